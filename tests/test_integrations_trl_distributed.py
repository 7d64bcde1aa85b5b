"""The real distributed path on CPU: ``torchrun`` starts two processes (gloo) running examples/trl/train_kk.py,
TRL's GRPOTrainer subclass with AR + Lopti, for 2 RL steps on the bundled lab model with the K&K reward, and saves
checkpoints. One thread per process; about 30 s on the 2-core CI machine."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[trl]')")

from lopti_lab.paths import data_dir

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_two_rl_steps_with_ar_and_lopti_and_save_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(ROOT / "examples" / "trl" / "train_kk.py"),
        "--model_name_or_path", "lab", "--people", "2", "--train_limit", "8", "--prompt_style", "chat_quiz",
        "--ar_alpha", "0.3", "--lopti_eta", "0.5", "--rl_steps", "2",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "256",
        "--temperature", "1.0", "--learning_rate", "1e-5", "--lr_scheduler_type", "constant",
        "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
        "--report_to", "none", "--use_cpu", "true", "--bf16", "false", "--gradient_checkpointing", "false",
        "--disable_tqdm", "true", "--seed", "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "GRPO+AR+Lopti on 2 process(es) (MULTI_CPU, backend gloo)" in result.stdout
    assert "2 optimizer steps per RL step, max_steps 4" in result.stdout

    final = out / "checkpoint-4"  # 2 RL steps x 2 stages x 1 optimizer step each
    assert (out / "checkpoint-2").is_dir() and final.is_dir()
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= {
        p.name for p in final.iterdir()
    }  # both ranks wrote their RNG state: a resumable distributed checkpoint
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert len(logs) == 4
    generations = [entry for entry in logs if "lopti/low_share" in entry]
    assert len(generations) == 2  # one generation per RL step, each updated in two stages
    for entry in generations:
        assert 0.0 <= entry["lopti/low_share"] <= 1.0 and 0.7 <= entry["ar/weight_mean"] <= 1.0
        assert {"kk/format", "kk/answer", "kk/accuracy", "rewards/kk_reward/mean"} <= set(entry)

    start = load_file(data_dir() / "lab_model" / "model.safetensors")
    trained = load_file(final / "model.safetensors")
    assert set(start) == set(trained)
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # the two RL steps moved the weights
