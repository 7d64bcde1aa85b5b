"""The one source of the run times and settings that the README, the notebooks and docs quote: docs/numbers.md and
docs/numbers.json, generated from recorded files and from the code's own configs.

    .venv/bin/python scripts/number_table.py            # write docs/numbers.md and docs/numbers.json
    .venv/bin/python scripts/number_table.py --check    # exit 1 if they are stale or a page quotes a number wrongly
    .venv/bin/python scripts/number_table.py --time demo -- lopti-lab demo --threads 2
                                                        # run a command, record its times in benchmarks/records/

Where the numbers come from:
- a notebook's run time: ``notebooks/build_record.json``, written by ``scripts/build_notebooks.py`` as it executes
  the committed notebooks (wall seconds, date, cores, threads, torch);
- a command's run time: ``benchmarks/records/NAME.json``, written by ``--time NAME -- CMD`` (wall seconds, the
  command's CPU seconds and peak memory, the load average around it, date, machine, commit);
- a study's settings: its config in ``lopti_lab.studies`` (``studies.settings``), notebook 04's
  ``notebook.training_defaults`` and ``gpu_defaults``, ``TrainConfig``'s defaults; the paper's from its text
  (docs/paper.md). The table of docs/settings.md is written between its two markers from the same rows.

A page quotes a number with a marker right after it, an HTML comment that renders as nothing: ``95 s<!--#nb.02-->``.
``mismatches`` finds every marker in a text and checks the number just before it against the table at the precision
it is printed (95 for 95.3 s; 1.6 min for 95.3 s would need the key's minutes: ``nb.02.min``). tests/test_numbers.py
runs it on the README, docs/ and notebooks/src, and requires every run time in the README to carry a marker.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_RECORD = ROOT / "notebooks" / "build_record.json"
RECORDS = ROOT / "benchmarks" / "records"
PAGE, TABLE = ROOT / "docs" / "numbers.md", ROOT / "docs" / "numbers.json"
MARKER = re.compile(r"(?P<number>[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)[^\d<]{0,12}?<!--#(?P<key>[\w.+-]+)-->")
"""A number, up to 12 characters of unit or emphasis (`` s``, ``** minutes``), and its marker."""


@dataclass(frozen=True)
class Number:
    key: str
    value: float
    what: str
    source: str  # the file it was read from, or the config that defines it


def notebook_times(record: Path = BUILD_RECORD) -> list[Number]:
    """Each built notebook's wall time, in seconds (``nb.02``) and minutes (``nb.02.min``)."""
    if not record.exists():
        return []
    out = []
    for name, entry in sorted(json.loads(record.read_text()).items()):
        if entry.get("quick"):
            continue  # a QUICK build's time is not the notebook's
        where = f"{entry['date']}, {entry['cpu_count']} cores, {entry['threads']} threads, torch {entry['torch']}"
        if "load_at_end" in entry:
            where += f", load average {entry['load_at_end'][1]:g} over the last 5 min"
        what = f"notebook {name}, executed in full by `scripts/build_notebooks.py` ({where})"
        key = f"nb.{name[:2]}"
        out += [Number(key, entry["wall_s"], what + ", s", _rel(record)),
                Number(key + ".min", entry["wall_s"] / 60, what + ", min", _rel(record))]  # fmt: skip
    return out


def command_times(folder: Path = RECORDS) -> list[Number]:
    """Each recorded command's wall and CPU time (``time.NAME`` in s, ``.min`` in minutes, ``.cpu_min``) and its peak
    resident memory (``.peak_mib``)."""
    out = []
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        key, where = f"time.{path.stem}", f"{r['date']}, {r['cpu_count']} cores, load {r['load_before']:.1f}"
        what = f"`{r['command']}` ({where})"
        out += [
            Number(key, r["wall_s"], what + ", wall s", _rel(path)),
            Number(key + ".min", r["wall_s"] / 60, what + ", wall min", _rel(path)),
            Number(key + ".cpu_min", r["cpu_s"] / 60, what + ", CPU min", _rel(path)),
            Number(key + ".peak_mib", r["peak_mib"], what + ", peak resident MiB of one process", _rel(path)),
        ]
    return out


def record_command(name: str, command: list[str], folder: Path = RECORDS) -> dict:
    """Run ``command``, and write its wall and CPU seconds, peak memory and context to ``folder/name.json``."""
    load_before = os.getloadavg()[0]
    start, wall = datetime.now(UTC), time.perf_counter()
    done = subprocess.run(command, check=False)
    wall = time.perf_counter() - wall
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"numbers: `{' '.join(command)}` exited {done.returncode}; nothing recorded")
    record = {
        "command": " ".join(command), "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_mib": round(usage.ru_maxrss / 1024), "date": start.strftime("%Y-%m-%d"), "start": start.isoformat(),
        "load_before": load_before, "load_after": os.getloadavg()[0], "cpu_count": os.cpu_count(),
        "machine": platform.platform(), "commit": _commit(),
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def settings_rows() -> list[dict]:
    """Every study's settings (``studies.settings``), notebook 04's default runs, ``lopti-lab train``'s defaults and
    the paper's."""
    from lopti_lab import notebook, plan
    from lopti_lab.studies.settings import PAPER_SETTINGS, study_rows, train_row
    from lopti_lab.train_config import TrainConfig

    env = notebook.Environment(in_colab=False, device="cpu", model="lab", lora_r=None,
                               prompt_style="chat_quiz_numfirst_bare", quick=False)  # fmt: skip
    _, gpu, _ = notebook.gpu_defaults(plan.GPUS["h100"])
    return [
        *study_rows(),
        train_row("nb04", "notebook 04's Run, lab model on a CPU", "notebook 04",
                  "`notebook.training_defaults` (the demo's, evaluated every 5 steps)", notebook.training_defaults(env),
                  "GRPO x 1 seed"),
        train_row("nb04.gpu", "notebook 04's Run on a GPU (H100)", "notebook 04", "`notebook.gpu_defaults`", gpu,
                  "GRPO x 1 seed"),
        train_row("train", "`lopti-lab train` with no options", "`lopti-lab train`", "`TrainConfig` defaults",
                  TrainConfig(), "1 run"),
        PAPER_SETTINGS,
    ]  # fmt: skip


SETTINGS_PAGE = ROOT / "docs" / "settings.md"
SETTINGS_BEGIN, SETTINGS_END = "<!-- settings table: scripts/number_table.py -->", "<!-- end of settings table -->"


def settings_page(text: str) -> str:
    """docs/settings.md's text with the table between its two markers rewritten from ``settings_rows``."""
    from lopti_lab.studies.settings import settings_markdown

    return between_markers(text, SETTINGS_BEGIN, SETTINGS_END, f"{settings_markdown(settings_rows())}\n")


def between_markers(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with what lies between its ``begin`` and ``end`` markers replaced by a new line and ``body``."""
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def settings_numbers() -> list[Number]:
    """Every study's settings as numbers (``set.STUDY.FIELD``), from ``settings_rows``."""
    out = []
    for row in settings_rows():
        for field, value in row["numbers"].items():
            out.append(Number(f"set.{row['key']}.{field}", value, f"{row['study']}: {field}", row["source"]))
    return out


CONFIRM = ROOT / "data" / "hard_lab_confirm"
HARD_LAB_PAGE = ROOT / "docs" / "hard_lab.md"
CONFIRM_BEGIN, CONFIRM_END = (
    "<!-- confirmatory table: scripts/number_table.py -->",
    "<!-- end of confirmatory table -->",
)


def confirm_primary(folder: Path | None = None):
    """The confirmatory study's primary table (``studies.primary.primary_table``) recomputed from its bundled sampled
    curves, or None before the study is bundled (``python -m lopti_lab.studies.record``)."""
    import pandas as pd

    from lopti_lab.studies.primary import primary_table

    curves = (folder or CONFIRM) / "curves_sample.csv"
    return primary_table(pd.read_csv(curves)) if curves.exists() else None


def confirm_numbers(folder: Path | None = None) -> list[Number]:
    """The confirmatory study's numbers: per primary comparison (``confirm.lopti.3ppl.mean`` ...) its mean, interval
    half-width, detectable effect (points) and p and Holm's p; the study's span in hours from its first run's start
    to its last run's end (``times.csv``) and its peak memory in GB (``memory.json``)."""
    import pandas as pd

    folder = folder or CONFIRM
    table = confirm_primary(folder)
    if table is None:
        return []
    source = _rel(folder / "curves_sample.csv")
    out = []
    for r in table.itertuples():
        key = f"confirm.{r.method.removeprefix('GRPO+').lower()}.{r.column}"
        what = f"{r.method} - GRPO at {r.column[0]} people"
        for field, scale in (("mean", 100), ("half", 100), ("detectable", 100), ("p", 1), ("p_holm", 1)):
            out.append(Number(f"{key}.{field}", scale * getattr(r, field), f"{what}: {field}", source))
        out.append(Number(f"{key}.n", r.n, f"{what}: seeds", source))
    spans = pd.read_csv(folder / "times.csv", parse_dates=["start", "end"])
    hours = (spans["end"].max() - spans["start"].min()).total_seconds() / 3600
    out.append(
        Number("confirm.span_h", hours, "first run's start to last run's end, hours", _rel(folder / "times.csv"))
    )
    memory = folder / "memory.json"
    if memory.exists():
        for field, value in json.loads(memory.read_text()).items():
            if isinstance(value, (int, float)):
                out.append(Number(f"confirm.{field}", value, f"peak memory: {field}", _rel(memory)))
    return out


def hard_lab_page(text: str) -> str:
    """docs/hard_lab.md's text with the confirmatory table between its two markers rewritten from
    ``confirm_primary`` (unchanged when the page has no markers yet)."""
    import pandas as pd

    from lopti_lab.studies.primary import primary_markdown, secondary_markdown, secondary_table

    if CONFIRM_BEGIN not in text:
        return text
    table = confirm_primary()
    if table is None:
        raise FileNotFoundError(f"{_rel(HARD_LAB_PAGE)} has the confirmatory table's markers but {_rel(CONFIRM)} "
                                "has no curves_sample.csv")  # fmt: skip
    sample, greedy = (pd.read_csv(CONFIRM / f"curves_{mode}.csv") for mode in ("sample", "greedy"))
    tables = f"{primary_markdown(table)}\n{secondary_markdown(secondary_table(sample, greedy))}"
    return between_markers(text, CONFIRM_BEGIN, CONFIRM_END, tables)


def table() -> dict[str, Number]:
    numbers = [*notebook_times(), *command_times(), *settings_numbers(), *confirm_numbers()]
    out = {n.key: n for n in numbers}
    if len(out) != len(numbers):
        raise ValueError("numbers: two numbers share a key")
    return out


def agrees(printed: str, value: float) -> bool:
    """Whether ``value`` prints as ``printed`` at its precision: decimals for a fixed-point number (either way at a
    half), the value itself for one in e-notation (a learning rate)."""
    text = printed.replace(",", "")
    if "e" in text.lower():
        return abs(float(text) - value) <= 1e-12 * abs(value)
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - value) <= 0.5 * 10**-decimals + 1e-9


def mismatches(text: str, numbers: dict[str, Number], where: str = "") -> list[str]:
    """Every marked number of ``text`` that is not its key's value, or whose key is unknown, as messages."""
    out = []
    for m in MARKER.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        key, printed = m["key"], m["number"]
        if key not in numbers:
            out.append(f"{where}:{line}: unknown number key {key!r} (docs/numbers.md lists them)")
        elif not agrees(printed, numbers[key].value):
            out.append(f"{where}:{line}: {printed} marked {key}, but the table has {numbers[key].value:.6g}")
    return out


def pages() -> list[Path]:
    """Every page that may quote a number: the README, docs/*.md, benchmarks/README.md, the notebooks' sources."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "notebooks" / "src").glob("*.py"))]  # fmt: skip


def check_pages(numbers: dict[str, Number]) -> list[str]:
    out = []
    for page in pages():
        if page.exists() and page != PAGE:
            out += mismatches(page.read_text(encoding="utf-8"), numbers, _rel(page))
    return out


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e6):
        return f"{value:.0e}".replace("e-0", "e-").replace("e+0", "e+")
    return f"{value:g}" if float(value).is_integer() else f"{value:.4g}"


def render(numbers: dict[str, Number]) -> str:
    """docs/numbers.md: the run times, then the settings at a glance (from ``settings_table``)."""
    lines = [
        "# Numbers: run times and settings, from their records",
        "",
        "Generated by `.venv/bin/python scripts/number_table.py` from the files named in each row; not edited by hand.",
        "A page quotes one of these numbers with its key in an HTML comment after it (`95 s<!--#nb.02-->`, invisible",
        "when rendered), and `tests/test_numbers.py` fails when the printed number is not the one here.",
        "",
        "Every study's settings side by side: [settings.md](settings.md) (its table is written by the same script).",
        "",
        "## Run times",
        "",
        "| key | value | what | source |",
        "|---|---|---|---|",
    ]
    for n in numbers.values():
        if not n.key.startswith(("set.", "confirm.")):
            lines.append(f"| `{n.key}` | {_fmt(n.value)} | {n.what} | `{n.source}` |")
    confirm = [n for n in numbers.values() if n.key.startswith("confirm.")]
    if confirm:  # recomputed from the bundled study (points are x 100 of an accuracy)
        lines += ["", "## The confirmatory study (docs/hard_lab.md), recomputed from its record", "",
                  "| key | value | what | source |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| `{n.key}` | {_fmt(n.value)} | {n.what} | `{n.source}` |" for n in confirm]
    lines += ["", "## Settings, one number per key", "", "| key | value | source |", "|---|---|---|"]
    for n in numbers.values():
        if n.key.startswith("set."):
            lines.append(f"| `{n.key}` | {_fmt(n.value)} | {n.source} |")
    return "\n".join(lines) + "\n"


def as_json(numbers: dict[str, Number]) -> str:
    return json.dumps({k: {"value": n.value, "what": n.what, "source": n.source} for k, n in numbers.items()},
                      indent=1) + "\n"  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/numbers.* is stale or a page disagrees")
    parser.add_argument("--time", metavar="NAME", help="run the command after -- and record its times as NAME")
    args, command = parser.parse_known_args(argv)
    if args.time:
        if command[:1] == ["--"]:
            command = command[1:]
        if not command:
            parser.error("--time NAME needs a command after --")
        print(json.dumps(record_command(args.time, command)))
    numbers = table()
    if args.check:
        problems = check_pages(numbers)
        stale = [PAGE.read_text() != render(numbers), TABLE.read_text() != as_json(numbers),
                 SETTINGS_PAGE.read_text() != settings_page(SETTINGS_PAGE.read_text()),
                 HARD_LAB_PAGE.read_text() != hard_lab_page(HARD_LAB_PAGE.read_text())]  # fmt: skip
        if any(stale):
            problems.append(
                "docs/numbers.md, numbers.json, settings.md or hard_lab.md's confirmatory table is stale: "
                "run scripts/number_table.py"
            )
        print("\n".join(problems) or "numbers: every marked number agrees with docs/numbers.md")
        return 1 if problems else 0
    PAGE.write_text(render(numbers))
    TABLE.write_text(as_json(numbers))
    SETTINGS_PAGE.write_text(settings_page(SETTINGS_PAGE.read_text()))
    HARD_LAB_PAGE.write_text(hard_lab_page(HARD_LAB_PAGE.read_text()))
    print(f"wrote {_rel(PAGE)} and {_rel(TABLE)}: {len(numbers)} numbers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
