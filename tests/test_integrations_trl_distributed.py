"""The real distributed path on CPU: ``torchrun`` starts two processes (gloo) running examples/trl/train_kk.py,
TRL's GRPOTrainer subclass with AR + Lopti, for 2 RL steps on the bundled lab model with the K&K reward, and saves
checkpoints. The model is loaded the standard way (AutoTokenizer, AutoModelForCausalLM) and prompted in the style its
config names, so its rewards in TRL are those of lopti_lab's own rollouts of the same puzzles. The second test runs
examples/trl/probe_any_run.py the same way: stock GRPOTrainer with TokenCreditCallback, its per-bin metrics reduced
over the two ranks, and the PNG. One thread per process."""

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


def own_rollout_rates(puzzles: int, group: int, max_new_tokens: int) -> dict:
    """Accuracy and format-error rate of lopti_lab's own rollouts of the bundled model on the first ``puzzles``
    2-person training puzzles, ``group`` samples each at T = 1.0."""
    from lopti_lab.evaluate import score_rollout
    from lopti_lab.kk import build_prompt, load_split
    from lopti_lab.models import load_policy, prompt_style_of
    from lopti_lab.rollout import sample

    model, tokenizer = load_policy("lab", lora=None, device="cpu")
    chosen = load_split("train", 2, limit=puzzles)
    torch.manual_seed(0)
    prompts = [build_prompt(p, prompt_style_of("lab"), tokenizer) for p in chosen]
    rollout = sample(model, tokenizer, prompts, group, max_new_tokens=max_new_tokens, temperature=1.0)
    rewards = score_rollout(rollout, chosen)
    return {
        "accuracy": sum(r.total == 3.0 for r in rewards) / len(rewards),
        "format_error_rate": sum(r.format_score < 0 for r in rewards) / len(rewards),
    }


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
        "--model_name_or_path", "lab", "--people", "2", "--train_limit", "8",
        "--ar_alpha", "0.3", "--lopti_eta", "0.5", "--rl_steps", "2",
        "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "640",
        "--temperature", "1.0", "--learning_rate", "1e-5", "--lr_scheduler_type", "constant",
        "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
        "--report_to", "none", "--use_cpu", "true", "--bf16", "false", "--activation_checkpointing", "false",
        "--disable_tqdm", "true", "--seed", "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "GRPO+AR+Lopti on 2 process(es) (MULTI_CPU, backend gloo)" in result.stdout
    assert "prompt style chat_quiz_numfirst_bare" in result.stdout  # the lab model's own, from its config
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
    # the same model's own rollouts of the same puzzles, at the same temperature: TRL sees what lopti_lab sees
    own = own_rollout_rates(puzzles=8, group=4, max_new_tokens=640)
    trl_acc = sum(e["kk/accuracy"] for e in generations) / len(generations)
    trl_format = sum(e["kk/format_error_rate"] for e in generations) / len(generations)
    assert abs(trl_acc - own["accuracy"]) < 0.3, (trl_acc, own)  # 32 completions a side: same order of accuracy
    assert trl_format <= own["format_error_rate"] + 0.1, (trl_format, own)  # no unparseable answers of its own

    start = load_file(data_dir() / "lab_model" / "model.safetensors")
    trained = load_file(final / "model.safetensors")
    assert set(start) == set(trained)
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # the two RL steps moved the weights


DRIVER = """
import json, os, sys
sys.path.insert(0, sys.argv.pop(1))  # examples/trl: probe_any_run imports train_kk beside it
import probe_any_run
from lopti_lab.integrations import trl_callback

finish = trl_callback.TokenCreditCallback._finish


def recording(self):
    reduced = finish(self)
    with open(f"rank{os.environ['RANK']}.jsonl", "a") as f:
        f.write(json.dumps({"local": self.last_local.pack().tolist(), "reduced": reduced}) + "\\n")
    return reduced


trl_callback.TokenCreditCallback._finish = recording
probe_any_run.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_token_credit_on_stock_grpo_two_processes_reduces_over_ranks_and_draws_the_png(tmp_path):
    """examples/trl/probe_any_run.py on two processes: TRL's own GRPOTrainer with TokenCreditCallback, the lab model,
    3 optimizer steps. Each rank's local sums (recorded beside the run) differ, and every logged metric is the one
    computed from their sum: the reduction covers both ranks' tokens, backwards and Fig. 3 counts."""
    from lopti_lab.probes.credit import CreditSums

    out = tmp_path / "run"
    (tmp_path / "driver.py").write_text(DRIVER)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(tmp_path / "driver.py"), str(ROOT / "examples" / "trl"),
        "--model_name_or_path", "lab", "--people", "2", "--train_limit", "8", "--max_steps", "3",
        "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "256",
        "--temperature", "1.0", "--learning_rate", "1e-5", "--output_dir", str(out), "--save_strategy", "no",
        "--logging_steps", "1", "--report_to", "none", "--use_cpu", "true", "--bf16", "false",
        "--activation_checkpointing", "false", "--disable_tqdm", "true", "--seed", "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "probe_any_run: 3 measured steps on 2 process(es) (MULTI_CPU)" in result.stdout

    rows = [json.loads(line) for line in (out / "token_credit.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    png = (out / "token_credit.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    ranks = [[json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for row, mine, theirs in zip(rows, *ranks, strict=True):
        assert mine["local"] != theirs["local"]  # each rank measured its own rows
        total = torch.tensor(mine["local"]) + torch.tensor(theirs["local"])
        expected = CreditSums().reduced(lambda t, total=total: total).metrics()
        for key, value in expected.items():
            for logged in (mine["reduced"][key], theirs["reduced"][key], row[key]):
                assert logged == pytest.approx(value, nan_ok=True) or (logged is None and value != value), key
        assert sum(row[f"tokens/share_bin{k}"] for k in range(4)) == pytest.approx(1.0)
        grad = sum(row[f"grad/share_bin{k}"] for k in range(4)) + row["grad/share_context"]
        assert grad == pytest.approx(1.0, abs=1e-4)  # bins + context = the whole gradient, to float32 rounding
        assert sum(row[f"fig3/q/n_bin{k}"] for k in range(4)) > 0
