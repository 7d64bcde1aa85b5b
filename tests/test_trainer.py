"""trainer.py: config validation, 2-step smoke runs of GRPO / AR / Lopti / AR+Lopti on a tiny random Qwen2, the Lopti
stage order, resume == straight run, non-finite steps, callbacks, evaluation and the CLI.

The tiny random model never solves a puzzle, so the runs score completions with a fake reward (a hash of the text:
3 or -0.5) that gives groups nonzero advantages; the real reward has its own tests (test_kk_reward.py).
"""

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch
from tiny import fake_score, tiny_qwen2, tiny_tokenizer

import lopti_lab.trainer as trainer
import lopti_lab.update as update
from lopti_lab import evaluate as evaluation
from lopti_lab import runs
from lopti_lab.evaluate import evaluate
from lopti_lab.kk import Reward, build_prompt, load_split
from lopti_lab.methods import METHODS, ORDER
from lopti_lab.models import LoraSpec, load_policy, trainable_state_dict
from lopti_lab.train_config import TrainConfig
from lopti_lab.trainer import train, train_step
from lopti_lab.update import update_policy

VARIANTS = {label: METHODS[label].overrides() for label in ORDER}  # the paper's four and the methods after it
REQUIRED = [
    "step", "reward/mean", "reward/std", "acc/all", "format/error_rate", "len/response_mean", "groups/zero_var_share",
    "policy/entropy", "policy/approx_kl", "policy/clip_frac_low", "policy/clip_frac_high", "policy/kl", "loss/policy",
    "grad/norm", "update/optimizer_steps", "skipped/nonfinite", "time/generate", "time/score", "time/update",
]  # fmt: skip


@pytest.fixture()
def config(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluation, "score_response", fake_score)
    return TrainConfig(
        model=str(model_dir),
        lora_r=4,
        lora_alpha=8,
        prompt_style="base",  # the shortest prompt: fits the tiny model's 512 positions with room to answer
        train_people=(3, 4),
        train_limit=8,
        eval_people=(3,),
        eval_size=2,
        eval_modes=("greedy",),
        eval_every=0,
        prompts_per_step=2,
        group_size=4,
        minibatch_size=4,
        max_new_tokens=10,
        lr=5e-3,
        steps=2,
        save_every=0,
        run_dir=str(tmp_path / "run"),
        progress=False,
    )


def _base_weights_unchanged(model, model_dir) -> bool:
    original = tiny_qwen2(len(tiny_tokenizer())).state_dict()
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if not torch.equal(param.detach(), original[key]):
            return False
    return True


@pytest.mark.parametrize("method", list(VARIANTS))
def test_two_steps_train_the_adapter_only(config, model_dir, method):
    cfg = replace(config, **VARIANTS[method])
    assert cfg.method == method
    result = train(cfg)

    lora_b = [p for n, p in result.model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # LoRA B starts at zero: it moved
    assert _base_weights_unchanged(result.model, model_dir)
    assert [m["step"] for m in result.history] == [1, 2]
    for metrics in result.history:
        assert set(REQUIRED) <= set(metrics)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["skipped/nonfinite"] == 0
        stages = 2 if cfg.lopti_eta else 1
        assert metrics["update/optimizer_steps"] == stages * 2  # 2 minibatches of 4 rows per stage
    assert result.history[-1]["policy/kl"] > 0  # step 2 starts away from the reference
    assert "eval/greedy/acc_3ppl" in result.history[-1] and "eval/greedy/acc_all" in result.history[-1]
    assert ("ar/weight_mean" in result.history[0]) == bool(cfg.ar_alpha)
    assert ("lopti/low_share" in result.history[0]) == bool(cfg.lopti_eta)
    assert ("forking/share" in result.history[0]) == (cfg.forking_rho is not None)
    assert ("entadv/bonus_mean" in result.history[0]) == (cfg.entropy_adv_alpha is not None)

    run = result.run_dir
    assert json.loads((run / "config.json").read_text()) == cfg.to_dict()
    assert [r["step"] for r in runs.load_metrics(run)] == [1, 2]
    checkpoint = runs.latest_checkpoint(run)
    assert checkpoint.name == "step_2"
    assert {p.name for p in checkpoint.iterdir()} == {"adapter", "optimizer.pt", "rng.pt", "state.json"}
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    df = runs.load_run(run)
    assert df.attrs["method"] == method and list(df["step"]) == [1, 2]


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_lopti_updates_all_low_minibatches_then_all_high(config, monkeypatch, order):
    """Spies: the stage masks that reach policy_loss, the old_logp they see, and optimizer.step calls. Each call
    gets the stage's tokens with a nonzero advantage, on the rows that have one (the update skips the rest)."""
    stage_masks, calls, steps, seen = {}, [], [], {}
    real_stages, real_loss, real_step = update.lopti_stages, update.policy_loss, torch.optim.AdamW.step
    real_split = trainer.advantages_and_stages
    n_reweight = []

    def spy_stages(old_logp, mask, eta, order):
        stages = real_stages(old_logp, mask, eta, order)
        stage_masks.update({name: m for name, m in stages})
        return stages

    def spy_split(rollout, advantages, cfg):
        seen.update(old_logp=rollout.old_logp.clone(), advantages=advantages.clone())
        return real_split(rollout, advantages, cfg)

    def spy_loss(logp, old_logp, advantages, mask, **kw):
        calls.append((mask.clone(), old_logp.clone(), kw["denom"].item()))
        return real_loss(logp, old_logp, advantages, mask, **kw)

    def spy_step(self, *args, **kwargs):
        steps.append(len(calls))
        return real_step(self, *args, **kwargs)

    def spy_reweight(*args):
        n_reweight.append(1)
        return trainer_reweight(*args)

    trainer_reweight = update.reweight_advantages
    monkeypatch.setattr(update, "lopti_stages", spy_stages)
    monkeypatch.setattr(trainer, "advantages_and_stages", spy_split)
    monkeypatch.setattr(update, "policy_loss", spy_loss)
    monkeypatch.setattr(torch.optim.AdamW, "step", spy_step)
    monkeypatch.setattr(update, "reweight_advantages", spy_reweight)
    # eta near the random tiny model's median token probability (about 1 / 300), so both stages get tokens
    cfg = replace(config, ar_alpha=0.3, lopti_eta=0.003, lopti_order=order, steps=1, eval_people=())
    result = train(cfg)

    first, second = ("low", "high") if order == "low_first" else ("high", "low")
    moving = seen["advantages"] != 0  # (B,)
    expected = []  # per minibatch in update order: (stage tokens with a gradient, their rows)
    for name in (first, second):
        for rows in (slice(0, 4), slice(4, 8)):
            acting = stage_masks[name][rows].bool() & moving[rows, None]  # (4, T)
            kept = acting.any(1).nonzero()[:, 0] + rows.start
            expected.append((acting[kept - rows.start], kept))
    ran = [e for e in expected if len(e[1])]
    assert all(m.any() for m in stage_masks.values()) and len(ran) == 4  # every minibatch of both stages ran
    assert len(calls) == len(ran)
    for (mask, old_logp, _), (acting, kept) in zip(calls, ran, strict=True):
        assert torch.equal(mask.bool(), acting)
        assert torch.equal(old_logp, seen["old_logp"][kept])  # both stages read pi_old from before the update
    assert steps == list(itertools.accumulate(int(len(kept) > 0) for _, kept in expected))  # 2 steps per stage
    assert result.history[0]["update/optimizer_steps"] == 4
    full = [(stage_masks["low"] + stage_masks["high"])[rows].sum().item() for rows in (slice(0, 4), slice(4, 8))]
    denoms = [d for (_, kept), d in zip(expected, full + full, strict=True) if len(kept)]
    assert [c[2] for c in calls] == denoms  # each stage's token mean divides by ALL response tokens
    assert len(n_reweight) == 1  # AR weights computed once per step, shared by both stages


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_resume_reproduces_a_straight_run(config, tmp_path, optimizer):
    """4 straight steps == 2 steps, a stop, and a resume for 2 more (same metrics.jsonl, timings aside), under either
    optimizer (AdamW's moments and SGD's lack of them are both restored from the checkpoint)."""
    cfg = replace(config, ar_alpha=0.3, lopti_eta=0.5, steps=4, save_every=2, eval_every=2, optimizer=optimizer)
    straight = train(replace(cfg, run_dir=str(tmp_path / "straight")))
    split = replace(cfg, run_dir=str(tmp_path / "split"))
    first = train(split, callbacks=[lambda m: m["step"] == 2])
    assert first.stopped and [m["step"] for m in first.history] == [1, 2]
    second = train(split, resume=True)
    assert [m["step"] for m in second.history] == [1, 2, 3, 4]

    def values(run):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in runs.load_metrics(run)]

    assert values(straight.run_dir) == values(second.run_dir)
    for a, b in zip(trainable_state_dict(straight.model).values(), trainable_state_dict(second.model).values()):
        assert torch.equal(a, b)


def test_sgd_is_plain_sgd_without_momentum():
    """optimizer="sgd": each step moves a weight by lr x (its gradient + weight_decay x weight) and nothing else, no
    momentum from the step before (the paper's Fig. 1 / Fig. 3 optimizer); AdamW-only settings are refused by name."""
    from lopti_lab.update import OptimizerSpec, build_optimizer

    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    cfg = TrainConfig(optimizer="sgd", lr=0.1, weight_decay=0.01)
    optimizer = build_optimizer([weight], cfg.optimizer_spec())
    assert isinstance(optimizer, torch.optim.SGD)
    expected = weight.detach().clone()
    for grad in (torch.tensor([0.5, 0.0, -1.0]), torch.tensor([0.0, 2.0, 0.0])):
        weight.grad = grad.clone()
        optimizer.step()
        expected = expected - 0.1 * (grad + 0.01 * expected)
        torch.testing.assert_close(weight.detach(), expected, rtol=0, atol=1e-7)
    assert isinstance(build_optimizer([weight], OptimizerSpec()), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"TrainConfig\.adam_eps is an AdamW setting"):
        TrainConfig(optimizer="sgd", adam_eps=1e-3)
    with pytest.raises(ValueError, match=r"TrainConfig\.optimizer must be one of"):
        TrainConfig(optimizer="lion")


@pytest.mark.parametrize("method", ["GRPO+Forking", "GRPO+CISPO", "GRPO+Clip-Cov", "GRPO+KL-Cov", "GRPO+EntAdv"])
def test_each_method_after_the_paper_runs_its_own_function(config, monkeypatch, method):
    """The trainer's update reaches the method's own function in token_credit (no copy in the trainer), once per
    step for the step-wide ones (forking mask, entropy advantage) and once per micro-batch for the losses."""
    from lopti_lab import token_credit

    fn = {"GRPO+Forking": "forking_mask", "GRPO+CISPO": "cispo_loss", "GRPO+Clip-Cov": "clip_cov_loss",
          "GRPO+KL-Cov": "kl_cov_loss", "GRPO+EntAdv": "entropy_advantage"}[method]  # fmt: skip
    calls = []
    real = getattr(token_credit, fn)
    monkeypatch.setattr(update, fn, lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = replace(config, **METHODS[method].overrides(), steps=1, eval_people=())
    metrics = train(cfg).history[0]
    per_step = fn in ("forking_mask", "entropy_advantage")
    acting = metrics["groups/zero_var_share"] < 1.0  # a step whose groups all tie updates nothing
    assert len(calls) == (1 if per_step else 2 * acting), (method, calls)


def test_resume_cuts_metrics_back_to_the_checkpoint(config):
    cfg = replace(config, steps=3, save_every=1)
    train(replace(cfg, steps=2))
    with open(f"{cfg.run_dir}/metrics.jsonl", "a") as f:  # a step 3 that never reached a checkpoint
        f.write(json.dumps({"step": 3, "reward/mean": 0.0}) + "\n")
    result = train(cfg, resume=True)
    assert [r["step"] for r in runs.load_metrics(result.run_dir)] == [1, 2, 3]
    assert "loss/policy" in runs.load_metrics(result.run_dir)[-1]
    with pytest.raises(ValueError, match="lr"):
        train(replace(cfg, lr=1.0), resume=True)


def test_nonfinite_loss_skips_the_step_and_leaves_weights(config, monkeypatch):
    real_loss = update.policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(update, "policy_loss", nan_loss)
    torch.manual_seed(0)
    model, tokenizer = load_policy(config.model, LoraSpec(r=4), device="cpu")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1.0)
    before = trainable_state_dict(model)
    puzzles = load_split("train", 3, limit=2)
    metrics = train_step(model, tokenizer, optimizer, puzzles, config)
    assert metrics["skipped/nonfinite"] == 1.0 and metrics["update/optimizer_steps"] == 0
    assert all(torch.equal(before[n], p) for n, p in trainable_state_dict(model).items())
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state  # AdamW moments untouched too


def test_callback_stop_ends_cleanly_with_a_checkpoint(config):
    seen = []
    result = train(replace(config, steps=5), callbacks=[lambda m: seen.append(m["step"]), lambda m: True])
    assert seen == [1] and result.stopped and len(result.history) == 1
    assert runs.latest_checkpoint(result.run_dir).name == "step_1"


def test_full_finetune_checkpoint_round_trip(config):
    result = train(replace(config, lora_r=None, steps=1, kl_coef=0.01, eval_people=()))
    checkpoint = runs.latest_checkpoint(result.run_dir)
    assert (checkpoint / "model.safetensors").is_file()
    model, _, cfg = trainer.load_trained(result.run_dir, device="cpu")
    assert cfg.lora_r is None
    for (name, a), b in zip(model.state_dict().items(), result.model.state_dict().values()):
        assert torch.equal(a, b), name


BAD = [
    ("ar_alpha", 1.5),
    ("ar_alpha", -0.1),
    ("lopti_eta", 0.0),
    ("lopti_eta", 1.0),
    ("group_size", 1),
    ("minibatch_size", 3),  # does not divide B = 2 x 4
    ("micro_batch_size", 3),
    ("adam_eps", 0.0),
    ("warmup_steps", -1),
    ("lopti_order", "middle"),
    ("prompt_style", "poem"),
    ("temperature", 0.0),
    ("dual_clip", 0.5),
    ("probe_bins", (0.0, 0.5)),
    ("train_people", ()),
    ("eval_modes", ("beam",)),
    ("data_root", "/no/such/folder"),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_bad_config_names_the_field(config, field, value):
    with pytest.raises(ValueError, match=field):
        replace(config, **{field: value})


def test_missing_model_path_and_taken_run_dir_fail_before_loading(config, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer, "load_policy", no_loading)
    with pytest.raises(ValueError, match="model"):
        replace(config, model=str(tmp_path / "nope"))
    runs.RunFolder(config.run_dir).write_config(config.to_dict())
    with pytest.raises(ValueError, match="run_dir"):
        train(config)


def test_config_round_trips_and_documents_every_field(config):
    again = TrainConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    docs = TrainConfig.field_docs()
    assert set(docs) == {f for f in config.to_dict()} and all(docs.values())
    with pytest.raises(ValueError, match="unknown"):
        TrainConfig.from_dict({"alpha": 0.3})


def test_evaluate_reports_accuracy_by_people(config, monkeypatch):
    monkeypatch.setattr(evaluation, "score_response", lambda text, p: Reward(3.0 if p.n_people == 3 else -3.0, 1, 2))
    model, tokenizer = load_policy(config.model, None, device="cpu")
    puzzles = load_split("test", [3, 4], limit=2)
    out = evaluate(model, tokenizer, puzzles, prompt_style="base", max_new_tokens=4, modes=("greedy", "sample"))
    assert out["eval/greedy/acc_3ppl"] == 1.0 and out["eval/greedy/acc_4ppl"] == 0.0
    assert out["eval/sample/acc_all"] == 0.5  # mean over people counts
    rng = torch.get_rng_state()
    evaluate(model, tokenizer, puzzles, prompt_style="base", max_new_tokens=4, modes=("sample",))
    assert torch.equal(rng, torch.get_rng_state())  # evaluation does not consume the training RNG


def test_accuracy_standard_errors(config, monkeypatch):
    """accuracy_se: the docstring's case (per-puzzle means 0.5, 1, 0, 0.5: sd 0.408 / sqrt 4 = 0.204), the binomial
    sqrt(p (1 - p) / (n - 1)) for one completion per puzzle; evaluate's _se keys, acc_all's from its strata."""
    import numpy as np

    correct = np.array([[1, 0], [1, 1], [0, 0], [1, 0]], dtype=float)
    assert evaluation.accuracy_se(correct) == pytest.approx(0.2041241452)
    assert evaluation.accuracy_se(np.array([[1.0], [0.0], [0.0], [1.0], [1.0]])) == pytest.approx(
        math.sqrt(0.6 * 0.4 / 4)
    )
    assert math.isnan(evaluation.accuracy_se(np.array([[1.0, 0.0]])))
    seen = []

    def alternating(text, puzzle):  # completions alternate right / wrong in the order they are scored
        seen.append(puzzle)
        return Reward(3.0 if len(seen) % 2 else -3.0, 1, 2)

    monkeypatch.setattr(evaluation, "score_response", alternating)
    model, tokenizer = load_policy(config.model, None, device="cpu")
    puzzles = load_split("test", [3, 4], limit=3)
    out = evaluate(model, tokenizer, puzzles, prompt_style="base", max_new_tokens=2, modes=("sample",), samples=2)
    # every puzzle has one right and one wrong completion: accuracy 0.5 with zero spread between puzzles
    assert out["eval/sample/acc_3ppl"] == 0.5 and out["eval/sample/acc_3ppl_se"] == 0.0
    out = evaluate(model, tokenizer, puzzles, prompt_style="base", max_new_tokens=2, modes=("greedy",))
    se3, se4 = out["eval/greedy/acc_3ppl_se"], out["eval/greedy/acc_4ppl_se"]
    assert se3 > 0 and out["eval/greedy/acc_all_se"] == pytest.approx(math.sqrt(se3**2 + se4**2) / 2)


def test_cli_train_and_eval(config, capsys):
    from lopti_lab.cli import main

    argv = ["train", "--model", config.model, "--lora-r", "none", "--ar", "0.3", "--lopti", "0.4", "--steps", "1",
            "--prompts-per-step", "2", "--group-size", "2", "--minibatch-size", "2", "--max-new-tokens", "4",
            "--train-people", "3", "--train-limit", "4", "--eval-people", "--prompt-style", "base",
            "--run-dir", config.run_dir, "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    saved = runs.load_config(config.run_dir)
    assert saved["ar_alpha"] == 0.3 and saved["lopti_eta"] == 0.4 and saved["lora_r"] is None
    assert "GRPO+AR+Lopti" in capsys.readouterr().out
    eval_argv = ["eval", "--run", config.run_dir, "--people", "3", "--size", "2", "--modes", "greedy",
                 "--max-new-tokens", "4", "--device", "cpu"]  # fmt: skip
    assert main(eval_argv) == 0
    assert "eval/greedy/acc_3ppl" in capsys.readouterr().out


def test_gradient_probe_metrics_every_k_steps(config):
    """With one minibatch and one micro-batch, the probe sees exactly the step's gradient: its norm is grad/norm."""
    cfg = replace(config, steps=2, probe_every=2, minibatch_size=8, eval_people=())
    history = train(cfg).history
    assert not any(k.startswith("grad/share") for k in history[0])  # step 1: not a probe step
    probed = history[1]
    shares = [probed[f"grad/share_bin{i}"] for i in range(4)] + [probed["grad/share_context"]]
    assert sum(shares) == pytest.approx(1.0, abs=1e-4)
    assert sum(probed[f"tokens/share_bin{i}"] for i in range(4)) == pytest.approx(1.0)
    assert probed["grad/norm_probed"] == pytest.approx(probed["grad/norm"], rel=1e-4)
    assert {"shift/correct_pos_bin0", "shift/n_neg_bin0", "shift/dp_mean_bin0"} <= set(probed)
    assert "shift/n_pos_bin0" not in history[0]


def test_the_probe_without_its_shift_gives_the_same_shares_and_no_shift(config):
    """probe_shift=False: the same step's gradient shares to the last bit (the float64 forwards do not touch the
    weights, the optimizer or the random stream), and no shift/ metrics, so the probe step costs only its hooks."""
    cfg = replace(config, steps=1, probe_every=1, minibatch_size=8, eval_people=())
    with_shift = train(cfg).history[0]
    alone = train(replace(cfg, probe_shift=False, run_dir=f"{cfg.run_dir}_alone")).history[0]
    shares = [k for k in with_shift if k.startswith(("grad/share", "tokens/share", "grad/norm"))]
    assert shares and {k: alone[k] for k in shares} == {k: with_shift[k] for k in shares}
    assert any(k.startswith("shift/") for k in with_shift) and not any(k.startswith("shift/") for k in alone)
    with pytest.raises(ValueError, match="probe_shift"):
        replace(cfg, probe_shift="no")


def test_gradient_probe_with_lopti_and_full_finetune(config):
    cfg = replace(config, lora_r=None, steps=1, probe_every=1, lopti_eta=0.5, micro_batch_size=2, eval_people=())
    metrics = train(cfg).history[0]
    assert all(math.isfinite(metrics[f"grad/share_bin{i}"]) for i in range(4))
    # a random model gives every token pi ~ 1 / V: all in bin 0 and all in Lopti's low stage
    assert metrics["tokens/share_bin0"] == 1.0 == metrics["lopti/low_share"]
    assert metrics["grad/share_bin0"] + metrics["grad/share_context"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("change", [{"micro_batch_size": 2}, {"gradient_checkpointing": True}])
def test_micro_batches_and_checkpointing_give_the_same_update(config, tmp_path, change):
    """Gradient accumulation over micro-batches (token mean over the whole minibatch) and activation checkpointing
    change the arithmetic's order only."""
    cfg = replace(config, steps=1, lopti_eta=0.5, eval_people=())
    plain = train(replace(cfg, run_dir=str(tmp_path / "plain")))
    other = train(replace(cfg, run_dir=str(tmp_path / "other"), **change))
    assert plain.history[0]["loss/policy"] == pytest.approx(other.history[0]["loss/policy"], abs=1e-6)
    for a, b in zip(trainable_state_dict(plain.model).values(), trainable_state_dict(other.model).values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fast_path", ["hf", "lean"])
def test_single_step_grpo_reuses_its_update_forward_as_pi_old(config, tmp_path, monkeypatch, fast_path):
    """One optimizer step per rollout (GRPO, minibatch = B): the update's own forward gives pi_old exactly, so the
    rollout's log-prob forward is skipped. AR with alpha = 0 is the same algorithm but must take pi_old before the
    update: from a log-prob forward on HF's path, from the decoder's sampling logits on the lean path (no forward at
    all). The runs must agree, and the first update's ratio must be 1: exactly on HF's path (the same forward
    arithmetic twice), to float32 rounding of the logits on the lean path (|log ratio| < 1e-5)."""
    cfg = replace(config, steps=2, minibatch_size=8, eval_people=(), kl_coef=0.0, fast_path=fast_path)
    calls, log_ratios = [], []
    real, real_loss = trainer.add_logprobs, update.policy_loss

    def spy_loss(logp, old_logp, *args, **kwargs):
        log_ratios.append((logp.detach() - old_logp).abs().max().item())
        return real_loss(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(trainer, "add_logprobs", lambda *a, **k: calls.append(k["policy"]) or real(*a, **k))
    fast = train(replace(cfg, run_dir=str(tmp_path / "fast")))
    monkeypatch.setattr(update, "policy_loss", spy_loss)
    slow = train(replace(cfg, run_dir=str(tmp_path / "slow"), ar_alpha=0.0))
    assert calls == ([False, False, True, True] if fast_path == "hf" else [False] * 4)
    assert len(log_ratios) == 2 and max(log_ratios) <= (0.0 if fast_path == "hf" else 1e-5)
    # loss/policy sums to ~0 at ratio 1 (group advantages sum to zero): its float32 rounding is ~1e-7 either way
    for a, b in zip(fast.history, slow.history, strict=True):
        for key in ("loss/policy", "grad/norm", "policy/entropy", "reward/mean", "policy/clip_frac_high"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6 if key == "loss/policy" else 1e-7), key
    # AdamW's first step is sign-like, so a weight whose gradient is near 0 amplifies a 1e-6 difference in pi_old
    atol, rtol = (1e-6, 1e-5) if fast_path == "hf" else (1e-5, 1e-4)
    for a, b in zip(trainable_state_dict(fast.model).values(), trainable_state_dict(slow.model).values()):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def test_shift_metrics_match_a_per_token_count(config):
    """After an update, shift/correct_pos_bin{i} is the share of bin i's A > 0 tokens that moved whose probability
    rose, counted here token by token from plain full forwards of float64 copies of the model before and after."""
    import copy

    from lopti_lab.rollout import sample

    model, tok = load_policy(config.model, LoraSpec(r=4, alpha=8))
    puzzles = load_split("train", 3, limit=2)
    torch.manual_seed(0)
    rollout = sample(model, tok, [build_prompt(p, "base") for p in puzzles], 4, max_new_tokens=6)
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 2.0, -2.0, 0.0])
    cfg = replace(config, temperature=1.0)
    ids, attn = rollout.input_ids, rollout.attention_mask
    positions = (attn.cumsum(-1) - 1).clamp(min=0)

    def probs_of_a_copy():
        with torch.no_grad():
            logits = copy.deepcopy(model).double()(input_ids=ids, attention_mask=attn, position_ids=positions).logits
        return logits.softmax(-1)  # (B, L, V)

    before = trainer.shift_logprobs(model, rollout, cfg)
    old_probs = probs_of_a_copy()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # some update
    metrics = trainer.shift_metrics(model, rollout, advantages, cfg, before)
    new_probs = probs_of_a_copy()
    T = rollout.response_ids.shape[1]
    entropies = rollout.entropy[rollout.response_mask.bool()].tolist()  # every response token ranks, A = 0 too
    counts = {}
    for b in range(len(rollout)):
        for t in range(T):
            if not rollout.response_mask[b, t] or advantages[b] == 0:
                continue
            at, token = ids.shape[1] - T - 1 + t, rollout.response_ids[b, t]
            old_p, new_p = old_probs[b, at, token].item(), new_probs[b, at, token].item()
            rank = sum(e < rollout.entropy[b, t].item() for e in entropies) / len(entropies)
            sign = "pos" if advantages[b] > 0 else "neg"
            right = new_p > old_p if sign == "pos" else new_p < old_p
            for prefix, value in (("shift", old_p), ("shift_entropy", rank)):
                key = (prefix, sign, min(int(value / 0.25), 3))
                n, c = counts.get(key, (0, 0))
                counts[key] = (n + 1, c + right)
    assert {key[0] for key in counts} == {"shift", "shift_entropy"}
    for (prefix, sign, k), (n, c) in counts.items():
        assert metrics[f"{prefix}/n_{sign}_bin{k}"] == n
        assert metrics[f"{prefix}/correct_{sign}_bin{k}"] == pytest.approx(c / n)
        assert metrics[f"{prefix}/unmoved_{sign}_bin{k}"] == 0.0  # an update this size moves every token


@pytest.mark.parametrize("fast_path", ["hf", "lean"])
def test_logprob_forwards_never_hold_more_rows_than_a_micro_batch(config, monkeypatch, fast_path):
    """The no-grad pi_old / reference forwards keep rows x T x V logits: they must run micro_batch_size rows at a
    time (found on the GPU, where a whole 64-row batch of 512 tokens put 9.3 GiB of logits in one forward). On the
    lean path pi_old comes from the decoder, so only the reference forwards remain."""
    import lopti_lab.rollout as rollout

    rows = []
    real = rollout.response_logprobs

    def spy(model, input_ids, *args, **kwargs):
        rows.append((torch.is_grad_enabled(), input_ids.shape[0]))
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(rollout, "response_logprobs", spy)  # add_logprobs' forwards (the update's are trainer's)
    cfg = replace(config, steps=1, lopti_eta=0.5, kl_coef=0.01, micro_batch_size=2, eval_people=(), fast_path=fast_path)
    train(cfg)
    no_grad = [n for grad, n in rows if not grad]
    forwards = 2 if fast_path == "hf" else 1  # pi_old and the reference, or the reference alone
    assert len(no_grad) == forwards * cfg.batch_size // 2  # 2 rows at a time
    assert max(no_grad) == 2
    assert replace(cfg, micro_batch_size=None, generate_batch_size=4).logprob_batch_size == 4


def test_warmup_ramps_the_learning_rate_and_resume_continues_it(config, tmp_path, monkeypatch):
    seen = []
    real_step = torch.optim.AdamW.step

    def spy_step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy_step)
    cfg = replace(config, steps=4, warmup_steps=3, lr=1e-3, eval_people=(), save_every=1)
    train(cfg)
    assert seen == pytest.approx([1e-3 / 3, 1e-3 / 3, 2e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3, 1e-3])  # 2 steps each
    assert [trainer.learning_rate(cfg, s) for s in (1, 2, 3, 9)] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])
    seen.clear()
    folder = tmp_path / "resumed"
    train(replace(cfg, steps=2, run_dir=str(folder)))
    train(replace(cfg, run_dir=str(folder)), resume=True)
    assert seen == pytest.approx([1e-3 / 3, 1e-3 / 3, 2e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("method", ["GRPO", "GRPO+AR+Lopti"])
def test_update_runs_only_rows_with_a_gradient_and_moves_weights_as_the_full_update(method, monkeypatch):
    """update_policy skips the rows whose advantage is zero (a group with equal rewards) and each row's columns after
    its last token with a gradient. Against a naive update (every row's plain HF forward with the stage masks as they
    are, one SGD step per minibatch) it ends at the same weights, having forwarded fewer rows."""
    from lopti_lab.objective import lopti_stages, reweight_advantages
    from lopti_lab.rollout import Rollout

    torch.manual_seed(0)
    vocab, group, n_prompts, P, T = 300, 4, 4, 6, 9
    B = group * n_prompts
    prompt_ids = torch.randint(3, vocab, (B // group, P)).repeat_interleave(group, 0)  # (B, P)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[:group, :2] = 0  # the first prompt is left-padded
    lengths = torch.randint(2, T + 1, (B,))
    response_mask = (torch.arange(T)[None] < lengths[:, None]).float()  # (B, T)
    response_ids = torch.randint(3, vocab, (B, T)) * response_mask.long()
    advantages = torch.randn(B)
    advantages[group : 2 * group] = 0.0  # a group whose rewards were all equal
    advantages[3 * group + 1] = 0.0  # and one row (only the group's mean of rewards matters to the test)
    extra = {"ar_alpha": 0.3, "lopti_eta": 0.003} if method == "GRPO+AR+Lopti" else {}
    cfg = TrainConfig(
        model="lab", lora_r=None, prompts_per_step=n_prompts, group_size=group, minibatch_size=8, micro_batch_size=4,
        grad_clip=None, kl_coef=0.0, temperature=0.9, **extra,
    )  # fmt: skip

    def naive_logp(model, ids, mask):  # (b, T) from a plain HF forward of the whole rows
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, P - 1 : -1]
        return torch.log_softmax(logits.double() / cfg.temperature, -1).gather(-1, ids[:, P:, None])[..., 0].float()

    ids, mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask.long()], 1)
    model = tiny_qwen2(vocab)
    with torch.no_grad():
        old_logp = naive_logp(model, ids, mask) * response_mask
    token_adv = advantages[:, None].expand(B, T)
    stages = [("all", response_mask)]
    if extra:
        token_adv = reweight_advantages(advantages, old_logp, 0.3)
        stages = lopti_stages(old_logp, response_mask, 0.003, "low_first")
        assert all(0 < s.sum() < response_mask.sum() for _, s in stages)

    naive = tiny_qwen2(vocab)
    sgd = torch.optim.SGD(naive.parameters(), lr=0.5)
    for _, stage in stages:
        for rows in (slice(0, 8), slice(8, 16)):
            sgd.zero_grad()
            logp = naive_logp(naive, ids[rows], mask[rows])
            loss, _ = update.policy_loss(
                logp, old_logp[rows], token_adv[rows], stage[rows], clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                dual_clip=cfg.dual_clip, denom=response_mask[rows].sum(),
            )  # fmt: skip
            loss.backward()
            sgd.step()

    forwarded, real_forward = [], update.response_logprobs

    def counting_forward(model, input_ids, *args, **kwargs):
        forwarded.append(len(input_ids))
        return real_forward(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(update, "response_logprobs", counting_forward)
    finished = torch.ones(B, dtype=torch.bool)
    rollout = Rollout(prompt_ids, prompt_mask, response_ids, response_mask, [""] * B, group, finished, old_logp)
    metrics = update_policy(
        model, torch.optim.SGD(model.parameters(), lr=0.5), rollout, token_adv, stages, cfg.update_spec()
    )

    assert metrics["update/optimizer_steps"] == 2 * len(stages)
    assert sum(forwarded) < B * len(stages)  # the zero-advantage rows were never run
    moved = 0.0
    for (name, ours), theirs in zip(model.named_parameters(), naive.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5, msg=name)
        moved = max(moved, (theirs - tiny_qwen2(vocab).get_parameter(name)).abs().max().item())
    assert moved > 1e-3
