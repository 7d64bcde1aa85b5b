"""The Logic-RL reward: every real record, a table of tricky completions, and arbitrary text."""

import random
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kk_fixtures import reference_records

from lopti_lab.kk import TOTALS, Puzzle, build_prompt, generate_puzzle, render_quiz, score, score_response
from lopti_lab.kk.reward import check_format, parse_answer


def wrap(answer: str, think: str = " reasoning ") -> str:
    return f"<think>{think}</think><answer>{answer}</answer>"


@pytest.fixture(scope="module")
def records(reference_kk):
    return reference_records()


def test_every_reference_solution_scores_3_and_one_flip_scores_minus_half(records):
    for r in records:
        p = Puzzle.from_record(r)
        assert score(wrap(r["solution_text_format"]), p).total == 3
        for flip in range(p.n_people):
            wrong = list(p.solution)
            wrong[flip] = not wrong[flip]
            text = "\n".join(
                f"({i + 1}) {n} is a {'knight' if k else 'knave'}" for i, (n, k) in enumerate(zip(p.names, wrong))
            )
            reward = score(wrap(text), p)
            assert (reward.total, reward.format_score, reward.answer_score) == (-0.5, 1, -1.5)


@pytest.fixture(scope="module")
def jack():
    """Names chosen to collide: 'Jack' inside 'Jackson', 'Ella' inside 'Isabella'. Solution: Jack knight,
    Jackson knave, Ella knight (the statements of a generated 3-people puzzle with that solution)."""
    seed = next(s for s in range(1000) if generate_puzzle(3, s).solution == (True, False, True))
    g = generate_puzzle(3, seed)
    names = ("Jack", "Jackson", "Ella")
    return Puzzle(render_quiz(names, g.statements, [0, 1, 2]), names, g.statements, g.solution, 3)


RIGHT = "(1) Jack is a knight\n(2) Jackson is a knave\n(3) Ella is a knight"
GARBAGE = "".join(random.Random(0).choice(string.printable) for _ in range(100_000)).replace("<", "[")

# (completion, expected total, strict total, why). The expected total is derived from Logic-RL's rules:
# format +1/-1 (each tag exactly once, in order), answer +2 right / -1.5 wrong / -2 unparseable or bad format.
TRICKY = [
    (wrap(RIGHT), 3, 3, "canonical answer: +1 +2"),
    (wrap(RIGHT.replace("Jackson is a knave", "Jackson is a knight")), -0.5, -0.5, "one role wrong: +1 -1.5"),
    (wrap(RIGHT + "\nAll knights are honest."), -1, 3,
     "'knights' contains 'knight': 4 role words for 3 people -> unparseable +1 -2; strict counts whole words"),
    (wrap("(1) Jackson is a knave\n(2) Ella is a knight\n(3) Jack is a knight"), 3, 3, "order of claims is free"),
    (wrap("Jackson is a knave, Jackson is a knight, Ella is a knight"), -1, -1,
     "'Jack' never matches inside 'Jackson' (word boundary): Jack unparsed -> +1 -2"),
    (wrap("Jack is a knight, Jackson is a knave, Isabella is a knight"), -1, -1,
     "'Ella' inside 'Isabella' is not Ella: unparsed -> +1 -2"),
    (wrap("(1) JACK IS A KNIGHT\n(2) jackson is a knave\n(3) ella Is A Knight"), 3, 3, "matching ignores case"),
    (wrap("Jack   is\n a knight; Jackson is\ta knave; Ella is a knight"), 3, 3, "any whitespace between words"),
    (wrap("Jack is an knight, Jackson is a knave, Ella is a knight"), -1, -1, "'is an' is not 'is a': +1 -2"),
    (wrap("knight, knave, knight"), -1, -1, "roles without names: +1 -2"),
    (wrap("Jack is a knave") + "<answer>" + RIGHT + "</answer>", -3, -3,
     "two answer blocks: <answer> occurs twice -> format -1, answer -2"),
    ("<think> x <answer>" + RIGHT + "</answer> </think>", -3, -3, "tags out of order: -1 -2"),
    ("<answer>" + RIGHT + "</answer><think> x </think>", -3, -3, "answer before think: -1 -2"),
    (" reasoning </think><answer>" + RIGHT + "</answer>", -3, -3, "no opening <think> (prefix not put back)"),
    ("<think> a <think> b </think><answer>" + RIGHT + "</answer>", -3, -3, "<think> twice: -1 -2"),
    (wrap(""), -1, -1, "empty answer block: format fine +1, no answer -2"),
    (wrap("   \n "), -1, -1, "whitespace-only answer: +1 -2"),
    ("", -3, -3, "empty completion: no tags -> -1 -2"),
    (GARBAGE, -3, -3, "100 kB of garbage without tags"),
    (wrap(RIGHT, think=GARBAGE), 3, 3, "100 kB of thinking, then the right answer"),
    (wrap(RIGHT.replace("Ella", "Еlla")), -1, -1, "Cyrillic 'Е' lookalike: Ella unparsed -> +1 -2"),
    (wrap(RIGHT + " ✓", think=" ü 🤔 日本 "), 3, 3, "unicode elsewhere is harmless"),
    ("<think></think><answer>(1) Jack is a knight(2) Jackson is a knave(3) Ella is a knight</answer>", 3, 3,
     "no spaces around claims still parses"),
    ("< think > x </think><answer>" + RIGHT + "</answer>", -3, -3, "a spaced tag is not a tag"),
    (wrap(RIGHT) + " Let me double check.", 3, -3, "text after </answer>: Logic-RL ignores it, strict fails format"),
    (wrap(RIGHT) + "<|im_end|>", 3, 3, "an end token after the answer is fine in both"),
    (wrap(RIGHT + "\n(4) Jack is a knave"), -1, -1, "an extra claim makes 4 role words for 3 people: +1 -2"),
]  # fmt: skip


@pytest.mark.parametrize(("completion", "expected", "strict_expected", "why"), TRICKY, ids=range(len(TRICKY)))
def test_tricky_completions(jack, completion, expected, strict_expected, why):
    assert score(completion, jack).total == expected, why
    assert score(completion, jack, strict=True).total == strict_expected, why


def test_table_is_large_enough():
    assert len(TRICKY) >= 20


def test_breakdown_explains_the_total(jack):
    r = score(wrap(RIGHT.replace("Jackson is a knave", "Jackson is a knight")), jack)
    assert r.details["outcome"] == "wrong"
    assert r.details["predicted"] == {"Jack": "knight", "Jackson": "knight", "Ella": "knight"}
    assert r.details["expected"]["Jackson"] == "knave"
    bad = score("<answer>x</answer>", jack)
    assert bad.details["outcome"] == "bad_format"
    assert bad.details["format_problems"] == ["<think> occurs 0 times", "</think> occurs 0 times"]
    assert not bad.correct and score(wrap(RIGHT), jack).correct


def test_score_response_puts_the_think_tag_back(jack):
    assert score_response(" x </think><answer>" + RIGHT + "</answer>", jack).total == 3
    assert build_prompt(jack).endswith("<|im_start|>assistant\n<think>")


def test_check_format_and_parse_answer_examples():
    assert check_format("<think></think><answer></answer>") == []
    assert check_format("</think><think><answer></answer>") == ["tags out of order"]
    assert parse_answer("Zoey is a knave and Oliver is a knight", ("Zoey", "Oliver")) == {
        "Zoey": "knave",
        "Oliver": "knight",
    }


FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "Jack", "Jackson", "Ella", " is a ", "knight", "knave",
             "knights", "\n", " ", "(1)", "<|im_end|>", "ü", "\\b", ".*", "(", "["]  # fmt: skip


@given(st.one_of(st.text(max_size=300), st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)))
@settings(max_examples=500, deadline=None)
def test_score_never_raises_and_returns_one_of_four_totals(jack, text):
    for strict in (False, True):
        r = score(text, jack, strict=strict)
        assert r.total in TOTALS
        assert r.total == r.format_score + r.answer_score


def test_non_string_completion_is_a_type_error(jack):
    with pytest.raises(TypeError, match="completion must be a str"):
        score(None, jack)


def test_the_numbered_quiz_follows_every_name_with_its_number_and_changes_nothing_else(records):
    """On the real K&K records: every occurrence of a name gains ' <its place in the list of inhabitants>', and
    taking those numbers out again gives the quiz back word for word."""
    import re

    from lopti_lab.kk.reward import numbered_quiz

    for record in records[::7]:
        p = Puzzle.from_record(record)
        text = numbered_quiz(p)
        for i, name in enumerate(p.names):
            plain = len(re.findall(rf"\b{re.escape(name)}\b", p.quiz))
            assert plain > 0 and len(re.findall(rf"\b{re.escape(name)} {i + 1}\b", text)) == plain
        pattern = r"\b(" + "|".join(re.escape(n) for n in p.names) + r") \d\b"
        assert re.sub(pattern, lambda m: m[1], text) == p.quiz


def test_the_bare_quiz_keeps_the_inhabitants_and_statements_and_drops_only_the_shared_sentences(records):
    """On the real K&K records: the bare quiz is the quiz less its rules and closing question, word for word, it
    opens with the inhabitants and ends with the last statement; a text that is not a K&K quiz is refused."""
    from lopti_lab.kk.generate import CLOSING, RULES
    from lopti_lab.kk.reward import bare_quiz, numbered_quiz

    for record in records[::7]:
        p = Puzzle.from_record(record)
        for quiz in (p.quiz, numbered_quiz(p)):
            bare = bare_quiz(quiz)
            assert f"{RULES}{bare} {CLOSING}" == quiz
            assert bare.startswith(f"You meet {p.n_people} inhabitants: ") and "knights and knaves" not in bare
            assert "So who is" not in bare and bare.endswith((".", '"'))
    with pytest.raises(ValueError, match="not a K&K quiz"):
        bare_quiz("You meet 2 inhabitants: Zoey, and Oliver.")


def test_the_number_first_quiz_puts_each_number_before_its_name_and_changes_nothing_else(records):
    """On the real K&K records: every occurrence of a name becomes '<its number> <name>' (after an opening quote
    ' <number> <name>', so that each number is one and the same token), and taking the numbers out again gives the
    quiz back word for word; the prompt style "chat_quiz_numfirst_bare" reads that quiz, bare."""
    import re

    from lopti_lab.kk.reward import bare_quiz, build_prompt, numbered_quiz
    from lopti_lab.lab.tokenizer import build_tokenizer

    quoted = 0
    for record in records[::7]:
        p = Puzzle.from_record(record)
        text = numbered_quiz(p, first=True)
        for i, name in enumerate(p.names):
            plain = len(re.findall(rf"\b{re.escape(name)}\b", p.quiz))
            assert plain > 0 and len(re.findall(rf"(?<![\w\d]){i + 1} {re.escape(name)}\b", text)) == plain
        assert not re.search(r'"\d', text)
        quoted += text.count('" ')
        names = "|".join(re.escape(n) for n in p.names)
        unquoted = re.sub(rf'(?<=\s)" \d ({names})\b', lambda m: '"' + m[1], text)  # an opening quote
        assert re.sub(rf"\b\d ({names})\b", lambda m: m[1], unquoted) == p.quiz
    assert quoted > 0  # the records do quote statements that open with a name
    tokenizer = build_tokenizer(n_puzzles=100)
    p = Puzzle.from_record(records[0])
    assert bare_quiz(numbered_quiz(p, first=True)) in build_prompt(p, "chat_quiz_numfirst_bare", tokenizer)
