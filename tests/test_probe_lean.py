"""The position probe on the lean shared-prompt forward: the same split as on HF's forward, where every row carries
its own copy of its prompt (float64 tiny Qwen2, bare and with LoRA, plain and checkpointed)."""

from __future__ import annotations

import pytest
import torch
from test_probes import ACROSS_BACKWARDS, close, make_model, rel_err

from lopti_lab.lean import forward as lean_forward
from lopti_lab.probes import GradientProbe
from lopti_lab.rollout import response_logprobs, shared_prompt_forward

PROMPTS = ["You meet 3 inhabitants: Zoey, Oliver, and Emma.", "Who is a knight?"]
RESPONSES = ["<think>Zoey is a knight", "Oliver lies.</think>", "<answer>(1) Emma is a knave", "ok", "no", "a b c"]


def grouped_batch(tokenizer, group: int = 3):
    """Two prompts x ``group`` rows each (a prompt's rows contiguous, as GRPO's), responses of different lengths."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(group)]
    responses = [tokenizer(RESPONSES[i % len(RESPONSES)])["input_ids"] for i in range(len(prompts))]
    P, T = max(map(len, prompts)), max(map(len, responses))
    n = len(prompts)
    ids = torch.full((n, P + T), tokenizer.pad_token_id)
    attn = torch.zeros(n, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, P - len(p) : P], attn[i, P - len(p) : P] = torch.tensor(p), 1
        ids[i, P : P + len(r)], attn[i, P : P + len(r)] = torch.tensor(r), 1
    gen = torch.Generator().manual_seed(3)
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    probs = torch.rand(n, T, generator=gen, dtype=torch.float64)
    return ids, attn, attn[:, P:].bool(), advantages, probs


def probe_table(model, batch, fast_path: str):
    ids, attn, mask, adv, probs = batch
    model.zero_grad(set_to_none=True)
    with GradientProbe(model, level="param") as probe:
        tokens = lambda t: probe.set_tokens(probs[:, :t], mask[:, :t])  # noqa: E731
        logp, _ = response_logprobs(model, ids, attn, mask, before_forward=tokens, fast_path=fast_path)
        (-(adv[:, None] * logp) / mask.sum()).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return probe.summary(), grads


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("lora", [False, True], ids=["bare", "lora"])
def test_the_probe_splits_the_lean_forward_as_it_splits_hfs(tokenizer, monkeypatch, lora, checkpointed):
    model = make_model(len(tokenizer), lora=lora)
    batch = grouped_batch(tokenizer)
    hf, hf_grads = probe_table(model, batch, "hf")
    if checkpointed:
        model.train()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    monkeypatch.setattr(lean_forward, "BUCKET_TOKENS", 1)  # short responses in several length buckets, as long ones
    real = lean_forward.shared_prompt_logits
    monkeypatch.setattr("lopti_lab.rollout.shared_prompt_logits", lambda *a, **k: calls.append(k) or real(*a, **k))
    lean, lean_grads = probe_table(model, batch, "lean")
    assert calls, "the probed forward did not take the lean path"
    for name, grad in hf_grads.items():  # the same gradient: two forwards of one function (RMSNorm rounds to fp32)
        close(lean_grads[name], grad)
    lean, hf = (t.sort_values(["scope", "label"], kind="stable").reset_index(drop=True) for t in (lean, hf))
    assert list(lean["scope"]) == list(hf["scope"]) and list(lean["label"]) == list(hf["label"])
    assert list(lean["n_tokens"]) == list(hf["n_tokens"])
    for scope, rows in hf.groupby("scope", sort=False):  # per parameter and for the model, relative to its largest
        here = lean[lean["scope"] == scope]
        for column in ("grad_norm", "grad_share"):
            assert rel_err(here[column], rows[column]) < ACROSS_BACKWARDS, (scope, column)
    context = hf[(hf["scope"] == "model") & (hf["label"] == "context")]["grad_share"].iloc[0]
    assert abs(context) > 1e-3  # the shared prompt positions carry a real part, and it is split right


def test_rows_own_last_prompt_position_gives_the_same_logits(tokenizer):
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, *_ = grouped_batch(tokenizer)
    P, lengths = ids.shape[1] - mask.shape[1], mask.sum(1)
    shared = shared_prompt_forward(model, ids, attn, P, lengths)
    own = shared_prompt_forward(model, ids, attn, P, lengths, own_last=True)
    real = mask[..., None].expand_as(shared)
    torch.testing.assert_close(own[real], shared[real], rtol=1e-12, atol=1e-12)


def test_a_lean_call_whose_input_does_not_match_its_segment_is_refused(tokenizer):
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, _, probs = grouped_batch(tokenizer)
    with GradientProbe(model) as probe:
        probe.set_tokens(probs, mask)
        token = lean_forward.SEGMENT.set(("rows", torch.arange(2)))  # two rows announced, the whole batch fed
        try:
            with pytest.raises(ValueError, match="does not match its segment"):
                model(input_ids=ids, attention_mask=attn)
        finally:
            lean_forward.SEGMENT.reset(token)
