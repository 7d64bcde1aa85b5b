"""The ``lopti-lab`` command. Every subcommand is one config dataclass and one function that runs it:

    lopti-lab data      kk.data.DataConfig            build K&K datasets
    lopti-lab train     train_config.TrainConfig      GRPO with AR (--ar ALPHA) and Lopti (--lopti ETA)
    lopti-lab eval      evaluate.EvalConfig           test accuracy of a model or a run
    lopti-lab pretrain  lab.pretrain.PretrainConfig   the lab model's warm start
    lopti-lab demo      studies.config.DemoConfig     the four methods on the lab model, and a report
    lopti-lab hardlab   studies.config.HardLabConfig  the four methods on the hard lab model (docs/hard_lab.md)
    lopti-lab confirm   studies.config.ConfirmConfig  the hard lab's confirmatory study, seeds 5-14 (docs/hard_lab.md)
    lopti-lab mechanism studies.mechanism.MechanismConfig
                                                  the paper's Fig. 1 and Fig. 3, as it measured them
    lopti-lab plan      train_config.TrainConfig      a step's peak GPU memory and whether it fits (plan.py)

Each builds its options the same way (``add_config_options``): one option per field, named after it (``--lora-r``),
its help the docstring under the field; a nested config's fields are options too (``lopti-lab demo --lr`` sets
``DemoConfig.train.lr``). ``--config FILE`` reads a JSON object of fields the same way for every subcommand, and the
options given override it. A usage error (an unknown or bad field, a bad file, a run folder that cannot resume)
prints the message naming the field or file and exits 2, before any model loads. Only the chosen subcommand's
config module is imported, so ``lopti-lab data`` never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lopti_lab.configs import field_docs, from_dict, nested_config, read_json
from lopti_lab.durable import DiskFullError
from lopti_lab.runs import RunFolderError

__all__ = ["COMMANDS", "Command", "add_config_options", "build_parser", "main"]

USAGE_ERROR = 2
"""Exit code of every usage error (argparse's own too), and of a run folder that cannot be written (damaged, or
another process's)."""
NONFINITE_STOP = 3
"""Exit code of ``train`` stopped by non-finite steps (the run is saved and resumable)."""
NO_ROOM = 4
"""Exit code of a run stopped by a full disk, a quota or a read-only file system (durable.DiskFullError): every
finished step is kept; free space and run the command again (``train``: with ``--resume``)."""
INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT): every finished step is kept and no worker process is left behind."""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    config: str
    """"module:Class" of the config dataclass (imported only when this subcommand is chosen)"""
    flatten: tuple[str, ...] = ()
    """nested config fields whose own fields become options"""
    skip: tuple[str, ...] = ()
    """fields (dotted for nested ones) that get no option"""
    aliases: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def skipped(self, cls: type) -> tuple[str, ...]:
        """``skip`` and, for a study, the ``train`` fields it sets per run (its config's ``SET_PER_RUN``)."""
        return (*self.skip, *(f"train.{name}" for name in getattr(cls, "SET_PER_RUN", ())))


def _study(name: str, help: str, config: str) -> Command:
    """A study's command (``studies.config.StudyConfig``): its shared TrainConfig's fields become options, except those
    each run sets itself (the config's ``SET_PER_RUN``, read when the command is chosen)."""
    return Command(name, help, config, flatten=("train",))


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command(
            "data", "build K&K train/test datasets (JSONL, optionally Logic-RL parquet)", "lopti_lab.kk.data:DataConfig"
        ),
        Command(
            "train",
            "train a GRPO policy on K&K (AR: --ar ALPHA, Lopti: --lopti ETA)",
            "lopti_lab.train_config:TrainConfig",
            aliases={"ar_alpha": ("--ar",), "lopti_eta": ("--lopti",), "model": ("-m",)},
        ),
        Command(
            "eval", "K&K test accuracy of a model or a trained run, by people count", "lopti_lab.evaluate:EvalConfig"
        ),
        Command(
            "pretrain",
            "train the lab model's warm start from scratch (CPU, <= 60 min)",
            "lopti_lab.lab.pretrain:PretrainConfig",
            flatten=("spec",),
        ),
        _study(
            "demo",
            "GRPO, +AR, +Lopti, +AR+Lopti on the lab model (CPU) and a report",
            "lopti_lab.studies.config:DemoConfig",
        ),
        _study(
            "hardlab",
            "the four methods on the hard lab model, 5 seeds x 60 steps, and a report (CPU, about 3 hours on 2 cores)",
            "lopti_lab.studies.config:HardLabConfig",
        ),
        _study(
            "confirm",
            "the hard lab's pre-registered confirmatory study: GRPO, +AR, +Lopti on fresh seeds 5-14, and a report",
            "lopti_lab.studies.config:ConfirmConfig",
        ),
        _study(
            "mechanism",
            "the paper's Fig. 1 and Fig. 3 measured as it measured them, under SGD and AdamW (CPU, <= 20 min)",
            "lopti_lab.studies.mechanism:MechanismConfig",
        ),
        Command(
            "plan",
            "a training step's peak GPU memory, component by component, and whether it fits a GPU (--gpu, --matrix)",
            "lopti_lab.train_config:TrainConfig",
            aliases={"model": ("-m",)},
        ),
    )
}


def config_class(command: Command) -> type:
    module, name = command.config.split(":")
    return getattr(importlib.import_module(module), name)


# --- options from a config dataclass -------------------------------------------------------------------------------


def _none_or(kind: type) -> Callable[[str], Any]:
    """A parser of ``kind`` that also reads "none" / "null" / "off" as None (for ``X | None`` fields)."""

    def parse(text: str):
        return None if text.lower() in ("none", "null", "off") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def _scalar(hint) -> tuple[type, bool, bool]:
    """(item type, optional, is a tuple) of a field annotation such as ``int | None`` or ``tuple[float, ...]``."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    optional = type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        kinds = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return (kinds.pop() if len(kinds) == 1 else str), optional, True
    return hint, optional, False


def add_config_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    flatten: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    aliases: Mapping[str, tuple[str, ...]] | None = None,
    prefix: str = "",
) -> None:
    """One option per field of ``cls`` (``dest`` the field's dotted name, default unset), and per field of each
    nested config in ``flatten``; a nested config not flattened (``PretrainConfig.trace``) is set by ``--config``."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dest = prefix + f.name
        if dest in skip:
            continue
        nested = nested_config(cls, f.name)
        if nested is not None:
            if f.name in flatten:
                add_config_options(parser, nested, skip=skip, prefix=f"{dest}.")
            continue
        kind, optional, many = _scalar(hints[f.name])
        flags = [f"--{f.name.replace('_', '-')}", *(aliases or {}).get(f.name, ())]
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": dest,
                                  "help": docs.get(f.name, "").replace("%", "%%")}  # fmt: skip
        if kind is not bool:
            kwargs["metavar"] = f.name.upper()
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif many:
            kwargs.update(nargs="*", type=kind)
        else:
            kwargs["type"] = _none_or(kind) if optional else kind
        parser.add_argument(*flags, **kwargs)


def given_values(args: argparse.Namespace) -> dict:
    """The options given, as a (nested) dict of fields: {"seeds": 3, "train": {"lr": 0.001}}."""
    values: dict = {}
    for dest, value in vars(args).items():
        if dest.startswith("_") or dest in ("func", "command"):
            continue
        *parents, name = dest.split(".")
        target = values
        for parent in parents:
            target = target.setdefault(parent, {})
        target[name] = value
    return values


def merged(base: Mapping, given: Mapping) -> dict:
    """``given`` over ``base``, nested objects merged field by field."""
    out = dict(base)
    for key, value in given.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
        )
    return out


# --- the parser and the commands -----------------------------------------------------------------------------------


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lopti-lab", description="Token-level credit in LLM RL: GRPO, AR and Lopti")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS.values():
        if only is not None and only != command.name:
            sub.add_parser(command.name, help=command.help)  # listed in --help, options built only when chosen
            continue
        cls = config_class(command)
        p = sub.add_parser(
            command.name, help=command.help, description=(cls.__doc__ or "").split("\n\n")[0], allow_abbrev=False
        )  # "--seed" must not pass for "--seeds"
        p.add_argument("--config", dest="_config", metavar="FILE", help=f"a JSON file of {cls.__name__} fields (the "
                       "options given override it)")  # fmt: skip
        EXTRA_OPTIONS.get(command.name, lambda p: None)(p)
        add_config_options(p, cls, flatten=command.flatten, skip=command.skipped(cls), aliases=command.aliases)
    return parser


def _train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", dest="_resume", action="store_true", help="continue the run in --run-dir from its "
                   "latest checkpoint (its config.json gives every option not given)")  # fmt: skip


def _pretrain_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", dest="_out", default="data/lab_model", metavar="FOLDER", help="output folder (default "
                   "data/lab_model)")  # fmt: skip


def _plan_options(p: argparse.ArgumentParser) -> None:
    from lopti_lab.plan import GPUS

    p.add_argument("--gpu", dest="_gpu", default="t4", choices=list(GPUS), help="the GPU to plan for (default t4)")
    p.add_argument("--matrix", dest="_matrix", action="store_true", help="the peaks of Qwen2.5 0.5B-7B on a "
                   "T4, A100-40 and H100 at the notebook's and the paper's settings, not one table")  # fmt: skip
    p.add_argument("--defaults", dest="_defaults", action="store_true", help="what the notebooks choose on each "
                   "GPU (model, precision, batch sizes, probe cadence), as a markdown table")  # fmt: skip


EXTRA_OPTIONS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "train": _train_options,
    "pretrain": _pretrain_options,
    "plan": _plan_options,
}
"""Options that are not config fields: how to run, not what."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen is not None and chosen not in COMMANDS:
        print(f"lopti-lab: unknown command {chosen!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return USAGE_ERROR
    parser = build_parser(chosen)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return USAGE_ERROR
    command = COMMANDS[args.command]
    try:
        config = _config(command, args)
    except (ValueError, TypeError) as err:  # a field (ConfigError, the config's own checks) or a run folder
        print(f"lopti-lab {command.name}: {err}", file=sys.stderr)
        return USAGE_ERROR
    try:
        return int(RUNNERS[command.name](config, args) or 0)
    except RunFolderError as err:  # a damaged folder, or one another process is writing (before any model loads)
        print(f"lopti-lab {command.name}: {err}", file=sys.stderr)
        return USAGE_ERROR
    except DiskFullError as err:
        print(f"lopti-lab {command.name}: stopped: {err}", file=sys.stderr)
        return NO_ROOM
    except KeyboardInterrupt:
        again = "the same command with --resume" if command.name == "train" else "the same command"
        print(
            f"\nlopti-lab {command.name}: interrupted; every finished step is kept, {again} continues", file=sys.stderr
        )
        return INTERRUPTED


def _config(command: Command, args: argparse.Namespace):
    """The chosen subcommand's config: its --config file (or, for ``train --resume``, the run's config.json), the
    options given over it."""
    cls = config_class(command)
    base = {}
    if args._config:
        base = _pretrain_file(args._config) if command.name == "pretrain" else read_json(args._config)
    elif command.name == "train" and args._resume:
        base = _resume_base(getattr(args, "run_dir", None))
    return from_dict(cls, merged(base, given_values(args)))


def _pretrain_file(file: str) -> dict:
    from lopti_lab.lab.pretrain import config_fields

    return config_fields(file)


def _resume_base(run_dir: str | None) -> dict:
    """On ``train --resume``, the run's own config.json gives every option not given."""
    from lopti_lab import runs
    from lopti_lab.resume import check_resume

    if run_dir is None:
        raise runs.RunFolderError("--resume needs --run-dir, the folder of the run to continue")
    if not (Path(run_dir) / runs.CONFIG).is_file():
        check_resume(run_dir)  # raises: the folder holds no run
    return runs.load_config(run_dir)


def run_data(config, args) -> int:
    built = config.build(progress=True)
    counts = ", ".join(f"{s}/{n}ppl: {len(ps)}" for (s, n), ps in sorted(built.items()))
    print(f"wrote {config.out} ({counts})")
    return 0


def run_train(config, args) -> int:
    """Exit codes: 0 done, 2 a run folder that cannot be used (before any model loads), 3 stopped by non-finite
    steps (resumable), 4 a full disk (resumable), 130 Ctrl-C (resumable)."""
    from lopti_lab.trainer import NonFiniteError, train

    try:
        result = train(config, resume=args._resume)
    except NonFiniteError as err:
        print(f"lopti-lab train: {err}", file=sys.stderr)
        return NONFINITE_STOP
    last = result.history[-1] if result.history else {}
    print(f"{config.method}: {len(result.history)} steps in {result.run_dir}")
    for key in sorted(k for k in last if k.startswith(("eval/", "acc/all", "reward/mean"))):
        print(f"  {key:32s} {last[key]:.4f}")
    return 0


def run_eval(config, args) -> int:
    from lopti_lab.evaluate import evaluate
    from lopti_lab.kk import load_split
    from lopti_lab.models import load_policy, prompt_style_of
    from lopti_lab.trainer import load_trained

    if config.run is not None:
        model, tokenizer, cfg = load_trained(config.run, config.step, config.device)
        style, root = config.prompt_style or cfg.prompt_style, config.data_root or cfg.data_root
    else:
        model, tokenizer = load_policy(config.model, lora=None, dtype=config.dtype, device=config.device)
        style, root = config.prompt_style or prompt_style_of(config.model) or "instruct", config.data_root
    metrics = evaluate(model, tokenizer, load_split("test", config.people, root, config.size), config.spec(style))
    for key, value in metrics.items():
        print(f"{key:32s} {value:.4f}")
    if config.json:
        Path(config.json).write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return 0


def run_pretrain(config, args) -> int:
    from lopti_lab.lab.pretrain import pretrain

    summary = pretrain(config, args._out)
    final = summary["final_eval"]
    accs = "; ".join(
        f"{mode} " + ", ".join(f"{n} people {final[f'test/{mode}/acc_{n}ppl']:.0%}" for n in config.final_people)
        for mode in ("greedy", "sample")
    )
    print(f"saved {args._out} after {summary['steps_done']} steps in {summary['minutes']:.1f} min; test: {accs}")
    return 0


def run_mechanism(config, args) -> int:
    from lopti_lab.studies.mechanism import run_mechanism as mechanism

    report = mechanism(config)
    print(f"report: {report / 'report.md'}")
    return 0


def run_demo(config, args) -> int:
    from lopti_lab.studies.run import run_demo as demo

    report = demo(config)
    print(f"report: {report / 'report.md'}")
    return 0


def run_plan(config, args) -> int:
    """Exit codes: 0 the step fits the GPU (or --matrix), 1 it does not (the message names the fields to lower)."""
    import pandas as pd

    from lopti_lab import plan

    with pd.option_context("display.width", 200, "display.max_colwidth", 80, "display.max_columns", 10):
        if args._defaults:
            from lopti_lab.notebook import gpu_defaults_markdown

            print(gpu_defaults_markdown())
            return 0
        if args._matrix:
            print(plan.plan_matrix(_plan_settings(), [f"Qwen/Qwen2.5-{n}-Instruct" for n in ("0.5B", "1.5B", "3B",
                  "7B")], ["t4", "a100-40", "h100"]).to_string(index=False))  # fmt: skip
            return 0
        model_config = plan.model_config(config.model)
        print(plan.estimate(config, model_config, args._gpu).table().to_string(index=False, float_format="%.2f"))
    try:
        fits = plan.check_fits(config, model_config, args._gpu)
    except ValueError as err:
        print(f"does not fit: {err}")
        return 1
    gpu = plan.GPUS[args._gpu]
    print(f"fits: peak ~{fits.peak / plan.GiB:.1f} GiB ({fits.peak_phase} phase) of the {gpu.label}'s "
          f"{gpu.usable / plan.GiB:.1f} GiB")  # fmt: skip
    return 0


def _plan_settings() -> dict:
    """The matrix's two settings: the notebook's (notebook.training_defaults on a GPU, LoRA r=16) and the paper's
    (TrainConfig's defaults: 64 prompts x 8, 4096 new tokens, minibatch 256, full fine-tuning)."""
    from lopti_lab.notebook import Environment, training_defaults
    from lopti_lab.train_config import TrainConfig

    def notebook(model: str):
        env = Environment(in_colab=False, device="cuda", model=model, lora_r=16, prompt_style="instruct", quick=False)
        return training_defaults(env)

    return {"notebook": notebook, "paper": lambda model: TrainConfig(model=model, lora_r=None)}


RUNNERS: dict[str, Callable[[Any, argparse.Namespace], int]] = {
    "data": run_data,
    "train": run_train,
    "eval": run_eval,
    "pretrain": run_pretrain,
    "demo": run_demo,
    "hardlab": run_demo,
    "confirm": run_demo,
    "mechanism": run_mechanism,
    "plan": run_plan,
}


if __name__ == "__main__":
    raise SystemExit(main())
