"""The solver against the real K&K records and against a naive evaluator; statement parsing and its errors."""

from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kk_fixtures import reference_records

from lopti_lab.kk import Puzzle, evaluate, parse_statements, solve, solver_trace
from lopti_lab.kk.logic import count_solutions, mentioned


@pytest.fixture(scope="module")
def records(reference_kk):
    return reference_records()


def test_solver_agrees_with_every_reference_record(records):
    assert len(records) == 700
    per_people = {}
    for r in records:
        statements = parse_statements(r["statements"])
        solutions = solve(statements, len(r["names"]))
        assert solutions == [tuple(r["solution"])], r["index"]
        per_people[len(r["names"])] = per_people.get(len(r["names"]), 0) + 1
    assert per_people == {n: 100 for n in range(2, 9)}


def naive_solve(statements, n):
    """Try every assignment with the recursive evaluator, in the same order as solve (person 0 = lowest bit)."""
    out = []
    for a in range(1 << n):
        knights = tuple(bool(a >> i & 1) for i in range(n))
        if all(evaluate(s, knights) == knights[i] for i, s in enumerate(statements)):
            out.append(knights)
    return out


@st.composite
def statement_sets(draw, max_people=6):
    n = draw(st.integers(2, max_people))
    leaf = st.tuples(st.sampled_from(["telling-truth", "lying"]), st.integers(0, n - 1))
    tree = st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.tuples(st.just("not"), kids),
            st.tuples(st.sampled_from(["and", "or"]), kids, kids),
            st.tuples(st.sampled_from(["and", "or"]), kids, kids, kids),
            st.tuples(st.sampled_from(["->", "<=>"]), kids, kids),
        ),
        max_leaves=4,
    )
    return n, tuple(draw(tree) for _ in range(n))


@given(statement_sets())
@settings(max_examples=300, deadline=None)
def test_bitset_solver_equals_naive_enumeration(case):
    n, statements = case
    assert solve(statements, n) == naive_solve(statements, n)
    assert count_solutions(statements, n) == len(naive_solve(statements, n))


def test_evaluate_truth_tables():
    a, b = ("telling-truth", 0), ("telling-truth", 1)
    for x, y in product([True, False], repeat=2):
        k = (x, y)
        assert evaluate(("and", a, b), k) == (x and y)
        assert evaluate(("or", a, b), k) == (x or y)
        assert evaluate(("->", a, b), k) == ((not x) or y)
        assert evaluate(("<=>", a, b), k) == (x == y)
        assert evaluate(("not", a), k) == (not x)
        assert evaluate(("lying", 1), k) == (not y)


def test_hand_solved_puzzles():
    # A: "B is a knave"; B: "A and I are both knights". A knight -> B knave -> B's claim false (A knight, B knave:
    # false) ok. A knave -> B knight -> B's claim "A knight and B knight" must be true, but A is a knave: no.
    statements = (("lying", 1), ("and", ("telling-truth", 0), ("telling-truth", 1)))
    assert solve(statements, 2) == [(True, False)]
    # "B is a knave" / "A is a knave": the two always disagree, two solutions.
    assert solve((("lying", 1), ("lying", 0)), 2) == [(True, False), (False, True)]
    # A: "I am a knight" holds for either role of A; B: "A is a knight" makes B's role equal A's: two solutions.
    assert solve((("telling-truth", 0), ("telling-truth", 0)), 2) == [(False, False), (True, True)]


def test_mentioned_keeps_order_of_first_mention():
    assert mentioned(("or", ("lying", 3), ("telling-truth", 1))) == [3, 1]
    assert mentioned(("<=>", ("lying", 2), ("telling-truth", 2))) == [2]


def test_trace_reaches_the_unique_solution(records):
    for r in records[::7]:
        statements = parse_statements(r["statements"])
        steps, found = solver_trace(statements)
        assert found == tuple(r["solution"])
        assert steps[-1].kind == "assume"


def test_trace_reports_failure_on_unsolvable():
    steps, found = solver_trace((("lying", 1), ("telling-truth", 0)))
    assert found is None and steps[-1].kind == "fail"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("(('lying', 2),)", "person index 2"),
        ("(('maybe', 0), ('lying', 0))", "unknown operator"),
        ("(('->', ('lying', 0)), ('lying', 0))", "operands"),
        ("__import__('os').system('echo hi')", "not a Python literal"),
        ("(('lying', 0), ('lying', 1)", "not a Python literal"),
        ("42", "tuple of statement tuples"),
        ("(('lying', 'x'), ('lying', 0))", "person index"),
        ("()", "tuple of statement tuples"),
    ],
)
def test_malformed_statements_raise_valueerror_naming_the_problem(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_statements(text, 1 if text.startswith("(('lying', 2)") else None)


def test_statement_count_must_match_people():
    with pytest.raises(ValueError, match="2 statements for 3 people"):
        parse_statements("(('lying', 1), ('lying', 0))", 3)


def test_puzzle_rejects_inconsistent_record(records):
    r = dict(records[0])
    r["solution"] = [not s for s in r["solution"]]
    with pytest.raises(ValueError, match="solution"):
        Puzzle.from_record(r)
