"""Gradient probes: how much of an update each probability bin of response tokens carries, on any HF causal LM.

Shape legend: B = sequences (prompts x group size), L = input length (prompt + response), T = response tokens,
V = vocabulary, K = probability bins, G = K + 1 position groups (bins + `context`), N = B * L flattened positions.

Layout (the trainer's contract). ``input_ids`` (B, L) is [left-padded prompt | right-padded response of T tokens], so
the response is the LAST T input positions and the logits at input position L - T - 1 + t predict response token t.
Per-token tensors are (B, T) over response tokens: ``logp``, ``old_logp``, ``response_mask`` (bool or 0/1) and
``per_token_loss``. The probabilities that pick a token's bin are the rollout's, ``old_logp.exp()`` (PAPER.md §5);
bins are edges as `theory.check_bins` takes them (default [0, .25), [.25, .5), [.5, .75), [.75, 1]).

What it measures. The paper's claim is about the size of the gradient each token sends (its Fig. 1d). Two exact
attributions split the gradient g of sum_t mask_t per_token_loss_t into per-bin parts g_k that add up to g:

* ``attribution="loss"``: g_k = d(sum of the losses of bin k's tokens) / d theta, the whole effect of those tokens'
  losses wherever it flows. K vector-Jacobian products: ONE batched backward (``torch.autograd.grad`` with
  ``is_grads_batched``, K gradients in memory), or with ``batched=False`` one backward for g and one per bin but the
  largest (g minus the others), norms taken in parameter hooks. Exact for every parameter; costs about K backwards.
* ``attribution="position"``: a Linear weight's gradient is a sum over input positions, dW = sum_t g_t a_t^T (g_t the
  gradient at its output at position t, a_t its input); g_k keeps the terms of the positions that PREDICT a bin-k
  token, and the positions that predict no response token (prompt, padding, the last one) form the `context` row, so
  bins + context = g. Hooks capture a_t and g_t during the ordinary backward and no per-token gradient is ever formed:
  a matmul per group of positions, or the Gram identity ||sum_t g_t a_t^T||^2 = sum_{t,s} (g_t.g_s)(a_t.a_s) when the
  batch is short, whichever is cheaper. Splits Linear weights and biases (LoRA's A and B are Linears), Embedding
  weights (tied lm_heads included) and GPT-2's Conv1D; not norms. Costs a fraction of one backward.

The two differ because attention carries token t's loss to other positions: g_t at an early layer holds gradient from
every later token's loss, so a position's row mixes the losses of many tokens, while a loss row follows one set of
losses through every position. After the last attention (final MLP, lm_head) the network is position-wise and the two
agree exactly; tests/test_probes.py checks both facts.

Tables have one row per (scope, bin): scope "model" (all probed parameters), and per layer or per parameter with
``level=``; rows for the bins, `context` (position only) and `all` (g itself). Columns: `attribution`, `scope`, `bin`
(Int64, <NA> for context/all), `label`, `n_tokens`, `token_share`, `grad_norm` = ||g_k||, `grad_share` =
<g_k, g> / ||g||^2 (adds up to 1 over the rows; negative when a bin pulls against the rest), `norm_ratio` =
||g_k|| / ||g||, `cosine`, `n_params`.

For the trainer, every k steps, around its real forward + backward (cheap, "position"):

    with GradientProbe(policy, bins=(0, .25, .5, .75, 1)) as probe:  # hooks on; params=None: all it can split
        for mb in minibatches:
            probe.set_tokens(mb.old_logp.exp(), mb.response_mask)    # (B, T) each, BEFORE the forward
            logits = policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            loss = objective.policy_loss(...)                        # any loss of these response tokens
            loss.backward()                                          # one record per backward; grads untouched
            optimizer.step(); optimizer.zero_grad()
    metrics.update(probe.metrics())  # {"grad/norm_bin0": .., "grad/share_bin0": .., "tokens/share_bin0": .., ...}
    table = probe.summary()          # the per-bin table averaged over the records (probe.frame(): every record)

and occasionally, on one minibatch, the exact loss attribution (about K backwards; ``accumulate=True`` leaves the full
gradient in .grad as loss.backward() would, so the call can replace that minibatch's backward):

    table = bin_gradient_norms(policy, per_token_loss, old_logp.exp(), response_mask, accumulate=True)
    metrics.update(to_metrics(table, prefix="loss_attr/"))

Once detached (the ``with`` block ends) the probe has removed every hook and costs nothing.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch import nn

from lopti_lab.theory import DEFAULT_BINS, bin_index, bin_labels, check_bins, shift_summary

__all__ = [
    "GradientProbe",
    "ProbabilityShift",
    "SelectiveUpdate",
    "TokenStats",
    "bin_gradient_norms",
    "bin_gradients",
    "probability_shift",
    "selective_sweep",
    "selective_update",
    "to_metrics",
    "token_stats",
]

LEVELS = ("model", "layer", "param")
COLUMNS = [
    "attribution",
    "scope",
    "bin",
    "label",
    "n_tokens",
    "token_share",
    "grad_norm",
    "grad_share",
    "norm_ratio",
    "cosine",
    "n_params",
]


# ----------------------------------------------------------------------------------------------------------------------
# Input checks: every bad input gets a ValueError that names it, before any work starts


def _check_mask(mask) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a (B, T) tensor over response tokens, got {shape}")
    if mask.dtype != torch.bool:
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError("mask must be boolean or 0/1")
        mask = mask.bool()
    return mask


def _check_like(name: str, x, mask: torch.Tensor, allow_per_sequence: bool = False) -> torch.Tensor:
    """x must be a (B, T) tensor like mask (or (B,) per sequence when allowed, broadcast over T)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if allow_per_sequence and x.dim() == 1 and x.shape[0] == mask.shape[0]:
        return x[:, None].expand(mask.shape)  # (B, T)
    if x.shape != mask.shape:
        raise ValueError(f"mask must have the shape of {name}: {name} is {tuple(x.shape)}, mask is {tuple(mask.shape)}")
    return x


def _check_probs(probs, mask: torch.Tensor) -> torch.Tensor:
    probs = _check_like("probs", probs, mask)
    p = probs.detach()[mask]
    if p.numel() and (torch.isnan(p).any() or p.min() < 0 or p.max() > 1):
        raise ValueError("probs must lie in [0, 1] on masked tokens (pass old_logp.exp(), not log-probabilities)")
    return probs.detach()


def _check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    return level


def _named_trainable(model: nn.Module, params, splittable: Callable[[nn.Parameter], bool] | None = None):
    """[(name, param)] for `params` (default: every trainable parameter, or every splittable one)."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(p, name)  # a tied parameter keeps its first name
    if params is None:
        chosen = [(n, p) for p, n in names.items() if p.requires_grad and (splittable is None or splittable(p))]
        if not chosen:
            raise ValueError("params: the model has no trainable parameters to probe")
        return chosen
    if isinstance(params, torch.Tensor):
        raise ValueError("params must be an iterable of parameters (e.g. [w]), not a single tensor")
    chosen = []
    for i, p in enumerate(params):
        if p not in names:
            raise ValueError(f"params[{i}] is not a parameter of the model")
        if not p.requires_grad:
            raise ValueError(f"params: {names[p]} does not require grad, so it has no gradient to split")
        if splittable is not None and not splittable(p):
            raise ValueError(
                f"params: {names[p]} is not the weight or bias of a Linear, Embedding or Conv1D module, so "
                "attribution='position' cannot split it; use attribution='loss' or leave it out"
            )
        chosen.append((names[p], p))
    if not chosen:
        raise ValueError("params is empty")
    return chosen


def _scope_of(name: str, level: str) -> str:
    """The table row a parameter rolls up into: "model", its transformer block ("layers.3"), or its own name."""
    if level == "model":
        return "model"
    if level == "param":
        return name
    m = re.search(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.", name)
    if m:
        return f"layers.{int(m.group(1))}"
    if "embed" in name or ".wte." in name or name.startswith("wte."):
        return "embed"
    if "lm_head" in name:
        return "lm_head"
    return "other"


# ----------------------------------------------------------------------------------------------------------------------
# Per-token statistics, without a backward pass


@dataclass
class TokenStats:
    """Per response token (B, T): the token id and its log-probability, probability, entropy of the distribution it was
    drawn from, and ||e_y - softmax(z)||, the exact norm of its gradient through the logits (theory.logit_grad_norm).
    Entries outside `mask` hold the values for whatever token sits there (padding); use the mask."""

    tokens: torch.Tensor
    logp: torch.Tensor
    prob: torch.Tensor
    entropy: torch.Tensor
    grad_norm: torch.Tensor
    mask: torch.Tensor
    vocab_size: int

    def to_frame(self, bins: Sequence[float] = DEFAULT_BINS) -> pd.DataFrame:
        """One row per masked token: seq, pos, token, logp, prob, entropy, grad_norm, bin (Fig. 2a's scatter)."""
        seq, pos = self.mask.nonzero(as_tuple=True)
        pick = {k: getattr(self, k)[seq, pos].detach().double().cpu().numpy() for k in ("logp", "prob", "entropy")}
        return pd.DataFrame(
            {
                "seq": seq.cpu().numpy(),
                "pos": pos.cpu().numpy(),
                "token": self.tokens[seq, pos].cpu().numpy(),
                **pick,
                "grad_norm": self.grad_norm[seq, pos].detach().double().cpu().numpy(),
                "bin": bin_index(self.prob[seq, pos].detach(), bins).cpu().numpy(),
            }
        )


def _default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens, as `generate` does for a left-padded batch: pads get 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, L)


def _check_batch(input_ids, attention_mask, response_mask) -> tuple[torch.Tensor, int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (B, L) tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
    mask = _check_mask(response_mask)
    B, L = input_ids.shape
    if mask.shape[0] != B or not 0 < mask.shape[1] < L:
        raise ValueError(
            f"response_mask must be (B, T) with B = {B} and 0 < T < L = {L} (the response is the last T input "
            f"positions), got {tuple(mask.shape)}"
        )
    return mask, mask.shape[1]


def _response_logits(model, input_ids, attention_mask, T: int, position_ids=None) -> torch.Tensor:
    """Logits that predict the T response tokens: input positions L-T-1 .. L-2. (B, L) -> (B, T, V)."""
    if position_ids is None:
        position_ids = _default_position_ids(attention_mask)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    try:  # only the last T + 1 positions' logits: saves a (B, L, V) tensor on long prompts
        logits = model(**kwargs, logits_to_keep=T + 1).logits
    except TypeError:  # a model without logits_to_keep
        logits = model(**kwargs).logits
    return logits[:, -(T + 1) : -1]  # (B, T, V)


def _response_logp(model, input_ids, attention_mask, T: int, position_ids=None, temperature: float = 1.0):
    logits = _response_logits(model, input_ids, attention_mask, T, position_ids)  # (B, T, V)
    tokens = input_ids[:, -T:]  # (B, T)
    return (logits / temperature).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)


@torch.no_grad()
def token_stats(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,
    max_chunk: int = 2**25,
) -> TokenStats:
    """Per-token log-prob, prob, entropy and exact logit-gradient norm of the response tokens, in one no-grad forward.

    The response is the last T = response_mask.shape[1] positions of `input_ids` (module docstring). `temperature`
    divides the logits as the rollout did (the paper's pi_old uses the rollout temperature). `position_ids` default to
    the attention mask's running count, as `generate` uses for left-padded prompts. Softmax statistics are computed
    over chunks of sequences of at most `max_chunk` logits, in float32 (float64 for a float64 model).

    grad_norm is ||e_y - softmax(z / temperature)||: for y = 0 and logits (0, 0) it is sqrt(.5); it lies in the wedge
    `theory.grad_norm_bounds(prob, V)`.
    """
    mask, T = _check_batch(input_ids, attention_mask, response_mask)
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    logits = _response_logits(model, input_ids, attention_mask, T, position_ids)  # (B, T, V)
    tokens = input_ids[:, -T:]  # (B, T)
    B, _, V = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = {k: torch.empty(B, T, dtype=dtype, device=logits.device) for k in ("logp", "entropy", "grad_norm")}
    rows = max(1, max_chunk // max(1, T * V))
    for b0 in range(0, B, rows):
        z = logits[b0 : b0 + rows].to(dtype) / temperature  # (b, T, V)
        y = tokens[b0 : b0 + rows, :, None]  # (b, T, 1)
        logp_all = z.log_softmax(-1)
        p_all = logp_all.exp()
        out["logp"][b0 : b0 + rows] = logp_all.gather(-1, y).squeeze(-1)
        out["entropy"][b0 : b0 + rows] = -(p_all * logp_all).sum(-1)
        del logp_all
        p_all.scatter_add_(-1, y, torch.full_like(p_all[..., :1], -1.0))  # p - e_y, as theory.logit_grad_norm
        out["grad_norm"][b0 : b0 + rows] = torch.linalg.vector_norm(p_all, dim=-1)
    return TokenStats(
        tokens=tokens,
        logp=out["logp"],
        prob=out["logp"].exp(),
        entropy=out["entropy"],
        grad_norm=out["grad_norm"],
        mask=mask,
        vocab_size=V,
    )


# ----------------------------------------------------------------------------------------------------------------------
# Tables


@dataclass
class _Stats:
    """One parameter's split: ||g_k||^2 and <g_k, g> for each group k, and ||g||^2 (tensors, synced only when read)."""

    nsq: torch.Tensor  # (G,)
    ip: torch.Tensor  # (G,)
    full_sq: torch.Tensor  # ()
    numel: int


def _table(
    stats: dict[str, _Stats],
    counts: np.ndarray,
    bins: Sequence[float],
    attribution: str,
    level: str,
    record: int | None = None,
) -> pd.DataFrame:
    """Roll per-parameter stats up into the (scope, bin) rows described in the module docstring."""
    labels = bin_labels(bins)
    K = len(labels)
    names = list(stats)
    G = len(stats[names[0]].nsq) if names else (K if attribution == "loss" else K + 1)
    if names:  # one host transfer per table
        packed = torch.stack([torch.cat([s.nsq, s.ip, s.full_sq[None]]).double().cpu() for s in stats.values()])
        nsq, ip, full_sq = packed[:, :G].numpy(), packed[:, G : 2 * G].numpy(), packed[:, 2 * G].numpy()  # (P, ...)
    else:
        nsq, ip, full_sq = np.zeros((0, G)), np.zeros((0, G)), np.zeros(0)
    scopes = ["model"] if level == "model" else ["model", *dict.fromkeys(_scope_of(n, level) for n in names)]
    member = np.array([[scope == "model" or _scope_of(n, level) == scope for n in names] for scope in scopes], float)
    member = member.reshape(len(scopes), len(names))  # (S, P)
    full = member @ full_sq  # (S,)
    # the `all` row is one more column whose split is the full gradient itself: ||g||^2 and <g, g>
    sq = np.concatenate([member @ nsq, full[:, None]], axis=1)  # (S, G + 1)
    proj = np.concatenate([member @ ip, full[:, None]], axis=1)  # (S, G + 1)
    norm, full_norm = np.sqrt(np.maximum(sq, 0.0)), np.sqrt(full)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(full[:, None] > 0, proj / full[:, None], np.nan)
        ratio = np.where(full[:, None] > 0, norm / full_norm, np.nan)
        cosine = np.where((norm > 0) & (full_norm > 0), proj / (norm * full_norm), np.nan)
    total = int(np.sum(counts))
    n_tokens = [*(int(c) for c in counts), *([0] * (G - K)), total]
    with np.errstate(divide="ignore", invalid="ignore"):
        token_share = [
            *(c / total if total else np.nan for c in counts),
            *([np.nan] * (G - K)),
            1.0 if total else np.nan,
        ]
    S, C = len(scopes), G + 1
    table = pd.DataFrame(
        {
            **({} if record is None else {"record": record}),
            "attribution": attribution,
            "scope": np.repeat(scopes, C),
            "bin": pd.array([*range(K), *([pd.NA] * (C - K))] * S, dtype="Int64"),
            "label": [*labels, *(["context"] * (G - K)), "all"] * S,
            "n_tokens": n_tokens * S,
            "token_share": token_share * S,
            "grad_norm": norm.reshape(-1),
            "grad_share": share.reshape(-1),
            "norm_ratio": ratio.reshape(-1),
            "cosine": cosine.reshape(-1),
            "n_params": np.repeat([sum(stats[n].numel for n, m in zip(names, row) if m) for row in member], C),
        }
    )
    return table


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    """Average a table over its records (GradientProbe.frame()'s `record` column): norms and shares are the mean over
    the records that have them, token counts add up. A table without `record` comes back unchanged."""
    if "record" not in table.columns:
        return table
    keys = ["attribution", "scope", "label"]
    grouped = table.groupby(keys, sort=False, dropna=False)
    out = grouped.agg(
        bin=("bin", "first"),
        n_tokens=("n_tokens", "sum"),
        grad_norm=("grad_norm", "mean"),
        grad_share=("grad_share", "mean"),
        norm_ratio=("norm_ratio", "mean"),
        cosine=("cosine", "mean"),
        n_params=("n_params", "max"),
        n_records=("record", "nunique"),
    ).reset_index()
    totals = out[out["label"] == "all"].set_index(["attribution", "scope"])["n_tokens"]
    denom = out.set_index(["attribution", "scope"]).index.map(totals).to_numpy(dtype=float)
    out["token_share"] = np.where(
        out["bin"].notna() & (denom > 0), out["n_tokens"] / np.where(denom > 0, denom, 1), np.nan
    )
    out.loc[out["label"] == "all", "token_share"] = np.where(
        out.loc[out["label"] == "all", "n_tokens"] > 0, 1.0, np.nan
    )
    return out[[*COLUMNS, "n_records"]]


def to_metrics(table: pd.DataFrame, prefix: str = "") -> dict[str, float]:
    """Flat float metrics with stable keys from a table's "model" rows (records averaged by `summarize`).

    Keys: ``grad/norm_bin{k}``, ``grad/share_bin{k}``, ``tokens/share_bin{k}`` for each bin k, ``grad/norm_context`` and
    ``grad/share_context`` for position attribution, ``grad/norm_probed`` (the norm of the probed full gradient), all
    after `prefix`. E.g. {"grad/norm_bin0": 0.71, "grad/share_bin0": 0.62, "tokens/share_bin0": 0.19, ...}.
    """
    rows = summarize(table)
    rows = rows[rows["scope"] == "model"]
    if rows.empty:
        raise ValueError("table has no 'model' rows (pass a table from bin_gradient_norms or GradientProbe)")
    if rows["attribution"].nunique() > 1:
        raise ValueError("table mixes attributions; pass one attribution's rows")
    out: dict[str, float] = {}
    for row in rows.itertuples(index=False):
        if row.label == "all":
            out[f"{prefix}grad/norm_probed"] = float(row.grad_norm)
            continue
        tag = f"bin{int(row.bin)}" if row.label != "context" else "context"
        out[f"{prefix}grad/norm_{tag}"] = float(row.grad_norm)
        out[f"{prefix}grad/share_{tag}"] = float(row.grad_share)
        if row.label != "context":
            out[f"{prefix}tokens/share_{tag}"] = float(row.token_share)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# attribution="loss": one batched backward over the bins


_BATCHED_MAX_VALUES = 2**27  # above this, K gradients at once cost more memory than a batched backward saves time


def _bin_losses(per_token_loss, probs, mask, edges) -> torch.Tensor:
    """(K,) the sum of the masked losses of each bin's tokens; checks its inputs."""
    mask = _check_mask(mask)
    loss = _check_like("per_token_loss", per_token_loss, mask)
    probs = _check_probs(probs, mask)
    if not loss.requires_grad:
        raise ValueError("per_token_loss does not require grad: compute it from the model with grad enabled")
    in_bin = nn.functional.one_hot(bin_index(probs, edges), len(edges) - 1).to(loss.dtype) * mask[..., None]
    return torch.einsum("bt,btk->k", loss.masked_fill(~mask, 0), in_bin)  # (K,): masked-out NaNs cannot leak


def bin_gradients(
    per_token_loss: torch.Tensor,
    probs: torch.Tensor,
    mask: torch.Tensor,
    params: Sequence[torch.Tensor],
    bins: Sequence[float] = DEFAULT_BINS,
    *,
    batched: bool = True,
    retain_graph: bool = False,
) -> list[torch.Tensor]:
    """The per-bin gradients themselves: for each parameter a (K, *shape) tensor whose slice k is
    d(sum of the masked losses of bin k's tokens) / d param. The K slices add up to the gradient of the masked sum.

    One batched backward (is_grads_batched: vmap over the backward graph); ``batched=False`` or an op without a
    batching rule falls back to one backward per bin. Holds K gradients at once: K times the memory of `params`' grads.
    """
    edges = check_bins(bins)
    bin_loss = _bin_losses(per_token_loss, probs, mask, edges)  # (K,)
    K = len(edges) - 1
    params = list(params)
    if batched:
        eye = torch.eye(K, dtype=bin_loss.dtype, device=bin_loss.device)
        try:
            # retain_graph=True so that the per-bin fallback can still run; the graph goes when the loss is dropped
            grads = torch.autograd.grad(
                bin_loss, params, grad_outputs=eye, is_grads_batched=True, retain_graph=True, allow_unused=True
            )
            return [_or_zeros(g, p, K) for g, p in zip(grads, params)]
        except RuntimeError:  # an op with no vmap support in its backward: fall back to the exact per-bin loop
            pass
    per_bin = [
        torch.autograd.grad(bin_loss[k], params, retain_graph=retain_graph or k < K - 1, allow_unused=True)
        for k in range(K)
    ]
    return [
        torch.stack([_or_zeros(per_bin[k][i], p) for k in range(K)]) for i, p in enumerate(params)
    ]  # each (K, *shape)


def _or_zeros(g: torch.Tensor | None, p: torch.Tensor, K: int | None = None) -> torch.Tensor:
    """allow_unused gives None for a parameter the loss does not reach: its gradient is zero."""
    if g is not None:
        return g
    return torch.zeros(p.shape if K is None else (K, *p.shape), dtype=p.dtype, device=p.device)


def bin_gradient_norms(
    model: nn.Module,
    per_token_loss: torch.Tensor | Callable[[], torch.Tensor],
    probs: torch.Tensor,
    mask: torch.Tensor,
    bins: Sequence[float] = DEFAULT_BINS,
    params: Iterable[torch.Tensor] | None = None,
    attribution: str = "loss",
    *,
    level: str = "model",
    accumulate: bool = False,
    retain_graph: bool = False,
    batched: bool | None = None,
    method: str = "auto",
) -> pd.DataFrame:
    """Split the gradient of sum_t mask_t * per_token_loss_t into per-bin parts and tabulate their norms.

    Args:
        model: any HF causal LM, bare or peft-wrapped; `params` default to its trainable parameters ("loss") or to those
            "position" can split (Linear / Embedding / Conv1D weights and biases).
        per_token_loss: (B, T) losses of the response tokens, or a callable that runs the forward and returns them
            (required for "position", whose hooks must see the forward). Scale it so that its masked sum is your loss
            (e.g. divide by the token count for a token mean) and the `all` row is your gradient's norm.
        probs: (B, T) probabilities that pick each token's bin, normally ``old_logp.exp()``.
        mask: (B, T) response mask.
        bins: bin edges, strictly increasing from 0 to 1.
        attribution: "loss" or "position" (module docstring).
        level: "model", "layer" (adds a row set per transformer block) or "param" (per parameter).
        accumulate: also leave the full gradient in .grad, as ``loss.backward()`` would: "position" runs exactly that
            backward (every parameter gets its .grad); "loss" adds the bins' sum to the .grad of `params`.
        retain_graph: keep the autograd graph for another backward.
        batched: for "loss": True, one batched backward over the bins (K gradients in memory at once); False, one
            backward for the full gradient and one per bin but the largest (three gradients in memory); same numbers.
            None: batched unless K gradients of `params` exceed 2^27 values (0.5 GB in float32), e.g. full
            fine-tuning of a 100M model, where the streamed way is also faster on a CPU (benchmarks/README.md).
        method: for "position": "auto", "matmul" or "gram" (GradientProbe).

    Returns the table of the module docstring. Example, on a batch where bin 0 holds 19% of the tokens:
    ``bin_gradient_norms(model, loss, p, m).query("scope == 'model'")[["label", "token_share", "grad_norm"]]``.
    """
    edges = check_bins(bins)
    level = _check_level(level)
    mask = _check_mask(mask)
    if attribution == "position":
        if not callable(per_token_loss):
            raise ValueError(
                "per_token_loss: attribution='position' must see the forward pass; pass a callable that runs it "
                "(e.g. lambda: loss_fn(model(...))), or wrap your own forward and backward in a GradientProbe"
            )
        with GradientProbe(model, edges, params, level=level, method=method) as probe:
            probe.set_tokens(probs, mask)
            loss = _check_like("per_token_loss", per_token_loss(), mask)
            total = loss.masked_fill(~mask, 0).sum()
            if accumulate:
                total.backward(retain_graph=retain_graph)
            else:
                torch.autograd.grad(total, probe.params, retain_graph=retain_graph, allow_unused=True)
            return probe.frame().drop(columns="record")
    if attribution != "loss":
        raise ValueError(f"attribution must be 'loss' or 'position', got {attribution!r}")
    named = _named_trainable(model, params)
    probs = _check_probs(probs, mask)
    loss = per_token_loss() if callable(per_token_loss) else per_token_loss
    counts = torch.bincount(bin_index(probs, edges)[mask], minlength=len(edges) - 1).tolist()
    if batched is None:
        batched = (len(edges) - 1) * sum(p.numel() for _, p in named) <= _BATCHED_MAX_VALUES
    split = _loss_split_batched if batched else _loss_split_streamed
    stats, fulls = split(loss, probs, mask, named, edges, counts, retain_graph)
    if accumulate:  # the bins add up to the full gradient: what loss.backward() would have accumulated
        for (_, p), full in zip(named, fulls):
            summed = full.to(p.dtype).view_as(p)
            if p.grad is None:
                p.grad = summed  # a fresh tensor of ours
            else:
                p.grad += summed
    return _table(stats, np.asarray(counts), edges, "loss", level)


def _loss_split_batched(loss, probs, mask, named, edges, counts, retain_graph):
    """All K bin gradients from one batched backward, then their norms and projections."""
    grads = bin_gradients(loss, probs, mask, [p for _, p in named], edges, retain_graph=retain_graph)
    stats, fulls = {}, []
    for (name, p), g in zip(named, grads):
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        flat = g.detach().reshape(g.shape[0], -1).to(acc)  # (K, numel)
        full = flat.sum(0)
        nsq = torch.linalg.vector_norm(flat, dim=1).square()
        stats[name] = _Stats(nsq=nsq, ip=flat @ full, full_sq=full.dot(full), numel=p.numel())
        fulls.append(full)
    return stats, fulls


def _loss_split_streamed(loss, probs, mask, named, edges, counts, retain_graph):
    """One backward for the full gradient, then one per non-empty bin but the largest, which is the full gradient
    minus the others: K backwards at most. The norms are taken in parameter hooks, while each gradient is still in
    cache, and no more than three parameter-sized buffers are alive at once."""
    bin_loss = _bin_losses(loss, probs, mask, edges)  # (K,)
    params = [p for _, p in named]
    K = len(counts)
    present = [k for k, n in enumerate(counts) if n > 0]
    skip = max(present, key=counts.__getitem__) if present else None
    others = [k for k in present if k != skip]
    accs = [torch.float64 if p.dtype == torch.float64 else torch.float32 for p in params]
    fulls: list = [None] * len(params)
    rest: list = [None] * len(params)  # running sum of the other bins' gradients
    nsq = [torch.zeros(K, dtype=a, device=p.device) for a, p in zip(accs, params)]
    ip = [torch.zeros(K, dtype=a, device=p.device) for a, p in zip(accs, params)]
    current = [None]  # None: the full backward; k: bin k's

    def on_grad(j: int, grad: torch.Tensor) -> None:
        g = grad.detach().reshape(-1).to(accs[j])
        k = current[0]
        if k is None:
            fulls[j] = g
            return
        nsq[j][k], ip[j][k] = g.dot(g), g.dot(fulls[j])
        if rest[j] is None:
            rest[j] = g.clone()
        else:
            rest[j] += g

    handles = [p.register_hook(lambda grad, j=j: on_grad(j, grad)) for j, p in enumerate(params)]
    try:
        torch.autograd.grad(bin_loss.sum(), params, retain_graph=retain_graph or bool(others), allow_unused=True)
        for i, k in enumerate(others):
            current[0] = k
            torch.autograd.grad(
                bin_loss[k], params, retain_graph=retain_graph or i < len(others) - 1, allow_unused=True
            )
    finally:
        for h in handles:
            h.remove()
    stats = {}
    for j, (name, p) in enumerate(named):
        if fulls[j] is None:  # the loss does not reach this parameter
            fulls[j] = torch.zeros(p.numel(), dtype=accs[j], device=p.device)
        if skip is not None:
            last = fulls[j] if rest[j] is None else rest[j].neg_().add_(fulls[j])  # the largest bin, by linearity
            nsq[j][skip], ip[j][skip] = last.dot(last), last.dot(fulls[j])
        stats[name] = _Stats(nsq=nsq[j], ip=ip[j], full_sq=fulls[j].dot(fulls[j]), numel=p.numel())
    return stats, fulls


# ----------------------------------------------------------------------------------------------------------------------
# attribution="position": hooks that split dW = sum_t g_t a_t^T by the group of position t, in the ordinary backward


def _module_kind(module: nn.Module) -> str | None:
    """How a module's weight gradient splits over positions, or None if this probe cannot split it."""
    if isinstance(module, nn.Linear):
        return "linear"  # W (out, in): dW = sum_t g_t a_t^T; LoRA's A and B are Linears
    if isinstance(module, nn.Embedding):
        if module.sparse or module.scale_grad_by_freq or module.max_norm is not None:
            return None
        return "embedding"  # W (V, d): dW = sum_t e_{x_t} g_t^T
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return "conv1d"  # GPT-2's transposed Linear, W (in, out): dW = sum_t a_t g_t^T
    return None


@dataclass
class _Layout:
    """A (B, L') activation's positions, flattened to N = B * L': group k is perm[offsets[k]:offsets[k+1]]."""

    gid: torch.Tensor  # (N,)
    perm: torch.Tensor  # (N,)
    offsets: list[int]  # (G + 1,)
    _onehot: dict = field(default_factory=dict)

    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    def onehot(self, acc: torch.dtype) -> torch.Tensor:
        if acc not in self._onehot:
            self._onehot[acc] = nn.functional.one_hot(self.gid, len(self.offsets) - 1).to(acc)  # (N, G)
        return self._onehot[acc]


@dataclass
class _Use:
    """One call of a module that uses a probed parameter: what the split of its gradient needs."""

    kind: str  # "linear", "conv1d", "embedding" (weights) or "bias"
    x: torch.Tensor | None  # (N, in) inputs, (N,) token ids, None for a bias
    g: torch.Tensor  # (N, out) gradient at the module's output
    layout: _Layout
    token_set: int

    def add_group(self, k: int, out: torch.Tensor, acc: torch.dtype) -> None:
        """out += this call's part of group k's gradient (out has the parameter's shape)."""
        idx = self.layout.perm[self.layout.offsets[k] : self.layout.offsets[k + 1]]
        if idx.numel() == 0:
            return
        g = self.g[idx].to(acc)  # (n_k, out)
        if self.kind == "bias":
            out += g.sum(0)
        elif self.kind == "embedding":
            out.index_add_(0, self.x[idx], g)
        elif self.kind == "linear":
            out.addmm_(g.T, self.x[idx].to(acc))  # sum_{t in k} g_t a_t^T
        else:
            out.addmm_(self.x[idx].to(acc).T, g)

    def all_groups(self, out: torch.Tensor, acc: torch.dtype) -> None:
        """out (G, *shape) += this call's gradient of every group at once: G times the flops of one matmul, but a
        single kernel, which wins on small layers where the per-group loop's overhead dominates."""
        onehot = self.layout.onehot(acc)  # (N, G)
        G = onehot.shape[1]
        g = self.g.to(acc)  # (N, out)
        if self.kind == "bias":
            out += onehot.T @ g  # (G, out)
        elif self.kind == "embedding":
            V = out.shape[1]
            out.view(G * V, -1).index_add_(0, self.layout.gid * V + self.x, g)
        else:
            g_by_group = (onehot[:, :, None] * g[:, None, :]).reshape(g.shape[0], -1)  # (N, G * out)
            x = self.x.to(acc)  # (N, in)
            if self.kind == "linear":
                out += (g_by_group.T @ x).view(out.shape)  # (G, out, in)
            else:
                out += (x.T @ g_by_group).view(x.shape[1], G, -1).transpose(0, 1)  # (G, in, out)

    def times(self, r: torch.Tensor, rows: int, acc: torch.dtype) -> torch.Tensor:
        """This call's part of (dW @ r), in O(N (in + out)): the Freivalds check that the hooks explain dW."""
        g = self.g.to(acc)
        if self.kind == "embedding":
            return torch.zeros(rows, dtype=acc, device=g.device).index_add_(0, self.x, g @ r)
        if self.kind == "linear":
            return g.T @ (self.x.to(acc) @ r)
        return self.x.to(acc).T @ (g @ r)


def _pair_width(u: _Use, v: _Use) -> int | None:
    """Multiply-adds per position pair of `_pair_gram(u, v)`, or None if the pair has no Gram form here."""
    kinds = {u.kind, v.kind}
    if kinds in ({"linear"}, {"conv1d"}):
        return u.x.shape[1] + u.g.shape[1]
    if kinds in ({"embedding"}, {"linear", "embedding"}):
        return (u.g if u.kind == "embedding" else v.g).shape[1] + 1
    return None


def _pair_gram(u: _Use, v: _Use, acc: torch.dtype, cache: dict | None = None) -> torch.Tensor:
    """(N_u, N_v) inner products between the per-position gradient terms of two calls of one weight."""
    if u.kind == "embedding" and v.kind == "linear":
        return _pair_gram(v, u, acc).T
    gu, gv = u.g.to(acc), v.g.to(acc)
    if u.kind == v.kind == "embedding":  # <e_{x_t} g_t^T, e_{x_s} g_s^T> = [x_t = x_s] (g_t . g_s)
        return (u.x[:, None] == v.x[None, :]).to(acc) * (gu @ gv.T)
    if v.kind == "embedding":  # a tied lm_head (V, d): <g_t a_t^T, e_{x_s} g_s^T> = g_t[x_s] (a_t . g_s)
        return gu[:, v.x] * (u.x.to(acc) @ gv.T)
    g_gram = _syrk(gu) if v is u else gu @ gv.T
    return _input_gram(u.x, v.x, acc, cache) * g_gram  # (a_t . a_s)(g_t . g_s), Linear or Conv1D alike


def _syrk(a: torch.Tensor, block: int = 128) -> torch.Tensor:
    """a @ a.T from the row panels on and right of the diagonal only (symmetric): 10-30% faster on a CPU."""
    n = a.shape[0]
    if n <= 2 * block:
        return a @ a.T
    out = torch.empty(n, n, dtype=a.dtype, device=a.device)
    for i in range(0, n, block):
        panel = a[i : i + block] @ a[i:].T  # (b, n - i)
        out[i : i + block, i:] = panel
        out[i + block :, i : i + block] = panel[:, block:].T
    return out


def _input_gram(x: torch.Tensor, y: torch.Tensor, acc: torch.dtype, cache: dict | None) -> torch.Tensor:
    """x y^T, reused across the modules that read the same input (q, k, v; gate and up): saves a third of the Gram."""
    key = (x.data_ptr(), y.data_ptr(), tuple(x.shape), tuple(y.shape), x.dtype, acc)
    if cache is not None and key in cache:
        return cache[key][0]
    gram = _syrk(x.to(acc)) if x is y else x.to(acc) @ y.to(acc).T
    if cache is not None:  # keep x and y alive with it, so that their storage cannot be reused under the same key
        if len(cache) >= 4:
            cache.pop(next(iter(cache)))
        cache[key] = (gram, x, y)
    return gram


@dataclass
class _Record:
    stats: dict[str, _Stats] = field(default_factory=dict)
    checks: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    token_sets: set[int] = field(default_factory=set)
    table: pd.DataFrame | None = None


_GRAM_MAX_POSITIONS = 4096  # the Gram route holds an (N, N) matrix
_ONE_SHOT_MACS = 2**24  # below this many extra multiply-adds, all groups in one kernel beat a Python loop over them


class GradientProbe:
    """Per-bin gradient norms of every backward, by position attribution, from hooks (module docstring).

    Attach it (``with GradientProbe(model) as probe:``, or ``attach()`` / ``detach()``), call
    ``set_tokens(probs, mask)`` with the (B, T) probabilities and response mask of each minibatch before its forward,
    and run forward + backward as usual. Each backward adds one record: per parameter, ||g_k||^2 and <g_k, g> for
    every bin and `context`, kept on the device (no host sync in the backward) and tabulated by `frame()`.

    How: a forward hook on each Linear / Embedding / Conv1D that owns a probed parameter keeps its input (a view of the
    tensor autograd saves anyway) and hooks its output's gradient; when the parameter's own gradient dW arrives
    (a tensor hook), the probe groups the positions by bin and forms each group's sum_t g_t a_t^T: one matmul per
    group with the largest group taken as dW minus the others, or the Gram identity, by an operation count
    (``method="gram"`` forces the Gram, ``"matmul"`` forbids it). A cheap Freivalds check, dW r = sum_t g_t (a_t . r),
    confirms that the hooked calls explain dW; a parameter that fails it (used outside its module, e.g. DoRA's weight
    norm) is left out of the tables with a warning.

    Positions: input position L - T - 1 + t belongs to the bin of response token t when mask[:, t], else to `context`,
    like every other position (prompt, padding, the last position). An activation shorter than L (``logits_to_keep``)
    covers the last positions. A tied weight (embedding = lm_head) is split over both of its uses; gradient
    checkpointing, reentrant or not, counts each call once (tested). Not supported: models that flatten (B, L) before
    a Linear (MoE experts): a ValueError names the module. Costs, measured in benchmarks/README.md: about 1.3x a plain
    forward + backward on a 100M model on one CPU thread (1.15x with LoRA), a constant ~10 ms per backward on tiny
    models.
    """

    def __init__(
        self,
        model: nn.Module,
        bins: Sequence[float] = DEFAULT_BINS,
        params: Iterable[torch.Tensor] | None = None,
        *,
        level: str = "model",
        method: str = "auto",
    ):
        self.bins = check_bins(bins)
        self.level = _check_level(level)
        if method not in ("auto", "matmul", "gram"):
            raise ValueError(f"method must be 'auto', 'matmul' or 'gram', got {method!r}")
        self.method = method
        self.K = len(self.bins) - 1
        self.model = model
        owners: dict[nn.Parameter, list[tuple[nn.Module, str | None, str]]] = {}
        for module in {id(m): m for m in model.modules()}.values():
            kind = _module_kind(module)
            for role, p in module._parameters.items():
                if p is not None:
                    owners.setdefault(p, []).append((module, kind, role))

        def splittable(p) -> bool:
            own = owners.get(p, [])
            return bool(own) and all(kind is not None and role in ("weight", "bias") for _, kind, role in own)

        self._named = _named_trainable(model, params, splittable)
        probed = {p for _, p in self._named}
        self._kinds: dict[nn.Module, str] = {}
        self._probed_of: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}
        for p in probed:
            for module, kind, role in owners[p]:
                self._kinds[module] = kind
                self._probed_of.setdefault(module, []).append((role, p))
        self._handles: list = []
        self._tensor_handles: list = []
        self._attached = False
        self._warned: set[str] = set()
        self._vectors: dict = {}
        self._input_grams: dict = {}  # a small LRU of x x^T for modules sharing an input
        self.reset()

    # -- lifecycle -------------------------------------------------------------------------------------------------

    @property
    def params(self) -> list[nn.Parameter]:
        """The probed parameters."""
        return [p for _, p in self._named]

    def attach(self) -> GradientProbe:
        if self._attached:
            return self
        for module in self._kinds:
            self._handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))
        for name, p in self._named:
            self._handles.append(p.register_hook(lambda grad, p=p, name=name: self._on_grad(p, name, grad)))
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove every hook; the model is as it was, and a later backward costs nothing extra."""
        for handle in [*self._handles, *self._tensor_handles]:
            handle.remove()
        self._handles.clear()
        self._tensor_handles.clear()
        self._pending.clear()
        self._attached = False

    def __enter__(self) -> GradientProbe:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget every record and token set."""
        self._records: list[_Record] = []
        self._current = _Record()
        self._token_counts: list[torch.Tensor] = []
        self._groups: torch.Tensor | None = None
        self._layouts: dict = {}
        self._pending: dict[nn.Parameter, list[_Use]] = {}

    def set_tokens(self, probs: torch.Tensor, mask: torch.Tensor) -> None:
        """Bins for the next forward: (B, T) probabilities (normally old_logp.exp()) and response mask."""
        mask = _check_mask(mask)
        probs = _check_probs(probs, mask)
        self._close()
        bin_of = bin_index(probs, self.bins)  # (B, T)
        group = torch.where(mask, bin_of, self.K)  # (B, T): masked-out tokens' positions are context
        last = torch.full_like(group[:, :1], self.K)  # (B, 1): the last input position predicts nothing
        self._groups = torch.cat([group, last], dim=1)  # (B, T + 1): groups of input positions L-T-1 .. L-1
        self._token_counts.append(torch.bincount(bin_of[mask], minlength=self.K))
        self._layouts = {}
        # output-gradient hooks of graphs already freed need no removal: keep a long-attached probe's list short
        self._tensor_handles = [h for h in self._tensor_handles if h.hooks_dict_ref() is not None]

    # -- hooks -----------------------------------------------------------------------------------------------------

    def _layout(self, length: int, device) -> _Layout:
        key = (length, str(device))
        if key not in self._layouts:
            groups = self._groups.to(device)
            B, T1 = groups.shape
            if length >= T1:  # prompt positions in front are context
                gid = torch.cat([torch.full((B, length - T1), self.K, dtype=groups.dtype, device=device), groups], 1)
            else:  # logits_to_keep: the activation covers only the last `length` positions
                gid = groups[:, -length:]
            gid = gid.reshape(-1)  # (N,)
            counts = torch.bincount(gid, minlength=self.K + 1).tolist()  # one host sync per minibatch and length
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + c)
            self._layouts[key] = _Layout(gid, torch.argsort(gid, stable=True), offsets)
        return self._layouts[key]

    def _on_forward(self, module, args, kwargs, output):
        if not self._attached or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        if self._groups is None:
            raise RuntimeError("GradientProbe: call set_tokens(probs, mask) before the forward pass")
        x = args[0] if args else kwargs.get("input")
        kind = self._kinds[module]
        B = self._groups.shape[0]
        want = 2 if kind == "embedding" else 3
        if x.dim() != want or x.shape[0] != B:
            raise ValueError(
                f"GradientProbe: a {type(module).__name__} got input {tuple(x.shape)}; expected (B={B}, L"
                f"{'' if want == 2 else ', features'}) as in set_tokens (models that flatten tokens are not supported)"
            )
        layout = self._layout(x.shape[1], x.device)
        x = x.detach().reshape(-1) if kind == "embedding" else x.detach().reshape(-1, x.shape[-1])
        token_set = len(self._token_counts) - 1
        self._tensor_handles.append(
            output.register_hook(lambda g: self._on_output_grad(module, x, layout, token_set, g))
        )

    def _on_output_grad(self, module, x, layout, token_set, g):
        if not self._attached:
            return
        g = g.detach().reshape(-1, g.shape[-1])  # (N, out)
        kind = self._kinds[module]
        if kind == "embedding" and module.padding_idx is not None:
            g = g.masked_fill((x == module.padding_idx)[:, None], 0)  # F.embedding gives the padding row no gradient
        for role, p in self._probed_of[module]:
            use = _Use("bias" if role == "bias" else kind, None if role == "bias" else x, g, layout, token_set)
            self._pending.setdefault(p, []).append(use)

    def _on_grad(self, p, name, grad):
        uses = self._pending.pop(p, [])
        if not self._attached:
            return
        if not uses:
            self._warn(name, "got a gradient that no hooked module call explains (used functionally?)")
            return
        if name in self._current.stats:  # this parameter already reported: a new backward began
            self._close()
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        full = grad.detach().to(acc)  # never written to: it may be the very tensor autograd accumulates
        counts = [sum(c) for c in zip(*(u.layout.counts() for u in uses))]
        kinds = {u.kind for u in uses}
        if kinds == {"embedding"}:
            nsq, ip = self._split_sparse(full, uses, acc)
        elif kinds != {"bias"} and self._gram_pays(full, uses, counts):
            nsq, ip = self._split_gram(uses, acc)
        else:
            nsq, ip = self._split_dense(full, uses, acc, counts)
        flat_full = full.reshape(-1)
        self._current.stats[name] = _Stats(nsq=nsq, ip=ip, full_sq=flat_full.dot(flat_full), numel=p.numel())
        self._current.checks[name] = self._check(full, uses, acc, grad.dtype)
        self._current.token_sets.update(u.token_set for u in uses)

    # -- the split -------------------------------------------------------------------------------------------------

    def _gram_pays(self, full: torch.Tensor, uses: list[_Use], counts: list[int]) -> bool:
        """Gram or per-group matmuls, by an operation count calibrated on a CPU (one pass over a weight-sized
        buffer ~ 20 multiply-adds): the matmuls write G weight-sized matrices, the Gram only N x N ones."""
        widths = [[_pair_width(u, v) for v in uses] for u in uses]
        if self.method == "matmul" or any(w is None for row in widths for w in row):
            return False
        if self.method == "gram":
            return True
        n, G = sum(counts), len(counts)
        if n > _GRAM_MAX_POSITIONS:
            return False
        gram = sum(u.g.shape[0] * v.g.shape[0] * widths[i][j] for i, u in enumerate(uses) for j, v in enumerate(uses))
        matmul = (n - max(counts)) * full.numel() + 20 * (8 * (G - 1) + 6) * full.numel()
        return gram + n * n * G < matmul

    def _split_dense(self, full, uses, acc, counts):
        """Each group's gradient as a matrix, one group at a time; the largest group is dW minus the others."""
        G = len(counts)
        if sum(counts) * full.numel() * (G - 1) < _ONE_SHOT_MACS:  # small layer: every group in one kernel
            groups = torch.zeros((G, *full.shape), dtype=acc, device=full.device)
            for u in uses:
                u.all_groups(groups, acc)
            flat = groups.reshape(G, -1)
            return flat.square().sum(1), flat @ full.reshape(-1)
        skip = max(range(len(counts)), key=counts.__getitem__)
        zero = full.new_zeros(())
        nsq, ip = [zero] * len(counts), [zero] * len(counts)
        group = torch.empty_like(full)
        rest = torch.zeros_like(full)
        flat_full = full.reshape(-1)
        for k, n_k in enumerate(counts):
            if k == skip or n_k == 0:
                continue
            group.zero_()
            for u in uses:
                u.add_group(k, group, acc)
            flat = group.reshape(-1)
            nsq[k], ip[k] = torch.dot(flat, flat), torch.dot(flat, flat_full)
            rest += group
        skipped = (full - rest).reshape(-1)  # exact when the hooks explain dW, which _check verifies
        nsq[skip], ip[skip] = torch.dot(skipped, skipped), torch.dot(skipped, flat_full)
        return torch.stack(nsq), torch.stack(ip)

    def _split_gram(self, uses, acc):
        """<G_k, G_j> from the Gram identity, summed over pairs of calls: sum_{t in k, s in j} <term_t, term_s>, where
        a Linear's term g_t a_t^T pairs with another as (g_t . g_s)(a_t . a_s). No weight-sized matrix at all."""
        C = 0
        for i, u in enumerate(uses):
            for v in uses[i:]:
                gram = _pair_gram(u, v, acc, self._input_grams)  # (N_u, N_v)
                block = u.layout.onehot(acc).T @ gram @ v.layout.onehot(acc)  # (G, G)
                C = C + (block if v is u else block + block.T)
        return C.diagonal().clone(), C.sum(1)

    def _split_sparse(self, full, uses, acc):
        """An embedding's group gradients touch only the rows of the tokens seen: sum them per (group, token)."""
        V = full.shape[0]
        ids = torch.cat([u.x for u in uses])  # (N,)
        g = torch.cat([u.g for u in uses]).to(acc)  # (N, d)
        gid = torch.cat([u.layout.gid for u in uses])  # (N,)
        keys, inverse = torch.unique(gid * V + ids, return_inverse=True)
        rows = torch.zeros(len(keys), g.shape[1], dtype=acc, device=g.device).index_add_(0, inverse, g)  # (U, d)
        group, token = keys // V, keys % V
        G = self.K + 1
        nsq = torch.zeros(G, dtype=acc, device=g.device).index_add_(0, group, rows.square().sum(1))
        ip = torch.zeros(G, dtype=acc, device=g.device).index_add_(0, group, (rows * full[token]).sum(1))
        return nsq, ip

    def _check(self, full, uses, acc, grad_dtype):
        """Freivalds: does the sum over the hooked calls of (their dW) r equal dW r? -> (residual, scale, tolerance)."""
        if uses[0].kind == "bias":
            lhs = full
            rhs = sum(u.g.to(acc).sum(0) for u in uses)
        else:
            r = self._probe_vector(full.shape[1], full.device, acc)
            lhs = full @ r
            rhs = sum(u.times(r, full.shape[0], acc) for u in uses)
        dtypes = {grad_dtype, *(u.g.dtype for u in uses)}
        tol = 1e-8 if dtypes == {torch.float64} else 1e-3 if dtypes <= {torch.float32, torch.float64} else 3e-2
        return (lhs - rhs).norm(), lhs.norm() + rhs.norm(), tol

    def _probe_vector(self, n: int, device, acc) -> torch.Tensor:
        """A fixed vector with no structure a real gradient could share (no RNG: the trainer's stays untouched)."""
        key = (n, str(device), acc)
        if key not in self._vectors:
            self._vectors[key] = torch.sin(torch.arange(n, device=device, dtype=acc) * 0.7548776662 + 0.5)
        return self._vectors[key]

    # -- results ---------------------------------------------------------------------------------------------------

    def _warn(self, name: str, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"GradientProbe: {name} {why}; it is left out of the tables", stacklevel=3)

    def _close(self) -> None:
        self._input_grams.clear()
        if self._current.stats:
            self._records.append(self._current)
        self._current = _Record()

    def _record_table(self, record: _Record, index: int) -> pd.DataFrame:
        if record.table is None:
            names = list(record.checks)
            resid, scale = (torch.stack([record.checks[n][i].double().cpu() for n in names]) for i in (0, 1))
            for n, r, s in zip(names, resid.tolist(), scale.tolist()):
                if not r <= record.checks[n][2] * s + 1e-30:
                    self._warn(n, "has a gradient that its hooked calls do not explain (used outside its module?)")
                    del record.stats[n]
            counts = sum(self._token_counts[i] for i in sorted(record.token_sets)).cpu().numpy()
            record.table = _table(record.stats, counts, self.bins, "position", self.level, record=index)
        return record.table

    def frame(self) -> pd.DataFrame:
        """Every record so far, one table per backward, with a `record` column (0, 1, ...)."""
        self._close()
        tables = [self._record_table(r, i) for i, r in enumerate(self._records)]
        if not tables:
            return pd.DataFrame(columns=["record", *COLUMNS])
        return tables[0].copy() if len(tables) == 1 else pd.concat(tables, ignore_index=True)

    def summary(self) -> pd.DataFrame:
        """The per-bin table averaged over the records (`summarize`)."""
        return summarize(self.frame())

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """`to_metrics` of the records so far: {"grad/norm_bin0": ..., "grad/share_context": ..., ...}."""
        table = self.frame()
        if table.empty:
            raise RuntimeError("GradientProbe has no records: run a backward while it is attached")
        return to_metrics(table, prefix)


# ----------------------------------------------------------------------------------------------------------------------
# Probability shift (Fig. 2b) and selective updates (Fig. 1c, e, f)


@dataclass
class ProbabilityShift:
    """How an update moved the probability of each response token."""

    delta_p: torch.Tensor
    """(B, T) exp(new_logp) - exp(old_logp), 0 outside the mask."""
    tokens: pd.DataFrame
    """One row per masked token: seq, pos, bin, label, p_old, p_new, delta_p, advantage, correct (True when the
    probability moved the way the advantage's sign asks; <NA> for A = 0)."""
    bins: pd.DataFrame
    """`theory.shift_summary`: per (bin, sign in "pos"/"neg") n_tokens, correct_ratio and delta_p quantiles."""


def probability_shift(
    old_logp: torch.Tensor,
    new_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    bins: Sequence[float] = DEFAULT_BINS,
) -> ProbabilityShift:
    """delta_p = exp(new) - exp(old) per token, binned by the OLD probability, and the paper's correct ratio.

    `advantages` are (B, T) per token or (B,) per sequence. The correct ratio of a (bin, sign) cell is the share of its
    tokens whose probability moved the way the advantage asks: up for A > 0, down for A < 0 (Fig. 2b plots the A > 0
    one). Example: p_old = .2 -> p_new = .3 with A = +1 is correct; the same move with A = -1 is not.
    """
    edges = check_bins(bins)
    mask = _check_mask(mask)
    old_logp = _check_like("old_logp", old_logp, mask).detach()
    new_logp = _check_like("new_logp", new_logp, mask).detach()
    adv = _check_like("advantages", advantages, mask, allow_per_sequence=True).detach()
    p_old, p_new = old_logp.exp(), new_logp.exp()
    delta_p = torch.where(mask, p_new - p_old, torch.zeros_like(p_old))  # (B, T)
    seq, pos = mask.nonzero(as_tuple=True)
    a = adv[seq, pos].double().cpu().numpy()
    dp = delta_p[seq, pos].double().cpu().numpy()
    bin_of = bin_index(p_old[seq, pos], edges).cpu().numpy()
    correct = pd.array(np.where(a > 0, dp > 0, dp < 0), dtype="boolean")
    correct[a == 0] = pd.NA
    labels = bin_labels(edges)
    tokens = pd.DataFrame(
        {
            "seq": seq.cpu().numpy(),
            "pos": pos.cpu().numpy(),
            "bin": bin_of,
            "label": [labels[k] for k in bin_of],
            "p_old": p_old[seq, pos].double().cpu().numpy(),
            "p_new": p_new[seq, pos].double().cpu().numpy(),
            "delta_p": dp,
            "advantage": a,
            "correct": correct,
        }
    )
    return ProbabilityShift(delta_p=delta_p, tokens=tokens, bins=shift_summary(tokens, edges))


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
    *,
    bins: Sequence[float] = DEFAULT_BINS,
    lr: float = 1e-3,
    params: Iterable[torch.Tensor] | None = None,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,
) -> SelectiveUpdate:
    """One SGD step on the policy-gradient loss of the tokens of `update_bins` only, then every token's probability
    change, with the model's weights restored exactly afterwards (the paper's Fig. 1c: all bins; e: only bin 0;
    f: only the top bin; SGD with lr 1e-3 as there).

    The loss is the GRPO token mean at ratio 1, L = -(1/n) sum_{t in update_bins} A_t log pi(o_t), n counting ALL
    response tokens (as Lopti's stages do), so the update on all bins is exactly GRPO's first minibatch step. Bins are
    chosen by the model's own probabilities before the step. The model runs in eval mode (no dropout) throughout and
    its mode is restored. `advantages` are (B, T) or (B,); pass AR-reweighted ones to see AR.

    Example: ``selective_update(model, ids, attn, resp_mask, adv, update_bins=[0]).shift.bins`` is Fig. 1e's data.
    """
    edges = check_bins(bins)
    mask, T = _check_batch(input_ids, attention_mask, response_mask)
    adv = _check_like("advantages", advantages, mask, allow_per_sequence=True).detach()
    K = len(edges) - 1
    chosen = list(range(K)) if update_bins is None else [int(k) for k in update_bins]
    if not chosen or any(not 0 <= k < K for k in chosen):
        raise ValueError(f"update_bins must name bins in 0..{K - 1}, got {update_bins!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    named = _named_trainable(model, params)
    params = [p for _, p in named]
    was_training = model.training
    model.eval()
    try:
        logp = _response_logp(model, input_ids, attention_mask, T, position_ids, temperature)  # (B, T)
        old_logp = logp.detach()
        in_update = mask & torch.isin(bin_index(old_logp.exp(), edges), torch.tensor(chosen, device=mask.device))
        loss = -(adv * logp).masked_fill(~in_update, 0).sum() / mask.sum().clamp_min(1)
        grads = [_or_zeros(g, p) for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]
        grad_norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        saved = [p.detach().clone() for p in params]
        try:
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.add_(g, alpha=-lr)
                new_logp = _response_logp(model, input_ids, attention_mask, T, position_ids, temperature)
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
    finally:
        model.train(was_training)
    name = "all" if sorted(set(chosen)) == list(range(K)) else "+".join(f"bin{k}" for k in sorted(set(chosen)))
    return SelectiveUpdate(
        update=name,
        grad_norm=grad_norm,
        n_updated=int(in_update.sum()),
        shift=probability_shift(old_logp, new_logp, adv, mask, edges),
    )


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
    runs = [
        selective_update(model, input_ids, attention_mask, response_mask, advantages, which, **kwargs)
        for which in [None, *([k] for k in range(K))]
    ]
    tokens = pd.concat([r.shift.tokens.assign(update=r.update) for r in runs], ignore_index=True)
    grads = pd.DataFrame([{"update": r.update, "grad_norm": r.grad_norm, "n_updated": r.n_updated} for r in runs])
    return tokens, grads
