"""Import a module of scripts/ or benchmarks/ (not packages) by its file, as the tests that check their output need."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, folder: str = "scripts"):
    """<folder>/<name>.py as a module, registered under ``name`` (dataclasses look their module up by name)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS.parent / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
