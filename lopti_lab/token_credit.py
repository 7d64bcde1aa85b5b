"""The token-level methods that followed the paper, as pure functions on the same (B, T) tensors as AR and Lopti.

Each says which tokens carry the policy gradient, or how much: ``objective`` holds the paper's two (AR weights every
token by its probability, Lopti splits the update by it); these act on entropy or on a token's covariance with its
advantage instead, some in the opposite direction (forking tokens train only the high-entropy tokens, which are mostly
the low-probability ones AR damps).

    forking_mask           Wang et al. 2025 ("Beyond the 80/20 Rule", arXiv 2506.01939): only the top-rho entropy
                           tokens of the batch carry the gradient (TRL: ``top_entropy_quantile``)
    clip_cov_loss          Cui et al. 2025 ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617),
                           Clip-Cov: the clipped loss with a small random share of high-covariance tokens dropped
    kl_cov_loss            Cui et al. 2025, KL-Cov: |log pi - log pi_old| added on the top share by covariance
    cispo_loss             MiniMax-M1 (arXiv 2506.13585), CISPO: the importance weight clipped and detached, so every
                           token keeps its gradient (TRL: ``loss_type="cispo"``)
    entropy_advantage      Cheng et al. 2025 (arXiv 2506.14758): the advantage plus a capped entropy bonus

Each equals the reference implementation's own code on the same tensors (tests/test_token_credit.py: TRL's from the
installed package, verl's read from its wheel). Losses are token means with ``denom`` as ``objective.policy_loss``'s.

Shape legend: B rows, T response tokens.
"""

from __future__ import annotations

import torch

from lopti_lab.objective import masked_mean

__all__ = ["cispo_loss", "clip_cov_loss", "covariance", "entropy_advantage", "forking_mask", "kl_cov_loss"]


def forking_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """The "forking" tokens (Wang et al. 2025, Eq. 4): the response tokens whose entropy is at least the batch's
    (1 - rho) quantile, so about a share rho of them; the rest get no gradient (multiply their loss by 0, keep them
    in the token mean's denominator, as TRL does). rho = 1 keeps every token.

    The quantile is ``torch.quantile``'s (linear interpolation) over the masked tokens; a tie with it is kept.
    Worked example: entropies [0.1, 0.9, 0.5, 0.7] with the last one padding, rho = 0.5: the valid [0.1, 0.9, 0.5]
    have a 0.5 quantile of 0.5, so the mask is [False, True, True, False].

    entropy, mask: (B, T). Returns a bool (B, T) mask.
    """
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    keep = mask.bool()
    valid = entropy.detach()[keep].float()
    if valid.numel() == 0:
        return torch.zeros_like(keep)
    threshold = torch.quantile(valid, 1.0 - rho)
    return (entropy.detach() >= threshold) & keep


def covariance(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cui et al.'s per-token covariance (their Eq. 11), the centred product of a token's advantage and its
    log-probability over the batch's response tokens: (A_t - mean A) (log pi_t - mean log pi); means over ``mask``.
    A token whose log-prob and advantage are both above their means pushes the entropy down when trained on.

    Worked example: A = [1, -1], log pi = [-0.1, -2.1] (means 0 and -1.1): cov = [1 * 1.0, -1 * -1.0] = [1, 1].

    logp: (B, T) detached or not (used detached); advantages: (B,) or (B, T); mask: (B, T). Returns (B, T)."""
    adv = advantages[:, None].expand_as(logp) if advantages.ndim == 1 else advantages
    logp = logp.detach()
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


def clip_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    share: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    denom: torch.Tensor | float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, Algorithm 1): PPO's clipped loss, with the gradient of a few tokens whose
    covariance lies in (cov_low, cov_high) dropped: max(1, int(share x tokens)) of them, drawn at random among the
    tokens the ratio clip has not already cut. verl's defaults: share 2e-4, band (1, 5); on a lab-sized batch (a
    few thousand tokens) that share drops a single token, so a lab run states its own.

    Worked example: two tokens, A = [2, -2], log pi = log pi_old = [-0.1, -3.1]: cov = [2 * 1.5, -2 * -1.5] = [3, 3],
    both in (1, 5); share 0.5 drops max(1, int(0.5 * 2)) = 1 of them at random, and the loss is the other token's
    -A * ratio over the 2 tokens.

    logp: (B, T) with grad; old_logp: (B, T); advantages: (B,) or (B, T); mask: (B, T). Returns the loss and
    ``dropped`` (the tokens' 0/1 mask, (B, T)), ``drop_frac``.
    """
    adv = advantages[:, None].expand_as(logp) if advantages.ndim == 1 else advantages
    keep = mask.bool()
    ratio = torch.exp(logp - old_logp)
    surr1, surr2 = -adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        cov = covariance(logp, adv, mask)
        clipped = (surr2 > surr1) & keep  # the ratio clip already cuts these
        band = (cov > cov_low) & (cov < cov_high) & keep & ~clipped
        candidates = band.nonzero()  # (n, 2), row-major
        n_drop = min(max(int(share * keep.sum().item()), 1), len(candidates))
        dropped = torch.zeros_like(logp)
        if len(candidates):  # (no draw from the generator otherwise, as verl)
            chosen = candidates[torch.randperm(len(candidates), generator=generator)[:n_drop]]
            dropped[chosen[:, 0], chosen[:, 1]] = 1.0
    per_token_loss = torch.maximum(surr1, surr2) * (1.0 - dropped)
    loss = masked_mean(per_token_loss, mask, denom)
    return loss, {"dropped": dropped, "drop_frac": masked_mean(dropped, mask)}


def kl_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    share: float = 2e-4,
    kl_coef: float = 1.0,
    denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025, Algorithm 2): the unclipped loss -A * ratio, with kl_coef * |log pi - log pi_old|
    added on the max(1, int(share x tokens)) tokens of the largest covariance. verl's defaults: share 2e-4 and
    ppo_kl_coef 0.1 in its config (1.0 when left unset); the share selects one token on a lab-sized batch.

    Worked example: tokens with cov [3, 1] and share 0.5: the first (largest) gets the penalty; at ratio 1 the
    penalty is 0 and its gradient kl_coef * sign(log pi - log pi_old), zero too until the token has moved.

    Shapes as ``clip_cov_loss``. Returns the loss and ``penalised`` ((B, T) 0/1), ``penalised_frac``.
    """
    adv = advantages[:, None].expand_as(logp) if advantages.ndim == 1 else advantages
    keep = mask.bool()
    ratio = torch.exp(logp - old_logp)
    per_token_loss = -adv * ratio
    with torch.no_grad():
        cov = covariance(logp, adv, mask).masked_fill(~keep, -torch.inf)
        k = max(1, int(share * keep.sum().item()))
        top = torch.topk(cov.reshape(-1), min(k, int(keep.sum())), largest=True).indices
        penalised = torch.zeros_like(logp).reshape(-1)
        penalised[top] = 1.0
        penalised = penalised.view_as(logp)
    per_token_loss = per_token_loss + penalised * kl_coef * (logp - old_logp).abs()
    loss = masked_mean(per_token_loss, mask, denom)
    return loss, {"penalised": penalised, "penalised_frac": masked_mean(penalised, mask)}


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_max: float = 5.0,
    denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Eq. 4-5 of arXiv 2506.13585): -sg(min(ratio, eps_max)) * A * log pi, a token mean. The
    importance weight is clipped and detached, never the token: where PPO's clip zeroes a token's gradient, CISPO
    keeps it at the capped weight (the rare, low-probability "fork" tokens PPO clips first keep learning). TRL's
    ``loss_type="cispo"`` caps from above only, at ``epsilon_high`` (MiniMax recommends 5).

    Worked example: pi_old = 0.1, pi = 0.8 (ratio 8), A = 1, eps_max 5: the loss is -5 * log 0.8 = 1.116 with gradient
    -5 / pi in pi, where PPO at 1.2 would give none.

    Shapes as ``clip_cov_loss``. Returns the loss and ``capped_frac`` (tokens whose weight was capped)."""
    adv = advantages[:, None].expand_as(logp) if advantages.ndim == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, max=eps_max).detach()
    loss = masked_mean(-weight * adv * logp, mask, denom)
    return loss, {"capped_frac": masked_mean((ratio > eps_max).to(logp.dtype).detach(), mask)}


def entropy_advantage(
    advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, alpha: float = 0.4, kappa: float = 2.0
) -> torch.Tensor:
    """The entropy-shaped advantage of Cheng et al. 2025 (arXiv 2506.14758), as quoted by later work (their paper's
    defaults are not reproduced here): A_t + min(alpha * H_t, |A_t| / kappa), the entropy detached. The bonus is
    capped at |A| / kappa (kappa > 1) so it can never flip an advantage's sign, and adds to positive and negative
    advantages alike: exploratory (high-entropy) tokens are pushed up a little more, or down a little less.

    Worked example: A = [1, -1], H = [2.0, 0.1], alpha 0.4, kappa 2: bonus [min(0.8, 0.5), min(0.04, 0.5)] = [0.5,
    0.04], shaped [1.5, -0.96].

    advantages: (B,) or (B, T); entropy: (B, T) of the rollout policy; mask: (B, T). Returns (B, T), 0 on padding.
    """
    if alpha <= 0 or kappa <= 1:
        raise ValueError(f"alpha must be > 0 and kappa > 1, got alpha={alpha}, kappa={kappa}")
    adv = advantages[:, None].expand_as(entropy) if advantages.ndim == 1 else advantages
    bonus = torch.minimum(alpha * entropy.detach(), adv.abs() / kappa)
    return (adv + bonus) * mask
