"""Precision that the device has (DESIGN.md "Precision and memory"): "auto" is bf16 from compute capability 8.0,
fp16 below it, float32 on a CPU; a float16 policy trains with a loss scaler whose state is checkpointed; full
fine-tuning in half precision is refused.

The float16 arithmetic runs for real on the CPU: torch computes fp16 matmuls there (fp32 accumulation, fp16 results,
subnormals kept) and ``GradScaler("cpu")`` is the same class a GPU run uses.
"""

import functools
import json
from dataclasses import replace

import pytest
import torch
from peft.tuners.lora import LoraLayer
from tiny import fake_score, lora_update_rollout

from lopti_lab import evaluate as evaluation
from lopti_lab import models, runs
from lopti_lab.models import LoraSpec, load_policy, native_dtype, resolve_dtype, trainable_state_dict, training_dtype
from lopti_lab.notebook import Environment, training_defaults
from lopti_lab.objective import policy_loss
from lopti_lab.rollout import response_logprobs
from lopti_lab.train_config import TrainConfig
from lopti_lab.trainer import train
from lopti_lab.update import update_policy

GradScaler = torch.amp.GradScaler  # the class itself, whatever a test patches

# --- "auto" per device class ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16)],
)
def test_auto_dtype_is_what_the_gpu_has_natively(monkeypatch, capability, expected):
    """A T4 (sm 7.5) reports is_bf16_supported() True (emulation counts), yet has no bf16 units: auto gives fp16
    there, bf16 from Ampere (8.0) on; the decision reads the compute capability alone."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert native_dtype(capability) == expected
    assert resolve_dtype("auto", "cuda") == expected
    assert resolve_dtype("auto", torch.device("cuda:1")) == expected
    assert resolve_dtype("float32", "cuda") == torch.float32  # an explicit name is taken as it is
    # full fine-tuning keeps float32 master weights: "auto" is float32 for it on every device
    assert training_dtype("auto", "cuda", full_finetune=True) == torch.float32
    assert training_dtype("auto", "cuda", full_finetune=False) == expected


def test_auto_dtype_is_float32_on_a_cpu(monkeypatch):
    def no_gpu(device=None):
        raise AssertionError("a CPU never asks for a compute capability")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    assert native_dtype(None) == torch.float32
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert training_dtype("auto", "cpu", full_finetune=False) == torch.float32


# --- full fine-tuning in half precision ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_full_finetune_in_half_precision_is_refused_with_the_reason(dtype):
    """Why, by hand: a bf16 weight 0.02 lies in [2^-6, 2^-5), where bf16's 8-bit significand spaces values
    2^-6 x 2^-7 = 2^-13 ~ 1.2e-4 apart (fp16: 2^-6 x 2^-10 ~ 1.5e-5), so an Adam step of ~lr = 1e-6 rounds away."""
    weight = torch.tensor(0.02, dtype=getattr(torch, dtype))
    assert weight + 1e-6 == weight  # the update vanishes
    assert torch.tensor(0.02) + 1e-6 != torch.tensor(0.02)  # a float32 master weight keeps it

    with pytest.raises(ValueError, match=r"TrainConfig\.dtype .*full fine-tuning .*no float32 master weights") as err:
        TrainConfig(lora_r=None, dtype=dtype)
    assert "dtype='float32', or LoRA" in str(err.value) and "1e-6" in str(err.value)
    with pytest.raises(ValueError, match="no float32 master weights"):
        training_dtype(dtype, "cpu", full_finetune=True)  # what the trainer calls before loading
    assert TrainConfig(lora_r=None, dtype="auto").dtype == "auto"  # auto is float32 for it: allowed
    assert TrainConfig(lora_r=16, dtype=dtype).dtype == dtype  # LoRA keeps float32 adapter weights: allowed


# --- the float16 arithmetic --------------------------------------------------------------------------------------


def _notebook_denominator() -> int:
    """The token count a micro-batch's loss is divided by on the notebook's GPU setup (``training_defaults``): the
    minibatch's response tokens (the paper's token mean), 64 responses at their 1024-token cap."""
    gpu = Environment(in_colab=True, device="cuda", model="Qwen/Qwen2.5-1.5B-Instruct", lora_r=16,
                      prompt_style="instruct", quick=False)  # fmt: skip
    cfg = training_defaults(gpu)
    return cfg.minibatch_size * cfg.max_new_tokens


def _lora_gradients(model_dir, dtype: str, scaler: torch.amp.GradScaler | None):
    """The LoRA gradient (flat, float32) and the gradients reaching the LoRA-wrapped modules' outputs (the
    activation gradients that flow in the base dtype) of one GRPO micro-batch: 8 responses of 40 tokens, A = +-1,
    the loss divided by the notebook's minibatch token count. Base weights rounded to fp16 in both precisions; the
    LoRA B matrices drawn non-zero (peft starts them at 0, which would leave A's gradient exactly 0)."""
    torch.manual_seed(0)
    model, _ = load_policy(str(model_dir), LoraSpec(r=4), dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                p.copy_(p.half())  # the same weights, rounded to fp16 once
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    acts = []

    def keep_grad(module, args, output):
        output.register_hook(lambda grad: acts.append(grad.detach().float().flatten()))

    hooks = [m.register_forward_hook(keep_grad) for m in model.modules() if isinstance(m, LoraLayer)]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (8, 52), generator=gen)  # (B, P + T), P = 12, T = 40
    response_mask = torch.ones(8, 40)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    logp, _ = response_logprobs(model, ids, torch.ones_like(ids), response_mask, 0.7, fast_path="hf")  # (B, T)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0] * 4), response_mask, 0.2, 0.24, 10.0,
                          denom=_notebook_denominator())  # fmt: skip
    scale = 1.0
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.unscale_(torch.optim.SGD(params, lr=0.0))  # the trainer's unscale_, before clipping
    for hook in hooks:
        hook.remove()
    return torch.cat([p.grad.flatten() for p in params]), torch.cat(acts) / scale


def test_float16_lora_gradient_matches_float32_with_the_scaler_and_underflows_without(model_dir):
    """At the notebook's loss scale (a token mean over its 64 x 1024-token minibatch) the gradients that flow back
    through the fp16 model are ~1e-7: many fall under fp16's smallest subnormal (6e-8) and become exact zeros. The
    LoRA weight gradients themselves stay non-zero on this model (peft runs the adapter in float32, and each entry
    sums 320 tokens' contributions), but they lose accuracy; the scaler (x 65536) brings back both."""
    ref, ref_acts = _lora_gradients(model_dir, "float32", None)
    plain, plain_acts = _lora_gradients(model_dir, "float16", None)
    scaled, scaled_acts = _lora_gradients(model_dir, "float16", GradScaler("cpu"))
    cos = torch.nn.functional.cosine_similarity

    n_acts = ref_acts.numel()
    assert scaled.dtype == torch.float32 and (ref != 0).all()
    assert cos(scaled, ref, dim=0) >= 0.99 and (scaled == 0).sum() <= (ref == 0).sum()
    assert (scaled_acts == 0).sum() <= (ref_acts == 0).sum() + 0.01 * n_acts  # the underflow is gone
    # without the scaler: the underflow (measured: 73k exact zeros of 213k activation gradients, float32 24k)
    assert (plain_acts == 0).sum() >= (ref_acts == 0).sum() + 0.15 * n_acts
    # the weight gradients' lost accuracy, in float64 so that a distance near 1e-7 is not float32's rounding of 1.0
    lost_plain, lost_scaled = (1 - cos(g.double(), ref.double(), dim=0).item() for g in (plain, scaled))
    assert lost_plain > 1e-3 and lost_scaled < 1e-5, (lost_plain, lost_scaled)  # measured: 7e-3 vs 4e-7


# --- a skipped step ---------------------------------------------------------------------------------------------------


def _fp16_update_setup(model_dir, dtype="float16"):
    """A LoRA policy in ``dtype``, a frozen 8-row rollout with pi_old from the policy, and a config whose RL step is
    one optimizer step (minibatch = batch)."""
    model, rollout = lora_update_rollout(model_dir, dtype)
    response_mask = rollout.response_mask
    cfg = TrainConfig(model=str(model_dir), lora_r=4, prompt_style="base", prompts_per_step=2, group_size=4,
                      minibatch_size=8, kl_coef=0.0, lr=1e-2, dtype=dtype)  # fmt: skip
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)[:, None].expand(8, 10)  # (B, T)
    return model, rollout, advantages, [("all", response_mask)], cfg


def _inject_inf(model) -> list:
    """Make the next backward give one LoRA weight an inf gradient (what an fp16 overflow looks like)."""
    param = next(p for n, p in model.named_parameters() if "lora_B" in n)
    return [param.register_hook(lambda grad: torch.full_like(grad, float("inf")))]


def test_an_overflowed_step_is_skipped_logged_and_the_next_runs_at_a_lower_scale(model_dir):
    model, rollout, advantages, stages, cfg = _fp16_update_setup(model_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr)
    scaler = GradScaler("cpu")
    before = trainable_state_dict(model)

    hooks = _inject_inf(model)
    metrics = update_policy(model, optimizer, rollout, advantages, stages, cfg.update_spec(), scaler=scaler)
    for hook in hooks:
        hook.remove()
    assert metrics["amp/skipped_steps"] == 1.0 and metrics["update/optimizer_steps"] == 0.0
    assert metrics["skipped/nonfinite"] == 0.0  # an expected overflow, not the end of the run's health
    assert metrics["amp/scale"] == 65536.0 / 2
    assert all(torch.equal(before[n], p) for n, p in trainable_state_dict(model).items())  # weights unchanged
    assert not optimizer.state  # AdamW moments and step count untouched

    used = []
    real_scale = scaler.scale
    scaler.scale = lambda loss: used.append(scaler.get_scale()) or real_scale(loss)
    metrics = update_policy(model, optimizer, rollout, advantages, stages, cfg.update_spec(), scaler=scaler)
    assert used == [32768.0]  # the next step's backward ran at the lowered scale
    assert metrics["amp/skipped_steps"] == 0.0 and metrics["update/optimizer_steps"] == 1.0
    assert any(not torch.equal(before[n], p) for n, p in trainable_state_dict(model).items())


def test_without_a_scaler_a_nonfinite_gradient_still_ends_the_step(model_dir):
    """float32 / bfloat16 keep today's rule: a non-finite gradient is a sickness, not an expected overflow."""
    model, rollout, advantages, stages, cfg = _fp16_update_setup(model_dir, dtype="float32")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    _inject_inf(model)
    metrics = update_policy(model, optimizer, rollout, advantages, stages, cfg.update_spec())
    assert metrics["skipped/nonfinite"] == 1.0 and "amp/scale" not in metrics and not optimizer.state


def test_an_overflow_at_scale_one_is_nonfinite(model_dir):
    """Scaled down to 1 and still inf: the gradient itself does not fit float16, and halving further would skip
    every step in silence; the step counts as non-finite, so max_nonfinite_steps in a row stop the run."""
    model, rollout, advantages, stages, cfg = _fp16_update_setup(model_dir)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    _inject_inf(model)
    scaler = GradScaler("cpu", init_scale=1.0)
    metrics = update_policy(model, optimizer, rollout, advantages, stages, cfg.update_spec(), scaler=scaler)
    assert metrics["skipped/nonfinite"] == 1.0 and metrics["amp/skipped_steps"] == 1.0 and not optimizer.state


# --- the scaler's state in checkpoints --------------------------------------------------------------------------------


@pytest.fixture()
def fp16_config(model_dir, tmp_path, monkeypatch):
    """The trainer tests' tiny run in float16, on the CPU. The scaler starts at 2^24 so that the first steps'
    scaled gradients overflow fp16 (its largest value is 65504) and the scale the checkpoint holds is one that the
    run found, not the initial one."""
    monkeypatch.setattr(evaluation, "score_response", fake_score)
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(GradScaler, init_scale=2.0**24))
    return TrainConfig(
        model=str(model_dir), lora_r=4, lora_alpha=8, dtype="float16", prompt_style="base", train_people=(3, 4),
        train_limit=8, eval_people=(), prompts_per_step=2, group_size=4, minibatch_size=4, max_new_tokens=10,
        lr=5e-3, steps=4, save_every=2, run_dir=str(tmp_path / "run"), progress=False,
    )  # fmt: skip


def _values(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in runs.load_metrics(run_dir)]


def test_float16_checkpoint_holds_the_scaler_and_a_resume_is_exact(fp16_config, tmp_path):
    straight = train(replace(fp16_config, run_dir=str(tmp_path / "straight")))
    history = straight.history
    assert history[0]["amp/skipped_steps"] > 0 and history[1]["amp/scale"] < 2.0**24  # the scale came down
    assert all(r["skipped/nonfinite"] == 0.0 for r in history)  # overflow skips never stop the run
    assert sum(r["update/optimizer_steps"] for r in history) > 0
    saved = torch.load(tmp_path / "straight" / "checkpoints" / "step_2" / "scaler.pt", weights_only=True)
    assert saved["scale"] == history[1]["amp/scale"]
    state = json.loads((tmp_path / "straight" / "checkpoints" / "step_2" / "state.json").read_text())
    assert "scaler.pt" in state["files"]  # verified (size, sha256) on resume like every other file

    split = replace(fp16_config, run_dir=str(tmp_path / "split"))
    first = train(split, callbacks=[lambda m: m["step"] == 2])
    assert [m["step"] for m in first.history] == [1, 2]
    second = train(split, resume=True)
    assert _values(second.run_dir) == _values(straight.run_dir)  # amp/scale and amp/skipped_steps included
    for a, b in zip(trainable_state_dict(straight.model).values(), trainable_state_dict(second.model).values()):
        assert torch.equal(a, b)


def test_a_checkpoint_without_scaler_state_still_resumes(fp16_config, tmp_path):
    """A float16 checkpoint saved before the scaler's state was kept: the resume starts the scaler afresh."""
    cfg = replace(fp16_config, steps=3, save_every=1)
    train(replace(cfg, steps=2))
    checkpoint = runs.latest_checkpoint(cfg.run_dir)
    (checkpoint / "scaler.pt").unlink()
    state = json.loads((checkpoint / "state.json").read_text())
    del state["files"]["scaler.pt"]
    (checkpoint / "state.json").write_text(json.dumps(state))
    result = train(cfg, resume=True)
    assert [r["step"] for r in result.history] == [1, 2, 3]
    # from 2^24 again: step 3 overflows as step 1 did, where a restored scaler would have carried step 2's scale
    third, second = result.history[2], result.history[1]
    assert third["amp/skipped_steps"] > 0 and third["amp/scale"] > second["amp/scale"]


def test_float32_runs_keep_no_scaler(fp16_config):
    result = train(replace(fp16_config, dtype="float32", steps=1))
    assert not (runs.latest_checkpoint(result.run_dir) / "scaler.pt").exists()
    assert not any(k.startswith("amp/") for k in result.history[0])
    assert models.resolve_dtype("auto", "cpu") == torch.float32


def test_gradient_probe_norms_are_of_the_unscaled_gradient(fp16_config, monkeypatch):
    """The probe hooks see the scaled backward; the trainer reports its norms divided by the scale, so a float16
    probe step reads as a float32 one (grad/norm_probed is the norm of the same gradient as grad/norm)."""
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(GradScaler, init_scale=65536.0))  # the default
    record = train(replace(fp16_config, steps=1, probe_every=1)).history[0]
    assert record["amp/skipped_steps"] == 0.0 and record["amp/scale"] == 65536.0
    assert record["grad/norm_probed"] == pytest.approx(record["grad/norm"], rel=1e-4)
