"""The kill-anywhere soak in small (benchmarks/soak_kill.py; the recorded 30-kill run is in benchmarks/README.md):
`lopti-lab train` on the lab model, SIGKILLed three times (inside a metrics append, inside a checkpoint write, and
from outside at a random moment), resumed after each, must end with the straight run's metrics, record for record,
and its final checkpoint, byte for byte."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lopti_lab.paths import lab_model_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not (lab_model_dir() / "model.safetensors").is_file(), reason="needs the bundled lab model")
def test_three_kills_and_resumes_equal_a_straight_run(tmp_path):
    out = tmp_path / "soak.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "soak_kill.py"), "--kills", "3", "--demo-kills", "0",
               "--steps", "4", "--save-every", "2", "--no-eval", "--kinds", "append,checkpoint,outside",
               "--workdir", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (result,) = json.loads(out.read_text())["results"]
    assert result["kills"] == 3 and result["kinds"] == {"outside": 1, "append": 1, "checkpoint": 1, "repair": 0}
    landed = {k["kind"]: k["landed"] for k in result["log"]}
    assert landed["append"].startswith("inside append metrics.jsonl")
    assert landed["checkpoint"].startswith(("inside write", "inside replace"))
    assert result["identical"] and not result["mismatches"] and result["steps_exactly_once"]
    assert result["records"] == 4
    assert result["checkpoint_files_identical"] == result["checkpoint_files"] > 0


def test_soak_comparison_can_fail(tmp_path):
    """compare_runs sees a changed record and a doubled step (the soak's verdict is not a foregone conclusion)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import soak_kill
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from lopti_lab import runs

    for name, rewards in (("straight", [1.0, 2.0]), ("killed", [1.0, 2.5])):
        folder = runs.RunFolder(tmp_path / name / "run")
        folder.write_config({})
        for step, reward in enumerate(rewards, 1):
            folder.log({"step": step, "reward/mean": reward, "time/step": step * 0.1})
        (folder.path / "checkpoints" / "step_2").mkdir(parents=True)
        (folder.path / "checkpoints" / "step_2" / "state.json").write_text(json.dumps({"files": {}}))
        (folder.path / "checkpoints" / "latest").write_text("step_2\n")
    result = soak_kill.compare_runs(tmp_path / "straight", tmp_path / "killed", demo=False)
    assert not result["identical"] and result["mismatches"] == ["run step 2"]
    folder = runs.RunFolder(tmp_path / "killed" / "run")
    folder.log({"step": 2, "reward/mean": 2.0})
    result = soak_kill.compare_runs(tmp_path / "straight", tmp_path / "killed", demo=False)
    assert not result["steps_exactly_once"]
