"""The update of one RL step: per-token advantages and the update stages (AR, Lopti and the token-level methods
after them), the loss of a micro-batch, and every optimizer step (``update_policy``), with the optimizer they take.

    token_adv, stages, metrics = advantages_and_stages(rollout, advantages, config)   # AR, Lopti, forking, ...
    metrics |= update_policy(model, optimizer, rollout, token_adv, stages, config)    # all optimizer steps

``trainer.train_step`` runs these after the rollout; the counterfactual runs them on a frozen batch. Shape legend:
B rows = prompts x G, T response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from lopti_lab.objective import kl_penalty, lopti_stages, masked_mean, policy_loss, reweight_advantages
from lopti_lab.probes import GradientProbe
from lopti_lab.rollout import Rollout, response_logprobs
from lopti_lab.token_credit import cispo_loss, clip_cov_loss, entropy_advantage, forking_mask, kl_cov_loss
from lopti_lab.train_config import TrainConfig

__all__ = ["advantages_and_stages", "build_optimizer", "token_loss", "update_policy", "uses_entropy"]


def _schedule(stages, n_rows: int, minibatch: int, epochs: int) -> Iterator[tuple[str, torch.Tensor, slice]]:
    """The update order: every minibatch of stage 1 (Lopti: low tokens), then every minibatch of stage 2.

    A minibatch with no token in the stage still takes its optimizer step (zero gradient, but AdamW's momentum and
    weight decay move the weights), as the paper's code does, so Lopti always takes twice GRPO's steps."""
    for name, stage_mask in stages:
        for _ in range(epochs):
            for start in range(0, n_rows, minibatch):
                yield name, stage_mask, slice(start, start + minibatch)


def _probe_tokens(
    probe: GradientProbe | None, rollout: Rollout, rows: slice, probe_by: torch.Tensor | None = None
) -> Callable[[int], None] | None:
    """Tell the probe, before each forward, what bins the t response columns that forward keeps: their rollout
    probabilities, or ``probe_by`` ((B, T) values in [0, 1], e.g. ``bins.entropy_rank`` for entropy bins)."""
    if probe is None:
        return None
    by = rollout.old_logp.exp() if probe_by is None else probe_by
    return lambda t: probe.set_tokens(by[rows, :t], rollout.response_mask[rows, :t])


def _acting_rows(acting: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a micro-batch that have a token with a gradient, acting (b, T) bool, and for each of them the
    response mask cut after its last such token (k, T): the forward those tokens need (causal attention)."""
    reach = acting.flip(1).cumsum(1).flip(1) > 0  # (b, T): up to and including the row's last acting token
    rows = acting.any(1).nonzero()[:, 0]  # (k,)
    return rows, (response_mask * reach)[rows]


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    advantages: torch.Tensor,
    stages: Sequence[tuple[str, torch.Tensor]],
    config: TrainConfig,
    probe: GradientProbe | None = None,
    probe_by: torch.Tensor | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, float]:
    """All optimizer steps of one RL step; returns the update's metrics.

    advantages: (B, T) per token (AR already applied); stages: [(name, mask (B, T))], [("all", response_mask)] for
    GRPO. Each minibatch's loss is a token mean with the minibatch's full response-token count as denominator, also
    inside a Lopti stage (the paper's code). A non-finite loss or gradient norm skips that optimizer step, zeroes
    the gradients and ends the step's updates (``skipped/nonfinite`` = 1). An attached ``probe`` gets each
    micro-batch's rollout probabilities before its forward and records the per-bin gradients of its backward.

    ``scaler`` (a float16 policy, made once by the trainer and kept across steps): each backward runs on the loss
    times the scale, so that small gradients do not underflow float16 (smallest subnormal ~6e-8); the gradients are
    unscaled before clipping, and an optimizer step whose gradients overflowed (inf/nan) is skipped by the scaler,
    which halves its scale: an expected event, not the end of the RL step (``amp/skipped_steps``, ``amp/scale``
    after the step). A non-finite loss still ends the step's updates (``skipped/nonfinite``): no scale fixes it;
    so does an overflow at a scale <= 1, where the gradient itself does not fit float16.

    Only the stage's tokens with a nonzero advantage (every stage token when a KL term acts) have a gradient: the
    diagnostics (approx_kl, clip fractions, kl) are means over those, and, when pi_old is given and no probe is
    attached, the forwards skip the rest (``_acting_rows``): a group whose rewards are all equal is not run at all,
    and each row stops at its last such token. The gradient is the same sum, less its exact zeros.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    micro = config.micro_batch_size or config.minibatch_size
    on_policy = rollout.old_logp is None  # pi_old comes from the update's own forward: one optimizer step only
    if on_policy and (len(stages) > 1 or config.optimizer_steps_per_stage > 1):
        raise ValueError("rollout.old_logp is required when the update takes more than one optimizer step")
    input_ids, attention_mask = rollout.input_ids, rollout.attention_mask  # (B, P + T)
    keys = ("approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "kl", "tokens", "loss", "entropy")
    sums = {key: torch.zeros((), device=input_ids.device) for key in keys}
    grad_norms, n_steps, nonfinite, amp_skipped = [], 0, False, 0
    with_kl = rollout.ref_logp is not None and config.kl_coef != 0.0
    trim = not on_policy and probe is None  # on-policy: every row's forward is pi_old and its entropy
    model.train()
    try:
        for _name, stage_mask, rows in _schedule(stages, len(rollout), config.minibatch_size, config.ppo_epochs):
            denom = rollout.response_mask[rows].sum()  # all response tokens of the minibatch, whatever the stage
            optimizer.zero_grad(set_to_none=True)
            minibatch_loss, ran = torch.zeros((), device=input_ids.device), False
            for start in range(rows.start, rows.stop, micro):
                m = slice(start, start + micro)
                acting = stage_mask[m].bool() if with_kl else stage_mask[m].bool() & (advantages[m] != 0)  # (b, T)
                r, reach = m, rollout.response_mask[m]  # the rows run and their response columns
                if trim:
                    kept, reach = _acting_rows(acting, reach)
                    if len(kept) == 0:
                        continue  # no token of this micro-batch has a gradient
                    r, acting = kept + start, acting[kept]
                logp, entropy = response_logprobs(
                    model,
                    input_ids[r],
                    attention_mask[r],
                    reach,
                    config.temperature,
                    with_entropy=on_policy,
                    before_forward=_probe_tokens(probe, rollout, m, probe_by),
                    fast_path=config.fast_path,
                )  # (b, T)
                if on_policy:  # the weights are still the rollout's: this forward IS pi_old, exactly
                    sums["entropy"] += (entropy * rollout.response_mask[m]).sum()
                loss, stats = token_loss(
                    config,
                    logp,
                    logp.detach() if on_policy else rollout.old_logp[r],
                    advantages[r],
                    acting,
                    None if rollout.ref_logp is None else rollout.ref_logp[r],
                    denom,
                )
                (loss if scaler is None else scaler.scale(loss)).backward()
                ran = True
                minibatch_loss += loss.detach()
                for key in ("approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "kl"):
                    sums[key] += stats[key] * stats["tokens"]
                sums["tokens"] += stats["tokens"]
            if not ran:  # every forward skipped: the step is still taken, on the zero gradient a backward gives
                for p in params:
                    p.grad = torch.zeros_like(p)
            if scaler is not None:
                if not torch.isfinite(minibatch_loss):
                    nonfinite = True
                    break
                scaler.unscale_(optimizer)  # clip (and report) the true gradient
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip or math.inf)
            if scaler is not None:
                scale = scaler.get_scale()
                scaler.step(optimizer)  # skipped when unscale_ found an inf/nan gradient
                scaler.update()  # halves the scale after a skip, doubles it after growth_interval clean steps
                if scaler.get_scale() < scale:
                    amp_skipped += 1
                    if scale <= 1.0:  # it overflowed unscaled: the gradient itself is not finite in float16
                        nonfinite = True
                        break
                    continue
            elif not (torch.isfinite(minibatch_loss) and torch.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                nonfinite = True
                break
            else:
                optimizer.step()
            n_steps += 1
            grad_norms.append(grad_norm.detach())
            sums["loss"] += minibatch_loss
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
    n_minibatches = config.optimizer_steps_per_stage
    tokens = max(sums["tokens"].item(), 1.0)
    return {
        "policy/approx_kl": sums["approx_kl"].item() / tokens,
        "policy/clip_frac_low": sums["clip_frac_low"].item() / tokens,
        "policy/clip_frac_high": sums["clip_frac_high"].item() / tokens,
        "policy/dual_clip_frac": sums["dual_clip_frac"].item() / tokens,
        "policy/kl": sums["kl"].item() / tokens,
        "loss/policy": sums["loss"].item() / n_minibatches,  # Lopti: its two stages add up to one loss
        "grad/norm": torch.stack(grad_norms).mean().item() if grad_norms else math.nan,
        "update/optimizer_steps": float(n_steps),
        "skipped/nonfinite": float(nonfinite),
        **({"amp/skipped_steps": float(amp_skipped), "amp/scale": scaler.get_scale()} if scaler is not None else {}),
        **({"policy/entropy": sums["entropy"].item() / rollout.response_mask.sum().item()} if on_policy else {}),
    }


def token_loss(
    cfg: TrainConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    denom: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``cfg.loss`` of a micro-batch as a token mean over ``denom`` (the minibatch's response tokens), with the k3 KL
    term when ``cfg.kl_coef`` > 0: the paper's clipped loss (``objective.policy_loss``), or CISPO, Clip-Cov or KL-Cov
    (``token_credit``). The clipped loss's diagnostics (approx KL, clip fractions) are reported for every loss."""
    loss, stats = policy_loss(
        logp, old_logp, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        ref_logp=ref_logp, kl_coef=cfg.kl_coef, denom=denom,
    )  # fmt: skip
    if cfg.loss == "ppo":
        return loss, stats
    if cfg.loss == "cispo":
        loss, _ = cispo_loss(logp, old_logp, advantages, mask, eps_max=cfg.cispo_eps_max, denom=denom)
    elif cfg.loss == "clip_cov":
        low, high = cfg.clip_cov_band
        loss, _ = clip_cov_loss(logp, old_logp, advantages, mask, share=cfg.cov_share, cov_low=low, cov_high=high,
                                clip_low=cfg.clip_low, clip_high=cfg.clip_high, denom=denom)  # fmt: skip
    else:  # "kl_cov"
        loss, _ = kl_cov_loss(logp, old_logp, advantages, mask, share=cfg.cov_share, kl_coef=cfg.kl_cov_coef,
                              denom=denom)  # fmt: skip
    if ref_logp is not None and cfg.kl_coef != 0.0:
        loss = loss + cfg.kl_coef * masked_mean(kl_penalty(logp, ref_logp), mask, denom)
    return loss, stats


def advantages_and_stages(
    rollout: Rollout, advantages: torch.Tensor, config: TrainConfig
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], dict[str, float]]:
    """Per-token advantages (B, T) with AR applied, the update stages [(name, mask (B, T))] and their metrics.

    AR (docs/paper.md §3) weights each token once per step, and every stage and minibatch uses those weights; Lopti
    (§4) gives [("low", ...), ("high", ...)] in ``config.lopti_order``, GRPO [("all", response_mask)]. Both read
    ``rollout.old_logp``; advantages: (B,) per sequence.
    """
    mask = rollout.response_mask  # (B, T)
    token_adv = advantages[:, None].expand_as(mask)  # (B, T)
    metrics: dict[str, float] = {}
    if config.ar_alpha is not None:  # AR, Eq. 4
        alpha = config.ar_alpha
        token_adv = reweight_advantages(advantages, rollout.old_logp, alpha)  # (B, T)
        metrics["ar/weight_mean"] = masked_mean(alpha * rollout.old_logp.exp() + 1 - alpha, mask).item()
    if config.entropy_adv_alpha is not None:  # Cheng et al. 2025: a capped entropy bonus on every token
        shaped = entropy_advantage(token_adv, rollout.entropy, mask, config.entropy_adv_alpha, config.entropy_adv_kappa)
        metrics["entadv/bonus_mean"] = masked_mean(shaped - token_adv * mask, mask).item()
        token_adv = shaped  # (B, T)
    stages = [("all", mask)]
    if config.lopti_eta is not None:
        stages = lopti_stages(rollout.old_logp, mask, config.lopti_eta, config.lopti_order)  # stage 1 low, 2 high
        metrics["lopti/low_share"] = (dict(stages)["low"].sum() / mask.sum()).item()
    if config.forking_rho is not None:  # Wang et al. 2025: only the step's top-rho entropy tokens carry the gradient
        forks = forking_mask(rollout.entropy, mask, config.forking_rho).to(mask.dtype)  # (B, T)
        stages = [(name, stage * forks) for name, stage in stages]
        metrics["forking/share"] = (forks.sum() / mask.sum()).item()
    return token_adv, stages, metrics


def uses_entropy(cfg: TrainConfig) -> bool:
    """Whether a config's method reads the rollout policy's entropy (forking tokens, the entropy advantage)."""
    return cfg.forking_rho is not None or cfg.entropy_adv_alpha is not None


def build_optimizer(params: Sequence[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``params``: AdamW (fused on a GPU) with its betas and epsilon, or SGD without momentum
    (the paper's Fig. 1 / Fig. 3 optimizer); both at ``cfg.lr`` with ``cfg.weight_decay``."""
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.0, weight_decay=cfg.weight_decay)
    fused = params[0].is_cuda
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=fused
    )
