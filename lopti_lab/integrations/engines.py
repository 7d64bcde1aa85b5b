"""AR and Lopti in the signatures other engines' extension points take: thin adapters over ``lopti_lab.objective``.

Every number here comes from ``objective`` (``reweight_advantages``, ``lopti_stages``, ``policy_loss``); this module
only reshapes the engines' tensors and reads their configs. No engine is imported: the signatures were read from the
engines' source (docs/engines.md names the files and commits) and tests/test_engines.py holds each adapter to the
objective on random batches.

Engine-neutral forms (any engine that exposes per-token advantages or per-token loss weights):
    ar_advantages           advantage transform: advantages (B,) or (B, T) + pi_old -> AR advantages (B, T)
    ar_loss_weights         per-token loss weights w_t with w_t x (clipped policy loss)_t == AR's loss, exactly
    lopti_stage_advantages  Lopti's two updates on one batch: per stage its token mask and its masked advantages
Engine-specific:
    verl_policy_loss        a policy loss for verl's ``register_policy_loss`` registry, with AR
    prime_rl_loss           a per-sequence loss for prime-rl's ``[trainer.loss] type = "custom"``, with AR

Shape legend: B rows (prompts x group size), T response tokens (right-padded, ``mask`` marks the real ones),
S tokens of one packed sequence (prime-rl's per-sample tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lopti_lab.objective import lopti_stages, masked_mean, policy_loss, reweight_advantages

__all__ = [
    "LoptiStage",
    "PrimeRLLossOutputs",
    "ar_advantages",
    "ar_loss_weights",
    "lopti_stage_advantages",
    "prime_rl_loss",
    "verl_policy_loss",
]

# --- engine-neutral forms ---------------------------------------------------------------------------------------------


def ar_advantages(
    advantages: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, *, alpha: float
) -> torch.Tensor:
    """Advantage transform for AR (docs/paper.md §3): per-token advantages in, per-token advantages out.

    ``objective.reweight_advantages`` times the response mask, so padding carries no advantage (an engine's
    log-probs on padding are not meaningful). Call it once per batch, where the engine has pi_old and the advantages
    together: OpenRLHF's ``Experience.advantages`` / ``action_log_probs`` / ``action_mask``, verl's batch keys
    ``advantages`` / ``old_log_probs`` / ``response_mask``.

    Example, alpha = 0.3, A = [1, 1, 1] on pi_old = [0.05, 0.95, 0.5] with mask [1, 1, 0]: [0.715, 0.985, 0].

    advantages: (B,) or (B, T); old_logp, mask: (B, T). Returns (B, T).
    """
    return reweight_advantages(advantages, old_logp, alpha) * mask.to(old_logp.dtype)  # AR, Eq. 4; (B, T)


def ar_loss_weights(old_logp: torch.Tensor, mask: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """AR as per-token loss weights: w_t = alpha * pi_old(o_t) + (1 - alpha) on the response, 0 on padding.

    Why a weight is AR: w_t > 0, and the clipped surrogate is positively homogeneous in A (min(w a, w b) = w min(a, b),
    the sign of A and so the dual clip's branch are unchanged), so w_t times the token's clipped policy loss equals
    the loss with A_t replaced by w_t A_t, exactly. It is NOT AR for a KL or entropy term in the same per-token loss:
    an engine that multiplies its whole per-token loss by the weights (prime-rl's ``loss_weights`` scale its default
    loss's KL term too) reweights those terms as well. At alpha = 1 a weight underflows to 0 where pi_old does, and
    prime-rl then drops that token from its denominator; alpha < 1 keeps every weight >= 1 - alpha.

    Example, alpha = 0.3, pi_old = [0.05, 0.95, 0.5], mask [1, 1, 0]: [0.715, 0.985, 0].

    old_logp, mask: (B, T), or (S,) for one sequence. Returns the same shape.
    """
    if old_logp.ndim == 1:  # one sequence: a (1, S) batch, not S per-sequence advantages
        return ar_loss_weights(old_logp[None], mask[None], alpha=alpha)[0]  # (S,)
    return ar_advantages(torch.ones_like(old_logp), old_logp, mask, alpha=alpha)  # (B, T)


@dataclass(frozen=True)
class LoptiStage:
    """One of Lopti's two updates: which tokens it trains and the advantages an engine feeds its loss."""

    name: str
    """"low" (pi_old < eta) or "high" (the rest of the response)."""
    mask: torch.Tensor
    """(B, T) the stage's tokens: the mask for the stage's KL and entropy terms, never the loss denominator."""
    advantages: torch.Tensor
    """(B, T) the advantages zeroed outside the stage: what replaces the engine's advantages for this update."""


def lopti_stage_advantages(
    advantages: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    eta: float,
    order: Literal["low_first", "high_first"] = "low_first",
) -> list[LoptiStage]:
    """Lopti (docs/paper.md §4) for an engine: the stages to run, in order, as two optimizer updates on one batch.

    An engine runs its whole update (all mini-batches, their optimizer steps) once per stage, with
    ``stage.advantages`` in place of its advantages and, between the stages, pi_old (the ratio's denominator) NOT
    recomputed. Zeroing the advantages is all the policy term needs: a token with A = 0 has zero clipped loss, and the
    engine's token-mean denominator, which counts the response mask, keeps counting every response token, as
    ``objective.policy_loss(..., mask=stage.mask, denom=mask.sum())`` does in our trainer. A KL or entropy term must
    be masked by ``stage.mask`` as well, inside the engine's loss. Pass advantages already reweighted by AR: the
    paper computes the AR weights once and uses them in both stages.

    Example, eta = 0.5, pi_old = [0.1, 0.5, 0.9, 0.3], mask [1, 1, 1, 0], A = 2 for the row: stages
    [low: mask [1, 0, 0, 0], A [2, 0, 0, 0]], [high: mask [0, 1, 1, 0], A [0, 2, 2, 0]].

    advantages: (B,) or (B, T); old_logp, mask: (B, T). Returns [LoptiStage, LoptiStage].
    """
    if advantages.ndim == 1:
        advantages = advantages[:, None]  # (B, 1)
    stages = lopti_stages(old_logp, mask, eta=eta, order=order)
    return [LoptiStage(name, stage_mask, advantages * stage_mask) for name, stage_mask in stages]  # (B, T) each


# --- verl -------------------------------------------------------------------------------------------------------------

VerlPolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


def verl_policy_loss(*, ar_alpha: float = 0.0) -> VerlPolicyLoss:
    """A verl policy loss with AR: the PPO/GRPO clipped loss of verl's ``vanilla`` mode on AR's advantages.

    Read from volcengine/verl at b178a3cd56f58b2d502255daba591e92833930a7 (version 0.8.0.dev):
    verl/trainer/ppo/core_algos.py, ``PolicyLossFn`` and ``compute_policy_loss_vanilla``. verl's actor
    (``verl/workers/actor/dp_actor.py`` ``update_policy``; ``verl/workers/utils/losses.py`` ``ppo_loss``) looks the
    function up by ``actor_rollout_ref.actor.policy_loss.loss_mode`` and calls it with keywords ``old_log_prob``,
    ``log_prob``, ``advantages``, ``response_mask``, ``loss_agg_mode``, ``config`` (the actor config) and
    ``rollout_is_weights``; it expects ``(pg_loss, metrics)``. Register the returned function in a module verl's
    workers import (docs/engines.md):

        register_policy_loss("lopti_ar")(verl_policy_loss(ar_alpha=0.3))

    What it takes from ``config``: ``clip_ratio``, ``clip_ratio_low`` / ``clip_ratio_high`` (None -> clip_ratio),
    ``clip_ratio_c`` (verl's dual clip, default 3.0, always on as in vanilla) and ``global_batch_info``
    (``dp_size``, ``batch_num_tokens``; verl's token mean is sum / batch_num_tokens x dp_size). Only
    ``loss_agg_mode="token-mean"`` (the paper's) is accepted. ``rollout_is_weights`` (>= 0) multiply the
    advantages, which equals verl's weighting of the per-token clipped loss (see ``ar_loss_weights``).
    Differences from vanilla: verl clamps the log-ratio to +-20 before exp, ``objective.policy_loss`` does not
    (the losses differ by at most e^-20 |A| per token, where a ratio is below e^-20); ``actor/pg_clipfrac`` counts a
    token whose IS weight is 0 as unclipped.

    AR reads pi_old from ``old_log_prob``. verl passes ``log_prob.detach()`` there when the update is one
    mini-batch and one epoch (``on_policy`` in dp_actor.py): the same numbers for one update, but not for Lopti's
    second stage (docs/engines.md).
    """
    if not 0.0 <= ar_alpha <= 1.0:
        raise ValueError(f"ar_alpha must be in [0, 1], got {ar_alpha}")

    def lopti_ar_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Mapping | None = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        clip_low, clip_high, clip_c, dp_size, batch_tokens = _verl_settings(config, loss_agg_mode)
        mask = response_mask.to(log_prob.dtype)  # (B, T)
        weighted = reweight_advantages(advantages, old_log_prob, ar_alpha)  # AR, Eq. 4; (B, T)
        if rollout_is_weights is not None:
            weighted = weighted * rollout_is_weights.detach()  # verl's IS correction scales the per-token loss
        loss, stats = policy_loss(
            log_prob,
            old_log_prob,
            weighted,
            mask,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=clip_c,
            denom=batch_tokens,
        )
        with torch.no_grad():
            metrics = {
                "actor/pg_clipfrac": (stats["clip_frac_low"] + stats["clip_frac_high"]).item(),
                "actor/ppo_kl": masked_mean(old_log_prob - log_prob, mask).item(),  # verl's metric: mean -log ratio
                "actor/pg_clipfrac_lower": stats["dual_clip_frac"].item(),
            }
        return loss * dp_size, metrics

    lopti_ar_policy_loss.__doc__ = f"verl policy loss with AR (alpha = {ar_alpha}); see verl_policy_loss."
    return lopti_ar_policy_loss


def _verl_settings(config: Mapping | None, loss_agg_mode: str) -> tuple[float, float, float, float, Any]:
    """(clip_low, clip_high, dual clip c, dp_size, batch_num_tokens or None) from verl's actor config, as vanilla
    reads them; the errors name verl's config keys."""
    if loss_agg_mode != "token-mean":
        raise ValueError(
            f"actor_rollout_ref.actor.loss_agg_mode must be 'token-mean' for lopti_lab's loss, got {loss_agg_mode!r}"
        )
    if config is None:
        raise ValueError("config: verl passes the actor config; lopti_lab's verl loss reads its clip ratios")
    clip = config.get("clip_ratio", 0.2)
    clip_low = config.get("clip_ratio_low", None)
    clip_high = config.get("clip_ratio_high", None)
    clip_c = config.get("clip_ratio_c", 3.0)
    if clip_c <= 1.0:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual clip), got {clip_c}")
    batch_info = config.get("global_batch_info", None) or {}
    return (
        clip if clip_low is None else clip_low,
        clip if clip_high is None else clip_high,
        clip_c,
        batch_info.get("dp_size", 1),
        batch_info.get("batch_num_tokens", None),
    )


# --- prime-rl ---------------------------------------------------------------------------------------------------------


@dataclass
class PrimeRLLossOutputs:
    """What prime-rl's ``compute_loss`` reads from a loss function's result: ``loss`` and ``metrics`` (0-d
    tensors), the fields of its ``LossOutputs`` (src/prime_rl/trainer/rl/loss.py)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def prime_rl_loss(
    inputs: Any,
    ar_alpha: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PrimeRLLossOutputs:
    """prime-rl's custom rl loss (``[trainer.loss] type = "custom"``): the paper's clipped GRPO loss with AR.

    prime-rl (src/prime_rl/trainer/rl/loss.py, ``setup_rl_loss_fn`` and ``compute_loss``) calls
    ``fn(inputs, **kwargs)`` once per packed sequence, ``kwargs`` from ``[trainer.loss.kwargs]``, with ``inputs`` a
    ``LossInputs``: ``trainer_logprobs``, ``inference_logprobs`` (the sampler's: pi_old, the ratio's denominator),
    ``advantages`` (per token), ``loss_mask`` (bool, this component's tokens), ``loss_weights`` (None or >= 0
    per-token weights). It sums the returned losses and divides by the global count of rl tokens, so the return
    is the SUM over the sequence's loss tokens; the whole batch is then ``objective.policy_loss``'s token mean.

    AR uses pi_old = exp(inference_logprobs), the rollout probability (docs/paper.md §3). ``loss_weights`` multiply
    the advantages, which equals scaling the per-token clipped loss (see ``ar_loss_weights``). This replaces
    prime-rl's default loss (DPPO masking plus a squared-log-ratio term): no KL term is added.

    inputs.*: (S,). Returns the scalar sum and 0-d diagnostics (means over the sequence's loss tokens).
    """
    mask = inputs.loss_mask[None]  # (1, S)
    old_logp = inputs.inference_logprobs[None].detach()  # (1, S)
    advantages = reweight_advantages(inputs.advantages[None], old_logp, ar_alpha)  # AR, Eq. 4; (1, S)
    if inputs.loss_weights is not None:
        if bool((inputs.loss_weights < 0).any()):
            raise ValueError("loss_weights must be >= 0 for lopti_lab's prime-rl loss (they scale advantages)")
        advantages = advantages * inputs.loss_weights[None]  # (1, S)
    loss, stats = policy_loss(
        inputs.trainer_logprobs[None],
        old_logp,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        denom=1.0,
    )
    names = ("approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac")
    return PrimeRLLossOutputs(loss=loss, metrics={name: stats[name] for name in names})
