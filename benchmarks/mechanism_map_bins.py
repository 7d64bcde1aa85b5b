"""Side check of the mechanism map (docs/mechanism.md, "Where does the mechanism operate?"): GRPO's correct ratio in
every probability bin (A > 0 tokens, among those that moved, float64) at the cells where the top bin fell below 0.5.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mechanism_map_bins.py --w128 <a width-128 warm start folder>
                                                        # writes data/mechanism/map_bins.csv (about a CPU minute)

The width-128 warm start is made by the map's ``lopti-lab pretrain`` command (docs/mechanism.md); without
``--w128`` its rows are left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from lopti_lab.counterfactual import counterfactual, frozen_batch
from lopti_lab.studies.mechanism_map import batch_puzzles, load_start
from lopti_lab.update import OptimizerSpec

CELLS = [("lab", "lab", "adamw", 1e-3), ("lab", "lab", "sgd", 1e-3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--w128", help="folder of the width-128 warm start")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data/mechanism/map_bins.csv"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cells = CELLS + ([("w128", args.w128, "adamw", 1e-4)] if args.w128 else [])
    rows = []
    for start, spec, optimizer, lr in cells:
        model, tokenizer = load_start(spec)
        for seed in range(args.seeds):
            batch = frozen_batch(model, tokenizer, batch_puzzles(1, seed), 8, max_new_tokens=640, seed=seed)
            moved = counterfactual(model, batch, {"GRPO": {}}, lr=lr, optimizer=optimizer,
                                   adamw=OptimizerSpec(adam_eps=1e-8))  # fmt: skip
            positive = moved.bins[moved.bins["sign"] == "pos"]
            rows += [{"start": start, "optimizer": optimizer, "lr": lr, "seed": seed, "bin": r.bin,
                      "n": r.n_tokens, "ratio": r.correct_ratio} for r in positive.itertuples()]  # fmt: skip
    table = pd.DataFrame(rows)
    table.to_csv(args.out, index=False)
    print(table.groupby(["start", "optimizer", "lr", "bin"])["ratio"].mean().unstack().round(3))


if __name__ == "__main__":
    main()
