"""docs/bad_inputs.md: every config field has bad values of its own, every bad input is refused by name before any
model loads, and the committed table is what the code produces now."""

import dataclasses
import json
from pathlib import Path

import bad_input_table as bad_inputs
import pytest

from lopti_lab import models, train_config, trainer
from lopti_lab.lab import model as lab_model
from lopti_lab.lab import pretrain

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"


@pytest.fixture(scope="module")
def rows():
    """The whole table, built while loading any model or building a lab model is an error."""
    patch = pytest.MonkeyPatch()

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded while checking a bad input")

    for module, name in ((models, "load_policy"), (trainer, "load_policy"), (lab_model, "build_model"),
                         (pretrain, "build_model")):  # fmt: skip
        patch.setattr(module, name, no_model)
    try:
        yield bad_inputs.all_rows()
    finally:
        patch.undo()


@pytest.mark.parametrize("owner", list(bad_inputs.CASES))
def test_every_field_has_bad_values_of_its_own(owner):
    """A field added to a config without an entry in bad_inputs.CASES fails here, by name."""
    cls = bad_inputs.config_classes()[owner]
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if not bad_inputs.CASES[owner].get(n)]
    assert not missing, f"{owner} fields without bad-value cases in tests/bad_input_table.py: {missing}"
    stale = sorted(set(bad_inputs.CASES[owner]) - set(names))
    assert not stale, f"bad_inputs.CASES[{owner!r}] names fields that no longer exist: {stale}"


def test_every_bad_input_is_refused_by_name(rows):
    accepted = [f"{r.subject} = {r.value} ({r.kind}): {r.error}" for r in rows if not r.ok]
    assert not accepted, "\n".join(accepted)
    sections = {r.section for r in rows}
    assert sections == {*bad_inputs.config_classes(), "K&K file", "run folder"}
    assert set(bad_inputs.config_classes()) == {
        "TrainConfig",
        "DemoConfig",
        "MechanismConfig",
        "PretrainConfig",
        "EvalConfig",
        "DataConfig",
    }
    for owner, cls in bad_inputs.config_classes().items():  # every field appears, with a wrong type among its rows
        for f in dataclasses.fields(cls):
            kinds = [r.kind for r in rows if r.subject == f"{owner}.{f.name}"]
            assert any(k.startswith("wrong type") for k in kinds) and len(kinds) >= 2, (owner, f.name, kinds)


def test_committed_table_is_current(rows):
    assert DOC.read_text(encoding="utf-8") == bad_inputs.markdown(rows), (
        "docs/bad_inputs.md is stale: run `python tests/bad_input_table.py --write docs/bad_inputs.md`"
    )


def test_the_table_notices_an_accepted_value(monkeypatch):
    """The check can fail: with TrainConfig's validation switched off, its cases are reported as accepted."""
    monkeypatch.setattr(train_config, "_validate", lambda config: None)
    rows = [r for r in bad_inputs.config_rows() if r.section == "TrainConfig"]
    assert rows and not any(r.ok for r in rows) and {r.error for r in rows} == {"ACCEPTED"}


def test_a_field_without_a_wrong_type_rule_is_loud():
    with pytest.raises(TypeError, match="no wrong-type values"):
        bad_inputs.type_cases(dict)


def test_cli_train_refuses_every_bad_config_file_before_loading(tmp_path, monkeypatch, capsys):
    """`lopti-lab train --config bad.json` for every TrainConfig case JSON can hold: exit 2, the field on stderr."""
    from lopti_lab.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer, "load_policy", no_model)
    monkeypatch.chdir(tmp_path)  # where a run folder would go, were a case accepted
    tried = 0
    for name, cases in bad_inputs.CASES["TrainConfig"].items():
        for _, value in cases:
            values = value.values if isinstance(value, bad_inputs.Combo) else {name: value}
            file = tmp_path / "bad.json"
            file.write_text(json.dumps(values))
            assert main(["train", "--config", str(file)]) == 2, (name, value)
            assert f"TrainConfig.{name}" in capsys.readouterr().err, (name, value)
            tried += 1
    assert tried >= 70 and not (tmp_path / "runs").exists()


def test_the_page_is_a_compact_table_of_every_field(rows):
    """docs/bad_inputs.md names every field of every config in its config's table, in under 16 KiB; the whole
    messages stay in `--full` (and in this test's rows)."""
    page = bad_inputs.markdown(rows)
    assert len(page.encode()) <= 16 * 1024
    sections = dict(part.split("\n", 1) for part in page.split("\n## ")[1:])
    for owner, cls in bad_inputs.config_classes().items():
        missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in sections[owner]]
        assert not missing, (owner, missing)
    full = bad_inputs.full_markdown(rows)
    assert all(r.error.replace("|", "\\|").replace("`", "'").replace("\n", " ") in full for r in rows)


def test_an_error_naming_a_longer_field_does_not_name_the_field():
    """'PretrainConfig.people_weights must ...' is not an error about PretrainConfig.people."""
    assert bad_inputs._names("PretrainConfig.people must not be empty, got ()", "PretrainConfig.people")
    assert bad_inputs._names("PretrainConfig.people: no test file for 9 people", "PretrainConfig.people")
    assert bad_inputs._names("PretrainConfig.spec.num_hidden_layers must be ...", "PretrainConfig.spec")
    assert not bad_inputs._names("PretrainConfig.people_weights must give one weight", "PretrainConfig.people")
