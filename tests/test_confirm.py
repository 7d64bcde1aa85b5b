"""`lopti-lab confirm`: the confirmatory study's config is the pre-registered one (docs/hard_lab.md), its evaluation
schedule leaves every other run as it was, every run folder records its start and end, and the smoke version runs
end to end with the schedule's evaluations."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from lopti_lab import runs, trainer
from lopti_lab.studies import run as study_run
from lopti_lab.studies.config import CONFIRM_PRIMARY, HARD_TRAIN, ConfirmConfig
from lopti_lab.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
LAB_HARD = ROOT / "data" / "lab_model_hard" / "model.safetensors"
EVAL_FIELDS = ("eval_people", "eval_size", "eval_samples", "eval_full_steps", "eval_full_samples")


def test_the_confirm_config_is_the_pre_registered_one():
    """GRPO, AR and Lopti x seeds 5-14 (none of the exploratory study's 0-4), the hard lab's training settings
    unchanged, evaluated at 2 and 3 people: 100 x 8 sampled plus greedy at 40, 50, 60, 100 x 2 at 10, 20, 30."""
    config = ConfirmConfig()
    assert config.methods == ("GRPO", "GRPO+AR", "GRPO+Lopti") and config.seed_list == tuple(range(5, 15))
    assert not set(config.seed_list) & set(range(5)) and config.out == "reports/hard_lab_confirm"
    training = {k: v for k, v in HARD_TRAIN.items() if k not in EVAL_FIELDS}
    assert {k: getattr(config.train, k) for k in training} == training
    train = config.train
    assert (train.eval_people, train.eval_size, train.eval_modes) == ((2, 3), 100, ("greedy", "sample"))
    assert [train.eval_spec(k).samples for k in (10, 20, 30, 40, 50, 60)] == [2, 2, 2, 8, 8, 8]
    assert [k for k in range(1, 61) if train.evaluates_at(k)] == [10, 20, 30, 40, 50, 60]
    assert config.curve_steps() == (10, 20, 30) and config.PRIMARY_COMPARISONS == CONFIRM_PRIMARY
    run = config.train_config("GRPO+AR", 7, Path("x"))
    assert (run.seed, run.ar_alpha, run.lopti_eta, run.eval_spec(50).seed) == (7, 0.3, None, 7)
    assert set(config.run_dirs()) == {(m, s) for m in config.methods for s in range(5, 15)}
    assert ConfirmConfig(with_ar_lopti=True).methods[-1] == "GRPO+AR+Lopti"
    page = (ROOT / "docs" / "hard_lab.md").read_text(encoding="utf-8")
    assert "## Confirmatory study: pre-registration" in page and "`lopti-lab confirm --threads 2`" in page


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"first_seed": -1}, "ConfirmConfig.first_seed"),
        ({"methods": ("GRPO+AR",)}, "ConfirmConfig.methods"),
        ({"train": {"steps": 30}}, "ConfirmConfig.train.eval_full_steps"),
        ({"train": {"eval_full_samples": 0}}, "ConfirmConfig.train.eval_full_samples"),
        ({"with_ar_lopti": "yes"}, "ConfirmConfig.with_ar_lopti"),
    ],
)
def test_a_bad_confirm_field_is_refused_by_name(fields, named):
    with pytest.raises(ValueError, match="^" + re.escape(named) + " "):
        ConfirmConfig(**fields)


def test_the_schedule_at_its_defaults_is_the_old_one():
    """eval_full_steps () evaluates exactly where eval_every did, with the one spec; a config.json written before
    the fields existed loads to the same config."""
    for every, steps in ((0, 7), (3, 10), (50, 100)):
        cfg = TrainConfig(eval_every=every, steps=steps)
        old = [k for k in range(1, steps + 1) if k == steps or (every and k % every == 0)]
        assert [k for k in range(1, steps + 1) if cfg.evaluates_at(k)] == old
        assert all(cfg.eval_spec(k) == cfg.eval_spec() for k in range(1, steps + 1))
    assert not TrainConfig(eval_people=()).evaluates_at(100)
    saved = TrainConfig(model="lab", lora_r=None).to_dict()
    for name in ("eval_full_steps", "eval_full_samples"):
        del saved[name]
    assert TrainConfig.from_dict(saved) == TrainConfig(model="lab", lora_r=None)
    full = TrainConfig(steps=10, eval_every=0, eval_samples=2, eval_full_steps=[4, 8], eval_full_samples=8)
    assert full.eval_full_steps == (4, 8) and [k for k in range(1, 11) if full.evaluates_at(k)] == [4, 8, 10]
    assert (full.eval_spec(4).samples, full.eval_spec(10).samples, full.eval_spec().samples) == (8, 2, 2)


def test_times_keep_the_first_start_and_list_each_session(tmp_path):
    folder = runs.RunFolder(tmp_path)
    assert runs.load_times(tmp_path) is None
    first = folder.mark("start")
    assert first["end"] is None and first["sessions"] == [[first["start"], None]]
    assert first["saved"] == [None]
    saved = folder.mark("saved")["saved"]  # a checkpoint, then a kill: the session keeps its work up to then
    folder.mark("start")  # a resume after a kill: the killed session keeps no end
    ended = folder.mark("end")
    assert ended["start"] == first["start"] and len(ended["sessions"]) == 2
    assert ended["sessions"][0][1] is None and ended["sessions"][1][1] == ended["end"] >= ended["start"]
    assert ended["saved"] == [saved[0], None] and saved[0] >= first["start"]
    assert runs.load_times(tmp_path) == ended
    with pytest.raises(ValueError, match="'saved'"):
        folder.mark("stop")
    old = {"start": first["start"], "end": None, "sessions": [[first["start"], None]]}  # before checkpoint times
    (tmp_path / runs.TIMES).write_text(json.dumps(old))
    assert folder.mark("start")["saved"] == [None, None]
    (tmp_path / runs.TIMES).write_text("[1, 2]")
    with pytest.raises(runs.RunFolderError, match=r"times\.json"):
        runs.load_times(tmp_path)


@pytest.mark.skipif(not (ROOT / "data" / "lab_model" / "config.json").is_file(), reason="needs the lab model")
def test_train_records_its_times_and_a_resume_keeps_the_first_start(tmp_path):
    tiny = {"prompts_per_step": 2, "group_size": 2, "minibatch_size": 4, "max_new_tokens": 16, "eval_people": ()}
    cfg = TrainConfig(model="lab", lora_r=None, steps=1, save_every=1, progress=False, run_dir=str(tmp_path), **tiny)
    trainer.train(cfg)
    first = runs.load_times(cfg.run_dir)
    assert first["start"] <= first["end"] and first["sessions"] == [[first["start"], first["end"]]]
    assert first["start"] <= first["saved"][0] <= first["end"]  # its one checkpoint (save_every 1)
    trainer.train(replace(cfg, steps=2), resume=True)
    again = runs.load_times(cfg.run_dir)
    assert again["start"] == first["start"] and again["end"] >= first["end"] and len(again["sessions"]) == 2
    assert again["sessions"][0] == first["sessions"][0] and again["sessions"][1][1] == again["end"]


@pytest.mark.skipif(not LAB_HARD.is_file(), reason="needs the bundled hard lab model")
def test_confirm_quick_runs_end_to_end_with_its_schedule_and_times(tmp_path, monkeypatch):
    """The smoke version, 2 steps x 2 seeds (5, 6), in this process: step 1 gets the curve evaluation (1 sample per
    puzzle), step 2 the full one (2 samples); every run folder has its start and end; the report holds the primary
    comparisons (those whose method ran: Lopti at 2 people, the smoke version's one count)."""
    calls = []
    real = trainer.evaluate

    def spy(model, tokenizer, puzzles, spec=None, **kw):
        calls.append(spec.samples)
        return real(model, tokenizer, puzzles, spec, **kw)

    monkeypatch.setattr(trainer, "evaluate", spy)
    config = ConfirmConfig(quick=True, workers=1, seeds=2, methods=("GRPO", "GRPO+Lopti"), out=str(tmp_path / "c"))
    # the smallest run that takes every path of the schedule (Fig. 3's measurement has tests of its own)
    small = {"prompts_per_step": 2, "minibatch_size": 8, "max_new_tokens": 96, "eval_size": 2, "shift_every": 0}
    config.train = replace(config.train, **small)
    out = study_run.run_demo(config)
    assert calls == [1, 2] * 4  # 2 methods x seeds 5, 6, in training order
    for (_, seed), folder in config.run_dirs().items():
        assert seed in (5, 6) and json.loads((folder / runs.CONFIG).read_text())["seed"] == seed
        times = runs.load_times(folder)
        assert times["start"] <= times["end"] and len(times["sessions"]) == 1
    curves = pd.read_csv(out / "curves_sample.csv")
    assert sorted(curves.query("model == '+ GRPO'")["seed"].unique()) == [5, 6]
    primary = pd.read_csv(out / "primary.csv")
    assert list(zip(primary["method"], primary["column"], strict=True)) == [("GRPO+Lopti", "2ppl")]
    assert "pre-registered primary comparisons" in (out / "report.md").read_text()


def test_the_budget_estimate_by_hand():
    """CPU seconds: greedy 10, full sampled 100, curve sampled 20, a plain step 6, a probed step 18. A run: 54 x 6 +
    6 x 18 = 432 s of training (Lopti 1.4x: 604.8), 3 x 110 + 3 x 30 = 420 s of evaluation; a seed: 852 + 852 +
    1024.8 + the warm start's 30 = 2758.8 s; 10 seeds: 27,588 s = 459.8 CPU minutes, 229.9 on two cores."""
    from lopti_lab.studies.budget import estimate

    cost = {"greedy": {"cpu_s": 10}, "sample_full": {"cpu_s": 100}, "sample_curve": {"cpu_s": 20},
            "steps": [{"cpu_s": 6}, {"cpu_s": 18}]}  # fmt: skip
    got = estimate(cost, ConfirmConfig())
    assert got == pytest.approx({"run_train_min": 7.2, "run_eval_min": 7.0, "study_cpu_min": 459.8,
                                 "study_wall_min": 229.9})  # fmt: skip


def test_the_confirm_command_builds_its_config_and_refuses_a_bad_field(capsys):
    """`lopti-lab confirm`: one option per ConfirmConfig field (and its train's), a bad one refused by name, exit 2,
    before any model loads."""
    from lopti_lab.cli import USAGE_ERROR, main

    assert main(["confirm", "--first-seed", "-1"]) == USAGE_ERROR
    assert "ConfirmConfig.first_seed" in capsys.readouterr().err
    assert main(["confirm", "--steps", "30"]) == USAGE_ERROR
    assert "ConfirmConfig.train.eval_full_steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["confirm", "--help"])
    help_text = capsys.readouterr().out
    assert "--with-ar-lopti" in help_text and "--eval-full-steps" in help_text and "--seed " not in help_text


def test_the_reports_first_table_says_how_many_samples_each_row_scored():
    """The confirmatory study's last step is a full evaluation (8 per puzzle) and its warm start a curve one (2): the
    report's heading said 2 for both; the demo scores 2 everywhere."""
    from lopti_lab.studies.config import ConfirmConfig, DemoConfig
    from lopti_lab.studies.report import _samples_text

    assert _samples_text(ConfirmConfig().train) == "8 per puzzle; the warm start 2"
    assert _samples_text(DemoConfig().train) == "2 per puzzle"
