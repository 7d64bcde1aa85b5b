"""The frozen-batch counterfactual against a hand-made update, the attribution tables, and the lab demo."""

import json
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import lopti_lab.trainer as trainer
from lopti_lab import experiments, runs
from lopti_lab.kk import load_split
from lopti_lab.models import LoraSpec, load_policy
from lopti_lab.objective import group_advantages
from lopti_lab.rollout import response_logprobs, sample

LAB = Path(__file__).resolve().parents[1] / "data" / "lab_model" / "config.json"


@pytest.fixture(scope="module")
def policy(model_dir):
    model, tok = load_policy(str(model_dir), LoraSpec(r=4, alpha=8))
    with torch.no_grad():  # LoRA B starts at zero; give the adapter a non-trivial start
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model, tok


@pytest.fixture(scope="module")
def batch(policy):
    model, tok = policy
    puzzles = load_split("train", 3, limit=2)
    torch.manual_seed(0)
    rollout = sample(model, tok, [trainer.build_prompt(p, "base") for p in puzzles], 4, max_new_tokens=6)
    # a fixed spread of rewards (the random model never solves a puzzle)
    rewards = torch.tensor([3.0 if zlib.crc32(t.encode()) % 2 else -1.0 for t in rollout.texts])
    rewards[0], rewards[1] = 3.0, -1.0
    return experiments.FrozenBatch(puzzles, rollout, rewards, group_advantages(rewards, 4), 1.0)


def test_counterfactual_grpo_equals_one_hand_made_sgd_step(policy, batch):
    model, _ = policy
    before = [p.detach().clone() for p in model.parameters()]
    cf = experiments.counterfactual(model, batch, {"GRPO": {}}, lr=0.5, optimizer="sgd")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "weights restored"

    rollout, mask = batch.rollout, batch.rollout.response_mask
    params = [p for p in model.parameters() if p.requires_grad]
    logp, _ = response_logprobs(model, rollout.input_ids, rollout.attention_mask, mask, 1.0)
    # at ratio 1 the clipped loss is -A * ratio, token mean over the batch
    loss = -(batch.advantages[:, None] * (logp - rollout.old_logp).exp() * mask).sum() / mask.sum()
    grads = torch.autograd.grad(loss, params)
    total = torch.sqrt(sum(g.square().sum() for g in grads))
    scale = min(1.0, 1.0 / (total.item() + 1e-6))  # the trainer clips the norm at grad_clip = 1.0, as torch does
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= 0.5 * scale * g
        new_logp, _ = response_logprobs(model, rollout.input_ids, rollout.attention_mask, mask, 1.0)
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    expected = (new_logp.exp() - rollout.old_logp.exp())[mask.bool()]
    got = torch.tensor(cf.tokens.sort_values(["seq", "pos"])["delta_p"].to_numpy(), dtype=expected.dtype)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
    assert cf.updates.set_index("method").loc["GRPO", "optimizer_steps"] == 1


def test_counterfactual_adamw_uses_the_runs_epsilon(policy, batch):
    """Adam's first step moves a parameter by lr * g / (|g| + eps): with base.adam_eps far above every (clipped)
    gradient it is SGD at lr / eps, so the two counterfactuals agree; at torch's default eps it is sign-like."""
    from lopti_lab.counterfactual import whole_batch_config

    model, _ = policy

    def delta_p(optimizer, lr, eps):
        cf = experiments.counterfactual(
            model, batch, {"GRPO": {}}, lr=lr, optimizer=optimizer, base=whole_batch_config(batch, adam_eps=eps)
        )
        return torch.tensor(cf.tokens.sort_values(["seq", "pos"])["delta_p"].to_numpy())

    sgd = delta_p("sgd", 0.5, 1e-8)
    torch.testing.assert_close(delta_p("adamw", 0.5 * 1e5, 1e5), sgd, atol=1e-6, rtol=1e-3)
    assert not torch.allclose(delta_p("adamw", 0.5 * 1e5, 1e-8), sgd, atol=1e-4)


def test_counterfactual_methods_differ_and_lopti_takes_two_steps(policy, batch):
    model, _ = policy
    methods = {**experiments.METHODS, "AR(alpha=0)": {"ar_alpha": 0.0}}
    cf = experiments.counterfactual(model, batch, methods, lr=0.5, optimizer="sgd")
    steps = cf.updates.set_index("method")["optimizer_steps"]
    assert steps["GRPO"] == steps["GRPO+AR"] == 1 and steps["GRPO+Lopti"] == steps["GRPO+AR+Lopti"] == 2
    dp = {m: t.sort_values(["seq", "pos"])["delta_p"].to_numpy() for m, t in cf.tokens.groupby("method")}
    assert (dp["AR(alpha=0)"] == dp["GRPO"]).all()
    assert not (dp["GRPO+AR"] == dp["GRPO"]).all()
    assert set(cf.bins["sign"]) == {"pos", "neg"} and set(cf.bins["method"]) == set(methods)


def test_counterfactual_rejects_an_unknown_optimizer(policy, batch):
    with pytest.raises(ValueError, match="optimizer"):
        experiments.counterfactual(policy[0], batch, optimizer="lion")


def test_attribution_tables_add_up(policy, batch):
    model, _ = policy
    tables = experiments.attribution_tables(model, batch)
    for attribution, rows in tables[tables["scope"] == "model"].groupby("attribution"):
        parts = rows[rows["label"] != "all"]
        assert parts["grad_share"].sum() == pytest.approx(1.0, abs=1e-4), attribution
    assert set(tables["attribution"]) == {"loss", "position"}
    assert all(p.grad is None for p in model.parameters())


def test_demo_config_validation_and_quick_mode():
    with pytest.raises(ValueError, match="methods"):
        experiments.DemoConfig(methods=("PPO",))
    with pytest.raises(ValueError, match="seeds"):
        experiments.DemoConfig(seeds=0)
    with pytest.raises(ValueError, match="ppo_epochs"):
        experiments.DemoConfig(ppo_epochs=0)
    longer = experiments.DemoConfig(ppo_epochs=2, temperature=1.0, lr=5e-5).train_config("GRPO", 0, Path("x"))
    assert (longer.ppo_epochs, longer.temperature, longer.lr) == (2, 1.0, 5e-5)
    quick = experiments.DemoConfig(quick=True)
    assert quick.steps == 2 and quick.eval_size <= 8
    cfg = quick.train_config("GRPO+AR+Lopti", 1, Path("x"))
    assert (cfg.ar_alpha, cfg.lopti_eta, cfg.seed, cfg.lora_r) == (0.3, 0.5, 1, None)
    same = {k: v for k, v in vars(cfg).items() if k not in ("ar_alpha", "lopti_eta", "run_dir")}
    other = quick.train_config("GRPO", 1, Path("y"))
    assert same == {k: v for k, v in vars(other).items() if k not in ("ar_alpha", "lopti_eta", "run_dir")}


@pytest.mark.slow
@pytest.mark.skipif(not LAB.is_file(), reason="needs the bundled lab model")
def test_demo_quick_writes_every_report_file(tmp_path):
    import time

    # CPU seconds of this process (torch runs one thread in the tests): the other test worker shares the two cores,
    # which stretches wall time but not this; `lopti-lab demo --quick` alone took 87 s of wall time here
    start = time.process_time()
    out = experiments.run_demo(experiments.DemoConfig(quick=True, workers=1, out=str(tmp_path / "demo")))
    elapsed = time.process_time() - start
    for name in (
        "report.md",
        "summary.json",
        "metrics.csv",
        "accuracy_sample.csv",
        "accuracy_sample.md",
        "accuracy_greedy.csv",
        "accuracy_greedy.md",
        "counterfactual.csv",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in ("learning_curves.png", "gradient_share.png", "correct_ratio.png", "mechanism.png"):
        assert (out / name).stat().st_size > 10_000, f"{name} looks empty"
    table = (out / "accuracy_sample.csv").read_text()
    for row in ("warm start", "GRPO", "GRPO + AR", "GRPO + Lopti", "GRPO + AR + Lopti"):
        assert row in table
    report = (out / "report.md").read_text()
    assert "over the warm start" in report and "![learning curves]" in report
    assert len(list((out / "runs").iterdir())) == 4
    assert elapsed < 120, f"demo --quick took {elapsed:.0f} CPU seconds"
    # a second call reuses the finished runs instead of training again
    again = time.process_time()
    experiments.run_demo(replace(experiments.DemoConfig(quick=True, workers=1, out=str(out))))
    assert time.process_time() - again < elapsed


@pytest.mark.slow
@pytest.mark.skipif(not LAB.is_file(), reason="needs the bundled lab model")
def test_demo_runs_in_worker_processes_equal_the_same_runs_in_this_process(tmp_path):
    """Two worker processes of one thread train the same runs as this process does at one thread, record for
    record (timings aside), and the report names every run."""
    methods = ("GRPO", "GRPO+AR+Lopti")
    reports = {
        workers: experiments.run_demo(
            experiments.DemoConfig(quick=True, workers=workers, methods=methods, out=str(tmp_path / f"w{workers}"))
        )
        for workers in (1, 2)
    }
    assert torch.get_num_threads() == 1  # the pool's thread setting was put back
    for method in methods:
        records = {}
        for workers, out in reports.items():
            run_dir = out / "runs" / f"{experiments.slug(method)}-seed0"
            records[workers] = [
                {k: v for k, v in r.items() if not k.startswith("time/")} for r in runs.load_metrics(run_dir)
            ]
        assert len(records[1]) == 2, method
        assert json.dumps(records[1], sort_keys=True) == json.dumps(records[2], sort_keys=True), method  # NaN too
    assert "GRPO + AR + Lopti" in (reports[2] / "accuracy_sample.csv").read_text()


@pytest.mark.skipif(not LAB.is_file(), reason="needs the bundled lab model")
def test_warm_start_evaluation_is_cached_by_weights_and_settings(tmp_path, monkeypatch):
    import shutil

    from lopti_lab import labmodel

    folder = tmp_path / "lab_model"
    shutil.copytree(LAB.parent, folder)
    (folder / experiments.WARM_START_CACHE).unlink(missing_ok=True)
    monkeypatch.setattr(labmodel, "lab_model_dir", lambda: folder)
    model, tok = load_policy("lab", lora=None)
    config = experiments.DemoConfig(eval_people=(2,), eval_size=3, eval_samples=1, max_new_tokens=120)
    fresh = experiments.warm_start_eval(config, model, tok)
    assert set(fresh) >= {"eval/greedy/acc_2ppl", "eval/sample/acc_2ppl"}
    assert (folder / experiments.WARM_START_CACHE).is_file()

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the cached result should have been used")

    monkeypatch.setattr(experiments, "evaluate", no_evaluation)
    assert experiments.warm_start_eval(config, model, tok) == fresh
    with pytest.raises(AssertionError, match="cached"):  # other settings, or no cache wanted: measured again
        experiments.warm_start_eval(replace(config, eval_size=4), model, tok)
    with pytest.raises(AssertionError, match="cached"):
        experiments.warm_start_eval(replace(config, cache_warm_start=False), model, tok)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))
    with pytest.raises(AssertionError, match="cached"):  # other weights
        experiments.warm_start_eval(config, model, tok)


def test_demo_cli_names_a_bad_method_before_any_work(tmp_path):
    from lopti_lab.cli import main

    with pytest.raises(SystemExit, match=r"methods.*PPO"):
        main(["demo", "--methods", "GRPO", "PPO", "--out", str(tmp_path / "demo")])
    assert not (tmp_path / "demo").exists()


def test_demo_cli_passes_the_rl_settings_and_names_a_bad_one(tmp_path, monkeypatch):
    from lopti_lab.cli import main

    seen = []
    monkeypatch.setattr(experiments, "run_demo", lambda config: seen.append(config) or Path(config.out))
    assert main(["demo", "--lr", "5e-5", "--temperature", "1.0", "--ppo-epochs", "2", "--out", str(tmp_path)]) == 0
    assert (seen[0].lr, seen[0].temperature, seen[0].ppo_epochs) == (5e-5, 1.0, 2)
    assert seen[0].steps == experiments.DemoConfig.steps  # the default, untouched
    with pytest.raises(SystemExit, match="ppo_epochs"):
        main(["demo", "--ppo-epochs", "0", "--out", str(tmp_path / "demo")])
    assert not (tmp_path / "demo").exists()
    argv = ["demo", "--fast-path", "hf", "--max-new-tokens", "300", "--train-people", "2", "3", "--eval-people", "3"]
    assert main([*argv, "--eval-size", "20", "--out", str(tmp_path)]) == 0
    last = seen[-1]
    assert (last.fast_path, last.max_new_tokens, last.train_people, last.eval_people, last.eval_size, last.model) == (
        "hf",
        300,
        (2, 3),
        (3,),
        20,
        "lab",
    )
    for flag, value, field in (("--fast-path", "fast", "fast_path"), ("--model", "no/such/model", "model")):
        with pytest.raises(SystemExit, match=field):
            main(["demo", flag, value, "--out", str(tmp_path / "demo")])


def test_accuracy_markdown_gives_a_spread_only_where_there_are_seeds():
    import pandas as pd

    frame = pd.DataFrame(
        {"model": ["Lab model (warm start)", "+ GRPO", "+ GRPO"], "3ppl": [0.25, 0.30, 0.40], "avg": [0.25, 0.3, 0.4]}
    )
    grouped = frame.groupby("model", sort=False)
    text = experiments._markdown(grouped.mean(), grouped.std(ddof=1))
    lines = text.splitlines()
    assert lines[0] == "| K&K accuracy (people) | 3 | avg |"
    assert lines[2] == "| Lab model (warm start) | 0.25 | 0.25 |"
    assert lines[3] == "| + GRPO | 0.35 ± 0.07 | 0.35 ± 0.07 |"  # sample std of (.3, .4) = .0707
    assert "±" not in experiments._markdown(grouped.mean(), None)
    one = pd.DataFrame({"3ppl": [0.3], "3ppl_se": [0.046], "avg": [0.3], "avg_se": [0.046]}, index=["+ GRPO"])
    assert experiments._markdown(one, None).splitlines()[2] == "| + GRPO | 0.30 ± 0.05 | 0.30 ± 0.05 |"  # one seed: SE


def test_accuracy_table_carries_each_runs_standard_error(tmp_path):
    """The SE columns come from the runs' metrics; the avg's is sqrt(sum se^2) / k over the people counts."""
    from lopti_lab import runs

    config = experiments.DemoConfig(out=str(tmp_path / "demo"), eval_people=(2, 3))
    folder = runs.RunFolder(tmp_path / "run")
    folder.write_config({"note": "test"})
    record = {"step": 1}
    for mode in ("sample", "greedy"):
        record |= {f"eval/{mode}/acc_2ppl": 0.5, f"eval/{mode}/acc_3ppl": 0.2}
        record |= {f"eval/{mode}/acc_2ppl_se": 0.03, f"eval/{mode}/acc_3ppl_se": 0.04}
    folder.log(record)
    warm = {k: v for k, v in record.items() if k != "step" and not k.endswith("_se")}  # an old cache entry
    frame = experiments.accuracy_table(config, {("GRPO", 0): tmp_path / "run"}, warm, "sample")
    run = frame.set_index("model").loc["+ GRPO"]
    assert run["3ppl_se"] == 0.04 and abs(run["avg_se"] - (0.03**2 + 0.04**2) ** 0.5 / 2) < 1e-12
    assert frame.set_index("model").loc["Lab model (warm start)", ["2ppl_se", "avg_se"]].isna().all()


def test_the_demo_prompts_a_lab_model_folder_in_the_style_its_trace_was_trained_on(tmp_path):
    """A lab model folder whose trace numbers the quiz gets numbered prompts in every run; the bundled model the
    prompt of its own trace (number first, bare), and a folder without lab_model.json ``LAB_PROMPT_STYLE``."""
    from lopti_lab.labmodel import LAB_PROMPT_STYLE, RL_TRACE, lab_prompt_style

    folder = tmp_path / "coded"
    folder.mkdir()
    trace = {"coded": True, "numbered_quiz": True, "leaf_roles": ["is", "really"]}
    (folder / "lab_model.json").write_text(json.dumps({"config": {"trace": trace}}))
    numbered = experiments.DemoConfig(model=str(folder), out=str(tmp_path / "demo"))
    assert numbered.train_config(list(experiments.METHODS)[-1], 0, tmp_path / "r").prompt_style == "chat_quiz_numbered"
    bundled = experiments.DemoConfig(out=str(tmp_path / "demo"))
    assert bundled.train_config("GRPO", 0, tmp_path / "r").prompt_style == lab_prompt_style(RL_TRACE)
    assert lab_prompt_style(RL_TRACE) == LAB_PROMPT_STYLE == "chat_quiz_numfirst_bare"
    assert experiments.DemoConfig(model=str(tmp_path), out=str(tmp_path / "demo")).prompt_style() == LAB_PROMPT_STYLE


def test_a_run_that_fails_in_a_worker_raises_here_and_stops_the_pool(tmp_path):
    """The worker's error reaches the caller with its message, and no worker process is left behind."""
    import multiprocessing

    from lopti_lab.run_pool import RunPool

    config = experiments.DemoConfig(quick=True, methods=("GRPO",), out=str(tmp_path / "demo"))
    blocked = tmp_path / "a-file-not-a-folder"
    blocked.write_text("")
    pool = RunPool(config, {("GRPO", 0): blocked / "grpo-seed0"}, threads=1)  # a folder inside a file
    with pytest.raises(OSError, match="a-file-not-a-folder"):
        pool.wait()
    assert not multiprocessing.active_children()


def test_workers_end_when_the_demo_is_killed(tmp_path):
    """SIGKILL the process that owns a RunPool: its workers end within seconds (no orphan keeps training a run that
    the demo, called again, resumes)."""
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import sys
from pathlib import Path
from lopti_lab import experiments
from lopti_lab.run_pool import RunPool
config = experiments.DemoConfig(quick=True, methods=("GRPO", "GRPO+AR"), out={str(tmp_path / "demo")!r})
pool = RunPool(config, {{(m, 0): Path(config.out) / m for m in config.methods}}, threads=1)
print(*pool.pids, flush=True)
pool.wait()
"""
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(workers) == 2
    time.sleep(3.0)  # the workers are importing or training
    owner.send_signal(signal.SIGKILL)
    owner.wait()

    def alive(pid: int) -> bool:
        try:
            return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 20.0
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers)
