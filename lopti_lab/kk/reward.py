"""Prompt formats, answer parsing and the Logic-RL reward, with its breakdown.

The reward (Logic-RL, used by the paper) is the sum of two parts:

    format   +1  if <think>, </think>, <answer>, </answer> each occur exactly once, in that order; else -1
    answer   +2  every person's role right; -1.5 a parsed answer with any role wrong;
             -2  no answer, an answer that cannot be parsed, or a format error

so the total is one of 3 (solved), -0.5 (well-formed, wrong), -1 (well-formed, unparseable), -3 (bad format).

Parsing rules, exactly as Logic-RL applies them to the LAST <answer>...</answer> block (whitespace stripped):
1. The block must contain as many "knight" plus "knave" substrings (case-insensitive, so "knights" counts as one
   "knight") as there are people; otherwise it is unparseable.
2. For each person, in order, the first match of ``\\bNAME\\b\\s+is\\s+a\\s+\\b(knight|knave)\\b`` (case-insensitive)
   gives their role; a person with no match makes the answer unparseable.
3. The answer is right when every person's parsed role equals the solution's.

Example: with names (Zoey, Oliver) and solution (knave, knight),
    score("<think> ... </think><answer> (1) Zoey is a knave\\n(2) Oliver is a knight </answer>", p).total == 3
    score("<think> ... </think><answer> Zoey is a knave, Oliver is a knave </answer>", p).total == -0.5
    score("<think> ... </think><answer> Zoey is a knave </answer>", p).total == -1      # 1 role word for 2 people
    score("<answer> (1) Zoey is a knave\\n(2) Oliver is a knight </answer>", p).total == -3   # no <think>

``strict=True`` (not the paper's reward; off by default) differs in two ways, each closing a loophole of the
original: (a) role words are counted as whole words, so "knights" or "knavery" neither count nor spoil the count;
(b) nothing but whitespace or end tokens may follow </answer> (Logic-RL ignores anything after it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import pairwise

from lopti_lab.kk.generate import CLOSING, RULES, Puzzle

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
FORMAT_REWARD, FORMAT_PENALTY = 1.0, -1.0
ANSWER_RIGHT, ANSWER_WRONG, ANSWER_UNPARSEABLE = 2.0, -1.5, -2.0
TOTALS = (3.0, -0.5, -1.0, -3.0)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_STRICT_ROLE_WORD = re.compile(r"\b(knight|knave)\b", re.IGNORECASE)
_END_TOKENS = re.compile(r"^(\s|<\|im_end\|>|<\|endoftext\|>)*$")

# --- prompts ----------------------------------------------------------------------------------------------------------

# Logic-RL's system prompt for instruct models, character for character (note "and<answer>" and the double space):
# the model is asked to think inside <think> tags and answer inside <answer> tags.
LOGIC_RL_SYSTEM = (
    "You are a helpful assistant. The assistant first thinks about the reasoning process in the mind and then provides "
    "the user with the answer. The reasoning process and answer are enclosed within <think> </think> and<answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>.  Now "
    "the user asks you to solve a logical reasoning problem. After thinking, when you finally reach a conclusion, "
    "clearly state the identity of each character within <answer> </answer> tags. i.e., <answer> (1) Zoey is a "
    "knight\n(2) ... </answer>.\n"
)
BASE_INSTRUCTION = (
    "The user asks a question, and the Assistant solves it. The assistant first thinks about the reasoning process "
    "and then gives the final answer, enclosed within <think> </think> and <answer> </answer> tags, i.e., <think> "
    "reasoning process here </think><answer> answer here </answer>. State the identity of each character in the "
    "answer, one per line, for example <answer> (1) Zoey is a knight\n(2) Oliver is a knave </answer>."
)
RESPONSE_PREFIX = "<think>"
PROMPT_STYLES = (
    "instruct",
    "base",
    "chat",
    "chat_quiz",
    "chat_quiz_numbered",
    "chat_quiz_numbered_bare",
    "chat_quiz_numfirst",
    "chat_quiz_numfirst_bare",
)


def instruct_prompt(puzzle: Puzzle) -> str:
    """The Logic-RL prompt for instruct models: Qwen chat markup as one string, ending inside the assistant's
    <think> (tokenize it as is, without a chat template)."""
    return (
        f"<|im_start|>system\n{LOGIC_RL_SYSTEM}<|im_end|>\n<|im_start|>user\n{puzzle.quiz}\n<|im_end|>\n"
        f"<|im_start|>assistant\n{RESPONSE_PREFIX}"
    )


def base_prompt(puzzle: Puzzle) -> str:
    """A plain-text prompt for base models (no chat markup), also ending inside <think>."""
    return f"{BASE_INSTRUCTION}\n\nUser: {puzzle.quiz}\nAssistant: {RESPONSE_PREFIX}"


def numbered_quiz(puzzle: Puzzle, first: bool = False) -> str:
    """The quiz with every name followed by the person's number, their place in the quiz's list of inhabitants
    (for the lab model's coded traces, which name people by number: ``lab.trace.TraceStyle.numbered_quiz``); with
    ``first`` the number comes before the name ('1 Logan told you that 2 Sebastian is a knave', '" 2 Sebastian is a
    knave," 1 Logan said': ``lab.trace.TraceStyle.number_first``).

    >>> from lopti_lab.kk.generate import generate_puzzle
    >>> numbered_quiz(generate_puzzle(2, 0)).count(" 1")  # doctest: +SKIP
    3
    """
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in puzzle.names) + r")\b")
    if first:  # after an opening quote a space, so that every number is the same token (' 3', never '3')
        quoted = lambda m: " " if m.start() > 0 and m.string[m.start() - 1] == '"' else ""  # noqa: E731
        return pattern.sub(lambda m: f"{quoted(m)}{puzzle.names.index(m[0]) + 1} {m[0]}", puzzle.quiz)
    return pattern.sub(lambda m: f"{m[0]} {puzzle.names.index(m[0]) + 1}", puzzle.quiz)


def bare_quiz(quiz: str) -> str:
    """The quiz without the sentences that every puzzle shares (the island's rules before "You meet ..." and the
    closing question): the inhabitants and their statements (the lab model's 3-person prompts: 74 tokens, not 108).

    >>> from lopti_lab.kk.generate import generate_puzzle
    >>> bare_quiz(generate_puzzle(2, 0).quiz).startswith("You meet 2 inhabitants: ")
    True
    """
    if not (quiz.startswith(RULES) and quiz.endswith(" " + CLOSING)):
        raise ValueError(f"not a K&K quiz (it must open with {RULES!r} and close with {CLOSING!r}): {quiz[:80]!r}")
    return quiz[len(RULES) : -len(CLOSING) - 1]


def chat_messages(
    puzzle: Puzzle, system: bool = True, numbered: bool = False, bare: bool = False, number_first: bool = False
) -> list[dict[str, str]]:
    """The same request as messages for ``tokenizer.apply_chat_template`` (system prompt, if asked, + quiz; with
    ``numbered`` the quiz names each person with their number, ``numbered_quiz``, before the name with
    ``number_first``; with ``bare`` only the inhabitants and their statements, ``bare_quiz``)."""
    messages = [{"role": "system", "content": LOGIC_RL_SYSTEM.rstrip("\n")}] if system else []
    quiz = numbered_quiz(puzzle, first=number_first) if numbered else puzzle.quiz
    return [*messages, {"role": "user", "content": bare_quiz(quiz) if bare else quiz}]


def build_prompt(puzzle: Puzzle, style: str = "instruct", tokenizer=None) -> str:
    """The prompt text in one of PROMPT_STYLES; every style ends with "<think>", so a response starts inside it.

    "chat" renders ``chat_messages`` with the tokenizer's own chat template (and its generation prompt);
    "chat_quiz" does the same without the system prompt (the quiz alone: short prompts for the tiny lab model);
    "chat_quiz_numbered" with every name in the quiz followed by the person's number (``numbered_quiz``);
    "chat_quiz_numbered_bare" that quiz without the sentences every puzzle shares (``bare_quiz``);
    "chat_quiz_numfirst" and "chat_quiz_numfirst_bare" the same with each number before its name.
    """
    if style == "instruct":
        return instruct_prompt(puzzle)
    if style == "base":
        return base_prompt(puzzle)
    if style in PROMPT_STYLES[2:]:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"prompt style {style!r} needs a tokenizer with a chat_template")
        numbered, first, bare = style.startswith("chat_quiz_num"), "numfirst" in style, style.endswith("_bare")
        messages = chat_messages(puzzle, system=style == "chat", numbered=numbered, bare=bare, number_first=first)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + RESPONSE_PREFIX
    raise ValueError(f"prompt style must be one of {PROMPT_STYLES}, got {style!r}")


# --- scoring ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reward:
    """The Logic-RL reward of one completion and why.

    details: ``format_ok``, ``answer_text`` (last answer block or None), ``predicted`` ({name: "knight"|"knave"} or
    None), ``expected``, ``outcome`` ("correct" | "wrong" | "unparseable" | "no_answer" | "bad_format") and
    ``format_problems`` (list of strings).
    """

    total: float
    format_score: float
    answer_score: float
    details: dict = field(default_factory=dict, compare=False)

    @property
    def correct(self) -> bool:
        return self.total == TOTALS[0]


def check_format(text: str) -> list[str]:
    """Logic-RL's structure check: what is wrong with the tags (empty list = format OK).

    >>> check_format("<think> x </think><answer> y </answer>")
    []
    >>> check_format("<think> x </think><answer> y </answer><answer> z </answer>")
    ['<answer> occurs 2 times', '</answer> occurs 2 times']
    """
    problems = [f"{tag} occurs {text.count(tag)} times" for tag in TAGS if text.count(tag) != 1]
    positions = [text.find(tag) for tag in TAGS]
    if any(a > b for a, b in pairwise(positions)):  # first occurrences out of order
        problems.append("tags out of order")
    return problems


def parse_answer(answer_text: str, names: tuple[str, ...], strict: bool = False) -> dict[str, str] | None:
    """{name: role} from an answer block, or None if it is unparseable (rules 1-2 in the module docstring).

    >>> parse_answer("(1) Zoey is a knave\\n(2) Oliver is a knight", ("Zoey", "Oliver"))
    {'Zoey': 'knave', 'Oliver': 'knight'}
    >>> parse_answer("Zoey is a knave; knights: Oliver", ("Zoey", "Oliver")) is None   # no "Oliver is a ..."
    True
    """
    if strict:
        n_roles = len(_STRICT_ROLE_WORD.findall(answer_text))
    else:  # Logic-RL counts substrings: "knights" holds a "knight"
        n_roles = answer_text.lower().count("knight") + answer_text.lower().count("knave")
    if n_roles != len(names):
        return None
    predicted = {}
    for name in names:
        pattern = re.compile(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", re.IGNORECASE)
        match = pattern.search(answer_text)
        if match is None:
            return None
        predicted[name] = match.group(1).lower()
    return predicted


def score(completion: str, puzzle: Puzzle, strict: bool = False) -> Reward:
    """The Logic-RL reward of ``completion``: the assistant's whole text, opening <think> included.

    Never raises on any string; the total is always one of TOTALS.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    expected = {n: "knight" if k else "knave" for n, k in zip(puzzle.names, puzzle.solution, strict=True)}
    problems = check_format(completion)
    if strict and not problems:
        tail = completion[completion.rfind("</answer>") + len("</answer>") :]
        if not _END_TOKENS.match(tail):
            problems.append("text after </answer>")
    blocks = _ANSWER_BLOCK.findall(completion)
    answer_text = blocks[-1].strip() if blocks else None
    details = {
        "format_ok": not problems,
        "format_problems": problems,
        "answer_text": answer_text,
        "predicted": None,
        "expected": expected,
    }
    format_score = FORMAT_PENALTY if problems else FORMAT_REWARD
    if problems:
        outcome, answer_score = "bad_format", ANSWER_UNPARSEABLE
    elif not answer_text:
        outcome, answer_score = "no_answer", ANSWER_UNPARSEABLE
    else:
        predicted = parse_answer(answer_text, puzzle.names, strict=strict)
        details["predicted"] = predicted
        if predicted is None:
            outcome, answer_score = "unparseable", ANSWER_UNPARSEABLE
        elif predicted == expected:
            outcome, answer_score = "correct", ANSWER_RIGHT
        else:
            outcome, answer_score = "wrong", ANSWER_WRONG
    details["outcome"] = outcome
    return Reward(format_score + answer_score, format_score, answer_score, details)


def score_response(response: str, puzzle: Puzzle, strict: bool = False) -> Reward:
    """Score a sampled response to a prompt that ended with "<think>": puts the opening tag back in front."""
    return score(RESPONSE_PREFIX + response, puzzle, strict=strict)
