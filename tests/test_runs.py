"""runs.py: method labels, the metrics log, tidy loading and comparison, checkpoints with RNG states."""

import json
import random

import numpy as np
import pandas as pd
import pytest
import torch

from lopti_lab.runs import (
    RunFolder,
    compare,
    latest_checkpoint,
    load_checkpoint,
    load_metrics,
    load_run,
    method_label,
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
        f.write('{"step": 3, "rew')  # a run killed mid-write
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
