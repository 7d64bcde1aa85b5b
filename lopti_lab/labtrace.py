"""The lab model's chain of thought: a search in which every decision is local, with free wording and rare slips.

A K&K puzzle is solved by trying whole assignments in a fixed order (all knights first, then counting in binary with
knave = 1, the last person flipping fastest) and checking each person's statement under the assignment until one
fails. Every token the model must get right depends only on a few tokens just before it:

    Suppose Logan knight , Sebastian knight , Daniel knave .              # the next assignment: +1 on the last line
    Daniel says Sebastian knave false and Logan knave false so false ,    # the statement, restated from the quiz,
        Daniel knave ok .                                                 # each leaf's truth read off the line above
    Logan claims Sebastian knave false and Daniel knight false hence false , Logan knight no .
    Try Logan knight , Sebastian knave , Daniel knight .                  # a failed check ends the line
    ...
    </think><answer>(1) Logan is a knave ...</answer>                    # all checks passed: copy the line

Two kinds of variety make the model's own rollouts look like an LLM's (PAPER.md §5: a fifth of the tokens of a
GRPO rollout below p = 0.25), without deciding correctness:

- **wording**: the opening verb of a line, the verb after the speaker and the connective before the verdict are drawn
  from small synonym sets (one token each);
- **search order**: the statements of a line are checked in a random order (a failing line stops at its first
  failed check, so the order also changes how long the line is).

And one kind of error makes room for RL: with probability ``slip`` a truth value (a leaf's, or a statement's) is
written wrong, and the search goes on from the wrong belief, exactly as a solver that misread would: it may accept
a wrong assignment (a wrong answer) or reject the right one. The supervised model learns to slip at about that rate
when it samples, and almost never when it decodes greedily: sampled accuracy sits below greedy accuracy, and GRPO
can close the gap by removing the slips.

Two options move a lookup into the trace itself, after measuring where a trained model errs
(benchmarks/README.md): ``leaf_roles`` writes the line's role of each leaf's person before its value ('Sebastian
knave is knight false': a copy, then a comparison of two adjacent words, instead of a lookup and a comparison in one
token), and ``restate_line`` repeats the line's roles before each check but a line's first.

``lab_trace(puzzle, rng)`` returns the response that follows the prompt's ``<think>``; ``TraceStyle`` holds the
knobs. Worked example: ``lab_trace(p, random.Random(0), TraceStyle(slip=0.0))`` for a 2-person puzzle whose
solution is (knave, knight) writes a failing line for (knight, knight), then for (knight, knave), then the line
(knave, knight) with both checks ok, then the answer.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product

from lopti_lab.kk.generate import Puzzle, role_word, solution_text_format
from lopti_lab.kk.logic import LEAVES, Statement, evaluate

__all__ = [
    "TraceAudit",
    "TraceStats",
    "TraceStyle",
    "assignments",
    "audit_trace",
    "ideal_profile",
    "lab_trace",
    "lab_trace_with_stats",
    "render_claim",
    "trace_vocabulary",
]


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

    def __post_init__(self):
        for name in ("line_verbs", "say_verbs", "connectives", "passes", "fails", "leaf_roles"):
            words = getattr(self, name)
            if (
                (name != "leaf_roles" and not words)
                or any(not w or " " in w for w in words)
                or len(set(words)) != len(words)
            ):
                raise ValueError(f"TraceStyle.{name} must be distinct single words, got {words!r}")
        if not 0.0 <= self.slip < 0.5:
            raise ValueError(f"TraceStyle.slip must be in [0, 0.5), got {self.slip!r}")
        for name in ("say_that", "line_now", "line_and"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"TraceStyle.{name} must be a probability in [0, 1], got {getattr(self, name)!r}")


@dataclass
class TraceStats:
    """What one generated trace did: lines tried, checks written, slips made, and whether its answer is right."""

    lines: int = 0
    checks: int = 0
    slips: int = 0
    correct: bool = True


def render_claim(statement: Statement, names: Sequence[str]) -> str:
    """The compact words of a statement, as a check restates it (without the truth values a check adds).

    >>> render_claim(('->', ('lying', 0), ('telling-truth', 1)), ['Zoey', 'Oliver'])
    'if Zoey knave then Oliver knight'
    """
    op = statement[0]
    if op in LEAVES:
        return _leaf_words(statement, names)
    return _join(op, [_leaf_words(leaf, names) for leaf in statement[1:]])


def _leaf_words(leaf: Statement, names: Sequence[str]) -> str:
    return f"{names[leaf[1]]} {role_word(leaf[0] == 'telling-truth')}"


def _join(op: str, parts: Sequence[str]) -> str:
    """Operator words around the rendered leaves: 'not A', 'if A then B', 'A and B', 'A or B', 'A iff B'."""
    if op == "not":
        return f"not {parts[0]}"
    if op == "->":
        return f"if {parts[0]} then {parts[1]}"
    return {"and": " and ", "or": " or ", "<=>": " iff "}[op].join(parts)


def _truth(value: bool) -> str:
    return "true" if value else "false"


class _Writer:
    """Builds a trace word by word, each word with the probability the generator gave it (1 for forced words), so
    that ``ideal_profile`` can tell what a model that learned the generator exactly would see."""

    def __init__(self, rng: random.Random, style: TraceStyle):
        self.rng, self.style = rng, style
        self.words: list[tuple[str, float]] = []
        self.stats = TraceStats()
        self.carry = 1.0  # the probability of having left out an optional word just before

    def fixed(self, text: str) -> None:
        for i, w in enumerate(text.split()):
            self.words.append((w, self._prob(1.0) if i == 0 else 1.0))

    def choose(self, options: Sequence[str]) -> str:
        word = self.rng.choice(list(options))
        self.words.append((word, self._prob(1.0 / len(options))))
        return word

    def pick(self, word: str, prob: float) -> None:
        """A word the generator chose with probability ``prob`` by other means (a shuffle, a coin)."""
        self.words.append((word, self._prob(prob)))

    def maybe(self, word: str, rate: float) -> None:
        """An optional word, written with probability ``rate``. Leaving it out is a choice too: the next word then
        carries the probability 1 - rate (folded into it by ``skip``)."""
        if self.rng.random() < rate:
            self.words.append((word, rate))
            self.carry = 1.0
        else:
            self.carry = 1.0 - rate

    def _prob(self, prob: float) -> float:
        prob, self.carry = prob * self.carry, 1.0
        return prob

    def truth(self, value: bool) -> bool:
        """Write a truth value, wrong with probability ``slip``; return the value written."""
        slipped = self.rng.random() < self.style.slip
        self.stats.slips += slipped
        self.words.append((_truth(value != slipped), self._prob(self.style.slip if slipped else 1.0 - self.style.slip)))
        return value != slipped

    def text(self) -> str:
        return "".join(" " + w for w, _ in self.words)


def _combine(op: str, values: Sequence[bool]) -> bool:
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


def _write_claim(out: _Writer, statement: Statement, names, knights) -> bool:
    """The restated statement with a truth value after each leaf; returns the statement's value computed from the
    values written (so a slip on a leaf carries into the statement)."""
    op = statement[0]
    leaves = [statement] if op in LEAVES else list(statement[1:])
    if op in ("and", "or", "<=>") and out.style.swap_symmetric and out.rng.random() < 0.5:
        leaves.reverse()  # the sides of a commuting operator, in either order
    values = []
    for k, leaf in enumerate(leaves):
        if k == 1:
            out.fixed({"->": "then", "and": "and", "or": "or", "<=>": "iff"}[op])
        if op == "not":
            out.fixed("not")
        if op == "->" and k == 0:
            out.fixed("if")
        name, role = _leaf_words(leaf, names).split()
        if k == 0 and op in ("and", "or", "<=>") and out.style.swap_symmetric:
            # the coin shows at the first word where the two orders differ: the name, or (same name) the role
            same_name = leaves[0][1] == leaves[1][1]
            out.pick(name, 1.0 if same_name else 0.5)
            out.pick(role, 0.5 if same_name else 1.0)
        else:
            out.pick(name, 1.0)
            out.fixed(role)
        if out.style.leaf_roles:
            out.choose(out.style.leaf_roles)
            out.fixed(f"{name} {role_word(knights[leaf[1]])}" if out.style.leaf_name else role_word(knights[leaf[1]]))
        values.append(out.truth(evaluate(leaf, knights)))
    return values[0] if op in LEAVES else _combine(op, values)


def _write_check(out: _Writer, speaker: int, puzzle: Puzzle, knights) -> bool:
    """One check after the speaker's name: '<verb> <claim with values> <connective> <value> <speaker> <role> ok|no .'
    and whether it passed. The statement's value is written (and may slip) after the connective; the verdict compares
    it with the speaker's role on the current line: a knight's statement must be true, a knave's false."""
    style, names = out.style, puzzle.names
    out.choose(style.say_verbs)
    out.maybe("that", style.say_that)
    value = _write_claim(out, puzzle.statements[speaker], names, knights)
    out.choose(style.connectives)
    value = out.truth(value)
    passed = value == knights[speaker]
    out.fixed(f"{names[speaker]} {role_word(knights[speaker])}")
    out.choose(style.passes if passed else style.fails)
    out.fixed(".")
    out.stats.checks += 1
    return passed


def assignments(n_people: int) -> list[tuple[bool, ...]]:
    """The search order: all knights first, then binary counting with knave = 1, the last person flipping fastest.

    >>> assignments(2)
    [(True, True), (True, False), (False, True), (False, False)]
    """
    return [tuple(not bit for bit in bits) for bits in product((False, True), repeat=n_people)]


def _write_trace(puzzle: Puzzle, rng: random.Random, style: TraceStyle) -> _Writer:
    out = _Writer(rng, style)
    names, n = puzzle.names, puzzle.n_people
    if style.transcribe:
        order = list(range(n))
        if style.shuffle_transcription:
            rng.shuffle(order)
        for k, i in enumerate(order):
            out.pick(names[i], 1.0 / (n - k) if style.shuffle_transcription else 1.0)
            out.choose(style.say_verbs)
            out.fixed(f"{render_claim(puzzle.statements[i], names)} .")
    found: tuple[bool, ...] | None = None
    for knights in assignments(n):
        out.stats.lines += 1
        out.choose(style.line_verbs)
        if out.stats.lines > 1:
            out.maybe("now", style.line_now)
        for i, k in enumerate(knights):
            if i == n - 1 and n > 1:
                out.maybe("and", style.line_and)
            out.fixed(f"{names[i]} {role_word(k)}")
        out.fixed(".")
        left = list(range(n))
        passed = True
        while left and passed:
            if style.restate_line and len(left) < n:
                out.fixed("with " + " ".join(f"{names[i]} {role_word(k)}" for i, k in enumerate(knights)))
            if style.random_check_order:
                speaker = left.pop(rng.randrange(len(left)))
                out.pick(names[speaker], 1.0 / (len(left) + 1))
            else:
                speaker = left.pop(0)
                out.fixed(names[speaker])
            passed = _write_check(out, speaker, puzzle, knights)
        if passed:
            found = knights
            break
    if found is None:
        out.fixed("none left .")
    out.stats.correct = found == tuple(puzzle.solution)
    answer = "no solution" if found is None else solution_text_format(names, found)
    out.words.append((f"</think><answer>{answer}</answer>", 1.0))
    return out


def lab_trace_with_stats(
    puzzle: Puzzle, rng: random.Random, style: TraceStyle = TraceStyle()
) -> tuple[str, TraceStats]:
    """The response after ``<think>`` (trace, ``</think>``, the answer) and what the trace did."""
    out = _write_trace(puzzle, rng, style)
    return out.text().replace(" </think>", "</think>"), out.stats


def lab_trace(puzzle: Puzzle, rng: random.Random, style: TraceStyle = TraceStyle()) -> str:
    """The response after ``<think>``: the search, ``</think>``, then ``<answer>...</answer>``."""
    return lab_trace_with_stats(puzzle, rng, style)[0]


def ideal_profile(
    puzzles: Sequence[Puzzle],
    style: TraceStyle = TraceStyle(),
    tokenizer=None,
    bins: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    seed: int = 0,
) -> list[float]:
    """Share of response tokens per probability bin for a model that samples exactly the generator's distribution
    at temperature 1 (the best a warm start can learn): each chosen word has probability 1/(options), a truth value
    1 - slip (or slip), every forced word 1. With a ``tokenizer`` a word that splits into several tokens counts as
    one token at its probability and the rest at 1 (the answer block's tokens all at 1); without one, words count."""
    import numpy as np

    probs: list[float] = []
    for i, p in enumerate(puzzles):
        for word, prob in _write_trace(p, random.Random(seed + i), style).words:
            n = len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) if tokenizer is not None else 1
            probs += [prob] + [1.0] * (n - 1)
    counts, _ = np.histogram(np.minimum(probs, 1.0 - 1e-12), bins=np.asarray(bins))
    return (counts / counts.sum()).tolist()


def trace_vocabulary(style: TraceStyle = TraceStyle()) -> list[str]:
    """Every word a trace can use besides names (the tokenizer must keep each as one token)."""
    fixed = ["knight", "knave", "true", "false", "not", "if", "then", "and", "or", "iff", "that", "now", "none", "left"]
    fixed += ["with"] if style.restate_line else []
    words = [*style.line_verbs, *style.say_verbs, *style.connectives, *style.passes, *style.fails, *style.leaf_roles]
    return [*words, *fixed]


# ---------------------------------------------------------------------------------------------------------------------
# reading a trace back: which decisions a (sampled) trace got wrong


@dataclass
class TraceAudit:
    """The decisions of one trace, checked one by one against the puzzle (``audit_trace``).

    A *slip* is a truth value written wrong: a leaf's value under the line's assignment, or a statement's value
    given the leaf values the trace itself wrote. Other errors: a restated statement that is not the speaker's, a
    speaker's role that is not the line's, a verdict that does not follow from the written value and role, a line
    that is not the next assignment of the search order, an answer that is not the line that passed."""

    parsed: bool = True
    decisions: int = 0
    """truth values written (leaves and statements): the places a slip can happen"""
    slips: int = 0
    copy_errors: int = 0
    """restated statements or roles that do not match the quiz or the line"""
    logic_errors: int = 0
    """verdicts, next lines or answers that do not follow from what was written"""
    leaves: int = 0
    """leaf truth values read (a part of ``decisions``)"""
    leaf_errors: int = 0
    """leaf values that are not the leaf's truth on the line, whatever the cause (a slip, a wrong looked-up role)"""
    changed_leaves: int = 0
    """leaves about a person whose role on the line differs from the line before: a model that averages the roles
    of earlier lines instead of reading the current one errs on these (``leaf_errors`` among them:
    ``changed_leaf_errors``)"""
    changed_leaf_errors: int = 0
    leaves_by_line: list[int] = field(default_factory=list)
    """leaf values read on each line of the search (index 0: the first, all-knights line)"""
    leaf_errors_by_line: list[int] = field(default_factory=list)
    lookup_errors: int = 0
    """leaf roles (``TraceStyle.leaf_roles``) that are not the line's: the trace read the wrong role off the line"""
    transcribed: int = 0
    """statements restated before the first line (``TraceStyle.transcribe``)"""
    transcription_errors: int = 0
    """restated statements that are not their speaker's in the quiz, plus each person never or twice restated: the
    checks copy from these lines, so one error here can spoil every check of that speaker"""

    @property
    def clean(self) -> bool:
        """No copy, logic or transcription error (slips allowed): the trace did what its own values said."""
        return self.parsed and not (self.copy_errors or self.logic_errors or self.transcription_errors)


_VALUES = {"true": True, "false": False}


def add_at(counts: list[int], i: int, n: int) -> None:
    """``counts[i] += n``, growing ``counts`` with zeros as far as needed (per-line tallies)."""
    counts.extend([0] * (i + 1 - len(counts)))
    counts[i] += n


def _audit_claim(
    words: list[str], statement: Statement, names, knights, before, style: TraceStyle, audit: TraceAudit
) -> bool | None:
    """Check a restated claim with its truth values ('Logan knave false and Zoey knight true', or with
    ``style.leaf_roles`` 'Logan knave is knight false ...'); return the value the trace's own leaf values give, or
    None when the words are not this statement's shape."""
    op = statement[0]
    leaves = [statement] if op in LEAVES else list(statement[1:])
    if words[:1] == ["that"]:
        words = words[1:]
    expected_words = render_claim(statement, names).split()
    if op in ("and", "or", "<=>") and words[:2] != expected_words[:2]:  # restated with the sides swapped
        leaves.reverse()
        expected_words = render_claim((op, *leaves), names).split()
    # the claim's words with each leaf's looked-up role and truth value removed must be the restated statement
    values, plain, looked = [], [], []
    words_left = iter(words)
    for w in words_left:
        after_leaf = bool(plain) and plain[-1] in ("knight", "knave")
        if after_leaf and w in style.leaf_roles:
            if style.leaf_name and next(words_left, None) != plain[-2]:  # the leaf's person, restated
                audit.copy_errors += 1
            looked.append(next(words_left, None))
        elif after_leaf and w in _VALUES:
            values.append(_VALUES[w])
        else:
            plain.append(w)
    if plain != expected_words or len(values) != len(leaves) or len(looked) != (len(leaves) if style.leaf_roles else 0):
        audit.copy_errors += 1
        return None
    for k, (leaf, value) in enumerate(zip(leaves, values)):
        audit.decisions += 1
        wrong = value != evaluate(leaf, knights)
        changed = before is not None and before[leaf[1]] != knights[leaf[1]]  # `before`: the line before
        audit.leaves, audit.leaf_errors = audit.leaves + 1, audit.leaf_errors + wrong
        audit.changed_leaves += changed
        audit.changed_leaf_errors += changed and wrong
        if style.leaf_roles:  # the value compares the claimed role with the role the trace looked up
            audit.lookup_errors += looked[k] != role_word(knights[leaf[1]])
            audit.slips += value != ((looked[k] == "knight") == (leaf[0] == "telling-truth"))
        else:
            audit.slips += wrong
    return values[0] if op in LEAVES else _combine(op, values)


def _audit_transcription(
    words: list[str], puzzle: Puzzle, style: TraceStyle, restated: Counter, audit: TraceAudit
) -> None:
    """One restated statement before the first line: 'SPEAKER VERB claim' with the claim in compact words."""
    audit.transcribed += 1
    if words[0] not in puzzle.names or len(words) < 3 or words[1] not in style.say_verbs:
        audit.transcription_errors += 1
        return
    restated[words[0]] += 1
    claim = render_claim(puzzle.statements[puzzle.names.index(words[0])], puzzle.names)
    audit.transcription_errors += " ".join(words[2:]) != claim


def audit_trace(text: str, puzzle: Puzzle, style: TraceStyle = TraceStyle()) -> TraceAudit:
    """Read a lab trace (the response after ``<think>``) back and count its slips and errors.

    >>> import random
    >>> p = generate_puzzle(3, 1)  # doctest: +SKIP
    >>> audit_trace(lab_trace(p, random.Random(0)), p).slips  # doctest: +SKIP
    0
    """
    audit = TraceAudit()
    names = list(puzzle.names)
    index = {name: i for i, name in enumerate(names)}
    think, _, answer = text.partition("</think>")
    sentences = [s.split() for s in think.split(" .") if s.strip()]
    order = assignments(puzzle.n_people)
    line: tuple[bool, ...] | None = None
    before: tuple[bool, ...] | None = None  # the line before the current one
    line_no, passed_line, line_failed = -1, None, False
    first_line = next((i for i, words in enumerate(sentences) if words[0] in style.line_verbs), len(sentences))
    restated: Counter = Counter()
    for words in sentences[:first_line]:  # the transcription
        _audit_transcription(words, puzzle, style, restated, audit)
    if style.transcribe:  # every person restated once
        audit.transcription_errors += sum(restated[n] != 1 for n in names)
    try:
        for words in sentences[first_line:]:
            if words[0] in style.line_verbs:  # a new assignment line
                pairs = words[2:] if words[1:2] == ["now"] else words[1:]
                if len(pairs) == 2 * puzzle.n_people + 1 and pairs[-3] == "and":
                    pairs = pairs[:-3] + pairs[-2:]
                before, line = line, tuple(pairs[2 * i + 1] == "knight" for i in range(puzzle.n_people))
                if pairs[0::2] != names or len(pairs) != 2 * puzzle.n_people:
                    audit.copy_errors += 1
                line_no += 1
                if line_no >= len(order) or line != order[line_no] or (line_no > 0 and not line_failed):
                    audit.logic_errors += 1
                line_failed, passed_line = False, line
                continue
            if words[:2] == ["none", "left"]:
                continue
            if style.restate_line and words[0] == "with":  # the line's roles restated before the check
                pairs, words = words[1 : 1 + 2 * puzzle.n_people], words[1 + 2 * puzzle.n_people :]
                audit.copy_errors += pairs != [w for i, k in enumerate(line) for w in (names[i], role_word(k))]
            # a check: SPEAKER VERB claim... CONNECTIVE VALUE SPEAKER ROLE VERDICT
            speaker = index[words[0]]
            claim, connective, value, name2, role, verdict = words[2:-5], *words[-5:]
            if connective not in style.connectives or name2 != words[0] or value not in _VALUES:
                audit.copy_errors += 1
                continue
            leaves, leaf_errors = audit.leaves, audit.leaf_errors
            own = _audit_claim(claim, puzzle.statements[speaker], names, line, before, style, audit)
            add_at(audit.leaves_by_line, line_no, audit.leaves - leaves)
            add_at(audit.leaf_errors_by_line, line_no, audit.leaf_errors - leaf_errors)
            audit.decisions += 1
            if own is not None:
                audit.slips += _VALUES[value] != own
            if (role == "knight") != line[speaker]:
                audit.copy_errors += 1
            ok = _VALUES[value] == (role == "knight")
            if verdict not in (style.passes if ok else style.fails):
                audit.logic_errors += 1
            if verdict in style.fails:
                line_failed, passed_line = True, None
    except (KeyError, IndexError, TypeError, ValueError):
        audit.parsed = False
        return audit
    if passed_line is not None and solution_text_format(names, passed_line) not in answer:
        audit.logic_errors += 1
    return audit
