"""Where does the mechanism operate? The top-bin correct ratio of GRPO and the fixes mapped on frozen batches over
the learning rate (SGD, AdamW), the batch size, the warm start and the model width (lopti_lab/studies/mechanism_map.py;
docs/_mechanism_map_section.md reads the result).

    OMP_NUM_THREADS=1 python benchmarks/mechanism_map.py --axes lr                     # the lab model, 10 settings
    OMP_NUM_THREADS=1 python benchmarks/mechanism_map.py --axes batch start width \\
        --start half=/tmp/half_run/checkpoints/step_15 --start w64=/tmp/widths/w64 ...

Resumable: a killed run continues from the last finished (setting, seed) when called again with the same --out.
Writes --out (one row per setting, seed and method), its table (map_summary.csv beside it) and the figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from lopti_lab.studies.mechanism_map import MAP_METHODS, Setting, lr_axis, map_table, plot_map, run_map, with_reference

FIXES3 = MAP_METHODS[:3]


def grid(axes, ref, widths, starts) -> list[Setting]:
    """The settings of the named axes: ``ref`` the (optimizer, lr) pairs the batch / start / width axes are
    measured at (the lab model's point of each comes from the lr axis)."""
    settings = []
    if "lr" in axes:
        settings += lr_axis("lab")
    if "batch" in axes:
        settings += [Setting("batch", "lab", o, lr, p, FIXES3) for o, lr in ref for p in (4,)]
    if "start" in axes:
        settings += [Setting("start", s, o, lr, 1, FIXES3) for s in starts for o, lr in ref]
    if "width" in axes:
        settings += [Setting("width", w, o, lr, 1, FIXES3) for w in widths for o, lr in ref]
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/mechanism/map.csv")
    parser.add_argument("--axes", nargs="+", default=["lr"], choices=["lr", "batch", "start", "width"])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--ref", nargs="+", default=["sgd:1e-3", "adamw:1e-4", "adamw:1e-3"], help="optimizer:lr pairs")
    parser.add_argument("--start", action="append", default=[], help="NAME=model or checkpoint folder")
    parser.add_argument("--widths", nargs="*", default=[], help="names among --start of the width axis")
    parser.add_argument("--starts", nargs="*", default=[], help="names among --start of the warm-start axis")
    parser.add_argument("--figure", default="docs/mechanism_map.png")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ref = [(o, float(lr)) for o, lr in (r.split(":") for r in args.ref)]
    starts = {"lab": "lab", "lab-hard": "lab-hard", **dict(s.split("=", 1) for s in args.start)}
    settings = grid(args.axes, ref, args.widths, args.starts)
    rows = run_map(settings, starts, args.out, args.seeds, log=lambda m: print(m, flush=True))
    table = map_table(with_reference(rows, ref))
    summary = Path(args.out).with_name(Path(args.out).stem + "_summary.csv")
    table.to_csv(summary, index=False, float_format="%.6g")
    plot_map(table).savefig(args.figure, dpi=110)
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(table[["axis", "start", "optimizer", "lr", "puzzles", "method", "n_seeds", "mean", "ci95", "n_ties",
                     "diff_mean", "diff_ci95", "solved"]].round(4).to_string())  # fmt: skip


if __name__ == "__main__":
    main()
