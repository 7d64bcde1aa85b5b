"""The update of one RL step: per-token advantages and the update stages (AR, Lopti and the token-level methods
after them), the loss of a micro-batch, and every optimizer step (``update_policy``), with the optimizer they take.

    spec = config.update_spec()                                                       # an UpdateSpec
    token_adv, stages, metrics = advantages_and_stages(rollout, advantages, spec.objective)  # AR, Lopti, forking
    metrics |= update_policy(model, optimizer, rollout, token_adv, stages, spec)      # all optimizer steps

Each takes the small spec it needs: ``Objective`` (the method's switches and its loss's settings),
``UpdateSpec`` (the objective and how the batch is cut into optimizer steps), ``OptimizerSpec``. ``TrainConfig``
builds them (``objective()``, ``update_spec()``, ``optimizer_spec()``); the counterfactual builds its own.
``trainer.train_step`` runs these after the rollout; the counterfactual runs them on a frozen batch. Shape legend:
B rows = prompts x G, T response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from lopti_lab.checks import FieldCheck, is_real
from lopti_lab.methods import METHODS, Method
from lopti_lab.objective import kl_penalty, lopti_stages, masked_mean, policy_loss, reweight_advantages
from lopti_lab.probes import GradientProbe
from lopti_lab.probes.credit import CreditSums, token_sums
from lopti_lab.rollout import Rollout, response_logprobs
from lopti_lab.token_credit import cispo_loss, clip_cov_loss, entropy_advantage, forking_mask, kl_cov_loss

__all__ = [
    "Objective",
    "OptimizerSpec",
    "UpdateSpec",
    "advantages_and_stages",
    "build_optimizer",
    "check_objective",
    "token_loss",
    "update_policy",
]

OPTIMIZERS = ("adamw", "sgd")
"""``OptimizerSpec.optimizer`` choices."""


@dataclass(frozen=True)
class Objective:
    """What an update optimizes: the method's switches (``methods.Method``) and its loss's settings. Defaults are the
    paper's K&K settings (docs/paper.md §6)."""

    method: Method = METHODS["GRPO"]
    """the method: AR, Lopti, the loss and the token-level switches (``methods.Method``)"""
    advantage_scale: str = "std"
    """"std": GRPO's (r - mean) / (std + eps) per group; "none": r - mean (Dr. GRPO)"""
    clip_low: float = 0.2
    """lower clip range: ratio >= 1 - clip_low (the paper: 0.2)"""
    clip_high: float = 0.24
    """upper clip range: ratio <= 1 + clip_high (the paper: 0.24)"""
    dual_clip: float | None = 10.0
    """dual-clip constant c > 1 for negative advantages (the paper: 10); None = off"""
    kl_coef: float = 0.001
    """k3 KL-to-reference loss coefficient (the paper: 0.001); 0 = no reference forward at all"""
    cispo_eps_max: float = 5.0
    """CISPO's cap on the importance weight (MiniMax-M1: 5; TRL's epsilon_high)"""
    cov_share: float = 0.002
    """Clip-Cov / KL-Cov: share of the minibatch's response tokens they act on (verl's 2e-4 picks a single token of
    a lab-sized batch: the lab's default is ten times that)"""
    clip_cov_band: tuple[float, float] = (1.0, 5.0)
    """Clip-Cov: the covariance band its tokens are drawn from (verl: 1 to 5)"""
    kl_cov_coef: float = 1.0
    """KL-Cov: the coefficient of its |log pi - log pi_old| penalty (verl: 1.0 unless its config sets ppo_kl_coef)"""
    entropy_adv_kappa: float = 2.0
    """the entropy bonus's cap: at most |A| / kappa (kappa > 1, so an advantage never changes sign)"""

    def __post_init__(self):
        check_objective(FieldCheck(self))


def check_objective(check: FieldCheck) -> None:
    """Check the loss settings of ``Objective`` on any object holding them (an ``Objective``, a ``TrainConfig``);
    each error names the holder's field."""
    check.choice("advantage_scale", ("std", "none"))
    check.real("clip_low", 0.0, 1.0, high_open=True)
    check.real("clip_high", low=0.0)
    check.real("dual_clip", low=1.0, low_open=True, optional=True)
    check.real("kl_coef", low=0.0)
    check.real("cispo_eps_max", low=1.0, low_open=True)
    check.real("cov_share", 0.0, 1.0, low_open=True)
    check.items("clip_cov_band", is_real, "two numbers")
    band = check.obj.clip_cov_band
    check.need(len(band) == 2 and band[0] < band[1], "clip_cov_band", "must be two numbers (low, high), low < high")
    check.real("kl_cov_coef", low=0.0)
    check.real("entropy_adv_kappa", low=1.0, low_open=True)


@dataclass(frozen=True)
class UpdateSpec:
    """How one RL step's batch is updated: the objective, the rollout temperature its log-probs are taken at, and how
    the batch is cut into optimizer steps."""

    objective: Objective
    temperature: float
    """the rollout's sampling temperature: the update's log-probs are taken at it, as pi_old's were"""
    minibatch_size: int = 256
    """responses per optimizer step (the paper: 256); must divide B"""
    micro_batch_size: int | None = None
    """responses per forward / backward inside a minibatch (gradient accumulation); None = the whole minibatch"""
    ppo_epochs: int = 1
    """passes over the step's batch per stage (the paper: 1)"""
    grad_clip: float | None = 1.0
    """clip the gradient norm of each optimizer step (the paper: 1.0); None = no clipping"""
    fast_path: str = "auto"
    """the forward (``rollout.FAST_PATHS``)"""

    def optimizer_steps_per_stage(self, rows: int) -> int:
        return rows // self.minibatch_size * self.ppo_epochs


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer of an update. Defaults are the paper's (AdamW, lr 1e-6, weight decay 0.01)."""

    optimizer: str = "adamw"
    """"adamw" (how the paper trains) or "sgd" (plain SGD, no momentum: the optimizer of the paper's Fig. 1 and Fig. 3
    measurements, under which a token's probability moves with the size of its gradient)"""
    lr: float = 1e-6
    """learning rate (the paper: 1e-6 with AdamW and full fine-tuning; LoRA usually wants 1e-5 to 1e-4)"""
    weight_decay: float = 0.01
    """weight decay (the paper: 0.01): AdamW's decoupled decay, or SGD's L2 term"""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    adam_eps: float = 1e-8
    """AdamW epsilon (larger values damp the updates of parameters whose gradients are tiny)"""


def _schedule(stages, n_rows: int, minibatch: int, epochs: int) -> Iterator[tuple[str, torch.Tensor, slice]]:
    """The update order: every minibatch of stage 1 (Lopti: low tokens), then every minibatch of stage 2.

    A minibatch with no token in the stage still takes its optimizer step (zero gradient, but AdamW's momentum and
    weight decay move the weights), as the paper's code does, so Lopti always takes twice GRPO's steps."""
    for name, stage_mask in stages:
        for _ in range(epochs):
            for start in range(0, n_rows, minibatch):
                yield name, stage_mask, slice(start, start + minibatch)


def _probe_tokens(
    probe: GradientProbe | None,
    rollout: Rollout,
    rows: slice,
    probe_by: torch.Tensor | None = None,
    run: slice | torch.Tensor | None = None,
) -> Callable[[int], None] | None:
    """Tell the probe, before each forward, what bins the t response columns that forward keeps: their rollout
    probabilities, or ``probe_by`` ((B, T) values in [0, 1], e.g. ``bins.entropy_rank`` for entropy bins). The
    forward runs the micro-batch's rows ``run`` (default all of ``rows``); the token shares count every token of
    ``rows``, run or not."""
    if probe is None:
        return None
    by = rollout.old_logp.exp() if probe_by is None else probe_by
    run = rows if run is None else run
    census = (by[rows], rollout.response_mask[rows])
    return lambda t: probe.set_tokens(by[run, :t], rollout.response_mask[run, :t], census=census)


def _acting_rows(acting: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a micro-batch that have a token with a gradient, acting (b, T) bool, and for each of them the
    response mask cut after its last such token (k, T): the forward those tokens need (causal attention)."""
    reach = acting.flip(1).cumsum(1).flip(1) > 0  # (b, T): up to and including the row's last acting token
    rows = acting.any(1).nonzero()[:, 0]  # (k,)
    return rows, (response_mask * reach)[rows]


@dataclass
class _Pass:
    """One update's fixed parts and running sums: what every micro-batch of every stage reads and adds to."""

    model: torch.nn.Module
    rollout: Rollout
    advantages: torch.Tensor  # (B, T)
    spec: UpdateSpec
    probe: GradientProbe | None
    probe_by: torch.Tensor | None
    scaler: torch.amp.GradScaler | None

    def __post_init__(self):
        self.on_policy = self.rollout.old_logp is None  # pi_old comes from the update's own forward
        self.with_kl = self.rollout.ref_logp is not None and self.spec.objective.kl_coef != 0.0
        self.trim = not self.on_policy  # on-policy: every row's forward is pi_old and entropy
        device = self.rollout.input_ids.device
        self.sums = {key: torch.zeros((), device=device) for key in (*_TOKEN_STATS, "tokens", "loss", "entropy")}
        self.credit: CreditSums | None = None  # a probed update's per-bin clip shares (probes.credit)

    def minibatch(self, stage_mask: torch.Tensor, rows: slice) -> tuple[torch.Tensor, bool]:
        """Forward and backward of every micro-batch of one minibatch; its loss and whether any forward ran."""
        denom = self.rollout.response_mask[rows].sum()  # all response tokens of the minibatch, whatever the stage
        micro = self.spec.micro_batch_size or self.spec.minibatch_size
        loss, ran = torch.zeros((), device=denom.device), False
        for start in range(rows.start, rows.stop, micro):
            part = self.micro_batch(stage_mask, slice(start, start + micro), denom)
            if part is not None:
                loss += part
                ran = True
        return loss, ran

    def micro_batch(self, stage_mask: torch.Tensor, m: slice, denom: torch.Tensor) -> torch.Tensor | None:
        """One micro-batch's forward and backward; its loss, or None when no token of it has a gradient."""
        rollout, advantages = self.rollout, self.advantages
        acting = stage_mask[m].bool() if self.with_kl else stage_mask[m].bool() & (advantages[m] != 0)  # (b, T)
        r, reach = m, rollout.response_mask[m]  # the rows run and their response columns
        if self.trim:
            kept, kept_reach = _acting_rows(acting, reach)
            if len(kept):
                r, reach, acting = kept + m.start, kept_reach, acting[kept]
            elif self.probe is None:
                return None
            # else a probe still records this micro-batch (its tokens and a zero gradient), on all of its rows
        logp, entropy = response_logprobs(
            self.model, rollout.input_ids[r], rollout.attention_mask[r], reach, self.spec.temperature,
            with_entropy=self.on_policy, before_forward=_probe_tokens(self.probe, rollout, m, self.probe_by, r),
            fast_path=self.spec.fast_path,
        )  # fmt: skip
        if self.on_policy:  # the weights are still the rollout's: this forward IS pi_old, exactly
            self.sums["entropy"] += (entropy * rollout.response_mask[m]).sum()
        old = logp.detach() if self.on_policy else rollout.old_logp[r]
        ref = None if rollout.ref_logp is None else rollout.ref_logp[r]
        loss, stats = token_loss(self.spec.objective, logp, old, advantages[r], acting, ref, denom)
        if self.probe is not None and self.probe_by is None:  # by pi_old's bins, as the probe's shares
            self._count_clips(logp, old, advantages[r], acting)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        for key in _TOKEN_STATS:
            self.sums[key] += stats[key] * stats["tokens"]
        self.sums["tokens"] += stats["tokens"]
        return loss.detach()

    def _count_clips(self, logp, old_logp, advantages, acting) -> None:
        """Add a micro-batch's clipped tokens per bin of pi_old (``probes.credit``: ``clip/{low,high}_share_bin{k}``
        over the tokens that carried the loss, every pass counted)."""
        o = self.spec.objective
        part = token_sums(old_logp.exp(), acting, advantages, bins=self.probe.bins, log_ratio=logp.detach() - old_logp,
                          clip_low=o.clip_low, clip_high=o.clip_high)  # fmt: skip
        self.credit = part if self.credit is None else self.credit + part


_TOKEN_STATS = ("approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "kl")


def _optimizer_step(optimizer, params, loss: torch.Tensor, grad_clip: float | None, scaler) -> tuple[str, torch.Tensor]:
    """Clip and take one optimizer step: ("stepped", norm); ("amp_skipped", norm) when the scaler skipped an
    overflowing step ("amp_nonfinite" when it overflowed at a scale <= 1: the gradient itself does not fit float16);
    ("nonfinite", norm) when the loss or gradient is not finite (no step taken)."""
    if scaler is not None:
        if not torch.isfinite(loss):
            return "nonfinite", loss
        scaler.unscale_(optimizer)  # clip (and report) the true gradient
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip or math.inf)
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skipped when unscale_ found an inf/nan gradient
        scaler.update()  # halves the scale after a skip, doubles it after growth_interval clean steps
        if scaler.get_scale() >= scale:
            return "stepped", grad_norm
        return ("amp_nonfinite" if scale <= 1.0 else "amp_skipped"), grad_norm
    if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return "nonfinite", grad_norm
    optimizer.step()
    return "stepped", grad_norm


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    advantages: torch.Tensor,
    stages: Sequence[tuple[str, torch.Tensor]],
    spec: UpdateSpec,
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
    diagnostics (approx_kl, clip fractions, kl) are means over those, and, when pi_old is given, the forwards skip
    the rest (``_acting_rows``): a group whose rewards are all equal is not run at all, and each row stops at its
    last such token. The gradient is the same sum, less its exact zeros. An attached probe sees the same forwards
    (the skipped positions would add exact zeros to each bin's gradient) and counts every token in its token shares.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    work = _Pass(model, rollout, advantages, spec, probe, probe_by, scaler)
    per_stage = spec.optimizer_steps_per_stage(len(rollout))
    if work.on_policy and (len(stages) > 1 or per_stage > 1):
        raise ValueError("rollout.old_logp is required when the update takes more than one optimizer step")
    grad_norms, amp_skipped, nonfinite = [], 0, False
    model.train()
    try:
        for _name, stage_mask, rows in _schedule(stages, len(rollout), spec.minibatch_size, spec.ppo_epochs):
            optimizer.zero_grad(set_to_none=True)
            loss, ran = work.minibatch(stage_mask, rows)
            if not ran:  # every forward skipped: the step is still taken, on the zero gradient a backward gives
                for p in params:
                    p.grad = torch.zeros_like(p)
            outcome, grad_norm = _optimizer_step(optimizer, params, loss, spec.grad_clip, scaler)
            amp_skipped += outcome.startswith("amp")
            if outcome.endswith("nonfinite"):
                nonfinite = True
                break
            if outcome == "amp_skipped":
                continue
            grad_norms.append(grad_norm.detach())
            work.sums["loss"] += loss
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
    return _update_metrics(work, per_stage, grad_norms, nonfinite, amp_skipped)


def _update_metrics(work: _Pass, per_stage: int, grad_norms: list, nonfinite: bool, amp_skipped: int) -> dict:
    sums, scaler = work.sums, work.scaler
    tokens = max(sums["tokens"].item(), 1.0)
    return {
        **{f"policy/{key}": sums[key].item() / tokens for key in _TOKEN_STATS},
        "loss/policy": sums["loss"].item() / per_stage,  # Lopti: its two stages add up to one loss
        "grad/norm": torch.stack(grad_norms).mean().item() if grad_norms else math.nan,
        "update/optimizer_steps": float(len(grad_norms)),
        "skipped/nonfinite": float(nonfinite),
        **({"amp/skipped_steps": float(amp_skipped), "amp/scale": scaler.get_scale()} if scaler is not None else {}),
        **({"policy/entropy": sums["entropy"].item() / work.rollout.response_mask.sum().item()}
           if work.on_policy else {}),
        **({k: v for k, v in work.credit.metrics().items() if k.startswith("clip/")} if work.credit else {}),
    }  # fmt: skip


def token_loss(
    objective: Objective,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    denom: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective's loss of a micro-batch as a token mean over ``denom`` (the minibatch's response tokens), with
    the k3 KL term when ``kl_coef`` > 0: the paper's clipped loss (``objective.policy_loss``), or CISPO, Clip-Cov or
    KL-Cov (``token_credit``). The clipped loss's diagnostics (approx KL, clip fractions) are given for every loss."""
    o, kind = objective, objective.method.loss
    loss, stats = policy_loss(
        logp, old_logp, advantages, mask, clip_low=o.clip_low, clip_high=o.clip_high, dual_clip=o.dual_clip,
        ref_logp=ref_logp, kl_coef=o.kl_coef, denom=denom,
    )  # fmt: skip
    if kind == "ppo":
        return loss, stats
    if kind == "cispo":
        loss, _ = cispo_loss(logp, old_logp, advantages, mask, eps_max=o.cispo_eps_max, denom=denom)
    elif kind == "clip_cov":
        low, high = o.clip_cov_band
        loss, _ = clip_cov_loss(logp, old_logp, advantages, mask, share=o.cov_share, cov_low=low, cov_high=high,
                                clip_low=o.clip_low, clip_high=o.clip_high, denom=denom)  # fmt: skip
    else:  # "kl_cov"
        loss, _ = kl_cov_loss(logp, old_logp, advantages, mask, share=o.cov_share, kl_coef=o.kl_cov_coef,
                              denom=denom)  # fmt: skip
    if ref_logp is not None and o.kl_coef != 0.0:
        loss = loss + o.kl_coef * masked_mean(kl_penalty(logp, ref_logp), mask, denom)
    return loss, stats


def advantages_and_stages(
    rollout: Rollout, advantages: torch.Tensor, objective: Objective
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], dict[str, float]]:
    """Per-token advantages (B, T) with AR applied, the update stages [(name, mask (B, T))] and their metrics.

    AR (docs/paper.md §3) weights each token once per step, and every stage and minibatch uses those weights; Lopti
    (§4) gives [("low", ...), ("high", ...)] in the method's ``lopti_order``, GRPO [("all", response_mask)]. Both
    read ``rollout.old_logp``; advantages: (B,) per sequence.
    """
    method, mask = objective.method, rollout.response_mask  # (B, T)
    token_adv = advantages[:, None].expand_as(mask)  # (B, T)
    metrics: dict[str, float] = {}
    if method.ar_alpha is not None:  # AR, Eq. 4
        alpha = method.ar_alpha
        token_adv = reweight_advantages(advantages, rollout.old_logp, alpha)  # (B, T)
        metrics["ar/weight_mean"] = masked_mean(alpha * rollout.old_logp.exp() + 1 - alpha, mask).item()
    if method.entropy_adv_alpha is not None:  # Cheng et al. 2025: a capped entropy bonus on every token
        shaped = entropy_advantage(token_adv, rollout.entropy, mask, method.entropy_adv_alpha,
                                   objective.entropy_adv_kappa)  # fmt: skip
        metrics["entadv/bonus_mean"] = masked_mean(shaped - token_adv * mask, mask).item()
        token_adv = shaped  # (B, T)
    stages = [("all", mask)]
    if method.lopti_eta is not None:
        stages = lopti_stages(rollout.old_logp, mask, method.lopti_eta, method.lopti_order)  # stage 1 low, 2 high
        metrics["lopti/low_share"] = (dict(stages)["low"].sum() / mask.sum()).item()
    if method.forking_rho is not None:  # Wang et al. 2025: only the step's top-rho entropy tokens carry the gradient
        forks = forking_mask(rollout.entropy, mask, method.forking_rho).to(mask.dtype)  # (B, T)
        stages = [(name, stage * forks) for name, stage in stages]
        metrics["forking/share"] = (forks.sum() / mask.sum()).item()
    return token_adv, stages, metrics


def build_optimizer(params: Sequence[torch.nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """``spec.optimizer`` over ``params``: AdamW (fused on a GPU) with its betas and epsilon, or SGD without momentum
    (the paper's Fig. 1 / Fig. 3 optimizer); both at ``spec.lr`` with ``spec.weight_decay``."""
    params = list(params)
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=0.0, weight_decay=spec.weight_decay)
    fused = params[0].is_cuda
    return torch.optim.AdamW(
        params, lr=spec.lr, betas=spec.betas, eps=spec.adam_eps, weight_decay=spec.weight_decay, fused=fused
    )
