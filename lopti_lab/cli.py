"""The ``lopti-lab`` command. Each subcommand lives beside the code it drives; this file only wires them up.

Every module in ``SUBCOMMANDS`` exposes ``add_cli(subparsers)`` which adds its parser and sets ``func`` (a callable
taking the parsed ``argparse.Namespace`` and returning an exit code). Modules are imported lazily so that
``lopti-lab data`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that implements it (its add_cli adds the parser)
SUBCOMMANDS: dict[str, str] = {
    "data": "lopti_lab.kk.data",
    "train": "lopti_lab.trainer",
    "eval": "lopti_lab.trainer",
    "pretrain": "lopti_lab.labmodel",
    "demo": "lopti_lab.experiments",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lopti-lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if only is None or only == name:
            importlib.import_module(module).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # import only the module of the chosen subcommand (a bare `lopti-lab` or `--help` lists them all)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        if chosen is not None and chosen not in SUBCOMMANDS:
            parser.error(f"unknown command {chosen!r}; choose from {', '.join(SUBCOMMANDS)}")
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
