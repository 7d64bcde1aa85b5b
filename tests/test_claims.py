"""Every number the README quotes from a bundled record, recomputed from that record with the project's own analysis
functions and compared at the precision the README prints it: a number changed in the README, or in the record,
fails here. The records: data/lab_model/lab_model.json, data/methods/comparison_*.csv, data/hard_lab/*.csv and
data/mechanism/fig3.csv. What the README says about an interval (a fix "separates", "level", "holds 0.5") is checked
against the interval too.

A README sentence is found by its pattern in ``PATTERNS``; when a sentence is reworded, update its pattern here.
Numbers with no bundled record behind them (wall times, settings) are listed in ``UNBACKED``.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pandas as pd
import pytest
from scripts_loader import load_script

from lopti_lab.paths import data_dir
from lopti_lab.studies.curves import GRPO_ROW, WARM, last_evaluations, late_gain, paired_over_steps, seed_bands
from lopti_lab.studies.primary import primary_table
from lopti_lab.studies.stats import holm, paired_t
from lopti_lab.studies.tables import paired_intervals, paired_per_seed, paired_vs_grpo, spread_over_seeds

README = Path(__file__).resolve().parents[1] / "README.md"
agrees = load_script("number_table").agrees  # a printed number against its value, at the precision printed
FIXES = ("+ GRPO + AR", "+ GRPO + Lopti", "+ GRPO + AR + Lopti")
LAB, DEMO, HARD, MECH = (
    "The lab model",
    "The demo's result",
    "The hard lab",
    "The mechanism, measured as the paper measured it",
)

PATTERNS = {
    LAB: {
        "size": r"(\d+\.\d+)M-parameter",
        "accuracy": r"scores (\d\.\d+) / (\d\.\d+) greedy and (\d\.\d+) / (\d\.\d+) sampled",
    },
    DEMO: {
        "gain": r"GRPO gains (\d+) points.*?\((\d\.\d+) -> (\d\.\d+)",
        "paired": r"paired by seed: " + ", ".join([r"([+-]?\d\.\d+) ± (\d\.\d+)"] * 3),
        "greedy": r"solves (\d\.\d+) of the test puzzles greedily",
    },
    HARD: {
        "design": r"x (\d+) seeds for (\d+) steps",
        "gain": r"GRPO gains (\d+) points at 3 people",
        "+ GRPO + Lopti": r"\bLopti ([+-]\d\.\d+) ± (\d\.\d+)",
        "+ GRPO + AR + Lopti": r"\bAR\+Lopti ([+-]\d\.\d+) ± (\d\.\d+)",
        "+ GRPO + AR": r"\bAR ([+-]\d\.\d+) ± (\d\.\d+) \(p (\d\.\d+), Holm (\d\.\d+)",
        "confirm": r"fresh seeds.*?: Lopti ([+-]\d+\.\d) ± (\d+\.\d) points at 3 people, AR ([+-]\d+\.\d) ± "
        r"(\d+\.\d) at 3, Lopti ([+-]\d+\.\d) ± (\d+\.\d) at 2 \(Holm p (\d\.\d+), (\d\.\d+), (\d\.\d+)\)",
        "confirm power": r"could have detected (\d+\.\d)-(\d+\.\d) points",
    },
    MECH: {
        "float64": r"correct ratio reads (\d\.\d+)-(\d\.\d+)",
        "bf16": r"it reads (\d\.\d+) \(AR (\d\.\d+), Lopti (\d\.\d+)\)",
        "hard lab": r"GRPO (\d\.\d+) and the fixes (\d\.\d+)-(\d\.\d+)",
    },
}
"""Per README section, the sentences whose numbers are checked, each a pattern whose groups capture them."""

UNBACKED = {LAB: {"1.0"}, DEMO: set(), HARD: set(), MECH: {"0.5"}}
"""Decimals a checked section may print that no bundled record backs (the sampling temperature T = 1.0, the 0.5
threshold); every other decimal there must be matched by a pattern (run times: tests/test_numbers.py)."""


def section(title: str) -> str:
    """The README section under ``## title``, its lines joined by single spaces (the README wraps at 120)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README.read_text(), re.S | re.M)
    assert match, f"README.md has no section '## {title}'"
    return " ".join(match.group(1).split())


def quoted(title: str, claim: str) -> tuple[str, ...]:
    """The numbers the README section ``title`` prints in ``claim``'s sentence (``PATTERNS[title][claim]``)."""
    match = re.search(PATTERNS[title][claim], section(title))
    assert match, f"README.md, '{title}': no sentence matches {PATTERNS[title][claim]!r} (reworded? update PATTERNS)"
    return match.groups()


def assert_quotes(title: str, claim: str, values) -> None:
    printed = quoted(title, claim)
    values = [float(v) for v in values]
    wrong = [f"{p} (record: {v:.5g})" for p, v in zip(printed, values, strict=True) if not agrees(p, v)]
    assert not wrong, f"README.md, '{title}', {claim}: {', '.join(wrong)}"


# --- the records, through the analysis functions the reports use ----------------------------------------------------


@cache
def methods_comparison(mode: str = "sample") -> pd.DataFrame:
    """The token-credit comparison's accuracy_table frame (docs/methods.md); the demo's four methods are in it."""
    return pd.read_csv(data_dir() / "methods" / f"comparison_{mode}.csv")


@cache
def hard_lab_curves() -> pd.DataFrame:
    return pd.read_csv(data_dir() / "hard_lab" / "curves_sample.csv")


@cache
def hard_lab_primaries() -> pd.DataFrame:
    """Each fix minus GRPO at 3 people, the mean of steps 40-60 paired by seed: mean, ci95 (paired_intervals), the
    paired t-test's p and Holm's adjustment over the three (docs/hard_lab.md, "The primary measure")."""
    diffs = paired_per_seed(last_evaluations(hard_lab_curves(), k=3), ["3ppl"])
    table = paired_intervals(diffs).set_index("model").loc[list(FIXES)]
    table["p"] = [paired_t(diffs.loc[diffs["model"] == model, "diff"])["p"] for model in table.index]
    table["holm"] = holm(table["p"])
    return table


@cache
def confirm_primaries() -> pd.DataFrame:
    """The confirmatory study's pre-registered table (``studies.primary.primary_table``) from its bundled curves
    (data/hard_lab_confirm/, docs/hard_lab.md "Confirmatory study: results"): Lopti 3, AR 3, Lopti 2 people."""
    return primary_table(pd.read_csv(data_dir() / "hard_lab_confirm" / "curves_sample.csv"))


@cache
def fig3() -> pd.DataFrame:
    """The mechanism study's top bin (p > 0.75, quartiles), zeros excluded: mean and ci95 per (optimizer, method,
    precision)."""
    table = pd.read_csv(data_dir() / "mechanism" / "fig3.csv")
    top = table[(table["binning"] == "q") & (table["bin"] == 3) & (table["stat"] == "correct_moved")]
    return top.set_index(["optimizer", "method", "precision"])[["mean", "ci95"]]


@cache
def hard_lab_top_bin() -> pd.Series:
    """The hard lab's float64 Fig. 3 top-bin ratio per method, the mean over its probed steps (mechanism.csv)."""
    table = pd.read_csv(data_dir() / "hard_lab" / "mechanism.csv")
    return table[table["bin"] == 3].groupby("method")["fig3_correct"].mean()


# --- the claims ------------------------------------------------------------------------------------------------------


def test_the_lab_models_size_and_accuracy_are_its_records():
    record = json.loads((data_dir() / "lab_model" / "lab_model.json").read_text())
    final = record["final_eval"]
    assert_quotes(LAB, "size", [record["parameters"] / 1e6])
    assert_quotes(LAB, "accuracy", [final[f"test/{mode}/acc_{n}ppl"] for mode in ("greedy", "sample") for n in (2, 3)])


def test_the_demos_result_is_the_recorded_comparison():
    frame = methods_comparison("sample")
    mean, _ = spread_over_seeds(frame)
    warm, grpo = mean.loc[WARM, "avg"], mean.loc[GRPO_ROW, "avg"]
    assert_quotes(DEMO, "gain", [100 * (grpo - warm), warm, grpo])
    paired = paired_vs_grpo(frame, "avg").loc[list(FIXES)]
    assert_quotes(DEMO, "paired", [x for _, row in paired.iterrows() for x in (row["mean"], row["ci95"])])
    assert "do not separate" in section(DEMO)
    assert ((paired["mean"] - paired["ci95"] < 0) & (paired["mean"] + paired["ci95"] > 0)).all()
    greedy, _ = spread_over_seeds(methods_comparison("greedy"))
    assert_quotes(DEMO, "greedy", [greedy.loc[WARM, "avg"]])


def test_the_hard_labs_study_is_its_recorded_curves():
    curves = hard_lab_curves()
    runs = curves[curves["model"] != WARM]
    assert_quotes(HARD, "design", [runs["seed"].nunique(), runs["step"].max()])
    grpo = seed_bands(curves, ["3ppl"]).query("model == @GRPO_ROW").set_index("step")["mean"]
    assert_quotes(HARD, "gain", [100 * (grpo.iloc[-1] - grpo.loc[0])])
    gains = late_gain(curves)
    assert "still rises" in section(HARD) and gains.loc[gains["model"] == GRPO_ROW, "3ppl"].mean() > 0


def test_the_hard_labs_primaries_and_their_holm_correction():
    table = hard_lab_primaries()
    for model in ("+ GRPO + Lopti", "+ GRPO + AR + Lopti"):
        assert_quotes(HARD, model, table.loc[model, ["mean", "ci95"]])
    assert_quotes(HARD, "+ GRPO + AR", table.loc["+ GRPO + AR", ["mean", "ci95", "p", "holm"]])
    assert "no fix separates" in section(HARD) and (table["holm"] > 0.05).all()
    step60 = paired_over_steps(hard_lab_curves(), ["3ppl"]).query("model == '+ GRPO + AR' and step == 60").iloc[0]
    assert "level at step 60" in section(HARD)
    assert step60["mean"] - step60["ci95"] < 0 < step60["mean"] + step60["ci95"], "AR - GRPO at step 60 holds 0"


def test_the_confirmatory_studys_primaries_are_its_record():
    """Each primary comparison's mean ± 95% interval in points and its Holm-adjusted p, in the pre-registered order,
    the range of their detectable effects, and the verdict's wording by Holm's test."""
    table = confirm_primaries()
    points = [100 * v for r in table.itertuples() for v in (r.mean, r.half)]
    assert_quotes(HARD, "confirm", [*points, *table["p_holm"]])
    assert_quotes(HARD, "confirm power", [100 * table["detectable"].min(), 100 * table["detectable"].max()])
    separated = bool(table["holm_reject"].any())
    assert ("none separates" in section(HARD)) == (not separated), "the confirmatory verdict's wording"


def test_the_mechanisms_fig3_ratios_are_the_recorded_table():
    table = fig3()
    grpo64 = table.xs(("GRPO", "float64"), level=("method", "precision"))["mean"]
    assert_quotes(MECH, "float64", [grpo64.min(), grpo64.max()])
    assert "no fix separating" in section(MECH)
    for (optimizer, method, precision), row in table.iterrows():  # even the 10-draw intervals overlap GRPO's
        grpo = table.loc[(optimizer, "GRPO", precision)]
        if precision == "float64" and method != "GRPO":
            assert abs(row["mean"] - grpo["mean"]) < row["ci95"] + grpo["ci95"], (optimizer, method)
    bf16 = table.xs(("sgd", "bfloat16"), level=("optimizer", "precision")).loc[["GRPO", "GRPO+AR", "GRPO+Lopti"]]
    assert_quotes(MECH, "bf16", bf16["mean"])
    assert "intervals that hold 0.5" in section(MECH)
    assert ((bf16["mean"] - bf16["ci95"] <= 0.5) & (bf16["mean"] + bf16["ci95"] >= 0.5)).all()


def test_the_hard_labs_top_bin_ratio_is_its_mechanism_table():
    ratio = hard_lab_top_bin()
    fixes = ratio.drop("GRPO")
    assert_quotes(MECH, "hard lab", [ratio["GRPO"], fixes.min(), fixes.max()])
    assert "the reverse of the paper" in section(MECH) and (fixes < ratio["GRPO"]).all()


@pytest.mark.parametrize("title", PATTERNS)
def test_every_decimal_in_a_checked_section_is_checked(title):
    """A decimal added to one of these sections needs a pattern in PATTERNS and a check above (or an entry in
    UNBACKED, with its reason)."""
    checked = {n.lstrip("+-") for claim in PATTERNS[title] for n in quoted(title, claim)}
    prose = re.sub(r"`[^`]*`|\]\([^)]*\)", " ", section(title))  # code and link targets are not claims
    unchecked = set(re.findall(r"\d+\.\d+", prose)) - checked - UNBACKED[title]
    assert not unchecked, f"README.md, '{title}': numbers no test checks: {sorted(unchecked)}"


def test_the_first_pictures_caption_is_its_figures_record():
    """The README's first picture (scripts/readme_figure.py): its caption's shares are the hard lab's recorded ones."""
    table = load_script("readme_figure").shares("GRPO")
    text = " ".join(README.read_text().split())
    caption = (
        r"p < 0\.25 are (\d+)% of the response and carry (\d+)% of the gradient; the (\d+)% at p >= 0\.75 carry (\d+)%"
    )
    match = re.search(caption, text)
    assert match, "README.md: the first picture's caption was reworded (update this pattern)"
    low, top = table.iloc[0], table.iloc[-1]
    values = [100 * low["token_share"], 100 * low["grad_share"], 100 * top["token_share"], 100 * top["grad_share"]]
    wrong = [(p, v) for p, v in zip(match.groups(), values, strict=True) if not agrees(p, v)]
    assert not wrong, f"README.md, the first picture's caption: {wrong}"
    assert "readme_gradient_share.png" in text and (README.parent / "docs" / "readme_gradient_share.png").exists()
