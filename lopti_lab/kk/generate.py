"""The puzzle sampler, the English rendering of the K&K dataset, and the solver traces (chains of thought).

The wording reproduces the K&K dataset (Xie et al. 2024) sentence by sentence, so a generated quiz reads like a real
one: the 51-name pool, the 18 ways of reporting a statement, the opening and closing sentences, and the wording of
leaves and operators. ``tests/test_kk_generate.py`` checks every sentence of the 700 reference records against these
shapes.

Example (``generate_puzzle(2, seed=...)`` produces quizzes of this form):

    A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves always
    lie. You meet 2 inhabitants: Zoey, and Oliver. Zoey remarked, "Oliver is not a knight". Oliver stated, "Oliver is
    a knight if and only if Zoey is a knave". So who is a knight and who is a knave?
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from lopti_lab.kk.logic import (
    OPERATORS,
    Statement,
    TraceStep,
    count_solutions,
    parse_statements,
    solve,
    solver_trace,
)

# The dataset's name pool (51 first names), in alphabetical order.
NAMES: tuple[str, ...] = (
    "Abigail", "Aiden", "Alexander", "Amelia", "Aria", "Aurora", "Ava", "Avery", "Benjamin", "Charlotte", "Chloe",
    "Daniel", "David", "Elizabeth", "Ella", "Emily", "Emma", "Ethan", "Evelyn", "Grace", "Harper", "Henry", "Isabella",
    "Jack", "Jackson", "Jacob", "James", "Joseph", "Liam", "Lily", "Logan", "Lucas", "Luke", "Mason", "Matthew", "Mia",
    "Michael", "Noah", "Oliver", "Olivia", "Owen", "Penelope", "Riley", "Samuel", "Scarlett", "Sebastian", "Sofia",
    "Sophia", "Victoria", "William", "Zoey",
)  # fmt: skip

# The dataset's 18 ways to report what a person said.
TEMPLATES: tuple[str, ...] = (
    "{name} said that {content}.",
    "{name} told you that {content}.",
    '{name} said, "{content}."',
    '{name} stated, "{content}".',
    'According to {name}, "{content}".',
    'In {name}\'s words: "{content}".',
    '{name} remarked, "{content}".',
    '"{content}," {name} declared.',
    '{name} was heard saying, "{content}".',
    "{name} expressed that {content}.",
    '"{content}" - {name}.',
    'As {name} put it, "{content}".',
    '{name} asserted: "{content}".',
    '"{content}," {name} mentioned.',
    '{name} commented, "{content}".',
    'In a statement by {name}: "{content}".',
    '{name} noted, "{content}".',
    '"{content}," {name} claimed.',
)

OPENING = (
    "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves always "
    "lie. You meet {n} inhabitants: {names}."
)
CLOSING = "So who is a knight and who is a knave?"
RULES = OPENING[: OPENING.index("You meet")]
"""The island's rules, the opening's sentences before the inhabitants (the same in every quiz)."""
COT_HEAD = "Let's think step by step, by considering whether each person is lying and if that leads to contradiction."
COT_FOOT = "This leads to a feasible solution."
KNIGHT_KNAVE = {
    "knight": "knight",
    "knave": "knave",
    "a_knight": "a knight",
    "a_knave": "a knave",
    "Knight": "Knight",
    "Knave": "Knave",
}
STATEMENT_KINDS = ("leaf", "not", "and", "or", "->", "<=>")


def role_word(knight: bool) -> str:
    return "knight" if knight else "knave"


def join_names(names: Sequence[str], pair: str = " and ") -> str:
    """The dataset's lists: 'A', 'A and B', 'A, B, and C' (``pair=", and "`` gives the opening's 'A, and B')."""
    if len(names) == 1:
        return names[0]
    if len(names) == 2:
        return pair.join(names)
    return ", ".join(names[:-1]) + ", and " + names[-1]


# ----------------------------------------------------------------------------------------------------------------------
# rendering


def render_statement(statement: Statement, names: Sequence[str]) -> str:
    """English for one statement tree, in the dataset's wording.

    >>> render_statement(('->', ('lying', 0), ('telling-truth', 1)), ['Zoey', 'Oliver'])
    'If Zoey is a knave then Oliver is a knight'
    >>> render_statement(('not', ('telling-truth', 1)), ['Zoey', 'Oliver'])
    'Oliver is not a knight'
    """
    op = statement[0]
    if op == "telling-truth":
        return f"{names[statement[1]]} is a knight"
    if op == "lying":
        return f"{names[statement[1]]} is a knave"
    if op == "not":
        child = statement[1]
        if child[0] in ("telling-truth", "lying"):
            return f"{names[child[1]]} is not a {role_word(child[0] == 'telling-truth')}"
        return f"it is not the case that {render_statement(child, names)}"  # deeper trees only; the dataset has none
    parts = [render_statement(s, names) for s in statement[1:]]
    if op == "and":
        return " and ".join(parts)
    if op == "or":
        return " or ".join(parts)
    if op == "->":
        return f"If {parts[0]} then {parts[1]}"  # the dataset keeps the capital 'If' mid-sentence
    if op == "<=>":
        return f"{parts[0]} if and only if {parts[1]}"
    raise ValueError(f"unknown operator {op!r}")


def render_quiz(names: Sequence[str], statements: Sequence[Statement], templates: Sequence[int]) -> str:
    """The full quiz: opening, one sentence per person (``templates[i]`` indexes TEMPLATES), closing."""
    sentences = [
        TEMPLATES[t].format(name=name, content=render_statement(s, names))
        for name, s, t in zip(names, statements, templates, strict=True)
    ]
    opening = OPENING.format(n=len(names), names=join_names(names, pair=", and "))
    return " ".join([opening, *sentences, CLOSING])


def solution_text(names: Sequence[str], solution: Sequence[bool]) -> str:
    """'Zoey is a knave, and Oliver is a knight.' (the dataset's ``solution_text``)."""
    claims = [f"{n} is a {role_word(k)}" for n, k in zip(names, solution, strict=True)]
    return ", ".join(claims[:-1]) + ", and " + claims[-1] + "." if len(claims) > 1 else claims[0] + "."


def solution_text_format(names: Sequence[str], solution: Sequence[bool]) -> str:
    """'(1) Zoey is a knave\\n(2) Oliver is a knight' (the dataset's ``solution_text_format``, the answer to give)."""
    return "\n".join(f"({i}) {n} is a {role_word(k)}" for i, (n, k) in enumerate(zip(names, solution, strict=True), 1))


def render_cot(steps: Sequence[TraceStep], names: Sequence[str], statements: Sequence[Statement]) -> list[str]:
    """The dataset's ``cot_repeat_steps`` for a solver trace.

    >>> s = (('lying', 1), ('lying', 0))
    >>> render_cot(solver_trace(s)[0], ['Zoey', 'Oliver'], s)[1]
    'Oliver cannot be a knight, because this would contradict the claim of Zoey that Oliver is a knave.'
    """
    out = []
    for step in steps:
        if step.kind == "assume":
            false = "" if step.role else "false "
            claim = render_statement(statements[step.person], names)
            out.append(
                f"Assume {names[step.person]} is a {role_word(step.role)}. "
                f"No contradiction is found in their {false}claim that {claim}."
            )
        elif step.kind == "conflict":
            false = "" if step.speaker_role else "false "
            whose = "their own" if step.speaker == step.person else names[step.speaker]
            claim = render_statement(statements[step.speaker], names)
            out.append(
                f"{names[step.person]} cannot be a {role_word(step.role)}, because this would contradict the "
                f"{false}claim of {whose} that {claim}."
            )
        elif step.kind == "backtrack":
            gone = join_names([names[p] for p in step.exhausted])
            out.append(
                f"We have exhausted all possibilities for {gone}, so let us go back and reconsider "
                f"{names[step.person]}."
            )
        elif step.kind == "fail":
            out.append("Every possibility leads to a contradiction, so the puzzle has no solution.")
    return out


def render_compact_trace(steps: Sequence[TraceStep], names: Sequence[str]) -> str:
    """A short trace of the same search, for a tiny model: one clause per step, no restated claims.

    assume -> 'Zoey knight ok', conflict -> 'Oliver knight no Zoey' (the statement of Zoey rules it out),
    backtrack -> 'back Zoey'. Clauses end with ' .' so every word is its own token.

    >>> s = (('lying', 1), ('lying', 0))
    >>> render_compact_trace(solver_trace(s)[0], ['Zoey', 'Oliver'])
    'Zoey knight ok . Oliver knight no Zoey . Oliver knave ok .'
    """
    clauses = []
    for step in steps:
        if step.kind == "assume":
            clauses.append(f"{names[step.person]} {role_word(step.role)} ok")
        elif step.kind == "conflict":
            clauses.append(f"{names[step.person]} {role_word(step.role)} no {names[step.speaker]}")
        elif step.kind == "backtrack":
            clauses.append(f"back {names[step.person]}")
        elif step.kind == "fail":
            clauses.append("no solution")
    return " . ".join(clauses) + " ."


# ----------------------------------------------------------------------------------------------------------------------
# the puzzle record


@dataclass(frozen=True)
class Puzzle:
    """One K&K puzzle: the fields of a dataset record that matter, plus its chain of thought.

    ``solution[i]`` is True when ``names[i]`` is a knight. Lists given for tuple fields are converted, and a missing
    chain of thought is derived from the solver trace, so ``Puzzle.from_record(p.to_record()) == p``.
    """

    quiz: str
    names: tuple[str, ...]
    statements: tuple[Statement, ...]
    solution: tuple[bool, ...]
    n_people: int
    cot_head: str = COT_HEAD
    cot_repeat_steps: tuple[str, ...] = field(default=())
    cot_foot: str = COT_FOOT
    index: int = 0

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "names", tuple(self.names))
        set_(self, "solution", tuple(bool(s) for s in self.solution))
        set_(self, "statements", parse_statements(self.statements, self.n_people))
        if len(self.names) != self.n_people or len(self.solution) != self.n_people:
            raise ValueError(
                f"Puzzle: n_people={self.n_people} but {len(self.names)} names and {len(self.solution)} solution values"
            )
        if len(set(self.names)) != self.n_people:
            raise ValueError(f"Puzzle: names must be distinct, got {self.names}")
        set_(self, "cot_repeat_steps", tuple(self.cot_repeat_steps))
        if not self.cot_repeat_steps:
            set_(
                self,
                "cot_repeat_steps",
                tuple(render_cot(solver_trace(self.statements)[0], self.names, self.statements)),
            )

    @property
    def solution_text(self) -> str:
        return solution_text(self.names, self.solution)

    @property
    def solution_text_format(self) -> str:
        return solution_text_format(self.names, self.solution)

    def trace(self) -> list[TraceStep]:
        return solver_trace(self.statements)[0]

    def compact_trace(self) -> str:
        return render_compact_trace(self.trace(), self.names)

    def to_record(self) -> dict:
        """The K&K dataset record (the HF dataset's fields, in its order)."""
        return {
            "quiz": self.quiz,
            "names": list(self.names),
            "knight_knave": dict(KNIGHT_KNAVE),
            "solution": list(self.solution),
            "solution_text": self.solution_text,
            "solution_text_format": self.solution_text_format,
            "cot_head": self.cot_head,
            "cot_repeat_steps": list(self.cot_repeat_steps),
            "cot_foot": self.cot_foot,
            "statements": repr(self.statements),
            "index": self.index,
        }

    @classmethod
    def from_record(cls, record: dict, check: bool = True) -> Puzzle:
        """Read a K&K record (a dict from the dataset's JSONL, a parquet row, or ``to_record``).

        ``statements`` is parsed with ``ast.literal_eval`` (never eval). With ``check`` the record's solution must
        be the only solution of its statements, else ValueError.
        """
        if not isinstance(record, dict):
            raise ValueError(f"record: expected a dict, got {type(record).__name__}")
        missing = [k for k in ("quiz", "names", "solution", "statements") if k not in record]
        if missing:
            raise ValueError(f"record missing fields: {missing} (has {sorted(record)})")
        names = tuple(str(n) for n in record["names"])
        kwargs = {f.name: record[f.name] for f in fields(cls) if f.name in record and f.name != "n_people"}
        kwargs["names"] = names
        kwargs["n_people"] = len(names)
        kwargs["index"] = int(record.get("index", 0))
        puzzle = cls(**kwargs)
        if check:
            solutions = solve(puzzle.statements, puzzle.n_people)
            if solutions != [puzzle.solution]:
                raise ValueError(
                    f"record index={puzzle.index}: solution {list(puzzle.solution)} but the statements have "
                    f"{len(solutions)} solution(s) {[list(s) for s in solutions][:3]}"
                )
        return puzzle


# ----------------------------------------------------------------------------------------------------------------------
# sampling


def _leaf(rng: random.Random, speaker: int, n_people: int) -> Statement:
    person = rng.randrange(n_people)
    # The dataset never has a person call themselves a knave (inside a compound or not): "I am a knave" is a paradox.
    kind = "telling-truth" if person == speaker else rng.choice(("telling-truth", "lying"))
    return (kind, person)


def sample_statement(rng: random.Random, speaker: int, n_people: int, depth: int = 2, width: int = 2) -> Statement:
    """One statement for ``speaker``: a leaf, or (depth 2) one operator over distinct leaves, each kind equally likely
    as in the dataset; 'and'/'or' take 2..width operands."""
    if depth == 1:
        return _leaf(rng, speaker, n_people)
    kind = rng.choice(STATEMENT_KINDS)
    if kind == "leaf":
        return _leaf(rng, speaker, n_people)
    if kind == "not":
        return ("not", _leaf(rng, speaker, n_people))
    arity = rng.randint(2, width) if kind in ("and", "or") else OPERATORS[kind][0]
    children: list[Statement] = []
    while len(children) < arity:
        child = _leaf(rng, speaker, n_people)
        if child not in children:
            children.append(child)
    return (kind, *children)


def generate_puzzle(n_people: int, seed: int, depth: int = 2, width: int = 2, index: int = 0) -> Puzzle:
    """A random puzzle with exactly one solution, deterministic per seed.

    Statement sets are drawn until exactly one assignment is consistent and no two people say the same thing; then
    names (distinct, from NAMES) and one of the 18 templates per person are drawn.
    """
    if not isinstance(n_people, int) or isinstance(n_people, bool) or not 2 <= n_people <= len(NAMES):
        raise ValueError(f"n_people must be an int in 2..{len(NAMES)} (the name pool), got {n_people!r}")
    if depth not in (1, 2):
        raise ValueError(f"depth must be 1 (leaves only) or 2 (one operator over leaves, the dataset's), got {depth!r}")
    if not isinstance(width, int) or not 2 <= width <= 4:
        raise ValueError(f"width (operands of 'and'/'or') must be an int in 2..4, got {width!r}")
    rng = random.Random(seed)
    while True:
        statements = tuple(sample_statement(rng, i, n_people, depth, width) for i in range(n_people))
        if len(set(statements)) == n_people and count_solutions(statements, n_people) == 1:
            break
    (solution,) = solve(statements, n_people)
    names = tuple(rng.sample(NAMES, n_people))
    templates = [rng.randrange(len(TEMPLATES)) for _ in range(n_people)]
    return Puzzle(
        quiz=render_quiz(names, statements, templates),
        names=names,
        statements=statements,
        solution=solution,
        n_people=n_people,
        index=index,
    )
