"""Where lopti_lab finds its bundled data (K&K datasets, the lab model), in a checkout or an installed wheel."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """The folder holding ``kk/`` and ``lab_model/``.

    Order: ``$LOPTI_LAB_DATA`` if set, then ``lopti_lab/_data`` (a wheel install puts ``data/`` there), then ``data/``
    beside the package in a source checkout or editable install.
    """
    env = os.environ.get("LOPTI_LAB_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for candidate in (here / "_data", here.parent / "data"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"lopti_lab data folder not found (looked in {here / '_data'} and {here.parent / 'data'}); "
        "set LOPTI_LAB_DATA to the folder that holds kk/ and lab_model/"
    )


BUNDLED_MODELS = {"lab": "lab_model", "lab-hard": "lab_model_hard"}
"""The bundled lab models, by the name ``TrainConfig.model`` takes, and their folders in the data folder: "lab" (the
demo's: a reliable reasoner with rare slips, docs/lab_model.md) and "lab-hard" (the same model taught to misread
'or', 'if' and 'iff' as 'and' 60% of the time: a skill left for RL to learn, docs/hard_lab.md)."""


def lab_model_dir(name: str = "lab") -> Path:
    """A bundled lab model's folder (a standard Hugging Face checkpoint), by its name in ``BUNDLED_MODELS``."""
    if name not in BUNDLED_MODELS:
        raise ValueError(f"no bundled lab model {name!r}; the bundled ones are {list(BUNDLED_MODELS)}")
    return data_dir() / BUNDLED_MODELS[name]


def cache_dir() -> Path:
    """Where lopti_lab caches what it measured once (e.g. a lab model's warm-start evaluation): ``$LOPTI_LAB_CACHE``
    if set, else ``$XDG_CACHE_HOME/lopti_lab`` (``~/.cache/lopti_lab``). Never inside the package, which a wheel
    install puts in a read-only site-packages."""
    env = os.environ.get("LOPTI_LAB_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lopti_lab"


def shown(path: str | Path) -> str:
    """How a notebook names where it read a table: "lopti_lab data: <the path inside the data folder>" for a bundled
    record (not this machine's folders), else the path relative to the working folder when it lies under it, else
    the path as given.

    >>> shown(data_dir() / "hard_lab")
    'lopti_lab data: hard_lab'
    >>> shown(Path.cwd() / "reports" / "hard_lab")
    'reports/hard_lab'
    """
    path = Path(path)
    resolved = path.resolve()
    for root, label in ((data_dir().resolve(), "lopti_lab data: "), (Path.cwd().resolve(), "")):
        if resolved.is_relative_to(root):
            return label + resolved.relative_to(root).as_posix()
    return str(path)
