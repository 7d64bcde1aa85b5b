"""`lopti-lab mechanism`: the paper's Fig. 1 and Fig. 3 measured the way the paper measured them, on the lab model.

    report = run_mechanism(MechanismConfig())         # `lopti-lab mechanism`: report folder reports/mechanism

Three measurements, one report folder (docs/mechanism.md reads them):

1. **Fig. 3 during training**: the four methods trained under each optimizer setting (``OPTIMIZER_SETTINGS``: the
   paper's SGD at lr 1e-3, AdamW at epsilon 1e-8, the demo's AdamW at epsilon 1e-3), the paper's measurement at every
   step (``probes.update_shift``: the real update, both Lopti stages, pre-AR advantage signs, float64 and bf16
   forwards), averaged over steps and seeds with 95% intervals (``fig3.csv``, ``fig3.png``, the paper's values drawn
   beside).
2. **Fig. 1c-f** on one frozen batch from the warm start: SGD at lr 1e-3 on all tokens, then on one probability bin's
   tokens alone (the advantages outside it zeroed), and what each update did to every bin (``fig1.png``).
3. **Why the optimizers differ**, on the same frozen batch: how Lopti's update departs from GRPO's as the step size
   grows (``step_size.csv``: to first order in lr the two stages add up to GRPO's update), and how much of a top-bin
   token's move comes from the other bins' gradients under SGD and under AdamW's first step (``decomposition.csv``).

The runs are trained two at a time in worker processes (``pool.RunPool``) while this process measures the frozen
batch; a study killed at any moment continues where it stopped when called again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import pandas as pd
import torch

from lopti_lab import durable, plots, runs
from lopti_lab.bins import DEFAULT_BINS
from lopti_lab.checks import FieldCheck, is_real
from lopti_lab.counterfactual import FrozenBatch, counterfactual, frozen_batch, whole_batch_update
from lopti_lab.kk import load_split
from lopti_lab.methods import LOPTI_ETA, METHODS, run_name
from lopti_lab.models import load_policy
from lopti_lab.paths import data_dir
from lopti_lab.pool import finished, train_while
from lopti_lab.probes import selective_sweep, selective_updates
from lopti_lab.studies.config import DEMO_TRAIN, PER_RUN, StudyConfig
from lopti_lab.studies.stats import ci95
from lopti_lab.train_config import TrainConfig

__all__ = [
    "MECHANISM_TRAIN",
    "OPTIMIZER_FIELDS",
    "OPTIMIZER_SETTINGS",
    "MechanismConfig",
    "decomposition",
    "fig3_source",
    "fig3_table",
    "run_mechanism",
    "step_size_scan",
]

OPTIMIZER_SETTINGS: dict[str, dict] = {
    "sgd": {"optimizer": "sgd", "lr": 1e-3, "adam_eps": 1e-8, "weight_decay": 0.0},
    "adamw-eps1e-8": {"optimizer": "adamw", "lr": 5e-5, "adam_eps": 1e-8, "weight_decay": 0.01},
    "adamw-eps1e-3": {"optimizer": "adamw", "lr": 1e-3, "adam_eps": 1e-3, "weight_decay": 0.01},
}
"""The optimizer settings compared, fixed before any run (docs/mechanism.md): the paper's Fig. 1 / Fig. 3 SGD (lr
1e-3, no momentum, no weight decay); AdamW at torch's epsilon 1e-8, as the paper trains, at lr 5e-5 (the largest lr
that did not break the lab model at that epsilon in the demo's GRPO sweep); and the demo's AdamW as it stood when
this study was fixed (lr 1e-3, epsilon 1e-3; the demo's lr is 5e-4 since). Each run's TrainConfig takes these fields
from its setting."""

OPTIMIZER_FIELDS = ("optimizer", "lr", "adam_eps", "weight_decay")
"""The TrainConfig fields an optimizer setting sets."""

MECHANISM_TRAIN = {
    **DEMO_TRAIN,
    "prompts_per_step": 3,
    "minibatch_size": 24,
    "steps": 5,
    "shift_every": 1,
    "shift_rows": 6,
    "probe_every": 0,
    "eval_people": (),
}
"""The runs' shared settings: the demo's (lab model, 2-3 people, 8 rollouts at T = 1.0, no KL, clip 1.0) with the
batch scaled down to 3 puzzles x 8 rollouts in one minibatch per stage, 5 steps, the Fig. 3 measurement at every
step on 6 of the positive-advantage rollouts (evenly spaced over the batch; the paper's code takes all of them, about
12 here: the study's 20-minute budget, docs/mechanism.md) and no test evaluation (the runs measure the mechanism, not
accuracy)."""


def mechanism_train(**changes) -> TrainConfig:
    return TrainConfig(**{**MECHANISM_TRAIN, **changes})


@dataclass
class MechanismConfig(StudyConfig):
    """`lopti-lab mechanism`: Fig. 1 and Fig. 3 as the paper measured them, for the four methods under each optimizer
    setting, and the measurements that say why the optimizers differ."""

    TRAIN_DEFAULTS: ClassVar[dict] = MECHANISM_TRAIN
    SET_PER_RUN: ClassVar[tuple[str, ...]] = (*PER_RUN, *OPTIMIZER_FIELDS)

    out: str = "reports/mechanism"
    """report folder (created; runs/<optimizer>/ inside holds each run folder)"""
    seeds: int = 2
    """seeds per (method, optimizer); every step of every seed is one Fig. 3 measurement"""
    train: TrainConfig = field(default_factory=mechanism_train)
    """the settings every run shares (MECHANISM_TRAIN; a dict of fields is read as changes to it); each run takes its
    optimizer, lr, adam_eps and weight_decay from its optimizer setting"""
    optimizers: tuple[str, ...] = tuple(OPTIMIZER_SETTINGS)
    """optimizer settings to compare (OPTIMIZER_SETTINGS)"""
    step_sizes: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1)
    """SGD learning rates of the frozen-batch step-size scan (Lopti's update against GRPO's)"""
    frozen_puzzles: int = 2
    """training puzzles per people count in the frozen batch of Fig. 1 and of the optimizer measurements"""

    def check(self, check: FieldCheck) -> None:
        if isinstance(self.optimizers, list):
            self.optimizers = tuple(self.optimizers)
        if isinstance(self.step_sizes, list):
            self.step_sizes = tuple(self.step_sizes)
        check.items("optimizers", lambda o: o in OPTIMIZER_SETTINGS, f"settings from {list(OPTIMIZER_SETTINGS)}",
                    distinct=True)  # fmt: skip
        check.items("step_sizes", lambda lr: is_real(lr) and lr > 0, "learning rates > 0", distinct=True)
        check.integer("frozen_puzzles", low=1)
        shared = TrainConfig(**MECHANISM_TRAIN)
        for name in OPTIMIZER_FIELDS:  # each optimizer setting gives these: a value here would be silently replaced
            if getattr(self.train, name) != getattr(shared, name):
                raise ValueError(f"MechanismConfig.train.{name} is set by each optimizer setting "
                                 f"(OPTIMIZER_SETTINGS): leave it at {getattr(shared, name)!r}, got "
                                 f"{getattr(self.train, name)!r}")  # fmt: skip
        if self.quick:
            self.step_sizes, self.frozen_puzzles = self.step_sizes[:2], 1

    def run_dirs(self) -> dict[tuple[str, str, int], Path]:
        """{(optimizer, method, seed): run folder}."""
        root = Path(self.out) / "runs"
        return {
            (o, m, s): root / o / run_name(m, seed=s)
            for o in self.optimizers
            for s in range(self.seeds)
            for m in self.methods
        }

    def run_configs(self) -> dict[tuple[str, str, int], TrainConfig]:
        return {
            (o, m, s): replace(self.train_config(m, s, d), **OPTIMIZER_SETTINGS[o])
            for (o, m, s), d in self.run_dirs().items()
        }


def run_mechanism(config: MechanismConfig) -> Path:
    """Train every (optimizer, method, seed) run with the Fig. 3 measurement on, measure the frozen batch meanwhile,
    and write the report; returns the report folder."""
    if config.threads:
        torch.set_num_threads(config.threads)
    with runs.writer_lock(config.out):  # one study per report folder (and each run its own lock, in its worker)
        return _run_mechanism(config)


def _run_mechanism(config: MechanismConfig) -> Path:
    out = Path(config.out)
    start = time.perf_counter()
    todo = [c for c in config.run_configs().values() if not finished(c)]

    def measure() -> dict:
        with durable.room(out):
            return _frozen_measurements(config, out)

    frozen = train_while(todo, config.workers, measure)
    with durable.room(out):  # a full disk: a DiskFullError naming the report folder (the runs are all kept)
        return _write_report(config, out, frozen, (time.perf_counter() - start) / 60)


def _write_report(config: MechanismConfig, out: Path, frozen: dict, minutes: float) -> Path:
    long = fig3_long(config)
    long.to_csv(out / "fig3_steps.csv", index=False)
    table = fig3_table(long)
    table.to_csv(out / "fig3.csv", index=False)
    plots.fig3(table).savefig(out / "fig3.png", dpi=110)
    summary = {"minutes": minutes, "runs": len(config.run_dirs()), "frozen_batch": frozen}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    (out / "report.md").write_text(_report(config, table, frozen, minutes))
    return out


# --- the frozen batch: Fig. 1c-f, the step-size scan, the decomposition -------------------------------------------


def _frozen_measurements(config: MechanismConfig, out: Path) -> dict:
    base = config.train
    model, tokenizer = load_policy(base.model, lora=None)
    batch = frozen_batch(
        model,
        tokenizer,
        load_split("train", base.train_people, limit=config.frozen_puzzles),
        base.group_size,
        prompt_style=base.prompt_style,
        temperature=base.temperature,
        max_new_tokens=base.max_new_tokens,
        fast_path=base.fast_path,
    )
    r = batch.rollout
    tokens, grads = selective_sweep(
        model, r.input_ids, r.attention_mask, r.response_mask, batch.advantages, lr=1e-3, temperature=batch.temperature
    )
    plots.fig1(tokens, grads).savefig(out / "fig1.png", dpi=110)
    fig1 = _fig1_table(tokens, grads)
    fig1.to_csv(out / "fig1.csv", index=False)
    steps = step_size_scan(model, batch, config.step_sizes)
    steps.to_csv(out / "step_size.csv", index=False)
    parts = decomposition(model, batch, config.optimizers)
    parts.to_csv(out / "decomposition.csv", index=False)
    return {"rows": len(r), "tokens": int(r.response_mask.sum()), "rewards": batch.rewards.tolist()}


def _fig1_table(tokens: pd.DataFrame, grads: pd.DataFrame) -> pd.DataFrame:
    """Per (update, bin): the bin's token share, the update's gradient norm, and the mean probability change of the
    bin's A > 0 and A < 0 tokens (Fig. 1a, 1c-f)."""
    rows = []
    norms = grads.set_index("update")["grad_norm"]
    for (update, b), cell in tokens.groupby(["update", "bin"]):
        n_all = (tokens["update"] == update).sum()
        pos, neg = cell[cell["advantage"] > 0], cell[cell["advantage"] < 0]
        rows.append({
            "update": update, "bin": int(b), "label": cell["label"].iloc[0], "token_share": len(cell) / n_all,
            "grad_norm": norms[update], "dp_mean_pos": pos["delta_p"].mean(), "dp_mean_neg": neg["delta_p"].mean(),
            "correct_pos": (pos["dlogp"] > 0).mean() if len(pos) else float("nan"),
        })  # fmt: skip
    return pd.DataFrame(rows)


def step_size_scan(model, batch: FrozenBatch, step_sizes, eta: float = LOPTI_ETA) -> pd.DataFrame:
    """One SGD update of GRPO and of GRPO+Lopti on the frozen batch at each lr, without gradient clipping (the
    first-order argument's premise: a clipped step is not linear in the gradient): the size of Lopti's departure from
    GRPO's update relative to GRPO's own (``rel_diff`` = ||dlogp_Lopti - dlogp_GRPO|| / ||dlogp_GRPO||, over every
    response token; first order in lr makes it proportional to lr), and each one's top-bin correct ratio."""
    pair = {
        "GRPO": METHODS["GRPO"].overrides(),
        "GRPO+Lopti": METHODS["GRPO+Lopti"].with_settings(lopti_eta=eta).overrides(),
    }
    update = whole_batch_update(batch, grad_clip=None)
    rows = []
    for lr in step_sizes:
        shift = counterfactual(model, batch, pair, lr=lr, optimizer="sgd", update=update)
        by = {m: t.sort_values(["seq", "pos"]) for m, t in shift.tokens.groupby("method")}
        g, lop = by["GRPO"]["dlogp"].to_numpy(), by["GRPO+Lopti"]["dlogp"].to_numpy()
        top = shift.bins[(shift.bins["sign"] == "pos") & (shift.bins["bin"] == shift.bins["bin"].max())]
        ratios = top.set_index("method")["correct_ratio"]
        rows.append({
            "lr": lr, "rel_diff": float(((lop - g) ** 2).sum() ** 0.5 / max(1e-300, (g**2).sum() ** 0.5)),
            "grpo_dlogp_norm": float((g**2).sum() ** 0.5), "top_correct_grpo": ratios.get("GRPO"),
            "top_correct_lopti": ratios.get("GRPO+Lopti"),
        })  # fmt: skip
    return pd.DataFrame(rows)


def decomposition(model, batch: FrozenBatch, optimizers, bins: Sequence[float] = DEFAULT_BINS) -> pd.DataFrame:
    """Under each optimizer setting's first step (SGD; AdamW's first step g / (|g| + eps) at that setting's lr and
    epsilon), the top bin's A > 0 tokens after updating all tokens, the top bin's alone, and the other bins' alone:
    their correct ratio each, the share of the all-token move along the others' move (``from_rest`` = <d_all,
    d_rest> / ||d_all||^2) and along the top bin's own (``from_top``), and how far the all-token move is from the sum
    of the two (``additivity`` = ||d_all - d_top - d_rest|| / ||d_all||: 0 to first order for SGD)."""
    r = batch.rollout
    args = (model, r.input_ids, r.attention_mask, r.response_mask, batch.advantages)
    top = len(bins) - 2
    rows = []
    for name in optimizers:
        setting = OPTIMIZER_SETTINGS[name]
        kw = {"lr": setting["lr"], "optimizer": setting["optimizer"], "adam_eps": setting["adam_eps"],
              "temperature": batch.temperature, "bins": bins}  # fmt: skip
        parts = {"all": None, "top": [top], "rest": list(range(top))}
        updates = selective_updates(*args, list(parts.values()), **kw)
        moves = {
            part: u.shift.tokens.sort_values(["seq", "pos"]).reset_index(drop=True)
            for part, u in zip(parts, updates, strict=True)
        }
        in_top = (moves["all"]["bin"] == top) & (moves["all"]["advantage"] > 0)
        d = {part: t.loc[in_top, "dlogp"].to_numpy() for part, t in moves.items()}
        norm = max(1e-300, float((d["all"] ** 2).sum()))
        rows.append({
            "optimizer": name, "tokens": int(in_top.sum()),
            **{f"correct_{part}": float((v > 0).mean()) if len(v) else float("nan") for part, v in d.items()},
            "from_rest": float((d["all"] * d["rest"]).sum() / norm),
            "from_top": float((d["all"] * d["top"]).sum() / norm),
            "additivity": float(((d["all"] - d["top"] - d["rest"]) ** 2).sum() ** 0.5 / norm**0.5),
        })  # fmt: skip
    return pd.DataFrame(rows)


# --- Fig. 3 over the runs ------------------------------------------------------------------------------------------


def fig3_source(folder: str | Path = "reports/mechanism") -> tuple[pd.DataFrame, Path]:
    """(the Fig. 3 table, where it was read): ``folder``'s fig3.csv when ``lopti-lab mechanism`` wrote one there,
    else the study recorded with lopti_lab (``data/mechanism/fig3.csv``, docs/mechanism.md says how it was run)."""
    for file in (Path(folder) / "fig3.csv", data_dir() / "mechanism" / "fig3.csv"):
        if file.is_file():
            return pd.read_csv(file), file
    raise FileNotFoundError(f"no fig3.csv in {folder} or in {data_dir() / 'mechanism'}: run `lopti-lab mechanism`")


def fig3_long(config: MechanismConfig) -> pd.DataFrame:
    """One row per (optimizer, method, seed, step, precision, binning, bin, stat) of every run's fig3/ metrics."""
    rows = []
    for (optimizer, method, seed), run_dir in config.run_dirs().items():
        for record in runs.load_metrics(run_dir):
            for key, value in record.items():
                if not key.startswith("fig3/") or key.count("/") != 3:
                    continue
                _, precision, binning, stat_bin = key.split("/")
                stat, _, b = stat_bin.rpartition("_bin")
                rows.append((optimizer, method, seed, record["step"], precision, binning, int(b), stat, value))
    columns = ["optimizer", "method", "seed", "step", "precision", "binning", "bin", "stat", "value"]
    return pd.DataFrame(rows, columns=columns)


def fig3_table(long: pd.DataFrame) -> pd.DataFrame:
    """Mean and 95% interval over every (seed, step) measurement, per (optimizer, method, precision, binning, bin,
    stat); ``n`` the measurements with a value (a bin without A > 0 tokens at a step has none)."""
    keys = ["optimizer", "method", "precision", "binning", "bin", "stat"]
    grouped = long.dropna(subset=["value"]).groupby(keys, sort=False)["value"]
    return grouped.agg(mean="mean", ci95=ci95, n="count").reset_index()


def _cell(by: pd.DataFrame, precision: str, stat: str) -> str:
    """ "mean ± ci" of one (precision, stat) row of a method's table, "-" when it has none."""
    if (precision, stat) not in by.index:
        return "-"
    row = by.loc[(precision, stat)]
    return f"{row['mean']:.3f} ± {row['ci95']:.3f}" if row["n"] > 1 else f"{row['mean']:.3f}"


def _report(config: MechanismConfig, table: pd.DataFrame, frozen: dict, minutes: float) -> str:
    lines = []
    for binning, top, label in (("q", 3, "p > 0.75"), ("d", 9, "p > 0.9")):
        lines.append(f"\nTop bin ({label}), correct ratio of positive-advantage tokens, mean ± 95% CI over seeds x "
                     f"steps:\n")  # fmt: skip
        lines.append(
            "| optimizer | method | float64 | float64, zeros excluded | bf16 | bf16, zeros excluded | bf16 zeros |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        cells = table[(table["binning"] == binning) & (table["bin"] == top)]
        for (optimizer, method), rows in cells.groupby(["optimizer", "method"], sort=False):
            by = rows.set_index(["precision", "stat"])
            wanted = [("float64", "correct"), ("float64", "correct_moved"), ("bfloat16", "correct"),
                      ("bfloat16", "correct_moved"), ("bfloat16", "zero_share")]  # fmt: skip
            shown = [_cell(by, precision, stat) for precision, stat in wanted]
            lines.append(f"| {optimizer} | {method} | " + " | ".join(shown) + " |")
    train = config.train
    rows = "all" if train.shift_rows is None else f"at most {train.shift_rows}"
    return f"""# lopti_lab mechanism study: Fig. 1 and Fig. 3 as the paper measured them

{len(config.methods)} methods x {len(config.optimizers)} optimizer settings x {config.seeds} seeds, {train.steps} RL
steps each ({train.prompts_per_step} puzzles x {train.group_size} rollouts at T = {train.temperature:g}, one
minibatch per stage, clip {train.grad_clip}), the Fig. 3 measurement at every step on {rows} of its A > 0 rollouts;
{minutes:.1f} minutes in all.
Frozen batch of Fig. 1 and of the optimizer measurements: {frozen["rows"]} rollouts, {frozen["tokens"]} response
tokens. Settings: {json.dumps({k: OPTIMIZER_SETTINGS[k] for k in config.optimizers})}.
{chr(10).join(lines)}

Files: fig3.csv (every bin, both binnings, both precisions), fig3_steps.csv (each step), fig1.csv / fig1.png (Fig.
1a, 1c-f on the frozen batch, SGD lr 1e-3), step_size.csv (Lopti against GRPO as the lr grows), decomposition.csv
(a top-bin token's move from the other bins' gradients, per optimizer).

![Fig. 3](fig3.png)
![Fig. 1](fig1.png)
"""
