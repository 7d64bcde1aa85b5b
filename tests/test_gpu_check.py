"""benchmarks/gpu_check.py, the prepared GPU check, runs every phase on tiny shapes on a CPU (--smoke): the day a GPU
is lent, the one call it gets does not fail on a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("device", "update_1.5B", "update_3B", "precision", "decode_3B", "notebook_defaults")


def test_gpu_check_smoke_runs_every_phase(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
                   cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)  # fmt: skip
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report) == list(PHASES)
    assert not [name for name, phase in report.items() if "error" in phase], report
    assert report["device"]["auto_dtype"] == "torch.float32" and report["device"]["attn_implementation"] == "sdpa"
    for name in ("update_1.5B", "update_3B"):
        for variant in ("plain", "probe", "fig3"):
            assert report[name][variant]["peak_gib"] > 0 and report[name][variant]["planned_gib"] > 0
    assert all(v["cosine"] > 0.99 for k, v in report["precision"].items() if k != "seconds")
    assert report["decode_3B"]["ms_per_token"] > 0
    notebook = report["notebook_defaults"]
    assert notebook["steps"] == [1, 2] and notebook["first_step_kept"] and notebook["finite"]
