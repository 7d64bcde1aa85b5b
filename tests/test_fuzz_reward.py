"""The reward fuzz (benchmarks/fuzz_reward.py; the recorded 100,000-completion run is in benchmarks/README.md): its
independent reference agrees with the hand-derived table of test_kk_reward.py, a short fuzz run finds no exception
and no disagreement, and a scorer with a planted bug is caught."""

import sys
from pathlib import Path

import pytest
from test_kk_reward import TRICKY, jack  # noqa: F401 (the fixture)

from lopti_lab.kk import Reward, score

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fuzz_reward

sys.path.pop(0)


@pytest.mark.parametrize(("completion", "expected", "strict_expected", "why"), TRICKY, ids=range(len(TRICKY)))
def test_reference_agrees_with_the_hand_derived_table(jack, completion, expected, strict_expected, why):  # noqa: F811
    assert fuzz_reward.reference_total(completion, jack.names, jack.solution) == expected, why
    assert fuzz_reward.reference_total(completion, jack.names, jack.solution, strict=True) == strict_expected, why


def test_reference_matches_python_regex_semantics_on_lookalikes(jack):  # noqa: F811
    """Logic-RL matches claims under re.IGNORECASE, where the Kelvin sign is a 'k' and a dotless i an 'i', but it
    counts role words in str.lower(), where only the first holds: the reference follows both."""
    right = "(1) Jack is a knight\n(2) Jackson is a knave\n(3) Ella is a knight"
    kelvin = right.replace("knave", "\u212anave")
    dotless = right.replace("Jack is", "Jack \u0131s")
    for text in (kelvin, dotless):
        completion = f"<think> x </think><answer>{text}</answer>"
        for strict in (False, True):
            assert (
                fuzz_reward.reference_total(completion, jack.names, jack.solution, strict)
                == score(completion, jack, strict=strict).total
            )
    assert score(f"<think></think><answer>{kelvin}</answer>", jack).total == 3.0


def test_short_fuzz_finds_nothing():
    result = fuzz_reward.fuzz(n=2000, seed=1, mega_every=400)
    assert result["exceptions"] == 0 and result["not_a_logic_rl_total"] == 0
    assert result["disagreements"] == 0, result["first_disagreements"]
    assert result["megabyte_completions"] == 5 and result["longest_chars"] > 1_000_000
    assert set(result["mutations"]) == {*fuzz_reward.MUTATIONS, "megabyte"}
    for totals in (result["totals_default"], result["totals_strict"]):  # every outcome is exercised
        assert set(totals) == {"3.0", "-0.5", "-1.0", "-3.0"} and min(totals.values()) >= 20


def test_fuzz_catches_a_planted_bug():
    """A scorer that forgets the strict rule's tail check (and one that raises on NUL bytes) is caught."""

    def lax(text, puzzle, strict=False):
        return score(text, puzzle, strict=False)

    assert fuzz_reward.fuzz(n=400, seed=2, mega_every=0, scorer=lax)["disagreements"] > 0

    def fragile(text, puzzle, strict=False):
        if "\x00" in text:
            raise ValueError("NUL")
        return score(text, puzzle, strict=strict)

    assert fuzz_reward.fuzz(n=400, seed=2, mega_every=0, scorer=fragile)["exceptions"] > 0
    assert isinstance(score("", fuzz_reward.puzzles()[0]), Reward)
