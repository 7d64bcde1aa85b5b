"""The toy policy: its tables, the 1 - p scaling it shows, and that it runs the objective's own functions."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lopti_lab.bins import DEFAULT_BINS
from lopti_lab.methods import METHODS, PAPER, Method
from lopti_lab.theory import grad_norm_bounds
from lopti_lab.toy import ToyConfig, simulate

QUICK = ToyConfig(vocab_size=64, n_states=16, feature_dim=4, seq_len=8, n_prompts=4, group_size=4, steps=3)


@pytest.fixture(scope="module")
def toy():
    return simulate(QUICK)


def test_toy_tables_are_tidy_and_complete(toy):
    n_tokens = QUICK.n_prompts * QUICK.group_size * QUICK.seq_len
    assert len(toy.steps) == QUICK.steps * len(PAPER)
    assert set(toy.steps["method"]) == set(PAPER)
    assert len(toy.bins) == QUICK.steps * len(PAPER) * 4
    assert len(toy.shift) == QUICK.steps * len(PAPER) * 4 * 2
    assert len(toy.tokens) == QUICK.steps * len(PAPER) * n_tokens
    assert (toy.bins.groupby(["step", "method"])["n_tokens"].sum() == n_tokens).all()
    np.testing.assert_allclose(toy.bins.groupby(["step", "method"])["grad_share"].sum(), 1.0, atol=1e-5)
    assert toy.tokens[["prob", "grad_norm", "p_new", "delta_p"]].notna().all().all()
    np.testing.assert_allclose(toy.tokens["delta_p"], toy.tokens["p_new"] - toy.tokens["prob"])


def test_toy_reproduces_the_one_minus_p_scaling(toy):
    """docs/paper.md §1 and Fig. 1d in miniature: per-token gradients shrink with p, and at step 0 the lowest bin sends
    a larger gradient than the top bin although the top bin holds more tokens."""
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
    res = simulate(QUICK, methods=[Method("GRPO"), Method("AR0", ar_alpha=0.0), Method("AR", ar_alpha=0.3)])

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
    grpo, lopti = (first[first["method"] == m].reset_index(drop=True) for m in ("GRPO", "GRPO+Lopti"))
    np.testing.assert_array_equal(grpo["token"], lopti["token"])
    assert not np.allclose(grpo["p_new"], lopti["p_new"])


def test_toy_is_seeded_and_validates_its_config():
    a, b = simulate(QUICK, methods=[METHODS["GRPO"]]), simulate(QUICK, methods=[METHODS["GRPO"]])
    pd.testing.assert_frame_equal(a.tokens, b.tokens)
    c = simulate(ToyConfig(**{**QUICK.__dict__, "seed": 1}), methods=[METHODS["GRPO"]])
    assert not a.tokens["token"].equals(c.tokens["token"])
    for field, value in [("vocab_size", 1), ("group_size", 1), ("lr", 0.0), ("optimizer", "rmsprop"), ("steps", 0)]:
        with pytest.raises(ValueError, match=f"ToyConfig.{field}"):
            ToyConfig(**{field: value})
    with pytest.raises(ValueError, match="bins"):
        ToyConfig(bins=(0, 0.6, 0.3, 1))
    with pytest.raises(ValueError, match="ar_alpha"):
        Method("AR", ar_alpha=1.5)
    with pytest.raises(ValueError, match="the toy trains the paper's methods"):
        simulate(QUICK, methods=[METHODS["GRPO+CISPO"]])
    with pytest.raises(ValueError, match="unique"):
        simulate(QUICK, methods=[Method("GRPO"), Method("GRPO")])
    assert QUICK.bins == DEFAULT_BINS


def test_toy_runs_the_objectives_own_functions(monkeypatch):
    """No copies of the math: the toy's advantages, AR weights, Lopti stages and clipped loss are objective's."""
    from lopti_lab import objective, toy

    calls = {name: 0 for name in ("group_advantages", "reweight_advantages", "lopti_stages", "policy_loss")}
    for name in calls:
        real = getattr(objective, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(toy, name, spy)
    simulate(QUICK, methods=[METHODS["GRPO+AR+Lopti"]])
    steps = QUICK.steps
    assert calls == {"group_advantages": steps, "reweight_advantages": steps, "lopti_stages": steps,
                     "policy_loss": 2 * steps}  # fmt: skip
