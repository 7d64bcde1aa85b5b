"""The generator: unique solutions, determinism, and the K&K dataset's exact wording and chain of thought."""

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kk_fixtures import reference_records

from lopti_lab.kk import NAMES, TEMPLATES, Puzzle, generate_puzzle, render_cot, render_statement, solve, solver_trace
from lopti_lab.kk.generate import CLOSING, OPENING, join_names


@pytest.fixture(scope="module")
def records(reference_kk):
    return reference_records()


def split_quiz(quiz: str, names, statements) -> list[int]:
    """Recover the template index of each person's sentence, asserting the quiz has exactly the dataset's shape:
    the opening, one templated sentence per person in order, the closing."""
    opening = OPENING.format(n=len(names), names=join_names(names, pair=", and ")) + " "
    assert quiz.startswith(opening), quiz[:200]
    assert quiz.endswith(" " + CLOSING)
    rest = quiz[len(opening) : -len(CLOSING) - 1]
    chosen = []
    for name, statement in zip(names, statements, strict=True):
        content = render_statement(statement, names)
        candidates = [t for t, tpl in enumerate(TEMPLATES) if rest.startswith(tpl.format(name=name, content=content))]
        assert candidates, f"no template matches {rest[:120]!r}"
        t = candidates[0]
        rest = rest[len(TEMPLATES[t].format(name=name, content=content)) :].removeprefix(" ")
        chosen.append(t)
    assert rest == ""
    return chosen


def test_reference_quizzes_have_exactly_our_sentence_shapes(records):
    used_templates, used_names = set(), set()
    for r in records:
        p = Puzzle.from_record(r)
        used_templates.update(split_quiz(p.quiz, p.names, p.statements))
        used_names.update(p.names)
    assert used_templates == set(range(18)), "every one of the 18 templates occurs in the real data"
    assert used_names == set(NAMES) and len(NAMES) == 51


def test_reference_chain_of_thought_is_reproduced_exactly(records):
    for r in records:
        p = Puzzle.from_record(r)
        steps, found = solver_trace(p.statements)
        assert render_cot(steps, p.names, p.statements) == r["cot_repeat_steps"], r["index"]
        assert found == p.solution


def test_records_round_trip_unchanged(records):
    for r in records:
        p = Puzzle.from_record(r)
        assert p.to_record() == r
        assert Puzzle.from_record(p.to_record()) == p


@given(n=st.integers(2, 8), seed=st.integers(0, 2**32))
@settings(max_examples=120, deadline=None)
def test_generated_puzzles_have_one_solution_and_the_dataset_shape(n, seed):
    p = generate_puzzle(n, seed)
    assert solve(p.statements, n) == [p.solution]
    assert len(set(p.statements)) == n, "no two people say the same thing"
    assert len(set(p.names)) == n and set(p.names) <= set(NAMES)
    split_quiz(p.quiz, p.names, p.statements)
    assert Puzzle.from_record(p.to_record()) == p
    for i, s in enumerate(p.statements):  # nobody calls themselves a knave, as in the dataset
        assert ("lying", i) not in (s, *s[1:])


def test_generation_is_deterministic_per_seed():
    assert generate_puzzle(5, 123) == generate_puzzle(5, 123)
    assert generate_puzzle(5, 123).quiz != generate_puzzle(5, 124).quiz


def test_statement_kinds_are_balanced_like_the_dataset():
    kinds = {}
    for seed in range(300):
        for s in generate_puzzle(4, seed).statements:
            key = "leaf" if s[0] in ("telling-truth", "lying") else s[0]
            kinds[key] = kinds.get(key, 0) + 1
    assert set(kinds) == {"leaf", "not", "and", "or", "->", "<=>"}
    assert max(kinds.values()) < 2 * min(kinds.values())


def test_compact_trace_is_short_and_follows_the_search():
    p = generate_puzzle(4, 7)
    compact = p.compact_trace()
    assert compact.count(" ok ") + compact.endswith(" ok .") >= 4
    assert len(compact.split()) < sum(len(s.split()) for s in p.cot_repeat_steps) / 3
    assert re.fullmatch(r"([A-Z][a-z]+ (knight|knave) (ok|no [A-Z][a-z]+)|back [A-Z][a-z]+)( \. .*)? \.", compact)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"n_people": 1}, "n_people"),
        ({"n_people": 52}, "n_people"),
        ({"n_people": 3.0}, "n_people"),
        ({"n_people": 3, "depth": 3}, "depth"),
        ({"n_people": 3, "width": 1}, "width"),
    ],
)
def test_bad_generator_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        generate_puzzle(seed=0, **kwargs)


def test_record_missing_fields_is_named():
    record = generate_puzzle(3, 0).to_record()
    del record["statements"], record["solution"]
    with pytest.raises(ValueError, match=r"missing fields: \['solution', 'statements'\]"):
        Puzzle.from_record(record)


def test_puzzle_field_mismatch_is_named():
    p = generate_puzzle(3, 0)
    with pytest.raises(ValueError, match="n_people=3 but 2 names"):
        Puzzle(p.quiz, p.names[:2], p.statements, p.solution, 3)


def test_thousand_eight_people_puzzles_are_fast():
    start = time.perf_counter()
    for seed in range(200):
        generate_puzzle(8, seed)
    assert time.perf_counter() - start < 5  # 1,000 take about 0.5 s here: benchmarks/bench_kk.py
