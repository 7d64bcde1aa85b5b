"""The lab-model demo: GRPO, GRPO+AR, GRPO+Lopti and GRPO+AR+Lopti trained side by side on a laptop CPU, then a
report folder (accuracy tables, learning curves, the paper's figures during training).

    report = run_demo(DemoConfig(seeds=3))                                 # `lopti-lab demo --seeds 3`

The frozen-batch counterfactual it reports beside the runs is ``lopti_lab.counterfactual``, the report folder
``lopti_lab.demo_report`` (both re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pandas as pd
import torch

from lopti_lab import labmodel, runs
from lopti_lab.checks import FieldCheck, is_int, rename_owner
from lopti_lab.counterfactual import (  # noqa: F401  (re-exported: experiments.counterfactual etc. stay where they were)
    METHODS,
    Counterfactual,
    FrozenBatch,
    attribution_tables,
    counterfactual,
    frozen_batch,
)
from lopti_lab.demo_report import (  # noqa: F401  (re-exported: the report's parts stay reachable from here)
    _markdown,
    accuracy_table,
    compare_methods,
    write_report,
)
from lopti_lab.kk import load_split
from lopti_lab.rollout import FAST_PATHS
from lopti_lab.run_pool import RunPool, train_or_resume
from lopti_lab.trainer import TrainConfig, evaluate

PAPER_TABLE = pd.DataFrame(
    [
        ("Qwen2.5-3B-Instruct", 0.09, 0.10, 0.03, 0.05, 0.02, 0.06),
        ("+ GRPO", 0.60, 0.45, 0.33, 0.34, 0.23, 0.39),
        ("+ GRPO + AR", 0.67, 0.62, 0.53, 0.44, 0.37, 0.53),
        ("+ GRPO + Lopti", 0.74, 0.67, 0.56, 0.42, 0.30, 0.54),
        ("+ GRPO + AR + Lopti", 0.72, 0.66, 0.55, 0.52, 0.40, 0.57),
        ("Qwen2.5-7B-Instruct-1M", 0.22, 0.15, 0.08, 0.10, 0.02, 0.11),
        ("+ GRPO", 0.91, 0.91, 0.77, 0.65, 0.61, 0.77),
        ("+ GRPO + AR", 0.97, 0.98, 0.89, 0.83, 0.80, 0.89),
        ("+ GRPO + Lopti", 0.95, 0.94, 0.84, 0.80, 0.76, 0.86),
        ("+ GRPO + AR + Lopti", 0.95, 0.94, 0.91, 0.87, 0.87, 0.91),
    ],
    columns=["model", "3ppl", "4ppl", "5ppl", "6ppl", "7ppl", "avg"],
).set_index("model")
"""The paper's K&K accuracy table (PAPER.md §6): share of test puzzles with reward 3, by people count."""


# ---------------------------------------------------------------------------------------------------------------------
# the lab demo: GRPO, GRPO+AR, GRPO+Lopti, GRPO+AR+Lopti on the lab model, on a laptop CPU


@dataclass
class DemoConfig:
    """`lopti-lab demo`: the four methods on the lab model, same data and seeds, then a report folder.

    The RL settings are the paper's (PAPER.md §6: clip 0.2 / 0.24, dual clip 10, token-mean loss, AR alpha 0.3,
    Lopti eta 0.5) scaled down to a CPU: fewer prompts per step, shorter responses, and no KL term (it costs a
    second forward per step; at 0.001 it barely acts in a few dozen steps). Nothing here is tuned per method.

    The shared settings were picked on GRPO alone (`benchmarks/lab_rl_sweep.py`, table in benchmarks/README.md, "GRPO
    on the bundled lab model"), on 2-3-person puzzles with rollouts at T = 1.0, by sampled test accuracy on the 2-3
    mix (warm start 0.674): at Adam's usual eps of 1e-8, lr 5e-5 gave 0.74 after 20 steps and 2e-4 0.76, while 5e-4
    and 1e-3 broke the model within two steps; with eps 1e-3, lr 1e-3 gave 0.853 and 0.885 after 10 steps (two
    seeds) and 0.913 after 20, and lr 2e-3 broke it again. 10 steps of the four methods took 10.5-11.5 minutes on
    two CPU cores, two runs at a time (README, "The demo").
    """

    out: str = "reports/demo"
    """report folder (created; runs/ inside holds each run folder)"""
    seeds: int = 1
    """seeds per method (> 1 gives spreads)"""
    quick: bool = False
    """a two-minute smoke version (tests): 2 steps, small evaluation"""
    steps: int = 10
    """RL steps per run (15 steps of the four methods took 20 min on two cores in one process; 10 took 10.5-11.5 in
    two workers on 2026-12-02, README "The demo")"""
    prompts_per_step: int = 8
    group_size: int = 8
    lr: float = 1e-3
    """AdamW learning rate (full fine-tuning of the lab model); with ``adam_eps`` at the same size, a parameter moves
    by at most about lr per step, and one with a gradient smaller than adam_eps by about lr / adam_eps times it"""
    adam_eps: float = 1e-3
    """AdamW epsilon. At the usual 1e-8 Adam's first steps move every parameter by about lr whatever its gradient,
    and the many parameters with gradients of pure sampling noise then wreck the lab model at lr >= 5e-4 within one
    RL step (benchmarks/README.md, "GRPO on the bundled lab model"); at 1e-3 they move in proportion to their
    gradient"""
    minibatch_size: int = 32
    """rollouts per optimizer step: two minibatches per RL step (the paper: 512 rollouts in minibatches of 256)"""
    temperature: float = 1.0
    """rollout temperature (the paper: 0.7; here 1.0, the temperature of the sampled evaluation, so that training
    sees the slips the evaluation counts)"""
    ppo_epochs: int = 1
    """passes over each step's rollouts per stage (the paper: 1)"""
    max_new_tokens: int = 512
    """response cap of rollouts and evaluation (the bundled model's 3-person traces: 234 tokens on average, about
    450 at most)"""
    train_people: tuple[int, ...] = (2, 3)
    """people counts trained on (each RL step draws from their mix): those the bundled model was warm-started on"""
    eval_people: tuple[int, ...] = (2, 3)
    eval_size: int = 100
    """test puzzles per people count"""
    eval_samples: int = 2
    """sampled completions per test puzzle at temperature 1.0"""
    probe_every: int = 5
    cache_warm_start: bool = True
    """reuse the bundled lab model's recorded warm-start accuracy for these evaluation settings (`warm_start_eval`)"""
    methods: tuple[str, ...] = tuple(METHODS)
    model: str = "lab"
    threads: int | None = None
    """torch threads of the demo (None: torch's default), shared out among the workers"""
    workers: int = 2
    """runs trained at once, each in a process of its own with threads // workers torch threads (at least 1); 1
    trains them one after another in this process. Two one-thread processes decode 1.27x as many rollouts per second
    on two cores as one two-thread process (benchmarks/README.md, "Demo wall time")"""
    fast_path: str = "auto"
    """the decoder and log-prob path of every run and the warm-start evaluation (`rollout.FAST_PATHS`; "hf" is the
    path before the lean decode, for timing it side by side)"""

    def __post_init__(self):
        for name in ("train_people", "eval_people", "methods"):
            if isinstance(getattr(self, name), list):  # JSON and argparse give lists
                setattr(self, name, tuple(getattr(self, name)))
        check = FieldCheck(self)  # every field by name, before any model loads (docs/bad_inputs.md)
        check.text("out")
        check.need(not Path(self.out).is_file(), "out", "must be a folder, not a file")
        for name in ("seeds", "steps", "prompts_per_step", "minibatch_size", "eval_size", "eval_samples", "ppo_epochs",
                     "max_new_tokens"):  # fmt: skip
            check.integer(name, low=1)
        check.integer("group_size", low=2)
        check.flag("quick")
        check.real("lr", low=0, low_open=True)
        check.real("adam_eps", low=0, low_open=True)
        check.real("temperature", low=0, low_open=True)
        check.items("train_people", lambda n: is_int(n) and n >= 2, "people counts >= 2", distinct=True)
        check.items("eval_people", lambda n: is_int(n) and n >= 2, "people counts >= 2", distinct=True)
        check.integer("probe_every", low=0)
        check.flag("cache_warm_start")
        check.items("methods", lambda m: m in METHODS, f"methods from {list(METHODS)}", distinct=True)
        check.text("model")
        check.integer("threads", low=1, optional=True)
        check.integer("workers", low=1)
        check.choice("fast_path", FAST_PATHS)
        if self.quick:  # every code path once, on the smallest batches that exercise it (tests, notebook QUICK)
            self.steps, self.prompts_per_step, self.group_size, self.eval_size, self.eval_samples = 2, 4, 4, 8, 1
            self.probe_every = 1  # the smallest people count only: the shortest traces
            self.train_people, self.eval_people = self.train_people[:1], self.eval_people[:1]
        try:  # the combinations (a minibatch that does not divide the batch, a missing data file, ...): as each run
            for method in self.methods:
                self.train_config(method, 0, Path(self.out) / "runs" / slug(method))
        except ValueError as err:
            raise rename_owner(err, "TrainConfig", "DemoConfig", [f.name for f in fields(self)]) from None

    def prompt_style(self) -> str:
        """The prompt style of the lab model under study (a numbered quiz for a coded trace that asks for one)."""
        return labmodel.prompt_style_of(self.model)

    def train_config(self, method: str, seed: int, run_dir: Path) -> TrainConfig:
        """The TrainConfig of one run: every method shares everything but its own switches."""
        return TrainConfig(
            model=self.model,
            lora_r=None,
            prompt_style=self.prompt_style(),
            train_people=self.train_people,
            eval_people=self.eval_people,
            prompts_per_step=self.prompts_per_step,
            group_size=self.group_size,
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            lr=self.lr,
            adam_eps=self.adam_eps,
            minibatch_size=min(self.minibatch_size, self.prompts_per_step * self.group_size),
            kl_coef=0.0,
            ppo_epochs=self.ppo_epochs,
            steps=self.steps,
            seed=seed,
            eval_every=0,
            eval_size=self.eval_size,
            eval_samples=self.eval_samples,
            probe_every=self.probe_every,
            save_every=0,
            run_dir=str(run_dir),
            progress=True,
            fast_path=self.fast_path,
            **METHODS[method],
        )


def slug(method: str) -> str:
    return method.lower().replace("+", "_")


def run_demo(config: DemoConfig) -> Path:
    """Evaluate the warm start under every seed's sampling seed, train every (method, seed), and write the report;
    returns the report folder."""
    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = config.train_config(config.methods[0], 0, out / "runs" / "probe")  # validates before any work
    run_dirs = {(m, s): out / "runs" / f"{slug(m)}-seed{s}" for s in range(config.seeds) for m in config.methods}
    todo = [key for key, run_dir in run_dirs.items() if not _finished(run_dir, config.steps)]
    reused = len(run_dirs) - len(todo)  # earlier, complete runs of the same report are kept
    pool, threads_before = None, torch.get_num_threads()
    if config.workers > 1 and todo:  # the runs start now; this process meanwhile measures the frozen batch
        threads = max(1, threads_before // config.workers)  # config.threads, when given, is set above
        torch.set_num_threads(threads)
        pool = RunPool(config, {key: run_dirs[key] for key in todo}, threads)
    try:
        warm, shift = _warm_start_and_counterfactual(config, base)
    except BaseException:
        if pool is not None:
            pool.stop()
        raise
    finally:
        torch.set_num_threads(threads_before)
    if pool is None:
        for method, seed in todo:
            train_or_resume(config.train_config(method, seed, run_dirs[(method, seed)]))
    else:
        pool.wait()
    minutes = (time.perf_counter() - start) / 60
    report = write_report(config, out, run_dirs, warm, shift, minutes=minutes, reused=reused)
    return report


def _warm_start_and_counterfactual(config: DemoConfig, base: TrainConfig) -> tuple[dict, Counterfactual]:
    """The warm start's evaluation under each seed, and one update of every method on a frozen batch."""
    from lopti_lab.models import load_policy

    model, tokenizer = load_policy(config.model, lora=None)
    # the warm start under each seed's evaluation seed: run s is compared with warm[s], and their mean over seeds
    # is measured with the same sampling noise as the runs' (one evaluation of 200 puzzles has an SE of about 0.02)
    warm = {seed: warm_start_eval(config, model, tokenizer, seed=seed) for seed in range(config.seeds)}
    batch = frozen_batch(
        model,
        tokenizer,
        load_split("train", config.train_people, limit=2 if config.quick else 4),  # per people count
        config.group_size,
        prompt_style=config.prompt_style(),
        temperature=config.temperature,
        max_new_tokens=config.max_new_tokens,
        fast_path=config.fast_path,
    )
    shift = counterfactual(
        model,
        batch,
        {m: METHODS[m] for m in config.methods},
        lr=base.lr,
        optimizer="adamw",
        base=replace(base, prompts_per_step=len(batch.puzzles), minibatch_size=len(batch.rollout)),
    )
    return warm, shift


WARM_START_CACHE = "warm_start_evals.json"
"""In data/lab_model/: the bundled model's test accuracy under given evaluation settings, so the demo does not spend
a minute of its budget (measured: 1.1 min) re-measuring a model that never changes (keyed by the weights' sha256)."""


def warm_start_eval(config: DemoConfig, model, tokenizer, seed: int = 0) -> dict[str, float]:
    """The warm start's test accuracy, with the same `evaluate` call as the final evaluation of the runs of ``seed``
    (whose sampling seed is the run's seed).

    For the bundled lab model the result is cached beside its weights, keyed by the weights' sha256 and every
    evaluation setting; `config.cache_warm_start=False` always measures afresh (and refreshes the cache)."""
    settings = {
        "eval_people": list(config.eval_people),
        "eval_size": config.eval_size,
        "eval_samples": config.eval_samples,
        "max_new_tokens": config.max_new_tokens,
        "prompt_style": config.prompt_style(),
        "seed": seed,
    }
    cache_file, key = None, None
    if config.model == "lab":
        weights = labmodel.lab_model_dir() / "model.safetensors"
        if weights.is_file():
            key = json.dumps({"sha256": hashlib.sha256(weights.read_bytes()).hexdigest(), **settings}, sort_keys=True)
            cache_file = weights.parent / WARM_START_CACHE
    cache = json.loads(cache_file.read_text()) if cache_file is not None and cache_file.is_file() else {}
    if config.cache_warm_start and key in cache and all(f"{k}_se" in cache[key] for k in _acc_keys(config)):
        return cache[key]  # (an entry recorded before evaluate reported standard errors is measured again)
    test = load_split("test", config.eval_people, limit=config.eval_size)
    warm = evaluate(
        model,
        tokenizer,
        test,
        prompt_style=settings["prompt_style"],
        max_new_tokens=config.max_new_tokens,
        samples=config.eval_samples,
        seed=settings["seed"],
        fast_path=config.fast_path,
    )
    if cache_file is not None and not config.quick:  # smoke runs (tests) leave the checkout untouched
        try:
            cache_file.write_text(json.dumps({**cache, key: warm}, indent=1, sort_keys=True) + "\n")
        except OSError as err:  # a read-only install: measuring every time is correct, only slower
            warnings.warn(f"could not cache the warm-start evaluation in {cache_file}: {err}", stacklevel=2)
    return warm


def _acc_keys(config: DemoConfig) -> list[str]:
    return [f"eval/{mode}/acc_{n}ppl" for mode in ("sample", "greedy") for n in config.eval_people]


def _finished(run_dir: Path, steps: int) -> bool:
    """Whether a run folder holds a complete run: its final checkpoint is committed (runs.py: its records are then
    on disk too). A run killed before that resumes (train's resume=True) and redoes what was not saved."""
    checkpoint = runs.latest_checkpoint(run_dir)
    return checkpoint is not None and checkpoint.name == f"step_{steps}"


def add_cli(subparsers) -> None:
    d = {f.name: f.default for f in fields(DemoConfig)}  # the defaults, without building (and checking) a config
    p = subparsers.add_parser("demo", help="GRPO, +AR, +Lopti, +AR+Lopti on the lab model (CPU) and a report")
    p.add_argument("--out", default="reports/demo", help="report folder (default reports/demo)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per method (spreads)")
    p.add_argument("--quick", action="store_true", help="a two-minute smoke run")
    p.add_argument("--steps", type=int, default=None, help=f"RL steps per run (default {d['steps']})")
    p.add_argument("--methods", nargs="+", default=None, help=f"a subset of {', '.join(METHODS)}")
    p.add_argument("--threads", type=int, default=None, help="torch threads in all (default: torch's)")
    p.add_argument(
        "--workers", type=int, default=None, help=f"runs trained at once, one process each (default {d['workers']})"
    )
    p.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate (default {d['lr']:g})")
    p.add_argument(
        "--temperature", type=float, default=None, help=f"rollout temperature (default {d['temperature']:g})"
    )
    p.add_argument("--ppo-epochs", type=int, default=None, help="passes over each step's rollouts (default 1)")
    p.add_argument("--fast-path", default=None, help=f"decoder: one of {', '.join(FAST_PATHS)} (default auto)")
    p.add_argument("--model", default=None, help='"lab" (the bundled lab model, default) or a lab model folder')
    p.add_argument("--max-new-tokens", type=int, default=None, help="response cap of rollouts and evaluation")
    p.add_argument(
        "--train-people",
        type=int,
        nargs="+",
        default=None,
        help=f"people counts trained on (default {' '.join(map(str, d['train_people']))})",
    )
    p.add_argument(
        "--eval-people",
        type=int,
        nargs="+",
        default=None,
        help=f"people counts evaluated (default {' '.join(map(str, d['eval_people']))})",
    )
    p.add_argument("--eval-size", type=int, default=None, help="test puzzles per people count (default 100)")
    p.set_defaults(func=_cli_demo)


def _cli_demo(args) -> int:
    names = ("steps", "lr", "temperature", "ppo_epochs", "fast_path", "model", "max_new_tokens", "train_people",
             "eval_people", "eval_size", "workers")  # fmt: skip
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.methods:
        overrides["methods"] = tuple(args.methods)
    try:
        config = DemoConfig(out=args.out, seeds=args.seeds, quick=args.quick, threads=args.threads, **overrides)
    except ValueError as err:
        raise SystemExit(f"lopti-lab demo: {err}") from None
    report = run_demo(config)
    print(f"report: {report / 'report.md'}")
    return 0
