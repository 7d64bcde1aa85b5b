"""The lab demo: GRPO, GRPO+AR, GRPO+Lopti and GRPO+AR+Lopti trained side by side on a laptop CPU, then a report
folder (accuracy tables, learning curves, the paper's figures during training).

    report = run_demo(DemoConfig(seeds=3))                                 # `lopti-lab demo --seeds 3`

Every (method, seed) is a run folder under ``<out>/runs``; runs finished by an earlier call are reused, unfinished
ones resume, so a demo killed at any moment continues where it stopped when called again.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from lopti_lab import durable, runs
from lopti_lab.counterfactual import Counterfactual, counterfactual, frozen_batch
from lopti_lab.kk import load_split
from lopti_lab.lab.evaluate import evaluate_warm_start
from lopti_lab.methods import METHODS
from lopti_lab.models import load_policy, model_path
from lopti_lab.paths import cache_dir
from lopti_lab.pool import finished, train_while
from lopti_lab.studies.config import DemoConfig
from lopti_lab.studies.report import write_report
from lopti_lab.train_config import TrainConfig

__all__ = ["WARM_START_CACHE", "run_demo", "warm_start_eval"]


def run_demo(config: DemoConfig) -> Path:
    """Evaluate the warm start under every seed's sampling seed, train every (method, seed), and write the report;
    returns the report folder."""
    if config.threads:
        torch.set_num_threads(config.threads)
    with runs.writer_lock(config.out):  # one demo per report folder (and each run its own lock, in its worker)
        return _run_demo(config)


def _run_demo(config: DemoConfig) -> Path:
    out = Path(config.out)
    start = time.perf_counter()
    base = config.train_config(config.methods[0], config.seed_list[0], out / "runs" / "probe")
    run_dirs = config.run_dirs()
    todo = [c for c in config.run_configs().values() if not finished(c)]
    reused = len(run_dirs) - len(todo)  # earlier, complete runs of the same report are kept
    # the runs start now (or after, with one worker); this process meanwhile measures the warm start and the batch
    warm, shift = train_while(todo, config.workers, lambda: _warm_start_and_counterfactual(config, base))
    minutes = (time.perf_counter() - start) / 60
    with durable.room(out):  # a full disk: a DiskFullError naming the report folder (the runs are all kept)
        report = write_report(config, out, run_dirs, warm, shift, minutes=minutes, reused=reused)
    return report


def _warm_start_and_counterfactual(config: DemoConfig, base: TrainConfig) -> tuple[dict, Counterfactual]:
    """The warm start's evaluation under each seed, and one update of every method on a frozen batch."""
    model, tokenizer = load_policy(base.model, lora=None)
    # the warm start under each seed's evaluation seed: run s is compared with warm[s], and their mean over seeds
    # is measured with the same sampling noise as the runs' (one evaluation of 200 puzzles has an SE of about 0.02)
    warm = {seed: warm_start_eval(config, model, tokenizer, seed=seed) for seed in config.seed_list}
    batch = frozen_batch(
        model,
        tokenizer,
        load_split("train", base.train_people, limit=2 if config.quick else 4),  # per people count
        base.group_size,
        prompt_style=base.prompt_style,
        temperature=base.temperature,
        max_new_tokens=base.max_new_tokens,
        fast_path=base.fast_path,
    )
    shift = counterfactual(
        model,
        batch,
        {m: METHODS[m].overrides() for m in config.methods},
        lr=base.lr,
        optimizer="adamw",
        update=replace(base.update_spec(), minibatch_size=len(batch.rollout)),
        adamw=base.optimizer_spec(),
    )
    return warm, shift


WARM_START_CACHE = "warm_start_evals.json"
"""A lab model's test accuracy under given evaluation settings, keyed by the weights' sha256 and every setting, so the
demo does not spend a minute of its budget re-measuring a model that never changes: written to the user's cache
(``paths.cache_dir()``), read from there or, read-only, from the model folder (the bundled model ships its own)."""


def warm_start_eval(config: DemoConfig, model, tokenizer, seed: int = 0) -> dict[str, float]:
    """The warm start's test accuracy, with the same `evaluate` call as the final evaluation of the runs of ``seed``
    (whose sampling seed is the run's seed).

    For a local model folder the result is cached (``WARM_START_CACHE``), keyed by the weights' sha256 and every
    evaluation setting; ``config.cache_warm_start=False`` always measures afresh (and refreshes the user's cache)."""
    train = config.train
    settings = {
        "eval_people": list(train.eval_people),
        "eval_size": train.eval_size,
        "eval_samples": train.eval_samples,
        "max_new_tokens": train.eval_max_new_tokens or train.max_new_tokens,
        "prompt_style": train.prompt_style,
        "seed": seed,
    }
    weights = Path(model_path(train.model)) / "model.safetensors"
    key = None
    if weights.is_file():
        key = json.dumps({"sha256": hashlib.sha256(weights.read_bytes()).hexdigest(), **settings}, sort_keys=True)
    user_cache = cache_dir() / WARM_START_CACHE
    if config.cache_warm_start and key is not None:
        for file in (user_cache, weights.parent / WARM_START_CACHE):
            cached = _read_cache(file).get(key)
            if cached is not None and all(f"{k}_se" in cached for k in _acc_keys(config)):
                return cached  # (an entry recorded before evaluate reported standard errors is measured again)
    warm = evaluate_warm_start(
        model,
        tokenizer,
        train.eval_people,
        train.eval_samples,
        train.eval_size,
        settings["max_new_tokens"],
        settings["prompt_style"],
        seed=seed,
        prefix="eval",
        fast_path=train.fast_path,
    )
    if key is not None and not config.quick:  # smoke runs (tests) leave the cache untouched
        try:
            user_cache.parent.mkdir(parents=True, exist_ok=True)
            user_cache.write_text(json.dumps({**_read_cache(user_cache), key: warm}, indent=1, sort_keys=True) + "\n")
        except OSError as err:  # no writable cache: measuring every time is correct, only slower
            warnings.warn(f"could not cache the warm-start evaluation in {user_cache}: {err}", stacklevel=2)
    return warm


def _read_cache(file: Path) -> dict:
    """A cache file's entries ({} when there is none); a damaged one is reported and counts as empty (the evaluation
    is measured again, and the user's cache rewritten)."""
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        warnings.warn(f"ignoring the damaged cache {file}: {err}", stacklevel=3)
        return {}
    if not isinstance(entries, dict):
        warnings.warn(f"ignoring the cache {file}: a JSON {type(entries).__name__}, not an object", stacklevel=3)
        return {}
    return entries


def _acc_keys(config: DemoConfig) -> list[str]:
    return [f"eval/{mode}/acc_{n}ppl" for mode in ("sample", "greedy") for n in config.train.eval_people]
