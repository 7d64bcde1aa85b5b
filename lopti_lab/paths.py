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
