"""The lab demo: its config (one TrainConfig shared by every run), its CLI, the runs in worker processes, the
warm-start cache, and the report on a real quick run."""

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from lopti_lab import runs
from lopti_lab.methods import METHODS, PAPER
from lopti_lab.models import load_policy
from lopti_lab.paths import lab_model_dir
from lopti_lab.studies import run as demo_run
from lopti_lab.studies import tables as demo_tables
from lopti_lab.studies.config import DemoConfig, HardLabConfig, demo_train

LAB = lab_model_dir() / "config.json"


def test_demo_config_validation_and_quick_mode():
    with pytest.raises(ValueError, match=r"DemoConfig\.methods"):
        DemoConfig(methods=("PPO",))
    with pytest.raises(ValueError, match=r"DemoConfig\.seeds"):
        DemoConfig(seeds=0)
    with pytest.raises(ValueError, match=r"DemoConfig\.train\.ppo_epochs"):
        DemoConfig(train={"ppo_epochs": 0})
    with pytest.raises(ValueError, match=r"DemoConfig\.train\.seed must be left at its default"):
        DemoConfig(train=demo_train(seed=3))
    longer = DemoConfig(train={"ppo_epochs": 2, "lr": 5e-5}).train_config("GRPO", 0, Path("x"))
    assert (longer.ppo_epochs, longer.temperature, longer.lr, longer.steps) == (2, 1.0, 5e-5, demo_train().steps)
    quick = DemoConfig(quick=True)
    assert quick.train.steps == 2 and quick.train.eval_size <= 8
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
    out = demo_run.run_demo(DemoConfig(quick=True, workers=1, out=str(tmp_path / "demo")))
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
    # a guard against a slow-down, not a benchmark: 120.4 s was seen on a CI machine whose two cores ran two workers
    assert elapsed < 150, f"demo --quick took {elapsed:.0f} CPU seconds"
    # a second call reuses the finished runs instead of training again
    again = time.process_time()
    demo_run.run_demo(replace(DemoConfig(quick=True, workers=1, out=str(out))))
    assert time.process_time() - again < elapsed


@pytest.mark.slow
@pytest.mark.skipif(not LAB.is_file(), reason="needs the bundled lab model")
def test_demo_runs_in_worker_processes_equal_the_same_runs_in_this_process(tmp_path):
    """Two worker processes of one thread train the same runs as this process does at one thread, record for
    record (timings aside), and the report names every run."""
    methods = ("GRPO", "GRPO+AR+Lopti")
    reports = {
        workers: demo_run.run_demo(
            DemoConfig(quick=True, workers=workers, methods=methods, out=str(tmp_path / f"w{workers}"))
        )
        for workers in (1, 2)
    }
    assert torch.get_num_threads() == 1  # the pool's thread setting was put back
    for method in methods:
        records = {}
        for workers, out in reports.items():
            run_dir = out / "runs" / f"{METHODS[method].slug}-seed0"
            records[workers] = [
                {k: v for k, v in r.items() if not k.startswith("time/")} for r in runs.load_metrics(run_dir)
            ]
        assert len(records[1]) == 2, method
        assert json.dumps(records[1], sort_keys=True) == json.dumps(records[2], sort_keys=True), method  # NaN too
    assert "GRPO + AR + Lopti" in (reports[2] / "accuracy_sample.csv").read_text()


@pytest.mark.skipif(not LAB.is_file(), reason="needs the bundled lab model")
def test_warm_start_evaluation_is_cached_by_weights_and_settings(tmp_path, monkeypatch):
    """Cached in the user's cache folder (never in the package, which a wheel puts in a read-only site-packages),
    keyed by the weights' sha256 and every evaluation setting."""
    import shutil

    folder = tmp_path / "lab_model"
    shutil.copytree(LAB.parent, folder)
    (folder / demo_run.WARM_START_CACHE).unlink(missing_ok=True)
    folder.chmod(0o555)  # a read-only install: nothing may be written beside the weights
    monkeypatch.setenv("LOPTI_LAB_CACHE", str(tmp_path / "cache"))
    model, tok = load_policy(str(folder), lora=None)
    config = DemoConfig(train={"model": str(folder), "eval_people": (2,), "eval_size": 3, "eval_samples": 1,
                               "max_new_tokens": 120})  # fmt: skip
    try:
        fresh = demo_run.warm_start_eval(config, model, tok)
        assert set(fresh) >= {"eval/greedy/acc_2ppl", "eval/sample/acc_2ppl"}
        assert (tmp_path / "cache" / demo_run.WARM_START_CACHE).is_file()
        assert not (folder / demo_run.WARM_START_CACHE).exists()

        def no_evaluation(*args, **kwargs):
            raise AssertionError("the cached result should have been used")

        monkeypatch.setattr(demo_run, "evaluate_warm_start", no_evaluation)
        assert demo_run.warm_start_eval(config, model, tok) == fresh
        with pytest.raises(AssertionError, match="cached"):  # other settings, or no cache wanted: measured again
            demo_run.warm_start_eval(replace(config, train=replace(config.train, eval_size=4)), model, tok)
        with pytest.raises(AssertionError, match="cached"):
            demo_run.warm_start_eval(replace(config, cache_warm_start=False), model, tok)
        folder.chmod(0o755)
        weights = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))
        with pytest.raises(AssertionError, match="cached"):  # other weights
            demo_run.warm_start_eval(config, model, tok)
    finally:
        folder.chmod(0o755)


def test_demo_cli_names_a_bad_method_before_any_work(tmp_path, capsys):
    from lopti_lab.cli import main

    assert main(["demo", "--methods", "GRPO", "PPO", "--out", str(tmp_path / "demo")]) == 2
    assert "DemoConfig.methods" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def test_demo_cli_passes_the_rl_settings_and_names_a_bad_one(tmp_path, monkeypatch, capsys):
    """Every shared TrainConfig field is a demo option (built from the config), over the demo's own defaults."""
    from lopti_lab.cli import main

    seen = []
    monkeypatch.setattr(demo_run, "run_demo", lambda config: seen.append(config) or Path(config.out))
    assert main(["demo", "--lr", "5e-5", "--temperature", "1.0", "--ppo-epochs", "2", "--out", str(tmp_path)]) == 0
    train = seen[0].train
    assert (train.lr, train.temperature, train.ppo_epochs) == (5e-5, 1.0, 2)
    assert train.steps == demo_train().steps and train.adam_eps == demo_train().adam_eps  # the demo's, untouched
    assert main(["demo", "--ppo-epochs", "0", "--out", str(tmp_path / "demo")]) == 2
    assert "DemoConfig.train.ppo_epochs" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()
    argv = ["demo", "--fast-path", "hf", "--max-new-tokens", "300", "--train-people", "2", "3", "--eval-people", "3"]
    assert main([*argv, "--eval-size", "20", "--seeds", "2", "--out", str(tmp_path)]) == 0
    last = seen[-1]
    got = (last.train.fast_path, last.train.max_new_tokens, last.train.train_people, last.train.eval_people)
    assert got == ("hf", 300, (2, 3), (3,)) and (last.train.eval_size, last.train.model, last.seeds) == (20, "lab", 2)
    for flag, value, field in (("--fast-path", "fast", "fast_path"), ("--model", "no/such/model", "model")):
        assert main(["demo", flag, value, "--out", str(tmp_path / "demo")]) == 2
        assert f"DemoConfig.train.{field}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a run's own field is no demo option
        main(["demo", "--seed", "3"])
    config = tmp_path / "demo.json"
    config.write_text(json.dumps({"seeds": 3, "train": {"lr": 2e-4}}))
    assert main(["demo", "--config", str(config), "--steps", "4", "--out", str(tmp_path)]) == 0
    assert (seen[-1].seeds, seen[-1].train.lr, seen[-1].train.steps) == (3, 2e-4, 4)


def test_accuracy_markdown_gives_a_spread_only_where_there_are_seeds():
    import pandas as pd

    frame = pd.DataFrame(
        {"model": ["Lab model (warm start)", "+ GRPO", "+ GRPO"], "3ppl": [0.25, 0.30, 0.40], "avg": [0.25, 0.3, 0.4]}
    )
    grouped = frame.groupby("model", sort=False)
    text = demo_tables.accuracy_markdown(grouped.mean(), grouped.std(ddof=1))
    lines = text.splitlines()
    assert lines[0] == "| K&K accuracy (people) | 3 | avg |"
    assert lines[2] == "| Lab model (warm start) | 0.25 | 0.25 |"
    assert lines[3] == "| + GRPO | 0.35 ± 0.07 | 0.35 ± 0.07 |"  # sample std of (.3, .4) = .0707
    assert "±" not in demo_tables.accuracy_markdown(grouped.mean(), None)
    one = pd.DataFrame({"3ppl": [0.3], "3ppl_se": [0.046], "avg": [0.3], "avg_se": [0.046]}, index=["+ GRPO"])
    one_seed = demo_tables.accuracy_markdown(one, None).splitlines()[2]
    assert one_seed == "| + GRPO | 0.30 ± 0.05 | 0.30 ± 0.05 |"  # one seed: the evaluation's SE


def test_accuracy_table_carries_each_runs_standard_error(tmp_path):
    """The SE columns come from the runs' metrics; the avg's is sqrt(sum se^2) / k over the people counts."""
    config = DemoConfig(out=str(tmp_path / "demo"), train={"eval_people": (2, 3)})
    folder = runs.RunFolder(tmp_path / "run")
    folder.write_config({"note": "test"})
    record = {"step": 1}
    for mode in ("sample", "greedy"):
        record |= {f"eval/{mode}/acc_2ppl": 0.5, f"eval/{mode}/acc_3ppl": 0.2}
        record |= {f"eval/{mode}/acc_2ppl_se": 0.03, f"eval/{mode}/acc_3ppl_se": 0.04}
    folder.log(record)
    warm = {k: v for k, v in record.items() if k != "step" and not k.endswith("_se")}  # an old cache entry
    frame = demo_tables.accuracy_table(config, {("GRPO", 0): tmp_path / "run"}, warm, "sample")
    run = frame.set_index("model").loc["+ GRPO"]
    assert run["3ppl_se"] == 0.04 and abs(run["avg_se"] - (0.03**2 + 0.04**2) ** 0.5 / 2) < 1e-12
    assert frame.set_index("model").loc["Lab model (warm start)", ["2ppl_se", "avg_se"]].isna().all()


def test_the_demo_prompts_a_lab_model_folder_in_the_style_its_config_names(tmp_path, model_dir):
    """Every run of a lab model folder reads the prompt its config names (``models.PROMPT_STYLE_KEY``); the bundled
    model's is its trace's (number first, bare); a style the model was not trained on is refused by name."""
    import shutil

    from lopti_lab.lab.trace import RL_PROMPT_STYLE, RL_TRACE, prompt_style

    folder = tmp_path / "coded"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "kk_prompt_style": "chat_quiz_numbered"}))
    numbered = DemoConfig(train={"model": str(folder)}, out=str(tmp_path / "demo"))
    assert numbered.train_config("GRPO+AR+Lopti", 0, tmp_path / "r").prompt_style == "chat_quiz_numbered"
    bundled = DemoConfig(out=str(tmp_path / "demo"))
    assert bundled.train_config("GRPO", 0, tmp_path / "r").prompt_style == prompt_style(RL_TRACE) == RL_PROMPT_STYLE
    with pytest.raises(ValueError, match=r"DemoConfig\.train\.prompt_style must be 'chat_quiz_numbered'"):
        DemoConfig(train={"model": str(folder), "prompt_style": "instruct"}, out=str(tmp_path / "demo"))


def test_a_run_that_fails_in_a_worker_raises_here_and_stops_the_pool(tmp_path):
    """The worker's error reaches the caller with its message, and no worker process is left behind."""
    import multiprocessing

    from lopti_lab.pool import RunPool

    config = DemoConfig(quick=True, methods=("GRPO",), out=str(tmp_path / "demo"))
    blocked = tmp_path / "a-file-not-a-folder"
    blocked.write_text("")
    pool = RunPool([config.train_config("GRPO", 0, blocked / "grpo-seed0")], 2, threads=1)  # a folder inside a file
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
from lopti_lab.studies.config import DemoConfig
from lopti_lab.pool import RunPool
config = DemoConfig(quick=True, methods=("GRPO", "GRPO+AR"), out={str(tmp_path / "demo")!r})
pool = RunPool([config.train_config(m, 0, Path(config.out) / m) for m in config.methods], 2, threads=1)
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


def test_the_hard_lab_study_config_is_the_pre_registered_one():
    """`lopti-lab hardlab`: the four methods x 5 seeds on `lab-hard` with the settings docs/hard_lab.md fixed before
    the study ran (a change here is a change to a pre-registered study: the page must say so)."""
    config = HardLabConfig()
    assert (config.methods, config.seeds, config.out) == (PAPER, 5, "reports/hard_lab")
    run = config.train_config("GRPO+AR+Lopti", 3, Path("x"))
    fixed = {"model": "lab-hard", "lora_r": None, "train_people": (2, 3), "eval_people": (2, 3, 4),
             "prompts_per_step": 4, "group_size": 8, "minibatch_size": 16, "temperature": 1.0, "lr": 1e-4,
             "adam_eps": 1e-3, "kl_coef": 0.0, "steps": 60, "eval_every": 10, "eval_size": 30, "eval_samples": 2,
             "probe_every": 10, "shift_every": 10, "ar_alpha": 0.3, "lopti_eta": 0.5, "seed": 3}  # fmt: skip
    assert {k: getattr(run, k) for k in fixed} == fixed
    page = (Path(__file__).resolve().parents[1] / "docs" / "hard_lab.md").read_text()
    assert (
        "lr 1e-4 constant" in page
        and "| steps | 60 |" in page
        and "the first 30 test puzzles at 2, 3 and 4 people" in page
    )
    quick = HardLabConfig(quick=True)
    assert (quick.train.steps, quick.train.eval_every, quick.train.shift_every) == (2, 1, 1)
    with pytest.raises(ValueError, match=r"HardLabConfig\.train\.lr"):
        HardLabConfig(train={"lr": -1.0})


@pytest.mark.slow
@pytest.mark.skipif(not LAB.is_file(), reason="needs the bundled lab model")
def test_hard_lab_quick_reports_learning_curves_and_the_papers_last_3_accuracy(tmp_path):
    """The hard lab study's smoke version (two methods, one seed, evaluated at both of its steps): its report folder
    holds the curves, the last-3 accuracy with its paired differences, the area under the curve and the figure."""
    out = demo_run.run_demo(HardLabConfig(quick=True, workers=1, seeds=1, methods=("GRPO", "GRPO+Lopti"),
                                          out=str(tmp_path / "hard")))  # fmt: skip
    curves = pd.read_csv(out / "curves_sample.csv")
    assert sorted(curves.query("model == '+ GRPO + Lopti'")["step"]) == [0, 1, 2]
    last3 = pd.read_csv(out / "last3_sample.csv").set_index("model")
    lopti = curves.query("model == '+ GRPO + Lopti' and step > 0")["2ppl"].mean()
    assert last3.loc["+ GRPO + Lopti", "2ppl"] == pytest.approx(lopti)  # fewer than 3 evaluations: all of them
    for name in ("auc.csv", "paired_last3_sample.csv", "late_gain.csv", "bands_sample.csv", "paired_steps_sample.csv"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "study_curves.png").stat().st_size > 10_000
    report = (out / "report.md").read_text()
    assert report.startswith("# lopti_lab hard lab") and "mean of its last 3 evaluations" in report
    mechanism = pd.read_csv(out / "mechanism.csv")
    assert mechanism["fig3_correct"].notna().any() and (mechanism["fig3_n"] >= 0).all()
