"""integrations/engines.py: each engine adapter gives ``objective``'s numbers (loss and gradient) on random padded
batches, with AR on and off and for each Lopti stage; verl's vanilla loss is rebuilt here from its equations as an
oracle; the signatures are the ones the engines call (volcengine/verl b178a3c, PrimeIntellect-ai/prime-rl 559b447)."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from lopti_lab.integrations.engines import (
    ar_advantages,
    ar_loss_weights,
    lopti_stage_advantages,
    prime_rl_loss,
    verl_policy_loss,
)
from lopti_lab.objective import group_advantages, kl_penalty, masked_mean, policy_loss, reweight_advantages

B, G, T = 6, 3, 7
LENGTHS = [7, 5, 1, 4, 6, 3]  # right padding; row 2 has a single response token
VERL_CONFIG = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def make_batch(seed: int = 0) -> SimpleNamespace:
    """A GRPO batch in float64: rewards [0, 1, 2 | 2, 0, 1] give row 0 a negative and row 3 a positive advantage;
    token (0, 1) gets ratio e^1.5 = 4.5 > clip_ratio_c = 3 with A < 0, so every clip branch is exercised."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).double()  # (B, T)
    old_logp = torch.rand(B, T, generator=gen, dtype=torch.float64).clamp(0.02, 0.98).log()  # (B, T)
    logp = old_logp + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    logp[0, 1] = old_logp[0, 1] + 1.5
    ref_logp = old_logp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = group_advantages(torch.tensor([0.0, 1, 2, 2, 0, 1]), G).double()  # (B,)
    return SimpleNamespace(
        mask=mask,
        old_logp=old_logp,
        logp=logp.requires_grad_(True),
        ref_logp=ref_logp,
        seq_adv=advantages,
        adv=advantages[:, None] * mask,  # per token, zero on padding, as verl and OpenRLHF hold them; (B, T)
    )


def loss_and_grad(loss: torch.Tensor, leaf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def assert_same(got: tuple, want: tuple) -> None:
    """Loss and gradient equal to float64 rounding."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)


def test_the_batch_exercises_every_clip_branch():
    """Otherwise the parity tests below could pass on a batch where clipping never bites."""
    b = make_batch()
    _, stats = policy_loss(b.logp, b.old_logp, b.adv, b.mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert stats["clip_frac_low"] > 0 and stats["clip_frac_high"] > 0 and stats["dual_clip_frac"] > 0


# --- engine-neutral forms ---------------------------------------------------------------------------------------------


def test_ar_advantages_hand_case():
    """alpha 0.3, A = 1, pi_old [0.05, 0.95, 0.5], mask [1, 1, 0]: 0.3 * 0.05 + 0.7 = 0.715, 0.985, and 0 on padding."""
    old_logp = torch.tensor([[0.05, 0.95, 0.5]]).log()
    got = ar_advantages(torch.ones(1), old_logp, torch.tensor([[1.0, 1.0, 0.0]]), alpha=0.3)
    torch.testing.assert_close(got, torch.tensor([[0.715, 0.985, 0.0]]))
    torch.testing.assert_close(ar_loss_weights(old_logp, torch.tensor([[1.0, 1.0, 0.0]]), alpha=0.3), got)
    one_sequence = ar_loss_weights(old_logp[0], torch.tensor([True, True, False]), alpha=0.3)  # prime-rl's (S,)
    torch.testing.assert_close(one_sequence, got[0])


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_ar_advantages_is_the_objectives_reweighting_on_the_response(alpha):
    b = make_batch()
    want = reweight_advantages(b.seq_adv, b.old_logp, alpha) * b.mask
    torch.testing.assert_close(ar_advantages(b.seq_adv, b.old_logp, b.mask, alpha=alpha), want, rtol=0, atol=0)
    torch.testing.assert_close(ar_advantages(b.adv, b.old_logp, b.mask, alpha=alpha), want, rtol=0, atol=0)


def per_token_loss(b: SimpleNamespace, advantages: torch.Tensor, **kwargs) -> torch.Tensor:
    """``objective.policy_loss`` token by token, differentiable in logp: with denom fixed at 1 the loss is
    sum_t m_t l_t, so its gradient in the mask is l_t. (B, T)"""
    mask = b.mask.clone().requires_grad_(True)
    total, _ = policy_loss(b.logp, b.old_logp, advantages, mask, denom=1.0, **kwargs)
    (per_token,) = torch.autograd.grad(total, mask, create_graph=True)
    return per_token


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_loss_weights_on_the_clipped_loss_are_ar(alpha, dual_clip):
    """sum_t w_t l_t(A) / N == the token-mean loss with A_t replaced by w_t A_t: loss and gradient."""
    b = make_batch()
    weights = ar_loss_weights(b.old_logp, b.mask, alpha=alpha)
    weighted = masked_mean(weights * per_token_loss(b, b.adv, dual_clip=dual_clip), b.mask)
    ar_loss, _ = policy_loss(
        b.logp, b.old_logp, reweight_advantages(b.adv, b.old_logp, alpha), b.mask, dual_clip=dual_clip
    )
    assert_same(loss_and_grad(weighted, b.logp), loss_and_grad(ar_loss, b.logp))


def test_loss_weights_are_not_ar_on_a_kl_term():
    """An engine that weights its whole per-token loss also reweights the KL term: no longer AR's loss."""
    b = make_batch()
    kl = {"ref_logp": b.ref_logp, "kl_coef": 0.5}
    weights = ar_loss_weights(b.old_logp, b.mask, alpha=0.3)
    weighted = masked_mean(weights * per_token_loss(b, b.adv, **kl), b.mask)
    ar_loss, _ = policy_loss(b.logp, b.old_logp, reweight_advantages(b.adv, b.old_logp, 0.3), b.mask, **kl)
    assert not torch.allclose(weighted, ar_loss, rtol=1e-6, atol=1e-9)


# --- Lopti stages -----------------------------------------------------------------------------------------------------


def test_lopti_hand_case():
    """eta 0.5, pi_old [0.1, 0.5, 0.9, 0.3], mask [1, 1, 1, 0], A = 2: low A [2, 0, 0, 0], high A [0, 2, 2, 0]."""
    old_logp = torch.tensor([[0.1, 0.5, 0.9, 0.3]]).log()
    low, high = lopti_stage_advantages(torch.tensor([2.0]), old_logp, torch.tensor([[1.0, 1, 1, 0]]), eta=0.5)
    assert (low.name, high.name) == ("low", "high")
    torch.testing.assert_close(low.advantages, torch.tensor([[2.0, 0, 0, 0]]))
    torch.testing.assert_close(high.advantages, torch.tensor([[0.0, 2, 2, 0]]))
    torch.testing.assert_close(high.mask, torch.tensor([[0.0, 1, 1, 0]]))


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_lopti_stages_partition_the_response(order):
    b = make_batch()
    stages = lopti_stage_advantages(b.adv, b.old_logp, b.mask, eta=0.5, order=order)
    assert [s.name for s in stages] == (["low", "high"] if order == "low_first" else ["high", "low"])
    torch.testing.assert_close(stages[0].mask + stages[1].mask, b.mask, rtol=0, atol=0)
    assert (stages[0].mask * stages[1].mask).sum() == 0
    for stage in stages:
        torch.testing.assert_close(stage.advantages, b.adv * stage.mask, rtol=0, atol=0)
    low = next(s for s in stages if s.name == "low")
    assert bool(((b.old_logp.exp() < 0.5) == low.mask.bool())[b.mask.bool()].all())


@pytest.mark.parametrize("stage_index", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_a_stages_zeroed_advantages_give_our_trainers_stage_loss(alpha, stage_index):
    """The engine's form (every response token in the mask and the denominator, A zero outside the stage) equals our
    trainer's (the stage's mask, the full response count as denominator), AR computed once before the split."""
    b = make_batch()
    weighted = ar_advantages(b.adv, b.old_logp, b.mask, alpha=alpha)
    stage = lopti_stage_advantages(weighted, b.old_logp, b.mask, eta=0.5)[stage_index]
    engine, _ = policy_loss(b.logp, b.old_logp, stage.advantages, b.mask, dual_clip=3.0)
    ours, _ = policy_loss(b.logp, b.old_logp, weighted, stage.mask, dual_clip=3.0, denom=b.mask.sum())
    assert_same(loss_and_grad(engine, b.logp), loss_and_grad(ours, b.logp))


def test_zeroed_advantages_leave_the_kl_term_on_every_token():
    """With a KL term, zeroing the advantages is not enough: the engine's loss exceeds the stage's by exactly
    kl_coef x (KL of the tokens outside the stage) / N, so the engine must mask its KL by ``stage.mask`` too."""
    b = make_batch()
    low, _ = lopti_stage_advantages(b.adv, b.old_logp, b.mask, eta=0.5)
    kl = {"ref_logp": b.ref_logp, "kl_coef": 0.1}
    engine, _ = policy_loss(b.logp, b.old_logp, low.advantages, b.mask, **kl)
    ours, _ = policy_loss(b.logp, b.old_logp, b.adv, low.mask, denom=b.mask.sum(), **kl)
    outside = masked_mean(kl_penalty(b.logp, b.ref_logp), b.mask - low.mask, b.mask.sum())
    assert outside > 1e-4
    torch.testing.assert_close(engine - ours, 0.1 * outside, rtol=1e-10, atol=1e-12)


def two_stage_update(*, engine_form: bool, refresh_pi_old: bool = False) -> torch.Tensor:
    """Two SGD updates of a tiny shared-weight policy (logits = features @ W) on one batch, one per Lopti stage, AR
    (alpha 0.3) computed once. Returns W after both."""
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(B, T, 4, generator=gen, dtype=torch.float64)  # (B, T, D)
    weights = torch.randn(4, 5, generator=gen, dtype=torch.float64).requires_grad_(True)  # (D, V)
    ids = torch.randint(0, 5, (B, T), generator=gen)  # (B, T)
    b = make_batch()

    def logp_of_ids() -> torch.Tensor:
        return (features @ weights).log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)  # (B, T)

    old_logp = logp_of_ids().detach()
    weighted = ar_advantages(b.seq_adv, old_logp, b.mask, alpha=0.3)
    for stage in lopti_stage_advantages(weighted, old_logp, b.mask, eta=0.2):
        anchor = logp_of_ids().detach() if refresh_pi_old else old_logp
        if engine_form:
            loss, _ = policy_loss(logp_of_ids(), anchor, stage.advantages, b.mask)
        else:
            loss, _ = policy_loss(logp_of_ids(), anchor, weighted, stage.mask, denom=b.mask.sum())
        (grad,) = torch.autograd.grad(loss, weights)
        with torch.no_grad():
            weights -= 2.0 * grad
    return weights.detach()


def test_two_stage_update_on_one_batch_matches_our_trainer():
    """The engine recipe (two updates, advantages zeroed per stage, pi_old fixed) lands on the same weights as our
    trainer; recomputing pi_old between the stages (what Lopti must NOT do) lands elsewhere."""
    engine = two_stage_update(engine_form=True)
    torch.testing.assert_close(engine, two_stage_update(engine_form=False), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(engine, two_stage_update(engine_form=True, refresh_pi_old=True), atol=1e-6)


# --- verl -------------------------------------------------------------------------------------------------------------


def test_verl_signature_is_what_verls_actor_passes():
    """dp_actor.update_policy and losses.ppo_loss call the registered loss with these keywords and defaults."""
    params = inspect.signature(verl_policy_loss(ar_alpha=0.3)).parameters
    assert list(params) == [
        "old_log_prob",
        "log_prob",
        "advantages",
        "response_mask",
        "loss_agg_mode",
        "config",
        "rollout_is_weights",
    ]
    assert params["loss_agg_mode"].default == "token-mean"
    assert params["config"].default is None and params["rollout_is_weights"].default is None


def verl_call(b, fn, config, **kwargs):
    return fn(
        old_log_prob=b.old_logp,
        log_prob=b.logp,
        advantages=b.adv,
        response_mask=b.mask.bool(),
        loss_agg_mode="token-mean",
        config=config,
        **kwargs,
    )


@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_verl_loss_is_the_objective_with_ar(alpha):
    b = make_batch()
    loss, metrics = verl_call(b, verl_policy_loss(ar_alpha=alpha), VERL_CONFIG)
    advantages = reweight_advantages(b.adv, b.old_logp, alpha)
    want, stats = policy_loss(b.logp, b.old_logp, advantages, b.mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert_same(loss_and_grad(loss, b.logp), loss_and_grad(want, b.logp))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(stats["clip_frac_low"] + stats["clip_frac_high"]))
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(float(stats["dual_clip_frac"]))
    assert metrics["actor/ppo_kl"] == pytest.approx(float(masked_mean(b.old_logp - b.logp.detach(), b.mask)))


def verl_vanilla_reference(b: SimpleNamespace, clip_low: float, clip_high: float, clip_c: float):
    """verl's vanilla loss from its equations (core_algos.compute_policy_loss_vanilla, token-mean, no IS weights):
    ratio from the log-ratio clamped to +-20; loss_t = max(-A r, -A clip(r)); for A < 0 also min(loss_t, -A c)."""
    ratio = torch.exp(torch.clamp(b.logp - b.old_logp, -20.0, 20.0))
    clipped = torch.maximum(-b.adv * ratio, -b.adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    per_token = torch.where(b.adv < 0, torch.minimum(clipped, -b.adv * clip_c), clipped)
    clipfrac = ((-b.adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high) > -b.adv * ratio) * b.mask).sum()
    return (per_token * b.mask).sum() / b.mask.sum(), float(clipfrac / b.mask.sum())


def test_verl_loss_without_ar_is_verls_vanilla():
    b = make_batch()
    loss, metrics = verl_call(b, verl_policy_loss(ar_alpha=0.0), VERL_CONFIG)
    want, clipfrac = verl_vanilla_reference(b, 0.2, 0.28, 3.0)
    assert_same(loss_and_grad(loss, b.logp), loss_and_grad(want, b.logp))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipfrac)


def test_verl_global_batch_info_gives_verls_global_token_mean():
    """verl's new worker path sets global_batch_info: token mean = sum / batch_num_tokens x dp_size."""
    b = make_batch()
    config = {**VERL_CONFIG, "global_batch_info": {"dp_size": 2, "batch_num_tokens": 50, "global_batch_size": 12}}
    loss, _ = verl_call(b, verl_policy_loss(ar_alpha=0.3), config)
    adv = reweight_advantages(b.adv, b.old_logp, 0.3)
    want, _ = policy_loss(b.logp, b.old_logp, adv, b.mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, denom=50)
    assert_same(loss_and_grad(loss, b.logp), loss_and_grad(2 * want, b.logp))


def test_verl_clip_ratio_low_and_high_fall_back_to_clip_ratio():
    b = make_batch()
    config = {"clip_ratio": 0.1, "clip_ratio_low": None, "clip_ratio_high": None}
    loss, _ = verl_call(b, verl_policy_loss(ar_alpha=0.0), config)
    want, _ = policy_loss(b.logp, b.old_logp, b.adv, b.mask, clip_low=0.1, clip_high=0.1, dual_clip=3.0)
    assert_same(loss_and_grad(loss, b.logp), loss_and_grad(want, b.logp))


def test_verl_rollout_is_weights_scale_the_per_token_loss():
    """Weights 0/1 drop tokens from the sum but not from the denominator; a constant 0.5 halves the loss."""
    b = make_batch()
    keep = (torch.rand(B, T, generator=torch.Generator().manual_seed(3)) < 0.6).double()
    loss, _ = verl_call(b, verl_policy_loss(ar_alpha=0.3), VERL_CONFIG, rollout_is_weights=keep)
    adv = reweight_advantages(b.adv, b.old_logp, 0.3)
    kw = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    want, _ = policy_loss(b.logp, b.old_logp, adv, b.mask * keep, denom=b.mask.sum(), **kw)
    assert_same(loss_and_grad(loss, b.logp), loss_and_grad(want, b.logp))
    half, _ = verl_call(b, verl_policy_loss(ar_alpha=0.3), VERL_CONFIG, rollout_is_weights=torch.full((B, T), 0.5))
    full, _ = verl_call(b, verl_policy_loss(ar_alpha=0.3), VERL_CONFIG)
    torch.testing.assert_close(half, 0.5 * full)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_agg_mode": "seq-mean-token-mean"}, "loss_agg_mode"),
        ({"config": None}, "config"),
        ({"config": {**VERL_CONFIG, "clip_ratio_c": 1.0}}, "clip_ratio_c"),
    ],
)
def test_verl_bad_settings_name_the_field(change, message):
    b = make_batch()
    call = {"loss_agg_mode": "token-mean", "config": VERL_CONFIG, **change}
    with pytest.raises(ValueError, match=message):
        verl_policy_loss(ar_alpha=0.3)(b.old_logp, b.logp, b.adv, b.mask, **call)
    with pytest.raises(ValueError, match="ar_alpha"):
        verl_policy_loss(ar_alpha=1.5)


# --- prime-rl ---------------------------------------------------------------------------------------------------------


def prime_rl_samples(b: SimpleNamespace, weights: torch.Tensor | None = None) -> list[SimpleNamespace]:
    """The batch as prime-rl's per-sequence LossInputs: two prompt tokens (not in loss_mask) then the response, no
    padding; trainer_logprobs are slices of b.logp, so gradients reach it."""
    samples = []
    for row, length in enumerate(LENGTHS):
        prompt = torch.full((2,), -1.0, dtype=torch.float64)
        samples.append(
            SimpleNamespace(
                trainer_logprobs=torch.cat([prompt, b.logp[row, :length]]),
                inference_logprobs=torch.cat([prompt, b.old_logp[row, :length]]),
                ref_logprobs=None,
                advantages=torch.cat([torch.zeros(2, dtype=torch.float64), b.adv[row, :length]]),
                loss_mask=torch.cat([torch.zeros(2, dtype=torch.bool), torch.ones(length, dtype=torch.bool)]),
                loss_weights=None if weights is None else torch.cat([torch.ones(2), weights[row, :length]]).double(),
            )
        )
    return samples


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_prime_rl_loss_summed_over_sequences_is_the_objectives_token_mean(alpha, dual_clip):
    """prime-rl sums the per-sequence losses and divides by the global rl-token count (compute_loss)."""
    b = make_batch()
    kw = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": dual_clip}
    outputs = [prime_rl_loss(s, ar_alpha=alpha, **kw) for s in prime_rl_samples(b)]
    total = sum(out.loss for out in outputs) / b.mask.sum()
    want, _ = policy_loss(b.logp, b.old_logp, reweight_advantages(b.adv, b.old_logp, alpha), b.mask, **kw)
    assert_same(loss_and_grad(total, b.logp), loss_and_grad(want, b.logp))
    assert all(v.dim() == 0 for out in outputs for v in out.metrics.values())


def test_prime_rl_loss_weights_scale_the_per_token_loss():
    """0/1 weights keep the weighted tokens in the sum (prime-rl itself also drops 0-weight tokens from its count)."""
    b = make_batch()
    keep = (torch.rand(B, T, generator=torch.Generator().manual_seed(4)) < 0.6).double()
    outputs = [prime_rl_loss(s, ar_alpha=0.3) for s in prime_rl_samples(b, keep)]
    total = sum(out.loss for out in outputs) / b.mask.sum()
    adv = reweight_advantages(b.adv, b.old_logp, 0.3)
    want, _ = policy_loss(b.logp, b.old_logp, adv, b.mask * keep, denom=b.mask.sum())
    assert_same(loss_and_grad(total, b.logp), loss_and_grad(want, b.logp))
    with pytest.raises(ValueError, match="loss_weights"):
        prime_rl_loss(prime_rl_samples(b, -keep)[0])
