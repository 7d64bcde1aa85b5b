"""The one registry of methods: labels, order, run-folder names and the TrainConfig fields each method sets."""

import pytest

from lopti_lab.methods import (
    AR_ALPHA,
    LOPTI_ETA,
    METHODS,
    ORDER,
    PAPER,
    Method,
    method_label,
    method_of,
    run_name,
    slug,
)
from lopti_lab.train_config import TrainConfig


def test_the_papers_four_methods_in_table_order_then_the_ones_after_it():
    assert PAPER == ("GRPO", "GRPO+AR", "GRPO+Lopti", "GRPO+AR+Lopti") == ORDER[:4]
    assert (AR_ALPHA, LOPTI_ETA) == (0.3, 0.5)  # the paper's K&K settings
    assert [METHODS[m].stages for m in PAPER] == [1, 1, 2, 2]
    assert {"GRPO+Forking", "GRPO+CISPO", "GRPO+Clip-Cov", "GRPO+KL-Cov", "GRPO+EntAdv"} <= set(ORDER)


@pytest.mark.parametrize("label", ORDER)
def test_a_methods_overrides_make_a_config_of_that_method(label):
    """The label, the overrides and the config's own method label agree, both ways."""
    config = TrainConfig(**METHODS[label].overrides())
    assert config.method == label == method_label(config) == method_label(config.to_dict())


def test_labels_slugs_and_run_names():
    assert method_label({"ar_alpha": 0.0}) == "GRPO"  # alpha = 0 is GRPO exactly
    assert method_label({"lopti_eta": 0.5, "lopti_order": "high_first"}) == "GRPO+Lopti(high-first)"
    assert slug("GRPO+Lopti(high-first)") == "grpo_lopti_high_first"
    assert METHODS["GRPO+AR+Lopti"].slug == "grpo_ar_lopti"
    assert run_name("GRPO+AR", seed=3) == "grpo_ar-seed3"
    assert run_name("GRPO", stamp="20261203-101500") == "grpo-20261203-101500"
    assert run_name("GRPO").startswith("grpo-20")


def test_other_settings_keep_a_switch_that_is_off_off():
    both = METHODS["GRPO+AR+Lopti"].with_settings(0.1, 0.4)
    assert (both.ar_alpha, both.lopti_eta) == (0.1, 0.4)
    grpo = METHODS["GRPO"].with_settings(0.1, 0.4)
    assert (grpo.ar_alpha, grpo.lopti_eta) == (None, None)


def test_bad_methods_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown method 'PPO'"):
        method_of("PPO")
    with pytest.raises(ValueError, match=r"Method\.ar_alpha"):
        Method("x", ar_alpha=1.5)
    with pytest.raises(ValueError, match=r"Method\.lopti_eta"):
        Method("x", lopti_eta=1.0)
    with pytest.raises(ValueError, match=r"Method\.lopti_order"):
        Method("x", lopti_order="middle")
