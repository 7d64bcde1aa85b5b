"""Run folders: what a training run leaves on disk, how it survives a kill, and how to read runs back as DataFrames.

A run folder (``TrainConfig.run_dir``) holds everything needed to reload, compare or resume the run:

    config.json                      the TrainConfig, as JSON
    metrics.jsonl                    one JSON object per completed step, appended durably each step
    checkpoints/step_{k}/            model.safetensors (full fine-tuning) or adapter/ (PEFT save_pretrained),
                                     optimizer.pt, rng.pt (python, numpy, torch and CUDA RNG states), tokenizer/,
                                     scaler.pt (a float16 run's loss-scaler state), state.json (the step, and each
                                     file's size and sha256)
    checkpoints/latest               the name of the newest complete checkpoint ("step_{k}")
    times.json                       wall-clock times (UTC): the first start, the end of training, each
                                     process's [start, end] and its last checkpoint (``RunFolder.mark``,
                                     ``load_times``)
    lock                             the writer's lock (``writer_lock``): one process writes a run at a time

Crash consistency (lopti_lab.durable has the primitives). Every write reaches the disk in this order, so a kill or a
power cut at any moment leaves a folder that ``check_resume`` can continue from:

    1. config.json: written to config.json.tmp, fsynced, renamed, folder fsynced (before the model loads)
    2. step k's record: one line appended to metrics.jsonl, flushed and fsynced
    3. checkpoint k (every save_every steps): every file written into checkpoints/step_{k}.partial/ and fsynced,
       state.json last, then the folder renamed to step_{k} and checkpoints/ fsynced
    4. checkpoints/latest <- "step_{k}" (tmp + fsync + rename + fsync): the commit point of checkpoint k

Because 2 precedes 3-4, the latest checkpoint's step always has its record. On resume, ``resume.check_resume``
verifies the folder and ``resume.repair_for_resume`` cuts it back to a consistent point: records after the checkpoint
are dropped and their steps redone, a torn last line (a kill inside an append) is dropped and its step redone from the
last checkpoint that all surviving records cover, partial checkpoints are removed. Anything else (a damaged line in the
middle, a step missing or doubled, a checkpoint whose files are missing or differ from state.json, a config.json that
does not parse) is a RunFolderError naming the file and line; nothing is skipped in silence.

    df = load_run("runs/ar")                  # one row per step, one column per metric; df.attrs["config"]
    long = compare(["runs/grpo", "runs/ar"])  # tidy: run, method, step, metric, value

Metric keys (plain floats; plots and widgets read these names, whatever produced the run):

    step                          the RL step, 1-based
    reward/mean, reward/std       Logic-RL reward (3 / -0.5 / -1 / -3) over the step's B = prompts x G completions
    acc/all, acc/{n}ppl           share of completions with reward 3, overall and per people count in the batch
    format/error_rate             share with a format error (format score < 0)
    len/response_mean, len/response_max, len/truncated_share   response tokens; share that hit max_new_tokens
    groups/zero_var_share         share of prompts whose G rewards are all equal (zero advantage, no signal)
    adv/abs_mean                  mean |advantage| over response tokens, after AR when it is on
    ar/weight_mean                mean AR weight alpha * pi_old + 1 - alpha over response tokens (AR runs only)
    lopti/low_share               share of response tokens with pi_old < eta (Lopti runs only)
    policy/entropy                mean entropy of the rollout policy over response tokens (at the temperature)
    policy/approx_kl              k3 estimate of KL(pi_old || pi) during the update (token mean over updates)
    policy/clip_frac_low          share of tokens with ratio < 1 - clip_low and A < 0 (clipped from below)
    policy/clip_frac_high         share of tokens with ratio > 1 + clip_high and A > 0 (clipped from above)
    policy/dual_clip_frac         share of tokens with A < 0 and ratio > dual_clip
    policy/kl                     k3 KL to the reference policy (0 when kl_coef is 0)
    loss/policy                   the clipped loss per minibatch (Lopti: its two stages summed), mean over minibatches
    grad/norm                     gradient norm before clipping, mean over the step's optimizer steps
    update/optimizer_steps        optimizer steps taken this step (minibatches x epochs x stages)
    skipped/nonfinite             1 when a non-finite loss or gradient stopped the step's updates, else 0
    amp/skipped_steps, amp/scale  float16 runs only: optimizer steps the loss scaler skipped for an inf/nan
                                  gradient (an expected overflow; the step's other optimizer steps run), and the
                                  scale after the step
    every probe_every steps, from probes.GradientProbe on the step's real backward passes ("position"
    attribution, averaged over the step's backward passes; bins by pi_old, TrainConfig.probe_bins):
    tokens/share_bin{i}           share of response tokens in probability bin i
    grad/norm_bin{i}              norm of the gradient part of the positions that predict bin i's tokens
    grad/share_bin{i}             <g_i, g> / ||g||^2, bin i's share of the gradient (with the context row, sums to 1)
    grad/norm_context, grad/share_context   the same for prompt and padding positions
    grad/norm_probed              norm of the probed (LoRA / Linear and Embedding) gradient
    shift/correct_pos_bin{i}      after the step's update, share of bin i's A > 0 tokens whose probability rose
    shift/correct_neg_bin{i}      ... and of its A < 0 tokens whose probability fell (the paper's Fig. 2b)
    shift/n_pos_bin{i}, shift/n_neg_bin{i}, shift/dp_mean_bin{i}   their token counts and bin i's mean delta p
    time/generate, time/logprob, time/score, time/update, time/eval, time/step     seconds (logprob: the rollout's
                                  old_logp / entropy / reference forward; step: all of it, evaluation included)
    eval/{greedy,sample}/acc_{n}ppl   test accuracy per people count (every eval_every steps and at the end)
    eval/{greedy,sample}/acc_all      mean of the per-people accuracies (the paper's "avg" column)
    eval/{greedy,sample}/format_error_rate, eval/{greedy,sample}/len_mean
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import socket
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

try:
    import fcntl
except ImportError:  # Windows: no flock, no writer lock
    fcntl = None

from lopti_lab import durable
from lopti_lab.methods import method_label

__all__ = [
    "RunFolder",
    "RunFolderError",
    "RunFolderLocked",
    "compare",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "load_metrics",
    "load_run",
    "load_times",
    "save_checkpoint",
    "writer_lock",
]

CONFIG, METRICS, CHECKPOINTS, LATEST, LOCK = "config.json", "metrics.jsonl", "checkpoints", "latest", "lock"
TIMES = "times.json"
PARTIAL = ".partial"
STEP_FOLDER = re.compile(r"step_(\d+)")


class RunFolderError(ValueError):
    """A run folder that cannot be read or resumed as it is; the message names the file (and line)."""


class RunFolderLocked(RunFolderError):
    """A second writer on a folder another live process is writing; the message names that process."""


@contextmanager
def writer_lock(path: str | Path) -> Iterator[Path]:
    """Hold ``path``'s writer lock for the block: a run (``train``, its resume, a panel's run, a demo worker) or a
    study's report folder has one writer at a time.

    The lock is an ``flock`` on ``<path>/lock``, whose text names the owner (pid, host, since when). A second writer
    is refused at once with a RunFolderLocked naming it; the kernel drops a lock when its process ends, however it
    ends (SIGKILL included), so a lock left by a dead process is simply taken over. Readers (``load_run``, notebook
    05) never take it. Where ``flock`` does not exist (Windows) there is no lock."""
    path = Path(path)
    with durable.room(path):
        path.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield path
        return
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            raise RunFolderLocked(
                f"{path} is being written by {owner} (its lock: {path / LOCK}); a second writer is refused: wait for "
                "it to finish or stop it (a lock whose process has died is taken over)"
            ) from None
        note = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        with durable.room(path / LOCK, len(note)):
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
        try:
            yield path
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class RunFolder:
    """Writes a run folder: config once (atomically), one durable metrics line per step, checkpoints."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    def exists(self) -> bool:
        """Whether the folder holds a run (a config or a metrics log), i.e. whether a new run would clobber one."""
        return (self.path / CONFIG).exists() or self.metrics_path.exists()

    def write_config(self, config: Mapping) -> None:
        with durable.room(self.path):
            self.path.mkdir(parents=True, exist_ok=True)
            durable.fsync_dir(self.path.parent)
        durable.atomic_write(self.path / CONFIG, (json.dumps(dict(config), indent=2) + "\n").encode())

    def log(self, record: Mapping) -> None:
        """Append one step's record durably (flush + fsync), so an interrupted run keeps every completed step."""
        durable.append(self.metrics_path, (json.dumps(_plain(record), allow_nan=True) + "\n").encode())

    def mark(self, event: str) -> dict:
        """Record in times.json, atomically, that the run's process starts ("start"), has saved a checkpoint
        ("saved") or has trained its last step ("end") now: ``start`` stays the first start (a resume keeps it),
        ``end`` is the latest end, ``sessions`` lists each process's [start, end] (end null while it runs or after a
        kill), and ``saved`` each process's last checkpoint (null before its first), so a killed process's kept work
        spans [start, saved] and a resumed run's time is their sum. Returns the times as written."""
        if event not in ("start", "saved", "end"):
            raise ValueError(f"event must be 'start', 'saved' or 'end', got {event!r}")
        now = datetime.now(UTC).isoformat(timespec="seconds")
        times = load_times(self.path) or {"start": now, "end": None, "sessions": []}
        saved = times.setdefault("saved", [None] * len(times["sessions"]))  # older folders: no checkpoint times
        if event == "start":
            times["sessions"].append([now, None])
            saved.append(None)
        elif event == "saved" and saved:
            saved[-1] = now
        elif event == "end":
            times["end"] = now
            if times["sessions"]:
                times["sessions"][-1][1] = now
        durable.atomic_write(self.path / TIMES, (json.dumps(times, indent=1) + "\n").encode())
        return times

    def truncate(self, step: int) -> None:
        """Keep only the records of steps <= ``step`` (their lines byte for byte), atomically."""
        lines = (
            [line for line in lines_of(self.metrics_path) if not is_torn(line)] if self.metrics_path.is_file() else []
        )
        kept = [line for line in lines if record_of(self.metrics_path, line).get("step", 0) <= step]
        durable.atomic_write(self.metrics_path, b"".join(line.raw + b"\n" for line in kept))


def load_config(path: str | Path) -> dict:
    """config.json of a run folder as a dict; RunFolderError naming the file and line if it is not a JSON object."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG} in run folder {path}")
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as err:
        raise RunFolderError(f"{file} line {err.lineno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise RunFolderError(f"{file}: not UTF-8 text ({err})") from None
    if not isinstance(config, dict):
        raise RunFolderError(f"{file}: a JSON {type(config).__name__}, not an object of TrainConfig fields")
    return config


def load_times(path: str | Path) -> dict | None:
    """A run folder's times.json (``RunFolder.mark``): {"start", "end", "sessions"}, ISO 8601 UTC; None for a run
    that has none (one trained before runs recorded their times); RunFolderError naming the file if damaged."""
    file = Path(path) / TIMES
    if not file.is_file():
        return None
    try:
        times = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RunFolderError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(times, dict) or not {"start", "end", "sessions"} <= times.keys():
        raise RunFolderError(f"{file}: must be a JSON object with start, end and sessions")
    return times


def load_metrics(path: str | Path) -> list[dict]:
    """The metrics records of a run, one per line of metrics.jsonl.

    A line that is not a JSON object raises RunFolderError naming the file and line. The one exception is an
    unterminated last line that does not parse: a write in progress, or one cut by a kill (a torn line). It is left
    out with a warning naming it; resuming the run redoes its step (``check_resume``).
    """
    file = Path(path) / METRICS
    if not file.is_file():
        return []
    records = []
    for line in lines_of(file):
        if is_torn(line):
            warnings.warn(f"{file} line {line.number}: torn last line ({len(line.raw)} bytes) left out", stacklevel=2)
            continue
        records.append(record_of(file, line))
    return records


def load_run(path: str | Path) -> pd.DataFrame:
    """One row per step, one column per metric (NaN where a step did not log it), sorted by step.

    ``df.attrs`` holds ``config`` (dict), ``method`` (``method_label``), ``run`` (the folder name) and ``path``.
    """
    path = Path(path)
    config = load_config(path)
    df = pd.DataFrame.from_records(load_metrics(path))
    if df.empty:
        df = pd.DataFrame({"step": pd.Series(dtype="int64")})
    df = df.sort_values("step").reset_index(drop=True)
    df.attrs.update(config=config, method=method_label(config), run=path.name, path=str(path))
    return df


def compare(paths: Iterable[str | Path], metrics: Iterable[str] | None = None) -> pd.DataFrame:
    """Tidy long table over runs: columns run, method, step, metric, value (one row per logged number).

    ``metrics`` keeps only those keys. Runs with the same folder name are told apart by their parent folder.
    """
    paths = list(paths)
    frames = []
    for path in paths:
        wide = load_run(path)
        long = wide.melt(id_vars="step", var_name="metric", value_name="value").dropna(subset=["value"])
        if metrics is not None:
            long = long[long["metric"].isin(list(metrics))]
        long.insert(0, "method", wide.attrs["method"])
        long.insert(0, "run", str(path) if _name_clash(paths, path) else wide.attrs["run"])
        frames.append(long)
    if not frames:
        return pd.DataFrame(columns=["run", "method", "step", "metric", "value"])
    out = pd.concat(frames, ignore_index=True)
    out["value"] = out["value"].astype(float)
    return out.sort_values(["run", "metric", "step"], kind="stable").reset_index(drop=True)


# --- checkpoints ---------------------------------------------------------------------------------------------------


def latest_checkpoint(path: str | Path) -> Path | None:
    """The newest committed checkpoint folder of a run (what ``checkpoints/latest`` names), or None."""
    pointer = Path(path) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    folder = Path(path) / CHECKPOINTS / pointer.read_text(encoding="utf-8").strip()
    return folder if folder.is_dir() else None


def save_checkpoint(path: str | Path, step: int, model, optimizer=None, tokenizer=None, scaler=None) -> Path:
    """Save the trainable weights, optimizer state, the loss scaler's state (``scaler``: a float16 run's
    ``torch.amp.GradScaler``) and RNG states after ``step`` (order 3-4 of the module docstring):
    into step_{k}.partial/, state.json with every file's size and sha256 last, rename, then point ``latest`` at it.
    A crash at any moment leaves the previous checkpoint as the latest; so does a full disk (DiskFullError), which
    also removes the partial checkpoint to give its space back."""
    root = Path(path) / CHECKPOINTS
    final, partial = root / f"step_{step}", root / f"step_{step}{PARTIAL}"
    if final.is_dir() and latest_checkpoint(path) == final:
        raise RunFolderError(f"{final} is already the latest checkpoint; a step is saved once")
    with durable.room(root):
        root.mkdir(parents=True, exist_ok=True)
    durable.remove(partial)  # left by a crash mid-save: never committed
    try:
        _write_checkpoint(partial, step, model, optimizer, tokenizer, scaler)
    except durable.DiskFullError:  # give the space back at once; the previous checkpoint stays the latest
        durable.remove(partial)
        raise
    durable.remove(final)  # an uncommitted leftover (renamed, but latest never named it)
    durable.replace(partial, final)
    durable.atomic_write(root / LATEST, (final.name + "\n").encode())
    return final


def _write_checkpoint(partial: Path, step: int, model, optimizer, tokenizer, scaler=None) -> None:
    """Every file of checkpoint ``step`` into ``partial``, fsynced, state.json (each file's size and sha256) last."""
    # torch (and models, which loads it) only here and in load_checkpoint: reading run folders stays light
    import numpy as np
    import torch
    from safetensors.torch import save

    from lopti_lab.models import is_peft, trainable_state_dict

    with durable.room(partial):
        partial.mkdir()
    blobs = {}
    if is_peft(model):
        with durable.room(partial / "adapter"):  # loadable with peft.PeftModel.from_pretrained(base, folder)
            model.save_pretrained(partial / "adapter")
    else:
        blobs["model.safetensors"] = save(trainable_state_dict(model))
    if tokenizer is not None and not is_peft(model):
        with durable.room(partial / "tokenizer"):
            tokenizer.save_pretrained(partial / "tokenizer")
    if optimizer is not None:
        blobs["optimizer.pt"] = _torch_bytes(optimizer.state_dict())
    if scaler is not None:
        blobs["scaler.pt"] = _torch_bytes(scaler.state_dict())
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    blobs["rng.pt"] = _torch_bytes(rng)
    for name, data in blobs.items():
        durable.write(partial / name, data)
    durable.sync_tree(partial)  # what save_pretrained wrote
    state = {"step": step, "files": _manifest(partial)}
    durable.write(partial / "state.json", (json.dumps(state, indent=1) + "\n").encode())
    durable.fsync_dir(partial)


def load_checkpoint(folder: str | Path, model, optimizer=None, restore_rng: bool = True, scaler=None) -> int:
    """Load a checkpoint folder into ``model`` (and ``optimizer``, and ``scaler`` from scaler.pt), restore the RNG
    states; returns its step. A checkpoint without scaler.pt (saved before float16 runs kept one) leaves ``scaler``
    at its initial scale, which finds its level again within a few optimizer steps."""
    import numpy as np
    import torch

    from lopti_lab.models import is_peft

    folder = Path(folder)
    if not (folder / "state.json").is_file():
        raise FileNotFoundError(f"not a complete checkpoint (no state.json): {folder}")
    if is_peft(model):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        result = set_peft_model_state_dict(model, load_peft_weights(str(folder / "adapter"), device="cpu"))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{folder}: adapter does not match the model ({result.unexpected_keys[:3]} ...)")
    else:
        from safetensors.torch import load_file

        state = load_file(folder / "model.safetensors")
        params = dict(model.named_parameters())
        if set(state) != {n for n, p in params.items() if p.requires_grad}:
            raise ValueError(f"{folder}/model.safetensors does not match the model's trainable parameters")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False))
    if scaler is not None and (folder / "scaler.pt").is_file():
        scaler.load_state_dict(torch.load(folder / "scaler.pt", weights_only=True))
    if restore_rng:
        rng = torch.load(folder / "rng.pt", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return int(json.loads((folder / "state.json").read_text(encoding="utf-8"))["step"])


# --- helpers -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    number: int
    """1-based line number in the file"""
    raw: bytes
    """the line's bytes, without its newline"""
    terminated: bool


def lines_of(file: Path) -> list[Line]:
    """The lines of a file as bytes: b'a\\nb' -> [Line(1, b'a', True), Line(2, b'b', False)]."""
    parts = file.read_bytes().split(b"\n")
    lines = [Line(i, raw, terminated=True) for i, raw in enumerate(parts[:-1], 1)]
    if parts[-1]:
        lines.append(Line(len(parts), parts[-1], terminated=False))
    return lines


def _parse(line: Line) -> tuple[dict | None, str]:
    """(record, "") or (None, what is wrong)."""
    try:
        value = json.loads(line.raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        return None, f"not valid JSON ({err})"
    if not isinstance(value, dict):
        return None, f"a JSON {type(value).__name__}, not a record"
    return value, ""


def is_torn(line: Line) -> bool:
    """An unterminated last line that does not parse: a prefix of an append (the writer adds the newline last)."""
    return not line.terminated and _parse(line)[0] is None


def record_of(file: Path, line: Line) -> dict:
    record, problem = _parse(line)
    if record is None:
        raise RunFolderError(f"{file} line {line.number}: {problem}")
    return record


def _torch_bytes(obj) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest(folder: Path) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file under ``folder``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_hex(p.read_bytes())}
            for p in files}  # fmt: skip


def _plain(record: Mapping) -> dict:
    """JSON-ready: tensors and numpy scalars become Python floats/ints."""
    out = {}
    for key, value in record.items():
        if hasattr(value, "item"):
            value = value.item()
        out[key] = value
    return out


def _name_clash(paths, path) -> bool:
    names = [Path(p).name for p in paths]
    return names.count(Path(path).name) > 1
