"""The README's first picture, from a recorded multi-seed study: GRPO's share of the response tokens against its share
of the gradient, per probability bin, in the hard lab (data/hard_lab/mechanism.csv: 5 seeds, measured every 10 of 60
steps; each row there is the mean over the seeds at one step).

    .venv/bin/python scripts/readme_figure.py      # writes docs/readme_gradient_share.png, prints the caption's numbers

tests/test_claims.py recomputes the README caption's numbers with ``shares``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from lopti_lab.bins import DEFAULT_BINS, bin_labels
from lopti_lab.paths import data_dir
from lopti_lab.studies.config import HardLabConfig

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "readme_gradient_share.png"
RECORD = "hard_lab/mechanism.csv"


def shares(method: str = "GRPO") -> pd.DataFrame:
    """Per probability bin: the mean token share and gradient share over the recorded steps (``token_share``,
    ``grad_share``) and their lowest and highest step means (``*_min``, ``*_max``), with the bin's label."""
    table = pd.read_csv(data_dir() / RECORD)
    rows = table[table["method"] == method]
    if rows.empty:
        raise ValueError(f"{RECORD} has no rows of {method!r}")
    out = rows.groupby("bin")[["token_share", "grad_share"]].agg(["mean", "min", "max"])
    out.columns = [a if b == "mean" else f"{a}_{b}" for a, b in out.columns]
    out["label"] = bin_labels(DEFAULT_BINS)[: len(out)]
    out["steps"] = rows.groupby("bin")["step"].nunique()
    return out.reset_index()


def figure(table: pd.DataFrame) -> Figure:
    fig = Figure(figsize=(7.2, 3.4), layout="constrained")
    ax = fig.subplots()
    x = range(len(table))
    for offset, (column, name, color) in enumerate(
        (("token_share", "share of the response tokens", "0.6"), ("grad_share", "share of the gradient", "C3"))
    ):
        xs = [i + (offset - 0.5) * 0.38 for i in x]
        low, high = table[column] - table[f"{column}_min"], table[f"{column}_max"] - table[column]
        ax.bar(xs, table[column], 0.38, color=color, label=name, yerr=[low, high], capsize=3, ecolor="0.3")
        for xi, value, top in zip(xs, table[column], table[f"{column}_max"], strict=True):
            ax.text(xi, top + 0.02, f"{value:.0%}", ha="center", fontsize="small")
    ax.set_xticks(list(x), [f"p in {label}" for label in table["label"]])
    ax.set_xlabel("probability of the sampled token under the old policy")
    ax.set_ylim(0, 1)
    ax.set_ylabel("share")
    ax.legend(loc="upper center", fontsize="small", frameon=False)
    steps, seeds = int(table["steps"].max()), HardLabConfig().seeds
    ax.set_title(f"GRPO, hard lab: {seeds} seeds, {steps} measured steps (bars: mean; whiskers: the steps' range)",
                 fontsize="medium")  # fmt: skip
    return fig


def main() -> int:
    table = shares()
    figure(table).savefig(OUT, dpi=110)
    low, top = table.iloc[0], table.iloc[-1]
    print(f"wrote {OUT.relative_to(ROOT)}: lowest bin {low['token_share']:.0%} of tokens, "
          f"{low['grad_share']:.0%} of the gradient; top bin {top['token_share']:.0%} of tokens, "
          f"{top['grad_share']:.0%} of the gradient")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
