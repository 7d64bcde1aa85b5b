"""The softmax-gradient facts of PAPER.md §2 against autograd, and the toy policy's behaviour."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lopti_lab.theory import (
    DEFAULT_BINS,
    METHODS,
    Method,
    ToyConfig,
    bin_index,
    bin_labels,
    check_bins,
    grad_norm_bounds,
    group_advantages,
    logit_grad_norm,
    shift_summary,
    simulate,
)

QUICK = ToyConfig(vocab_size=64, n_states=16, feature_dim=4, seq_len=8, n_prompts=4, group_size=4, steps=3)


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


# ---------------------------------------------------------------------------------------------------------------------
# Bins and the correct ratio


def test_bins_checks_name_the_problem():
    assert check_bins([0, 0.5, 1]) == (0.0, 0.5, 1.0)
    for bad, match in [
        ((0, 0.5, 0.5, 1), "increasing"),
        ((0, 0.7, 0.3, 1), "increasing"),
        ((0, 1.2), r"\[0, 1\]"),
        ((-0.5, 1), r"\[0, 1\]"),
        ((0.2, 1), "start at 0"),
        ((1,), "two edges"),
        ("abc", "numbers"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            check_bins(bad)
        assert "bins" in str(err.value)


def test_bin_index_and_labels():
    p = torch.tensor([0.0, 0.2499, 0.25, 0.5, 0.7499, 0.75, 1.0])
    assert bin_index(p).tolist() == [0, 0, 1, 2, 2, 3, 3]
    assert bin_labels() == ["[0, 0.25)", "[0.25, 0.5)", "[0.5, 0.75)", "[0.75, 1]"]
    assert bin_index(torch.tensor([0.3, 0.6]), (0, 0.5, 1)).tolist() == [0, 1]


def test_shift_summary_by_hand():
    """Bin 0: (A, dp) = (+1, +.1), (+1, -.2), (-1, -.3), (0, +.5); bin 1: (+2, 0.0), (+1, +.4).
    pos in bin 0: one of two went up -> .5; neg in bin 0: went down -> 1; A = 0 is left out; bin 1 pos: one did not
    move (unmoved share 1/2, neither right nor wrong), the other went up -> 1 of 1; bin 1 neg: empty -> NaN with
    n_tokens 0."""
    tokens = pd.DataFrame(
        {
            "bin": [0, 0, 0, 0, 1, 1],
            "advantage": [1.0, 1.0, -1.0, 0.0, 2.0, 1.0],
            "delta_p": [0.1, -0.2, -0.3, 0.5, 0.0, 0.4],
        }
    )
    table = shift_summary(tokens, (0, 0.5, 1)).set_index(["bin", "sign"])
    assert table.loc[(0, "pos"), "correct_ratio"] == 0.5
    assert table.loc[(0, "neg"), "correct_ratio"] == 1.0
    assert table.loc[(1, "pos"), "correct_ratio"] == 1.0
    assert table.loc[(1, "pos"), ["n_tokens", "n_moved"]].tolist() == [2, 1]
    assert table.loc[(1, "pos"), "unmoved_share"] == 0.5 and table.loc[(0, "pos"), "unmoved_share"] == 0.0
    # the direction comes from dlogp when given (a move a float32 delta_p cannot show)
    with_dlogp = shift_summary(tokens.assign(dlogp=[1.0, -1.0, -1.0, 0.0, 1e-9, 1.0]), (0, 0.5, 1))
    assert with_dlogp.set_index(["bin", "sign"]).loc[(1, "pos"), "n_moved"] == 2
    assert np.isnan(table.loc[(1, "neg"), "correct_ratio"]) and table.loc[(1, "neg"), "n_tokens"] == 0
    assert table.loc[(0, "pos"), "dp_mean"] == pytest.approx(-0.05)
    assert table.loc[(0, "pos"), "n_tokens"] == 2 and len(table) == 4
    with pytest.raises(ValueError, match="delta_p"):
        shift_summary(tokens.drop(columns="delta_p"))


def test_shift_summary_when_no_token_asks_to_move():
    """Every group's rewards tied (all advantages 0), as happens on a hard batch: an all-empty table, not a crash."""
    tokens = pd.DataFrame({"bin": [0, 1, 1], "advantage": [0.0, 0.0, 0.0], "delta_p": [0.1, -0.2, 0.0]})
    table = shift_summary(tokens, (0, 0.5, 1))
    assert len(table) == 4 and (table["n_tokens"] == 0).all()
    assert table[["correct_ratio", "dp_q25", "dp_q75"]].isna().all().all()


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    a = group_advantages(r, 2)
    # group (1, 0): mean .5, unbiased std sqrt(.5), so (r - mean) / std = (+.5, -.5) / sqrt(.5)
    torch.testing.assert_close(a[:2], torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-6))
    assert a[2:].abs().max() == 0  # equal rewards in a group: no signal


# ---------------------------------------------------------------------------------------------------------------------
# The toy


@pytest.fixture(scope="module")
def toy():
    return simulate(QUICK)


def test_toy_tables_are_tidy_and_complete(toy):
    n_tokens = QUICK.n_prompts * QUICK.group_size * QUICK.seq_len
    assert len(toy.steps) == QUICK.steps * len(METHODS)
    assert set(toy.steps["method"]) == {m.name for m in METHODS}
    assert len(toy.bins) == QUICK.steps * len(METHODS) * 4
    assert len(toy.shift) == QUICK.steps * len(METHODS) * 4 * 2
    assert len(toy.tokens) == QUICK.steps * len(METHODS) * n_tokens
    assert (toy.bins.groupby(["step", "method"])["n_tokens"].sum() == n_tokens).all()
    np.testing.assert_allclose(toy.bins.groupby(["step", "method"])["grad_share"].sum(), 1.0, atol=1e-5)
    assert toy.tokens[["prob", "grad_norm", "p_new", "delta_p"]].notna().all().all()
    np.testing.assert_allclose(toy.tokens["delta_p"], toy.tokens["p_new"] - toy.tokens["prob"])


def test_toy_reproduces_the_one_minus_p_scaling(toy):
    """PAPER.md §2 and Fig. 1d in miniature: per-token gradients shrink with p, and at step 0 the lowest bin sends a
    larger gradient than the top bin although the top bin holds more tokens."""
    first = toy.bins[(toy.bins["step"] == 0) & (toy.bins["method"] == "GRPO")].set_index("bin")
    assert first.loc[0, "token_grad_norm"] > 2 * first.loc[3, "token_grad_norm"]
    assert first.loc[3, "n_tokens"] > first.loc[0, "n_tokens"]
    assert first.loc[0, "grad_norm"] > first.loc[3, "grad_norm"]
    assert first.loc[0, "grad_share"] > first.loc[3, "grad_share"]
    # every sampled token sits in the wedge of grad_norm_bounds
    lower, upper = grad_norm_bounds(toy.tokens["prob"].to_numpy(), QUICK.vocab_size)
    norm = toy.tokens["grad_norm"].to_numpy()
    assert (norm >= lower - 1e-5).all() and (norm <= upper + 1e-5).all()


def test_ar_with_alpha_zero_is_grpo_exactly():
    res = simulate(QUICK, methods=[Method("GRPO"), Method("AR0", alpha=0.0), Method("AR", alpha=0.3)])

    def of(frame, name):
        return frame[frame["method"] == name].drop(columns="method").reset_index(drop=True)

    for frame in (res.steps, res.bins, res.shift, res.tokens):
        pd.testing.assert_frame_equal(of(frame, "GRPO"), of(frame, "AR0"), check_exact=True)
    # and AR with alpha > 0 does change the update (same first batch, different weights)
    assert not np.allclose(of(res.tokens, "GRPO")["p_new"], of(res.tokens, "AR")["p_new"])
    first = res.tokens[res.tokens["step"] == 0]
    np.testing.assert_array_equal(of(first, "GRPO")["token"], of(first, "AR")["token"])


def test_lopti_updates_in_two_stages(toy):
    """Same first batch, different update: Lopti's second stage moves the high-probability tokens on its own."""
    first = toy.tokens[toy.tokens["step"] == 0]
    grpo, lopti = (first[first["method"] == m].reset_index(drop=True) for m in ("GRPO", "Lopti"))
    np.testing.assert_array_equal(grpo["token"], lopti["token"])
    assert not np.allclose(grpo["p_new"], lopti["p_new"])


def test_toy_is_seeded_and_validates_its_config():
    a, b = simulate(QUICK, methods=METHODS[:1]), simulate(QUICK, methods=METHODS[:1])
    pd.testing.assert_frame_equal(a.tokens, b.tokens)
    c = simulate(ToyConfig(**{**QUICK.__dict__, "seed": 1}), methods=METHODS[:1])
    assert not a.tokens["token"].equals(c.tokens["token"])
    for field, value in [("vocab_size", 1), ("group_size", 1), ("lr", 0.0), ("optimizer", "rmsprop"), ("steps", 0)]:
        with pytest.raises(ValueError, match=f"ToyConfig.{field}"):
            ToyConfig(**{field: value})
    with pytest.raises(ValueError, match="bins"):
        ToyConfig(bins=(0, 0.6, 0.3, 1))
    with pytest.raises(ValueError, match="alpha"):
        Method("AR", alpha=1.5)
    with pytest.raises(ValueError, match="unique"):
        simulate(QUICK, methods=[Method("GRPO"), Method("GRPO")])
    assert QUICK.bins == DEFAULT_BINS
