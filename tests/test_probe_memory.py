"""The gradient probe's memory bound on a real shape: a Qwen2.5-0.5B-shaped model (random weights, built here from
its shapes; 4 of its 24 layers to keep the test short) with LoRA r 16 and gradient checkpointing, one micro-step of
2 rows x (600 prompt + 16 response) tokens. The probe keeps no layer input beyond what the step's backward keeps, so
the step's peak memory with it attached stays within 1.25x the plain step's; a probe that keeps every LoRA layer's
input from the forward to the backward (this repository's until 2026-12-06) takes well over that bound here, and
more with every layer (the measured ratios: benchmarks/README.md)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from tiny import shaped_qwen2

from lopti_lab.memory import PeakMemory, cpu_peak_supported
from lopti_lab.plan import model_config
from lopti_lab.probes import GradientProbe
from lopti_lab.rollout import response_logprobs

pytestmark = pytest.mark.skipif(not cpu_peak_supported(), reason="CPU peak memory needs torch's memory profiler")

QWEN_0P5B = model_config("Qwen/Qwen2.5-0.5B-Instruct")  # the bundled shapes (data/hub_configs)
PROMPT, RESPONSE, ROWS = 600, 16, 2


def qwen_0p5b_lora(layers: int = 4) -> torch.nn.Module:
    """The 0.5B shape with LoRA r 16 on every projection and non-reentrant activation checkpointing, in train mode."""
    return shaped_qwen2(QWEN_0P5B, num_hidden_layers=layers).train()


def batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (ROWS, PROMPT + RESPONSE), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.ones(ROWS, RESPONSE, dtype=torch.bool)
    mask[1, RESPONSE // 2 :] = False
    probs = torch.rand(ROWS, RESPONSE, generator=g)
    adv = torch.tensor([1.0, -1.0])
    return ids, attn, mask, probs, adv


def micro_step(model, data, probe: GradientProbe | None) -> None:
    """One forward + backward of the token-mean policy-gradient loss through the trainer's forward."""
    ids, attn, mask, probs, adv = data
    tokens = (lambda t: probe.set_tokens(probs[:, :t], mask[:, :t])) if probe else (lambda t: None)
    with probe or nullcontext():
        logp, _ = response_logprobs(model, ids, attn, mask, 1.0, before_forward=tokens, fast_path="hf")
        loss = -(adv[:, None] * logp).masked_fill(~mask, 0).sum() / mask.sum()
        loss.backward()
    model.zero_grad(set_to_none=True)


def test_gradient_probe_peak_is_within_1p25x_of_the_plain_step():
    model = qwen_0p5b_lora()
    data = batch(QWEN_0P5B["vocab_size"])
    micro_step(model, data, None)  # warm-up: first-call allocations
    peaks = {}
    for name in ("plain", "probe"):
        probe = GradientProbe(model) if name == "probe" else None
        with PeakMemory() as peak:
            micro_step(model, data, probe)
        peaks[name] = peak.bytes
        if probe is not None:
            shares = probe.metrics()
            assert abs(sum(v for k, v in shares.items() if k.startswith("grad/share_")) - 1) < 1e-4
            assert not probe._recomputed  # every re-run input was dropped after its layer's split
    assert peaks["probe"] <= 1.25 * peaks["plain"], {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}


def test_the_probe_keeps_every_checkpointed_layer_exact():
    """Under checkpointing every probed LoRA matrix is split from its re-run's input: none is left out, and the
    split equals the one without checkpointing."""
    from peft import LoraConfig, get_peft_model

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=300, num_hidden_layers=2)
    base = shaped_qwen2(QWEN_0P5B, lora=False, checkpointing=False, **small).double()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, lora).train()
    for p in model.parameters():  # LoRA B starts at zero: give the split something to see in every matrix
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    ids, attn, mask, probs, adv = batch(300)
    data = (ids[:, -80:], attn[:, -80:], mask, probs.double(), adv.double())
    tables = []
    for checkpointing in (False, True):
        if checkpointing:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        probe = GradientProbe(model, level="param")
        micro_step(model, data, probe)
        tables.append(probe.frame().set_index(["scope", "label"])["grad_norm"])
    assert len(tables[1]) == len(tables[0]) == (1 + 8) * 6  # model + 8 LoRA matrices, 4 bins + context + all
    torch.testing.assert_close(torch.tensor(tables[1].values), torch.tensor(tables[0].values), rtol=1e-9, atol=0)
