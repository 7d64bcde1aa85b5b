"""Shared helpers for the K&K tests: the real K&K records bundled as a fixture (tests/fixtures/kk_reference/README.md
names their source and licence)."""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE = Path(__file__).resolve().parent / "fixtures" / "kk_reference"


def reference_records() -> list[dict]:
    files = sorted((REFERENCE / "test").glob("people*_num100.jsonl"))
    return [json.loads(line) for f in files for line in f.open(encoding="utf-8")]
