"""Knights-and-Knaves logic: statement trees, truth evaluation, the brute-force solver and the solver's trace.

A statement is a nested tuple, exactly the K&K dataset's ``statements`` field once parsed:

    ('telling-truth', i)       person i is a knight
    ('lying', i)               person i is a knave
    ('not', s)                 negation
    ('and', s1, s2, ...)       conjunction (two or more children)
    ('or', s1, s2, ...)        disjunction (two or more children)
    ('->', a, b)               implication
    ('<=>', a, b)              equivalence

An assignment is a tuple of bools, True = knight. Person i's statement must be true if i is a knight and false if i
is a knave, so a solution is an assignment with ``knight[i] == evaluate(statements[i], knight)`` for every i.

Example: statements = (('lying', 1), ('telling-truth', 0)) ("B is a knave", said by A; "A is a knight", said by B).
A knight -> B knave -> B's claim "A is a knight" must be false: contradiction. A knave -> B knight -> B's claim must
be true: contradiction. So ``solve(statements, 2) == []``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import product

Statement = tuple
LEAVES = ("telling-truth", "lying")
OPERATORS = {"not": (1, 1), "and": (2, None), "or": (2, None), "->": (2, 2), "<=>": (2, 2)}


# ----------------------------------------------------------------------------------------------------------------------
# parsing and validation


def validate_statement(statement: object, n_people: int, where: str = "statement") -> Statement:
    """Check that ``statement`` is a well-formed tree over persons 0..n_people-1; return it, or raise ValueError."""
    if not isinstance(statement, tuple) or not statement:
        raise ValueError(f"{where}: expected a non-empty tuple, got {statement!r}")
    op, args = statement[0], statement[1:]
    if op in LEAVES:
        if len(args) != 1 or not isinstance(args[0], int) or isinstance(args[0], bool):
            raise ValueError(f"{where}: leaf {op!r} takes one person index, got {args!r}")
        if not 0 <= args[0] < n_people:
            raise ValueError(f"{where}: person index {args[0]} outside 0..{n_people - 1}")
        return statement
    if op not in OPERATORS:
        raise ValueError(f"{where}: unknown operator {op!r}; expected one of {[*LEAVES, *OPERATORS]}")
    lo, hi = OPERATORS[op]
    if len(args) < lo or (hi is not None and len(args) > hi):
        expected = lo if lo == hi else f"at least {lo}"
        raise ValueError(f"{where}: operator {op!r} takes {expected} operands, got {len(args)}")
    for k, child in enumerate(args):
        validate_statement(child, n_people, f"{where}[{k + 1}]")
    return statement


def parse_statements(text: str | Sequence, n_people: int | None = None) -> tuple[Statement, ...]:
    """Parse the dataset's ``statements`` field (a Python repr) without eval, and validate it.

    >>> parse_statements("(('lying', 1), ('not', ('telling-truth', 0)))")
    (('lying', 1), ('not', ('telling-truth', 0)))

    ``ast.literal_eval`` only accepts literals (no names, calls or attribute access), so a malicious string cannot run
    code; lists are accepted and turned into tuples (JSON round trips produce lists).
    """
    if isinstance(text, str):
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as err:
            problem = f"{type(err).__name__}: " + re.sub(r" object at 0x[0-9a-f]+", "", str(err))  # no addresses
            raise ValueError(f"statements: not a Python literal ({problem}): {text[:120]!r}") from None
    else:
        value = text
    value = _as_tuple(value)
    if not isinstance(value, tuple) or not value or not all(isinstance(s, tuple) for s in value):
        raise ValueError(f"statements: expected a tuple of statement tuples, got {str(text)[:120]!r}")
    n = len(value) if n_people is None else n_people
    if len(value) != n:
        raise ValueError(f"statements: {len(value)} statements for {n} people")
    return tuple(validate_statement(s, n, f"statements[{i}]") for i, s in enumerate(value))


def _as_tuple(value):
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(v) for v in value)
    return value


# ----------------------------------------------------------------------------------------------------------------------
# evaluation


def evaluate(statement: Statement, knights: Sequence[bool]) -> bool:
    """Truth value of ``statement`` when ``knights[i]`` says whether person i is a knight.

    >>> evaluate(('->', ('lying', 0), ('telling-truth', 1)), (True, False))   # A is a knight, so the 'if' is vacuous
    True
    """
    op = statement[0]
    if op == "telling-truth":
        return bool(knights[statement[1]])
    if op == "lying":
        return not knights[statement[1]]
    if op == "not":
        return not evaluate(statement[1], knights)
    if op == "and":
        return all(evaluate(s, knights) for s in statement[1:])
    if op == "or":
        return any(evaluate(s, knights) for s in statement[1:])
    if op == "->":
        return (not evaluate(statement[1], knights)) or evaluate(statement[2], knights)
    if op == "<=>":
        return evaluate(statement[1], knights) == evaluate(statement[2], knights)
    raise ValueError(f"unknown operator {op!r}")


def mentioned(statement: Statement) -> list[int]:
    """Persons named in a statement, in order of first mention: ('or', ('lying', 3), ('lying', 1)) -> [3, 1]."""
    if statement[0] in LEAVES:
        return [statement[1]]
    out: list[int] = []
    for child in statement[1:]:
        out += [p for p in mentioned(child) if p not in out]
    return out


MAX_SOLVER_PEOPLE = 20
"""The brute-force solver holds 2^n assignments as the bits of one integer: 20 people are 128 KiB, 40 would be
128 GiB. The K&K dataset has 2-8 people."""


def _check_solvable(statements: Sequence[Statement], n_people: int) -> None:
    if not 1 <= n_people <= MAX_SOLVER_PEOPLE or len(statements) != n_people:
        raise ValueError(
            f"solve: {len(statements)} statements for n_people={n_people} (the solver takes 1..{MAX_SOLVER_PEOPLE})"
        )


def contradiction(statements: Sequence[Statement], solution: Sequence[bool]) -> int | None:
    """The first person whose role the assignment ``solution`` contradicts (a knight whose statement is false, or a
    knave whose statement is true), or None when ``solution`` is consistent with every statement.

    >>> contradiction((('lying', 1), ('telling-truth', 0)), (True, True))   # A says B is a knave, but B is a knight
    0
    """
    return next((i for i, s in enumerate(statements) if evaluate(s, solution) != bool(solution[i])), None)


@lru_cache(maxsize=16)
def _knight_masks(n_people: int) -> tuple[int, ...]:
    # Bit a of mask i is set when person i is a knight in assignment a (bit i of the integer a).
    return tuple(sum(1 << a for a in range(1 << n_people) if a >> i & 1) for i in range(n_people))


def _truth_mask(statement: Statement, knight: tuple[int, ...], full: int) -> int:
    """The set of assignments (as a 2^n-bit integer) in which ``statement`` is true: the solver's inner loop."""
    op = statement[0]
    if op == "telling-truth":
        return knight[statement[1]]
    if op == "lying":
        return full ^ knight[statement[1]]
    if op == "not":
        return full ^ _truth_mask(statement[1], knight, full)
    children = [_truth_mask(s, knight, full) for s in statement[1:]]
    if op == "and":
        out = full
        for c in children:
            out &= c
        return out
    if op == "or":
        out = 0
        for c in children:
            out |= c
        return out
    if op == "->":
        return (full ^ children[0]) | children[1]
    if op == "<=>":
        return full ^ (children[0] ^ children[1])
    raise ValueError(f"unknown operator {op!r}")


def solve(statements: Sequence[Statement], n_people: int) -> list[tuple[bool, ...]]:
    """Every knight/knave assignment consistent with all statements (True = knight), by brute force over 2^n.

    All 2^n assignments are evaluated at once as bits of one Python integer, so an 8-person puzzle costs a few dozen
    big-integer operations. Solutions come in increasing order of the assignment's integer code (person 0 = bit 0).

    >>> solve((('lying', 1), ('telling-truth', 1)), 2)   # A: "B is a knave"; B: "B is a knight"
    [(True, False), (False, True)]
    """
    _check_solvable(statements, n_people)
    knight = _knight_masks(n_people)
    full = (1 << (1 << n_people)) - 1
    consistent = full
    for i, statement in enumerate(statements):
        # person i is consistent where (i is a knight) == (statement i is true)
        consistent &= full ^ (knight[i] ^ _truth_mask(statement, knight, full))
        if not consistent:
            return []
    return [tuple(bool(a >> i & 1) for i in range(n_people)) for a in range(1 << n_people) if consistent >> a & 1]


def count_solutions(statements: Sequence[Statement], n_people: int) -> int:
    _check_solvable(statements, n_people)
    knight = _knight_masks(n_people)
    full = (1 << (1 << n_people)) - 1
    consistent = full
    for i, statement in enumerate(statements):
        consistent &= full ^ (knight[i] ^ _truth_mask(statement, knight, full))
    return consistent.bit_count()


# ----------------------------------------------------------------------------------------------------------------------
# the solver's trace: depth-first search with the dataset's person order, recorded step by step


@dataclass(frozen=True)
class TraceStep:
    """One step of the depth-first solver.

    kind: "assume" (person takes ``role`` with no contradiction), "conflict" (``role`` for person contradicts the
    statement of ``speaker``, whose own role is ``speaker_role``), "backtrack" (every role of ``exhausted`` failed;
    go back to ``person``) or "fail" (no solution).
    """

    kind: str
    person: int = -1
    role: bool = True
    speaker: int = -1
    speaker_role: bool = True
    exhausted: tuple[int, ...] = ()


def _determined(statement: Statement, assignment: Sequence[bool | None]) -> bool | None:
    """The statement's truth value if it is the same whatever the unassigned persons are, else None."""
    free = [p for p in mentioned(statement) if assignment[p] is None]
    values = set()
    for combo in product((True, False), repeat=len(free)):
        knights = list(assignment)
        for p, v in zip(free, combo, strict=True):
            knights[p] = v
        values.add(evaluate(statement, knights))
        if len(values) > 1:
            return None
    return values.pop()


def _first_conflict(statements, assignment) -> int | None:
    """The first speaker whose statement the current partial assignment contradicts, or None.

    A statement contradicts when its speaker is assigned and its truth value is already determined and differs from
    the speaker's role. Speakers are checked in index order (the dataset cites the first one that contradicts).
    """
    for speaker in range(len(statements)):
        if assignment[speaker] is None:
            continue
        value = _determined(statements[speaker], assignment)
        if value is not None and value != assignment[speaker]:
            return speaker
    return None


def solver_trace(statements: Sequence[Statement]) -> tuple[list[TraceStep], tuple[bool, ...] | None]:
    """Depth-first search that tries knight before knave, as a list of steps, and the solution it finds (or None).

    Person order (the K&K dataset's): start with person 0; after a person is assumed without contradiction, the
    still-unassigned persons that their statement mentions move to the front of the queue, in order of mention.
    On backtracking, each level keeps the queue it had.

    Example, statements (('lying', 1), ('lying', 0)) (A: "B is a knave", B: "A is a knave"): assume A knight; B knight
    contradicts A's claim; assume B knave -> solution (True, False) after 3 steps.
    """
    n = len(statements)
    assignment: list[bool | None] = [None] * n
    steps: list[TraceStep] = []
    # stack of levels: (queue of persons still to assign at this level, roles left to try for queue[0])
    levels: list[tuple[list[int], list[bool]]] = [(list(range(n)), [False, True])]
    while True:
        queue, roles = levels[-1]
        person = queue[0]
        if not roles:  # every role of this person failed: backtrack
            exhausted = []
            while levels and not levels[-1][1]:
                p = levels.pop()[0][0]
                assignment[p] = None
                exhausted.append(p)
            if not levels:
                steps.append(TraceStep("fail", exhausted=tuple(exhausted)))
                return steps, None
            steps.append(TraceStep("backtrack", person=levels[-1][0][0], exhausted=tuple(exhausted)))
            continue
        role = roles.pop()  # True (knight) first
        assignment[person] = role
        speaker = _first_conflict(statements, assignment)
        if speaker is not None:
            steps.append(TraceStep("conflict", person, role, speaker, bool(assignment[speaker])))
            assignment[person] = None
            continue
        steps.append(TraceStep("assume", person, role, person, role))
        rest = queue[1:]
        if not rest:
            return steps, tuple(bool(a) for a in assignment)
        front = [p for p in mentioned(statements[person]) if p in rest]
        levels.append((front + [p for p in rest if p not in front], [False, True]))
