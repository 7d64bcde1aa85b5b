"""attribution="loss": each probability bin's gradient as the vector-Jacobian product of its own token losses
(see lopti_lab.probes)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from lopti_lab.bins import DEFAULT_BINS, bin_index, check_bins
from lopti_lab.probes._common import (
    _check_level,
    _check_like,
    _check_mask,
    _check_probs,
    _named_trainable,
    _Stats,
    _table,
)
from lopti_lab.probes.position import GradientProbe

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
