"""The frozen-batch counterfactual: one scored rollout kept fixed, and each method's update applied to it from the
same weights.

    batch = frozen_batch(model, tokenizer, puzzles, group_size=8)         # one rollout, scored, kept fixed
    shift = counterfactual(model, batch, lr=1e-4)                          # GRPO / AR / Lopti / AR+Lopti on it
    plots.fig2(shift=shift.bins)                                           # the paper's Fig. 2b
    tables = attribution_tables(model, batch)                              # the gradient per probability bin

The counterfactual applies each method's update (one RL step's optimizer steps, exactly as the trainer takes them)
to the SAME batch from the SAME weights, measures how every response token's probability moved, and restores the
weights: the cleanest view of what AR and Lopti change, free of sampling noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from lopti_lab.bins import DEFAULT_BINS, bin_labels, entropy_rank
from lopti_lab.evaluate import score_rollout
from lopti_lab.kk import Puzzle, build_prompt
from lopti_lab.methods import METHODS, PAPER, Method
from lopti_lab.models import PROMPT_STYLE_KEY
from lopti_lab.objective import group_advantages
from lopti_lab.paths import data_dir
from lopti_lab.probes import GradientProbe, bin_gradient_norms, probability_shift
from lopti_lab.probes.shift import float64_logprobs
from lopti_lab.rollout import Rollout, response_logprobs, sample
from lopti_lab.update import (
    OPTIMIZERS,
    Objective,
    OptimizerSpec,
    UpdateSpec,
    advantages_and_stages,
    build_optimizer,
    update_policy,
)

# ---------------------------------------------------------------------------------------------------------------------
# the frozen-batch counterfactual


@dataclass
class FrozenBatch:
    """One scored rollout, kept fixed so that several updates can be compared on it."""

    puzzles: list[Puzzle]
    rollout: Rollout
    rewards: torch.Tensor
    """(B,) Logic-RL totals."""
    advantages: torch.Tensor
    """(B,) GRPO advantages (before AR)."""
    temperature: float


def frozen_batch(
    model,
    tokenizer,
    puzzles: Sequence[Puzzle],
    group_size: int = 8,
    *,
    prompt_style: str | None = None,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    seed: int = 0,
    fast_path: str = "auto",
) -> FrozenBatch:
    """Sample G completions per puzzle (with rollout log-probs), score them and compute GRPO advantages.
    ``prompt_style`` None: the one the model's config names (a lab model's, ``models.PROMPT_STYLE_KEY``), else
    "instruct"."""
    if prompt_style is None:
        prompt_style = getattr(model.config, PROMPT_STYLE_KEY, None) or "instruct"
    torch.manual_seed(seed)
    prompts = [build_prompt(p, prompt_style, tokenizer) for p in puzzles]
    rollout = sample(
        model,
        tokenizer,
        prompts,
        group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        fast_path=fast_path,
    )
    totals = torch.tensor([r.total for r in score_rollout(rollout, puzzles)], device=rollout.response_ids.device)
    return FrozenBatch(list(puzzles), rollout, totals, group_advantages(totals, group_size), temperature)


@dataclass
class Counterfactual:
    """What each method's update did to the same batch."""

    tokens: pd.DataFrame
    """`probes.ProbabilityShift.tokens` of every method, with a `method` column."""
    bins: pd.DataFrame
    """Per (method, bin, sign): n_tokens, correct_ratio, delta_p quantiles (`probes.shift_summary`)."""
    updates: pd.DataFrame
    """Per method: optimizer steps taken and the mean gradient norm."""


def whole_batch_update(batch: FrozenBatch, **overrides) -> UpdateSpec:
    """The update of one pass over ``batch`` as a single minibatch, no KL, at the batch's temperature (``overrides``
    replace UpdateSpec fields): GRPO then takes one optimizer step, Lopti two."""
    settings = {"objective": Objective(kl_coef=0.0), "temperature": batch.temperature,
                "minibatch_size": len(batch.rollout)}  # fmt: skip
    return UpdateSpec(**{**settings, **overrides})


def counterfactual(
    model,
    batch: FrozenBatch,
    methods: dict[str, dict] | None = None,
    *,
    lr: float = 1e-4,
    optimizer: str = "sgd",
    bins: Sequence[float] = DEFAULT_BINS,
    update: UpdateSpec | None = None,
    adamw: OptimizerSpec | None = None,
) -> Counterfactual:
    """Apply each method's update to ``batch`` from the same weights; measure the probability shift; restore.

    ``update`` gives the update's settings (its objective's clip range and KL, the minibatch size, ...; each method's
    switches replace its objective's); by default ``whole_batch_update``: one minibatch holds the whole batch, so
    GRPO takes one optimizer step and Lopti two (low, then high). ``optimizer``: "sgd" shows gradient sizes directly
    (the paper's Fig. 1 uses SGD), "adamw" is what training uses, with ``adamw``'s betas and epsilon (default
    ``OptimizerSpec()``'s) and no weight decay (its first step moves a parameter by lr * g / (|g| + eps): sign-like
    where eps << |g|).
    The correct ratio compares each token's probability change with the sign of its advantage (AR never flips it).
    """
    rollout = batch.rollout
    token_advantages = batch.advantages[:, None].expand_as(rollout.response_mask)  # (B, T)
    # the moves are measured between float64 forwards (probability_shift): a float32 probability near 1 hides them
    measure = (rollout.input_ids, rollout.attention_mask, rollout.response_mask, batch.temperature)
    before = float64_logprobs(model, *measure)
    shifts, updates = [], []
    for name, run in _updates(model, batch, methods, _optimizer(lr, optimizer, adamw), update):
        stats = run()
        after = float64_logprobs(model, *measure)
        shifts.append((name, probability_shift(before, after, token_advantages, rollout.response_mask, bins)))
        updates.append(
            {"method": name, "optimizer_steps": stats["update/optimizer_steps"], "grad_norm": stats["grad/norm"]}
        )
    return Counterfactual(
        tokens=pd.concat([s.tokens.assign(method=n) for n, s in shifts], ignore_index=True),
        bins=pd.concat([s.bins.assign(method=n) for n, s in shifts], ignore_index=True),
        updates=pd.DataFrame(updates),
    )


def _optimizer(lr: float, optimizer: str, adamw: OptimizerSpec | None) -> OptimizerSpec:
    """One measured update's optimizer: ``optimizer`` at ``lr`` without weight decay (one update measures the
    gradient's move), AdamW with ``adamw``'s betas and epsilon."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    return replace(adamw or OptimizerSpec(), optimizer=optimizer, lr=lr, weight_decay=0.0)


def _updates(model, batch: FrozenBatch, methods, optimizer: OptimizerSpec, update: UpdateSpec | None):
    """(name, run) for each method, where ``run(probe=None, probe_by=None)`` applies the method's update to the
    frozen batch from the saved weights and returns its metrics; the weights are put back after each method and at
    the end, whatever happens."""
    methods = {label: METHODS[label].overrides() for label in PAPER} if methods is None else methods
    rollout = batch.rollout
    update = whole_batch_update(batch) if update is None else update
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]

    def restore() -> None:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)

    try:
        for name, overrides in methods.items():
            method = Method(name, **{**METHODS["GRPO"].overrides(), **overrides})
            spec = replace(update, objective=replace(update.objective, method=method))

            def run(probe=None, probe_by=None, spec=spec):
                restore()
                weighted, stages, _ = advantages_and_stages(rollout, batch.advantages, spec.objective)
                return update_policy(model, build_optimizer(params, optimizer), rollout, weighted, stages, spec, probe,
                                     probe_by)  # fmt: skip

            yield name, run
            restore()
    finally:
        restore()


def method_probes(
    model,
    batch: FrozenBatch,
    methods: dict[str, dict] | None = None,
    *,
    lr: float = 1e-3,
    optimizer: str = "sgd",
    bins: Sequence[float] = DEFAULT_BINS,
    update: UpdateSpec | None = None,
    adamw: OptimizerSpec | None = None,
) -> pd.DataFrame:
    """What each method's update does to the gradient, by probability bin and by entropy bin, on the same frozen
    batch: the bin's share of the response tokens, its share of the update's gradient (``probes.GradientProbe`` on
    the real backward passes, position attribution; the prompt's share is ``context_grad_share``), and the correct ratio
    of its A > 0 tokens after the update (float64). Entropy bins are the batch's entropy quartiles of the rollout
    policy (``bins.entropy_rank``), so a reader sees where AR and Lopti (probability) and forking tokens and Clip-Cov
    (entropy, covariance) put the update. One row per (method, binning, bin)."""
    rollout = batch.rollout
    mask = rollout.response_mask
    by = {"probability": None, "entropy": entropy_rank(rollout.entropy, mask)}
    token_advantages = batch.advantages[:, None].expand_as(mask)
    measure = (rollout.input_ids, rollout.attention_mask, mask, batch.temperature)
    before = float64_logprobs(model, *measure)
    rows = []
    for name, run in _updates(model, batch, methods, _optimizer(lr, optimizer, adamw), update):
        for binning, bin_by in by.items():
            with GradientProbe(model, bins=bins) as probe:
                run(probe, bin_by)
            shares = probe.metrics()
            after = float64_logprobs(model, *measure)
            shift = probability_shift(before, after, token_advantages, mask, bins, bin_by=bin_by).bins
            pos = shift[shift["sign"] == "pos"].set_index("bin")
            for k, label in enumerate(bin_labels(bins)):
                rows.append({
                    "method": name, "binning": binning, "bin": k, "label": label,
                    "token_share": shares.get(f"tokens/share_bin{k}"), "grad_share": shares.get(f"grad/share_bin{k}"),
                    "context_grad_share": shares.get("grad/share_context"),
                    "correct_ratio": pos.loc[k, "correct_ratio"], "n_pos": int(pos.loc[k, "n_tokens"]),
                })  # fmt: skip
    return pd.DataFrame(rows)


def recorded_method_probes(folder: str | Path = "reports/method_probes") -> tuple[pd.DataFrame, Path]:
    """(``method_probes``'s table, where it was read): ``folder``'s method_probes.csv when
    ``benchmarks/method_probes.py`` wrote one there, else the run recorded with lopti_lab
    (``data/methods/method_probes.csv``; docs/methods.md says how it was run)."""
    for file in (Path(folder) / "method_probes.csv", data_dir() / "methods" / "method_probes.csv"):
        if file.is_file():
            return pd.read_csv(file), file
    raise FileNotFoundError(f"no method_probes.csv in {folder} or in {data_dir() / 'methods'}")


def attribution_tables(model, batch: FrozenBatch, bins: Sequence[float] = DEFAULT_BINS) -> pd.DataFrame:
    """The gradient of the batch's GRPO loss (at ratio 1) split by probability bin, both ways (`probes` explains
    them): "loss" follows each bin's token losses through the whole network, "position" splits every weight
    gradient by the position the gradient passed through. One row per (attribution, bin)."""
    rollout = batch.rollout
    probs, mask = rollout.old_logp.exp(), rollout.response_mask  # (B, T)

    def per_token_loss(before_forward=None):
        logp, _ = response_logprobs(
            model, rollout.input_ids, rollout.attention_mask, mask, batch.temperature, before_forward=before_forward
        )
        return -(batch.advantages[:, None] * logp) * mask / mask.sum()  # (B, T): the token-mean policy gradient

    model.zero_grad(set_to_none=True)
    loss_table = bin_gradient_norms(model, per_token_loss(), probs, mask, bins, attribution="loss")
    with GradientProbe(model, bins=bins) as probe:
        per_token_loss(lambda t: probe.set_tokens(probs[:, :t], mask[:, :t])).sum().backward()
    model.zero_grad(set_to_none=True)
    return pd.concat([loss_table, probe.summary()], ignore_index=True)
