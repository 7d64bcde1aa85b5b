"""The RL objective as pure tensor functions: GRPO advantages, Advantage Reweighting, Lopti stages, the clipped loss.

Nothing here knows about models, tokenizers or puzzles, so a trainer other than ours (verl, TRL) can call these
functions as they are. docs/paper.md §2-4 gives the equations; each function's docstring works one small case by hand.

Shape legend
    B  rows of a batch = prompts x group size (rows of one group are contiguous: b // G is the prompt)
    G  group size (completions sampled per prompt)
    T  response tokens (right-padded; ``mask`` marks the real ones)
    V  vocabulary
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "group_advantages",
    "kl_penalty",
    "lopti_stages",
    "masked_mean",
    "policy_loss",
    "reweight_advantages",
    "token_logprobs",
]


def masked_mean(values: torch.Tensor, mask: torch.Tensor, denom: torch.Tensor | float | None = None) -> torch.Tensor:
    """sum(values * mask) / denom, with denom = mask.sum() unless given (0 when the mask is empty)."""
    total = (values * mask).sum()
    denom = mask.sum() if denom is None else denom
    return total / torch.clamp(torch.as_tensor(denom, dtype=total.dtype, device=total.device), min=1)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: Literal["std", "none"] = "std", eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's advantage of each completion: its reward against the other completions of the same prompt.

    ``scale="std"``: (r - mean_g) / (std_g + eps) with the unbiased sample std (Bessel's n - 1), as verl and TRL do;
    ``scale="none"``: r - mean_g (Dr. GRPO drops the std, which up-weights near-uniform groups).

    Worked example, one group of G = 3 with rewards [3, 0, 0]: mean 1, deviations [2, -1, -1], unbiased variance
    (4 + 1 + 1) / 2 = 3, std 1.7321, so A = [1.1547, -0.5774, -0.5774]. A group whose rewards are all equal gets
    A = 0 for every completion (no signal; the trainer logs the share of such groups).

    rewards: (B,) with B = prompts x G, groups contiguous. Returns (B,) float32.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {rewards.shape}")
    if scale == "std" and group_size < 2:
        raise ValueError("group_size must be >= 2 for std scaling (one sample has no std)")
    grouped = rewards.float().view(-1, group_size)  # (B/G, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "std":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    return centered.view(-1)  # (B,)


def reweight_advantages(advantages: torch.Tensor, old_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage Reweighting (AR, docs/paper.md §3): A_hat_t = [alpha * pi_old(o_t) + (1 - alpha)] * A_t.

    The weight is linear in the rollout probability, so it damps exactly the tokens whose gradients are largest
    (norm ~ 1 - pi, §2). alpha = 0 returns A unchanged (plain GRPO); alpha = 1 weights each token by pi_old itself.

    Worked example, alpha = 0.3, A = 1: a token sampled at pi = 0.05 gets 0.3 * 0.05 + 0.7 = 0.715, one at pi = 0.95
    gets 0.3 * 0.95 + 0.7 = 0.985; with A = -2 they get -1.43 and -1.97.

    advantages: (B,) per sequence or (B, T) per token; old_logp: (B, T), detached. Returns (B, T).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if advantages.ndim == 1:
        advantages = advantages[:, None]  # (B, 1)
    weight = alpha * old_logp.detach().exp() + (1.0 - alpha)  # AR, Eq. 4
    return advantages * weight  # (B, T)


def lopti_stages(
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    eta: float,
    order: Literal["low_first", "high_first"] = "low_first",
) -> list[tuple[str, torch.Tensor]]:
    """Low-Probability Token Isolation (Lopti, docs/paper.md §4): split the response tokens into two update stages.

    low = response tokens with pi_old = exp(old_logp) < eta; high = the rest of the response. The two masks partition
    ``mask``. The paper updates low first; ``order="high_first"`` is its ablation (worse than GRPO: the low tokens'
    large gradients then undo the high-token update).

    Worked example, eta = 0.5, pi_old = [0.1, 0.5, 0.9, 0.3] with mask [1, 1, 1, 0] (last token is padding):
    low = [1, 0, 0, 0] (0.5 is not < 0.5), high = [0, 1, 1, 0]; returns [("low", low), ("high", high)].

    old_logp, mask: (B, T). Returns a list of (name, mask) with masks (B, T) in ``mask``'s dtype.
    """
    if not 0.0 < eta < 1.0:
        raise ValueError(f"eta must be in (0, 1), got {eta}")
    keep = mask.bool()
    is_low = old_logp.detach().exp() < eta
    low = (keep & is_low).to(mask.dtype)  # Lopti stage 1: low-probability tokens, (B, T)
    high = (keep & ~is_low).to(mask.dtype)  # Lopti stage 2: the rest, (B, T)
    if order == "low_first":
        return [("low", low), ("high", high)]
    if order == "high_first":
        return [("high", high), ("low", low)]
    raise ValueError(f"order must be 'low_first' or 'high_first', got {order!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO/GRPO clipped surrogate with an optional dual clip and k3 KL, as a token mean.

        ratio_t = exp(logp_t - old_logp_t)
        pg_t    = -min(ratio_t * A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_t)
        pg_t    = min(pg_t, -c * A_t)  where A_t < 0              (dual clip, Ye et al. 2020, c = dual_clip)
        kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       (k3, verl's "low_var_kl", clamped to 10)
        loss    = sum_t mask_t * (pg_t + kl_coef * kl_t) / denom

    ``denom`` defaults to mask.sum(). A Lopti stage passes its own token mask with the minibatch's full response-token
    count as ``denom``, as the paper's code does, so each stage's loss is on the same scale as a GRPO loss.

    Worked example (clip 0.2 / 0.2, one token, mask 1): pi_old = 0.5, pi = 0.6 gives ratio 1.2 and with A = 1
    loss = -1.2 (at the edge, not clipped); pi = 0.75 gives ratio 1.5, surr2 = 1.2 * 1 wins the min, loss = -1.2 with
    zero gradient (clipped high); pi = 0.25, A = -1: ratio 0.5, surr1 = -0.5, surr2 = 0.8 * -1 = -0.8, loss 0.8
    (clipped low); ratio 20, A = -1, c = 10: pg = 20 is capped at 10 by the dual clip.

    logp: (B, T) with grad; old_logp, ref_logp: (B, T) detached; advantages: (B,) or (B, T); mask: (B, T).
    Returns the scalar loss and detached diagnostics (means over ``mask``): approx_kl, clip_frac_low, clip_frac_high,
    dual_clip_frac, kl, tokens.
    """
    if advantages.ndim == 1:
        advantages = advantages[:, None]  # (B, 1)
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    surr1 = ratio * advantages
    surr2 = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    pg_loss = -torch.min(surr1, surr2)
    if dual_clip is not None:  # cap the loss of negative-advantage tokens whose ratio has exploded
        pg_loss = torch.where(advantages < 0, torch.min(pg_loss, -dual_clip * advantages), pg_loss)
    per_token_kl = torch.zeros_like(logp)
    if ref_logp is not None and kl_coef != 0.0:
        per_token_kl = kl_penalty(logp, ref_logp)
    per_token_loss = pg_loss + kl_coef * per_token_kl
    loss = masked_mean(per_token_loss, mask, denom)

    with torch.no_grad():
        stats = {
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),  # k3 of KL(pi_old || pi)
            "clip_frac_low": masked_mean(((ratio < 1.0 - clip_low) & (advantages < 0)).to(mask.dtype), mask),
            "clip_frac_high": masked_mean(((ratio > 1.0 + clip_high) & (advantages > 0)).to(mask.dtype), mask),
            "dual_clip_frac": masked_mean(((advantages < 0) & (ratio > (dual_clip or torch.inf))).to(mask.dtype), mask),
            "kl": masked_mean(per_token_kl, mask),
            "tokens": mask.sum(),
        }
    return loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The per-token k3 estimate of KL(pi || pi_ref), exp(r) - r - 1 with r = ref_logp - logp, clamped at 10 (verl's
    "low_var_kl"): unbiased and non-negative (http://joschu.net/blog/kl-approx.html). Example: r = 0 gives 0; r = 1
    gives e - 2 = 0.718. (B, T) -> (B, T)."""
    ref_log_ratio = ref_logp - logp
    return torch.clamp(torch.exp(ref_log_ratio) - ref_log_ratio - 1.0, max=10.0)


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / tau)[ids] and its gradient, one chunk of rows at a time.

    Saves only the logits (in their own dtype, bf16 on a GPU) and the (N,) log-normaliser: the float32 (N, V) softmax
    exists one chunk at a time in forward and backward, never for the whole batch (a (B, T, V) float32 copy of the
    logits is the largest tensor of a naive GRPO step at T = 4096).
    """

    @staticmethod
    def forward(ctx, logits, ids, temperature, chunk_rows, with_entropy):  # logits (N, V), ids (N,)
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> float32, float64 stays exact
        logp = torch.empty(ids.shape, dtype=dtype, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        for start in range(0, logits.shape[0], chunk_rows):
            scaled = logits[start : start + chunk_rows].to(dtype)  # (n, V)
            scaled = scaled if temperature == 1.0 else scaled / temperature  # x / 1 == x: one pass saved, exactly
            lse_chunk = torch.logsumexp(scaled, dim=-1)  # (n,)
            lse[start : start + chunk_rows] = lse_chunk
            picked = scaled.gather(-1, ids[start : start + chunk_rows, None]).squeeze(-1)
            logp[start : start + chunk_rows] = picked - lse_chunk
            if with_entropy:  # H = lse - sum_v p_v * z_v
                probs = torch.exp(scaled - lse_chunk[:, None])
                entropy[start : start + chunk_rows] = lse_chunk - (probs * scaled).sum(-1)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(*(() if entropy is None else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        tau = ctx.temperature
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            z = logits[rows].to(lse.dtype)
            z = z if tau == 1.0 else z / tau  # (n, V)
            # d logp_y / d z = (e_y - p) / tau  (docs/paper.md §1); in place, one (n, V) buffer: p x (-g) is -(p x g)
            g = z.sub(lse[rows, None]).exp_().mul_(-grad_logp[rows, None])
            g.scatter_add_(-1, ids[rows, None], grad_logp[rows, None])
            grad[rows] = g if tau == 1.0 else g.div_(tau)
        return grad, None, None, None, None


CHUNK_ELEMENTS = {"cpu": 2**20, "accelerator": 2**25}
"""Logits per chunk of ``token_logprobs``. On a CPU a chunk's float32 buffers (4 MiB) stay in a core's L2 cache
through the chunk's passes, so only the first reads memory (``benchmarks/bench_logprobs.py``); on a GPU a chunk is a
few kernel launches, and big chunks keep them few."""


def token_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each chosen token under softmax(logits / temperature), and optionally the entropy.

    Equals ``(logits / temperature).log_softmax(-1).gather(-1, ids[..., None])`` in float32, differentiable in
    ``logits``, without materialising the float32 (..., V) log-softmax (see ``_TokenLogprobs``). Dividing by the
    rollout temperature makes the training log-probs match the distribution the tokens were sampled from, as verl
    and TRL do.

    logits: (B, T, V) any float dtype; ids: (B, T). Returns logp (B, T) and entropy (B, T) or None, in float32 (float64
    for float64 logits). ``chunk_elements``: logits per chunk (None: ``CHUNK_ELEMENTS`` for the logits' device).
    """
    *lead, vocab = logits.shape
    chunk_elements = chunk_elements or CHUNK_ELEMENTS["cpu" if logits.device.type == "cpu" else "accelerator"]
    chunk_rows = max(1, chunk_elements // vocab)
    logp, entropy = _TokenLogprobs.apply(
        logits.reshape(-1, vocab), ids.reshape(-1), float(temperature), chunk_rows, with_entropy
    )
    return logp.view(*lead), None if entropy is None else entropy.view(*lead)
