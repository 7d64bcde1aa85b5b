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


def lab_model_dir() -> Path:
    """The bundled lab model's folder (a standard Hugging Face checkpoint)."""
    return data_dir() / "lab_model"


def cache_dir() -> Path:
    """Where lopti_lab caches what it measured once (e.g. a lab model's warm-start evaluation): ``$LOPTI_LAB_CACHE``
    if set, else ``$XDG_CACHE_HOME/lopti_lab`` (``~/.cache/lopti_lab``). Never inside the package, which a wheel
    install puts in a read-only site-packages."""
    env = os.environ.get("LOPTI_LAB_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lopti_lab"
