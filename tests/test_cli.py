"""The `lopti-lab` command: every subcommand's options come from its config dataclass the same way, every --config
file is read the same way, and every usage error exits 2 naming the field or file, before any work starts."""

import argparse
import dataclasses
import json

import pytest

from lopti_lab import cli
from lopti_lab.configs import field_docs, nested_config

COMMANDS = list(cli.COMMANDS)


def options_of(name: str) -> dict[str, str]:
    """{dest: help} of a subcommand's parser."""
    parser = cli.build_parser(name)
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    return {a.dest: a.help for a in sub._actions if a.dest not in ("help",)}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_field_is_an_option_with_its_docstring_as_help(name):
    command = cli.COMMANDS[name]
    cls = cli.config_class(command)
    options = options_of(name)
    expected = {}
    for f in dataclasses.fields(cls):
        nested = nested_config(cls, f.name)
        if nested is None:
            expected[f.name] = field_docs(cls).get(f.name, "")
        elif f.name in command.flatten:
            for g in dataclasses.fields(nested):
                dest = f"{f.name}.{g.name}"
                if dest not in command.skipped(cls):
                    expected[dest] = field_docs(nested).get(g.name, "")
    for dest, help_text in expected.items():
        assert dest in options, f"lopti-lab {name}: no option for {dest}"
        assert options[dest] == help_text.replace("%", "%%"), dest
    assert "_config" in options  # --config, the same for every subcommand


@pytest.mark.parametrize("name", COMMANDS)
def test_a_bad_config_file_is_a_usage_error_naming_file_and_line(name, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"seed": 1,\n "x": }')
    assert cli.main([name, "--config", str(bad)]) == cli.USAGE_ERROR
    assert f"{bad} line 2" in capsys.readouterr().err
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"sed": 1}))
    assert cli.main([name, "--config", str(unknown)]) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert "unknown field(s) ['sed']" in err and "seed" in err  # and the field that was meant


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["data", "--people", "1"], "DataConfig.people"),
        (["train", "--lr", "0"], "TrainConfig.lr"),
        (["eval", "--model", "lab", "--size", "0"], "EvalConfig.size"),
        (["pretrain", "--steps", "0"], "PretrainConfig.steps"),
        (["pretrain", "--num-attention-heads", "3"], "PretrainConfig.spec.num_attention_heads"),
        (["demo", "--seeds", "0"], "DemoConfig.seeds"),
        (["demo", "--lr", "0"], "DemoConfig.train.lr"),
    ],
)
def test_a_bad_field_exits_2_with_the_field_named(argv, field, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == cli.USAGE_ERROR
    assert field in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing was written"


def test_no_command_or_an_unknown_one_is_a_usage_error(capsys):
    assert cli.main([]) == cli.USAGE_ERROR
    assert cli.main(["trian"]) == cli.USAGE_ERROR
    assert "unknown command 'trian'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse's own usage errors exit 2 too
        cli.main(["train", "--no-such-option"])
    assert exit_info.value.code == cli.USAGE_ERROR


def test_options_given_override_the_config_file_field_by_field(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setitem(cli.RUNNERS, "train", lambda config, args: seen.append(config) or 0)
    file = tmp_path / "run.json"
    file.write_text(json.dumps({"lr": 1e-4, "steps": 7, "train_people": [3]}))
    assert cli.main(["train", "--config", str(file), "--steps", "9", "--ar", "0.3", "--lora-r", "none"]) == 0
    (config,) = seen
    assert (config.lr, config.steps, config.train_people, config.ar_alpha, config.lora_r) == (1e-4, 9, (3,), 0.3, None)


@pytest.mark.parametrize("command", ["demo", "hardlab", "mechanism"])
def test_a_study_gives_no_option_for_the_fields_each_run_sets(command):
    """The fields a study sets per run (its seed, folder and method; the mechanism's optimizer too) get no option."""
    from lopti_lab.studies.config import PER_RUN
    from lopti_lab.studies.mechanism import OPTIMIZER_FIELDS

    parser = cli.build_parser(only=command)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    dests = {a.dest for a in sub.choices[command]._actions}
    fixed = {*PER_RUN, *OPTIMIZER_FIELDS} if command == "mechanism" else set(PER_RUN)
    assert not {f"train.{n}" for n in fixed} & dests
    assert {"train.lr", "train.steps"} - {f"train.{n}" for n in fixed} <= dests
