"""What each token-level method's update does to the gradient, on one frozen batch of the lab model.

    .venv/bin/python benchmarks/method_probes.py --out reports/method_probes            # every registered method
    .venv/bin/python benchmarks/method_probes.py --methods GRPO GRPO+Forking --puzzles 1  # a quick look

Samples one batch from the bundled lab model (``--puzzles`` training puzzles per people count at 2 and 3 people, 8
rollouts each at T = 1.0, the demo's rollout settings), then for every method applies its update to that same batch
from the same weights (``counterfactual.method_probes``: SGD at ``--lr``, one minibatch per stage, the gradient
probe on the real backward passes) and writes ``method_probes.csv`` (one row per method, binning, bin),
``method_probes.png`` (``plots_methods.method_probes``) and ``method_probes.md`` (the tables, the batch's size and
the wall time). The numbers in docs/methods.md come from this script's default run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from lopti_lab.counterfactual import frozen_batch, method_probes
from lopti_lab.kk import load_split
from lopti_lab.methods import METHODS
from lopti_lab.models import load_policy
from lopti_lab.plots_methods import method_probes as method_probes_figure
from lopti_lab.studies.config import DEMO_TRAIN
from lopti_lab.train_config import TrainConfig


def grid_markdown(grid) -> str:
    """A (method x bin) frame as a markdown table, 3 decimals, "-" where the bin has no token."""
    head = ["| method | " + " | ".join(map(str, grid.columns)) + " |", "|---" * (len(grid.columns) + 1) + "|"]
    cells = [[("-" if v != v else f"{v:.3f}") for v in row] for row in grid.to_numpy(float)]
    return "\n".join(head + [f"| {m} | " + " | ".join(c) + " |" for m, c in zip(grid.index, cells, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="reports/method_probes")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--puzzles", type=int, default=8, help="training puzzles per people count (2 and 3)")
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate of each method's update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = TrainConfig(**DEMO_TRAIN)
    model, tokenizer = load_policy(base.model, base.lora_spec())
    puzzles = [p for n in (2, 3) for p in load_split("train", n, limit=args.puzzles)]
    batch = frozen_batch(model, tokenizer, puzzles, base.group_size, max_new_tokens=base.max_new_tokens, seed=args.seed)
    sampled = time.perf_counter() - start
    rows = len(batch.rollout)
    base = TrainConfig(**{**DEMO_TRAIN, "prompts_per_step": len(puzzles), "minibatch_size": rows})
    table = method_probes(model, batch, {m: METHODS[m].overrides() for m in args.methods}, lr=args.lr, base=base)
    table.to_csv(out / "method_probes.csv", index=False)
    method_probes_figure(table).savefig(out / "method_probes.png", dpi=110)
    minutes = (time.perf_counter() - start) / 60
    n_tokens = int(batch.rollout.response_mask.sum())
    acting = int((batch.advantages != 0).sum())
    lines = [
        "# What each method's update does to the gradient (one frozen batch)",
        "",
        f"Command: `.venv/bin/python benchmarks/method_probes.py --out {args.out} --puzzles {args.puzzles} "
        f"--lr {args.lr:g} --seed {args.seed}`",
        "",
        f"Batch: {len(puzzles)} puzzles x {base.group_size} rollouts = {rows} rows, {n_tokens} response tokens, "
        f"{acting} rows with A != 0; SGD lr {args.lr:g}; sampling {sampled / 60:.1f} min, total {minutes:.1f} min.",
        "",
    ]
    for binning, part in table.groupby("binning", sort=False):
        for measure in ("token_share", "grad_share", "correct_ratio"):
            grid = part.pivot(index="method", columns="label", values=measure).reindex(args.methods)
            grid = grid[part.drop_duplicates("bin").sort_values("bin")["label"]]
            lines += [f"## {measure}, by {binning} bin", "", grid_markdown(grid), ""]
    (out / "method_probes.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
