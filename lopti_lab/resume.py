"""Resuming a run folder: check it (reads only), then repair it to a consistent point (``runs`` has the layout and
the write order that make this possible after a kill at any moment).

    point = check_resume("runs/x")      # ResumePoint: the step to continue after, its checkpoint, the kept records
    repair_for_resume("runs/x", point)  # metrics.jsonl cut back, stale and partial checkpoints removed
    point = resume_point(config)        # both checks plus the TrainConfig's: what ``train(resume=True)`` calls
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from lopti_lab import durable
from lopti_lab.runs import (
    CHECKPOINTS,
    CONFIG,
    LATEST,
    METRICS,
    PARTIAL,
    STEP_FOLDER,
    Line,
    RunFolderError,
    is_torn,
    latest_checkpoint,
    lines_of,
    load_config,
    record_of,
    sha256_hex,
)
from lopti_lab.train_config import RESUMABLE_CHANGES, TrainConfig

__all__ = ["ResumePoint", "check_resume", "repair_for_resume", "resume_point"]


@dataclass
class ResumePoint:
    """Where a run continues: after ``step`` (0 = from the initial weights), from ``checkpoint``."""

    step: int
    checkpoint: Path | None
    records: list[dict]
    """the metrics of steps 1..step, which the resumed run keeps"""
    config: dict
    """config.json as saved"""
    notes: list[str] = field(default_factory=list)
    """what ``repair_for_resume`` changes and why (records dropped, a torn line, stale checkpoints)"""
    kept: bytes = b""
    """metrics.jsonl as it will be: the lines of the kept records, each newline-terminated"""


def check_resume(path: str | Path) -> ResumePoint:
    """Verify a run folder and find where it continues; reads only (``repair_for_resume`` applies the result).

    Every complete line of metrics.jsonl must be a record and the steps must run 1, 2, ..., m, each once; the
    checkpoint ``latest`` names must exist with every file state.json lists, at its size and sha256. It resumes at
    the latest checkpoint when all of its steps have records, else (a torn or lost last line: the checkpoint is ahead
    of the log) at the newest checkpoint, or the start, that the surviving records cover. RunFolderError otherwise.
    """
    path = Path(path)
    if not (path / CONFIG).is_file():
        what = "a metrics.jsonl but no config.json" if (path / METRICS).exists() else "no config.json"
        raise RunFolderError(f"{path} holds no run to resume ({what}); start it without resume")
    config = load_config(path)
    lines, records = _consistent_lines(path / METRICS)
    last, notes = len(records), []
    if len(lines) > last:
        notes.append(f"{METRICS} line {lines[-1].number}: a torn last line ({len(lines[-1].raw)} bytes) is dropped")
    latest = _committed_step(path)
    chosen = latest
    if latest is not None and latest > last:
        chosen = max((k for k in _checkpoint_steps(path) if k <= last), default=None)
        start = f"step_{chosen}" if chosen is not None else "the start"
        notes.append(f"checkpoint step_{latest} is ahead of {METRICS} (last record: step {last}): resuming from "
                     f"{start}")  # fmt: skip
    step = chosen or 0
    folder = None if chosen is None else _verified(path / CHECKPOINTS / f"step_{chosen}", chosen)
    if last > step:
        notes.append(f"the records of {_span(step + 1, last)} come after the checkpoint: dropped, and redone")
    kept = b"".join(line.raw + b"\n" for line in lines[:step])
    return ResumePoint(step, folder, records[:step], config, notes, kept)


def repair_for_resume(path: str | Path, point: ResumePoint) -> None:
    """Make the folder match ``point``, in an order that a crash at any moment leaves re-checkable: metrics.jsonl cut
    to the kept records, ``latest`` pointed at the checkpoint resumed from, then newer and partial checkpoints and
    leftover .tmp files removed."""
    path = Path(path)
    metrics = path / METRICS
    if metrics.is_file() and metrics.read_bytes() != point.kept:
        durable.atomic_write(metrics, point.kept)
    root = path / CHECKPOINTS
    if point.checkpoint is None:
        durable.remove(root / LATEST)
    elif latest_checkpoint(path) != point.checkpoint:
        durable.atomic_write(root / LATEST, (point.checkpoint.name + "\n").encode())
    stale = [root / f"step_{k}" for k in _checkpoint_steps(path) if k > point.step]
    stale += [*root.glob(f"*{PARTIAL}"), *root.glob(f"*{durable.TMP}"), *path.glob(f"*{durable.TMP}")]
    for leftover in stale:
        durable.remove(leftover)


def _consistent_lines(file: Path) -> tuple[list[Line], list[dict]]:
    """The lines and records of metrics.jsonl if steps run 1..m with one record each (a torn last line is kept in
    the lines but has no record); RunFolderError naming the line otherwise."""
    lines = lines_of(file) if file.is_file() else []
    records: list[dict] = []
    for line in lines:
        if is_torn(line):
            break
        record = record_of(file, line)
        step = record.get("step")
        if not (isinstance(step, int) and not isinstance(step, bool)):
            raise RunFolderError(f"{file} line {line.number}: no integer 'step' in the record")
        expected = len(records) + 1
        if step != expected:
            problem = f"step {step} again" if step < expected else f"step {step} where step {expected} is missing"
            raise RunFolderError(f"{file} line {line.number}: {problem} (each step needs exactly one record)")
        records.append(record)
    return lines, records


def _committed_step(path: Path) -> int | None:
    """The step ``checkpoints/latest`` names (verified later), or None when there is no committed checkpoint."""
    pointer = path / CHECKPOINTS / LATEST
    if not pointer.exists():
        return None
    match = STEP_FOLDER.fullmatch(pointer.read_bytes().decode("utf-8", "replace").strip())
    if match is None:
        raise RunFolderError(f"{pointer} line 1: not a checkpoint name (step_<k>)")
    folder = path / CHECKPOINTS / match.group(0)
    if not folder.is_dir():
        raise RunFolderError(f"{pointer} names {match.group(0)}, but {folder} does not exist (a missing checkpoint)")
    return int(match.group(1))


def _checkpoint_steps(path: Path) -> list[int]:
    root = path / CHECKPOINTS
    found = [STEP_FOLDER.fullmatch(p.name) for p in root.iterdir()] if root.is_dir() else []
    return sorted(int(m.group(1)) for m in found if m is not None)


def _verified(folder: Path, step: int) -> Path:
    """``folder`` if it is the complete checkpoint of ``step``: state.json names the step and every file it lists
    has its recorded size and sha256 (checkpoints saved before the file list existed: the weights and RNG files)."""
    state_file = folder / "state.json"
    if not state_file.is_file():
        raise RunFolderError(f"{state_file} is missing (a partial checkpoint)")
    try:
        state = json.loads(state_file.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunFolderError(f"{state_file}: not valid JSON ({err})") from None
    if not isinstance(state, dict) or state.get("step") != step:
        raise RunFolderError(f"{state_file}: records step {state.get('step') if isinstance(state, dict) else state!r}"
                             f", not {step}")  # fmt: skip
    listed = state.get("files") or {
        name: None for name in ("rng.pt",) + (("adapter",) if (folder / "adapter").is_dir() else ("model.safetensors",))
    }
    for name, meta in listed.items():
        file = folder / name
        if not file.exists():
            raise RunFolderError(f"{file} is missing (a partial checkpoint)")
        if meta is None:
            continue
        size = file.stat().st_size
        if size != meta["bytes"]:
            raise RunFolderError(f"{file}: {size} bytes, state.json records {meta['bytes']} (a partial checkpoint)")
        if sha256_hex(file.read_bytes()) != meta["sha256"]:
            raise RunFolderError(f"{file}: content differs from the sha256 in state.json (a damaged checkpoint)")
    return folder


def _span(first: int, last: int) -> str:
    """'step 3' or 'steps 3-5'."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


def resume_point(cfg: TrainConfig) -> ResumePoint:
    """Everything a resume checks before any model loads: the folder (``check_resume``), that its config.json
    still validates and matches ``cfg`` but for RESUMABLE_CHANGES, and that the run is not past ``cfg.steps``."""
    path = Path(cfg.run_dir)
    point = check_resume(path)
    try:
        saved = TrainConfig.from_dict(point.config)
    except (ValueError, TypeError) as err:
        raise RunFolderError(f"{path / CONFIG} no longer validates: {err}") from None
    changed = [f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(saved, f.name)]
    changed = [name for name in changed if name not in RESUMABLE_CHANGES]
    if changed:
        raise RunFolderError(f"resume: config differs from {path / CONFIG} in {changed}")
    if point.step > cfg.steps:
        raise RunFolderError(f"resume: {path} is at step {point.step}, past TrainConfig.steps={cfg.steps}")
    return point
