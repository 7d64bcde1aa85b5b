"""Reading a lab trace back: which decisions a (sampled) trace got wrong (``audit_trace``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from lopti_lab.kk.generate import Puzzle, role_word
from lopti_lab.kk.logic import LEAVES, Statement, evaluate
from lopti_lab.lab.trace.style import (
    AS_AND,
    PLAIN,
    TraceStyle,
    answer_text,
    assignments,
    code_roles,
    combine,
    line_code,
    render_claim,
    roster,
)


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
    conflations: int = 0
    """slips at an 'or' / 'if' / 'iff' statement's value that wrote the 'and' of its written sides
    (``TraceStyle.compound_as_and``); a part of ``slips``"""
    as_and_chances: int = 0
    """'or' / 'if' / 'iff' statements whose value, from their written sides, differs from the 'and' of those sides:
    where a conflation can happen (conflations / as_and_chances is the trace's misreading rate)"""
    copy_errors: int = 0
    """restated statements or roles that do not match the quiz or the line"""
    verdict_errors: int = 0
    """verdicts that do not follow from the statement's written value and the speaker's role on the line"""
    line_errors: int = 0
    """lines that are not the search order's next assignment, or that follow a line whose checks all passed"""
    answer_errors: int = 0
    """answers that are not the line whose checks all passed"""
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
    number_errors: int = 0
    """coded traces: names after the roster not followed by their own number (in the transcription and the checks;
    also counted as transcription or copy errors)"""
    code_reads: int = 0
    """coded traces with ``leaf_roles``: looked-up roles, each read off the check's code word at the number
    written after the leaf's name"""
    code_misreads: int = 0
    """looked-up roles that are not the code's role at the number written: a wrong read of the code, apart from a
    wrong number (``number_errors``), which makes a right read give the wrong person's role"""
    transcribed: int = 0
    """statements restated before the first line (``TraceStyle.transcribe``)"""
    transcription_errors: int = 0
    """restated statements that are not their speaker's in the quiz, plus each person never or twice restated: the
    checks copy from these lines, so one error here can spoil every check of that speaker"""

    @property
    def logic_errors(self) -> int:
        """Verdicts, next lines or answers that do not follow from what was written."""
        return self.verdict_errors + self.line_errors + self.answer_errors

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
) -> tuple[bool, list[bool]] | None:
    """Check a restated claim with its truth values ('Logan knave false and Zoey knight true', or with
    ``style.leaf_roles`` 'Logan knave is knight false ...'); return the value the trace's own leaf values give and
    those values, or None when the words are not this statement's shape."""
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
    return (values[0] if op in LEAVES else combine(op, values)), values


def _unnumber(words: list[str], index: dict[str, int]) -> tuple[list[str], int]:
    """The words of a coded trace with the number after each name taken out, and how many names lack their own
    number (missing, or another person's)."""
    plain, wrong, i = [], 0, 0
    while i < len(words):
        plain.append(words[i])
        numbered = words[i] in index and i + 1 < len(words) and words[i + 1].isdigit()
        if words[i] in index:
            wrong += not (numbered and words[i + 1] == str(index[words[i]] + 1))
        i += 2 if numbered else 1
    return plain, wrong


def _named(words: list[str], names: Sequence[str]) -> list[str]:
    """A sentence of a ``numbers_only`` trace with each person's number preceded by their name ('1 KKN says 2 knave'
    -> 'Logan 1 KKN says Sebastian 2 knave'); a number that names no one stays as it is (the audit counts it)."""
    out: list[str] = []
    for w in words:
        out += [names[int(w) - 1], w] if w.isdigit() and 1 <= int(w) <= len(names) else [w]
    return out


def _audit_code_reads(words: list[str], index: dict[str, int], style: TraceStyle, audit: TraceAudit) -> None:
    """In a coded check 'SPEAKER N CODE VERB ... NAME N ROLE LEAF_WORD LOOKED VALUE ...': each looked-up role
    against the role the check's own code gives at the number written before it."""
    code = words[2] if len(words) > 2 else ""
    for i in range(3, len(words) - 4):
        if words[i] in index and words[i + 1].isdigit() and words[i + 3] in style.leaf_roles:
            n = int(words[i + 1])
            audit.code_reads += 1
            audit.code_misreads += not (1 <= n <= len(code) and words[i + 4] == code_roles(code)[n - 1])


def _audit_transcription(
    words: list[str], puzzle: Puzzle, index: dict[str, int], style: TraceStyle, restated: Counter, audit: TraceAudit
) -> None:
    """One restated statement before the first line: 'SPEAKER VERB claim' with the claim in compact words (coded:
    every name followed by its number)."""
    audit.transcribed += 1
    wrong_numbers = 0
    if style.coded:
        words, wrong_numbers = _unnumber(words, index)
        audit.number_errors += wrong_numbers
    if words[0] not in puzzle.names or len(words) < 3 or words[1] not in style.say_verbs:
        audit.transcription_errors += 1
        return
    restated[words[0]] += 1
    claim = render_claim(puzzle.statements[index[words[0]]], puzzle.names)
    audit.transcription_errors += " ".join(words[2:]) != claim or wrong_numbers > 0


def audit_trace(text: str, puzzle: Puzzle, style: TraceStyle = PLAIN) -> TraceAudit:
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
    if style.coded and not style.number_first:  # the roster, then the transcription
        first = roster(names, style).split()[:-1]  # the sentence without its '.'
        audit.transcription_errors += not sentences or sentences[0] != first
        sentences, first_line = sentences[1:], max(first_line - 1, 0)
    if style.numbers_only:  # read every number as the person it names, then audit as a numbered trace
        sentences = [_named(words, names) for words in sentences]
    for words in sentences[:first_line]:  # the transcription
        _audit_transcription(words, puzzle, index, style, restated, audit)
    if style.transcribe:  # every person restated once
        audit.transcription_errors += sum(restated[n] != 1 for n in names)
    try:
        for words in sentences[first_line:]:
            if words[0] in style.line_verbs and style.coded:  # a new line as one code word
                code = words[2:] if words[1:2] == ["now"] else words[1:]
                if len(code) != 1 or len(code[0]) != puzzle.n_people or set(code[0]) - {"K", "N"}:
                    raise ValueError(f"not a line code: {code}")
                pairs = [w for name, role in zip(names, code_roles(code[0])) for w in (name, role)]
            elif words[0] in style.line_verbs:  # a new assignment line
                pairs = words[2:] if words[1:2] == ["now"] else words[1:]
            if words[0] in style.line_verbs:
                if len(pairs) == 2 * puzzle.n_people + 1 and pairs[-3] == "and":
                    pairs = pairs[:-3] + pairs[-2:]
                before, line = line, tuple(pairs[2 * i + 1] == "knight" for i in range(puzzle.n_people))
                if pairs[0::2] != names or len(pairs) != 2 * puzzle.n_people:
                    audit.copy_errors += 1
                line_no += 1
                if line_no >= len(order) or line != order[line_no] or (line_no > 0 and not line_failed):
                    audit.line_errors += 1
                line_failed, passed_line = False, line
                continue
            if words[:2] == ["none", "left"]:
                continue
            if words[0] in style.check_openers:  # a check's free first word
                words = words[1:]
            if style.restate_line and words[0] == "with":  # the line's roles restated before the check
                pairs, words = words[1 : 1 + 2 * puzzle.n_people], words[1 + 2 * puzzle.n_people :]
                audit.copy_errors += pairs != [w for i, k in enumerate(line) for w in (names[i], role_word(k))]
            if style.coded:  # numbers off, then the line's code after the speaker
                _audit_code_reads(words, index, style, audit)
                words, wrong_numbers = _unnumber(words, index)
                audit.number_errors += wrong_numbers
                audit.copy_errors += wrong_numbers + (words[1] != line_code(line))
                words = [words[0], *words[2:]]
            # a check: SPEAKER VERB claim... CONNECTIVE VALUE SPEAKER ROLE VERDICT
            speaker = index[words[0]]
            claim, connective, value, name2, role, verdict = words[2:-5], *words[-5:]
            if connective not in style.connectives or name2 != words[0] or value not in _VALUES:
                audit.copy_errors += 1
                continue
            leaves, leaf_errors = audit.leaves, audit.leaf_errors
            claimed = _audit_claim(claim, puzzle.statements[speaker], names, line, before, style, audit)
            add_at(audit.leaves_by_line, line_no, audit.leaves - leaves)
            add_at(audit.leaf_errors_by_line, line_no, audit.leaf_errors - leaf_errors)
            audit.decisions += 1
            if claimed is not None:
                own, sides = claimed
                audit.slips += _VALUES[value] != own
                chance = puzzle.statements[speaker][0] in AS_AND and own != all(sides)
                audit.as_and_chances += chance
                audit.conflations += chance and _VALUES[value] != own
            if (role == "knight") != line[speaker]:
                audit.copy_errors += 1
            ok = _VALUES[value] == (role == "knight")
            if verdict not in (style.passes if ok else style.fails):
                audit.verdict_errors += 1
            if verdict in style.fails:
                line_failed, passed_line = True, None
    except (KeyError, IndexError, TypeError, ValueError):
        audit.parsed = False
        return audit
    if passed_line is not None and answer_text(names, passed_line, style) not in answer:
        audit.answer_errors += 1
    return audit
