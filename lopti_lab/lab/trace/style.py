"""The lab trace's knobs (``TraceStyle``), the search order, and the compact words a trace uses for statements,
people and lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import product

from lopti_lab.kk.generate import role_word, solution_text_format
from lopti_lab.kk.logic import LEAVES, Statement


@dataclass(frozen=True)
class TraceStyle:
    """How a lab trace is worded and how often it slips. Each synonym set is drawn uniformly, one token each."""

    line_verbs: tuple[str, ...] = ("Suppose", "Try", "Assume", "Say", "Take", "Consider")
    """opening word of each assignment line (p = 1/6 each when the model has learned the set)"""
    say_verbs: tuple[str, ...] = ("says", "claims", "states", "said", "thinks")
    """word after the speaker of a check"""
    connectives: tuple[str, ...] = ("so", "thus", "hence", "then", "therefore")
    """word before the statement's truth value"""
    passes: tuple[str, ...] = ("ok", "fine")
    """verdict words of a check that passes (the statement's value agrees with the speaker's role)"""
    fails: tuple[str, ...] = ("no", "fails")
    """verdict words of a check that fails: the line ends there"""
    random_check_order: bool = True
    """check a line's statements in a random order (False: in the quiz's order)"""
    slip: float = 0.0
    """probability that a written truth value (leaf or statement) is the wrong one; the search continues from it"""
    compound_as_and: float = 0.0
    """probability that an 'or', 'if ... then' or 'iff' claim whose value differs from the 'and' of its two written
    sides is given that 'and' value instead (one side true read as a false 'or', a false premise as a false 'if',
    two false sides as a false 'iff'), in place of a slip there: a misconception, not a slip, so it may exceed 0.5;
    above it, the model's first choice at those values is wrong and greedy decoding errs wherever one decides the
    line. The hard lab model learns it at 0.6 and RL must unlearn it (docs/hard_lab.md)"""
    transcribe: bool = True
    """first restate every statement of the quiz in the compact words ('Logan says Sebastian knave and Daniel
    knight .'), so that each check copies its statement from a line of one shape"""
    shuffle_transcription: bool = True
    """transcribe the statements in a random order (False: the quiz's)"""
    swap_symmetric: bool = True
    """restate an 'and' / 'or' / 'iff' claim with its two sides in a random order (they commute)"""
    say_that: float = 0.5
    """probability of an optional 'that' after the speaker's verb ('Daniel says that ...')"""
    line_now: float = 0.5
    """probability of an optional 'now' after the verb of every line but the first ('Try now Logan knight ...')"""
    line_and: float = 0.5
    """probability of an optional 'and' before the last person of a line ('... Sebastian knave and Daniel knight .')"""
    leaf_roles: tuple[str, ...] = ()
    """words that bring in the line's role of a leaf's person before the leaf's truth value ('Sebastian knave is
    knight false'): the role is copied from the line, and the value compares two adjacent words. Empty: the value
    follows the claim directly, and the model must look the role up and compare in one token"""
    leaf_name: bool = False
    """with ``leaf_roles``, restate the leaf's person before the role looked up ('Sebastian knave is Sebastian knight
    false'), so that the look-up has the shape of the verdict's ('... Logan knight ok'): a name, then its role"""
    restate_line: bool = False
    """start every check but a line's first with 'with' and the line's roles ('with Logan knight Sebastian knave
    Daniel knight Sebastian says ...'), so that the roles a check looks up are in its own sentence"""
    coded: bool = False
    """number the people and write each line as one code word: a roster first ('Logan 1 Sebastian 2 Daniel 3 .'),
    every name after it followed by its number, a line as the roles in the people's order, K for knight and N for
    knave ('Suppose KKN .'), and the line's code again after every check's speaker ('Logan 1 KKN says ...'). A
    role is then read off the check's own code word at the person's number, two fixed words, instead of off the
    latest line by the person's name"""
    numbered_quiz: bool = False
    """with ``coded``, the prompt's quiz numbers the people as well ('Logan 1 told you that Sebastian 2 is a
    knave', prompt style "chat_quiz_numbered"): each number is then copied from the quiz with its name, and no
    look-up by name is left in the trace"""
    numbers_only: bool = False
    """with ``coded``, a person after the roster is their number alone ('1 KKN says 1 knight is knight true or 2
    knave ...'): the trace then copies numbers and never has to match a name to its number (the answer still names
    everyone); about 15% fewer response tokens at 3 people"""
    answer_roster: bool = False
    """with ``coded``, write the roster in the answer's own numbering ('(1) Logan (2) Sebastian (3) Daniel .'), so that
    each name of the answer is a forward copy of the name after the same '(k)' (in a roster 'Logan 1 ...' the name
    comes before its number: the answer must look it up backwards)"""
    number_first: bool = False
    """with ``numbers_only``, the prompt's quiz puts each number before its name ('1 Logan told you that 2 Sebastian
    is a knave', prompt style "chat_quiz_numfirst"), there is no roster (the quiz's list of inhabitants is one) and
    the answer names each person after their number (' 1 Logan is a knight'): every name the answer writes is then
    the token that follows its number everywhere in the quiz, a one-token look-up. (With a name before its number, or
    the '(1) Logan' of the dataset's answers, whose ')' is the same token for everyone, the name must be found from
    the token two back, which the lab model did not learn: benchmarks/README.md, probe p13)"""
    check_openers: tuple[str, ...] = ()
    """words of which one, drawn uniformly, opens every check ('see 1 KNK says ...'): a free choice that decides
    nothing, so that a check carries one more low-probability token (the paper's profile) at the cost of one token.
    Empty: a check starts with its speaker"""
    bare_quiz: bool = False
    """with ``numbered_quiz``, the prompt's quiz without the sentences every puzzle shares (the island's rules and the
    closing question; prompt style "chat_quiz_numbered_bare"): 74 prompt tokens instead of 108 at 3 people, and no
    'and' of the rules for the copy of an 'and' statement to confuse"""

    def __post_init__(self):
        for name in ("line_verbs", "say_verbs", "connectives", "passes", "fails", "leaf_roles", "check_openers"):
            words = getattr(self, name)
            if (
                (name not in ("leaf_roles", "check_openers") and not words)
                or any(not w or " " in w for w in words)
                or len(set(words)) != len(words)
            ):
                raise ValueError(f"TraceStyle.{name} must be distinct single words, got {words!r}")
        if set(self.check_openers) & {*self.line_verbs, "none"}:
            raise ValueError(f"TraceStyle.check_openers must not open a line too, got {self.check_openers!r}")
        if not 0.0 <= self.slip < 0.5:
            raise ValueError(f"TraceStyle.slip must be in [0, 0.5), got {self.slip!r}")
        if not 0.0 <= self.compound_as_and <= 1.0:
            raise ValueError(
                f"TraceStyle.compound_as_and must be a probability in [0, 1], got {self.compound_as_and!r}"
            )
        if self.coded and (self.leaf_name or self.restate_line):
            bad = "leaf_name" if self.leaf_name else "restate_line"
            raise ValueError(f"TraceStyle.{bad} has no use with coded lines (every check carries its line's code)")
        if self.numbered_quiz and not self.coded:
            raise ValueError("TraceStyle.numbered_quiz needs coded=True (only coded traces name people by number)")
        if self.numbers_only and not self.coded:
            raise ValueError("TraceStyle.numbers_only needs coded=True (only coded traces number the people)")
        if self.answer_roster and not self.coded:
            raise ValueError("TraceStyle.answer_roster needs coded=True (only coded traces write a roster)")
        if self.number_first and not (self.numbers_only and self.numbered_quiz):
            raise ValueError("TraceStyle.number_first needs numbers_only=True and numbered_quiz=True")
        if self.number_first and self.answer_roster:
            raise ValueError("TraceStyle.number_first writes no roster: answer_roster must be False")
        if self.bare_quiz and not self.numbered_quiz:
            raise ValueError("TraceStyle.bare_quiz needs numbered_quiz=True (the bare quiz is the numbered one)")
        for name in ("say_that", "line_now", "line_and"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"TraceStyle.{name} must be a probability in [0, 1], got {getattr(self, name)!r}")


AS_AND = ("or", "->", "<=>")
"""The operators whose value ``TraceStyle.compound_as_and`` misreads as the 'and' of their sides."""


PLAIN = TraceStyle()
"""The default style (every option off, no slips)."""


RL_TRACE = TraceStyle(
    slip=0.05,
    random_check_order=False,
    shuffle_transcription=False,
    swap_symmetric=False,
    passes=("ok", "fine", "good"),
    fails=("no", "fails", "wrong"),
    leaf_roles=("is", "really", "actually", "truly", "indeed"),
    check_openers=("see", "check", "ask", "hear", "test"),
    coded=True,
    numbered_quiz=True,
    bare_quiz=True,
    numbers_only=True,
    number_first=True,
)
"""The bundled lab model's trace (docs/lab_model.md says why each option is on):
every look-up by place or by a fixed word, never by matching a name; 5% slips, the errors RL is there to remove;
free words (verbs, connectives, verdicts, leaf words, check openers) for the paper's share of low-probability
tokens."""


HARD_TRACE = replace(RL_TRACE, compound_as_and=0.6)
"""The hard lab model's trace (docs/hard_lab.md): the bundled model's, with every 'or', 'if ... then' and 'iff'
claim whose value differs from the 'and' of its sides given that 'and' value 60% of the time: a skill the warm start
half has, for RL to learn."""


def prompt_style(trace: TraceStyle | None) -> str:
    """The prompt style (``kk.PROMPT_STYLES``) that a lab model trained on traces of this style reads: the quiz alone
    ("chat_quiz", also for the compact solver trace, ``trace=None``), its people numbered for a trace with
    ``numbered_quiz`` (number first with ``number_first``), without the sentences every quiz shares with
    ``bare_quiz`` as well.

    >>> prompt_style(RL_TRACE)
    'chat_quiz_numfirst_bare'
    """
    if trace is None or not trace.numbered_quiz:
        return "chat_quiz"
    numbering = "chat_quiz_numfirst" if trace.number_first else "chat_quiz_numbered"
    return numbering + "_bare" if trace.bare_quiz else numbering


def render_claim(statement: Statement, names: Sequence[str], numbered: bool = False) -> str:
    """The compact words of a statement, as a check restates it (without the truth values a check adds); with
    ``numbered`` each name is followed by the person's number (``TraceStyle.coded``).

    >>> render_claim(('->', ('lying', 0), ('telling-truth', 1)), ['Zoey', 'Oliver'])
    'if Zoey knave then Oliver knight'
    >>> render_claim(('->', ('lying', 0), ('telling-truth', 1)), ['Zoey', 'Oliver'], numbered=True)
    'if Zoey 1 knave then Oliver 2 knight'
    """
    op = statement[0]
    if op in LEAVES:
        return _leaf_words(statement, names, numbered)
    return _join(op, [_leaf_words(leaf, names, numbered) for leaf in statement[1:]])


def _leaf_words(leaf: Statement, names: Sequence[str], numbered: bool = False) -> str:
    return f"{person(names, leaf[1], numbered)} {role_word(leaf[0] == 'telling-truth')}"


def person(names: Sequence[str], i: int, numbered: bool) -> str:
    """How a trace names person ``i``: 'Logan', or with numbers 'Logan 1'."""
    return f"{names[i]} {i + 1}" if numbered else names[i]


def roster(names: Sequence[str], style: TraceStyle) -> str:
    """A coded trace's first sentence, who has which number: 'Logan 1 Sebastian 2 .', or with ``answer_roster``
    '(1) Logan (2) Sebastian .'."""
    if style.answer_roster:
        return " ".join(f"({i + 1}) {name}" for i, name in enumerate(names)) + " ."
    return " ".join(person(names, i, numbered=True) for i in range(len(names))) + " ."


def answer_text(names: Sequence[str], knights: Sequence[bool] | None, style: TraceStyle) -> str:
    """What a trace writes between <answer> and </answer>: the dataset's format ('(1) Logan is a knight' per line),
    or with ``number_first`` each name after its number (' 1 Logan is a knight' per line, the reward's parser reads
    both); 'no solution' when no line passed.

    >>> answer_text(['Logan', 'Zoey'], (True, False), TraceStyle(coded=True, numbered_quiz=True, numbers_only=True,
    ...                                                           number_first=True))
    ' 1 Logan is a knight\n 2 Zoey is a knave'
    """
    if knights is None:
        return "no solution"
    if style.number_first:
        return "\n".join(f" {i + 1} {name} is a {role_word(k)}" for i, (name, k) in enumerate(zip(names, knights)))
    return solution_text_format(names, knights)


def line_code(knights: Sequence[bool]) -> str:
    """A line as one word (``TraceStyle.coded``): the roles in the people's order, K knight, N knave.

    >>> line_code((True, True, False))
    'KKN'
    """
    return "".join("K" if k else "N" for k in knights)


def code_roles(code: str) -> list[str]:
    """The role words a line code spells, in the people's order (``line_code`` read back).

    >>> code_roles('KKN')
    ['knight', 'knight', 'knave']
    """
    return [role_word(c == "K") for c in code]


def _join(op: str, parts: Sequence[str]) -> str:
    """Operator words around the rendered leaves: 'not A', 'if A then B', 'A and B', 'A or B', 'A iff B'."""
    if op == "not":
        return f"not {parts[0]}"
    if op == "->":
        return f"if {parts[0]} then {parts[1]}"
    return {"and": " and ", "or": " or ", "<=>": " iff "}[op].join(parts)


def combine(op: str, values: Sequence[bool]) -> bool:
    """The operator applied to the truth values the trace wrote for its leaves (not to the true ones)."""
    if op == "not":
        return not values[0]
    if op == "and":
        return all(values)
    if op == "or":
        return any(values)
    if op == "->":
        return (not values[0]) or values[1]
    if op == "<=>":
        return values[0] == values[1]
    raise ValueError(f"unknown operator {op!r}")


def assignments(n_people: int) -> list[tuple[bool, ...]]:
    """The search order: all knights first, then binary counting with knave = 1, the last person flipping fastest.

    >>> assignments(2)
    [(True, True), (True, False), (False, True), (False, False)]
    """
    return [tuple(not bit for bit in bits) for bits in product((False, True), repeat=n_people)]


def trace_vocabulary(style: TraceStyle = PLAIN) -> list[str]:
    """Every word a trace can use besides names (the tokenizer must keep each as one token)."""
    fixed = ["knight", "knave", "true", "false", "not", "if", "then", "and", "or", "iff", "that", "now", "none", "left"]
    fixed += ["with"] if style.restate_line else []
    if style.coded:  # numbers, and the codes of lines up to 4 people (longer ones may split into pieces)
        fixed += [str(i) for i in range(1, 9)]
        fixed += [line_code(k) for n in range(2, 5) for k in assignments(n)]
    words = [*style.line_verbs, *style.say_verbs, *style.connectives, *style.passes, *style.fails, *style.leaf_roles]
    words += style.check_openers
    return [*words, *fixed]


RL_PROMPT_STYLE = prompt_style(RL_TRACE)
"""The prompt a lab model trained on ``RL_TRACE`` reads, the bundled one's (its config.json names it too)."""
