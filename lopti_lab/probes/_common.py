"""Shared parts of the probes: input checks (a ValueError naming the bad input), the response logits of the
trainer's row layout, and the per-bin tables every attribution returns (see lopti_lab.probes)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import nn

from lopti_lab.bins import bin_labels

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
