"""Probability bins: the one way lopti_lab groups tokens by their rollout probability (probes, toy, plots, reports).

Bin k is [bins[k], bins[k+1]), the last one closed, [bins[-2], 1], so every probability falls in exactly one bin. The
default is the paper's Fig. 1 (docs/paper.md §5): quarters.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

DEFAULT_BINS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The paper's Fig. 1 bins: [0, .25), [.25, .5), [.5, .75), [.75, 1]."""

DECILES: tuple[float, ...] = tuple(k / 10 for k in range(11))
"""Tenths, the finer bins of the paper's Fig. 3."""


def check_bins(bins: Sequence[float]) -> tuple[float, ...]:
    """Validate bin edges and return them as a tuple of floats.

    Edges must be strictly increasing, start at 0 and end at 1, so that every probability falls in exactly one bin:
    bin k is [bins[k], bins[k+1]), the last one closed, [bins[-2], 1].

    >>> check_bins([0, 0.5, 1])
    (0.0, 0.5, 1.0)
    """
    try:
        edges = tuple(float(b) for b in bins)
    except (TypeError, ValueError) as err:
        raise ValueError(f"bins must be a sequence of numbers, got {bins!r}") from err
    if len(edges) < 2:
        raise ValueError(f"bins needs at least two edges, got {edges}")
    if any(not 0.0 <= b <= 1.0 for b in edges):
        raise ValueError(f"bins must lie in [0, 1], got {edges}")
    if any(b1 <= b0 for b0, b1 in itertools.pairwise(edges)):
        raise ValueError(f"bins must be strictly increasing, got {edges}")
    if edges[0] != 0.0 or edges[-1] != 1.0:
        raise ValueError(f"bins must start at 0 and end at 1 so that every token has a bin, got {edges}")
    return edges


def bin_index(p: torch.Tensor, bins: Sequence[float] = DEFAULT_BINS) -> torch.Tensor:
    """The bin of each probability: k such that bins[k] <= p < bins[k+1] (p = 1 goes to the last bin).

    >>> bin_index(torch.tensor([0.0, 0.25, 0.7, 1.0]))
    tensor([0, 1, 2, 3])
    """
    edges = check_bins(bins)
    inner = torch.tensor(edges[1:-1], dtype=p.dtype, device=p.device)
    return torch.bucketize(p.detach().contiguous(), inner, right=True)  # right=True: an edge value opens the next bin


def bin_labels(bins: Sequence[float] = DEFAULT_BINS) -> list[str]:
    """Interval labels for plots and tables.

    >>> bin_labels((0, 0.5, 1))
    ['[0, 0.5)', '[0.5, 1]']
    """
    edges = check_bins(bins)
    last = len(edges) - 2
    return [f"[{lo:g}, {hi:g}{']' if k == last else ')'}" for k, (lo, hi) in enumerate(itertools.pairwise(edges))]


def entropy_rank(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each response token's entropy as its rank among the batch's response tokens, in [0, 1): binned by
    ``DEFAULT_BINS`` these are the batch's entropy quartiles (the forking tokens of Wang et al., the top 20%, lie in
    the top one). Ties share the lowest rank of their run. 0 outside ``mask``.

    >>> entropy_rank(torch.tensor([[0.5, 2.0, 0.1, 9.0]]), torch.tensor([[1, 1, 1, 0]])).tolist()
    [[0.3333333432674408, 0.6666666865348816, 0.0, 0.0]]
    """
    keep = mask.bool()
    values = entropy.detach()[keep].float()
    ranks = torch.searchsorted(values.sort().values, values, right=False).float() / max(1, values.numel())
    out = torch.zeros_like(entropy, dtype=torch.float32)
    out[keep] = ranks
    return out
