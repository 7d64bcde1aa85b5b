"""integrations/verl.py: verl's compute_score scores our parquet export and Logic-RL's file exactly as
kk.score_response does, and reads the ground truth it is given (no access to anything else)."""

import inspect

import pandas as pd
import pytest

from lopti_lab.integrations.verl import compute_score, compute_score_breakdown, puzzle_from_ground_truth
from lopti_lab.kk import export_parquet, generate_puzzle, read_parquet, score_response


def flipped(solution_text_format: str) -> str:
    """Every knight a knave and every knave a knight."""
    return solution_text_format.replace("knight", "kn@ve").replace("knave", "knight").replace("kn@ve", "knave")


def responses_for(puzzle) -> list[str]:
    """One response per outcome: right, wrong, unparseable, no answer, bad format, and verl's decoding details."""
    right = puzzle.solution_text_format
    wrong = flipped(right)
    return [
        f" Let me think. </think><answer> {right} </answer>",
        f" Let me think. </think><answer> {wrong} </answer>",
        f" Let me think. </think><answer> {right.splitlines()[0]} </answer>",  # too few roles
        " Let me think. </think><answer></answer>",
        f" Let me think. <answer> {right} </answer>",  # no </think>
        f"<think> again </think><answer> {right} </answer>",  # a second <think>: bad format
        f" ok </think><answer> {right} </answer><|im_end|>",  # special token kept by the decoder
    ]


def rows_of(path):
    frame = pd.read_parquet(path)
    return list(zip(read_parquet(path), frame.to_dict("records"), strict=True))


@pytest.fixture()
def our_export(tmp_path):
    puzzles = [generate_puzzle(n, seed=n) for n in (2, 3, 5, 8)]
    return export_parquet(puzzles, tmp_path / "train.parquet")


def check_file(path):
    totals = set()
    for puzzle, row in rows_of(path):
        ground_truth = row["reward_model"]["ground_truth"]
        for response in responses_for(puzzle):
            expected = score_response(response, puzzle)
            got = compute_score(row["data_source"], response, ground_truth, row["extra_info"])
            assert got == expected.total, (response, got, expected)
            breakdown = compute_score_breakdown(row["data_source"], response, ground_truth)
            assert breakdown == {
                "score": expected.total,
                "format": expected.format_score,
                "answer": expected.answer_score,
                "acc": float(expected.correct),
            }
            totals.add(got)
    assert totals == {3.0, -0.5, -1.0, -3.0}  # every outcome was exercised


def test_compute_score_matches_score_response_on_our_export(our_export):
    check_file(our_export)


def test_compute_score_matches_score_response_on_the_logic_rl_file(reference_kk):
    path = reference_kk / "logic_rl_3ppl_test.parquet"
    check_file(path)
    assert len(rows_of(path)) == 100


def test_ground_truth_gives_back_the_puzzle(our_export):
    for puzzle, row in rows_of(our_export):
        found = puzzle_from_ground_truth(dict(row["reward_model"]["ground_truth"]))
        assert found.names == puzzle.names and found.solution == puzzle.solution


def test_signature_is_verls_and_bad_ground_truth_is_named():
    assert list(inspect.signature(compute_score).parameters) == [
        "data_source", "solution_str", "ground_truth", "extra_info",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="solution_text_format and statements"):
        compute_score("kk_logic", "x", {"answer": "?"})
    p = generate_puzzle(2, seed=0)
    bad = {"solution_text_format": "(1) Zoey is a wizard", "statements": repr(p.statements)}
    with pytest.raises(ValueError, match="line 1"):
        compute_score("kk_logic", "x", bad)
    wrong = {"solution_text_format": flipped(p.solution_text_format), "statements": repr(p.statements)}
    with pytest.raises(ValueError, match="solution"):  # not the statements' unique solution
        compute_score("kk_logic", "x", wrong)
