"""Closed-form softmax-gradient facts: why low-probability tokens dominate the update (docs/paper.md §1).

For a token y sampled with probability pi_y = softmax(z)_y over N tokens,

    d log pi_y / d z = e_y - pi
    ||e_y - pi||^2   = (1 - pi_y)^2 + sum_{k != y} pi_k^2
    sqrt(N / (N - 1)) * (1 - pi_y)  <=  ||e_y - pi||  <=  sqrt(2) * (1 - pi_y)

so the gradient a token sends back through the logits shrinks linearly to zero as its probability goes to one: the few
low-probability tokens of a batch carry most of the update. The toy policy that shows it in training is
``lopti_lab.toy``; the probability bins are ``lopti_lab.bins``.

Shape legend: V = vocabulary (N in the paper).
"""

from __future__ import annotations

import math

import pandas as pd
import torch


def logit_grad_norm(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """||e_y - softmax(z)||, the norm of d log softmax(z)_y / dz, for every token: (..., V), (...) -> (...).

    Exact (it forms p - e_y and takes its norm, as autograd would) and computed in the logits' dtype, upcast from
    half precision to float32.

    Example: z = (0, 0), y = 0 -> p = (.5, .5), e_y - p = (.5, -.5), norm = sqrt(.5) = 0.7071.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"tokens must have the logits' shape without V: {tuple(logits.shape[:-1])}, got {tokens.shape}"
        )
    z = logits.detach()
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    p_minus_e = z.softmax(-1)  # (..., V)
    p_minus_e.scatter_add_(-1, tokens[..., None], torch.full_like(p_minus_e[..., :1], -1.0))
    return torch.linalg.vector_norm(p_minus_e, dim=-1)  # (...)


def grad_norm_bounds(p, vocab_size: int):
    """The wedge of docs/paper.md §1: (lower, upper) = (sqrt(N/(N-1)) (1 - p), sqrt(2) (1 - p)).

    Works on floats, numpy arrays and tensors alike. The lower bound is reached when the other N-1 tokens share the
    remaining mass equally, the upper one when a single other token holds all of it.

    >>> grad_norm_bounds(0.5, 2)
    (0.7071067811865476, 0.7071067811865476)
    """
    if int(vocab_size) != vocab_size or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    gap = 1 - p
    return math.sqrt(vocab_size / (vocab_size - 1)) * gap, math.sqrt(2.0) * gap


def sampled_tokens(n: int = 5000, vocab_size: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Tokens sampled from random softmax distributions of every sharpness: one token per distribution, its
    probability `prob` and the norm `grad_norm` of d log pi_y / dz = e_y - pi. Fig. 2a's wedge, in numbers.

    Logits are standard normal times a scale drawn log-uniformly in [0.3, 30], so both flat and peaked distributions
    (and therefore both rare and confident tokens) appear.
    """
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(n, 1, dtype=torch.float64).uniform_(math.log(0.3), math.log(30), generator=gen))
    logits = torch.randn(n, vocab_size, generator=gen, dtype=torch.float64) * scale  # (n, V)
    tokens = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)  # (n,)
    prob = logits.softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    return pd.DataFrame({"prob": prob.numpy(), "grad_norm": logit_grad_norm(logits, tokens).numpy()})
