"""Datasets on disk: determinism, disjoint splits, the HF/datasets layout, Logic-RL parquet, the CLI."""

import json
from itertools import product

import pandas as pd
import pytest

from lopti_lab.cli import main
from lopti_lab.kk import (
    Puzzle,
    build_dataset,
    export_parquet,
    instruct_prompt,
    load_hf,
    load_jsonl,
    load_split,
    read_parquet,
    save_jsonl,
)
from lopti_lab.kk.data import parse_people, split_files
from lopti_lab.kk.logic import count_solutions
from lopti_lab.paths import data_dir


def test_build_is_deterministic_and_splits_are_disjoint():
    a = build_dataset([2, 3], train_size=30, test_size=10, seed=5)
    b = build_dataset([2, 3], train_size=30, test_size=10, seed=5)
    assert a == b
    assert build_dataset([3], train_size=5, test_size=5, seed=6)[("test", 3)] != a[("test", 3)][:5]
    for n in (2, 3):
        test = {p.statements for p in a[("test", n)]}
        train = {p.statements for p in a[("train", n)]}
        assert not test & train
        assert len(train) == 30 and len(test) == 10, "no duplicate statement sets within a split"
        assert [p.index for p in a[("train", n)]] == list(range(30))


def test_exclude_keeps_puzzles_out():
    test = build_dataset([2], train_size=0, test_size=50, seed=1)[("test", 2)]
    other = build_dataset([2], train_size=100, test_size=0, seed=2, exclude=test)[("train", 2)]
    assert not {p.statements for p in test} & {p.statements for p in other}


def test_two_people_have_only_395_distinct_puzzles():
    def statements(speaker):
        leaves = [(k, p) for p in range(2) for k in ("telling-truth", "lying") if (p, k) != (speaker, "lying")]
        out = leaves + [("not", leaf) for leaf in leaves]
        return out + [(op, a, b) for op in ("and", "or", "->", "<=>") for a in leaves for b in leaves if a != b]

    unique = [s for s in product(statements(0), statements(1)) if s[0] != s[1] and count_solutions(s, 2) == 1]
    assert len(unique) == 395
    with pytest.raises(ValueError, match="395"):
        build_dataset([2], train_size=400, test_size=0)


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="test_size"):
        build_dataset([3], test_size=-1)
    with pytest.raises(ValueError, match=r"train_size\[4\]"):
        build_dataset([3, 4], train_size={3: 5})
    with pytest.raises(ValueError, match="n_people"):
        build_dataset([1])


def test_jsonl_loads_with_hf_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    puzzles = build_dataset([3], train_size=0, test_size=12, seed=3)[("test", 3)]
    path = save_jsonl(puzzles, tmp_path / "test" / "people3_num12.jsonl")
    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    assert len(ds) == 12
    assert set(ds.column_names) == set(puzzles[0].to_record())
    assert [Puzzle.from_record(dict(row)) for row in ds] == puzzles
    assert load_jsonl(path) == puzzles


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = build_dataset([2], train_size=0, test_size=1)[("test", 2)][0].to_record()
    del good["quiz"]
    path.write_text(json.dumps(build_dataset([2], 0, 1)[("test", 2)][0].to_record()) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: record missing fields: \['quiz'\]"):
        load_jsonl(path)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_bundled_data_is_what_the_command_builds():
    root = data_dir() / "kk"
    files = sorted(root.rglob("*.jsonl"))
    assert sum(f.stat().st_size for f in files) < 20e6
    rebuilt = build_dataset()
    for (split, n), puzzles in rebuilt.items():
        (path,) = split_files(split, n)
        assert path.name == f"people{n}_num{len(puzzles)}.jsonl"
        with path.open() as f:
            first = [json.loads(next(f)) for _ in range(5)]
        assert first == [p.to_record() for p in puzzles[:5]], path
    assert len(load_split("test", range(2, 9))) == 700
    assert len(load_split("train", [3, 4], limit=7)) == 14


def test_missing_split_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="people9"):
        load_split("test", 9)
    with pytest.raises(ValueError, match="split"):
        load_split("dev", 3)


def test_hf_loader_reads_the_hub_layout_from_a_folder(reference_kk):
    puzzles = load_hf("test", [2, 8], repo=str(reference_kk), limit=3)
    assert [p.n_people for p in puzzles] == [2, 2, 2, 8, 8, 8]


def test_parquet_export_matches_logic_rl_file(reference_kk, tmp_path):
    reference = pd.read_parquet(reference_kk / "logic_rl_3ppl_test.parquet")
    puzzles = read_parquet(reference_kk / "logic_rl_3ppl_test.parquet")
    assert len(puzzles) == 100 and all(
        instruct_prompt(p) == row[0]["content"] for p, row in zip(puzzles, reference["prompt"])
    )
    ours = pd.read_parquet(export_parquet(puzzles, tmp_path / "kk.parquet", split="test"))
    assert list(ours.columns) == list(reference.columns)
    for column in ("quiz", "solution_text_format", "statements", "index", "data_source", "ability"):
        assert ours[column].tolist() == reference[column].tolist(), column
    for a, b in zip(ours.to_dict("records"), reference.to_dict("records")):
        assert a["prompt"][0] == b["prompt"][0]
        assert a["reward_model"]["ground_truth"] == b["reward_model"]["ground_truth"]
        assert a["reward_model"]["style"] == b["reward_model"]["style"]
        assert a["extra_info"] == b["extra_info"]
    assert read_parquet(tmp_path / "kk.parquet") == puzzles


def test_parse_people():
    assert parse_people("2-4") == [2, 3, 4]
    assert parse_people("3,5") == [3, 5]
    with pytest.raises(ValueError, match="empty"):
        parse_people("5-3")
    with pytest.raises(ValueError, match="people"):
        parse_people("x")


def test_cli_data_writes_files(tmp_path, capsys):
    out = tmp_path / "kk"
    assert (
        main(["data", "--people", "2", "3", "--train-size", "20", "--test-size", "5", "--out", str(out), "--parquet"])
        == 0
    )
    assert sorted(p.name for p in (out / "train").iterdir()) == ["people2_num20.jsonl", "people3_num20.jsonl"]
    assert len(read_parquet(out / "test.parquet")) == 10
    assert "wrote" in capsys.readouterr().out
    assert main(["data", "--people", "1", "--out", str(out)]) == 2  # a usage error, named
    assert "DataConfig.people" in capsys.readouterr().err


def test_bad_records_name_file_line_and_what_is_wrong(tmp_path):
    """A solution that contradicts its statements names the person whose statement breaks; a record with more than
    one solution, a field of the wrong type and bytes that are not UTF-8 are refused by line too."""
    from lopti_lab.kk import generate_puzzle
    from lopti_lab.kk.logic import contradiction

    p = generate_puzzle(3, seed=0)
    flipped = list(p.solution)
    flipped[0] = not flipped[0]
    speaker = contradiction(p.statements, flipped)
    assert speaker is not None  # the unique solution flipped is no solution: someone's statement breaks
    good = json.dumps(p.to_record())
    path = tmp_path / "people3_num2.jsonl"
    cases = [
        (json.dumps({**p.to_record(), "solution": flipped}), rf"line 2: the solution contradicts the statements: it "
         rf"makes {p.names[speaker]} a (knight|knave), but {p.names[speaker]}'s statement"),
        (json.dumps({**p.to_record(), "names": "Zoey"}), r"line 2: field 'names' must be a list of names"),
        ('{"quiz": "\\u00e9', r"line 2: invalid JSON at column \d+"),
    ]  # fmt: skip
    for line, message in cases:
        path.write_text(good + "\n" + line + "\n")
        with pytest.raises(ValueError, match=rf"people3_num2\.jsonl {message}"):
            load_jsonl(path)
    path.write_bytes(good.encode() + b"\n\n" + b'{"quiz": "\xff"}\n')  # a blank line 2 is skipped, line 3 is not
    with pytest.raises(ValueError, match=r"line 3: not UTF-8"):
        load_jsonl(path)
    assert load_jsonl(path, check=False, limit=1) == [p]


def test_the_solver_refuses_puzzles_it_cannot_hold():
    from lopti_lab.kk.logic import MAX_SOLVER_PEOPLE, solve

    with pytest.raises(ValueError, match=f"1..{MAX_SOLVER_PEOPLE}"):
        solve([("telling-truth", i) for i in range(MAX_SOLVER_PEOPLE + 1)], MAX_SOLVER_PEOPLE + 1)
