"""Gradient probes against naive autograd on a tiny random Qwen2, bare and with a peft LoRA adapter (float64)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import tiny_qwen2
from torch import nn

from lopti_lab.bins import DEFAULT_BINS, bin_index
from lopti_lab.probes import (
    GradientProbe,
    _common,
    bin_gradient_norms,
    bin_gradients,
    loss_attribution,
    position,
    probability_shift,
    selective_sweep,
    selective_update,
    selective_updates,
    to_metrics,
    token_stats,
)
from lopti_lab.probes import shift as shift_module
from lopti_lab.probes.shift import in_float64
from lopti_lab.theory import logit_grad_norm

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["You meet 3 inhabitants: Zoey, Oliver, and Emma.", "Who is a knight?", "Emma said that Zoey is a knave."]
RESPONSES = ["<think>Zoey is a knight", "Oliver lies.</think>", "<answer>(1) Emma is a knave", "ok"]


def make_model(vocab_size: int, lora: bool, tied: bool = True) -> nn.Module:
    model = tiny_qwen2(vocab_size).double()
    if not tied:  # its own lm_head: the embedding then has only its lookup use
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    if lora:
        # init_lora_weights=False draws B at random too, so that both A and B get gradients
        config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
        model = get_peft_model(model, config).double()
    return model.eval()


def make_batch(tokenizer, n: int = 4):
    """[left-padded prompt | right-padded response], the trainer's layout; advantages per sequence."""
    prompts = [tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(n)]
    responses = [tokenizer(RESPONSES[i % len(RESPONSES)])["input_ids"] for i in range(n)]
    P, T = max(map(len, prompts)), max(map(len, responses))
    pad = tokenizer.pad_token_id
    ids = torch.full((n, P + T), pad)
    attn = torch.zeros(n, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p) : P], attn[i, P - len(p) : P] = torch.tensor(p), 1
        ids[i, P : P + len(r)], attn[i, P : P + len(r)] = torch.tensor(r), 1
    response_mask = attn[:, P:].bool()
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    probs = torch.rand(n, T, generator=gen, dtype=torch.float64)  # spread over all bins (a random model's are ~1/V)
    return ids, attn, response_mask, advantages, probs


def policy_loss(model, ids, attn, mask, adv):
    """Token-mean policy-gradient loss per token, (B, T)."""
    logp = _common._response_logp(model, ids, attn, mask.shape[1])
    return -(adv[:, None] * logp) / mask.sum()


@pytest.fixture(params=[False, True], ids=["bare", "lora"])
def setup(request, tokenizer):
    model = make_model(len(tokenizer), lora=request.param)
    return model, *make_batch(tokenizer)


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def rows(table, scope="model"):
    return table[table["scope"] == scope].set_index("label")


# Qwen2RMSNorm computes in float32 even in a float64 model, so two DIFFERENT backward passes (one per bin, or one for
# the sum) agree to about 1e-8 relative, not 1e-15; comparisons within one backward are held to 1e-9.
ACROSS_BACKWARDS = 1e-6


def close(a: torch.Tensor, b: torch.Tensor, rel: float = ACROSS_BACKWARDS) -> None:
    """max |a - b| <= rel * max |b|: a scale-aware comparison of two gradients."""
    assert float((a - b).abs().max()) <= rel * float(b.abs().max()) + 1e-300


def rel_err(a, b) -> float:
    """max |a - b| / max |b| over a table column: relative to the largest entry, so that a zero row counts too."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


# ---------------------------------------------------------------------------------------------------------------------
# token_stats


def test_token_stats_match_a_plain_forward_and_autograd(tokenizer):
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, _, _ = make_batch(tokenizer)
    T = mask.shape[1]
    position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids).logits[:, -T - 1 : -1] / 0.7
    logits.requires_grad_(True)
    logp_all = logits.log_softmax(-1)
    naive_logp = logp_all.gather(-1, ids[:, -T:, None]).squeeze(-1)
    stats = token_stats(model, ids, attn, mask, temperature=0.7, max_chunk=1000)  # several chunks
    torch.testing.assert_close(stats.logp, naive_logp.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(stats.prob, naive_logp.detach().exp(), rtol=0, atol=1e-10)
    torch.testing.assert_close(stats.entropy, -(logp_all.exp() * logp_all).sum(-1).detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(stats.grad_norm, logit_grad_norm(logits, ids[:, -T:]), rtol=0, atol=1e-10)
    (dz,) = torch.autograd.grad(naive_logp[1, 2], logits)  # one token's gradient through the logits, by autograd
    assert stats.grad_norm[1, 2].item() == pytest.approx(dz.norm().item(), abs=1e-10)
    frame = stats.to_frame()
    assert len(frame) == int(mask.sum()) and set(frame["bin"]) <= {0, 1, 2, 3}
    assert stats.vocab_size == len(tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# attribution="loss"


def test_loss_attribution_equals_a_naive_loop_with_one_backward_per_bin(setup):
    model, ids, attn, mask, adv, probs = setup
    table = bin_gradient_norms(model, policy_loss(model, ids, attn, mask, adv), probs, mask)
    params = [p for _, p in trainable(model)]
    bin_of = bin_index(probs)
    naive = []
    for k in range(4):  # the naive way: a fresh forward and one backward per bin
        loss = policy_loss(model, ids, attn, mask, adv)[mask & (bin_of == k)].sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        naive.append(math.sqrt(sum(float(g.square().sum()) for g in grads if g is not None)))
    got = rows(table)
    assert rel_err(got.loc[got["bin"].notna(), "grad_norm"], naive) < 1e-5
    streamed = bin_gradient_norms(model, policy_loss(model, ids, attn, mask, adv), probs, mask, batched=False)
    assert 4 * sum(p.numel() for p in params) < loss_attribution._BATCHED_MAX_VALUES  # so `table` took the batched way
    np.testing.assert_allclose(streamed["grad_norm"], table["grad_norm"], rtol=ACROSS_BACKWARDS)
    np.testing.assert_allclose(streamed["grad_share"], table["grad_share"], rtol=1e-5, atol=1e-9)
    assert got.loc[got["bin"].notna(), "n_tokens"].sum() == mask.sum()
    assert got["grad_share"].sum() == pytest.approx(2.0)  # the bins' shares add to 1, plus the `all` row's 1
    assert got.loc["all", "n_params"] == sum(p.numel() for p in params)


def test_an_empty_bin_has_a_zero_row(tokenizer):
    model = make_model(len(tokenizer), lora=True)
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    probs = probs * 0.5  # nothing in [.5, .75) or [.75, 1]
    for batched in (True, False):
        table = rows(bin_gradient_norms(model, policy_loss(model, ids, attn, mask, adv), probs, mask, batched=batched))
        assert (table.loc[["[0.5, 0.75)", "[0.75, 1]"], ["n_tokens", "grad_norm", "grad_share"]] == 0).all().all()
        assert table.loc[["[0, 0.25)", "[0.25, 0.5)"], "grad_share"].sum() == pytest.approx(1.0)


def test_per_bin_gradients_sum_to_the_full_gradient(setup):
    model, ids, attn, mask, adv, probs = setup
    params = [p for _, p in trainable(model)]
    per_bin = bin_gradients(policy_loss(model, ids, attn, mask, adv), probs, mask, params)
    full = torch.autograd.grad(policy_loss(model, ids, attn, mask, adv)[mask].sum(), params)
    for g, f in zip(per_bin, full):
        assert g.shape == (4, *f.shape)
        close(g.sum(0), f)
    # the per-bin loop gives the same vectors
    looped = bin_gradients(policy_loss(model, ids, attn, mask, adv), probs, mask, params, batched=False)
    for a, b in zip(per_bin, looped):
        close(a, b)


def test_accumulate_leaves_the_full_gradient_in_grad(tokenizer):
    model = make_model(len(tokenizer), lora=True)
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    policy_loss(model, ids, attn, mask, adv)[mask].sum().backward()
    expected = {n: p.grad.clone() for n, p in trainable(model)}
    model.zero_grad(set_to_none=True)
    for attribution in ("loss", "position"):
        bin_gradient_norms(
            model,
            lambda: policy_loss(model, ids, attn, mask, adv),
            probs,
            mask,
            attribution=attribution,
            accumulate=True,
        )
        for n, p in trainable(model):
            close(p.grad, expected[n])
        model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------------------------
# attribution="position"


def explicit_position_split(model, ids, attn, mask, adv, probs):
    """The definition, by brute force: retain every Linear / Embedding call's input and output gradient, form each
    position's own term of dW (g_t a_t^T, its bias term g_t, its embedding row), sum the terms by the group of the
    position, and return per parameter name the (G, *shape) group gradients. Group of input position L-T-1+t: the bin
    of response token t if it is masked in, else context (G - 1), like every other position."""
    calls = []

    def keep(module, args, output):
        if output.requires_grad:  # a frozen base layer's output may not
            output.retain_grad()
            calls.append((module, args[0], output))

    modules = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    handles = [m.register_forward_hook(keep) for m in modules]
    try:
        policy_loss(model, ids, attn, mask, adv)[mask].sum().backward()
    finally:
        for h in handles:
            h.remove()
    B, L = ids.shape
    T = mask.shape[1]
    K = 4
    gid = torch.full((B, L), K)
    gid[:, L - T - 1 : L - 1] = torch.where(mask, bin_index(probs), K)
    names = {p: n for n, p in model.named_parameters() if p.requires_grad}
    split: dict[str, torch.Tensor] = {}
    for module, x, out in calls:
        g = out.grad  # (B, L', out)
        groups = gid[:, -x.shape[1] :]  # activations cover the last L' positions
        onehot = nn.functional.one_hot(groups, K + 1).double()  # (B, L', G)
        if isinstance(module, nn.Embedding):
            terms = torch.zeros(B, x.shape[1], *module.weight.shape, dtype=torch.float64)  # (B, L', V, d)
            for b in range(B):
                for t in range(x.shape[1]):
                    terms[b, t, x[b, t]] = g[b, t]
            parts = {"weight": terms}
        else:
            parts = {"weight": torch.einsum("bto,bti->btoi", g, x)}  # per position g_t a_t^T
            if module.bias is not None:
                parts["bias"] = g
        for role, terms in parts.items():
            p = getattr(module, role)
            if p in names:
                by_group = torch.einsum("btg,bt...->g...", onehot, terms)  # (G, *shape)
                split[names[p]] = split.get(names[p], 0) + by_group
    return {name: groups.detach() for name, groups in split.items()}


ROUTES = {  # every way the probe can split a parameter, forced in turn: (method, one-shot threshold, kernel it runs)
    "auto": ("auto", position._ONE_SHOT_MACS, None),
    "gram": ("gram", position._ONE_SHOT_MACS, "gram"),  # (a bias, never split by Gram, takes one kernel)
    "one-shot matmul": ("matmul", 2**62, "all_groups"),
    "per-group matmul": ("matmul", 0, "add_group"),
}
KERNELS = {"all_groups", "add_group", "gram"}


def spy_routes(monkeypatch) -> set[str]:
    """Which of the probe's kernels run: every group in one kernel, one group at a time, or the Gram route."""
    used: set[str] = set()
    for owner, name, tag in ((position._Use, "all_groups", "all_groups"), (position._Use, "add_group", "add_group"),
                             (position.GradientProbe, "_split_gram", "gram")):  # fmt: skip
        real = getattr(owner, name)

        def spy(*args, _real=real, _tag=tag, **kwargs):
            used.add(_tag)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return used


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("kind", ["tied", "untied", "lora"])
def test_position_attribution_equals_explicit_per_position_outer_products(tokenizer, monkeypatch, kind, route):
    model = make_model(len(tokenizer), lora=kind == "lora", tied=kind != "untied")
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    method, one_shot, kernels = ROUTES[route]
    monkeypatch.setattr(position, "_ONE_SHOT_MACS", one_shot)  # where _split_dense looks the threshold up
    used = spy_routes(monkeypatch)
    split = explicit_position_split(model, ids, attn, mask, adv, probs)
    for name, p in trainable(model):
        if name in split:  # the explicit terms explain the real gradient
            torch.testing.assert_close(split[name].sum(0), p.grad, rtol=1e-10, atol=1e-14)
    model.zero_grad(set_to_none=True)
    loss = lambda: policy_loss(model, ids, attn, mask, adv)  # noqa: E731
    table = bin_gradient_norms(model, loss, probs, mask, attribution="position", level="param", method=method)
    if kernels is not None:  # the route this case names is the one that ran, and no other route did
        others = KERNELS - {kernels} - ({"all_groups"} if kernels == "gram" else set())
        assert kernels in used and not used & others, (route, used)
    assert set(table["scope"]) - {"model"} == set(split)
    labels = ["[0, 0.25)", "[0.25, 0.5)", "[0.5, 0.75)", "[0.75, 1]", "context"]
    total_sq = {k: 0.0 for k in labels}
    for name, groups in split.items():
        full = groups.sum(0)
        got = rows(table, name)
        nsq = groups.flatten(1).square().sum(1)
        ip = groups.flatten(1) @ full.flatten()
        assert rel_err(got.loc[labels, "grad_norm"], nsq.sqrt()) < 1e-9, name
        np.testing.assert_allclose(got.loc[labels, "grad_share"], ip / full.square().sum(), rtol=1e-9, atol=1e-12)
        for k, v in zip(labels, nsq.tolist()):
            total_sq[k] += v
    model_rows = rows(table)
    assert rel_err(model_rows.loc[labels, "grad_norm"], np.sqrt(list(total_sq.values()))) < 1e-9
    assert model_rows.loc[labels, "grad_share"].sum() == pytest.approx(1.0, abs=1e-12)  # bins + context = full


def test_both_attributions_agree_after_the_last_attention_and_differ_before(tokenizer):
    """Past the last attention layer the network is position-wise, so token t's loss reaches only position t's
    activations: there the two attributions coincide. Earlier, attention mixes positions and they must differ."""
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    kwargs = {"level": "param"}
    by_loss = bin_gradient_norms(model, policy_loss(model, ids, attn, mask, adv), probs, mask, **kwargs)
    by_pos = bin_gradient_norms(
        model, lambda: policy_loss(model, ids, attn, mask, adv), probs, mask, attribution="position", **kwargs
    )
    bins_only = ["[0, 0.25)", "[0.25, 0.5)", "[0.5, 0.75)", "[0.75, 1]"]
    for name in ["model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight"]:
        pos_norms, loss_norms = (
            rows(by_pos, name).loc[bins_only, "grad_norm"],
            rows(by_loss, name).loc[bins_only, "grad_norm"],
        )
        assert rel_err(pos_norms, loss_norms) < ACROSS_BACKWARDS
        assert rows(by_pos, name).loc["context", "grad_norm"] == pytest.approx(0.0, abs=1e-12)
    early = "model.layers.0.self_attn.q_proj.weight"
    assert (
        rel_err(rows(by_pos, early).loc[bins_only, "grad_norm"], rows(by_loss, early).loc[bins_only, "grad_norm"])
        > 1e-3
    )
    assert rows(by_pos, early).loc["context", "grad_norm"] > 0  # prompt positions carry response losses via attention


def test_gram_and_matmul_routes_agree(setup):
    model, ids, attn, mask, adv, probs = setup

    def run(method):
        return bin_gradient_norms(
            model,
            lambda: policy_loss(model, ids, attn, mask, adv),
            probs,
            mask,
            attribution="position",
            level="layer",
            method=method,
        )

    a, b = run("gram"), run("matmul")
    assert list(a["scope"]) == list(b["scope"]) and {"layers.0", "layers.1"} <= set(a["scope"])
    np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(a["grad_share"], b["grad_share"], rtol=1e-8, atol=1e-12)


def test_gram_route_on_a_batch_long_enough_for_the_blocked_product(tokenizer):
    """N = 12 x 29 positions > 256: the Gram's x x^T and g g^T come from row panels (_syrk)."""
    a = torch.randn(300, 7, dtype=torch.float64)
    torch.testing.assert_close(position._syrk(a), a @ a.T, rtol=0, atol=1e-12)
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, adv, probs = make_batch(tokenizer, 12)
    assert ids.numel() > 256

    def run(method):
        loss = lambda: policy_loss(model, ids, attn, mask, adv)  # noqa: E731
        return bin_gradient_norms(model, loss, probs, mask, attribution="position", level="param", method=method)

    np.testing.assert_allclose(run("gram")["grad_norm"], run("matmul")["grad_norm"], rtol=1e-9, atol=1e-14)


def test_logits_to_keep_activations_are_the_last_positions(tokenizer):
    """A trainer that asks for the last T+1 logits only feeds lm_head a shorter activation; the split is the same."""
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    T = mask.shape[1]

    def short_loss():
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=T + 1).logits[:, :-1]
        logp = logits.log_softmax(-1).gather(-1, ids[:, -T:, None]).squeeze(-1)
        return -(adv[:, None] * logp) / mask.sum()

    def full_loss():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1 : -1]
        logp = logits.log_softmax(-1).gather(-1, ids[:, -T:, None]).squeeze(-1)
        return -(adv[:, None] * logp) / mask.sum()

    a = bin_gradient_norms(model, short_loss, probs, mask, attribution="position", level="layer")
    b = bin_gradient_norms(model, full_loss, probs, mask, attribution="position", level="layer")
    np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=ACROSS_BACKWARDS, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------------------
# GradientProbe


def test_probe_records_each_backward_and_leaves_gradients_untouched(tokenizer):
    model = make_model(len(tokenizer), lora=True)
    batches = [make_batch(tokenizer, n) for n in (4, 3)]
    for ids, attn, mask, adv, _ in batches:
        policy_loss(model, ids, attn, mask, adv)[mask].sum().backward()
    expected = {n: p.grad.clone() for n, p in trainable(model)}
    model.zero_grad(set_to_none=True)
    with GradientProbe(model) as probe:
        for ids, attn, mask, adv, probs in batches:  # two minibatches of different shapes
            probe.set_tokens(probs, mask)
            policy_loss(model, ids, attn, mask, adv)[mask].sum().backward()
    for n, p in trainable(model):
        close(p.grad, expected[n], rel=1e-12)  # the probe only listens
    frame = probe.frame()
    assert sorted(frame["record"].unique()) == [0, 1]
    ids, attn, mask, adv, probs = batches[1]
    model.zero_grad(set_to_none=True)
    one = bin_gradient_norms(
        model, lambda: policy_loss(model, ids, attn, mask, adv), probs, mask, attribution="position"
    )
    second = frame[frame["record"] == 1].drop(columns="record").reset_index(drop=True)
    pd.testing.assert_frame_equal(second, one, rtol=1e-10)
    summary = probe.summary()
    assert (summary["n_records"] == 2).all()
    assert summary.set_index("label").loc["all", "n_tokens"] == sum(int(b[2].sum()) for b in batches)
    metrics = probe.metrics()
    expected_keys = {f"{kind}_bin{k}" for kind in ("grad/norm", "grad/share", "tokens/share") for k in range(4)}
    assert expected_keys | {"grad/norm_context", "grad/share_context", "grad/norm_probed"} == set(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    assert sum(metrics[f"tokens/share_bin{k}"] for k in range(4)) == pytest.approx(1.0)


def test_detached_probe_leaves_no_hooks_and_records_nothing(tokenizer):
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, adv, probs = make_batch(tokenizer)

    def hooks():
        n_module = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        n_param = sum(len(p._backward_hooks or {}) for p in model.parameters())
        return n_module, n_param

    assert hooks() == (0, 0)
    probe = GradientProbe(model).attach()
    assert hooks()[0] > 0 and hooks()[1] == len(probe.params)
    probe.set_tokens(probs, mask)
    loss = policy_loss(model, ids, attn, mask, adv)[mask].sum()  # forward while attached ...
    probe.detach()
    assert hooks() == (0, 0)
    loss.backward()  # ... backward after: the output hooks are gone too
    policy_loss(model, ids, attn, mask, adv)[mask].sum().backward()
    assert probe.frame().empty


def test_probe_needs_tokens_and_a_matching_batch(tokenizer):
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    with GradientProbe(model) as probe:
        with pytest.raises(RuntimeError, match="set_tokens"):
            policy_loss(model, ids, attn, mask, adv)
        probe.set_tokens(probs[:2], mask[:2])
        with pytest.raises(ValueError, match="B=2"):
            policy_loss(model, ids, attn, mask, adv)
        with torch.no_grad():  # a no-grad forward (old_logp, evaluation) is ignored
            policy_loss(model, ids, attn, mask, adv)
    with pytest.raises(RuntimeError, match="no records"):
        probe.metrics()


def test_a_weight_used_outside_its_module_is_left_out_with_a_warning():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4).double()
            self.b = nn.Linear(4, 4).double()

        def forward(self, x):  # b.weight is also used functionally, which no module hook sees
            return self.b(self.a(x)) + x @ self.b.weight.T

    torch.manual_seed(0)
    model, x = Odd(), torch.randn(2, 5, 4, dtype=torch.float64)
    mask, probs = torch.ones(2, 3, dtype=torch.bool), torch.rand(2, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"b\.weight"):
        table = bin_gradient_norms(
            model, lambda: model(x)[:, -4:-1].sum(-1), probs, mask, attribution="position", level="param"
        )
    assert "b.weight" not in set(table["scope"]) and {"a.weight", "b.bias"} <= set(table["scope"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_split(tokenizer, reentrant):
    """Checkpointing re-runs each layer's forward inside the backward; every call must still be counted once."""
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, adv, probs = make_batch(tokenizer)

    def run():  # .backward(), as a trainer calls it: reentrant checkpointing refuses autograd.grad
        model.zero_grad(set_to_none=True)
        loss = lambda: policy_loss(model, ids, attn, mask, adv)  # noqa: E731
        return bin_gradient_norms(model, loss, probs, mask, attribution="position", level="layer", accumulate=True)

    plain = run()
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    checkpointed = run()
    handle.remove()
    assert len(calls) == 2  # the forward, then its re-run inside the backward: checkpointing is on
    np.testing.assert_allclose(checkpointed["grad_norm"], plain["grad_norm"], rtol=ACROSS_BACKWARDS, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------------------
# probability_shift and selective_update


def test_probability_shift_by_hand():
    """Two sequences of four tokens, bins (0, .5, 1), sequence 1's last token masked out.

        seq 0, A = +1: p_old (.1, .4, .6, .9) -> p_new (.2, .3, .7, .9)   dp (+.1, -.1, +.1, 0)
        seq 1, A = -1: p_old (.2, .7, .8, .3) -> p_new (.1, .75, .6, --)  dp (-.1, +.05, -.2, masked)

    Bin 0 ([0, .5)) holds p_old .1, .4 (A > 0) and .2 (A < 0); bin 1 ([.5, 1]) holds .6, .9 (A > 0) and .7, .8 (A < 0).
    Correct = moved the way A asks, among the tokens that moved: bin 0 pos: .1 up (yes), .4 down (no) -> 1/2;
    bin 0 neg: .2 down (yes) -> 1; bin 1 pos: .6 up (yes), .9 unmoved (counted apart, unmoved share 1/2) -> 1/1;
    bin 1 neg: .7 up (no), .8 down (yes) -> 1/2.
    Mean dp: bin 0 pos (.1 - .1)/2 = 0; bin 1 neg (.05 - .2)/2 = -.075.
    """
    p_old = torch.tensor([[0.1, 0.4, 0.6, 0.9], [0.2, 0.7, 0.8, 0.3]], dtype=torch.float64)
    p_new = torch.tensor([[0.2, 0.3, 0.7, 0.9], [0.1, 0.75, 0.6, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    shift = probability_shift(p_old.log(), p_new.log(), torch.tensor([1.0, -1.0]), mask, bins=(0, 0.5, 1))
    expected_dp = torch.tensor([[0.1, -0.1, 0.1, 0.0], [-0.1, 0.05, -0.2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(shift.delta_p, expected_dp, rtol=0, atol=1e-12)
    table = shift.bins.set_index(["bin", "sign"])
    assert table["correct_ratio"].to_dict() == pytest.approx(
        {(0, "pos"): 0.5, (0, "neg"): 1.0, (1, "pos"): 1.0, (1, "neg"): 0.5}
    )
    assert table["n_tokens"].to_dict() == {(0, "pos"): 2, (0, "neg"): 1, (1, "pos"): 2, (1, "neg"): 2}
    assert table["n_moved"].to_dict() == {(0, "pos"): 2, (0, "neg"): 1, (1, "pos"): 1, (1, "neg"): 2}
    unmoved = {(0, "pos"): 0, (0, "neg"): 0, (1, "pos"): 0.5, (1, "neg"): 0}
    assert table["unmoved_share"].to_dict() == pytest.approx(unmoved)
    assert table.loc[(0, "pos"), "dp_mean"] == pytest.approx(0.0, abs=1e-12)
    assert table.loc[(1, "neg"), "dp_mean"] == pytest.approx(-0.075)
    assert len(shift.tokens) == 7 and shift.tokens["correct"].sum() == 4
    assert shift.tokens["correct"].isna().sum() == 1 and not shift.tokens.loc[3, "moved"]  # p .9 -> .9


def test_selective_update_is_one_sgd_step_and_restores_the_weights(setup):
    model, ids, attn, mask, adv, _ = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    out = selective_update(model, ids, attn, mask, adv, update_bins=[0, 1], lr=0.5)
    assert model.training  # its mode is restored too
    model.eval()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # bit for bit
    # the same step by hand: bins from the model's own probabilities, token mean over every response token
    stats = token_stats(model, ids, attn, mask)
    chosen = mask & (bin_index(stats.prob) <= 1)
    loss = -(adv[:, None] * _common._response_logp(model, ids, attn, mask.shape[1]))[chosen].sum() / mask.sum()
    params = [p for _, p in trainable(model)]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    assert out.grad_norm == pytest.approx(math.sqrt(sum(float(g.square().sum()) for g in grads if g is not None)))
    assert out.n_updated == int(chosen.sum()) and out.update == "bin0+bin1"
    # the shift is measured in float64 throughout (HF's RMSNorm alone would round to float32: in_float64 fixes it)
    with in_float64(model):
        old = token_stats(model, ids, attn, mask).prob
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is not None:
                p -= 0.5 * g
        with in_float64(model):
            new = token_stats(model, ids, attn, mask).prob
        for k, v in before.items():
            model.state_dict()[k].copy_(v)
    # the step's gradient comes from the trainer's forward (rollout.response_logprobs), a different graph than the
    # one above: equal to ACROSS_BACKWARDS
    close(out.shift.delta_p, torch.where(mask, new - old, 0.0))


def test_selective_update_adamw_is_torchs_first_adamw_step(setup):
    """optimizer="adamw": the step torch.optim.AdamW takes first on the same gradient (no weight decay), whose size
    is lr * g / (|g| + eps) per weight, not SGD's lr * g."""
    model, ids, attn, mask, adv, _ = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = selective_update(model, ids, attn, mask, adv, lr=1e-3, optimizer="adamw", adam_eps=1e-6)
    sgd = selective_update(model, ids, attn, mask, adv, lr=1e-3)
    loss = -(adv[:, None] * _common._response_logp(model, ids, attn, mask.shape[1]))[mask].sum() / mask.sum()
    params = [p for _, p in trainable(model)]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    with in_float64(model):
        old = token_stats(model, ids, attn, mask).prob
    adamw = torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.0)
    for p, g in zip(params, grads):
        p.grad = torch.zeros_like(p) if g is None else g
    adamw.step()
    with torch.no_grad(), in_float64(model):
        new = token_stats(model, ids, attn, mask).prob
    with torch.no_grad():
        for k, v in before.items():
            model.state_dict()[k].copy_(v)
    torch.testing.assert_close(out.shift.delta_p, torch.where(mask, new - old, 0.0), rtol=1e-6, atol=1e-12)
    assert not torch.allclose(out.shift.delta_p, sgd.shift.delta_p)
    with pytest.raises(ValueError, match="optimizer"):
        selective_update(model, ids, attn, mask, adv, optimizer="lion")


def test_selective_updates_equal_one_selective_update_each(setup):
    """The shared forward and float64 baseline change nothing: each set's result is selective_update's alone, for
    both optimizers, and the weights come back bit for bit."""
    model, ids, attn, mask, adv, _ = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sets = [None, [3], [0, 1, 2], [1]]
    for kw in ({"lr": 0.1}, {"lr": 1e-3, "optimizer": "adamw", "adam_eps": 1e-6}):
        together = selective_updates(model, ids, attn, mask, adv, sets, **kw)
        for chosen, joint in zip(sets, together, strict=True):
            alone = selective_update(model, ids, attn, mask, adv, chosen, **kw)
            assert (joint.update, joint.n_updated) == (alone.update, alone.n_updated)
            assert joint.grad_norm == alone.grad_norm
            assert torch.equal(joint.shift.delta_p, alone.shift.delta_p)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="update_bins"):
        selective_updates(model, ids, attn, mask, adv, [None, [7]])


def test_selective_updates_measure_on_the_lean_path_as_on_the_models_own_forward(setup):
    """The forwards take rollout.response_logprobs (padding cut, a group's prompt once) unless position_ids are given;
    passing the default positions takes the model's own forward over the whole batch: the float64 log-probs agree to
    float64 rounding, the steps (through HF's float32 RMSNorm) to ACROSS_BACKWARDS."""
    model, ids, attn, mask, adv, _ = setup
    positions = _common._default_position_ids(attn)
    lean = selective_updates(model, ids, attn, mask, adv, [None, [0]], lr=0.1)
    own = selective_updates(model, ids, attn, mask, adv, [None, [0]], lr=0.1, position_ids=positions)
    for a, b in zip(lean, own, strict=True):
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=ACROSS_BACKWARDS) and a.n_updated == b.n_updated
        assert bool((b.shift.delta_p != 0).any())
        close(a.shift.delta_p, b.shift.delta_p)
    # the no-grad float64 forwards themselves, lean and the model's own, agree to float64 rounding
    with torch.no_grad(), in_float64(model):
        fast = shift_module._logp(model, ids, attn, mask, None, 1.0)
        slow = shift_module._logp(model, ids, attn, mask, positions, 1.0)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-13)


def test_selective_updates_take_the_gradient_of_a_float32_model(setup):
    """A float32 model (as trained; the other tests' models are float64): the float64 measurement forwards swap the
    weights' storage, and a gradient taken from a graph built before such a swap finds no weight (every grad None):
    each set's gradient norm must still be the hand-computed one."""
    model, ids, attn, mask, adv, _ = setup
    model = copy.deepcopy(model).float()
    out = selective_updates(model, ids, attn, mask, adv, [None, [0]], lr=1e-3)
    params = [p for _, p in trainable(model)]
    loss = -(adv[:, None].float() * _common._response_logp(model, ids, attn, mask.shape[1]))[mask].sum() / mask.sum()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))
    assert norm > 0 and out[0].grad_norm == pytest.approx(norm, rel=1e-5)
    assert out[1].grad_norm > 0 and bool((out[0].shift.delta_p != 0).any())


def test_selective_sweep_grad_norms_match_the_loss_attribution(tokenizer):
    """Fig. 1d two ways: the norm of the step on bin k alone is bin k's loss-attribution norm."""
    model = make_model(len(tokenizer), lora=True)
    ids, attn, mask, adv, _ = make_batch(tokenizer)
    tokens, grads = selective_sweep(model, ids, attn, mask, adv, lr=1e-3)
    assert list(grads["update"]) == ["all", "bin0", "bin1", "bin2", "bin3"]
    assert set(tokens["update"]) == set(grads["update"]) and len(tokens) == 5 * int(mask.sum())
    own = token_stats(model, ids, attn, mask).prob
    table = rows(bin_gradient_norms(model, policy_loss(model, ids, attn, mask, adv), own, mask))
    # two different graphs (the trainer's forward and HF's), so ACROSS_BACKWARDS, not 1e-9
    np.testing.assert_allclose(
        grads.set_index("update").loc["all", "grad_norm"], table.loc["all", "grad_norm"], rtol=ACROSS_BACKWARDS
    )
    nonempty = table["bin"].notna() & (table["n_tokens"] > 0)
    by_bin = grads.set_index("update").loc[[f"bin{int(b)}" for b in table.loc[nonempty, "bin"]], "grad_norm"]
    np.testing.assert_allclose(by_bin, table.loc[nonempty, "grad_norm"], rtol=ACROSS_BACKWARDS)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: a ValueError that names it


@pytest.mark.parametrize(
    "bins, match",
    [((0, 0.5, 0.4, 1), "increasing"), ((0, 0.5, 1.5), r"\[0, 1\]"), ((-0.1, 1), r"\[0, 1\]"), ((0, 0.5), "end at 1")],
)
def test_bad_bins(tokenizer, bins, match):
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    loss = policy_loss(model, ids, attn, mask, adv)
    with pytest.raises(ValueError, match=match) as err:
        bin_gradient_norms(model, loss, probs, mask, bins=bins)
    assert "bins" in str(err.value)
    with pytest.raises(ValueError, match="bins"):
        GradientProbe(model, bins=bins)
    with pytest.raises(ValueError, match="bins"):
        probability_shift(loss, loss, adv, mask, bins=bins)


def test_bad_masks_params_and_options(tokenizer):
    model = make_model(len(tokenizer), lora=True)
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    loss = policy_loss(model, ids, attn, mask, adv)
    with pytest.raises(ValueError, match="mask"):
        bin_gradient_norms(model, loss, probs, mask[:, :-1])
    with pytest.raises(ValueError, match="mask"):
        bin_gradient_norms(model, loss, probs, mask[0])
    with pytest.raises(ValueError, match="mask"):
        probability_shift(loss, loss, adv, mask.T)
    with pytest.raises(ValueError, match="response_mask"):
        token_stats(model, ids, attn, mask[:, :2].T)
    frozen = next(p for n, p in model.named_parameters() if not p.requires_grad)
    with pytest.raises(ValueError, match=r"params.*does not require grad"):
        bin_gradient_norms(model, loss, probs, mask, params=[frozen])
    with pytest.raises(ValueError, match=r"params.*does not require grad"):
        GradientProbe(model, params=[frozen])
    with pytest.raises(ValueError, match="params"):
        bin_gradient_norms(model, loss, probs, mask, params=[torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="probs"):
        bin_gradient_norms(model, loss, probs.log(), mask)
    with pytest.raises(ValueError, match="callable"):
        bin_gradient_norms(model, loss, probs, mask, attribution="position")
    with pytest.raises(ValueError, match="attribution"):
        bin_gradient_norms(model, loss, probs, mask, attribution="token")
    with pytest.raises(ValueError, match="level"):
        bin_gradient_norms(model, loss, probs, mask, level="block")
    with pytest.raises(ValueError, match="per_token_loss"):
        bin_gradient_norms(model, loss.detach(), probs, mask)
    with pytest.raises(ValueError, match="update_bins"):
        selective_update(model, ids, attn, mask, adv, update_bins=[4])
    bare = make_model(len(tokenizer), lora=False)
    norm = bare.model.norm.weight
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*position"):
        GradientProbe(bare, params=[norm])


def test_to_metrics_needs_one_attribution(tokenizer):
    model = make_model(len(tokenizer), lora=False)
    ids, attn, mask, adv, probs = make_batch(tokenizer)
    a = bin_gradient_norms(model, policy_loss(model, ids, attn, mask, adv), probs, mask)
    b = bin_gradient_norms(model, lambda: policy_loss(model, ids, attn, mask, adv), probs, mask, attribution="position")
    assert set(to_metrics(a)) == {
        f"{m}_bin{k}" for m in ("grad/norm", "grad/share", "tokens/share") for k in range(4)
    } | {"grad/norm_probed"}
    assert to_metrics(a, prefix="probe/")["probe/grad/norm_bin0"] == to_metrics(a)["grad/norm_bin0"]
    with pytest.raises(ValueError, match="attribution"):
        to_metrics(pd.concat([a, b]))
    assert len(DEFAULT_BINS) == 5
