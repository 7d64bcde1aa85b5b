"""The softmax-gradient facts of docs/paper.md §1 against autograd."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lopti_lab.theory import grad_norm_bounds, logit_grad_norm

# ---------------------------------------------------------------------------------------------------------------------
# ||e_y - softmax(z)|| and its wedge


@pytest.mark.parametrize("V", [2, 3, 17, 1000])
def test_logit_grad_norm_equals_autograd(V):
    gen = torch.Generator().manual_seed(V)
    # a spread of temperatures: near-uniform rows, ordinary ones and ones with a token at p ~ 1
    logits = (
        torch.randn(6, 5, V, generator=gen, dtype=torch.float64) * torch.tensor([0.01, 1.0, 3.0, 10.0, 30.0])[:, None]
    )
    tokens = torch.randint(V, (6, 5), generator=gen)
    z = logits.clone().requires_grad_(True)
    logp = z.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    expected = torch.stack(
        [
            torch.autograd.grad(logp[i, j], z, retain_graph=True)[0][i, j].norm()
            for i in range(logits.shape[0])
            for j in range(logits.shape[1])
        ]
    ).view(6, 5)
    got = logit_grad_norm(logits, tokens)
    assert got.shape == (6, 5)
    assert (got - expected).abs().max().item() < 1e-10
    # the closed form of §2 too: ||e_y - pi||^2 = (1 - pi_y)^2 + sum_{k != y} pi_k^2
    pi = logits.softmax(-1)
    others = pi.scatter(-1, tokens[..., None], 0.0)  # pi_k for k != y (summing them avoids 1 - pi_y's cancellation)
    closed = (others.sum(-1) ** 2 + others.square().sum(-1)).sqrt()
    assert (got - closed).abs().max().item() < 1e-10


def test_logit_grad_norm_worked_example_and_shape_check():
    assert logit_grad_norm(torch.zeros(2), torch.tensor(0)).item() == pytest.approx(math.sqrt(0.5))
    with pytest.raises(ValueError, match="tokens"):
        logit_grad_norm(torch.zeros(3, 4), torch.zeros(4, dtype=torch.long))


def test_bounds_hold_on_10000_random_distributions():
    gen = torch.Generator().manual_seed(0)
    for V in (2, 5, 50, 1000):
        # Dirichlet-like draws from sharp to flat: exp(scale * normal), normalised
        scale = torch.logspace(-2, 1.5, 2500, dtype=torch.float64)[:, None]
        logits = scale * torch.randn(2500, V, generator=gen, dtype=torch.float64)
        tokens = torch.randint(V, (2500,), generator=gen)
        p = logits.softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        norm = logit_grad_norm(logits, tokens)
        lower, upper = grad_norm_bounds(p, V)
        assert (norm >= lower - 1e-12).all() and (norm <= upper + 1e-12).all(), V


@pytest.mark.parametrize("V", [2, 3, 10, 1000])
@pytest.mark.parametrize("p", [0.0, 0.01, 0.3, 0.9, 1.0])
def test_bounds_are_reached_at_their_extremes(V, p):
    """Lower: the other N-1 tokens share 1 - p equally. Upper: one other token holds all of it."""
    spread = torch.full((V,), (1 - p) / (V - 1), dtype=torch.float64)
    spread[0] = p
    peaked = torch.zeros(V, dtype=torch.float64)
    peaked[0], peaked[1] = p, 1 - p
    lower, upper = grad_norm_bounds(p, V)
    for probs, bound in ((spread, lower), (peaked, upper)):
        e_minus_pi = -probs.clone()
        e_minus_pi[0] += 1
        assert e_minus_pi.norm().item() == pytest.approx(bound, abs=1e-12)
    if p > 0:  # and through logit_grad_norm, from logits whose softmax is that distribution (p = 0 has no logit)
        logits = torch.where(spread > 0, spread.log(), torch.tensor(-1e4, dtype=torch.float64))
        assert logit_grad_norm(logits, torch.tensor(0)).item() == pytest.approx(lower, abs=1e-10)


def test_bounds_accept_floats_arrays_and_tensors():
    lo, hi = grad_norm_bounds(np.array([0.0, 0.5, 1.0]), 4)
    np.testing.assert_allclose(lo, math.sqrt(4 / 3) * np.array([1, 0.5, 0]))
    np.testing.assert_allclose(hi, math.sqrt(2) * np.array([1, 0.5, 0]))
    assert isinstance(grad_norm_bounds(torch.tensor([0.5]), 4)[0], torch.Tensor)
    assert grad_norm_bounds(0.5, 2) == pytest.approx((math.sqrt(0.5), math.sqrt(0.5)))  # N = 2: the wedge closes
    with pytest.raises(ValueError, match="vocab_size"):
        grad_norm_bounds(0.5, 1)


@settings(max_examples=60, deadline=None)
@given(
    probs=st.lists(st.floats(1e-6, 1.0), min_size=2, max_size=40),
    y=st.integers(0, 39),
)
def test_logit_grad_norm_inside_the_wedge_for_any_distribution(probs, y):
    pi = torch.tensor(probs, dtype=torch.float64)
    pi = pi / pi.sum()
    y = y % len(probs)
    norm = logit_grad_norm(pi.log(), torch.tensor(y)).item()
    lower, upper = grad_norm_bounds(pi[y].item(), len(probs))
    assert lower - 1e-12 <= norm <= upper + 1e-12
