"""The confirmatory study's primary analysis, fixed before its first run (docs/hard_lab.md, "Confirmatory study:
pre-registration"): three paired comparisons with GRPO, Holm's correction over them, and the power each had.

    curves = pd.read_csv("reports/hard_lab_confirm/curves_sample.csv")      # model, seed, step, 2ppl, 3ppl, avg
    primary_table(curves)            # one row per comparison: mean, 95% interval, p, Holm's p, seeds, detectable
    power_table()                    # the pre-registration's: detectable effect by paired SD and seeds

Each run's measure is the mean of its sampled accuracy at steps 40, 50 and 60 (100 puzzles x 8 samples each); each
comparison is that measure's per-seed difference, the method minus GRPO at the same seed, tested against 0 by a
two-sided paired t-test (``stats.paired_t``), and the three p-values are Holm-corrected (``stats.holm``) at a
family-wise 0.05. The detectable effect is the smallest true mean difference found with 80% power at Holm's most
stringent level (0.05 / 3), from the observed paired SD and from the exploratory study's (``PRIOR_SD``).
In the exploratory study's own records (5 seeds) this analysis gives: AR - GRPO at 3 people -5.4 ± 5.1 points, p
0.041, Holm's p 0.108; Lopti - GRPO at 2 people +6.8 ± 6.1, p 0.036, Holm's p 0.108 (tests/test_confirm_stats.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from lopti_lab.studies.config import CONFIRM_PRIMARY, CONFIRM_TRAIN
from lopti_lab.studies.curves import GRPO_ROW, WARM, area_under_curve, model_name
from lopti_lab.studies.stats import detectable_effect, holm, paired_t

__all__ = [
    "ALPHA",
    "POWER",
    "PRIMARY_COMPARISONS",
    "PRIMARY_STEPS",
    "PRIOR_SD",
    "last_mean",
    "pooled_paired_sd",
    "power_table",
    "primary_markdown",
    "primary_table",
    "secondary_markdown",
    "secondary_table",
]

PRIMARY_COMPARISONS = CONFIRM_PRIMARY
"""(method, people column), each against GRPO (``studies.config.CONFIRM_PRIMARY``)."""
PRIMARY_STEPS = CONFIRM_TRAIN["eval_full_steps"]
"""The evaluations averaged into a run's measure: the full ones, steps 40, 50 and 60 (100 puzzles x 8 samples)."""
ALPHA = 0.05
"""The family-wise level of the three primary comparisons (Holm)."""
POWER = 0.8
PRIOR_SD = {"3ppl": 0.046, "2ppl": 0.056}
"""The exploratory study's pooled SD of a method's paired last-3 difference to GRPO, per people count (3 methods x 5
seeds, 30 puzzles x 2 samples per evaluation; ``pooled_paired_sd`` on data/hard_lab/curves_sample.csv, rounded)."""


def last_mean(curves: pd.DataFrame, steps: Sequence[int] = PRIMARY_STEPS) -> pd.DataFrame:
    """Per (model, seed) of the runs, the mean of each accuracy column over ``steps``; a run that lacks one of them
    is a ValueError naming it (the measure is fixed: it is never averaged over fewer or other steps)."""
    runs = curves[curves["model"] != WARM]
    columns = [c for c in curves.columns if c.endswith("ppl") or c == "avg"]
    rows = []
    for (model, seed), part in runs.groupby(["model", "seed"], sort=False):
        chosen = part[part["step"].isin(steps)]
        missing = sorted(set(steps) - set(chosen["step"]))
        if missing or len(chosen) != len(steps):
            raise ValueError(f"{model} seed {seed}: the evaluations at steps {list(steps)} are needed once each; "
                             f"missing {missing}, found steps {sorted(chosen['step'])}")  # fmt: skip
        rows.append({"model": model, "seed": int(seed), **chosen[columns].mean().to_dict()})
    return pd.DataFrame(rows, columns=["model", "seed", *columns])


def _paired(measure: pd.DataFrame, method: str, column: str) -> pd.Series:
    """The method's ``column`` minus GRPO's, per seed; a seed that one of the two lacks is a ValueError."""
    wide = measure.pivot(index="seed", columns="model", values=column)
    row = model_name(method)
    for name in (row, GRPO_ROW):
        if name not in wide.columns:
            raise ValueError(f"no runs of {name.removeprefix('+ ')} in the curves")
    unpaired = wide.index[wide[row].isna() ^ wide[GRPO_ROW].isna()].tolist()
    if unpaired:
        raise ValueError(f"{method} vs GRPO: seeds {unpaired} have one run of the pair only")
    return (wide[row] - wide[GRPO_ROW]).dropna()


def primary_table(
    curves: pd.DataFrame,
    comparisons: Sequence[tuple[str, str]] = PRIMARY_COMPARISONS,
    steps: Sequence[int] = PRIMARY_STEPS,
    prior_sd: dict[str, float] = PRIOR_SD,
) -> pd.DataFrame:
    """One row per comparison: method, column, n seeds, mean difference with its 95% interval (low, high, half),
    sd, t, p (two-sided paired t), p_holm and holm_reject (at ALPHA over the comparisons), seeds above / level /
    below GRPO, and the effect detectable with POWER at ALPHA / m (Holm's most stringent step): ``detectable`` from
    the observed SD, ``detectable_prior`` from ``prior_sd`` (the exploratory study's, per column)."""
    measure = last_mean(curves, steps)
    rows = []
    for method, column in comparisons:
        diffs = _paired(measure, method, column)
        rows.append({"method": method, "column": column, **paired_t(diffs)})
    table = pd.DataFrame(rows)
    m = len(table)
    table["p_holm"] = holm(table["p"])
    table["holm_reject"] = table["p_holm"] <= ALPHA
    level = ALPHA / m
    observed = zip(table["sd"], table["n"], strict=True)
    table["detectable"] = [detectable_effect(sd, n, level, POWER) if sd > 0 else math.nan for sd, n in observed]
    table["detectable_prior"] = [
        detectable_effect(prior_sd[c], n, level, POWER) for c, n in zip(table["column"], table["n"], strict=True)
    ]
    return table


def primary_markdown(table: pd.DataFrame) -> str:
    """``primary_table`` as the report's table, in points (x 100): each comparison's mean ± 95% interval, p and
    Holm's p, seeds above / level / below, and the effect it could detect."""
    lines = [
        "| comparison | people | mean ± 95% interval (points) | p | Holm p | above / level / below | detectable at 80% "
        "(observed SD; exploratory SD) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        verdict = "**separates**" if r.holm_reject else "does not separate"
        lines.append(
            f"| {r.method.replace('+', ' + ')} - GRPO | {r.column.removesuffix('ppl')} | {100 * r.mean:+.1f} ± "
            f"{100 * r.half:.1f} ({verdict}) | {r.p:.3f} | {r.p_holm:.3f} | {r.above} / {r.level} / {r.below} | "
            f"{100 * r.detectable:.1f}; {100 * r.detectable_prior:.1f} |"
        )
    return "\n".join(lines) + "\n"


SECONDARY = ("GRPO+AR", "GRPO+Lopti")
"""The methods the secondary measures pair with GRPO (each at 2 and 3 people and their average)."""


def secondary_table(sample: pd.DataFrame, greedy: pd.DataFrame, steps: Sequence[int] = PRIMARY_STEPS) -> pd.DataFrame:
    """The pre-registration's secondary measures, none corrected, each a paired difference to GRPO over seeds
    (``stats.paired_t``): the primary measure (the mean over ``steps``) sampled and greedy, the area under the
    sampled curve (``curves.area_under_curve``: the mean accuracy over training) and the gain from the first of
    ``steps`` to the last. One row per (measure, method, column); the three primary rows are left out."""
    measures = {
        "sampled, mean of steps " + ", ".join(map(str, steps)): last_mean(sample, steps),
        "greedy, mean of steps " + ", ".join(map(str, steps)): last_mean(greedy, steps),
        "sampled, area under the curve": area_under_curve(sample),
        f"sampled, gain from step {steps[0]} to {steps[-1]}": _gain(sample, steps[0], steps[-1]),
    }
    primary = set(PRIMARY_COMPARISONS)
    rows = []
    for k, (name, measure) in enumerate(measures.items()):
        for method in SECONDARY:
            for column in ("2ppl", "3ppl", "avg"):
                if k == 0 and (method, column) in primary:
                    continue
                rows.append({"measure": name, "method": method, "column": column,
                             **paired_t(_paired(measure, method, column))})  # fmt: skip
    return pd.DataFrame(rows)


def _gain(curves: pd.DataFrame, first: int, last: int) -> pd.DataFrame:
    """Per (model, seed) of the runs, each accuracy column at step ``last`` minus at step ``first``."""
    runs = curves[curves["model"] != WARM].set_index(["model", "seed", "step"])
    columns = [c for c in runs.columns if c.endswith("ppl") or c == "avg"]
    diff = runs.xs(last, level="step")[columns] - runs.xs(first, level="step")[columns]
    return diff.reset_index()


def secondary_markdown(table: pd.DataFrame) -> str:
    """``secondary_table`` in points: per measure and method, the paired difference at 2 and 3 people and their
    average (mean ± 95% interval, seeds above / level / below)."""
    lines = [
        "| secondary measure (uncorrected) | method - GRPO | 2 people | 3 people | average |",
        "|---|---|---|---|---|",
    ]
    for (measure, method), rows in table.groupby(["measure", "method"], sort=False):
        cells = {r.column: f"{100 * r.mean:+.1f} ± {100 * r.half:.1f} ({r.above} / {r.level} / {r.below})"
                 for r in rows.itertuples()}  # fmt: skip
        row = [cells.get(c, "primary, above") for c in ("2ppl", "3ppl", "avg")]
        lines.append(f"| {measure} | {method.replace('+', ' + ')} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def pooled_paired_sd(curves: pd.DataFrame, column: str, steps: Sequence[int] = PRIMARY_STEPS) -> float:
    """The SD of a method's paired last-``steps`` difference to GRPO, pooled over every other method in
    ``curves`` (the square root of the mean of their variances, each on n - 1 degrees of freedom; the same seeds
    for each)."""
    measure = last_mean(curves, steps)
    others = [m for m in dict.fromkeys(measure["model"]) if m != GRPO_ROW]
    variances, dof = 0.0, 0
    for row in others:
        diffs = _paired(measure, row.removeprefix("+ ").replace(" + ", "+"), column)
        variances += float(diffs.var(ddof=1)) * (len(diffs) - 1)
        dof += len(diffs) - 1
    return math.sqrt(variances / dof)


def power_table(
    sds: Sequence[float] = (0.046, 0.035, 0.025), seeds: Sequence[int] = (5, 10), comparisons: int = 3
) -> pd.DataFrame:
    """The smallest true paired difference found with POWER, per paired SD and number of seeds: at ALPHA two-sided
    (one comparison) and at ALPHA / ``comparisons`` (Holm's most stringent step). Columns sd, seeds,
    detectable_one, detectable_holm."""
    rows = [
        {"sd": sd, "seeds": n, "detectable_one": detectable_effect(sd, n, ALPHA, POWER),
         "detectable_holm": detectable_effect(sd, n, ALPHA / comparisons, POWER)}
        for sd in sds for n in seeds
    ]  # fmt: skip
    return pd.DataFrame(rows)
