"""trainer.py under failure: non-finite losses and gradients never reach the weights or the optimizer state, K of
them in a row stop a run that can still resume, and resuming repairs a folder a power cut left behind.

Same tiny random Qwen2 and fake reward as test_trainer.py (its ``config`` fixture)."""

import copy
import json
import math
from dataclasses import replace

import pytest
import torch
from test_trainer import config  # noqa: F401 (the fixture)

import lopti_lab.trainer as trainer
import lopti_lab.update as update
from lopti_lab import runs
from lopti_lab.kk import load_split
from lopti_lab.models import LoraSpec, load_policy, trainable_state_dict
from lopti_lab.train_config import TrainConfig
from lopti_lab.trainer import NonFiniteError, train, train_step


def _steady(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in runs.load_metrics(run_dir)]


def _same_state(a: dict, b: dict) -> bool:
    """Optimizer state dicts equal tensor for tensor (step counts, exp_avg, exp_avg_sq) and in their hyperparameters."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        torch.equal(torch.as_tensor(x), torch.as_tensor(y))
        for key in a["state"]
        for x, y in zip(a["state"][key].values(), b["state"][key].values(), strict=True)
    )


def _nan_loss(real):
    def loss(*args, **kwargs):
        value, stats = real(*args, **kwargs)
        return value * float("nan"), stats

    return loss


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_nonfinite_step_leaves_weights_and_optimizer_state_unchanged(config, monkeypatch, where):  # noqa: F811
    """One good step fills AdamW's moments; then NaN in the loss (or inf in one parameter's gradient while the loss
    stays finite) for a whole step: the parameters and every optimizer tensor are those after the good step."""
    torch.manual_seed(0)
    model, tokenizer = load_policy(config.model, LoraSpec(r=4, alpha=8), device="cpu")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    puzzles = load_split("train", 3, limit=2)
    good = train_step(model, tokenizer, optimizer, puzzles, config)
    assert good["skipped/nonfinite"] == 0 and good["update/optimizer_steps"] == 2 and optimizer.state
    weights, state = trainable_state_dict(model), copy.deepcopy(optimizer.state_dict())

    real_loss, hook = update.policy_loss, None
    if where == "loss":
        monkeypatch.setattr(update, "policy_loss", _nan_loss(real_loss))
    else:
        lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
        hook = lora_b.register_hook(lambda grad: torch.full_like(grad, math.inf))
    bad = train_step(model, tokenizer, optimizer, puzzles, config)
    if hook is not None:
        hook.remove()
        assert math.isfinite(bad["loss/policy"])  # the loss was fine: the gradient alone was not
    assert bad["skipped/nonfinite"] == 1.0 and bad["update/optimizer_steps"] == 0
    assert all(torch.equal(weights[n], p) for n, p in trainable_state_dict(model).items())
    assert _same_state(state, optimizer.state_dict())
    assert all(p.grad is None for p in model.parameters())
    monkeypatch.setattr(update, "policy_loss", real_loss)
    again = train_step(model, tokenizer, optimizer, puzzles, config)  # the next finite step updates as usual
    assert again["skipped/nonfinite"] == 0 and not _same_state(state, optimizer.state_dict())


def test_k_nonfinite_steps_in_a_row_stop_the_run_which_can_resume(config, monkeypatch):  # noqa: F811
    """From step 2 on every loss is NaN; with max_nonfinite_steps=2 the run stops after step 3 with a message,
    saved at step 3 with the weights of step 1; once the cause is gone, the run resumes to the end."""
    cfg = replace(config, steps=5, max_nonfinite_steps=2, eval_people=())
    real = update.policy_loss
    after_step_1 = {}

    def poison_after_step_1(metrics):
        if metrics["step"] == 1:
            after_step_1.update(trainable_state_dict(captured["model"]))
            monkeypatch.setattr(update, "policy_loss", _nan_loss(real))

    captured = {}  # the run's model, to read its weights after step 1
    monkeypatch.setattr(trainer, "load_policy", _capturing(trainer.load_policy, captured))
    with pytest.raises(NonFiniteError, match=r"steps 2-3 \(2 in a row.*weights are those of step 1.*--resume") as err:
        train(cfg, callbacks=[poison_after_step_1])
    result = err.value.result
    assert result.stopped and [m["step"] for m in result.history] == [1, 2, 3]
    assert [m["skipped/nonfinite"] for m in result.history] == [0, 1, 1]
    assert runs.latest_checkpoint(cfg.run_dir).name == "step_3"
    assert all(torch.equal(after_step_1[n], p) for n, p in trainable_state_dict(result.model).items())

    monkeypatch.setattr(update, "policy_loss", real)
    resumed = train(cfg, resume=True)
    assert [r["step"] for r in runs.load_metrics(resumed.run_dir)] == [1, 2, 3, 4, 5]
    assert [m["skipped/nonfinite"] for m in resumed.history[3:]] == [0, 0]


def _capturing(load, captured):
    def wrapper(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        captured["model"] = model
        return model, tokenizer

    return wrapper


def test_max_nonfinite_steps_zero_never_stops(config, monkeypatch):  # noqa: F811
    monkeypatch.setattr(update, "policy_loss", _nan_loss(update.policy_loss))
    result = train(replace(config, steps=3, max_nonfinite_steps=0, eval_people=()))
    assert [m["skipped/nonfinite"] for m in result.history] == [1, 1, 1] and not result.stopped


def test_a_lost_last_line_is_redone_not_skipped(config, tmp_path):  # noqa: F811
    """The issue's power cut: metrics.jsonl lost step 6's line while checkpoint 6 survived. The resumed run used to
    end with steps 1 2 3 4 5 7; now it goes back to checkpoint 4, redoes 5 and 6, and equals a straight run."""
    cfg = replace(config, steps=7, save_every=2, eval_people=())
    straight = train(replace(cfg, run_dir=str(tmp_path / "straight")))
    broken = replace(cfg, run_dir=str(tmp_path / "broken"))
    train(replace(broken, steps=6))
    metrics = tmp_path / "broken" / runs.METRICS
    metrics.write_bytes(b"".join(metrics.read_bytes().splitlines(keepends=True)[:5]))
    assert runs.latest_checkpoint(broken.run_dir).name == "step_6"
    train(broken, resume=True)
    assert [r["step"] for r in runs.load_metrics(broken.run_dir)] == list(range(1, 8))
    assert _steady(broken.run_dir) == _steady(straight.run_dir)


def test_cli_resume_needs_a_run_and_reads_its_config(config, tmp_path, capsys):  # noqa: F811
    from lopti_lab.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--run-dir", str(empty), "--resume"]) == 2
    assert "holds no run to resume (no config.json)" in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2
    assert "--resume needs --run-dir" in capsys.readouterr().err

    runs.RunFolder(config.run_dir).write_config(replace(config, steps=1, eval_people=()).to_dict())
    # no other option: the run's own config.json supplies them (steps may change on resume)
    assert main(["train", "--run-dir", config.run_dir, "--resume", "--steps", "2"]) == 0
    assert [r["step"] for r in runs.load_metrics(config.run_dir)] == [1, 2]
    saved = TrainConfig.from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
    assert saved.steps == 2 and saved.lora_r == config.lora_r
    assert main(["train", "--run-dir", config.run_dir, "--resume", "--lr", "0.5"]) == 2
    assert "config differs" in capsys.readouterr().err
