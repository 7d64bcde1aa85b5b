"""The bad-input table: every field of every config (TrainConfig, DemoConfig, PretrainConfig, EvalConfig,
DataConfig) with the bad values tried and the error each gets, then bad K&K files and damaged run folders. Generated
from the code into docs/bad_inputs.md, a compact table (one row per field, or per group of fields given the same
values and errors); every value with its whole message is printed by --full:

    python tests/bad_input_table.py --write docs/bad_inputs.md    # regenerate after changing a config
    python tests/bad_input_table.py --check docs/bad_inputs.md    # exit 1 if the committed table is stale
    python tests/bad_input_table.py --full                        # every case, its value and its whole error

Config cases come from two places. Every field gets wrong-type values derived from its annotation (``type_cases``:
a string where a number belongs, a number where a string belongs, ...), so a new field is tried without anyone
writing it; and each field has its own out-of-range values and inconsistent combinations in ``CASES`` below.
Each case must raise a ValueError whose message starts with the field's whole name ("TrainConfig.lr must be ...";
an error naming TrainConfig.lr_x would not do), from the config's own validation, before any model loads.
tests/test_bad_inputs.py fails if a field has no entry in CASES, if any case is accepted or names another field, or
if docs/bad_inputs.md differs from a fresh table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lopti_lab import runs
from lopti_lab.evaluate import EvalConfig
from lopti_lab.kk import generate_puzzle, load_jsonl
from lopti_lab.kk.data import DataConfig
from lopti_lab.lab.pretrain import PretrainConfig
from lopti_lab.paths import data_dir
from lopti_lab.resume import resume_point
from lopti_lab.studies.config import DemoConfig
from lopti_lab.studies.mechanism import MechanismConfig
from lopti_lab.train_config import TrainConfig

NAN, INF = math.nan, math.inf


@dataclass(frozen=True)
class Combo:
    """An inconsistent combination: these fields together (each fine alone); the case's field is the one blamed."""

    values: dict

    def __repr__(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.values.items())


# kind, value (or Combo); per config class, per field. Wrong types are added by type_cases.
CASES: dict[str, dict[str, list[tuple[str, object]]]] = {
    "TrainConfig": {
        "model": [("empty", ""), ("no such folder", "no/such/model/folder")],
        "lora_r": [("out of range", 0)],
        "lora_alpha": [("out of range", 0)],
        "lora_dropout": [("out of range", 1.0), ("out of range", -0.1)],
        "lora_targets": [("empty", ()), ("a string, not a list", "q_proj"), ("repeated", ("q_proj", "q_proj"))],
        "dtype": [
            ("unknown choice", "fp8"),
            ("inconsistent: full fine-tuning in half precision", Combo({"lora_r": None, "dtype": "bfloat16"})),
        ],
        "device": [("not a device", "tpu")],
        "gradient_checkpointing": [("a JSON string", "false")],
        "attn_implementation": [("unknown choice", "flash_attention_3")],
        "prompt_style": [("unknown choice", "poem")],
        "train_people": [("empty", ()), ("out of range", (1,)), ("repeated", (3, 3)), ("no data file", (9,))],
        "eval_people": [("out of range", (0,)), ("no data file", (9,))],
        "data_root": [("no such folder", "no/such/folder")],
        "train_limit": [("out of range", 0)],
        "prompts_per_step": [("out of range", 0)],
        "group_size": [("out of range: no group", 1)],
        "temperature": [("out of range", 0.0), ("not finite", INF)],
        "top_p": [("out of range", 0.0), ("out of range", 1.5)],
        "max_new_tokens": [("out of range", 0)],
        "max_prompt_tokens": [("out of range", 0)],
        "generate_batch_size": [("out of range", 0)],
        "fast_path": [("not a choice", "fast")],
        "optimizer": [("unknown choice", "lion")],
        "lr": [("out of range", 0.0), ("out of range", -1e-5), ("not finite", INF)],
        "weight_decay": [("out of range", -0.01)],
        "betas": [
            ("one value", (0.9,)),
            ("out of range", (0.9, 1.0)),
            ("inconsistent: an AdamW setting under SGD", Combo({"optimizer": "sgd", "betas": (0.8, 0.99)})),
        ],
        "adam_eps": [
            ("out of range", 0.0),
            ("inconsistent: an AdamW setting under SGD", Combo({"optimizer": "sgd", "adam_eps": 1e-3})),
        ],
        "warmup_steps": [("out of range", -1)],
        "grad_clip": [("out of range", 0.0)],
        "minibatch_size": [
            ("out of range", 0),
            ("inconsistent: does not divide B", Combo({"prompts_per_step": 2, "group_size": 4, "minibatch_size": 3})),
        ],
        "micro_batch_size": [
            ("out of range", 0),
            ("inconsistent: does not divide the minibatch", Combo({"minibatch_size": 256, "micro_batch_size": 3})),
        ],
        "ppo_epochs": [("out of range", 0)],
        "max_nonfinite_steps": [("out of range", -1)],
        "advantage_scale": [("unknown choice", "mean")],
        "clip_low": [("out of range", 1.0), ("out of range", -0.1)],
        "clip_high": [("out of range", -0.1)],
        "dual_clip": [("out of range", 1.0)],
        "kl_coef": [("out of range", -0.001)],
        "ar_alpha": [("out of range", 1.5), ("out of range", -0.1)],
        "lopti_eta": [("low stage empty by construction", 0.0), ("high stage empty by construction", 1.0)],
        "lopti_order": [("unknown choice", "middle")],
        "loss": [
            ("unknown choice", "grpo"),
            ("inconsistent: a covariance loss inside Lopti's stages", Combo({"loss": "kl_cov", "lopti_eta": 0.5})),
        ],
        "cispo_eps_max": [("out of range", 1.0)],
        "cov_share": [("out of range", 0.0), ("out of range", 1.5)],
        "clip_cov_band": [("one value", (1.0,)), ("not increasing", (5.0, 1.0))],
        "kl_cov_coef": [("out of range", -1.0)],
        "forking_rho": [("out of range", 0.0), ("out of range", 1.5)],
        "entropy_adv_alpha": [("out of range", 0.0)],
        "entropy_adv_kappa": [("out of range", 1.0)],
        "steps": [("out of range", 0)],
        "seed": [("out of range", -1), ("out of range", 2**32)],
        "eval_every": [("out of range", -1)],
        "eval_size": [("out of range", 0)],
        "eval_modes": [
            ("unknown choice", ("beam",)),
            ("repeated", ("greedy", "greedy")),
            ("inconsistent: no mode", Combo({"eval_people": (3,), "eval_modes": ()})),
        ],
        "eval_samples": [("out of range", 0)],
        "eval_temperature": [("out of range", 0.0)],
        "eval_max_new_tokens": [("out of range", 0)],
        "eval_full_steps": [
            ("out of range", (0,)),
            ("past the last step", Combo({"steps": 10, "eval_full_steps": (20,)})),
            ("repeated", (5, 5)),
        ],
        "eval_full_samples": [("out of range", 0), ("inconsistent: without eval_full_steps", 8)],
        "probe_every": [("out of range", -1)],
        "probe_shift": [("a JSON string", "false")],
        "shift_every": [("out of range", -1)],
        "shift_rows": [("out of range", 0)],
        "probe_bins": [("does not reach 1", (0.0, 0.5)), ("not increasing", (0.0, 0.5, 0.5, 1.0))],
        "save_every": [("out of range", -1)],
        "run_dir": [("empty", "")],
        "progress": [("a JSON string", "false")],
    },
    "DemoConfig": {
        "out": [("empty", "")],
        "seeds": [("out of range", 0)],
        "methods": [("unknown method", ("PPO",)), ("empty", ()), ("repeated", ("GRPO", "GRPO"))],
        "train": [
            ("unknown field", {"width": 3}),
            ("out of range", {"lr": 0.0}),
            ("inconsistent: does not divide B = 8 x 8", {"minibatch_size": 3}),
            ("no data file", {"train_people": (9,)}),
            ("no such folder", {"model": "no/such/model/folder"}),
            ("set per run: the seed", {"seed": 3}),
            ("set per run: a method switch", {"ar_alpha": 0.3}),
        ],
        "quick": [("a JSON string", "false")],
        "cache_warm_start": [("a JSON string", "false")],
        "threads": [("out of range", 0)],
        "workers": [("out of range", 0)],
    },
    "MechanismConfig": {
        "out": [("empty", "")],
        "seeds": [("out of range", 0)],
        "methods": [("unknown method", ("PPO",)), ("empty", ())],
        "train": [
            ("out of range", {"steps": 0}),
            ("set by each optimizer setting", {"lr": 1e-2}),
            ("set per run: a method switch", {"lopti_eta": 0.5}),
        ],
        "quick": [("a JSON string", "false")],
        "threads": [("out of range", 0)],
        "workers": [("out of range", 0)],
        "optimizers": [("unknown setting", ("lion",)), ("empty", ()), ("repeated", ("sgd", "sgd"))],
        "step_sizes": [("out of range", (0.0,)), ("not finite", (INF,)), ("empty", ())],
        "frozen_puzzles": [("out of range", 0)],
    },
    "EvalConfig": {
        "model": [
            ("no such folder", "no/such/model/folder"),
            ("inconsistent: and a run", Combo({"run": "."})),
            ("inconsistent: neither", Combo({"model": None, "run": None})),
        ],
        "run": [("no such folder", Combo({"model": None, "run": "no/such/run"}))],
        "step": [("out of range", 0), ("inconsistent: a step without a run", Combo({"step": 3}))],
        "people": [("empty", ()), ("out of range", (1,)), ("no data file", (9,))],
        "size": [("out of range", 0)],
        "modes": [("unknown choice", ("beam",)), ("empty", ())],
        "samples": [("out of range", 0)],
        "temperature": [("out of range", 0.0)],
        "max_new_tokens": [("out of range", 0)],
        "prompt_style": [("unknown choice", "poem")],
        "data_root": [("no such folder", "no/such/folder")],
        "batch_size": [("out of range", 0)],
        "device": [("empty", "")],
        "dtype": [("unknown choice", "fp8")],
        "seed": [("out of range", -1)],
        "json": [("empty", "")],
    },
    "DataConfig": {
        "people": [("empty", ()), ("out of range", (1,)), ("out of range", (21,)), ("repeated", (3, 3))],
        "train_size": [("out of range", 0)],
        "test_size": [("out of range", 0)],
        "seed": [("out of range", -1)],
        "out": [("empty", "")],
        "parquet": [("a JSON string", "false")],
    },
    "PretrainConfig": {
        "people": [
            ("empty", ()),
            ("out of range", (1,)),
            ("no data file", Combo({"people": (9,), "people_weights": (1.0,)})),
        ],
        "people_weights": [
            ("inconsistent: one weight for two counts", Combo({"people": (2, 3), "people_weights": (1.0,)})),
            ("all zero", (0.0, 0.0, 0.0, 0.0)),
            ("negative", (-1.0, 1.0, 1.0, 1.0)),
        ],
        "curriculum_steps": [("out of range", -1)],
        "steps": [("out of range", 0)],
        "max_minutes": [("out of range", 0.0)],
        "batch_size": [("out of range", 0)],
        "lr": [("out of range", 0.0)],
        "warmup_steps": [("out of range", -1)],
        "min_lr_ratio": [("out of range", 1.5)],
        "weight_decay": [("out of range", -0.01)],
        "grad_clip": [("out of range", 0.0)],
        "seed": [("out of range", -1)],
        "eval_every": [("out of range", 0)],
        "eval_size": [("out of range", 0)],
        "final_people": [("empty", ()), ("no data file", (9,))],
        "final_samples": [("out of range", 0)],
        "final_size": [("out of range", 0)],
        "spec": [
            ("unknown field", {"width": 3}),
            ("inconsistent: odd heads", {"hidden_size": 100}),
            ("inconsistent: KV heads", {"num_key_value_heads": 3}),
            ("out of range", {"num_hidden_layers": 0}),
        ],
        "trace": [
            ("unknown field", {"order": "random"}),
            ("out of range: slip", {"slip": 0.7}),
            ("repeated words", {"passes": ("ok", "ok")}),
            ("two-word leaf role", {"leaf_roles": ("in fact",)}),
            ("inconsistent: coded lines restated", {"coded": True, "restate_line": True}),
            ("inconsistent: numbered quiz without codes", {"numbered_quiz": True}),
            ("inconsistent: bare quiz without numbers", {"coded": True, "bare_quiz": True}),
            ("inconsistent: numbers only without codes", {"numbers_only": True}),
            ("inconsistent: answer roster without codes", {"answer_roster": True}),
            ("inconsistent: numbers first without numbers only", {"coded": True, "number_first": True}),
            ("opener that opens a line", {"check_openers": ("Try",)}),
        ],
        "length_buckets": [("out of range", 0)],
        "max_new_tokens": [("out of range", 0)],
        "threads": [("out of range", 0)],
        "init_from": [("not a lab model folder", "no/such/lab_model")],
        "autocast": [("not a choice", "float16")],
        "stop_after": [("out of range", 0)],
    },
}


def config_classes() -> dict[str, type]:
    return {
        "TrainConfig": TrainConfig,
        "DemoConfig": DemoConfig,
        "MechanismConfig": MechanismConfig,
        "PretrainConfig": PretrainConfig,
        "EvalConfig": EvalConfig,
        "DataConfig": DataConfig,
    }


BASES = {"EvalConfig": {"model": "lab"}}
"""The fields a config needs beyond its defaults to be valid (the base each case changes)."""


def type_cases(annotation) -> list[tuple[str, object]]:
    """Wrong-type values for a field annotation (``X | None`` as X: None is a valid value there).

    >>> type_cases(int)
    [('wrong type', '8'), ('wrong type', 2.5), ('wrong type: a bool', True)]
    """
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:
        (annotation,) = [a for a in args if a is not type(None)]
    base = typing.get_origin(annotation) or annotation
    if base is bool:
        return [("wrong type", "yes"), ("wrong type: an int", 1)]
    if base is int:
        return [("wrong type", "8"), ("wrong type", 2.5), ("wrong type: a bool", True)]
    if base is float:
        return [("wrong type", "0.5"), ("not finite", NAN)]
    if base is str:
        return [("wrong type", 3)]
    if base is tuple:
        return [("wrong type", 7)]
    if dataclasses.is_dataclass(base):
        return [("wrong type", "big")]
    raise TypeError(f"bad_inputs.type_cases: no wrong-type values for {annotation!r}; add them")


@dataclass
class Row:
    section: str
    subject: str
    """the field ("TrainConfig.lr"), file or folder case"""
    kind: str
    value: str
    error: str
    """the message, or "ACCEPTED" when nothing was raised (a failing row)"""
    ok: bool
    typed: bool = False
    """a wrong-type value derived from the field's annotation (``type_cases``), not one of its own ``CASES``"""


def config_rows() -> list[Row]:
    """Every config case, tried: the config built from its defaults with the bad value(s) replaced."""
    rows = []
    for owner, cls in config_classes().items():
        hints = typing.get_type_hints(cls)
        base = cls(**BASES.get(owner, {}))
        for f in dataclasses.fields(cls):
            typed = [(kind, value, True) for kind, value in type_cases(hints[f.name])]
            own = [(kind, value, False) for kind, value in CASES[owner].get(f.name, [])]
            for kind, value, derived in typed + own:
                values = value.values if isinstance(value, Combo) else {f.name: value}
                error = _raised(lambda: replace(base, **values))  # noqa: B023 (called at once)
                ok = error is not None and _names(error, f"{owner}.{f.name}")
                rows.append(Row(owner, f"{owner}.{f.name}", kind, _show(value), error or "ACCEPTED", ok, derived))
    return rows


def _names(error: str, subject: str) -> bool:
    """Whether the error starts with the field's name, as a whole name: 'PretrainConfig.people_weights must ...'
    does not name PretrainConfig.people."""
    return error.startswith(subject) and not error[len(subject) : len(subject) + 1].isidentifier()


def _raised(build: Callable[[], object]) -> str | None:
    try:
        build()
    except ValueError as err:
        return _portable(str(err))
    return None


def _show(value) -> str:
    return repr(value)


def _portable(text: str, *folders: Path) -> str:
    """The message with machine-specific folders replaced: the bundled data as <data>, temporary folders by name."""
    text = text.replace(str(data_dir()), "<data>")
    for folder in folders:
        text = text.replace(str(folder), folder.name)
    return text


# --- K&K files ----------------------------------------------------------------------------------------------------


def kk_rows() -> list[Row]:
    """Bad K&K JSONL lines: each written as line 2 of people3_num2.jsonl (line 1 a good record), then loaded."""
    good = generate_puzzle(3, seed=0).to_record()
    flipped = {**good, "solution": [not k for k in good["solution"][:1]] + good["solution"][1:]}
    two_solutions = {**generate_puzzle(2, seed=0).to_record(), "statements": "(('telling-truth', 0), "
                     "('telling-truth', 1))", "solution": [True, True]}  # fmt: skip
    cases = [
        ("invalid JSON", b'{"quiz": "A very special island'),
        ("not UTF-8", b'{"quiz": "\xff\xfe"}'),
        ("nested too deeply", b"[" * 100_000),
        ("not a record", b"[1, 2, 3]"),
        ("missing field", _line({k: v for k, v in good.items() if k != "solution"})),
        ("names: a string", _line({**good, "names": "Zoey"})),
        ("solution: words", _line({**good, "solution": ["knight", "knave", "knight"]})),
        ("index: a string", _line({**good, "index": "7"})),
        ("names repeat", _line({**good, "names": ["Zoey", "Zoey", "Emma"]})),
        ("too many people", _line({**good, "names": [f"P{i}" for i in range(25)], "solution": [True] * 25})),
        ("statements do not parse", _line({**good, "statements": "(('lying', 1), ('telling-truth'"})),
        ("statements: code", _line({**good, "statements": "__import__('os').system('true')"})),
        ("unknown operator", _line({**good, "statements": "(('xor', ('lying', 1)), ('lying', 0), ('lying', 1))"})),
        ("person out of range", _line({**good, "statements": "(('lying', 5), ('lying', 0), ('lying', 1))"})),
        ("statements for 2 of 3 people", _line({**good, "statements": "(('lying', 1), ('lying', 0))"})),
        ("solution contradicts the statements", _line(flipped)),
        ("more than one solution", _line(two_solutions)),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "people3_num2.jsonl"
        for kind, line in cases:
            file.write_bytes(_line(good) + b"\n" + line + b"\n")
            error = _raised(lambda: load_jsonl(file))
            error = None if error is None else error.replace(str(file), file.name)
            ok = error is not None and error.startswith(f"{file.name} line 2:")
            rows.append(Row("K&K file", file.name, kind, _clip(line), error or "ACCEPTED", ok))
    return rows


def _line(record: dict) -> bytes:
    return json.dumps(record).encode()


def _clip(line: bytes) -> str:
    text = line.decode("utf-8", "backslashreplace")
    return text if len(text) <= 60 else text[:57] + "..."


# --- run folders ----------------------------------------------------------------------------------------------------


def run_folder_rows() -> list[Row]:
    """A small real run folder (a Linear layer's checkpoints at steps 2 and 4, records 1-5), damaged one way at a
    time, then checked as `train(resume=True)` checks it before loading any model (``resume.resume_point``)."""
    rows = []
    for kind, damage in _damages():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "run"
            cfg = TrainConfig(run_dir=str(folder), steps=6, save_every=2)
            _small_run(folder, cfg)
            damage(folder, cfg)
            try:
                point = resume_point(replace(cfg, steps=cfg.steps if "steps" not in kind else 3))
                text, ok = "repaired: " + "; ".join(point.notes) if point.notes else "ACCEPTED", bool(point.notes)
            except (runs.RunFolderError, ValueError) as err:
                text, ok = str(err), isinstance(err, runs.RunFolderError)
            text = _portable(text.replace(str(folder), "run"))
            rows.append(Row("run folder", "run", kind, "", text, ok))
    return rows


def _small_run(folder: Path, cfg) -> None:
    run = runs.RunFolder(folder)
    run.write_config(cfg.to_dict())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(1, 6):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        run.log({"step": step, "reward/mean": float(step)})
        if step % 2 == 0:
            runs.save_checkpoint(folder, step, model, optimizer)


def _damages() -> Iterator[tuple[str, Callable]]:
    def lines(folder: Path) -> list[str]:
        return (folder / "metrics.jsonl").read_text().splitlines()

    def set_lines(folder: Path, new: list[str], end: str = "\n") -> None:
        (folder / "metrics.jsonl").write_text("\n".join(new) + end)

    def config(folder: Path, text: str) -> None:
        (folder / "config.json").write_text(text)

    def checkpoint(folder: Path) -> Path:
        return folder / "checkpoints" / "step_4"

    yield "no run (empty folder)", lambda f, c: [p.unlink() for p in f.rglob("*") if p.is_file()]
    yield "config.json not JSON", lambda f, c: config(f, '{"lr": 1e-6,\n "steps": }')
    yield "config.json no longer validates", lambda f, c: config(f, json.dumps({**c.to_dict(), "lr": -1}))
    yield "config.json unknown field", lambda f, c: config(f, json.dumps({**c.to_dict(), "alpha": 0.3}))
    yield "config differs (not resumable)", lambda f, c: config(f, json.dumps({**c.to_dict(), "lr": 1e-3}))
    yield "resume past TrainConfig.steps", lambda f, c: None
    yield "damaged line in the middle", lambda f, c: set_lines(f, [lines(f)[0], '{"step": 2, "rew', *lines(f)[2:]])
    yield "a step doubled", lambda f, c: set_lines(f, [*lines(f)[:2], lines(f)[1], *lines(f)[2:]])
    yield "a step missing", lambda f, c: set_lines(f, [lines(f)[0], *lines(f)[2:]])
    yield "latest names a missing folder", lambda f, c: (f / "checkpoints" / "latest").write_text("step_8\n")
    yield "latest is garbage", lambda f, c: (f / "checkpoints" / "latest").write_text("\x00\x00\n")
    yield "partial checkpoint (truncated file)", lambda f, c: _truncate(checkpoint(f) / "optimizer.pt")
    yield "damaged checkpoint (one byte)", lambda f, c: _flip(checkpoint(f) / "model.safetensors")
    yield "checkpoint without state.json", lambda f, c: (checkpoint(f) / "state.json").unlink()
    yield "checkpoint file missing", lambda f, c: (checkpoint(f) / "rng.pt").unlink()
    yield "torn last line (kill mid-append)", lambda f, c: set_lines(f, [*lines(f), '{"step": 6, "re'], end="")
    yield "last line lost, checkpoint survived", lambda f, c: set_lines(f, lines(f)[:3])


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:100])


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))


# --- the document ---------------------------------------------------------------------------------------------------


def all_rows() -> list[Row]:
    return config_rows() + kk_rows() + run_folder_rows()


INTRO = (
    """What lopti_lab refuses, and what it says. A bad config field is refused by the config's own validation before
any model loads, with an error that starts with the field's name (`TrainConfig.lr must be ...`); a bad K&K line by
`kk.load_jsonl`, naming the file and line; a damaged run folder as `train(resume=True)` checks it, before any model
loads (`repaired:`: the resume fixes the folder and says so)."""
).replace("\n", " ")

HOW = (
    """A row holds the config fields given the same values and errors: the values of their own (every field is also
given a wrong type: `'8'`, `2.5`, `True` for an int; `'0.5'`, `nan` for a number; `3` for a string; `'yes'`, `1`
for a flag; `7` for a list) and each distinct error, without the field's name and the `got <value>` behind.
Generated by `python tests/bad_input_table.py --write docs/bad_inputs.md` (`--full`: every value, every whole
message); tests/test_bad_inputs.py tries every value and fails when this page is stale."""
).replace("\n", " ")

MESSAGE_CHARS = 60
"""An error message is cut to this many characters on the page (`--full` prints it whole)."""


def markdown(rows: list[Row]) -> str:
    """docs/bad_inputs.md: a table per section, one row per config field (its values, its distinct errors)."""
    counts = _counts(rows)
    out = ["# Bad inputs and the errors they get", "", INTRO, "",
           f"{len(rows)} bad inputs: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", "", HOW]  # fmt: skip
    for section in counts:
        these = [r for r in rows if r.section == section]
        if section in config_classes():
            out += ["", f"## {section}", "", "| fields | values tried | error |", "|---|---|---|"]
            alike: dict[tuple[str, str], list[str]] = {}  # fields given the same values and errors share a row
            for subject in dict.fromkeys(r.subject for r in these):
                field = [r for r in these if r.subject == subject]
                shown = [r for r in field if not r.typed] or field
                values = " ".join(_cell(r.value) for r in shown)
                errors = "; ".join(dict.fromkeys(_short(r.error, subject) for r in field))
                alike.setdefault((values, errors), []).append(f"`{subject.split('.', 1)[1]}`")
            out += [f"| {', '.join(names)} | {vals} | {_escape(errs)} |" for (vals, errs), names in alike.items()]
        else:
            prefix = f"{these[0].subject} line 2: " if section == "K&K file" else ""
            where = (f"Each case is written as line 2 of `{these[0].subject}` (line 1 a good record); every error "
                     f"starts with `{prefix.strip()}`." if prefix else "A small real run folder, `run`, damaged one "
                     "way at a time.")  # fmt: skip
            out += ["", f"## {section}", "", where, "", "| case | error |", "|---|---|"]
            out += [f"| {r.kind} | {_escape(_cut(r.error.removeprefix(prefix)))} |" for r in these]
    return "\n".join(out) + "\n"


def full_markdown(rows: list[Row]) -> str:
    """Every row with its whole message (``--full``): a table per section."""
    out = ["# Bad inputs and the errors they get (every value)", "", INTRO]
    for section in _counts(rows):
        out += ["", f"## {section}", "", "| input | bad value | kind | error |", "|---|---|---|---|"]
        out += [f"| {_cell(r.subject)} | {_cell(r.value)} | {r.kind} | {_cell(r.error)} |" for r in rows
                if r.section == section]  # fmt: skip
    return "\n".join(out) + "\n"


def _short(error: str, subject: str) -> str:
    """An error as the compact table shows it: the field's name cut where the row already says it, and the bad
    value behind cut.

    'TrainConfig.lora_r must be an int >= 1 or None, got 0', 'TrainConfig.lora_r' -> 'must be an int >= 1 or None'
    'DemoConfig.train.lr must be a finite number > 0, got 0.0', 'DemoConfig.train' -> 'train.lr must be a ...'
    """
    rest = error.removeprefix(subject)
    if rest.startswith((" must ", " is ", " needs ", ":")):
        text = rest.removeprefix(":").strip()
    else:
        text = error.removeprefix(subject.split(".", 1)[0] + ".")
    return _cut(text.split(", got ", 1)[0])


def _cut(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3].rstrip() + "..."


def _counts(rows: list[Row]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.section] = counts.get(r.section, 0) + 1
    return counts


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'").replace("\n", " ") + "`" if text else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", help="write the table to this file")
    group.add_argument("--check", help="exit 1 if this file differs from a fresh table")
    group.add_argument("--full", action="store_true", help="print every value with its whole error message")
    args = parser.parse_args(argv)
    rows = all_rows()
    text = markdown(rows)
    bad = [r for r in rows if not r.ok]
    for r in bad:
        print(f"not refused by name: {r.subject} = {r.value} ({r.kind}): {r.error}")
    if args.full:
        print(full_markdown(rows), end="")
    elif args.write:
        Path(args.write).write_text(text, encoding="utf-8")
        print(f"wrote {args.write}: {len(rows)} bad inputs")
    elif Path(args.check).read_text(encoding="utf-8") != text:
        print(f"{args.check} is stale: run python tests/bad_input_table.py --write {args.check}")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
