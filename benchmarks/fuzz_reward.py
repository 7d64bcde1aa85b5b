"""The Logic-RL reward under fuzz: adversarial completions built by structured mutations of real answers, scored by
lopti_lab.kk.score (the rule as Logic-RL applies it, and strict=True) and by a second, independent implementation
of the rule written here from its statement; every total must be one of the four Logic-RL values, the two must agree
on every completion, and nothing may raise.

    .venv/bin/python benchmarks/fuzz_reward.py                   # 100,000 completions (the recorded run)
    .venv/bin/python benchmarks/fuzz_reward.py --n 3000          # seconds (tests/test_fuzz_reward.py)

Completions start from real answers: a bundled test puzzle's chain of thought and its solution in the dataset's
answer format, some with names renamed to collide (Jack / Jackson, Ella / Isabella, Liam / William, Ann / Anna /
Annabel). Each gets 1 to 4 mutations drawn from MUTATIONS: tags doubled, nested, reordered, respelled or missing;
claims dropped, doubled, reordered, with names swapped for sub- or superstrings; roles flipped or pluralised;
unicode look-alikes (Cyrillic, Greek, fullwidth, the Kelvin sign, dotless i, long s), zero-width and non-breaking
spaces, combining marks; control characters; truncation; text after </answer>; regex metacharacters; and, for one
completion in ``--mega-every``, a megabyte of padding in the thinking, the answer or around the tags.

The reference (``reference_total``) implements the rule statement of lopti_lab/kk/reward.py with plain string
scanning, no regular expression: the tag check, the answer block, the role-word count, and each name's first claim
"NAME <spaces> is <spaces> a <spaces> knight|knave" with word boundaries. "Case-insensitive" and "whitespace" mean
what they mean in Logic-RL's code, which counts role words in ``answer.lower()`` and matches claims with a Python
regex under re.IGNORECASE: characters are compared one at a time under Python's IGNORECASE equivalence (the one
place the reference asks the re module anything: whether two single characters are the same letter), whitespace is
str.isspace and a word character str.isalnum or "_".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from collections import Counter
from functools import lru_cache

from lopti_lab.kk import TOTALS, Puzzle, load_split, render_quiz, score

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
ROLES = ("knight", "knave")
COLLIDING = ("Jack", "Jackson", "Ella", "Isabella", "Liam", "William", "Ann", "Anna", "Annabel")

# --- the reference: the rule, from its statement -----------------------------------------------------------------


@lru_cache(maxsize=65536)
def same_letter(c: str, x: str) -> bool:
    """Whether character c matches character x case-insensitively, as one character of a re.IGNORECASE pattern."""
    return c == x or re.fullmatch(re.escape(x), c, re.IGNORECASE) is not None


def is_word(text: str, i: int) -> bool:
    return 0 <= i < len(text) and (text[i].isalnum() or text[i] == "_")


def boundary(text: str, i: int) -> bool:
    """A word boundary between text[i - 1] and text[i]."""
    return is_word(text, i - 1) != is_word(text, i)


def literal(text: str, i: int, word: str) -> int | None:
    """The end of ``word`` matched case-insensitively at text[i], or None."""
    if i + len(word) > len(text):
        return None
    return i + len(word) if all(same_letter(text[i + k], ch) for k, ch in enumerate(word)) else None


def spaces(text: str, i: int) -> int | None:
    """The end of one or more whitespace characters at text[i], or None."""
    j = i
    while j < len(text) and text[j].isspace():
        j += 1
    return j if j > i else None


def candidates(text: str, first: str):
    """Positions of characters matching ``first`` case-insensitively, in order (a fast scan of long texts)."""
    letters = [c for c in set(text) if same_letter(c, first)]
    positions = []
    for c in letters:
        i = text.find(c)
        while i != -1:
            positions.append(i)
            i = text.find(c, i + 1)
    return sorted(positions)


def first_claim(text: str, name: str) -> str | None:
    """The role of the leftmost "NAME is a ROLE" (word-bounded, whitespace-separated), lowercased, or None."""
    for i in candidates(text, name[0]):
        if not boundary(text, i):
            continue
        j = literal(text, i, name)
        if j is None or not boundary(text, j):
            continue
        for word in ("is", "a"):
            j = spaces(text, j)
            j = None if j is None else literal(text, j, word)
            if j is None:
                break
        if j is None:
            continue
        j = spaces(text, j)
        if j is None or not boundary(text, j):
            continue
        for role in ROLES:
            end = literal(text, j, role)
            if end is not None and boundary(text, end):
                return text[j:end].lower()
    return None


def whole_role_words(text: str) -> int:
    count, i = 0, 0
    starts = sorted(set(candidates(text, "k")))
    for i0 in starts:
        if i0 < i or not boundary(text, i0):
            continue
        for role in ROLES:
            end = literal(text, i0, role)
            if end is not None and boundary(text, end):
                count, i = count + 1, end
                break
    return count


def only_end_tokens(tail: str) -> bool:
    i = 0
    while i < len(tail):
        if tail[i].isspace():
            i += 1
            continue
        token = next((t for t in END_TOKENS if tail.startswith(t, i)), None)
        if token is None:
            return False
        i += len(token)
    return True


def reference_total(text: str, names: tuple[str, ...], solution: tuple[bool, ...], strict: bool = False) -> float:
    """The Logic-RL total of a completion, from the rule: format +1 / -1, answer +2 / -1.5 / -2."""
    format_ok = all(text.count(tag) == 1 for tag in TAGS)
    if format_ok:
        where = [text.find(tag) for tag in TAGS]
        format_ok = where == sorted(where)
    if format_ok and strict:
        format_ok = only_end_tokens(text[where[3] + len("</answer>") :])
    if not format_ok:
        return -1.0 - 2.0
    answer = text[where[2] + len("<answer>") : where[3]].strip()
    if not answer:
        return 1.0 - 2.0
    if strict:
        n_roles = whole_role_words(answer)
    else:
        low = answer.lower()
        n_roles = low.count("knight") + low.count("knave")
    if n_roles != len(names):
        return 1.0 - 2.0
    predicted = [first_claim(answer, name) for name in names]
    if None in predicted:
        return 1.0 - 2.0
    expected = ["knight" if k else "knave" for k in solution]
    return 1.0 + (2.0 if predicted == expected else -1.5)


# --- completions -------------------------------------------------------------------------------------------------

LOOKALIKES = {"a": "аɑα", "e": "еє", "o": "оοо", "p": "р", "c": "с", "i": "іıi̇", "s": "ѕſ", "k": "κк", "K": "ΚКK",
              "n": "ո", "g": "ɡ", "h": "һ", "t": "τ", "v": "ν", "A": "ΑА", "E": "ΕЕ", "J": "Ј", "I": "ІİΙ"}  # fmt: skip
INVISIBLE = ("\u200b", "\u200c", "\u200d", "\ufeff", "\u2060", "\u00ad")
ODD_SPACES = ("\u00a0", "\u2003", "\u3000", "\u2028", "\u0085", "\x1c", "\t", "\r\n")
CONTROLS = ("\x00", "\x07", "\x08", "\x0b", "\x0c", "\x1b", "\x7f", "\r", "\x1f")
NOISE = (".*", "\\b", "(", ")", "[", "]", "{", "}", "$", "^", "|", "\\", "+?", "(?i)")
TAILS = (" Let me double check.", "<|im_end|>", "<|endoftext|>", "\n<|im_end|>\n", " </answer>", "\n\n", "<think>")


def base_completion(puzzle: Puzzle, rng: random.Random) -> str:
    thinking = rng.choice([puzzle.compact_trace(), " ".join(puzzle.cot_repeat_steps), ""])
    return f"<think> {thinking} </think><answer> {puzzle.solution_text_format} </answer>"


def _pos(text: str, rng: random.Random) -> int:
    return rng.randrange(len(text) + 1)


def _swap_text(text: str, old: str, new: str, rng: random.Random) -> str:
    spots = [m.start() for m in re.finditer(re.escape(old), text)] if old else []
    if not spots:
        return text
    i = rng.choice(spots)
    return text[:i] + new + text[i + len(old) :]


def m_double_tag(t, p, rng):
    tag = rng.choice(TAGS)
    i = _pos(t, rng)
    return t[:i] + tag + t[i:]


def m_drop_tag(t, p, rng):
    return _swap_text(t, rng.choice(TAGS), "", rng)


def m_reorder_tags(t, p, rng):
    a, b = rng.sample(TAGS, 2)
    return t.replace(a, "\x00A\x00").replace(b, a).replace("\x00A\x00", b)


def m_nest_answer(t, p, rng):
    return t.replace("<answer>", "<answer><answer>", 1).replace("</answer>", "</answer></answer>", 1)


def m_second_answer(t, p, rng):
    block = re.search(r"<answer>.*?</answer>", t, re.DOTALL)
    return t + (block.group(0) if block else "<answer></answer>")


def m_respell_tag(t, p, rng):
    tag = rng.choice(TAGS)
    return _swap_text(t, tag, rng.choice([tag.upper(), tag.replace("<", "< "), tag.replace(">", " >"),
                                          tag.replace("/", "\\"), tag[:-1]]), rng)  # fmt: skip


def m_name_substring(t, p, rng):
    name = rng.choice(p.names)
    other = rng.choice([name[:-1], name + "son", "Is" + name.lower(), "W" + name.lower(), name + "a", name * 2])
    return _swap_text(t, name, other, rng)


def m_swap_names(t, p, rng):
    if len(p.names) < 2:
        return t
    a, b = rng.sample(p.names, 2)
    return t.replace(a, "\x00N\x00").replace(b, a).replace("\x00N\x00", b)


def m_claims(t, p, rng):
    claims = p.solution_text_format.split("\n")
    how = rng.choice(["drop", "double", "reorder", "one line", "unnumbered"])
    if how == "drop":
        claims.pop(rng.randrange(len(claims)))
    elif how == "double":
        claims.append(rng.choice(claims))
    elif how == "reorder":
        rng.shuffle(claims)
    text = (" " if how == "one line" else "\n").join(claims)
    if how == "unnumbered":
        text = re.sub(r"\(\d+\) ", "", text)
    return t.replace(p.solution_text_format, text)


def m_roles(t, p, rng):
    old = rng.choice(ROLES)
    new = rng.choice(["knave" if old == "knight" else "knight", old + "s", old.upper(), old.title(), old + "ish",
                      old[:-1], "an " + old, old + "_", "non-" + old])  # fmt: skip
    return _swap_text(t, old, new, rng)


def m_is_a(t, p, rng):
    return _swap_text(t, " is a ", rng.choice([" is an ", " is  a ", " is\na ", " IS A ", " is a a ", " isa ",
                                               "\tis\ta\t", " is the ", " was a "]), rng)  # fmt: skip


def m_lookalike(t, p, rng):
    spots = [i for i, c in enumerate(t) if c in LOOKALIKES]
    if not spots:
        return t
    i = rng.choice(spots)
    return t[:i] + rng.choice(LOOKALIKES[t[i]]) + t[i + 1 :]


def m_invisible(t, p, rng):
    i = _pos(t, rng)
    return t[:i] + rng.choice((*INVISIBLE, "\u0301", "\u0308", "\u20dd")) + t[i:]


def m_odd_space(t, p, rng):
    return _swap_text(t, " ", rng.choice(ODD_SPACES), rng)


def m_control(t, p, rng):
    i = _pos(t, rng)
    return t[:i] + "".join(rng.choices(CONTROLS, k=rng.randint(1, 3))) + t[i:]


def m_truncate(t, p, rng):
    return t[: _pos(t, rng)]


def m_tail(t, p, rng):
    return t + rng.choice(TAILS)


def m_noise(t, p, rng):
    i = _pos(t, rng)
    return t[:i] + rng.choice(NOISE) + t[i:]


def m_empty_answer(t, p, rng):
    empty = rng.choice(["<answer></answer>", "<answer> \n\t </answer>"])
    return re.sub(r"<answer>.*?</answer>", empty, t, count=1, flags=re.DOTALL)


def m_role_words_elsewhere(t, p, rng):
    words = rng.choice(["All knights are honest.", "knavery", "Knights and Knaves", "KNIGHT", "knave."])
    target = rng.choice(["<answer>", "</answer>", "</think>"])
    return _swap_text(t, target, target + " " + words + " " if target == "<answer>" else " " + words + " " + target,
                      rng)  # fmt: skip


FORMAT_MUTATIONS = {
    f.__name__.removeprefix("m_"): f
    for f in (
        m_double_tag,
        m_drop_tag,
        m_reorder_tags,
        m_nest_answer,
        m_second_answer,
        m_respell_tag,
        m_truncate,
        m_tail,
    )
}
ANSWER_MUTATIONS = {f.__name__.removeprefix("m_"): f for f in (
    m_name_substring, m_swap_names, m_claims, m_roles, m_is_a, m_lookalike, m_invisible, m_odd_space, m_control,
    m_noise, m_empty_answer, m_role_words_elsewhere)}  # fmt: skip
MUTATIONS = {**FORMAT_MUTATIONS, **ANSWER_MUTATIONS}
"""Tag mutations break the format (total -3) almost always, so each completion gets one with probability 0.4 and
1-3 of the others: most completions reach the answer parser."""


def megabyte(t: str, p: Puzzle, rng: random.Random) -> str:
    """About 1 MB of padding in the thinking, inside the answer, or as repeated tags and claims."""
    size = 1 << 20
    where = rng.choice(["think", "answer", "claims", "garbage"])
    if where == "claims":  # a megabyte of claims: the count can never match
        return t.replace("<answer>", "<answer>" + (p.solution_text_format + "\n") * (size // 60), 1)
    if where == "garbage":  # no tags at all
        return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz <>/\n" + "".join(p.names), k=size))
    pad = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ,.\n", k=size))
    return t.replace("</think>" if where == "think" else "</answer>", pad + ("</think>" if where == "think" else
                     "</answer>"), 1)  # fmt: skip


def puzzles() -> list[Puzzle]:
    """The bundled test split (700 puzzles of 2-8 people), and each again with colliding names where they fit."""
    real = load_split("test", range(2, 9))
    renamed = []
    for p in real:
        if p.n_people <= len(COLLIDING):
            names = tuple(COLLIDING[: p.n_people])
            renamed.append(Puzzle(render_quiz(names, p.statements, [0] * p.n_people), names, p.statements,
                                  p.solution, p.n_people))  # fmt: skip
    return real + renamed


def completions(n: int, seed: int, mega_every: int):
    """(puzzle, completion, mutation names) x n, deterministic in the seed."""
    rng = random.Random(seed)
    pool = puzzles()
    for k in range(n):
        p = rng.choice(pool)
        text = base_completion(p, rng)
        applied = rng.sample(list(ANSWER_MUTATIONS), rng.randint(1, 3))
        if rng.random() < 0.4:
            applied.insert(rng.randrange(len(applied) + 1), rng.choice(list(FORMAT_MUTATIONS)))
        if k % 20 == 0:
            applied = []  # one in 20 left as the real answer
        for name in applied:
            text = MUTATIONS[name](text, p, rng)
        if mega_every and k % mega_every == mega_every - 1:
            text, applied = megabyte(text, p, rng), [*applied, "megabyte"]
        yield p, text, applied


# --- the run -------------------------------------------------------------------------------------------------------


def fuzz(n: int = 100_000, seed: int = 0, mega_every: int = 2000, scorer=score) -> dict:
    """Score n completions both ways (default and strict rule) with ``scorer`` and with the reference."""
    counts = Counter()
    totals = {False: Counter(), True: Counter()}
    problems: list[dict] = []
    seconds = Counter()  # (library | reference, ordinary | megabyte) -> seconds
    longest = 0
    for p, text, applied in completions(n, seed, mega_every):
        counts.update(applied)
        longest = max(longest, len(text))
        size = "megabyte" if "megabyte" in applied else "ordinary"
        for strict in (False, True):
            t0 = time.perf_counter()
            try:
                reward = scorer(text, p, strict=strict)
                total, parts = reward.total, reward.format_score + reward.answer_score
            except Exception as err:  # counted and reported: the point of the benchmark
                total, parts = f"{type(err).__name__}: {err}", None
            t1 = time.perf_counter()
            expected = reference_total(text, p.names, p.solution, strict)
            t2 = time.perf_counter()
            seconds["library", size] += t1 - t0
            seconds["reference", size] += t2 - t1
            totals[strict][total if isinstance(total, float) else "exception"] += 1
            if total != expected or total not in TOTALS or parts != total:
                problems.append({"strict": strict, "total": total, "reference": expected, "mutations": applied,
                                 "text": text[:300]})  # fmt: skip
    return {
        "completions": n,
        "scored": 2 * n,
        "exceptions": sum(t["exception"] for t in totals.values()),
        "not_a_logic_rl_total": sum(v for t in totals.values() for k, v in t.items() if k not in TOTALS),
        "disagreements": len(problems),
        "first_disagreements": problems[:5],
        "totals_default": {str(k): v for k, v in sorted(totals[False].items(), key=str)},
        "totals_strict": {str(k): v for k, v in sorted(totals[True].items(), key=str)},
        "mutations": dict(sorted(counts.items())),
        "megabyte_completions": counts["megabyte"],
        "longest_chars": longest,
        **{f"{who}_per_second": 2 * n / (seconds[who, "ordinary"] + seconds[who, "megabyte"])
           for who in ("library", "reference")},
        **{f"{who}_per_second_ordinary": 2 * (n - counts["megabyte"]) / seconds[who, "ordinary"]
           for who in ("library", "reference")},
        "library_seconds_per_megabyte_score": seconds["library", "megabyte"] / max(2 * counts["megabyte"], 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="completions (each scored default and strict)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mega-every", type=int, default=2000, help="one megabyte completion in this many")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = fuzz(args.n, args.seed, args.mega_every)
    result["seconds"] = time.perf_counter() - start
    print(f"{result['completions']:,} completions ({result['megabyte_completions']} of ~1 MB), each scored by the "
          f"default and the strict rule: {result['exceptions']} exceptions, {result['not_a_logic_rl_total']} totals "
          f"outside (3, -0.5, -1, -3), {result['disagreements']} disagreements with the reference")  # fmt: skip
    print(f"totals (default): {result['totals_default']}; (strict): {result['totals_strict']}")
    print(f"library: {result['library_per_second']:,.0f} scores/s overall, {result['library_per_second_ordinary']:,.0f}"
          f" on ordinary completions, {1000 * result['library_seconds_per_megabyte_score']:.1f} ms per megabyte one; "
          f"reference: {result['reference_per_second']:,.0f} scores/s; {result['seconds']:.0f} s in all (load "
          f"{os.getloadavg()[0]:.2f})")  # fmt: skip
    for problem in result["first_disagreements"]:
        print("  disagreement:", json.dumps(problem)[:400])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if not (result["exceptions"] or result["disagreements"] or result["not_a_logic_rl_total"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
