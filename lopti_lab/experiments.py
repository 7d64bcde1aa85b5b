"""Experiments built from the trainer and the probes: the frozen-batch counterfactual and the lab-model demo.

    batch = frozen_batch(model, tokenizer, puzzles, group_size=8)         # one rollout, scored, kept fixed
    shift = counterfactual(model, batch, lr=1e-4)                          # GRPO / AR / Lopti / AR+Lopti on it
    plots.fig2(shift=shift.bins)                                           # the paper's Fig. 2b

    report = run_demo(DemoConfig(seeds=3))                                 # `lopti-lab demo --seeds 3`

The counterfactual applies each method's update (one RL step's optimizer steps, exactly as the trainer takes them)
to the SAME batch from the SAME weights, measures how every response token's probability moved, and restores the
weights: the cleanest view of what AR and Lopti change, free of sampling noise.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import pandas as pd
import torch

from lopti_lab import labmodel, plots, runs
from lopti_lab.checks import FieldCheck, is_int, rename_owner
from lopti_lab.kk import Puzzle, build_prompt, load_split
from lopti_lab.objective import group_advantages
from lopti_lab.probes import probability_shift
from lopti_lab.probes.shift import float64_logprobs
from lopti_lab.rollout import FAST_PATHS, Rollout, response_logprobs, sample
from lopti_lab.theory import DEFAULT_BINS
from lopti_lab.trainer import TrainConfig, advantages_and_stages, evaluate, score_rollout, train, update_policy

METHODS: dict[str, dict] = {
    "GRPO": {},
    "GRPO+AR": {"ar_alpha": 0.3},
    "GRPO+Lopti": {"lopti_eta": 0.5},
    "GRPO+AR+Lopti": {"ar_alpha": 0.3, "lopti_eta": 0.5},
}
"""The paper's four variants with its K&K settings (alpha = 0.3, eta = 0.5), as TrainConfig overrides."""

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
# the frozen-batch counterfactual


@dataclass
class FrozenBatch:
    """One scored rollout, kept fixed so that several updates can be compared on it."""

    puzzles: list[Puzzle]
    rollout: Rollout
    rewards: torch.Tensor
    """(B,) Logic-RL totals."""
    advantages: torch.Tensor
    """(B,) GRPO advantages (before AR)."""
    temperature: float


def frozen_batch(
    model,
    tokenizer,
    puzzles: Sequence[Puzzle],
    group_size: int = 8,
    *,
    prompt_style: str = labmodel.LAB_PROMPT_STYLE,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    seed: int = 0,
    fast_path: str = "auto",
) -> FrozenBatch:
    """Sample G completions per puzzle (with rollout log-probs), score them and compute GRPO advantages."""
    torch.manual_seed(seed)
    prompts = [build_prompt(p, prompt_style, tokenizer) for p in puzzles]
    rollout = sample(
        model,
        tokenizer,
        prompts,
        group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        fast_path=fast_path,
    )
    totals = torch.tensor([r.total for r in score_rollout(rollout, puzzles)], device=rollout.response_ids.device)
    return FrozenBatch(list(puzzles), rollout, totals, group_advantages(totals, group_size), temperature)


@dataclass
class Counterfactual:
    """What each method's update did to the same batch."""

    tokens: pd.DataFrame
    """`probes.ProbabilityShift.tokens` of every method, with a `method` column."""
    bins: pd.DataFrame
    """Per (method, bin, sign): n_tokens, correct_ratio, delta_p quantiles (`theory.shift_summary`)."""
    updates: pd.DataFrame
    """Per method: optimizer steps taken and the mean gradient norm."""


def counterfactual(
    model,
    batch: FrozenBatch,
    methods: dict[str, dict] | None = None,
    *,
    lr: float = 1e-4,
    optimizer: str = "sgd",
    bins: Sequence[float] = DEFAULT_BINS,
    base: TrainConfig | None = None,
) -> Counterfactual:
    """Apply each method's update to ``batch`` from the same weights; measure the probability shift; restore.

    ``base`` supplies the update's settings (clip range, minibatch size, ...); by default one minibatch holds the whole
    batch, so GRPO takes one optimizer step and Lopti two (low, then high). ``optimizer``: "sgd" shows gradient
    sizes directly (the paper's Fig. 1 uses SGD), "adamw" is what training uses (its first step is sign-like).
    The correct ratio compares each token's probability change with the sign of its advantage (AR never flips it).
    """
    methods = METHODS if methods is None else methods
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
    rollout = batch.rollout
    if base is None:
        prompts = len(rollout) // rollout.group_size
        base = TrainConfig(
            model="lab",
            kl_coef=0.0,
            minibatch_size=len(rollout),
            prompts_per_step=prompts,
            group_size=rollout.group_size,
            temperature=batch.temperature,
        )
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    token_advantages = batch.advantages[:, None].expand_as(rollout.response_mask)  # (B, T)
    # the moves are measured between float64 forwards (probability_shift): a float32 probability near 1 hides them
    measure = (rollout.input_ids, rollout.attention_mask, rollout.response_mask, batch.temperature)
    before = float64_logprobs(model, *measure)
    shifts, updates = [], []
    try:
        for name, overrides in methods.items():
            cfg = replace(base, lr=lr, **{"ar_alpha": None, "lopti_eta": None, **overrides})
            opt = (
                torch.optim.SGD(params, lr=lr)
                if optimizer == "sgd"
                else torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            )
            weighted, stages, _ = advantages_and_stages(rollout, batch.advantages, cfg)
            stats = update_policy(model, opt, rollout, weighted, stages, cfg)
            after = float64_logprobs(model, *measure)
            shift = probability_shift(before, after, token_advantages, rollout.response_mask, bins)
            shifts.append((name, shift))
            updates.append(
                {"method": name, "optimizer_steps": stats["update/optimizer_steps"], "grad_norm": stats["grad/norm"]}
            )
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    return Counterfactual(
        tokens=pd.concat([s.tokens.assign(method=n) for n, s in shifts], ignore_index=True),
        bins=pd.concat([s.bins.assign(method=n) for n, s in shifts], ignore_index=True),
        updates=pd.DataFrame(updates),
    )


# ---------------------------------------------------------------------------------------------------------------------
# the lab demo: GRPO, GRPO+AR, GRPO+Lopti, GRPO+AR+Lopti on the lab model, on a laptop CPU


@dataclass
class DemoConfig:
    """`lopti-lab demo`: the four methods on the lab model, same data and seeds, then a report folder.

    The RL settings are the paper's (PAPER.md §6: clip 0.2 / 0.24, dual clip 10, token-mean loss, AR alpha 0.3,
    Lopti eta 0.5) scaled down to a CPU: fewer prompts per step, shorter responses, and no KL term (it costs a
    second forward per step; at 0.001 it barely acts in a few dozen steps). Nothing here is tuned per method.

    The shared settings were picked on GRPO alone, 3-person puzzles, 400 sampled test completions after 30 steps
    (warm start 25.75%): lr 5e-5 on 3-5 people 25.75%; lr 1e-4 on 3 people 30.25% (minibatch 64), 30.5% (32),
    25.5% (16), 31.25% (rollouts at T = 1.0); lr 3e-4 at T = 1.0 collapsed to 12%. Training on 3 people only keeps
    responses short, so more steps fit in the 15-minute budget. A wider sweep (`benchmarks/lab_rl_sweep.py`, table
    in benchmarks/README.md) found no setting that gains more than 5 points in 20 steps; its best, two PPO epochs at
    T = 1.0 (`ppo_epochs=2, temperature=1.0`), gained about 9 points after 40-60 steps there (2 seeds), and 3 ± 5 over
    3 seeds when run the demo's way for 60 steps (28.5 min for GRPO alone): beyond the budget either way.
    """

    out: str = "reports/demo"
    """report folder (created; runs/ inside holds each run folder)"""
    seeds: int = 1
    """seeds per method (> 1 gives spreads)"""
    quick: bool = False
    """a two-minute smoke version (tests): 2 steps, small evaluation"""
    steps: int = 20
    """RL steps per run"""
    prompts_per_step: int = 8
    group_size: int = 8
    lr: float = 1e-4
    """AdamW learning rate (full fine-tuning of the lab model)"""
    minibatch_size: int = 32
    """rollouts per optimizer step: two minibatches per RL step (the paper: 512 rollouts in minibatches of 256)"""
    temperature: float = 0.7
    """rollout temperature (the paper's 0.7); evaluation samples at 1.0"""
    ppo_epochs: int = 1
    """passes over each step's rollouts per stage (the paper: 1)"""
    max_new_tokens: int = 200
    train_people: tuple[int, ...] = (3,)
    eval_people: tuple[int, ...] = (2, 3, 4, 5)
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
    """torch threads (None: torch's default)"""
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
        check.real("temperature", low=0, low_open=True)
        check.items("train_people", lambda n: is_int(n) and n >= 2, "people counts >= 2", distinct=True)
        check.items("eval_people", lambda n: is_int(n) and n >= 2, "people counts >= 2", distinct=True)
        check.integer("probe_every", low=0)
        check.flag("cache_warm_start")
        check.items("methods", lambda m: m in METHODS, f"methods from {list(METHODS)}", distinct=True)
        check.text("model")
        check.integer("threads", low=1, optional=True)
        check.choice("fast_path", FAST_PATHS)
        if self.quick:  # every code path once, on the smallest batches that exercise it (tests, notebook QUICK)
            self.steps, self.prompts_per_step, self.group_size, self.eval_size, self.eval_samples = 2, 4, 4, 8, 1
            self.eval_people, self.probe_every = self.eval_people[:2], 1
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
    """Train every (method, seed), evaluate the warm start once, and write the report; returns the report folder."""
    from lopti_lab.models import load_policy

    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = config.train_config(config.methods[0], 0, out / "runs" / "probe")  # validates before any work
    model, tokenizer = load_policy(config.model, lora=None)
    warm = warm_start_eval(config, model, tokenizer)
    batch = frozen_batch(
        model,
        tokenizer,
        load_split("train", config.train_people, limit=4 if config.quick else 16),
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
    del model
    run_dirs = {}
    for seed in range(config.seeds):
        for method in config.methods:
            run_dir = out / "runs" / f"{slug(method)}-seed{seed}"
            if _finished(run_dir, config.steps):
                run_dirs[(method, seed)] = run_dir  # an earlier, complete run of the same report: keep it
                continue
            train(config.train_config(method, seed, run_dir), resume=runs.RunFolder(run_dir).exists())
            run_dirs[(method, seed)] = run_dir
    report = write_report(config, out, run_dirs, warm, shift, minutes=(time.perf_counter() - start) / 60)
    return report


WARM_START_CACHE = "warm_start_evals.json"
"""In data/lab_model/: the bundled model's test accuracy under given evaluation settings, so the demo does not spend
a minute of its budget (measured: 1.1 min) re-measuring a model that never changes (keyed by the weights' sha256)."""


def warm_start_eval(config: DemoConfig, model, tokenizer) -> dict[str, float]:
    """The warm start's test accuracy, with the same `evaluate` call as every run's final evaluation (sampling
    seed 0, that of the seed-0 runs).

    For the bundled lab model the result is cached beside its weights, keyed by the weights' sha256 and every
    evaluation setting; `config.cache_warm_start=False` always measures afresh (and refreshes the cache)."""
    settings = {
        "eval_people": list(config.eval_people),
        "eval_size": config.eval_size,
        "eval_samples": config.eval_samples,
        "max_new_tokens": config.max_new_tokens,
        "prompt_style": config.prompt_style(),
        "seed": 0,
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


def accuracy_table(config: DemoConfig, run_dirs: dict, warm: dict, mode: str = "sample") -> pd.DataFrame:
    """The paper's layout: one row per (model, seed) (warm start, + each method), one column per people count and
    avg, and beside each its evaluation standard error (``{n}ppl_se``, ``avg_se``: `trainer.accuracy_se`; the
    avg's from the independent people counts, sqrt(sum se^2) / k)."""
    people = list(config.eval_people)
    models = [("Lab model (warm start)", 0, warm)]
    models += [(f"+ {m.replace('+', ' + ')}", seed, runs.load_metrics(d)[-1]) for (m, seed), d in run_dirs.items()]
    rows = []
    for model, seed, metrics in models:
        row = {"model": model, "seed": seed}
        for n in people:
            row[f"{n}ppl"] = metrics[f"eval/{mode}/acc_{n}ppl"]
            row[f"{n}ppl_se"] = metrics.get(f"eval/{mode}/acc_{n}ppl_se", math.nan)
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame["avg"] = frame[[f"{n}ppl" for n in people]].mean(axis=1)
    frame["avg_se"] = (frame[[f"{n}ppl_se" for n in people]] ** 2).sum(axis=1, min_count=len(people)) ** 0.5 / len(
        people
    )
    return frame


def _markdown(mean: pd.DataFrame, std: pd.DataFrame | None) -> str:
    """Cells "mean ± std over seeds" (``std`` given) or "accuracy ± its evaluation SE" (one seed)."""
    columns = [c for c in mean.columns if not c.endswith("_se")]
    if std is None and all(f"{c}_se" in mean.columns for c in columns):
        std = mean[[f"{c}_se" for c in columns]].rename(columns=lambda c: c.removesuffix("_se"))
    lines = [
        "| " + " | ".join(["K&K accuracy (people)", *[c.removesuffix("ppl") for c in columns]]) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for model, row in mean.iterrows():
        spread = [None if std is None or pd.isna(std.loc[model, c]) else std.loc[model, c] for c in columns]
        cells = [f"{row[c]:.2f}" + ("" if sd is None else f" ± {sd:.2f}") for c, sd in zip(columns, spread)]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(
    config: DemoConfig, out: Path, run_dirs: dict, warm: dict, shift: Counterfactual, minutes: float
) -> Path:
    """Everything a reader needs from the demo, as files in ``out``: metrics.csv, accuracy_{sample,greedy}.{csv,md},
    learning_curves.png, gradient_share.png, correct_ratio.png, counterfactual.csv, summary.json and report.md."""
    long = runs.compare(list(run_dirs.values()))
    long.to_csv(out / "metrics.csv", index=False)
    tables, means = {}, {}
    for mode in ("sample", "greedy"):
        frame = accuracy_table(config, run_dirs, warm, mode)
        frame.to_csv(out / f"accuracy_{mode}.csv", index=False)
        grouped = frame.drop(columns="seed").groupby("model", sort=False)
        means[mode] = grouped.mean()  # the _se columns: a single run's evaluation SE, averaged over seeds
        std = grouped.std(ddof=1) if config.seeds > 1 else None  # sample std; NaN for the single warm-start row
        tables[mode] = _markdown(means[mode], std) + _se_line(means[mode], config)
        (out / f"accuracy_{mode}.md").write_text(tables[mode])
    shift.bins.to_csv(out / "counterfactual.csv", index=False)
    figures = {
        "learning_curves.png": plots.learning_curves(
            long, ["reward/mean", "acc/all", "len/response_mean", "policy/entropy"]
        ),
        "gradient_share.png": plots.gradient_share(long),
        "correct_ratio.png": plots.fig2(shift=shift.bins),
    }
    if config.probe_every > 0:  # the probe steps' bins over training (Fig. 1a, 1d and 2b per step)
        figures["mechanism.png"] = plots.mechanism_over_steps(long)
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=110)
    verdict = compare_methods(means["sample"], config)
    summary = {
        "config": asdict(config),
        "minutes": minutes,
        "warm_start": warm,
        "verdict": verdict,
        "accuracy_sample": means["sample"].to_dict(orient="index"),
        "accuracy_greedy": means["greedy"].to_dict(orient="index"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    (out / "report.md").write_text(_report_text(config, tables, verdict, minutes))
    return out


def _se_line(mean: pd.DataFrame, config: DemoConfig) -> str:
    """Below a table: what the ± means, and with several seeds the evaluation's own SE of one run."""
    if config.seeds == 1:
        return "\n± is the evaluation's standard error (test puzzles as the unit: `trainer.accuracy_se`).\n"
    runs_only = mean.drop(index="Lab model (warm start)", errors="ignore")
    cells = ", ".join(f"{c.removesuffix('ppl_se')} people {runs_only[c].mean():.3f}"
                      for c in runs_only.columns if c.endswith("ppl_se"))  # fmt: skip
    return f"\n± is the std over seeds; one run's evaluation standard error, for scale: {cells}.\n"


def compare_methods(mean: pd.DataFrame, config: DemoConfig) -> list[str]:
    """Plain sentences: each method's average sampled accuracy against GRPO's and the warm start's."""
    lines = []
    warm = mean.loc["Lab model (warm start)", "avg"]
    grpo_row = "+ GRPO"
    for model, row in mean.iterrows():
        if model == "Lab model (warm start)":
            continue
        line = f"{model.removeprefix('+ ')}: avg {row['avg']:.3f} ({row['avg'] - warm:+.3f} over the warm start"
        if model != grpo_row and grpo_row in mean.index:
            line += f", {row['avg'] - mean.loc[grpo_row, 'avg']:+.3f} over GRPO"
        lines.append(line + ")")
    if config.seeds == 1:
        lines.append("One seed only: differences of a few points are within sampling noise (run --seeds 3).")
    return lines


def _report_text(config: DemoConfig, tables: dict, verdict: list[str], minutes: float) -> str:
    seeds = f"{config.seeds} seed{'s' if config.seeds > 1 else ''}"
    return f"""# lopti_lab demo: GRPO, AR and Lopti on the lab model

{len(config.methods)} methods x {seeds}, {config.steps} RL steps each ({config.prompts_per_step} puzzles x
{config.group_size} samples, {", ".join(map(str, config.train_people))} people), full fine-tuning of the lab model,
{minutes:.1f} minutes in all. Test accuracy is the share of completions scoring 3 on the bundled test split
({config.eval_size} puzzles per people count){"; mean ± std over seeds" if config.seeds > 1 else ""}.

## Sampled at temperature 1.0 ({config.eval_samples} per puzzle)

{tables["sample"]}
## Greedy

{tables["greedy"]}
## What it shows

{chr(10).join("- " + line for line in verdict)}

Whether AR or Lopti beats GRPO at this scale is an experimental result of this run, not a claim: read the spread.

## Figures

- `learning_curves.png`: reward, training accuracy, response length and entropy per step (mean over seeds).
- `gradient_share.png`: each probability bin's share of the tokens and of the gradient (the paper's Fig. 1a/1d).
- `correct_ratio.png`: one update of each method on the same frozen batch from the warm start: the share of
  positive-advantage tokens whose probability went up, per probability bin (the paper's Fig. 2b).
- `mechanism.png`: the same quantities during training, at every probe step: each bin's share of the tokens and of
  the gradient, and the correct ratio of the step's update among the tokens that moved (mean over seeds).

![learning curves](learning_curves.png)
![gradient share](gradient_share.png)
![correct ratio](correct_ratio.png)
{"![mechanism over training](mechanism.png)" if config.probe_every > 0 else ""}
"""


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="GRPO, +AR, +Lopti, +AR+Lopti on the lab model (CPU) and a report")
    p.add_argument("--out", default="reports/demo", help="report folder (default reports/demo)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per method (spreads)")
    p.add_argument("--quick", action="store_true", help="a two-minute smoke run")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run")
    p.add_argument("--methods", nargs="+", default=None, help=f"a subset of {', '.join(METHODS)}")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--temperature", type=float, default=None, help="rollout temperature (default 0.7)")
    p.add_argument("--ppo-epochs", type=int, default=None, help="passes over each step's rollouts (default 1)")
    p.add_argument("--fast-path", default=None, help=f"decoder: one of {', '.join(FAST_PATHS)} (default auto)")
    p.add_argument("--model", default=None, help='"lab" (the bundled lab model, default) or a lab model folder')
    p.add_argument("--max-new-tokens", type=int, default=None, help="response cap of rollouts and evaluation")
    p.add_argument("--train-people", type=int, nargs="+", default=None, help="people counts trained on (default 3)")
    p.add_argument("--eval-people", type=int, nargs="+", default=None, help="people counts evaluated (default 2-5)")
    p.add_argument("--eval-size", type=int, default=None, help="test puzzles per people count (default 100)")
    p.set_defaults(func=_cli_demo)


def _cli_demo(args) -> int:
    names = ("steps", "lr", "temperature", "ppo_epochs", "fast_path", "model", "max_new_tokens", "train_people",
             "eval_people", "eval_size")  # fmt: skip
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


def attribution_tables(model, batch: FrozenBatch, bins: Sequence[float] = DEFAULT_BINS) -> pd.DataFrame:
    """The gradient of the batch's GRPO loss (at ratio 1) split by probability bin, both ways (`probes` explains
    them): "loss" follows each bin's token losses through the whole network, "position" splits every weight
    gradient by the position the gradient passed through. One row per (attribution, bin)."""
    from lopti_lab.probes import GradientProbe, bin_gradient_norms

    rollout = batch.rollout
    probs, mask = rollout.old_logp.exp(), rollout.response_mask  # (B, T)

    def per_token_loss(before_forward=None):
        logp, _ = response_logprobs(
            model, rollout.input_ids, rollout.attention_mask, mask, batch.temperature, before_forward=before_forward
        )
        return -(batch.advantages[:, None] * logp) * mask / mask.sum()  # (B, T): the token-mean policy gradient

    model.zero_grad(set_to_none=True)
    loss_table = bin_gradient_norms(model, per_token_loss(), probs, mask, bins, attribution="loss")
    with GradientProbe(model, bins=bins) as probe:
        per_token_loss(lambda t: probe.set_tokens(probs[:, :t], mask[:, :t])).sum().backward()
    model.zero_grad(set_to_none=True)
    return pd.concat([loss_table, probe.summary()], ignore_index=True)
