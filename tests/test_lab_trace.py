"""The lab trace: a search whose every decision is local, with free wording and injected slips (lopti_lab.lab.trace)."""

import random
from collections import Counter
from dataclasses import replace

import pytest

from lopti_lab.kk import generate_puzzle, score_response
from lopti_lab.kk.logic import LEAVES, evaluate
from lopti_lab.lab.trace import (
    AS_AND,
    HARD_TRACE,
    RL_TRACE,
    TraceStyle,
    assignments,
    audit_trace,
    lab_trace,
    lab_trace_with_stats,
    render_claim,
)


def test_render_claim_by_hand():
    names = ["Zoey", "Oliver", "Emma"]
    assert render_claim(("telling-truth", 1), names) == "Oliver knight"
    assert render_claim(("not", ("lying", 2)), names) == "not Emma knave"
    assert render_claim(("and", ("lying", 1), ("telling-truth", 2)), names) == "Oliver knave and Emma knight"
    assert render_claim(("or", ("lying", 0), ("lying", 1)), names) == "Zoey knave or Oliver knave"
    assert render_claim(("->", ("lying", 0), ("telling-truth", 1)), names) == "if Zoey knave then Oliver knight"
    assert render_claim(("<=>", ("lying", 0), ("lying", 2)), names) == "Zoey knave iff Emma knave"


def test_search_order_counts_in_binary_with_knave_as_one():
    assert assignments(2) == [(True, True), (True, False), (False, True), (False, False)]
    order = assignments(3)
    assert len(set(order)) == 8 and order[0] == (True,) * 3 and order[-1] == (False,) * 3
    assert order[3] == (True, False, False)  # 011 in binary


def test_a_two_person_trace_by_hand():
    """Without slips a 2-person trace tries (knight, knight), (knight, knave), (knave, knight), (knave, knave) in that
    order and stops at the puzzle's solution: as many lines as the solution's place in that order, then the answer."""
    for seed in range(40):
        p = generate_puzzle(2, seed)
        text, stats = lab_trace_with_stats(p, random.Random(seed), TraceStyle(slip=0.0))
        first = assignments(2).index(tuple(p.solution))
        assert stats.lines == first + 1 and stats.correct
        assert text.count(" .") >= stats.lines + stats.checks  # every line and check ends with " ."
        assert text.endswith("</think><answer>" + p.solution_text_format + "</answer>")


LOOKED_UP = TraceStyle(slip=0.0, leaf_roles=("is", "really"), random_check_order=False)
"""Each leaf's role on the line written before its value ('Logan knave is knight false')"""
NAMED = TraceStyle(slip=0.0, leaf_roles=("is", "really"), leaf_name=True)
"""... with the leaf's person restated before the role ('Logan knave is Logan knight false')"""
RESTATED = TraceStyle(slip=0.0, leaf_roles=("is",), restate_line=True)
"""... and the line's roles restated before each check but a line's first"""
CODED = TraceStyle(slip=0.0, leaf_roles=("is", "really"), coded=True)
"""People numbered after a roster, each line one code word ('Try KNK .'), restated after every check's speaker"""


@pytest.mark.parametrize(
    "style",
    [TraceStyle(slip=0.0), LOOKED_UP, NAMED, RESTATED, CODED],
    ids=["plain", "looked_up", "named", "restated", "coded"],
)
@pytest.mark.parametrize("people", [2, 3, 4, 5])
def test_without_slips_every_trace_is_right_and_every_decision_checks_out(people, style):
    for seed in range(60):
        p = generate_puzzle(people, 1000 + seed)
        text = lab_trace(p, random.Random(seed), style)
        assert score_response(text, p).total == 3
        audit = audit_trace(text, p, style)
        assert audit.parsed and audit.decisions > 0 and audit.transcribed == people and audit.clean
        assert (audit.slips, audit.copy_errors, audit.logic_errors, audit.transcription_errors) == (0, 0, 0, 0)
        assert audit.lookup_errors == 0
        stats = lab_trace_with_stats(p, random.Random(seed), style)[1]  # the same trace, with what it wrote
        looked = sum(w in style.leaf_roles for w in text.partition("</think>")[0].split())  # one per leaf value
        assert looked == (audit.decisions - stats.checks if style.leaf_roles else 0)
        assert text.count(" with ") == (stats.checks - stats.lines if style.restate_line else 0)


def test_each_check_restates_the_speakers_statement_and_its_true_values():
    """Read the first line's checks by hand: the restated claim is the quiz's, each leaf value is its truth under the
    all-knights line, and the verdict compares the statement's value with the speaker being a knight."""
    style = TraceStyle(slip=0.0, swap_symmetric=False, say_that=0.0)
    p = generate_puzzle(3, 7)
    text = lab_trace(p, random.Random(0), style)
    sentences = [s.split() for s in text.split(" .")]
    first = next(i for i, w in enumerate(sentences) if w[0] in style.line_verbs)
    knights = (True, True, True)
    for words in sentences[first + 1 :]:
        if words[0] not in p.names:
            break
        speaker = p.names.index(words[0])
        statement = p.statements[speaker]
        value = evaluate(statement, knights)
        assert words[-4] == ("true" if value else "false")
        assert words[-1] in (style.passes if value else style.fails)
        claim = [w for w in words[2:-5] if w not in ("true", "false")]
        assert " ".join(claim) == render_claim(statement, p.names)
        if not value:
            break


def test_slips_happen_at_the_rate_asked_and_the_search_goes_on_from_them():
    """slip = 5%: the share of wrong truth values is 5% within 4 standard errors; a trace with slips can still end
    right (a slip on a line that fails anyway) or wrong, and `correct` says which, as the reward does."""
    style = TraceStyle(slip=0.05)
    slips = decisions = wrong = 0
    for seed in range(300):
        p = generate_puzzle(3, 5000 + seed)
        text, stats = lab_trace_with_stats(p, random.Random(seed), style)
        audit = audit_trace(text, p, style)
        assert audit.slips == stats.slips and audit.copy_errors == 0 and audit.logic_errors == 0
        assert stats.correct == (score_response(text, p).total == 3)
        slips, decisions, wrong = slips + audit.slips, decisions + audit.decisions, wrong + (not stats.correct)
    rate = slips / decisions
    assert abs(rate - 0.05) < 4 * (0.05 * 0.95 / decisions) ** 0.5
    assert 0 < wrong < 300


def test_wording_is_drawn_evenly_from_each_set():
    style = TraceStyle()
    counts = Counter()
    for seed in range(200):
        p = generate_puzzle(3, seed)
        counts.update(w for w in lab_trace(p, random.Random(seed), style).split() if w in style.line_verbs)
    assert set(counts) == set(style.line_verbs)
    expected = sum(counts.values()) / len(style.line_verbs)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 20.5  # chi-square with 5 degrees of freedom: p = 0.001


def test_the_audit_finds_a_planted_slip_and_a_broken_copy():
    """Flip the first truth value of a clean trace (transcriptions hold none, so it is a check's): one slip, or two
    when the statement's value no longer follows from its leaves. Restate a claim wrongly: a copy error."""
    style = TraceStyle(slip=0.0, swap_symmetric=False)  # the first value written is the first leaf's
    knights = (True, True, True)  # the first line
    seen = set()
    for seed in range(12):
        p = generate_puzzle(3, 11 + seed)
        text = lab_trace(p, random.Random(1), style)
        words = text.split(" ")
        k = next(i for i, w in enumerate(words) if w in ("true", "false"))
        words[k] = "false" if words[k] == "true" else "true"
        flipped = audit_trace(" ".join(words), p, style)
        # the statement with that leaf's truth flipped: does the statement's written value still follow?
        speaker = words[max(i for i in range(k) if words[i] == ".") + 1]
        statement = p.statements[p.names.index(speaker)]
        leaf = statement if statement[0] in LEAVES else statement[1]
        other = ("lying" if leaf[0] == "telling-truth" else "telling-truth", leaf[1])
        changed = other if leaf is statement else (statement[0], other, *statement[2:])
        expected = 1 + (evaluate(changed, knights) != evaluate(statement, knights))
        assert flipped.slips == expected and flipped.copy_errors == 0
        seen.add(expected)
    assert seen == {1, 2}  # both cases met: a flip the statement absorbs, and one it does not
    # the word just before that value is the leaf's role: swap it, and the claim is no longer the speaker's
    words = text.split(" ")
    words[k - 1] = "knave" if words[k - 1] == "knight" else "knight"
    miscopied = audit_trace(" ".join(words), p, style)
    assert miscopied.parsed and miscopied.copy_errors == 1


def test_the_audit_tells_a_wrong_looked_up_role_from_a_wrong_comparison():
    """With leaf roles, a leaf's value compares two written roles. Swap the first looked-up role: a lookup error,
    and the unchanged value no longer follows from the roles written (a slip). Swap the value instead: a slip and
    no lookup error. Restate a line wrongly before a check: a copy error."""
    for seed in range(10):
        p = generate_puzzle(3, 40 + seed)
        text = lab_trace(p, random.Random(seed), RESTATED)
        words = text.split(" ")
        k = next(i for i, w in enumerate(words) if w in RESTATED.leaf_roles)  # 'is', then the role, then the value
        looked = list(words)
        looked[k + 1] = "knave" if words[k + 1] == "knight" else "knight"
        audit = audit_trace(" ".join(looked), p, RESTATED)
        assert (audit.lookup_errors, audit.slips, audit.copy_errors) == (1, 1, 0)
        valued = list(words)
        valued[k + 2] = "false" if words[k + 2] == "true" else "true"
        audit = audit_trace(" ".join(valued), p, RESTATED)
        assert audit.lookup_errors == 0 and audit.slips >= 1 and audit.copy_errors == 0
    w = next(i for i, word in enumerate(words) if word == "with")
    words[w + 2] = "knave" if words[w + 2] == "knight" else "knight"  # the first person's role, restated wrong
    audit = audit_trace(" ".join(words), p, RESTATED)
    assert audit.copy_errors == 1 and audit.lookup_errors == 0


def test_leaf_errors_are_split_by_whether_the_persons_role_changed_since_the_line_before():
    """2 people: the second line (knight, knave) changes the second person's role only. Flip a leaf value about
    each person on that line: one leaf error either way, counted as on a changed role only for the second person."""
    style = TraceStyle(slip=0.0, swap_symmetric=False)
    met = set()
    for seed in range(60):
        p = generate_puzzle(2, 70 + seed)
        text = lab_trace(p, random.Random(seed), style)
        words = text.split(" ")
        starts = [i for i, w in enumerate(words) if w in style.line_verbs and words[i - 1] == "."]
        if len(starts) < 2:
            continue
        end = starts[2] if len(starts) > 2 else len(words)
        for k in range(starts[1], end):
            if words[k] in ("true", "false") and words[k - 2] in p.names and words[k - 1] in ("knight", "knave"):
                person = p.names.index(words[k - 2])
                flipped = list(words)
                flipped[k] = "false" if words[k] == "true" else "true"
                audit = audit_trace(" ".join(flipped), p, style)
                assert audit.leaf_errors == 1 and audit.changed_leaf_errors == (person == 1)
                assert audit.leaf_errors_by_line[1] == sum(audit.leaf_errors_by_line) == 1  # on the second line
                met.add(person)
        clean = audit_trace(text, p, style)
        assert clean.leaf_errors == clean.changed_leaf_errors == sum(clean.leaf_errors_by_line) == 0
        assert clean.changed_leaves <= clean.leaves == sum(clean.leaves_by_line)
        assert len(clean.leaves_by_line) == len(starts)  # every line checks at least one statement
    assert met == {0, 1}


def test_slips_with_looked_up_roles_fall_on_the_values_only():
    style = TraceStyle(slip=0.05, leaf_roles=("is", "really", "actually"), restate_line=True)
    slips = 0
    for seed in range(100):
        p = generate_puzzle(3, 6000 + seed)
        text, stats = lab_trace_with_stats(p, random.Random(seed), style)
        audit = audit_trace(text, p, style)
        assert (audit.slips, audit.lookup_errors, audit.copy_errors, audit.logic_errors) == (stats.slips, 0, 0, 0)
        assert stats.correct == (score_response(text, p).total == 3)
        slips += stats.slips
    assert slips > 0


def test_the_audit_reads_the_transcription():
    """The statements restated before the first line: give one speaker another's statement, restate one person twice
    and leave another out, or stop before the first line; each is counted, and the checks are audited as before."""
    style = TraceStyle(slip=0.0)
    p = generate_puzzle(3, 12)
    text = lab_trace(p, random.Random(2), style)
    head, rest = _split_transcription(text, style)
    lines = [s.split() for s in head.split(" .") if s.strip()]
    assert sorted(w[0] for w in lines) == sorted(p.names)

    def audit_with(new_lines):
        return audit_trace(" " + " . ".join(" ".join(w) for w in new_lines) + " ." + rest, p, style)

    swapped = [w[:2] + lines[(k + 1) % 3][2:] for k, w in enumerate(lines)]  # each speaker, the next one's claim
    distinct = sum(" ".join(lines[k][2:]) != " ".join(lines[(k + 1) % 3][2:]) for k in range(3))
    assert audit_with(swapped).transcription_errors == distinct > 0
    twice = [lines[0], lines[0], lines[2]]  # one person twice, one never
    assert audit_with(twice).transcription_errors == 2
    unchanged = audit_with(lines)
    assert unchanged.clean and unchanged.transcribed == 3
    only = audit_trace(" " + " . ".join(" ".join(w) for w in lines[:2]) + " .</think><answer>x</answer>", p, style)
    assert only.transcribed == 2 and only.transcription_errors == 1  # the third person never restated


def _split_transcription(text: str, style: TraceStyle) -> tuple[str, str]:
    """A trace's transcription (the sentences before the first line) and the rest, from the first line on."""
    words = text.split(" ")
    first = next(i for i, w in enumerate(words) if w in style.line_verbs and words[i - 1] == ".")
    return " ".join(words[:first]), " " + " ".join(words[first:])


@pytest.mark.parametrize(
    ("field", "value"),
    [("line_verbs", ()), ("say_verbs", ("says", "says")), ("connectives", ("so then",)), ("leaf_roles", ("is", "is"))],
)
def test_bad_styles_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        TraceStyle(**{field: value})


def test_bad_slip_is_named():
    with pytest.raises(ValueError, match="slip"):
        TraceStyle(slip=0.5)


def test_a_coded_trace_numbers_every_name_and_carries_the_line_code_into_each_check():
    """The roster gives each person the number of their place in the quiz; after it every name is followed by that
    number, and every check's speaker by the line's code word, which spells the line's roles in the people's order."""
    from lopti_lab.lab.trace import line_code

    assert line_code((True, False, True)) == "KNK"
    for seed in range(30):
        p = generate_puzzle(3, 2000 + seed)
        text, stats = lab_trace_with_stats(p, random.Random(seed), CODED)
        sentences = [s.split() for s in text.partition("</think>")[0].split(" .") if s.strip()]
        assert sentences[0] == [w for i, n in enumerate(p.names) for w in (n, str(i + 1))]
        words = [w for s in sentences[1:] for w in s]
        for i, w in enumerate(words):
            if w in p.names:
                assert words[i + 1] == str(p.names.index(w) + 1)
        lines = [s for s in sentences if s[0] in CODED.line_verbs]
        codes = [s[-1] for s in lines]
        assert codes == [line_code(k) for k in assignments(3)[: stats.lines]]
        checks = [s for s in sentences[1 + 3 :] if s[0] in p.names]
        assert len(checks) == stats.checks
        line_of_check = []  # the code of the line each check belongs to, in order
        for s in sentences[1 + 3 :]:
            if s[0] in CODED.line_verbs:
                current = s[-1]
            else:
                line_of_check.append(current)
        assert [c[2] for c in checks] == line_of_check


def test_the_audit_of_a_coded_trace_counts_a_wrong_number_and_a_wrong_code():
    p = generate_puzzle(3, 7)
    text = lab_trace(p, random.Random(7), CODED)
    think, _, answer = text.partition("</think>")
    words = think.split()
    # a wrong number on a leaf inside a check, a wrong code on a check, a wrong number in the roster
    first_check = next(i for i, w in enumerate(words) if w in ("KKK",) and words[i - 1] == "1" and i > 20)
    leaf = next(i for i in range(first_check + 2, len(words)) if words[i] in p.names)
    clean = audit_trace(text, p, CODED)
    assert clean.code_reads == clean.leaves and (clean.number_errors, clean.code_misreads) == (0, 0)
    for k, (where, new) in enumerate([(leaf + 1, "9"), (first_check, "KNN"), (1, "2")]):
        broken = list(words)
        broken[where] = new
        audit = audit_trace(" " + " ".join(broken) + "</think>" + answer, p, CODED)
        assert audit.parsed
        if k < 2:
            assert (audit.copy_errors, audit.transcription_errors) == (1, 0)
        else:
            assert (audit.copy_errors, audit.transcription_errors) == (0, 1)
        assert audit.number_errors == (k == 0)  # the roster's own numbers are not counted here
        # no code has a 9th role (one misread); under the code KNN the roles read off KKK misread persons 2 and 3
        end = words.index(".", first_check)
        changed = sum(words[j] in ("2", "3") and words[j + 2] in CODED.leaf_roles for j in range(first_check, end))
        assert audit.code_misreads == {0: 1, 1: changed, 2: 0}[k] and (k != 1 or changed > 0)
        assert audit.lookup_errors == 0


def test_a_right_read_at_a_wrong_number_is_a_lookup_error_and_not_a_misread():
    """A leaf numbered as the wrong person, whose looked-up role is that person's on the check's code: the read
    of the code is right (no misread), the role is not the leaf's person's (a lookup error) when the two differ."""
    from lopti_lab.lab.trace import line_code

    met = 0
    for seed in range(40):
        p = generate_puzzle(2, 3000 + seed)
        text = lab_trace(p, random.Random(seed), CODED)
        think, _, answer = text.partition("</think>")
        words = think.split()
        for i in range(len(words) - 4):
            if words[i] in p.names and words[i + 3] in CODED.leaf_roles and i > 10:
                code = next(words[j] for j in range(i, 0, -1) if words[j] in [line_code(k) for k in assignments(2)])
                other = 2 if words[i + 1] == "1" else 1
                if code[0] == code[1]:  # both read the same: nothing to tell apart on this line
                    continue
                broken = list(words)
                broken[i + 1] = str(other)
                broken[i + 4] = "knight" if code[other - 1] == "K" else "knave"
                audit = audit_trace(" " + " ".join(broken) + "</think>" + answer, p, CODED)
                assert (audit.number_errors, audit.code_misreads, audit.lookup_errors) == (1, 0, 1)
                met += 1
                break
    assert met >= 5


def test_coded_lines_reject_the_options_they_replace():
    for bad in ("leaf_name", "restate_line"):
        with pytest.raises(ValueError, match=f"TraceStyle.{bad}"):
            TraceStyle(leaf_roles=("is",), coded=True, **{bad: True})


def test_a_numbers_only_trace_is_the_coded_trace_with_every_name_after_the_roster_left_out():
    """Same seed, same choices: the numbers-only trace is the coded one less each name after the roster (the roster
    and the answer keep them); each number in it names its person, and the audit reads it clean for 2-5 people."""
    from dataclasses import replace

    bare = replace(CODED, numbers_only=True)
    for seed in range(20):
        p = generate_puzzle(2 + seed % 4, 4000 + seed)
        coded, numbers = lab_trace(p, random.Random(seed), CODED), lab_trace(p, random.Random(seed), bare)
        think, _, answer = coded.partition("</think>")
        roster = think.split(" .")[0]
        rest = [w for w in think[len(roster) :].split() if w not in p.names]
        assert numbers == roster + " " + " ".join(rest) + "</think>" + answer
        audit = audit_trace(numbers, p, bare)
        assert audit.clean and audit.parsed and audit.code_reads == audit.leaves and audit.code_misreads == 0


def test_the_audit_of_a_numbers_only_trace_counts_a_wrong_number_as_a_copy_of_the_wrong_person():
    from dataclasses import replace

    bare = replace(CODED, numbers_only=True)
    p = generate_puzzle(3, 11)
    text = lab_trace(p, random.Random(3), bare)
    think, _, answer = text.partition("</think>")
    words = think.split()
    first_line = next(i for i, w in enumerate(words) if w in bare.line_verbs)
    after_verb, numbers = (*bare.say_verbs, "that"), ("1", "2", "3")
    statement = next(i for i in range(first_line + 3, len(words)) if words[i] in numbers and words[i - 1] in after_verb)
    for where, what in [(statement, "check"), (7, "transcription")]:  # a check's first leaf; a transcribed speaker
        broken = list(words)
        broken[where] = {"1": "2", "2": "3", "3": "1"}[words[where]]
        audit = audit_trace(" " + " ".join(broken) + "</think>" + answer, p, bare)
        assert audit.parsed and not audit.clean and audit.number_errors == 0
        assert (audit.copy_errors > 0) == (what == "check") and (audit.transcription_errors > 0) == (what != "check")
    with pytest.raises(ValueError, match="numbers_only needs coded"):
        TraceStyle(numbers_only=True)


def test_the_audit_splits_logic_errors_into_verdicts_lines_and_answers():
    """A wrong verdict, a line out of the search order and a wrong answer, each planted once in a clean trace, are
    each counted once in their own field, and ``logic_errors`` is their sum."""
    from dataclasses import replace

    from lopti_lab.lab.trace import line_code

    style = replace(CODED, numbers_only=True)
    p = next(q for q in (generate_puzzle(3, 5000 + s) for s in range(50)) if q.solution.count(False) >= 1)
    text = lab_trace(p, random.Random(0), style)
    think, _, answer = text.partition("</think>")
    words = think.split()
    codes = [line_code(k) for k in assignments(3)]
    lines = [i for i, w in enumerate(words) if w in codes and words[i - 1] in (*style.line_verbs, "now")]
    last_verdict = max(i for i, w in enumerate(words) if w in style.passes)
    assert len(lines) >= 2 and last_verdict > lines[-1]
    knave = next(i for i, k in enumerate(p.solution) if not k)
    planted = {
        "verdict_errors": (last_verdict, style.fails[0], answer),
        "line_errors": (lines[1], codes[-1] if words[lines[1]] != codes[-1] else codes[-2], answer),
        "answer_errors": (None, None, answer.replace(f"{p.names[knave]} is a knave", f"{p.names[knave]} is a knight")),
    }
    for field, (where, new, new_answer) in planted.items():
        broken = list(words)
        if where is not None:
            broken[where] = new
        audit = audit_trace(" " + " ".join(broken) + "</think>" + new_answer, p, style)
        counts = {f: getattr(audit, f) for f in planted}
        assert audit.parsed and counts == {f: int(f == field) for f in planted}, (field, counts)
        assert audit.logic_errors == 1


def test_an_answer_roster_numbers_the_people_as_the_answer_does():
    """With ``answer_roster`` the roster reads '(1) Logan (2) Sebastian ...', the rest of the trace is unchanged, the
    answer's name after each '(k)' is the roster's, and a roster with two names swapped is a transcription error."""
    from dataclasses import replace

    plain, style = replace(CODED, numbers_only=True), replace(CODED, numbers_only=True, answer_roster=True)
    for seed in range(12):
        p = generate_puzzle(2 + seed % 3, 6000 + seed)
        text, before = lab_trace(p, random.Random(seed), style), lab_trace(p, random.Random(seed), plain)
        first, _, rest = text.partition(" .")
        assert first == " " + " ".join(f"({i + 1}) {n}" for i, n in enumerate(p.names))
        assert rest == before.partition(" .")[2]
        answer = text.partition("<answer>")[2]
        assert [line.split()[1] for line in answer.split("\n")] == [first.split()[2 * i + 1] for i in range(p.n_people)]
        assert audit_trace(text, p, style).clean
        swapped = text.replace(f"(1) {p.names[0]} (2) {p.names[1]}", f"(1) {p.names[1]} (2) {p.names[0]}", 1)
        assert audit_trace(swapped, p, style).transcription_errors == 1
    with pytest.raises(ValueError, match="answer_roster needs coded"):
        TraceStyle(answer_roster=True)


FIRST = TraceStyle(
    slip=0.0, leaf_roles=("is", "really"), coded=True, numbered_quiz=True, numbers_only=True, number_first=True
)
"""The bundled model's numbering: numbers before names in the quiz, no roster, an answer ' 1 Logan is a knight'"""


def test_a_number_first_trace_has_no_roster_and_answers_each_name_after_its_number():
    """With ``number_first`` the trace is the numbers-only trace less its roster (same seed, same choices), its
    answer is ' k Name is a role' per line, which the reward reads as the solution, and the audit reads it clean
    for 2-5 people; an answer that gives person 2's role to the wrong name is an answer error."""
    from dataclasses import replace

    numbered = replace(FIRST, number_first=False)
    for seed in range(20):
        p = generate_puzzle(2 + seed % 4, 7000 + seed)
        text, before = lab_trace(p, random.Random(seed), FIRST), lab_trace(p, random.Random(seed), numbered)
        think, _, answer = text.partition("</think>")
        assert think == before.partition(" .")[2].partition("</think>")[0]  # the roster sentence left out
        lines = answer.removeprefix("<answer>").removesuffix("</answer>").split("\n")
        roles = ["knight" if k else "knave" for k in p.solution]
        assert lines == [f" {i + 1} {name} is a {role}" for i, (name, role) in enumerate(zip(p.names, roles))]
        assert score_response(text, p).total == 3
        audit = audit_trace(text, p, FIRST)
        assert audit.clean and audit.transcription_errors == 0 and audit.answer_errors == 0
        wrong = text.replace(f" 2 {p.names[1]} is a", f" 2 {p.names[0]} is a", 1)
        assert audit_trace(wrong, p, FIRST).answer_errors == 1 and score_response(wrong, p).total < 3
    for bad, fields in [("number_first needs numbers_only", {"coded": True}),
                        ("writes no roster", {**{k: True for k in ("coded", "numbered_quiz", "numbers_only")},
                                              "answer_roster": True})]:  # fmt: skip
        with pytest.raises(ValueError, match=bad):
            TraceStyle(number_first=True, **fields)


def test_check_openers_open_every_check_with_a_free_word_that_the_audit_skips():
    """One opener per check, drawn evenly; the rest of the trace is the trace without openers (same seed); the audit
    reads it clean; an opener that is also a line verb is refused by name."""
    from dataclasses import replace

    style = replace(FIRST, check_openers=("see", "check", "ask"))
    counts: Counter = Counter()
    for seed in range(30):
        p = generate_puzzle(2 + seed % 3, 8000 + seed)
        text, stats = lab_trace_with_stats(p, random.Random(seed), style)
        words = text.partition("</think>")[0].split()
        openers = [w for w in words if w in style.check_openers]
        assert len(openers) == stats.checks
        counts.update(openers)
        assert audit_trace(text, p, style).clean
    assert min(counts.values()) > 0.25 * sum(counts.values())  # about a third each
    with pytest.raises(ValueError, match=r"TraceStyle\.check_openers"):
        TraceStyle(check_openers=("Try",))


def _believed(statement, knights) -> bool:
    """The value a reader who takes every 'or', 'if' and 'iff' for an 'and' gives a statement (naive, from the
    puzzle's logic alone)."""
    if statement[0] in AS_AND:
        return all(evaluate(leaf, knights) for leaf in statement[1:])
    return evaluate(statement, knights)


@pytest.mark.parametrize("people", [2, 3, 4])
def test_compound_as_and_at_one_gives_the_answer_of_a_reader_who_reads_or_if_and_iff_as_and(people):
    """compound_as_and = 1 (no slips): the trace's answer is the first line of the search order on which every
    statement read that way agrees with its speaker's role (or none), the audit counts each misread as a slip and a
    conflation, and the misreads are exactly the trace's own count."""
    style = replace(RL_TRACE, slip=0.0, compound_as_and=1.0)
    wrong = 0
    for seed in range(60):
        p = generate_puzzle(people, 7000 + seed)
        text, stats = lab_trace_with_stats(p, random.Random(seed), style)
        found = next(
            (line for line in assignments(people) if all(_believed(s, line) == k for s, k in zip(p.statements, line))),
            None,
        )
        assert stats.correct == (found == tuple(p.solution)) == (score_response(text, p).total == 3)
        audit = audit_trace(text, p, style)
        assert audit.conflations == audit.slips == stats.conflations == stats.as_and_chances == audit.as_and_chances
        assert audit.copy_errors == audit.logic_errors == 0
        wrong += not stats.correct
    assert 0 < wrong < 60


def test_compound_as_and_misreads_at_the_rate_asked_and_only_where_the_and_differs():
    style = replace(RL_TRACE, slip=0.0, compound_as_and=0.6)
    conflations = chances = 0
    for seed in range(300):
        p = generate_puzzle(3, 9000 + seed)
        text, stats = lab_trace_with_stats(p, random.Random(seed), style)
        audit = audit_trace(text, p, style)
        assert audit.conflations == audit.slips == stats.conflations
        assert audit.as_and_chances == stats.as_and_chances
        conflations, chances = conflations + stats.conflations, chances + stats.as_and_chances
    assert abs(conflations / chances - 0.6) < 4 * (0.6 * 0.4 / chances) ** 0.5
    plain = [lab_trace_with_stats(generate_puzzle(3, 9000 + s), random.Random(s), RL_TRACE)[1] for s in range(50)]
    assert all(s.conflations == s.as_and_chances == 0 for s in plain)  # off by default


def test_hard_trace_is_the_bundled_trace_with_the_misconception_only():
    assert replace(RL_TRACE, compound_as_and=0.6) == HARD_TRACE
    with pytest.raises(ValueError, match="compound_as_and"):
        TraceStyle(compound_as_and=1.5)
