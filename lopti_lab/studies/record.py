"""A finished study's record as bundled with lopti_lab: its tables (the test curves, the mechanism over training,
the primary comparisons) and every run's recorded start and end, so that a reader can check each run against the
commit of its pre-registration without the run folders (each about 300 MB of checkpoints).

    bundle("reports/hard_lab_confirm", data_dir() / "hard_lab_confirm", methods, runs=30)  # tables, times.csv
    run_times("reports/hard_lab_confirm", methods)     # one row per run: run, model, seed, start, end, sessions, ...
    started_before(times, "2026-12-06T06:41:29Z")      # the runs whose first start is not after that moment

A run folder's ``times.json`` (``runs.RunFolder.mark``) holds its first start, its end (null until its last step),
each process's span (a killed process's has no end) and each process's last checkpoint time (``saved``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from lopti_lab.methods import slug
from lopti_lab.studies.curves import RECORDED, model_name

__all__ = ["BUNDLED", "TIME_COLUMNS", "bundle", "run_times", "started_before"]

BUNDLED = (*RECORDED, "primary")
"""The report's tables a bundle copies (each ``NAME.csv``), beside the ``times.csv`` it writes."""
TIME_COLUMNS = ["run", "model", "seed", "start", "end", "sessions", "open_sessions", "kept_h"]


def _kept_hours(times: dict) -> float:
    """Hours of the run's processes whose work was kept: each from its start to its end, or, for a killed one, to
    its last checkpoint (``saved``; none: nothing kept). NaN when a killed process has no checkpoint time because
    the folder predates them (``runs.RunFolder.mark``): unknown, not zero."""
    saved = times.get("saved")
    total = 0.0
    for i, (start, end) in enumerate(times.get("sessions", [])):
        if end is None and saved is None:
            return float("nan")
        stop = end if end is not None else saved[i] if i < len(saved) else None
        if stop is not None:
            total += (pd.Timestamp(stop) - pd.Timestamp(start)).total_seconds() / 3600
    return total


def _method_of(run: str, methods: Sequence[str]) -> tuple[str, int]:
    """("grpo_lopti-seed5", methods) -> ("GRPO+Lopti", 5); a folder no method names is a ValueError."""
    name, _, seed = run.rpartition("-seed")
    for method in methods:
        if slug(method) == name and seed.isdigit():
            return method, int(seed)
    raise ValueError(f"run folder {run!r} is none of {list(methods)} at a seed (expected METHOD-seedN)")


def run_times(report: str | Path, methods: Sequence[str]) -> pd.DataFrame:
    """Every run of the study in ``report`` (its ``runs/*/times.json``): the folder, the method's row name, the seed,
    the first start and the end (UTC timestamps; the end is NaT for an unfinished run), the number of processes
    that worked on it, how many of them were killed before writing their end, and the hours whose work was kept
    (``_kept_hours``)."""
    rows = []
    for path in sorted(Path(report, "runs").glob("*/times.json")):
        times = json.loads(path.read_text())
        method, seed = _method_of(path.parent.name, methods)
        sessions = times.get("sessions", [])
        rows.append({"run": path.parent.name, "model": model_name(method), "seed": seed,
                     "start": pd.Timestamp(times["start"]), "end": pd.Timestamp(times["end"]),
                     "sessions": len(sessions), "open_sessions": sum(end is None for _, end in sessions),
                     "kept_h": _kept_hours(times)})  # fmt: skip
    if not rows:
        raise FileNotFoundError(f"no run folder with a times.json in {Path(report, 'runs')}")
    return pd.DataFrame(rows, columns=TIME_COLUMNS)


def started_before(times: pd.DataFrame, moment: str | pd.Timestamp) -> pd.DataFrame:
    """The rows of ``run_times`` whose first start is at or before ``moment`` (a pre-registration's commit time)."""
    return times[pd.to_datetime(times["start"], utc=True) <= pd.Timestamp(moment)]


def bundle(report: str | Path, out: str | Path, methods: Sequence[str], runs: int) -> pd.DataFrame:
    """Copy a finished study's tables (``BUNDLED``) from ``report`` into ``out`` and write ``out/times.csv`` from its
    run folders; returns the times. Refused, naming the cause, when a table is missing, when the study has fewer
    than ``runs`` runs or one of them has no end (a record is of a finished study, or it is not made)."""
    report, out = Path(report), Path(out)
    missing = [f"{name}.csv" for name in BUNDLED if not (report / f"{name}.csv").is_file()]
    if missing:
        raise FileNotFoundError(f"{report} lacks {missing}: the study's report is written when its last run ends")
    times = run_times(report, methods)
    unfinished = times.loc[times["end"].isna(), "run"].tolist()
    if len(times) < runs or unfinished:
        raise ValueError(f"{report}: {len(times)} of {runs} runs, unfinished {unfinished}: not a finished study")
    out.mkdir(parents=True, exist_ok=True)
    for name in BUNDLED:
        shutil.copyfile(report / f"{name}.csv", out / f"{name}.csv")
    times.to_csv(out / "times.csv", index=False)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lopti_lab.studies.record [REPORT]``: bundle the finished confirmatory study (``ConfirmConfig``'s
    methods and seeds) from REPORT (its ``out``) into data/hard_lab_confirm/."""
    from lopti_lab.paths import data_dir
    from lopti_lab.studies.config import ConfirmConfig

    config = ConfirmConfig()
    report = Path(argv[0] if argv else config.out)
    times = bundle(report, data_dir() / "hard_lab_confirm", config.methods, len(config.methods) * config.seeds)
    print(f"bundled {len(times)} runs from {report}: first start {times['start'].min()}, last end {times['end'].max()}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
