"""The token-level methods side by side: where each method's update puts the gradient, by probability bin and by
entropy bin, and how many A > 0 tokens it moves the right way (``counterfactual.method_probes``'s table), and how
each method's accuracy differs from GRPO's, seed by seed (``studies.tables.paired_per_seed``).

One heatmap per (binning, measure): a row per method in the table's order, a column per bin, the value in each cell
(a reader compares rows, so the numbers are printed, not only coloured). Built on ``matplotlib.figure.Figure`` like
``plots``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["method_probes", "paired_differences", "study_curves"]

MEASURES = {"grad_share": "gradient share", "correct_ratio": "correct ratio (A > 0)"}
BINNINGS = {"probability": "rollout probability bin", "entropy": "entropy quartile of the batch"}


def method_probes(table: pd.DataFrame) -> Figure:
    """2 x 2 heatmaps: rows of panels are the binnings (probability, entropy), columns the measures (the bin's share
    of the update's gradient; the share of its A > 0 tokens whose probability rose). Empty cells: no token there."""
    missing = {"method", "binning", "bin", "label", *MEASURES} - set(table.columns)
    if missing:
        raise ValueError(f"method_probes needs the columns {sorted(missing)} (counterfactual.method_probes)")
    methods = list(dict.fromkeys(table["method"]))
    binnings = [b for b in BINNINGS if b in set(table["binning"])]
    fig = Figure(figsize=(11, 0.9 + 0.42 * len(methods) * len(binnings)), layout="constrained")
    axes = fig.subplots(len(binnings), len(MEASURES), squeeze=False)
    for row, binning in enumerate(binnings):
        part = table[table["binning"] == binning]
        labels = part.drop_duplicates("bin").sort_values("bin")["label"].tolist()
        for col, (measure, title) in enumerate(MEASURES.items()):
            grid = part.pivot(index="method", columns="bin", values=measure).reindex(methods).to_numpy(float)
            ax = axes[row, col]
            image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            for (i, j), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8,
                            color="white" if value < 0.6 else "black")  # fmt: skip
            ax.set_xticks(range(len(labels)), labels, fontsize=8)
            ax.set_yticks(range(len(methods)), methods if col == 0 else [""] * len(methods), fontsize=8)
            ax.set_title(f"{title}, by {BINNINGS[binning]}", fontsize=9)
            fig.colorbar(image, ax=ax, shrink=0.8)
    return fig


def paired_differences(diffs: pd.DataFrame, intervals: pd.DataFrame) -> Figure:
    """A forest plot per column of the accuracy table (each people count, their average): a row per method, its
    difference to GRPO at each seed (dots), their mean and 95% interval (bar); the line at 0 is GRPO. ``diffs``:
    ``studies.tables.paired_per_seed``'s rows; ``intervals``: ``studies.tables.paired_intervals`` of them."""
    missing = {"model", "column", "seed", "diff"} - set(diffs.columns)
    missing |= {"model", "column", "mean", "ci95"} - set(intervals.columns)
    if missing or diffs.empty:
        raise ValueError(f"paired_differences needs rows with the columns {sorted(missing) or 'of paired_per_seed'}")
    models = list(dict.fromkeys(diffs["model"]))
    columns = list(dict.fromkeys(diffs["column"]))
    fig = Figure(figsize=(3.6 * len(columns) + 1.6, 0.8 + 0.36 * len(models)), layout="constrained")
    axes = fig.subplots(1, len(columns), squeeze=False, sharey=True)[0]
    y = {m: len(models) - 1 - i for i, m in enumerate(models)}
    for ax, column in zip(axes, columns, strict=True):
        part = diffs[diffs["column"] == column]
        ax.axvline(0.0, color="0.3", lw=1)
        ax.scatter(part["diff"], part["model"].map(y), s=14, color="0.55", zorder=2, label="one seed")
        summary = intervals[intervals["column"] == column]
        ci = summary["ci95"].fillna(0.0)
        ax.errorbar(summary["mean"], summary["model"].map(y), xerr=ci, fmt="o", color="C0", ms=5, capsize=3,
                    zorder=3, label="mean, 95% interval")  # fmt: skip
        title = f"{column[:-3]} people" if column.endswith("ppl") else column
        ax.set_title(f"{title}: method - GRPO", fontsize=9)
        ax.set_xlabel("accuracy difference, paired by seed", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(list(y.values()), [m.removeprefix("+ ") for m in y], fontsize=8)
    axes[-1].legend(fontsize=7, loc="lower right")
    return fig


def _title(column: str) -> str:
    return f"{column[:-3]} people" if column.endswith("ppl") else "average over people counts"


def study_curves(bands: pd.DataFrame, paired: pd.DataFrame | None = None, ylabel: str = "test accuracy") -> Figure:
    """A study's learning curves, one column of panels per people count (and their average). Top row: each method's
    test accuracy over the RL steps, the mean over seeds with its 95% interval as a band (the min-max over seeds
    where there is one seed). Bottom row (with ``paired``): each method minus GRPO at the same seed, per evaluated
    step, the mean and its 95% interval band; the line at 0 is GRPO. ``bands``: ``studies.curves.seed_bands``;
    ``paired``: ``studies.curves.paired_over_steps``."""
    missing = {"model", "column", "step", "mean", "ci95", "low", "high"} - set(bands.columns)
    if missing or bands.empty:
        raise ValueError(f"study_curves needs studies.curves.seed_bands rows (missing columns: {sorted(missing)})")
    columns = list(dict.fromkeys(bands["column"]))
    models = list(dict.fromkeys(bands["model"]))
    rows = 2 if paired is not None and not paired.empty else 1
    fig = Figure(figsize=(3.4 * len(columns) + 0.6, 3.0 * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, len(columns), squeeze=False, sharex=True)
    for j, column in enumerate(columns):
        ax = axes[0, j]
        for i, model in enumerate(models):
            cell = bands[(bands["model"] == model) & (bands["column"] == column)].sort_values("step")
            has_ci = cell["ci95"].notna()
            low = np.clip(np.where(has_ci, cell["mean"] - cell["ci95"], cell["low"]), 0.0, 1.0)  # an accuracy
            high = np.clip(np.where(has_ci, cell["mean"] + cell["ci95"], cell["high"]), 0.0, 1.0)
            ax.plot(cell["step"], cell["mean"], marker="o", ms=3, color=f"C{i}", label=model.removeprefix("+ "))
            ax.fill_between(cell["step"], low, high, color=f"C{i}", alpha=0.15, lw=0)
        ax.set_title(_title(column), fontsize=9)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if j == 0:
            ax.set_ylabel(f"{ylabel}\n(mean, 95% interval over seeds)", fontsize=8)
        if rows == 2:
            ax = axes[1, j]
            ax.axhline(0.0, color="C0", lw=1.2)
            for i, model in enumerate(models):
                cell = paired[(paired["model"] == model) & (paired["column"] == column)].sort_values("step")
                if cell.empty:
                    continue
                ci = cell["ci95"].fillna(0.0)
                low, high = np.clip(cell["mean"] - ci, -1.0, 1.0), np.clip(cell["mean"] + ci, -1.0, 1.0)
                ax.plot(cell["step"], cell["mean"], marker="o", ms=3, color=f"C{i}")
                ax.fill_between(cell["step"], low, high, color=f"C{i}", alpha=0.15, lw=0)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("method - GRPO, paired by seed\n(mean, 95% interval)", fontsize=8)
        axes[-1, j].set_xlabel("RL step")
    axes[0, 0].legend(fontsize=7)
    return fig
