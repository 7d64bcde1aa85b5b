"""What a confirmatory study costs, measured before it runs: one evaluation of each kind on the warm start, and a few
RL steps, at one torch thread (a study's worker has one), in wall seconds and CPU seconds.

    python -m lopti_lab.studies.budget                 # prints a JSON object (docs/hard_lab.md, "Budget")

The CPU seconds (``time.process_time``) are what a loaded machine does not inflate: on a shared machine the wall
seconds include the other jobs' share of the cores. ``estimate`` turns the measurements into the study's wall time.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from lopti_lab.evaluate import evaluate
from lopti_lab.kk import load_split
from lopti_lab.models import load_policy
from lopti_lab.studies.config import ConfirmConfig
from lopti_lab.trainer import train

__all__ = ["estimate", "measure", "measure_evaluations", "measure_steps"]


def _timed(work) -> tuple[object, dict[str, float]]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = work()
    return out, {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def measure(config: ConfirmConfig, steps: int = 2) -> dict:
    """``measure_evaluations`` and ``measure_steps``, at one torch thread."""
    torch.set_num_threads(1)
    return {**measure_evaluations(config), "steps": measure_steps(config, steps)}


def measure_evaluations(config: ConfirmConfig) -> dict:
    """Seconds of the warm start's evaluations at the study's people counts and puzzles, each as {"wall_s", "cpu_s",
    "acc"}: greedy, the full sampled one (``eval_full_samples`` per puzzle) and the curves' (``eval_samples``)."""
    cfg = config.train_config("GRPO", seed=config.seed_list[0], run_dir=Path("unused"))
    model, tokenizer = load_policy(cfg.model, lora=None)
    puzzles = load_split("test", cfg.eval_people, cfg.data_root, cfg.eval_size)
    spec = cfg.eval_spec()
    out = {"eval_puzzles": len(puzzles)}
    for name, settings in (
        ("greedy", {"modes": ("greedy",)}),
        ("sample_full", {"modes": ("sample",), "samples": cfg.eval_full_samples}),
        ("sample_curve", {"modes": ("sample",), "samples": cfg.eval_samples}),
    ):
        result, out[name] = _timed(lambda s=settings: evaluate(model, tokenizer, puzzles, replace(spec, **s)))
        out[name]["acc"] = {k: v for k, v in result.items() if "/acc_" in k and not k.endswith("_se")}
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)  # each as it comes (a long measurement)
    return out


def measure_steps(config: ConfirmConfig, steps: int = 2) -> list[dict]:
    """Seconds of each of ``steps`` RL steps of GRPO, without evaluation, the last one probed and measured for
    Fig. 3 as every 10th step of the study is: [{"wall_s", "cpu_s"}] (the first step's CPU seconds include loading
    the model, about a second)."""
    cfg = config.train_config("GRPO", seed=config.seed_list[0], run_dir=Path("unused"))
    with tempfile.TemporaryDirectory() as tmp:
        step_cfg = replace(cfg, run_dir=tmp, steps=steps, eval_people=(), eval_full_steps=(), eval_full_samples=None,
                           probe_every=steps, shift_every=steps, save_every=0, progress=False)  # fmt: skip
        marks = [time.process_time()]
        result = train(step_cfg, callbacks=[lambda m: marks.append(time.process_time())])
    spans = zip(result.history, marks[:-1], marks[1:], strict=True)
    return [{"wall_s": r["time/step"], "cpu_s": b - a} for r, a, b in spans]


def estimate(cost: dict, config: ConfirmConfig, workers: int = 2) -> dict[str, float]:
    """The study's time from ``measure``'s CPU seconds, in minutes: per run, its RL steps (one in ``probe_every``
    probed; a Lopti run's at 1.4x, the ratio the exploratory study measured) and its evaluations; for the study, every
    run and the warm start's evaluation under each seed, in CPU minutes and in wall minutes with ``workers`` runs at
    once, one core each (a lower bound: the exploratory study's wall time was 1.5x its own such estimate)."""
    train = config.train
    plain, probed = cost["steps"][0]["cpu_s"], cost["steps"][-1]["cpu_s"]
    n_probed = train.steps // train.probe_every if train.probe_every else 0
    steps_s = (train.steps - n_probed) * plain + n_probed * probed
    full, curve = len(train.eval_full_steps), len(config.curve_steps())
    greedy = cost["greedy"]["cpu_s"]
    evals_s = full * (greedy + cost["sample_full"]["cpu_s"]) + curve * (greedy + cost["sample_curve"]["cpu_s"])
    lopti_factor = 1.4
    runs_s = sum((steps_s * (lopti_factor if "Lopti" in m else 1.0) + evals_s) for m in config.methods)
    warm_s = greedy + cost["sample_curve"]["cpu_s"]  # the warm start under each seed's sampling seed (step 0)
    study_s = (runs_s + warm_s) * len(config.seed_list)
    return {
        "run_train_min": steps_s / 60,
        "run_eval_min": evals_s / 60,
        "study_cpu_min": study_s / 60,
        "study_wall_min": study_s / 60 / workers,
    }


if __name__ == "__main__":
    confirm = ConfirmConfig()
    cost = measure(confirm)
    print(json.dumps({"cost": cost, "estimate": estimate(cost, confirm)}, indent=1))
