"""The one source of quoted run times and settings (scripts/number_table.py, docs/numbers.md): every marked number on
every page agrees with it, the README marks every run time it prints, and docs/numbers.* is what the records give."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


nt = load_script("number_table")
DURATION = re.compile(r"\b\d+(?:\.\d+)?\s*(?:s|min|minutes|hours?)\b(?!\w)")
"""A run time as the README prints one ("95 s", "12.6 minutes")."""


@pytest.fixture(scope="module")
def numbers():
    return nt.table()


def test_every_marked_number_on_every_page_agrees_with_the_table(numbers):
    problems = nt.check_pages(numbers)
    assert not problems, "\n".join(problems)


def test_a_planted_wrong_number_is_caught(numbers):
    """The check can fail: each marked number of the README, changed by one in its last digit, is reported."""
    text = (ROOT / "README.md").read_text()
    marks = list(nt.MARKER.finditer(text))
    assert marks, "the README marks no number"
    for m in marks:
        printed = m["number"]
        wrong = printed[:-1] + str((int(printed[-1]) + 1) % 10)
        planted = text[: m.start("number")] + wrong + text[m.end("number") :]
        found = nt.mismatches(planted, numbers, "README.md")
        assert any(f"{wrong} marked {m['key']}" in p for p in found), (m["key"], found)


def test_unknown_keys_and_rounding():
    numbers = {"a": nt.Number("a", 95.3, "", ""), "lr": nt.Number("lr", 5e-4, "", "")}
    assert nt.mismatches("took 95 s<!--#a--> at lr 5e-4<!--#lr-->, **95.3 s**<!--#a-->", numbers) == []
    assert len(nt.mismatches("took 96 s<!--#a-->", numbers)) == 1
    assert len(nt.mismatches("took 95.4 s<!--#a-->", numbers)) == 1  # printed to one decimal: 95.3
    assert len(nt.mismatches("at lr 5e-5<!--#lr-->", numbers)) == 1
    assert "unknown number key 'b'" in nt.mismatches("7 s<!--#b-->", numbers)[0]


def test_every_run_time_the_readme_prints_is_marked():
    """A duration in the README (``95 s``, ``12.6 minutes``) must carry a marker, so that it comes from a record."""
    text = (ROOT / "README.md").read_text()
    unmarked = [
        (text.count("\n", 0, m.start()) + 1, m.group())
        for m in DURATION.finditer(text)
        if not re.match(r"[^\d<]{0,12}?<!--#", text[m.end() :])
    ]
    assert not unmarked, f"README.md prints run times without a marker (line, text): {unmarked}"


def test_the_generated_pages_are_current(numbers):
    assert (ROOT / "docs" / "numbers.md").read_text() == nt.render(numbers), "run scripts/number_table.py"
    assert json.loads((ROOT / "docs" / "numbers.json").read_text()) == json.loads(nt.as_json(numbers))
    settings = nt.SETTINGS_PAGE.read_text()
    assert settings == nt.settings_page(settings), "docs/settings.md's table is stale: run scripts/number_table.py"


def test_the_settings_table_reads_the_configs(numbers):
    """The settings come from the configs that train the studies: a change in a config shows in the table."""
    from lopti_lab.studies.config import CONFIRM_TRAIN, DEMO_TRAIN, HARD_TRAIN

    assert numbers["set.demo.lr"].value == DEMO_TRAIN["lr"]
    assert numbers["set.hardlab.steps"].value == HARD_TRAIN["steps"]
    assert numbers["set.confirm.prompts"].value == CONFIRM_TRAIN["prompts_per_step"]
    paper = (ROOT / "docs" / "paper.md").read_text()  # the paper's row is from its text
    assert "| learning rate | 1e-6 |" in paper and numbers["set.paper.lr"].value == 1e-6
    assert "| prompts per step × rollouts (group size) | 64 × 8 (512 responses per step) |" in paper
    assert "| mini-batch | 256 responses |" in paper and numbers["set.paper.minibatch"].value == 256


def test_a_recorded_command_is_read_back(tmp_path):
    record = nt.record_command("echo", [sys.executable, "-c", "print(1)"], folder=tmp_path)
    assert record["wall_s"] >= 0 and record["cpu_count"] >= 1
    got = {n.key: n.value for n in nt.command_times(tmp_path)}
    assert got["time.echo"] == record["wall_s"] and got["time.echo.min"] == pytest.approx(record["wall_s"] / 60)
