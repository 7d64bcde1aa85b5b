"""objective.py: hand-computed cases, the GRPO special cases, Lopti's partition, and parity of the loss with an
independent per-token loop and of its gradient with the hand-derived formula."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lopti_lab.objective import (
    group_advantages,
    lopti_stages,
    masked_mean,
    policy_loss,
    reweight_advantages,
    token_logprobs,
)

# --- group_advantages -------------------------------------------------------------------------------------------------


def test_group_advantages_hand_case():
    """Group [3, 0, 0]: mean 1, deviations [2, -1, -1], unbiased var (4 + 1 + 1) / 2 = 3, std sqrt(3) = 1.7321,
    A = [2, -1, -1] / 1.7321 = [1.1547, -0.5774, -0.5774]. Group [-1, -1, -1]: all equal, A = 0."""
    rewards = torch.tensor([3.0, 0.0, 0.0, -1.0, -1.0, -1.0])
    adv = group_advantages(rewards, group_size=3)
    s3 = math.sqrt(3.0)
    expected = torch.tensor([2 / s3, -1 / s3, -1 / s3, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_group_advantages_uses_unbiased_std_like_trl():
    """G = 2, rewards [3, -3]: mean 0, unbiased std sqrt((9 + 9) / 1) = 4.2426 (population std would be 3), so
    A = [0.7071, -0.7071] (with the population std it would be [1, -1])."""
    adv = group_advantages(torch.tensor([3.0, -3.0]), 2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)]))
    rewards = torch.randn(24)
    grouped = rewards.view(-1, 4)
    trl = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)  # TRL's formula
    torch.testing.assert_close(group_advantages(rewards, 4), trl.view(-1))


def test_group_advantages_none_is_mean_only():
    """Dr. GRPO: [3, 0, 0] -> [2, -1, -1] (no division)."""
    adv = group_advantages(torch.tensor([3.0, 0.0, 0.0]), 3, scale="none")
    torch.testing.assert_close(adv, torch.tensor([2.0, -1.0, -1.0]))


@pytest.mark.parametrize(
    ("rewards", "group", "scale"),
    [(torch.zeros(5), 2, "std"), (torch.zeros(2, 2), 2, "std"), (torch.zeros(4), 1, "std"), (torch.zeros(4), 2, "x")],
)
def test_group_advantages_rejects_bad_input(rewards, group, scale):
    with pytest.raises(ValueError):
        group_advantages(rewards, group, scale=scale)


# --- reweight_advantages ----------------------------------------------------------------------------------------------


def test_reweight_hand_case():
    """alpha = 0.3: pi = 0.05 -> weight 0.3 * 0.05 + 0.7 = 0.715; pi = 0.95 -> 0.985. With A = 1 and A = -2."""
    old_logp = torch.log(torch.tensor([[0.05, 0.95], [0.05, 0.95]]))
    adv = torch.tensor([1.0, -2.0])
    out = reweight_advantages(adv, old_logp, alpha=0.3)
    torch.testing.assert_close(out, torch.tensor([[0.715, 0.985], [-1.43, -1.97]]))


def test_reweight_alpha_zero_is_grpo_and_alpha_one_is_pi():
    old_logp = torch.rand(3, 5).clamp(min=0.01).log()
    adv = torch.randn(3)
    torch.testing.assert_close(reweight_advantages(adv, old_logp, 0.0), adv[:, None].expand(3, 5))
    torch.testing.assert_close(reweight_advantages(adv, old_logp, 1.0), adv[:, None] * old_logp.exp())
    token_adv = torch.randn(3, 5)  # per-token advantages work too
    torch.testing.assert_close(reweight_advantages(token_adv, old_logp, 0.0), token_adv)


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_reweight_rejects_alpha_outside_unit_interval(alpha):
    with pytest.raises(ValueError, match="alpha"):
        reweight_advantages(torch.ones(1), torch.zeros(1, 1), alpha)


def test_alpha_zero_loss_equals_grpo_loss():
    """AR with alpha = 0 reproduces GRPO's loss and gradient exactly."""
    torch.manual_seed(0)
    old_logp = -torch.rand(4, 6) * 3
    logp = (old_logp + 0.1 * torch.randn(4, 6)).requires_grad_()
    adv, mask = torch.randn(4), (torch.rand(4, 6) > 0.2).float()
    grpo, _ = policy_loss(logp, old_logp, adv, mask)
    (g_grpo,) = torch.autograd.grad(grpo, logp)
    ar, _ = policy_loss(logp, old_logp, reweight_advantages(adv, old_logp, 0.0), mask)
    (g_ar,) = torch.autograd.grad(ar, logp)
    assert ar.item() == grpo.item()
    assert torch.equal(g_ar, g_grpo)


# --- lopti_stages -----------------------------------------------------------------------------------------------------


def test_lopti_stages_hand_case():
    """eta = 0.5, pi = [0.1, 0.5, 0.9, 0.3], mask [1, 1, 1, 0]: low = [1, 0, 0, 0] (0.5 is not < 0.5, 0.3 is
    padding), high = [0, 1, 1, 0]."""
    old_logp = torch.log(torch.tensor([[0.1, 0.5, 0.9, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    stages = lopti_stages(old_logp, mask, eta=0.5)
    assert [name for name, _ in stages] == ["low", "high"]
    assert stages[0][1].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert stages[1][1].tolist() == [[0.0, 1.0, 1.0, 0.0]]
    assert [name for name, _ in lopti_stages(old_logp, mask, 0.5, order="high_first")] == ["high", "low"]


@settings(max_examples=50, deadline=None)
@given(
    probs=st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=30),
    eta=st.floats(0.01, 0.99),
    seed=st.integers(0, 1000),
    bool_mask=st.booleans(),
)
def test_lopti_stages_partition_the_response_mask(probs, eta, seed, bool_mask):
    old_logp = torch.log(torch.tensor(probs)).view(1, -1)
    mask = torch.rand(old_logp.shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask = mask if bool_mask else mask.float()
    (_, low), (_, high) = lopti_stages(old_logp, mask, eta)
    assert low.dtype == mask.dtype and high.dtype == mask.dtype
    assert torch.equal(low.bool() | high.bool(), mask.bool())  # cover the response
    assert not (low.bool() & high.bool()).any()  # and do not overlap
    assert torch.equal(low.bool(), mask.bool() & (old_logp.exp() < eta))


@pytest.mark.parametrize(("eta", "order"), [(0.0, "low_first"), (1.0, "low_first"), (0.5, "sideways")])
def test_lopti_stages_rejects_bad_arguments(eta, order):
    with pytest.raises(ValueError):
        lopti_stages(torch.zeros(1, 2), torch.ones(1, 2), eta, order)


# --- policy_loss ------------------------------------------------------------------------------------------------------


def _one(p_old, p_new, adv, **kw):
    old_logp = torch.tensor([[math.log(p_old)]])
    logp = torch.tensor([[math.log(p_new)]], requires_grad=True)
    loss, stats = policy_loss(logp, old_logp, torch.tensor([adv]), torch.ones(1, 1), **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad.item(), stats


def test_policy_loss_hand_cases():
    """Clip 0.2 / 0.2, one token. d loss / d logp = -ratio * A where surr1 is the min, else 0.
    pi_old 0.5 -> pi 0.6: ratio 1.2, A = 1, loss -1.2 (edge, unclipped: grad -1.2)
    pi 0.75: ratio 1.5, A = 1, surr2 = 1.2 wins, loss -1.2, grad 0, clipped high
    pi 0.25: ratio 0.5, A = -1: surr1 = -0.5, surr2 = -0.8, min -0.8, loss 0.8, grad 0, clipped low
    pi 0.5 (ratio 1), A = -2: loss 2, grad -ratio * A = 2."""
    loss, grad, stats = _one(0.5, 0.6, 1.0)
    assert loss == pytest.approx(-1.2) and grad == pytest.approx(-1.2)
    loss, grad, stats = _one(0.5, 0.75, 1.0)
    assert loss == pytest.approx(-1.2) and grad == 0.0 and stats["clip_frac_high"] == 1.0
    loss, grad, stats = _one(0.5, 0.25, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and stats["clip_frac_low"] == 1.0
    assert stats["clip_frac_high"] == 0.0
    loss, grad, _ = _one(0.5, 0.5, -2.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)


def test_policy_loss_dual_clip_hand_case():
    """ratio 20, A = -1, c = 10: pg = -min(-20, -1.2) = 20, capped by the dual clip at -c * A = 10, gradient 0.
    ratio 5 < c: pg = 5, unchanged, gradient -ratio * A = 5."""
    loss, grad, stats = _one(0.01, 0.2, -1.0, dual_clip=10.0)
    assert loss == pytest.approx(10.0) and grad == 0.0 and stats["dual_clip_frac"] == 1.0
    loss, grad, stats = _one(0.01, 0.2, -1.0)
    assert loss == pytest.approx(20.0) and grad == pytest.approx(20.0) and stats["dual_clip_frac"] == 0.0
    loss, grad, _ = _one(0.1, 0.5, -1.0, dual_clip=10.0)
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)


def test_policy_loss_kl_hand_case():
    """k3 with ref = log 0.5, pi = 0.25: d = ref - logp = log 2, kl = 2 - log 2 - 1 = 0.3069; with kl_coef 0.1 and
    A = 0 the loss is 0.03069 and d/dlogp = 0.1 * (1 - exp(d)) = -0.1."""
    old_logp = torch.tensor([[math.log(0.25)]])
    logp = old_logp.clone().requires_grad_()
    loss, stats = policy_loss(
        logp, old_logp, torch.zeros(1), torch.ones(1, 1), ref_logp=torch.tensor([[math.log(0.5)]]), kl_coef=0.1
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert stats["kl"].item() == pytest.approx(1 - math.log(2))
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    assert grad.item() == pytest.approx(-0.1)


def _loop_loss(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip, ref_logp, kl_coef, denom):
    """An independent per-token implementation with Python floats."""
    total = 0.0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            a = float(adv[b, t])
            ratio = math.exp(float(logp[b, t]) - float(old_logp[b, t]))
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
            pg = max(-ratio * a, -clipped * a)
            if dual_clip is not None and a < 0:
                pg = min(pg, -dual_clip * a)
            d = float(ref_logp[b, t]) - float(logp[b, t])
            kl = min(math.exp(d) - d - 1, 10.0)
            total += pg + kl_coef * kl
    return total / denom


def _grad_formula(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip, ref_logp, kl_coef, denom):
    """d loss / d logp_t by hand: -ratio * A when the unclipped surrogate is active (and the dual clip is not),
    plus kl_coef * (1 - exp(ref - logp)) (the k3 derivative), times mask / denom."""
    ratio = torch.exp(logp - old_logp)
    surr1, surr2 = ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    active = surr1 <= surr2
    if dual_clip is not None:
        active &= ~((adv < 0) & (-surr1 > -dual_clip * adv))
    d = ref_logp - logp
    kl_grad = torch.where(torch.exp(d) - d - 1 < 10.0, 1 - torch.exp(d), torch.zeros_like(d))
    return (torch.where(active, -ratio * adv, torch.zeros_like(ratio)) + kl_coef * kl_grad) * mask / denom


@pytest.mark.parametrize(
    "kw",
    [
        {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None, "kl_coef": 0.0, "denom": None},
        {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "kl_coef": 0.05, "denom": None},
        {"clip_low": 0.1, "clip_high": 0.24, "dual_clip": 10.0, "kl_coef": 0.001, "denom": 50.0},
    ],
)
def test_policy_loss_matches_loop_and_hand_gradient(kw):
    torch.manual_seed(1)
    B, T = 4, 7
    old_logp = (-torch.rand(B, T, dtype=torch.float64) * 4).clamp(max=-1e-3)
    logp = (old_logp + 0.6 * torch.randn(B, T, dtype=torch.float64)).requires_grad_()
    ref_logp = old_logp + 0.3 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, T, dtype=torch.float64) * 2
    mask = (torch.rand(B, T) > 0.25).double()
    denom = kw["denom"] or mask.sum().item()
    loss, stats = policy_loss(logp, old_logp, adv, mask, ref_logp=ref_logp, **{**kw, "denom": kw["denom"]})
    expected = _loop_loss(logp.detach(), old_logp, adv, mask, ref_logp=ref_logp, **{**kw, "denom": denom})
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    hand = _grad_formula(logp.detach(), old_logp, adv, mask, ref_logp=ref_logp, **{**kw, "denom": denom})
    torch.testing.assert_close(grad, hand, rtol=1e-10, atol=1e-12)
    assert 0.0 <= stats["clip_frac_low"] <= 1.0 and stats["tokens"] == mask.sum()


def test_policy_loss_stage_masks_add_up_to_the_full_loss():
    """With the full token count as denominator, the Lopti stage losses (same weights) sum to the GRPO loss."""
    torch.manual_seed(2)
    old_logp = -torch.rand(3, 5) * 3
    logp, adv, mask = old_logp + 0.1, torch.randn(3), (torch.rand(3, 5) > 0.2).float()
    full, _ = policy_loss(logp, old_logp, adv, mask)
    parts = [policy_loss(logp, old_logp, adv, m, denom=mask.sum())[0] for _, m in lopti_stages(old_logp, mask, 0.4)]
    torch.testing.assert_close(sum(parts), full)


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


# --- token_logprobs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_log_softmax_and_its_gradient(temperature):
    torch.manual_seed(3)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    logp, entropy = token_logprobs(logits, ids, temperature, with_entropy=True, chunk_elements=20)  # many chunks
    log_probs = (logits / temperature).log_softmax(-1)
    naive = log_probs.gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logp, naive, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1), rtol=0, atol=1e-12)
    weights = torch.randn(3, 5, dtype=torch.float64)
    (ours,) = torch.autograd.grad((logp * weights).sum(), logits)
    (ref,) = torch.autograd.grad((naive * weights).sum(), logits)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids, temperature, chunk_elements=30)[0], (logits,))


def test_token_logprobs_bf16_is_computed_in_float32():
    torch.manual_seed(4)
    logits = torch.randn(2, 4, 50) * 5
    ids = torch.randint(0, 50, (2, 4))
    exact, _ = token_logprobs(logits, ids)
    half = logits.bfloat16().requires_grad_()
    approx, _ = token_logprobs(half, ids)
    assert approx.dtype == torch.float32
    torch.testing.assert_close(approx, token_logprobs(half.detach().float(), ids)[0])  # only the input is rounded
    assert (approx - exact).abs().max() < 0.2
    approx.sum().backward()
    assert half.grad.dtype == torch.bfloat16 and torch.isfinite(half.grad.float()).all()
