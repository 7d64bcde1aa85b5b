"""Writing a lab trace: the search with its checks, free wording and slips (``lab_trace``), and the profile a
perfect learner of it would show (``ideal_profile``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from lopti_lab.kk.generate import Puzzle, role_word
from lopti_lab.kk.logic import LEAVES, Statement, evaluate
from lopti_lab.lab.trace.style import (
    AS_AND,
    PLAIN,
    TraceStyle,
    answer_text,
    assignments,
    combine,
    line_code,
    person,
    render_claim,
    roster,
)


@dataclass
class TraceStats:
    """What one generated trace did: lines tried, checks written, slips made, and whether its answer is right."""

    lines: int = 0
    checks: int = 0
    slips: int = 0
    conflations: int = 0
    """'or' / 'if' / 'iff' values written as the 'and' of their sides (``TraceStyle.compound_as_and``)"""
    as_and_chances: int = 0
    """'or' / 'if' / 'iff' values that differ from the 'and' of their written sides: where a conflation can happen"""
    correct: bool = True


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
        self.numbered = style.coded and not style.numbers_only  # a name followed by its number after the roster

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

    def conflated(self, value: bool) -> bool:
        """Write an 'or' / 'if' / 'iff' value that differs from the 'and' of its sides: that 'and' value (``not value``)
        with probability ``compound_as_and``, else the right one; return the value written."""
        rate = self.style.compound_as_and
        wrong = self.rng.random() < rate
        self.stats.conflations += wrong
        self.stats.as_and_chances += 1
        self.words.append((_truth(value != wrong), self._prob(rate if wrong else 1.0 - rate)))
        return value != wrong

    def text(self) -> str:
        return "".join(" " + w for w, _ in self.words)


def _write_claim(out: _Writer, statement: Statement, names, knights) -> tuple[bool, list[bool]]:
    """The restated statement with a truth value after each leaf; returns the statement's value computed from the
    values written (so a slip on a leaf carries into the statement) and those values. ``names``: how the trace names
    each person (their numbers with ``numbers_only``)."""
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
        name, role = names[leaf[1]], role_word(leaf[0] == "telling-truth")
        if k == 0 and op in ("and", "or", "<=>") and out.style.swap_symmetric:
            # the coin shows at the first word where the two orders differ: the name, or (same name) the role
            same_name = leaves[0][1] == leaves[1][1]
            out.pick(name, 1.0 if same_name else 0.5)
            if out.numbered:
                out.fixed(str(leaf[1] + 1))
            out.pick(role, 0.5 if same_name else 1.0)
        else:
            out.pick(name, 1.0)
            out.fixed(f"{leaf[1] + 1} {role}" if out.numbered else role)
        if out.style.leaf_roles:
            out.choose(out.style.leaf_roles)
            out.fixed(f"{name} {role_word(knights[leaf[1]])}" if out.style.leaf_name else role_word(knights[leaf[1]]))
        values.append(out.truth(evaluate(leaf, knights)))
    return (values[0] if op in LEAVES else combine(op, values)), values


def _write_check(out: _Writer, speaker: int, puzzle: Puzzle, knights, names: Sequence[str]) -> bool:
    """One check after the speaker's name: '<verb> <claim with values> <connective> <value> <speaker> <role> ok|no .'
    and whether it passed. The statement's value is written (and may slip) after the connective; the verdict compares
    it with the speaker's role on the current line: a knight's statement must be true, a knave's false."""
    style = out.style
    out.choose(style.say_verbs)
    out.maybe("that", style.say_that)
    value, sides = _write_claim(out, puzzle.statements[speaker], names, knights)
    out.choose(style.connectives)
    if style.compound_as_and and puzzle.statements[speaker][0] in AS_AND and value != all(sides):
        value = out.conflated(value)
    else:
        value = out.truth(value)
    passed = value == knights[speaker]
    out.fixed(f"{person(names, speaker, out.numbered)} {role_word(knights[speaker])}")
    out.choose(style.passes if passed else style.fails)
    out.fixed(".")
    out.stats.checks += 1
    return passed


def _write_trace(puzzle: Puzzle, rng: random.Random, style: TraceStyle) -> _Writer:
    out = _Writer(rng, style)
    names, n = puzzle.names, puzzle.n_people
    if style.coded and not style.number_first:  # the roster: who has which number
        out.fixed(roster(names, style))
    who = [str(i + 1) for i in range(n)] if style.numbers_only else names  # a person after the roster
    if style.transcribe:
        order = list(range(n))
        if style.shuffle_transcription:
            rng.shuffle(order)
        for k, i in enumerate(order):
            out.pick(who[i], 1.0 / (n - k) if style.shuffle_transcription else 1.0)
            if out.numbered:
                out.fixed(str(i + 1))
            out.choose(style.say_verbs)
            out.fixed(f"{render_claim(puzzle.statements[i], who, out.numbered)} .")
    found: tuple[bool, ...] | None = None
    for knights in assignments(n):
        out.stats.lines += 1
        out.choose(style.line_verbs)
        if out.stats.lines > 1:
            out.maybe("now", style.line_now)
        if style.coded:
            out.fixed(line_code(knights))
        for i, k in enumerate(knights if not style.coded else ()):
            if i == n - 1 and n > 1:
                out.maybe("and", style.line_and)
            out.fixed(f"{names[i]} {role_word(k)}")
        out.fixed(".")
        left = list(range(n))
        passed = True
        while left and passed:
            if style.restate_line and len(left) < n:
                out.fixed("with " + " ".join(f"{names[i]} {role_word(k)}" for i, k in enumerate(knights)))
            if style.check_openers:
                out.choose(style.check_openers)
            if style.random_check_order:
                speaker = left.pop(rng.randrange(len(left)))
                out.pick(who[speaker], 1.0 / (len(left) + 1))
            else:
                speaker = left.pop(0)
                out.fixed(who[speaker])
            if style.coded:
                out.fixed(f"{speaker + 1} {line_code(knights)}" if out.numbered else line_code(knights))
            passed = _write_check(out, speaker, puzzle, knights, who)
        if passed:
            found = knights
            break
    if found is None:
        out.fixed("none left .")
    out.stats.correct = found == tuple(puzzle.solution)
    out.words.append((f"</think><answer>{answer_text(names, found, style)}</answer>", 1.0))
    return out


def lab_trace_with_stats(puzzle: Puzzle, rng: random.Random, style: TraceStyle = PLAIN) -> tuple[str, TraceStats]:
    """The response after ``<think>`` (trace, ``</think>``, the answer) and what the trace did."""
    out = _write_trace(puzzle, rng, style)
    return out.text().replace(" </think>", "</think>"), out.stats


def lab_trace(puzzle: Puzzle, rng: random.Random, style: TraceStyle = PLAIN) -> str:
    """The response after ``<think>``: the search, ``</think>``, then ``<answer>...</answer>``."""
    return lab_trace_with_stats(puzzle, rng, style)[0]


def ideal_profile(
    puzzles: Sequence[Puzzle],
    style: TraceStyle = PLAIN,
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
