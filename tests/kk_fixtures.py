"""Shared helpers for the K&K tests: the reference records beside the checkout."""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "kk"


def reference_records() -> list[dict]:
    files = sorted((REFERENCE / "test").glob("people*_num100.jsonl"))
    return [json.loads(line) for f in files for line in f.open(encoding="utf-8")]
