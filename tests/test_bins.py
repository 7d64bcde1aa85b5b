"""Probability bins, and the correct-ratio table (Fig. 2b) that the probes and the toy both report."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from lopti_lab.bins import bin_index, bin_labels, check_bins
from lopti_lab.probes import shift_summary

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
