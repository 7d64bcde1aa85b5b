"""How an update moved each response token's probability (the paper's Fig. 2b) and selective updates of some bins
(Fig. 1c, e, f); see lopti_lab.probes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import nn

from lopti_lab.bins import DEFAULT_BINS, bin_index, bin_labels, check_bins
from lopti_lab.probes._common import (
    _check_batch,
    _check_like,
    _check_mask,
    _named_trainable,
    _response_logp,
)
from lopti_lab.probes.float64 import float64_response_logprobs
from lopti_lab.probes.float64 import in_float64 as in_float64  # its old home: tests import it from here
from lopti_lab.probes.loss_attribution import _or_zeros
from lopti_lab.rollout import response_logprobs

# ----------------------------------------------------------------------------------------------------------------------
# The correct-ratio table (Fig. 2b)


def shift_summary(tokens: pd.DataFrame, bins: Sequence[float] = DEFAULT_BINS, by: Sequence[str] = ()) -> pd.DataFrame:
    """Per bin and advantage sign, how far probabilities moved, how many did not move at all, and the share of the
    tokens that moved which moved the right way (Fig. 2b).

    `tokens` has one row per response token with columns `bin` (int), `advantage` and `delta_p` (new - old
    probability), optionally `dlogp` (new - old log-probability), plus any grouping columns named in `by` (e.g.
    ``("method", "step")``). The direction of a move is the sign of `dlogp` when given (precise even where a
    probability near 1 cannot show the move: 1 - 3e-5 and 1 - 2e-5 are the same float32 number), else of `delta_p`.
    A token that did not move (direction 0) is *unmoved*: neither right nor wrong, counted apart. A token that moved is
    *correct* when it moved the way its advantage asks: up for A > 0, down for A < 0. Tokens with A = 0 ask for
    nothing and are left out. Returns one row per (by..., bin, sign) with sign in ("pos", "neg"), empty cells
    included: `bin`, `label`, `sign`, `n_tokens` (tokens asked to move), `n_moved`, `unmoved_share`,
    `correct_ratio` (among the moved; NaN when none moved), and the mean, median and quartiles of `delta_p`.

    Example: a bin holding tokens (A, delta_p) = (+1, +.1), (+1, -.2), (+1, 0), (-1, -.3) has for "pos" n_tokens 3,
    n_moved 2, unmoved_share 1/3 and correct_ratio .5 (one of the two that moved went up); for "neg" correct_ratio 1.
    """
    by = list(by)
    labels = bin_labels(bins)
    missing = {"bin", "advantage", "delta_p", *by} - set(tokens.columns)
    if missing:
        raise ValueError(f"tokens lacks columns {sorted(missing)}")
    adv = tokens["advantage"].to_numpy(dtype=float)
    dp = tokens["delta_p"].to_numpy(dtype=float)
    direction = np.sign(tokens["dlogp"].to_numpy(dtype=float) if "dlogp" in tokens.columns else dp)
    asked = adv != 0
    moved = direction[asked] != 0
    right = np.where(adv[asked] > 0, direction[asked] > 0, direction[asked] < 0)
    cells = tokens.loc[asked, [*by, "bin"]].assign(
        sign=np.where(adv[asked] > 0, "pos", "neg"),
        delta_p=dp[asked],
        moved=moved.astype(float),
        correct=np.where(moved, right.astype(float), np.nan),
    )
    keys = [*by, "bin", "sign"]
    grouped = cells.groupby(keys, sort=False)
    table = grouped.agg(
        n_tokens=("moved", "size"),
        n_moved=("moved", "sum"),
        correct_ratio=("correct", "mean"),  # NaN (unmoved) rows are skipped: the ratio among the tokens that moved
        dp_mean=("delta_p", "mean"),
        dp_median=("delta_p", "median"),
    )
    # reindex: with no token asking for a move (every group's rewards tied) there are no cells and no columns
    quartiles = grouped["delta_p"].quantile([0.25, 0.75]).unstack().reindex(columns=[0.25, 0.75])
    table["dp_q25"], table["dp_q75"] = quartiles[0.25], quartiles[0.75]
    # Every (group, bin, sign) cell appears, empty ones with n_tokens = 0, so tables from different runs line up.
    groups = [()] if not by else list(tokens[by].drop_duplicates().itertuples(index=False, name=None))
    full = pd.MultiIndex.from_tuples(
        [(*g, k, s) for g in groups for k in range(len(labels)) for s in ("pos", "neg")], names=keys
    )
    table = table.reindex(full).reset_index()
    table["n_tokens"] = table["n_tokens"].fillna(0).astype(int)
    table["n_moved"] = table["n_moved"].fillna(0).astype(int)
    table.insert(table.columns.get_loc("n_moved") + 1, "unmoved_share", 1 - table["n_moved"] / table["n_tokens"])
    table.loc[table["n_tokens"] == 0, "unmoved_share"] = np.nan
    table.insert(len(by) + 1, "label", [labels[k] for k in table["bin"]])
    return table


# ----------------------------------------------------------------------------------------------------------------------
# Probability shift (Fig. 2b) and selective updates (Fig. 1c, e, f)


@dataclass
class ProbabilityShift:
    """How an update moved the probability of each response token."""

    delta_p: torch.Tensor
    """(B, T) float64 exp(new_logp) - exp(old_logp), as p_old * expm1(new_logp - old_logp); 0 outside the mask."""
    tokens: pd.DataFrame
    """One row per masked token: seq, pos, bin, label, p_old, p_new, dlogp (new - old log-prob), delta_p, advantage,
    moved (dlogp != 0), correct (True when the token moved the way the advantage's sign asks; <NA> for A = 0 and for a
    token that did not move)."""
    bins: pd.DataFrame
    """`shift_summary`: per (bin, sign in "pos"/"neg") n_tokens, n_moved, unmoved_share, correct_ratio (among
    the tokens that moved) and delta_p quantiles."""


def probability_shift(
    old_logp: torch.Tensor,
    new_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    bins: Sequence[float] = DEFAULT_BINS,
    bin_by: torch.Tensor | None = None,
) -> ProbabilityShift:
    """How each token's probability moved, binned by the OLD probability (or by ``bin_by``, any (B, T) values in
    [0, 1]: ``bins.entropy_rank`` for entropy bins), and the paper's correct ratio.

    The direction of a move is the sign of new_logp - old_logp, taken in float64: a log-probability near 0 keeps its
    digits where the probability itself does not (exp(-3e-5) and exp(-2e-5) are one float32 number), so a token near
    p = 1 that moved a little is seen to move. A token whose log-prob did not change at all is *unmoved* and counted
    apart (``moved`` False): the correct ratio of a (bin, sign) cell is the share of its tokens that MOVED the way the
    advantage asks, up for A > 0, down for A < 0 (Fig. 2b plots the A > 0 one), beside the cell's unmoved share. For
    the measurement to see small moves, the log-probs must come from forwards precise enough for them:
    ``float64_logprobs`` before and after the update.

    `advantages` are (B, T) per token or (B,) per sequence. Example: p_old = .2 -> p_new = .3 with A = +1 is correct;
    the same move with A = -1 is not; p_old = p_new with either sign is unmoved.
    """
    edges = check_bins(bins)
    mask = _check_mask(mask)
    old_logp = _check_like("old_logp", old_logp, mask).detach().double()
    new_logp = _check_like("new_logp", new_logp, mask).detach().double()
    adv = _check_like("advantages", advantages, mask, allow_per_sequence=True).detach()
    dlogp = torch.where(mask, new_logp - old_logp, torch.zeros_like(old_logp))  # (B, T)
    p_old = old_logp.exp()  # (B, T)
    delta_p = p_old * torch.expm1(dlogp)  # (B, T): exp(new) - exp(old) without cancelling near p = 1
    seq, pos = mask.nonzero(as_tuple=True)
    a = adv[seq, pos].double().cpu().numpy()
    step = dlogp[seq, pos].cpu().numpy()
    binned = p_old if bin_by is None else _check_like("bin_by", bin_by, mask).detach().double()
    bin_of = bin_index(binned[seq, pos], edges).cpu().numpy()
    correct = pd.array(np.where(a > 0, step > 0, step < 0), dtype="boolean")
    correct[(a == 0) | (step == 0)] = pd.NA
    labels = bin_labels(edges)
    tokens = pd.DataFrame(
        {
            "seq": seq.cpu().numpy(),
            "pos": pos.cpu().numpy(),
            "bin": bin_of,
            "label": [labels[k] for k in bin_of],
            "p_old": p_old[seq, pos].cpu().numpy(),
            "p_new": new_logp[seq, pos].exp().cpu().numpy(),
            "dlogp": step,
            "delta_p": delta_p[seq, pos].cpu().numpy(),
            "advantage": a,
            "moved": step != 0,
            "correct": correct,
        }
    )
    return ProbabilityShift(delta_p=delta_p, tokens=tokens, bins=shift_summary(tokens, edges))


def float64_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    batch_size: int | None = None,
) -> torch.Tensor:
    """(B, T) log pi(response token | prefix) from float64 forwards (``rollout.response_logprobs``'s layout), no grad,
    in eval mode: what a probability-shift measurement should compare. The rows go by response length,
    ``batch_size`` (default ``_LENGTH_CHUNK``) at a time, each chunk forwarded with only its own padding. Its rounding
    error is ~1e-15 where a float32 forward's is ~1e-6, below the log-prob moves of one small update (1e-5 to 1e-8
    on tokens near p = 1). Memory: ``probes.float64``'s bound (one module's weights in float64 at a time, the head
    in vocabulary chunks), never the whole model in float64."""
    mask = _check_mask(response_mask)
    was_training = model.training
    model.eval()
    try:
        logp = _logp(model, input_ids, attention_mask, mask, None, temperature, batch_size or _LENGTH_CHUNK, exact=True)
    finally:
        model.train(was_training)
    return logp  # (B, T)


_LENGTH_CHUNK = 8
"""Rows per forward in ``_logp``: the batch sorted by response length and cut into chunks of this many rows, each
forwarded with only its own padding (notebook 02's selective sweep, 24 rows of 128-435 tokens, two threads: 25-30 s
against 36 s with the whole batch in one forward; one run each, noisy)."""


def _logp(model, input_ids, attention_mask, mask, position_ids, temperature: float, rows: int = _LENGTH_CHUNK,
          exact: bool = False):  # fmt: skip
    """(B, T) response log-probs, 0 off the mask, for the gradient's forward and (``exact``: no grad, float64,
    ``float64_response_logprobs``) the measurement forwards. With the default positions: the rows by response
    length, ``rows`` at a time, through ``rollout.response_logprobs``, the trainer's own forward (each chunk's shared
    padding cut, a group's prompt computed once on the lean path). On notebook 02's batch of 24 rows that forward
    alone (before the chunks) was 2.7x faster in float64 and 2.1x with its graph in float32 than the model's forward
    over the padded batch; it equals that forward to 1e-14 in float64, and its gradient to about 1e-8 relative (HF's
    RMSNorm rounds to float32). With given ``position_ids``: the model's own forward over the whole batch."""
    if position_ids is not None:
        if exact:
            return float64_response_logprobs(model, input_ids, attention_mask, mask, temperature,
                                             position_ids=position_ids)  # fmt: skip
        return _response_logp(model, input_ids, attention_mask, mask.shape[1], position_ids, temperature) * mask

    def forward(chunk):
        args = (model, input_ids[chunk], attention_mask[chunk], mask[chunk], temperature)
        return float64_response_logprobs(*args) if exact else response_logprobs(*args)[0]

    order = mask.sum(1).argsort(stable=True)  # (B,): rows by response length, so each chunk cuts its own padding
    parts = [forward(chunk) for chunk in order.split(rows)]  # each (b, T)
    return torch.cat(parts)[order.argsort()]  # (B, T) in the batch's order


@dataclass
class SelectiveUpdate:
    """One SGD step on the tokens of some bins, and what it did to every bin."""

    update: str
    """Which tokens were updated: "all" or "bin0", "bin0+bin3", ..."""
    grad_norm: float
    """Norm of the applied gradient (the paper's Fig. 1d bar)."""
    n_updated: int
    shift: ProbabilityShift


def selective_update(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    update_bins: Sequence[int] | None = None,
    **kwargs,
) -> SelectiveUpdate:
    """One SGD step on the policy-gradient loss of the tokens of `update_bins` only, then every token's probability
    change, with the model's weights restored exactly afterwards (the paper's Fig. 1c: all bins; e: only bin 0;
    f: only the top bin; SGD with lr 1e-3 as there). The shift is measured from float64 forwards before and after the
    step (``float64_logprobs``'s forwards), so the top bin's small moves are seen, not rounded away.

    ``optimizer="adamw"`` takes AdamW's first step instead (fresh state, no weight decay): with bias correction its
    moments are g and g^2, so each weight moves by lr * g / (|g| + adam_eps), sign-like where adam_eps << |g|. Unlike
    SGD's, that step is not the sum of the steps of each bin's tokens alone.

    The loss is the GRPO token mean at ratio 1, L = -(1/n) sum_{t in update_bins} A_t log pi(o_t), n counting ALL
    response tokens (as Lopti's stages do), so the update on all bins is exactly GRPO's first minibatch step. Bins are
    chosen by the model's own probabilities before the step. The model runs in eval mode (no dropout) throughout and
    its mode is restored. `advantages` are (B, T) or (B,); pass AR-reweighted ones to see AR. Keyword arguments are
    ``selective_updates``'s.

    Example: ``selective_update(model, ids, attn, resp_mask, adv, update_bins=[0]).shift.bins`` is Fig. 1e's data.
    """
    return selective_updates(model, input_ids, attention_mask, response_mask, advantages, [update_bins], **kwargs)[0]


def selective_updates(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    update_sets: Sequence[Sequence[int] | None],
    *,
    bins: Sequence[float] = DEFAULT_BINS,
    lr: float = 1e-3,
    params: Iterable[torch.Tensor] | None = None,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,
    optimizer: str = "sgd",
    adam_eps: float = 1e-8,
) -> list[SelectiveUpdate]:
    """``selective_update`` for each entry of ``update_sets`` (a list of bins, or None for all), each step taken from
    the same weights, with the work they share done once: one forward whose graph every set's gradient is taken from,
    and one float64 forward before the steps (every set's gradient is held at once: memory for one gradient per
    set). Each result is the one ``selective_update`` alone gives."""
    edges = check_bins(bins)
    mask, _ = _check_batch(input_ids, attention_mask, response_mask)
    adv = _check_like("advantages", advantages, mask, allow_per_sequence=True).detach()
    K = len(edges) - 1
    chosen_sets = []
    for update_bins in update_sets:
        chosen = list(range(K)) if update_bins is None else [int(k) for k in update_bins]
        if not chosen or any(not 0 <= k < K for k in chosen):
            raise ValueError(f"update_bins must name bins in 0..{K - 1}, got {update_bins!r}")
        chosen_sets.append(chosen)
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if optimizer not in ("sgd", "adamw") or not adam_eps > 0:
        raise ValueError(f"optimizer must be 'sgd' or 'adamw' (adam_eps > 0), got {optimizer!r}, {adam_eps!r}")
    named = _named_trainable(model, params)
    params = [p for _, p in named]
    was_training = model.training
    model.eval()
    results = []
    try:
        logp = _logp(model, input_ids, attention_mask, mask, position_ids, temperature)  # (B, T)
        bin_of = bin_index(logp.detach().exp(), edges)
        steps = []  # every set's gradient before any step: a step changes the weights the graph holds
        for i, chosen in enumerate(chosen_sets):
            in_update = mask & torch.isin(bin_of, torch.tensor(chosen, device=mask.device))
            loss = -(adv * logp).masked_fill(~in_update, 0).sum() / mask.sum().clamp_min(1)
            raw = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=i < len(chosen_sets) - 1)
            grads = [_or_zeros(g, p) for g, p in zip(raw, params)]
            grad_norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
            if optimizer == "adamw":  # AdamW's first step: m_hat = g, v_hat = g^2
                grads = [g / (g.abs() + adam_eps) for g in grads]
            steps.append((chosen, in_update, grad_norm, grads))
        del logp
        # the shift is measured in float64 forwards before and after each step (probability_shift); only once every
        # gradient is taken: the float64 forward swaps the weights' storage, which the graph above must not see
        old_logp = _logp(model, input_ids, attention_mask, mask, position_ids, temperature, exact=True)
        saved = [p.detach().clone() for p in params]
        for chosen, in_update, grad_norm, grads in steps:
            try:
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.add_(g, alpha=-lr)
                new_logp = _logp(model, input_ids, attention_mask, mask, position_ids, temperature, exact=True)
            finally:
                with torch.no_grad():
                    for p, s in zip(params, saved):
                        p.copy_(s)
            all_bins = sorted(set(chosen)) == list(range(K))
            results.append(SelectiveUpdate(
                update="all" if all_bins else "+".join(f"bin{k}" for k in sorted(set(chosen))),
                grad_norm=grad_norm,
                n_updated=int(in_update.sum()),
                shift=probability_shift(old_logp, new_logp, adv, mask, edges),
            ))  # fmt: skip
    finally:
        model.train(was_training)
    return results


def selective_sweep(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    **kwargs,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`selective_update` on all tokens, then on each bin alone: the data of the paper's whole Fig. 1.

    Returns (tokens, grads): `tokens` stacks every update's per-token table with an `update` column ("all", "bin0",
    ...); `grads` has one row per update: update, grad_norm, n_updated. `plots.fig1(tokens, grads)` draws it.
    """
    K = len(check_bins(kwargs.get("bins", DEFAULT_BINS))) - 1
    sets = [None, *([k] for k in range(K))]
    runs = selective_updates(model, input_ids, attention_mask, response_mask, advantages, sets, **kwargs)
    tokens = pd.concat([r.shift.tokens.assign(update=r.update) for r in runs], ignore_index=True)
    grads = pd.DataFrame([{"update": r.update, "grad_norm": r.grad_norm, "n_updated": r.n_updated} for r in runs])
    return tokens, grads
