"""The package's layout: imports only point down (no circle, lazy imports inside functions included), every module
holds one idea (no file far past 600 lines), and each module imports on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lopti_lab"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """Every lopti_lab module ``name`` imports, at the top or inside a function, and the packages those imports run
    (importing a.b.c runs a/__init__ and a/b/__init__ first)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # "from lopti_lab import runs" imports the module lopti_lab.runs; "from lopti_lab.kk import load_split"
            # imports lopti_lab.kk
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("lopti_lab"):
                parts = target.split(".")
                found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
    found.discard(name)
    return {m for m in found if not name.startswith(m + ".") or m == "lopti_lab"}


def graph() -> dict[str, set[str]]:
    return {name: imports_of(name) - {"lopti_lab"} for name in MODULES}


def test_imports_only_point_down_with_no_circle():
    """A topological order exists over every import, lazy ones included: there is no circle to hide."""
    edges = graph()
    try:
        order = list(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"import circle: {' -> '.join(err.args[1])}")
    assert set(order) == set(MODULES)


def test_the_check_sees_a_circle(tmp_path):
    """The circle check can fail: a graph with one lazy back edge has no order."""
    edges = graph()
    edges["lopti_lab.objective"] = edges["lopti_lab.objective"] | {"lopti_lab.trainer"}
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(edges).static_order())


def test_the_ground_floor_needs_no_torch():
    """The K&K environment, the configs' helpers and the method registry import no torch: `lopti-lab data` and a
    reader of run folders stay light."""
    light = ["lopti_lab.kk", "lopti_lab.methods", "lopti_lab.configs", "lopti_lab.checks", "lopti_lab.runs"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in light) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_module_is_many_files_in_one():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules past {MAX_LINES} lines (split them by idea): {long}"


@pytest.mark.slow
def test_every_module_imports_alone_in_leaf_to_root_order():
    """Each module in a fresh interpreter of its own, leaves first: none depends on another having been imported."""
    order = list(graphlib.TopologicalSorter(graph()).static_order())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    failed = {}
    for name in order:
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", f"import {name}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        if len(procs) >= 4:  # a few at a time: imports are mostly disk and one core each
            for done, proc in list(procs.items()):
                _, err = proc.communicate()
                if proc.returncode:
                    failed[done] = err.strip().splitlines()[-1]
                del procs[done]
    for done, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode:
            failed[done] = err.strip().splitlines()[-1]
    assert not failed, failed
