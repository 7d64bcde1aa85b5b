"""runs.py: method labels, the metrics log, tidy loading and comparison, checkpoints with RNG states."""

import json
import random

import numpy as np
import pandas as pd
import pytest
import torch

from lopti_lab.methods import method_label
from lopti_lab.runs import (
    RunFolder,
    compare,
    latest_checkpoint,
    load_checkpoint,
    load_metrics,
    load_run,
    save_checkpoint,
)


@pytest.mark.parametrize(
    ("config", "label"),
    [
        ({"ar_alpha": None, "lopti_eta": None}, "GRPO"),
        ({"ar_alpha": 0.0, "lopti_eta": None}, "GRPO"),  # alpha = 0 is GRPO exactly
        ({"ar_alpha": 0.3, "lopti_eta": None}, "GRPO+AR"),
        ({"ar_alpha": None, "lopti_eta": 0.5}, "GRPO+Lopti"),
        ({"ar_alpha": 0.3, "lopti_eta": 0.5, "lopti_order": "low_first"}, "GRPO+AR+Lopti"),
        ({"lopti_eta": 0.5, "lopti_order": "high_first"}, "GRPO+Lopti(high-first)"),
    ],
)
def test_method_label(config, label):
    assert method_label(config) == label


def _make_run(path, ar_alpha, rewards):
    folder = RunFolder(path)
    folder.write_config({"ar_alpha": ar_alpha, "lopti_eta": None, "lopti_order": "low_first"})
    for step, reward in enumerate(rewards, 1):
        folder.log({"step": step, "reward/mean": torch.tensor(reward), "acc/all": np.float32(reward / 3)})
    return folder


def test_log_is_flushed_and_truncate_keeps_earlier_steps(tmp_path):
    folder = _make_run(tmp_path / "a", None, [0.0, 1.0, 2.0])
    lines = folder.metrics_path.read_text().splitlines()  # readable while the writer is still alive
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert isinstance(json.loads(lines[0])["reward/mean"], float)
    folder.truncate(2)
    assert [r["step"] for r in load_metrics(folder.path)] == [1, 2]
    with folder.metrics_path.open("a") as f:
        f.write('{"step": 3, "rew')  # a run killed mid-write: left out, and said so
    with pytest.warns(UserWarning, match="line 3: torn last line"):
        assert [r["step"] for r in load_metrics(folder.path)] == [1, 2]


def test_load_run_is_wide_with_config_attrs(tmp_path):
    _make_run(tmp_path / "ar", 0.3, [-3.0, 3.0])
    df = load_run(tmp_path / "ar")
    assert list(df.columns) == ["step", "reward/mean", "acc/all"]
    assert df["reward/mean"].tolist() == [-3.0, 3.0]
    assert df.attrs["method"] == "GRPO+AR" and df.attrs["config"]["ar_alpha"] == 0.3 and df.attrs["run"] == "ar"
    RunFolder(tmp_path / "empty").write_config({"ar_alpha": None})
    assert load_run(tmp_path / "empty").empty
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_run(tmp_path / "missing")


def test_compare_is_tidy(tmp_path):
    _make_run(tmp_path / "grpo", None, [0.0, 1.0])
    _make_run(tmp_path / "ar", 0.3, [0.5])
    long = compare([tmp_path / "grpo", tmp_path / "ar"])
    assert list(long.columns) == ["run", "method", "step", "metric", "value"]
    assert len(long) == 2 * 2 + 1 * 2  # steps x metrics per run
    row = long[(long.run == "ar") & (long.metric == "reward/mean")].iloc[0]
    assert row.method == "GRPO+AR" and row.step == 1 and row.value == 0.5
    only = compare([tmp_path / "grpo"], metrics=["acc/all"])
    assert set(only.metric) == {"acc/all"}
    pivot = long.pivot_table(index=["method", "step"], columns="metric", values="value")
    assert isinstance(pivot, pd.DataFrame) and pivot.shape == (3, 2)
    _make_run(tmp_path / "other" / "grpo", None, [2.0])  # same folder name: runs are told apart by path
    clash = compare([tmp_path / "grpo", tmp_path / "other" / "grpo"])
    assert clash.run.nunique() == 2
    assert compare([]).empty


def test_checkpoint_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    assert latest_checkpoint(tmp_path) is None
    folder = save_checkpoint(tmp_path, 7, model, optimizer)
    assert latest_checkpoint(tmp_path) == folder and folder.name == "step_7"
    expected = (random.random(), np.random.rand(), torch.rand(2))
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    clone = torch.nn.Linear(3, 2)
    clone_opt = torch.optim.AdamW(clone.parameters(), lr=0.1)
    random.random(), np.random.rand(), torch.rand(5)  # move every RNG on
    assert load_checkpoint(folder, clone, clone_opt) == 7
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(2), expected[2])
    assert all(torch.equal(saved[k], v) for k, v in clone.state_dict().items())
    assert clone_opt.state_dict()["state"][0]["step"] == 1

    with pytest.raises(ValueError, match="trainable"):
        load_checkpoint(folder, torch.nn.Linear(3, 3, bias=False))
    with pytest.raises(FileNotFoundError, match=r"state\.json"):
        load_checkpoint(tmp_path, clone)


# --- crash consistency ----------------------------------------------------------------------------------------------


def _run_with_checkpoints(path, steps=5, every=2):
    """A real run folder in miniature: a Linear layer trained `steps` steps, a record per step, checkpoints at
    every `every` steps (in train's order: the record first, then the checkpoint)."""
    folder = RunFolder(path)
    folder.write_config({"ar_alpha": None, "lopti_eta": None})
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        folder.log({"step": step, "reward/mean": float(step)})
        if step % every == 0:
            save_checkpoint(path, step, model, optimizer)
    return folder, model, optimizer


def test_durable_writes_come_in_the_stated_order(tmp_path, monkeypatch):
    """Record, then every checkpoint file into step_k.partial, state.json last, the folder rename, then `latest`:
    each through lopti_lab.durable, and file and folder fsynced."""
    from lopti_lab import durable

    calls = []
    for op in ("write", "append", "replace"):
        real = getattr(durable, op)
        monkeypatch.setattr(durable, op, lambda *a, _op=op, _real=real: calls.append((_op, *map(_name, a[:2]))) or
                            _real(*a))  # fmt: skip
    real_fsync = durable.os.fsync
    monkeypatch.setattr(durable.os, "fsync", lambda fd: calls.append(("fsync",)) or real_fsync(fd))
    model = torch.nn.Linear(3, 2)
    folder = RunFolder(tmp_path)
    folder.log({"step": 1})
    save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(model.parameters()))
    ops = [c[:2] for c in calls if c[0] != "fsync"]
    assert ops == [("append", "metrics.jsonl"), ("write", "model.safetensors"), ("write", "optimizer.pt"),
                   ("write", "rng.pt"), ("write", "state.json"), ("replace", "step_1.partial"),
                   ("write", "latest.tmp"), ("replace", "latest.tmp")]  # fmt: skip
    renames = [c for c in calls if c[0] == "replace"]
    assert [c[2] for c in renames] == ["step_1", "latest"]
    for i, call in enumerate(calls):  # the file (write, append) or the folder (replace) is fsynced at once
        if call[0] != "fsync":
            assert calls[i + 1] == ("fsync",), call
    state = json.loads((tmp_path / "checkpoints" / "step_1" / "state.json").read_text())
    assert set(state["files"]) == {"model.safetensors", "optimizer.pt", "rng.pt"}


def _name(p):
    return getattr(p, "name", "") if not isinstance(p, bytes) else ""


def test_a_crash_inside_a_checkpoint_leaves_the_previous_one_latest(tmp_path, monkeypatch):
    from lopti_lab import durable
    from lopti_lab.resume import check_resume, repair_for_resume

    folder, model, optimizer = _run_with_checkpoints(tmp_path, steps=4)
    folder.log({"step": 5, "reward/mean": 5.0})
    real = durable.replace

    def crash_at_rename(src, dst):
        if dst.name == "step_6":
            raise KeyboardInterrupt("power cut")  # the rename never happens
        real(src, dst)

    monkeypatch.setattr(durable, "replace", crash_at_rename)
    folder.log({"step": 6, "reward/mean": 6.0})
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 6, model, optimizer)
    assert (tmp_path / "checkpoints" / "step_6.partial" / "state.json").is_file()  # complete, but never committed
    point = check_resume(tmp_path)
    assert point.step == 4 and point.checkpoint.name == "step_4"
    assert [r["step"] for r in point.records] == [1, 2, 3, 4]
    repair_for_resume(tmp_path, point)
    assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_2", "step_4"]


def test_a_torn_last_line_is_reported_and_its_step_redone(tmp_path):
    from lopti_lab.resume import check_resume, repair_for_resume

    folder, *_ = _run_with_checkpoints(tmp_path, steps=4)
    with folder.metrics_path.open("ab") as f:
        f.write(b'{"step": 5, "rew')  # a kill inside step 5's append
    with pytest.warns(UserWarning, match=r"metrics\.jsonl line 5: torn last line \(16 bytes\)"):
        assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2, 3, 4]
    point = check_resume(tmp_path)
    assert point.step == 4 and any("line 5: a torn last line" in n for n in point.notes)
    repair_for_resume(tmp_path, point)
    assert folder.metrics_path.read_bytes().endswith(b'"reward/mean": 4.0}\n')  # the torn bytes are gone


def test_a_lost_last_line_falls_back_to_the_checkpoint_the_records_cover(tmp_path):
    """The issue's power cut: record 4 is gone but checkpoint 4 survived. Resuming from step_4 would leave step 4
    without a record (1 2 3 5 ...); the resume goes back to step_2 and redoes steps 3-4."""
    from lopti_lab.resume import check_resume, repair_for_resume

    folder, *_ = _run_with_checkpoints(tmp_path, steps=4)
    lines = folder.metrics_path.read_bytes().splitlines(keepends=True)
    folder.metrics_path.write_bytes(b"".join(lines[:3]))
    point = check_resume(tmp_path)
    assert (point.step, point.checkpoint.name) == (2, "step_2")
    assert "checkpoint step_4 is ahead of metrics.jsonl (last record: step 3)" in point.notes[0]
    repair_for_resume(tmp_path, point)
    assert latest_checkpoint(tmp_path).name == "step_2" and not (tmp_path / "checkpoints" / "step_4").exists()
    assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2]
    folder.metrics_path.write_bytes(b"")  # no record covers any checkpoint: back to the initial weights
    point = check_resume(tmp_path)
    assert point.step == 0 and point.checkpoint is None


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.joinpath("metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 3}\n'),
         r"metrics\.jsonl line 2: not valid JSON"),
        (lambda p: p.joinpath("metrics.jsonl").write_text('{"step": 1}\n{"step": 1}\n'),
         r"metrics\.jsonl line 2: step 1 again"),
        (lambda p: p.joinpath("metrics.jsonl").write_text('{"step": 1}\n{"step": 3}\n'),
         r"metrics\.jsonl line 2: step 3 where step 2 is missing"),
        (lambda p: p.joinpath("metrics.jsonl").write_text('{"step": 1}\n[2]\n'),
         r"metrics\.jsonl line 2: a JSON list, not a record"),
        (lambda p: p.joinpath("config.json").write_text("{\n\n oops"), r"config\.json line 3: not valid JSON"),
        (lambda p: p.joinpath("checkpoints", "latest").write_text("step_9\n"), r"step_9 does not exist"),
        (lambda p: p.joinpath("checkpoints", "step_4", "optimizer.pt").write_bytes(b"x"),
         r"step_4/optimizer\.pt: 1 bytes, state\.json records \d+ \(a partial checkpoint\)"),
        (lambda p: p.joinpath("checkpoints", "step_4", "rng.pt").unlink(), r"step_4/rng\.pt is missing"),
        (lambda p: p.joinpath("config.json").unlink(), r"holds no run to resume \(a metrics\.jsonl but no config"),
    ],
)  # fmt: skip
def test_damage_is_an_error_naming_file_and_line(tmp_path, damage, message):
    from lopti_lab.resume import check_resume
    from lopti_lab.runs import RunFolderError

    _run_with_checkpoints(tmp_path, steps=4)
    damage(tmp_path)
    with pytest.raises(RunFolderError, match=message):
        check_resume(tmp_path)


def test_load_metrics_never_skips_a_damaged_line(tmp_path):
    from lopti_lab.runs import RunFolderError

    folder = _make_run(tmp_path / "a", None, [0.0, 1.0, 2.0])
    lines = folder.metrics_path.read_text().splitlines()
    folder.metrics_path.write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
    with pytest.raises(RunFolderError, match=r"metrics\.jsonl line 2: not valid JSON"):
        load_metrics(folder.path)
    folder.metrics_path.write_text("\n".join(lines))  # a complete last record without its newline is kept
    assert [r["step"] for r in load_metrics(folder.path)] == [1, 2, 3]
