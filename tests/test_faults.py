"""The faults a user makes: a full disk at every write of a run (a real tmpfs filled up), two writers on one run
folder, and Ctrl-C in `lopti-lab train` / `lopti-lab demo`.

Same tiny random Qwen2 and fake reward as test_trainer.py (its ``config`` fixture)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from test_trainer import config  # noqa: F401 (the fixture)

from lopti_lab import durable, runs
from lopti_lab.resume import check_resume
from lopti_lab.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def steady(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in runs.load_metrics(run_dir)]


def checkpoint_bytes(run_dir) -> dict[str, bytes]:
    final = runs.latest_checkpoint(run_dir)
    return {str(p.relative_to(final)): p.read_bytes() for p in sorted(final.rglob("*")) if p.is_file()}


# --- a full disk --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """A real 24 MB tmpfs mounted for these tests (root only: skipped, with the reason, where it cannot be)."""
    mount = tmp_path_factory.mktemp("disk")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}): the full-disk tests need "
                    "root (CI runs them)")  # fmt: skip
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def fill(disk: Path) -> Path:
    """Take every free byte of the tmpfs with one file; returns it (remove it to free the space)."""
    filler = disk / f"filler-{uuid.uuid4().hex}"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: each write meets the disk at once
        for chunk in (1 << 20, 1 << 12, 1):
            block = b"\0" * chunk
            try:
                while True:
                    f.write(block)
            except OSError as err:
                assert err.errno == errno.ENOSPC
    return filler


class FullAt:
    """Fill the disk just before the k-th durable write of a run (durable.write / append / replace)."""

    def __init__(self, monkeypatch, disk: Path, k: int):
        self.disk, self.k, self.calls, self.filler = disk, k, 0, None
        for name in ("write", "append", "replace"):
            real = getattr(durable, name)

            def counted(*args, _real=real, **kwargs):
                self.calls += 1
                if self.calls == self.k:
                    self.filler = fill(self.disk)
                return _real(*args, **kwargs)

            monkeypatch.setattr(durable, name, counted)


@pytest.mark.slow
def test_a_full_disk_at_every_write_stops_cleanly_and_resumes_to_the_straight_run(config, small_disk, monkeypatch):  # noqa: F811
    """For every durable write k of a 3-step run (config, appends, checkpoint files, state.json, renames, the
    latest pointer): fill the tmpfs just before it; the run stops with a DiskFullError naming a file and the free
    space; the folder passes check_resume; with the space freed, the resume ends with the straight run's records
    (none lost, none doubled) and its final checkpoint, byte for byte."""
    cfg = replace(config, steps=3, save_every=1, eval_people=())
    straight = small_disk / "straight"
    train(replace(cfg, run_dir=str(straight)))
    expected, expected_checkpoint = steady(straight), checkpoint_bytes(straight)
    with monkeypatch.context() as m:  # count the writes of one run
        counter = FullAt(m, small_disk, k=0)
        train(replace(cfg, run_dir=str(small_disk / "count")))
        writes = counter.calls
    assert writes >= 20, writes
    failed_at, completed = [], []
    for k in range(1, writes + 1):
        run_dir = small_disk / f"run{k}"
        with monkeypatch.context() as m:
            full = FullAt(m, small_disk, k)
            try:
                train(replace(cfg, run_dir=str(run_dir)))
                completed.append(k)  # what was left to write needed no space (a rename)
                error = None
            except durable.DiskFullError as err:
                failed_at.append(full.calls)
                error = err
        full.filler.unlink()  # the space freed
        if error is not None:
            message = str(error)
            assert "bytes are free there" in message and "resume" in message and str(small_disk) in message, message
            if (run_dir / runs.CONFIG).is_file():
                check_resume(run_dir)  # a folder the resume accepts as it was left
                train(replace(cfg, run_dir=str(run_dir)), resume=True)
            else:  # the very first write failed: there is no run yet, so it starts afresh
                train(replace(cfg, run_dir=str(run_dir)))
        assert steady(run_dir) == expected, k
        assert checkpoint_bytes(run_dir) == expected_checkpoint, k
        assert not list(run_dir.rglob("*.partial")) and not list(run_dir.rglob("*.tmp")), k
        durable.remove(run_dir)  # room for the next point
    # most writes fail at once; an append into a page the file already holds takes a few more bytes first, and a
    # rename needs no space at all (only the last ones can then finish the run)
    immediate = sum(at == k for k, at in zip(sorted(set(range(1, writes + 1)) - set(completed)), failed_at))
    assert immediate >= 0.6 * writes and len(completed) <= 3, (failed_at, completed)
    print(
        f"full disk at each of {writes} writes: {len(failed_at)} stopped the run ({immediate} at the write "
        f"itself), {len(completed)} needed no space; every resume equal to the straight run"
    )


def test_a_failed_append_leaves_the_file_as_it_was(small_disk):
    file = small_disk / "metrics.jsonl"
    durable.append(file, b'{"step": 1}\n')
    filler = fill(small_disk)
    try:
        with pytest.raises(durable.DiskFullError, match=r"metrics\.jsonl: no space left on device"):
            durable.append(file, b"x" * 100_000)
        assert file.read_bytes() == b'{"step": 1}\n'
    finally:
        filler.unlink()
        file.unlink()


# --- two writers --------------------------------------------------------------------------------------------------


HOLDER = """
import sys, time
from lopti_lab.runs import writer_lock
with writer_lock(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(120)
"""


def test_a_second_writer_is_refused_with_the_owner_named_and_a_dead_owners_lock_is_taken_over(config, capsys):  # noqa: F811
    run_dir = Path(config.run_dir)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(runs.RunFolderLocked, match=f"pid {holder.pid} on "):
            train(config)
        assert not (run_dir / runs.CONFIG).exists(), "nothing was written"
        from lopti_lab.cli import main

        file = run_dir.parent / "config.json"
        file.write_text(json.dumps(config.to_dict()))
        assert main(["train", "--config", str(file)]) == 2  # `lopti-lab train` as the second writer
        assert f"is being written by pid {holder.pid} on " in capsys.readouterr().err
        holder.send_signal(signal.SIGKILL)  # the owner dies holding the lock
        holder.wait()
        result = train(config)  # the kernel dropped its lock: taken over
        assert len(result.history) == config.steps
        assert f"pid {os.getpid()} on " in (run_dir / runs.LOCK).read_text()
        with runs.writer_lock(run_dir):  # and released again when train returned
            pass
    finally:
        holder.kill()
        holder.wait()


def test_readers_never_need_the_lock(config):  # noqa: F811
    train(config)
    with runs.writer_lock(config.run_dir):  # a writer holds it: reading still works
        assert len(runs.load_run(config.run_dir)) == config.steps
        assert check_resume(config.run_dir).step == config.steps


# --- Ctrl-C -------------------------------------------------------------------------------------------------------


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (from /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout: float = 300.0, every: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


@pytest.mark.slow
def test_ctrl_c_in_train_exits_130_keeps_every_finished_step_and_resumes(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "lopti_lab.cli", "train", "--model", str(model_dir), "--lora-r", "4",
            "--lora-alpha", "8", "--prompt-style", "base", "--train-people", "3", "--train-limit", "8",
            "--eval-people", "--prompts-per-step", "2", "--group-size", "4", "--minibatch-size", "8",
            "--max-new-tokens", "8", "--lr", "1e-3", "--steps", "40", "--save-every", "2", "--run-dir", str(run_dir),
            "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: (run_dir / runs.METRICS).is_file() and len(runs.load_metrics(run_dir)) >= 3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; every finished step is kept, the same command with --resume continues" in err
    kept = runs.load_metrics(run_dir)
    assert [r["step"] for r in kept] == list(range(1, len(kept) + 1))  # every record whole, none doubled
    point = check_resume(run_dir)
    assert point.step <= len(kept)
    done = subprocess.run([*argv[:-1], "--resume", "--steps", str(len(kept) + 2)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["step"] for r in runs.load_metrics(run_dir)] == list(range(1, len(kept) + 3))
    print(f"Ctrl-C in train: exit {proc.returncode}, {len(kept)} records kept, resumed to {len(kept) + 2}")


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "data" / "lab_model" / "config.json").is_file(), reason="needs the bundled lab model")
def test_ctrl_c_in_the_demo_exits_130_leaves_no_worker_and_the_same_command_finishes(tmp_path):
    out = tmp_path / "demo"
    argv = [sys.executable, "-m", "lopti_lab.cli", "demo", "--quick", "--methods", "GRPO", "GRPO+AR", "--workers",
            "2", "--threads", "2", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: set[int] = set()

    def a_step_is_logged() -> bool:
        workers.update(children(proc.pid))
        return any(runs.load_metrics(d) for d in (out / "runs").glob("*") if d.is_dir())

    assert wait_for(a_step_is_logged)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal reaches the whole process group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert workers and wait_for(lambda: not any(alive(pid) for pid in workers), timeout=20), "orphan workers"
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "report.md").is_file()
    kept = {d.name: len(runs.load_metrics(d)) for d in (out / "runs").glob("*") if d.is_dir()}
    for run_dir in (out / "runs").glob("*"):
        assert [r["step"] for r in runs.load_metrics(run_dir)] == [1, 2]
    print(f"Ctrl-C in the demo: exit 130, {len(workers)} worker processes seen, 0 alive after; rerun exit 0, {kept}")
