"""Accuracy tables in the paper's layout and their statistics over seeds: one row per (model, seed), a column per
people count and their average; the spread over seeds (mean ± 95% interval, or one run's evaluation standard error),
each seed's gain over the warm start, and each method paired with GRPO at the same seed. ``studies.report`` writes
them into a report folder; the notebooks read them.

    frame = accuracy_table(config, run_dirs, warm, "sample")   # the final evaluation of every run
    paired_intervals(paired_per_seed(frame, ["3ppl", "avg"]))   # method - GRPO: mean, 95% interval, n seeds
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from lopti_lab import runs
from lopti_lab.paths import data_dir
from lopti_lab.studies.config import DemoConfig
from lopti_lab.studies.curves import GRPO_ROW, WARM, model_name
from lopti_lab.studies.stats import ci95

__all__ = ["accuracy_markdown", "accuracy_table", "by_seed", "compare_methods", "gains_markdown", "gains_per_seed",
           "paired_intervals", "paired_per_seed", "paired_vs_grpo", "recorded_comparison", "se_line",
           "spread_over_seeds"]  # fmt: skip


def by_seed(warm: dict) -> dict[int, dict]:
    """``warm`` as {seed: metrics}: `run_demo` passes one evaluation per seed; a plain metrics dict is seed 0's."""
    return warm if warm and all(isinstance(v, dict) for v in warm.values()) else {0: warm}


def accuracy_table(config: DemoConfig, run_dirs: dict, warm: dict, mode: str = "sample") -> pd.DataFrame:
    """The paper's layout: one row per (model, seed) (warm start under each seed's evaluation seed, + each method),
    one column per people count and avg, and beside each its evaluation standard error (``{n}ppl_se``, ``avg_se``:
    `evaluate.accuracy_se`; the avg's from the independent people counts, sqrt(sum se^2) / k)."""
    people = list(config.train.eval_people)
    models = [(WARM, seed, metrics) for seed, metrics in sorted(by_seed(warm).items())]
    models += [(model_name(m), seed, runs.load_metrics(d)[-1]) for (m, seed), d in run_dirs.items()]
    rows = []
    for model, seed, metrics in models:
        row = {"model": model, "seed": seed}
        for n in people:
            row[f"{n}ppl"] = metrics[f"eval/{mode}/acc_{n}ppl"]
            row[f"{n}ppl_se"] = metrics.get(f"eval/{mode}/acc_{n}ppl_se", math.nan)
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame["avg"] = frame[[f"{n}ppl" for n in people]].mean(axis=1)
    frame["avg_se"] = (frame[[f"{n}ppl_se" for n in people]] ** 2).sum(axis=1, min_count=len(people)) ** 0.5 / len(
        people
    )
    return frame


def spread_over_seeds(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(mean, 95% CI half-width) per model and column over the seeds of `accuracy_table`'s frame (for the warm start
    the spread of its evaluation alone); NaN where a model has one row. The ``_se`` columns' mean is one
    evaluation's SE."""
    grouped = frame.drop(columns="seed").groupby("model", sort=False)
    return grouped.mean(), grouped.agg(ci95)


def gains_per_seed(frame: pd.DataFrame, column: str = "avg") -> pd.DataFrame:
    """Each run's ``column`` minus the warm start's under the same evaluation seed (seed 0's where the warm start was
    evaluated once): one row per method, one column per seed, then mean and its 95% CI half-width."""
    warm = frame[frame["model"] == WARM].set_index("seed")[column]
    runs_only = frame[frame["model"] != WARM]
    table = runs_only.pivot(index="model", columns="seed", values=column).reindex(runs_only["model"].unique())
    table = table - pd.Series({seed: warm.get(seed, warm.iloc[0]) for seed in table.columns})
    table.columns = [f"seed {s}" for s in table.columns]
    seeds = list(table.columns)
    table["mean"] = table[seeds].mean(axis=1)
    table["ci95"] = table[seeds].apply(ci95, axis=1)
    return table


def paired_per_seed(frame: pd.DataFrame, columns: Sequence[str] = ("avg",)) -> pd.DataFrame:
    """Each method minus GRPO at the same seed (same puzzles in the same order, same sampling seed), for each of
    ``columns`` of `accuracy_table`'s frame: one row per (model, column, seed) with its ``diff``. Empty without GRPO."""
    rows = []
    order = [m for m in dict.fromkeys(frame["model"]) if m not in (WARM, GRPO_ROW)]
    for column in columns:
        wide = frame[frame["model"] != WARM].pivot(index="seed", columns="model", values=column)
        if GRPO_ROW not in wide.columns:
            continue
        for model in order:
            for seed, diff in (wide[model] - wide[GRPO_ROW]).dropna().items():
                rows.append({"model": model, "column": column, "seed": int(seed), "diff": float(diff)})
    return pd.DataFrame(rows, columns=["model", "column", "seed", "diff"])


def paired_vs_grpo(frame: pd.DataFrame, column: str = "avg") -> pd.DataFrame:
    """`paired_per_seed` of one column summarised, indexed by method: the mean difference to GRPO, its 95% CI
    half-width and the seeds where it was above / level / below. Empty without GRPO or with one seed."""
    diffs = paired_per_seed(frame, [column])
    if diffs.empty or diffs["seed"].nunique() < 2:
        return pd.DataFrame(columns=["mean", "ci95", "above", "level", "below"])
    return paired_intervals(diffs).set_index("model")[["mean", "ci95", "above", "level", "below"]]


def paired_intervals(diffs: pd.DataFrame) -> pd.DataFrame:
    """`paired_per_seed`'s rows summarised per (model, column): mean difference, 95% CI half-width (t over seeds), n,
    and how many seeds were above, level with and below GRPO (ties, |diff| <= 1e-12, reported apart, not counted
    either way)."""
    grouped = diffs.groupby(["model", "column"], sort=False)["diff"]
    return grouped.agg(
        mean="mean",
        ci95=ci95,
        n="count",
        above=lambda d: int((d > 1e-12).sum()),
        level=lambda d: int((d.abs() <= 1e-12).sum()),
        below=lambda d: int((d < -1e-12).sum()),
    ).reset_index()


def recorded_comparison(folder: str | Path = "reports/methods") -> tuple[pd.DataFrame, Path]:
    """(a study's sampled `accuracy_table` frame, where it was read): ``folder``'s accuracy_sample.csv when `lopti-lab
    demo --out folder` wrote one there, else the token-credit comparison recorded with lopti_lab
    (``data/methods/comparison_sample.csv``; docs/methods.md says how it was run)."""
    for file in (Path(folder) / "accuracy_sample.csv", data_dir() / "methods" / "comparison_sample.csv"):
        if file.is_file():
            return pd.read_csv(file), file
    raise FileNotFoundError(f"no accuracy_sample.csv in {folder} or comparison_sample.csv in {data_dir() / 'methods'}")


def accuracy_markdown(mean: pd.DataFrame, spread: pd.DataFrame | None) -> str:
    """Cells "mean ± spread" (``spread`` given: the 95% CI over seeds) or "accuracy ± its evaluation SE" (one seed)."""
    columns = [c for c in mean.columns if not c.endswith("_se")]
    if spread is None and all(f"{c}_se" in mean.columns for c in columns):
        spread = mean[[f"{c}_se" for c in columns]].rename(columns=lambda c: c.removesuffix("_se"))
    lines = [
        "| " + " | ".join(["K&K accuracy (people)", *[c.removesuffix("ppl") for c in columns]]) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for model, row in mean.iterrows():
        cells = []
        for c in columns:
            sd = None if spread is None or pd.isna(spread.loc[model, c]) else spread.loc[model, c]
            cells.append(f"{row[c]:.2f}" + ("" if sd is None else f" ± {sd:.2f}"))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def se_line(mean: pd.DataFrame, config: DemoConfig) -> str:
    """Below a table: what the ± means, and with several seeds the evaluation's own SE of one run."""
    if config.seeds == 1:
        return "\n± is the evaluation's standard error (test puzzles as the unit: `evaluate.accuracy_se`).\n"
    columns = [c for c in mean.columns if c.endswith("_se")]

    def cells(row) -> str:
        return ", ".join(f"{c.removesuffix('ppl_se').removesuffix('_se')} {row[c]:.3f}" for c in columns)

    runs_only = mean.drop(index=WARM, errors="ignore")
    text = (
        f"\n± is the 95% confidence interval of the mean over {config.seeds} seeds (t distribution, "
        f"{config.seeds - 1} degrees of freedom); the warm start is evaluated once per seed, with that seed's "
        f"sampling seed, so its ± is the evaluation's noise alone. One evaluation's own standard error (test "
        f"puzzles as the unit), averaged over the runs: {cells(runs_only.mean())}"
    )
    if WARM in mean.index and not mean.loc[WARM, columns].isna().all():
        text += f"; over the warm start's evaluations: {cells(mean.loc[WARM])}"
    return text + ".\n"


def gains_markdown(gains: pd.DataFrame) -> str:
    seeds = [c for c in gains.columns if c.startswith("seed")]
    lines = ["| method | " + " | ".join(seeds) + " | mean ± 95% CI |", "|---" * (len(seeds) + 2) + "|"]
    for model, row in gains.iterrows():
        ci = "" if pd.isna(row["ci95"]) else f" ± {100 * row['ci95']:.1f}"
        cells = [f"{100 * row[s]:+.1f}" for s in seeds]
        lines.append(f"| {model.removeprefix('+ ')} | " + " | ".join(cells) + f" | {100 * row['mean']:+.1f}{ci} |")
    return "\n".join(lines) + "\n"


def compare_methods(mean: pd.DataFrame, config: DemoConfig, paired: pd.DataFrame | None = None) -> list[str]:
    """Plain sentences: each method's average sampled accuracy against the warm start's and GRPO's; with several
    seeds, the difference to GRPO paired by seed with its 95% CI, and whether that interval excludes zero."""
    lines = []
    warm = mean.loc[WARM, "avg"]
    for model, row in mean.iterrows():
        if model == WARM:
            continue
        line = f"{model.removeprefix('+ ')}: avg {row['avg']:.3f} ({row['avg'] - warm:+.3f} over the warm start"
        if model != GRPO_ROW and GRPO_ROW in mean.index:
            line += f", {row['avg'] - mean.loc[GRPO_ROW, 'avg']:+.3f} over GRPO"
            if paired is not None and model in paired.index and not pd.isna(paired.loc[model, "ci95"]):
                p = paired.loc[model]
                lo, hi = p["mean"] - p["ci95"], p["mean"] + p["ci95"]
                verdict = "better than GRPO" if lo > 0 else "worse than GRPO" if hi < 0 else "not distinguishable"
                line += (
                    f"; paired by seed {p['mean']:+.3f} ± {p['ci95']:.3f}, {verdict}; seeds above / level with / "
                    f"below GRPO: {int(p['above'])} / {int(p['level'])} / {int(p['below'])}"
                )
        lines.append(line + ")")
    if config.seeds == 1:
        lines.append("One seed only: differences of a few points are within sampling noise (run --seeds 3).")
    return lines
