"""A study's learning curves on the test split: every run's evaluations over training, with the warm start as step 0,
and the measures the paper reports from them (docs/paper.md §6): accuracy as the mean of the last 3 evaluations, the
area under the learning curve, and each method against GRPO paired by seed, at every evaluated step.

    curves = test_curves(run_dirs, warm, people=(2, 3, 4))     # one row per (model, seed, step)
    last_evaluations(curves, k=3)                              # accuracy_table's layout: one row per (model, seed)
    area_under_curve(curves)                                   # the same layout: mean accuracy over the run
    paired_over_steps(curves, ["3ppl", "avg"])                 # method - GRPO per step: mean, 95% interval, n

The rows use ``studies.tables``' model names ("Lab model (warm start)", "+ GRPO", "+ GRPO + AR", ...), so its paired
statistics (``paired_per_seed``, ``paired_intervals``) apply to these frames as they do to the final accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from lopti_lab import runs
from lopti_lab.paths import data_dir
from lopti_lab.studies.stats import ci95

__all__ = ["GRPO_ROW", "RECORDED", "WARM", "area_under_curve", "last_evaluations", "late_gain", "model_name",
           "paired_over_steps", "recorded_study", "seed_bands", "test_curves"]  # fmt: skip

WARM = "Lab model (warm start)"
GRPO_ROW = "+ GRPO"


def model_name(method: str) -> str:
    """A method's row name in the tables: "GRPO+AR" -> "+ GRPO + AR"."""
    return f"+ {method.replace('+', ' + ')}"


def _accuracy_row(metrics: Mapping, mode: str, people: Sequence[int]) -> dict[str, float]:
    row = {f"{n}ppl": float(metrics[f"eval/{mode}/acc_{n}ppl"]) for n in people}
    row["avg"] = float(np.mean(list(row.values())))
    return row


def test_curves(
    run_dirs: Mapping[tuple[str, int], str | Path],
    warm: Mapping[int, Mapping],
    people: Sequence[int],
    mode: str = "sample",
) -> pd.DataFrame:
    """Every test evaluation of every run: columns model, seed, step, ``{n}ppl`` per people count and avg (their
    mean). The warm start's evaluation under each seed's sampling seed (``warm[seed]``, as ``studies.run`` measures it)
    is the row at step 0 of that seed's runs, and also a model of its own (``WARM``). ``mode``: "sample" or
    "greedy"."""
    rows = []
    for seed, metrics in sorted(warm.items()):
        rows.append({"model": WARM, "seed": seed, "step": 0, **_accuracy_row(metrics, mode, people)})
    for (method, seed), folder in run_dirs.items():
        start = warm.get(seed)
        if start is not None:
            rows.append({"model": model_name(method), "seed": seed, "step": 0, **_accuracy_row(start, mode, people)})
        for record in runs.load_metrics(folder):
            if f"eval/{mode}/acc_{people[0]}ppl" in record:
                rows.append({"model": model_name(method), "seed": seed, "step": int(record["step"]),
                             **_accuracy_row(record, mode, people)})  # fmt: skip
    columns = ["model", "seed", "step", *[f"{n}ppl" for n in people], "avg"]
    return pd.DataFrame(rows, columns=columns)


def _columns(curves: pd.DataFrame) -> list[str]:
    return [c for c in curves.columns if c.endswith("ppl") or c == "avg"]


def last_evaluations(curves: pd.DataFrame, k: int = 3) -> pd.DataFrame:
    """The paper's accuracy (docs/paper.md §6): per (model, seed), the mean of its last ``k`` evaluations after the
    warm start (all of them where a run has fewer); the warm start's rows are its own evaluation. Columns model,
    seed, ``{n}ppl``..., avg, and ``evals`` (how many were averaged).

    Worked example, one run evaluated at steps 0 (warm start), 20, 40, 60, 80 with 3-person accuracy 0.4, 0.5, 0.6,
    0.7, 0.9 and k = 3: (0.6 + 0.7 + 0.9) / 3 = 0.733."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    columns = _columns(curves)
    rows = []
    for (model, seed), part in curves.groupby(["model", "seed"], sort=False):
        evals = part if model == WARM else part[part["step"] > 0]
        last = evals.sort_values("step").tail(k)
        rows.append({"model": model, "seed": seed, **last[columns].mean().to_dict(), "evals": len(last)})
    return pd.DataFrame(rows, columns=["model", "seed", *columns, "evals"])


def area_under_curve(curves: pd.DataFrame) -> pd.DataFrame:
    """Per (model, seed) of the runs: the area under its accuracy curve from step 0 (the warm start) to its last
    evaluation by the trapezoid rule, divided by that span: the run's mean accuracy over training, so a method that
    gets to the same accuracy sooner scores higher. Columns model, seed, ``{n}ppl``..., avg.

    Worked example: accuracy 0.4, 0.6, 0.6 at steps 0, 20, 60: (20 x 0.5 + 40 x 0.6) / 60 = 0.567."""
    columns = _columns(curves)
    rows = []
    for (model, seed), part in curves[curves["model"] != WARM].groupby(["model", "seed"], sort=False):
        part = part.sort_values("step")
        steps = part["step"].to_numpy(float)
        if len(steps) < 2 or steps[-1] <= steps[0]:
            raise ValueError(f"{model} seed {seed}: an area needs evaluations at two steps or more, got {steps}")
        row = {"model": model, "seed": seed}
        for column in columns:
            values = part[column].to_numpy(float)
            row[column] = float(np.sum((values[1:] + values[:-1]) / 2 * np.diff(steps)) / (steps[-1] - steps[0]))
        rows.append(row)
    return pd.DataFrame(rows, columns=["model", "seed", *columns])


def seed_bands(curves: pd.DataFrame, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """Per (model, column, step): the mean over seeds, its 95% interval half-width (t over seeds; NaN with one seed),
    the min and max over seeds and their count n. The warm start is left out (it is every run's step 0)."""
    columns = list(columns or _columns(curves))
    runs_only = curves[curves["model"] != WARM]
    long = runs_only.melt(id_vars=["model", "seed", "step"], value_vars=columns, var_name="column")
    grouped = long.groupby(["model", "column", "step"], sort=False)["value"]
    return grouped.agg(mean="mean", ci95=ci95, low="min", high="max", n="count").reset_index()


def paired_over_steps(curves: pd.DataFrame, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """Each method minus GRPO at the same seed and step, summarised over seeds per (model, column, step): mean, its
    95% interval half-width (t over the seeds) and n. Step 0 (both the warm start) is left out. Empty without GRPO."""
    columns = list(columns or _columns(curves))
    runs_only = curves[(curves["model"] != WARM) & (curves["step"] > 0)]
    grpo = runs_only[runs_only["model"] == GRPO_ROW].set_index(["seed", "step"])
    if grpo.empty:
        return pd.DataFrame(columns=["model", "column", "step", "mean", "ci95", "n"])
    rows = []
    for model, part in runs_only[runs_only["model"] != GRPO_ROW].groupby("model", sort=False):
        part = part.set_index(["seed", "step"])
        shared = part.index.intersection(grpo.index)
        for column in columns:
            diff = (part.loc[shared, column] - grpo.loc[shared, column]).reset_index()
            for step, cell in diff.groupby("step")[column]:
                rows.append({"model": model, "column": column, "step": int(step), "mean": float(cell.mean()),
                             "ci95": ci95(cell), "n": int(cell.count())})  # fmt: skip
    return pd.DataFrame(rows, columns=["model", "column", "step", "mean", "ci95", "n"])


def late_gain(curves: pd.DataFrame, share: float = 2 / 3) -> pd.DataFrame:
    """Per (model, seed) of the runs: accuracy at its last evaluation minus accuracy at the last evaluation at or
    before ``share`` of the run (share 2/3, evaluations every 10 of 60 steps: step 60 minus step 40), the gain over
    the run's last third: positive while a method is still learning, about 0 once it has saturated. Columns model,
    seed, from_step, to_step, ``{n}ppl``..., avg."""
    if not 0 <= share < 1:
        raise ValueError(f"share must be in [0, 1), got {share}")
    columns = _columns(curves)
    rows = []
    for (model, seed), part in curves[curves["model"] != WARM].groupby(["model", "seed"], sort=False):
        part = part.sort_values("step").set_index("step")
        last = part.index[-1]
        start = part.index[part.index <= share * last][-1]
        rows.append({"model": model, "seed": seed, "from_step": int(start), "to_step": int(last),
                     **(part.loc[last, columns] - part.loc[start, columns]).to_dict()})  # fmt: skip
    return pd.DataFrame(rows, columns=["model", "seed", "from_step", "to_step", *columns])


RECORDED = ("curves_sample", "curves_greedy", "mechanism")
"""The hard lab study's tables bundled with lopti_lab (data/hard_lab/), what ``recorded_study`` reads."""


def recorded_study(
    folder: str | Path = "reports/hard_lab", bundled: str = "hard_lab"
) -> tuple[dict[str, pd.DataFrame], Path]:
    """A study's tables ({name: frame} for ``RECORDED``: its test curves per mode and its mechanism over training)
    and the folder they were read from: ``folder`` when the study's command wrote them there (`lopti-lab hardlab`,
    `lopti-lab confirm --out folder`), else the study recorded with lopti_lab (``data/{bundled}/``: "hard_lab" or
    "hard_lab_confirm"; docs/hard_lab.md says how each was run)."""
    for place in (Path(folder), data_dir() / bundled):
        if all((place / f"{name}.csv").is_file() for name in RECORDED):
            return {name: pd.read_csv(place / f"{name}.csv") for name in RECORDED}, place
    raise FileNotFoundError(f"no {', '.join(RECORDED)} .csv in {folder} or {data_dir() / bundled}")
