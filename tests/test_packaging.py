"""The install story stays consistent: environment.yml follows pyproject.toml, CI runs the README's test command."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower()


def test_environment_yml_has_the_same_lower_bounds_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    wanted += project["optional-dependencies"]["notebook"]
    env = (ROOT / "environment.yml").read_text()
    pip_lines = [line.strip()[2:].strip() for line in env.splitlines() if line.strip().startswith("- ") and "=" in line]
    pins = {_name(p): p for p in pip_lines if not p.startswith("python") and not p.startswith("-e")}
    for req in wanted:
        assert pins.get(_name(req)) == req, f"environment.yml should pin {req} (has {pins.get(_name(req))})"
    assert "python=3.11" in env and "- -e ." in env


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    block = re.search(r"# tests\n(.+)\n", readme)
    assert block, "README must show the test command under '# tests'"
    assert block.group(1).strip() in ci


def test_console_script_points_at_the_cli():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["lopti-lab"] == "lopti_lab.cli:main"
