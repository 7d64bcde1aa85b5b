"""The token-level methods side by side: where each method's update puts the gradient, by probability bin and by
entropy bin, and how many A > 0 tokens it moves the right way (``counterfactual.method_probes``'s table).

One heatmap per (binning, measure): a row per method in the table's order, a column per bin, the value in each cell
(a reader compares rows, so the numbers are printed, not only coloured). Built on ``matplotlib.figure.Figure`` like
``plots``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["method_probes"]

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
