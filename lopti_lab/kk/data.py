"""K&K datasets: build, save and load them as JSONL with the HF dataset's fields, and export the Logic-RL/verl parquet.

Layout on disk (the HF dataset K-and-K/knights-and-knaves uses the same):

    data/kk/train/people3_num800.jsonl      one record per line (Puzzle.to_record())
    data/kk/test/people3_num100.jsonl

Train and test never share a statement set: the test split is drawn first and the train split skips every
statement set already used. Every puzzle's seed is derived from (seed, split, people, index), so a dataset is the
same on every machine.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lopti_lab.checks import FieldCheck, is_int
from lopti_lab.kk.generate import Puzzle, generate_puzzle
from lopti_lab.kk.logic import MAX_SOLVER_PEOPLE, contradiction, evaluate, solve
from lopti_lab.kk.reward import instruct_prompt
from lopti_lab.paths import data_dir

SPLITS = ("train", "test")
DEFAULT_PEOPLE = tuple(range(2, 9))
# 2 people admit only 395 distinct statement sets with one solution (tests/test_kk_data.py counts them), so the
# default 2-people train split is smaller.
DEFAULT_TRAIN_SIZES = {2: 200}
DEFAULT_TRAIN_SIZE = 800
HF_REPO = "K-and-K/knights-and-knaves"


def puzzle_seed(seed: int, split: str, n_people: int, index: int) -> int:
    """A 63-bit seed for one puzzle, stable across Python versions and machines."""
    digest = hashlib.sha256(f"lopti_lab/kk/{seed}/{split}/{n_people}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _people_list(people: int | Iterable[int]) -> list[int]:
    out = [people] if isinstance(people, int) else list(people)
    if not out:
        raise ValueError("people: empty")
    return out


def build_dataset(
    people: int | Iterable[int] = DEFAULT_PEOPLE,
    train_size: int | dict[int, int] | None = None,
    test_size: int = 100,
    seed: int = 0,
    depth: int = 2,
    width: int = 2,
    out: str | Path | None = None,
    exclude: Iterable[Puzzle] = (),
    progress: bool = False,
) -> dict[tuple[str, int], list[Puzzle]]:
    """Generate train and test puzzles per people count; save them under ``out`` if given.

    ``train_size``: one size for every people count, or {n_people: size}; None = 800 (200 for 2 people).
    ``exclude``: puzzles whose statement sets must not appear (e.g. a real test split). Returns
    {(split, n_people): [Puzzle, ...]}.
    """
    people = _people_list(people)
    if train_size is None:
        train_size = {n: DEFAULT_TRAIN_SIZES.get(n, DEFAULT_TRAIN_SIZE) for n in people}
    train_sizes = train_size if isinstance(train_size, dict) else dict.fromkeys(people, train_size)
    for name, value in [("test_size", test_size)] + [(f"train_size[{n}]", train_sizes.get(n)) for n in people]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    for n in people:
        generate_puzzle(n, seed=0, depth=depth, width=width)  # validates n, depth and width before any long work
    seen = {p.statements for p in exclude}
    total = sum(train_sizes[n] + test_size for n in people)
    bar = _progress(total, progress, "K&K puzzles")
    result: dict[tuple[str, int], list[Puzzle]] = {}
    for split in ("test", "train"):  # test first, so train avoids its statement sets
        for n in people:
            puzzles: list[Puzzle] = []
            attempt = 0
            size = test_size if split == "test" else train_sizes[n]
            while len(puzzles) < size:
                if attempt > 20 * size + 2000:
                    raise ValueError(
                        f"cannot draw {size} distinct {n}-people {split} puzzles beside the {len(seen)} already drawn "
                        "(2 people have only 395 distinct puzzles); ask for fewer"
                    )
                p = generate_puzzle(n, puzzle_seed(seed, split, n, attempt), depth, width, index=len(puzzles))
                attempt += 1
                if p.statements in seen:
                    continue
                seen.add(p.statements)
                puzzles.append(p)
                bar.update(1)
            result[(split, n)] = puzzles
    bar.close()
    if out is not None:
        for (split, n), puzzles in result.items():
            save_jsonl(puzzles, Path(out) / split / f"people{n}_num{len(puzzles)}.jsonl")
    return result


def save_jsonl(puzzles: Iterable[Puzzle], path: str | Path) -> Path:
    """One K&K record per line, loadable by ``datasets.load_dataset("json", data_files=path)``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in puzzles:
            f.write(json.dumps(p.to_record(), ensure_ascii=False) + "\n")
    return path


def load_jsonl(path: str | Path, limit: int | None = None, check: bool = True) -> list[Puzzle]:
    """Read K&K records; a bad line raises ValueError naming the file and line, and what is wrong with it: not
    UTF-8, not JSON, not a record (a missing field, a field of the wrong type), statements that do not parse, or, with
    ``check``, a solution that contradicts the statements or is not their only one (``check_record``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"K&K file not found: {path}")
    puzzles = []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if limit is not None and len(puzzles) >= limit:
            break
        if not raw.strip():
            continue
        try:
            puzzles.append(_puzzle(_json_line(raw), check))
        except ValueError as err:
            raise ValueError(f"{path} line {lineno}: {err}") from None
    return puzzles


def _json_line(raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON at column {err.colno}: {err.msg}") from None
    except RecursionError:
        raise ValueError("invalid JSON: nested too deeply") from None


# field -> (test, what it must be); from_record reads these (the others are derived and rewritten by to_record)
_RECORD_FIELDS = {
    "quiz": (lambda v: isinstance(v, str), "a string"),
    "names": (lambda v: isinstance(v, list) and all(isinstance(n, str) and n for n in v), "a list of names"),
    "solution": (lambda v: isinstance(v, list) and all(isinstance(k, bool) for k in v), "a list of true/false"),
    "statements": (lambda v: isinstance(v, str | list), "a Python literal string (or a list)"),
    "cot_head": (lambda v: isinstance(v, str), "a string"),
    "cot_foot": (lambda v: isinstance(v, str), "a string"),
    "cot_repeat_steps": (lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v), "a list of strings"),
    "index": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
}
_REQUIRED = ("quiz", "names", "solution", "statements")


def check_record(record) -> None:
    """ValueError naming the field if ``record`` is not a K&K record that ``Puzzle.from_record`` can read.

    >>> check_record({"quiz": "...", "names": ["Zoey"], "solution": "knight", "statements": "(('telling-truth', 0),)"})
    Traceback (most recent call last):
    ValueError: field 'solution' must be a list of true/false, got 'knight'
    """
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not a record (an object with {list(_REQUIRED)})")
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        raise ValueError(f"record missing fields: {missing} (has {sorted(record)})")
    for name, (test, what) in _RECORD_FIELDS.items():
        if name in record and not test(record[name]):
            raise ValueError(f"field {name!r} must be {what}, got {_short(record[name])}")
    if not 1 <= len(record["names"]) <= MAX_SOLVER_PEOPLE:
        raise ValueError(f"field 'names' holds {len(record['names'])} people; the solver takes 1..{MAX_SOLVER_PEOPLE}")


def check_solution(puzzle: Puzzle) -> None:
    """ValueError unless the puzzle's solution is consistent with its statements and is their only solution."""
    speaker = contradiction(puzzle.statements, puzzle.solution)
    if speaker is not None:
        name, role = puzzle.names[speaker], "knight" if puzzle.solution[speaker] else "knave"
        truth = evaluate(puzzle.statements[speaker], puzzle.solution)
        raise ValueError(
            f"the solution contradicts the statements: it makes {name} a {role}, but {name}'s statement "
            f"{puzzle.statements[speaker]!r} is then {'true' if truth else 'false'}"
        )
    solutions = solve(puzzle.statements, puzzle.n_people)
    if len(solutions) != 1:
        shown = [[bool(k) for k in s] for s in solutions[:3]]
        raise ValueError(f"the statements have {len(solutions)} solutions ({shown} ...), not exactly one")


def _puzzle(record, check: bool) -> Puzzle:
    check_record(record)
    try:
        puzzle = Puzzle.from_record(record, check=False)
    except TypeError as err:  # a field of the right JSON type but unusable, e.g. names that repeat
        raise ValueError(str(err)) from None
    if check:
        check_solution(puzzle)
    return puzzle


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def split_files(split: str, people: int | Iterable[int], root: str | Path | None = None) -> list[Path]:
    """The JSONL file of each people count in a split folder (``root/split/people{n}_num*.jsonl``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if root is None:
        root = data_dir() / "kk"
    files = []
    for n in _people_list(people):
        found = sorted(Path(root, split).glob(f"people{n}_num*.jsonl"))
        if not found:
            raise FileNotFoundError(f"no {split} file for {n} people under {Path(root, split)} (people{n}_num*.jsonl)")
        files.append(found[-1])
    return files


def load_split(
    split: str, people: int | Iterable[int], root: str | Path | None = None, limit: int | None = None
) -> list[Puzzle]:
    """Puzzles of one split for the given people counts, ``limit`` per count, from the bundled data by default."""
    return [p for path in split_files(split, people, root) for p in load_jsonl(path, limit=limit)]


def load_hf(
    split: str = "test",
    people: int | Iterable[int] = DEFAULT_PEOPLE,
    repo: str = HF_REPO,
    limit: int | None = None,
) -> list[Puzzle]:
    """The real K&K dataset from the Hugging Face hub (needs network and ``datasets``), or from a local folder with
    the hub's layout (``repo`` is then a path holding ``{split}/people{n}_num*.jsonl``)."""
    if Path(repo).is_dir():
        return load_split(split, people, root=repo, limit=limit)
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError("load_hf needs the `datasets` package: pip install datasets") from err
    puzzles = []
    for n in _people_list(people):
        rows = load_dataset(repo, data_files={split: f"{split}/people{n}_num*.jsonl"}, split=split)
        for i, row in enumerate(rows):
            if limit is not None and i >= limit:
                break
            try:
                puzzles.append(_puzzle(dict(row), check=True))
            except ValueError as err:
                raise ValueError(f"{repo} {split}/people{n} row {i}: {err}") from None
    return puzzles


# --- Logic-RL / verl parquet -----------------------------------------------------------------------------------------


def to_logic_rl_rows(puzzles: Sequence[Puzzle], split: str = "train") -> list[dict]:
    """Rows in the Logic-RL/verl training layout: the record's fields plus data_source, prompt (chat list holding the
    instruct prompt), ability, reward_model.ground_truth and extra_info."""
    rows = []
    for i, p in enumerate(puzzles):
        record = p.to_record()
        ground_truth = {"solution_text_format": record["solution_text_format"], "statements": record["statements"]}
        record.update(
            data_source="kk_logic",
            prompt=[{"content": instruct_prompt(p), "role": "user"}],
            ability="logic",
            reward_model={"ground_truth": ground_truth, "style": "rule"},
            extra_info={"index": i, "split": split},
        )
        rows.append(record)
    return rows


def export_parquet(puzzles: Sequence[Puzzle], path: str | Path, split: str = "train") -> Path:
    """Write puzzles as a Logic-RL/verl parquet file (what their ``main_ppo`` reads)."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(to_logic_rl_rows(puzzles, split)).to_parquet(path, index=False)
    return path


def read_parquet(path: str | Path) -> list[Puzzle]:
    """Puzzles from a Logic-RL/verl parquet file (ours or theirs)."""
    import pandas as pd

    frame = pd.read_parquet(path)
    puzzles = []
    for i, row in enumerate(frame.to_dict("records")):
        try:
            puzzles.append(_puzzle({k: _plain(v) for k, v in row.items()}, check=True))
        except ValueError as err:
            raise ValueError(f"{path} row {i}: {err}") from None
    return puzzles


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


# --- CLI -------------------------------------------------------------------------------------------------------------


def parse_people(text: str) -> list[int]:
    """'2-8' -> [2, ..., 8]; '3,5,7' -> [3, 5, 7]; '4' -> [4]."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo > hi:
            raise ValueError(f"people range {text!r} is empty")
        return list(range(lo, hi + 1))
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"people must look like '2-8' or '3,5,7', got {text!r}") from None


def _progress(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit="puzzle")


@dataclass
class DataConfig:
    """`lopti-lab data`: build K&K train and test splits as JSONL (the HF dataset's layout), optionally as Logic-RL /
    verl parquet too."""

    people: tuple[int, ...] = DEFAULT_PEOPLE
    """people counts to build (2-8 by default)"""
    train_size: int | None = None
    """train puzzles per people count (None: 800, and 200 for 2 people, which admit only 395 puzzles)"""
    test_size: int = 100
    """test puzzles per people count"""
    seed: int = 0
    """every puzzle's seed derives from (seed, split, people, index): the same dataset on every machine"""
    out: str = "data/kk"
    """output folder (train/ and test/ inside)"""
    parquet: bool = False
    """also write train.parquet and test.parquet in the Logic-RL / verl training layout"""

    def __post_init__(self):
        if isinstance(self.people, list):
            self.people = tuple(self.people)
        check = FieldCheck(self)
        top = MAX_SOLVER_PEOPLE
        check.items("people", lambda n: is_int(n) and 2 <= n <= top, f"people counts in 2..{top}", distinct=True)
        check.integer("train_size", low=1, optional=True)
        check.integer("test_size", low=1)
        check.integer("seed", low=0)
        check.text("out")
        check.need(not Path(self.out).is_file(), "out", "must be a folder, not a file")
        check.flag("parquet")

    def build(self, progress: bool = True) -> dict[tuple[str, int], list[Puzzle]]:
        """Generate and save the splits (and the parquet files); {(split, people): puzzles}."""
        built = build_dataset(self.people, self.train_size, self.test_size, self.seed, out=self.out, progress=progress)
        if self.parquet:
            for split in SPLITS:
                puzzles = [p for (s, _), ps in built.items() if s == split for p in ps]
                export_parquet(puzzles, Path(self.out) / f"{split}.parquet", split=split)
        return built


# --- statistics -------------------------------------------------------------------------------------------------------


def dataset_stats(puzzles: Iterable[Puzzle]):
    """One row per puzzle (people, knights share, quiz words, statement kinds, trace steps, backtracks), as a
    DataFrame: ``dataset_stats(load_split("train", range(2, 9))).groupby("people").mean(numeric_only=True)``."""
    import pandas as pd

    rows = []
    for p in puzzles:
        kinds = ["leaf" if s[0] in ("telling-truth", "lying") else s[0] for s in p.statements]
        steps = p.trace()
        rows.append(
            {
                "people": p.n_people,
                "knight_share": sum(p.solution) / p.n_people,
                "quiz_words": len(p.quiz.split()),
                "trace_steps": len(steps),
                "backtracks": sum(s.kind == "backtrack" for s in steps),
                "compact_trace_words": len(p.compact_trace().split()),
                **{f"kind_{k}": kinds.count(k) / p.n_people for k in ("leaf", "not", "and", "or", "->", "<=>")},
            }
        )
    return pd.DataFrame(rows)
