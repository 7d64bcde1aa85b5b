"""The confirmatory study's primary analysis (``studies.stats``, ``studies.primary``), against hand-worked numbers,
closed forms and R's published power.t.test values, and on the exploratory study's bundled records."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from lopti_lab.studies.primary import (
    PRIMARY_STEPS,
    PRIOR_SD,
    last_mean,
    pooled_paired_sd,
    power_table,
    primary_markdown,
    primary_table,
)
from lopti_lab.studies.stats import detectable_effect, holm, nct_sf, paired_t, t_power, t_quantile, t_sf

HARD_LAB = Path(__file__).resolve().parents[1] / "data" / "hard_lab" / "curves_sample.csv"


def test_paired_t_by_hand():
    """diffs [1, 2, 3]: mean 2, sd 1, se 1/sqrt(3), t = 2 sqrt(3); Student's t on 2 degrees of freedom has the
    closed-form CDF 1/2 + t / (2 sqrt(2 + t^2)), so p = 2 (1 - F(t)) = 1 - 2 sqrt(3) / sqrt(14) = 0.074180; the
    interval's half-width is t(0.975, 2) / sqrt(3) = 4.302653 / 1.732051 = 2.484138."""
    r = paired_t([1.0, 2.0, 3.0])
    assert (r["n"], r["mean"], r["sd"]) == (3, 2.0, 1.0)
    assert r["t"] == pytest.approx(2 * math.sqrt(3), rel=1e-12)
    assert r["p"] == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(14), abs=1e-9)
    assert r["half"] == pytest.approx(4.302653 / math.sqrt(3), abs=1e-6)
    assert (r["low"], r["high"]) == pytest.approx((2 - r["half"], 2 + r["half"]))
    assert (r["above"], r["level"], r["below"]) == (3, 0, 0)
    counts = paired_t([0.1, 0.0, -0.2, 0.05])
    assert (counts["above"], counts["level"], counts["below"]) == (2, 1, 1)
    assert paired_t([-1.0, -2.0, -3.0])["p"] == pytest.approx(r["p"])  # two-sided: the sign does not matter
    with pytest.raises(ValueError, match="at least 2"):
        paired_t([0.1])


def test_t_tails_match_closed_forms():
    """df 1 is the Cauchy: P(T > 1) = 1/4; df 2: P(T > t) = 1/2 - t / (2 sqrt(2 + t^2))."""
    assert t_sf(1.0, 1) == pytest.approx(0.25, abs=1e-9)
    for t in (0.5, 2.0, 6.0):
        assert t_sf(t, 2) == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), abs=1e-9)
    assert t_sf(-2.0, 2) == pytest.approx(1 - t_sf(2.0, 2), abs=1e-12)


def test_holm_by_hand():
    """p = (0.01, 0.04, 0.03): sorted 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (never below the
    previous step), back in the given order: (0.03, 0.06, 0.06); capped at 1."""
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])
    assert holm([0.02]) == pytest.approx([0.02])
    assert holm([0.001, 0.02, 0.04]) == pytest.approx([0.003, 0.04, 0.04])


def test_noncentral_t_matches_r_power_t_test():
    """R's `power.t.test(n = 20, delta = 1)` (two samples, sd 1, two-sided 0.05) is 0.8689528: df 38, ncp =
    1 / sqrt(2 / 20), its upper tail beyond t(0.975, 38). ncp 0 is the central t."""
    assert nct_sf(t_quantile(0.975, 38), 38, 1 / math.sqrt(2 / 20)) == pytest.approx(0.8689528, abs=2e-7)
    for df in (1, 4, 9):
        assert nct_sf(1.5, df, 0.0) == pytest.approx(t_sf(1.5, df), abs=1e-8)


def test_detectable_effect_is_where_power_reaches_80_percent():
    """At the returned effect the power is 0.8; it lies a little above the normal-quantile approximation
    (t(1 - alpha/2) + t(0.8)) x sd / sqrt(n) and shrinks as 1/sqrt(n); at alpha 0.05 the power is ~alpha at 0."""
    for sd, n, alpha in ((0.046, 10, 0.05 / 3), (0.046, 5, 0.05), (0.02, 10, 0.05)):
        effect = detectable_effect(sd, n, alpha)
        assert t_power(effect, sd, n, alpha) == pytest.approx(0.8, abs=1e-5)
        approx = (t_quantile(1 - alpha / 2, n - 1) + t_quantile(0.8, n - 1)) * sd / math.sqrt(n)
        assert approx < effect < 1.1 * approx
    assert t_power(0.0, 0.05, 10, 0.05) == pytest.approx(0.05, abs=1e-6)
    assert detectable_effect(0.046, 10, 0.05 / 3) == pytest.approx(0.0563, abs=5e-4)  # the pre-registration's 5.6


def _curves(diffs_by_method: dict[str, list[float]], grpo: float = 0.5) -> pd.DataFrame:
    """Curves where each method's per-seed last-3 mean differs from GRPO's by the given amounts (the three steps
    spread around it so that only the mean matters), at 2 and 3 people alike."""
    rows = []
    for seed in range(len(next(iter(diffs_by_method.values())))):
        for model, diff in [("+ GRPO", 0.0), *[(m, d[seed]) for m, d in diffs_by_method.items()]]:
            for step, wiggle in zip(PRIMARY_STEPS, (-0.02, 0.0, 0.02), strict=True):
                value = grpo + diff + wiggle
                rows.append({"model": model, "seed": seed, "step": step, "2ppl": value, "3ppl": value})
            rows.append({"model": model, "seed": seed, "step": 30, "2ppl": 0.0, "3ppl": 0.0})  # not in the measure
    return pd.DataFrame(rows)


def test_primary_table_by_hand():
    """Lopti +1, +2, +3 points and AR -1, -2, -3: each comparison is paired_t of those, Holm over the three."""
    curves = _curves({"+ GRPO + Lopti": [0.01, 0.02, 0.03], "+ GRPO + AR": [-0.01, -0.02, -0.03]})
    table = primary_table(curves)
    assert list(zip(table["method"], table["column"], strict=True)) == [
        ("GRPO+Lopti", "3ppl"), ("GRPO+AR", "3ppl"), ("GRPO+Lopti", "2ppl")
    ]  # fmt: skip
    p = 1 - 2 * math.sqrt(3) / math.sqrt(14)  # test_paired_t_by_hand's, the scale does not change t
    assert table["mean"].tolist() == pytest.approx([0.02, -0.02, 0.02])
    assert table["p"].tolist() == pytest.approx([p] * 3, abs=1e-9)
    assert table["p_holm"].tolist() == pytest.approx([min(1, 3 * p)] * 3, abs=1e-9)
    assert not table["holm_reject"].any()
    assert table["detectable"].tolist() == pytest.approx([detectable_effect(0.01, 3, 0.05 / 3)] * 3, rel=1e-6)
    assert table.loc[2, "detectable_prior"] == pytest.approx(detectable_effect(PRIOR_SD["2ppl"], 3, 0.05 / 3))
    assert "+2.0 ± 2.5" in primary_markdown(table)


def test_a_run_without_a_primary_step_is_refused():
    curves = _curves({"+ GRPO + Lopti": [0.01, 0.02], "+ GRPO + AR": [0.0, 0.01]})
    curves = curves[~((curves["model"] == "+ GRPO + AR") & (curves["seed"] == 1) & (curves["step"] == 50))]
    with pytest.raises(ValueError, match=r"GRPO \+ AR seed 1: .* missing \[50\]"):
        last_mean(curves)


@pytest.mark.skipif(not HARD_LAB.is_file(), reason="needs the bundled exploratory study")
def test_the_exploratory_study_under_the_confirmatory_analysis():
    """The exploratory study (5 seeds, data/hard_lab) through the confirmatory analysis: the pooled paired SD that
    the pre-registration's power table starts from, and its two uncorrected leads, which Holm's correction does not
    keep (docs/hard_lab.md)."""
    curves = pd.read_csv(HARD_LAB)
    assert pooled_paired_sd(curves, "3ppl") == pytest.approx(PRIOR_SD["3ppl"], abs=5e-4)
    assert pooled_paired_sd(curves, "2ppl") == pytest.approx(PRIOR_SD["2ppl"], abs=5e-4)
    table = primary_table(curves).set_index(["method", "column"])
    ar, lopti2 = table.loc[("GRPO+AR", "3ppl")], table.loc[("GRPO+Lopti", "2ppl")]
    assert (round(ar["mean"], 3), round(ar["half"], 3), round(ar["p"], 3)) == (-0.054, 0.051, 0.041)
    assert (round(lopti2["mean"], 3), round(lopti2["half"], 3), round(lopti2["p"], 3)) == (0.068, 0.061, 0.036)
    assert table["p_holm"].round(3).tolist() == [0.927, 0.108, 0.108] and not table["holm_reject"].any()
    power = power_table().set_index(["sd", "seeds"])
    assert power.loc[(0.046, 5), "detectable_one"] == pytest.approx(0.077, abs=5e-4)  # the "~8 points"
    assert power.loc[(0.046, 10), "detectable_holm"] == pytest.approx(0.056, abs=5e-4)


def test_the_pre_registrations_power_table_is_recomputed():
    """docs/hard_lab.md's power table, cell by cell, from ``power_table`` (points, one decimal)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "hard_lab.md").read_text(encoding="utf-8")
    section = page.split("## Confirmatory study: pre-registration", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| 0.0")]
    assert len(rows) == 5
    power = power_table(sds=(0.056, 0.046, 0.035, 0.025, 0.015), seeds=(5, 10)).set_index(["sd", "seeds"])
    for line in rows:
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        sd = float(cells[0].split()[0])
        expected = [power.loc[(sd, n), col] for n in (5, 10) for col in ("detectable_one", "detectable_holm")]
        assert [float(c) for c in cells[1:]] == [round(100 * e, 1) for e in expected], line
