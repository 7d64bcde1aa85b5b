"""Where does the mechanism operate? The paper's Fig. 3 premise (GRPO moves the top-bin tokens of positive-advantage
rollouts the wrong way: a correct ratio below 0.5 for p > 0.75, AR and Lopti at about 0.52-0.53) mapped over settings
on frozen batches, in exact arithmetic.

    settings = lr_axis("lab") + [Setting("start", "lab-hard", "sgd", 1e-3, 1, MAP_METHODS[:3])]
    run_map(settings, {"lab": "lab", "lab-hard": "lab-hard"}, "data/mechanism/map.csv", seeds=4)
    table = map_table(pd.read_csv("data/mechanism/map.csv"))       # mean and 95% t interval over seeds per cell

One cell is a (warm start, optimizer, lr, batch size) setting; one measurement is one frozen batch (``seed``: the
puzzles and the rollout sampling) updated once by each method from the same weights (``counterfactual``: one RL
step's optimizer steps with the whole batch as one minibatch, gradient clipping 1.0, no KL, a fresh optimizer, so an
AdamW step is its first, lr * g / (|g| + eps)), with every response token's move taken between float64 forwards.
A measurement's ratio is the share of the top bin's A > 0 tokens whose log-prob rose, among those that moved
(an exact tie, a log-prob that did not change in float64, is counted apart in ``n_ties``); the cell's interval is a
95% t interval over seeds, and each fix's paired difference from GRPO on the same frozen batches is given beside it.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from lopti_lab import durable
from lopti_lab.bins import DEFAULT_BINS
from lopti_lab.counterfactual import FrozenBatch, counterfactual, frozen_batch
from lopti_lab.kk import load_split
from lopti_lab.methods import METHODS
from lopti_lab.models import load_policy
from lopti_lab.studies.stats import ci95
from lopti_lab.update import OptimizerSpec

__all__ = [
    "LRS",
    "MAP_METHODS",
    "Setting",
    "batch_puzzles",
    "load_start",
    "lr_axis",
    "map_table",
    "measure_cell",
    "plot_map",
    "run_map",
    "top_bin_counts",
    "with_reference",
]

MAP_METHODS = ("GRPO", "GRPO+AR", "GRPO+Lopti", "GRPO+AR+Lopti")
"""The methods measured (AR alpha 0.3, Lopti eta 0.5, ``methods.METHODS``); a setting may take the first three."""

LRS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
"""The learning rates of the lr axis, under SGD and under AdamW."""

PEOPLE = (2, 3)
"""People counts of the frozen batches' puzzles (the lab models' training counts)."""

ADAM_EPS = 1e-8
"""AdamW's epsilon in every AdamW cell: torch's default, as the paper trains."""


@dataclass(frozen=True)
class Setting:
    """One cell of the map."""

    axis: str
    """the figure panel it belongs to: "lr", "batch", "start" or "width\""""
    start: str
    """the warm start's name (a key of ``run_map``'s ``starts``)"""
    optimizer: str
    """"sgd" (no momentum) or "adamw" (epsilon ``ADAM_EPS``); no weight decay (``counterfactual``)"""
    lr: float
    puzzles: int = 1
    """puzzles per people count in each frozen batch (x 8 rollouts x 2 counts: 1 -> 16 responses)"""
    methods: tuple[str, ...] = MAP_METHODS

    def key(self) -> tuple:
        return (self.axis, self.start, self.optimizer, float(self.lr), int(self.puzzles))


KEY = ["axis", "start", "optimizer", "lr", "puzzles"]
"""The columns that name a cell in the map's CSV (``Setting.key``)."""


def lr_axis(start: str, lrs: Sequence[float] = LRS, puzzles: int = 1, axis: str = "lr") -> list[Setting]:
    """SGD and AdamW at each lr, one warm start, every method."""
    return [Setting(axis, start, opt, lr, puzzles) for opt in ("sgd", "adamw") for lr in lrs]


# --- one measurement ------------------------------------------------------------------------------------------------


def top_bin_counts(tokens: pd.DataFrame, top: float = DEFAULT_BINS[-2]) -> dict:
    """Counts of one method's update over the A > 0 tokens whose probability before it was >= ``top``.

    ``tokens`` has one row per response token with ``p_old``, ``advantage`` and ``dlogp`` (``counterfactual``'s
    token table). Worked example, top bin tokens with dlogp (+1e-9, -2e-9, 0, +3e-12) and A > 0: n_top 4, n_up 2,
    n_down 1, n_ties 1, ratio 2/3 (among the moved), ratio_ties_down 2/4 (an unmoved token counted as not up)."""
    cell = tokens[(tokens["advantage"] > 0) & (tokens["p_old"] >= top)]
    up, down = int((cell["dlogp"] > 0).sum()), int((cell["dlogp"] < 0).sum())
    n = len(cell)
    return {
        "n_top": n, "n_up": up, "n_down": down, "n_ties": n - up - down,
        "ratio": up / (up + down) if up + down else math.nan, "ratio_ties_down": up / n if n else math.nan,
    }  # fmt: skip


def batch_puzzles(puzzles: int, seed: int, people: Sequence[int] = PEOPLE) -> list:
    """The training puzzles of one frozen batch: ``puzzles`` per people count, seed k taking the k-th block of each
    count's split, so two seeds never share a puzzle."""
    chosen = []
    for n in people:
        split = load_split("train", n, limit=puzzles * (seed + 1))
        if len(split) < puzzles * (seed + 1):
            raise ValueError(f"the {n}-person training split has {len(split)} puzzles, seed {seed} needs more")
        chosen += split[puzzles * seed : puzzles * (seed + 1)]
    return chosen


def measure_cell(
    model,
    batch: FrozenBatch,
    optimizer: str,
    lr: float,
    methods: Sequence[str],
    adam_eps: float = ADAM_EPS,
    top: float = DEFAULT_BINS[-2],
) -> list[dict]:
    """Each method's update of ``batch`` from the model's weights (restored after), and its counts over the tokens
    at p >= ``top`` (``top_bin_counts``): one dict per method, with the update's gradient norm (before clipping) and
    optimizer steps."""
    overrides = {m: METHODS[m].overrides() for m in methods}
    cf = counterfactual(model, batch, overrides, lr=lr, optimizer=optimizer, adamw=OptimizerSpec(adam_eps=adam_eps))
    updates = cf.updates.set_index("method")
    rows = []
    for method in methods:
        counts = top_bin_counts(cf.tokens[cf.tokens["method"] == method], top)
        rows.append({"method": method, **counts, "grad_norm": float(updates.loc[method, "grad_norm"]),
                     "optimizer_steps": int(updates.loc[method, "optimizer_steps"])})  # fmt: skip
    return rows


def batch_profile(batch: FrozenBatch) -> dict:
    """How well the warm start does on the frozen batch (its rollouts at T = 1.0 on training puzzles): the share of
    rollouts scoring 3 (solved), of rollouts with the format right (total > -3), of rows with A > 0, and the share of
    response tokens in the top bin."""
    rewards, mask = batch.rewards.float(), batch.rollout.response_mask.bool()
    p = batch.rollout.old_logp.exp()[mask]
    return {
        "rows": len(rewards), "tokens": int(mask.sum()), "solved": float((rewards == 3).float().mean()),
        "format_ok": float((rewards > -3).float().mean()), "rows_pos": int((batch.advantages > 0).sum()),
        "top_share": float((p >= DEFAULT_BINS[-2]).float().mean()),
    }  # fmt: skip


# --- the map: resumable, one block of rows per finished (cell, seed) --------------------------------------------------


def load_start(spec: str):
    """(model, tokenizer) of a warm start: a ``models.load_policy`` name or folder ("lab", "lab-hard", a lab model
    folder), or a run's checkpoint folder (checkpoints/step_k with state.json), loaded into the model its run's
    config.json names. Full weights, no LoRA."""
    from lopti_lab import runs
    from lopti_lab.configs import read_json

    folder = Path(spec)
    if (folder / "state.json").is_file():
        run_config = read_json(folder.parent.parent / "config.json")
        model, tokenizer = load_policy(run_config["model"], lora=None)
        runs.load_checkpoint(folder, model, restore_rng=False)
        return model, tokenizer
    return load_policy(spec, lora=None)


def _done(out: Path) -> pd.DataFrame:
    """The finished rows of ``out`` (a block cut short by a kill is dropped, and the file rewritten without it)."""
    if not out.is_file():
        return pd.DataFrame()
    rows = pd.read_csv(out)
    complete = rows.groupby([*KEY, "seed"])["method"].transform("size") == rows["n_methods"]
    if not complete.all():
        rows = rows[complete]
        durable.atomic_write(out, rows.to_csv(index=False).encode())
    return rows


def run_map(
    settings: Iterable[Setting],
    starts: Mapping[str, str],
    out: str | Path,
    seeds: int = 4,
    *,
    group_size: int = 8,
    max_new_tokens: int = 640,
    log=print,
) -> pd.DataFrame:
    """Measure every (setting, seed) not yet in ``out`` and append its rows; returns all rows. ``starts`` maps each
    warm start's name to what ``load_start`` loads. Each warm start is loaded once and each frozen batch (warm start,
    batch size, seed) sampled once, so the cells of one warm start are paired by seed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done(out)
    finished = set() if done.empty else set(done[[*KEY, "seed"]].itertuples(index=False, name=None))
    todo = [(s, k) for s in settings for k in range(seeds) if (*s.key(), k) not in finished]
    for start in dict.fromkeys(s.start for s, _ in todo):
        model, tokenizer = load_start(starts[start])
        batches: dict[tuple[int, int], FrozenBatch] = {}
        for setting, seed in [(s, k) for s, k in todo if s.start == start]:
            clock = time.process_time()
            if (setting.puzzles, seed) not in batches:
                batches[setting.puzzles, seed] = frozen_batch(
                    model, tokenizer, batch_puzzles(setting.puzzles, seed), group_size,
                    max_new_tokens=max_new_tokens, seed=seed,
                )  # fmt: skip
            batch = batches[setting.puzzles, seed]
            rows = measure_cell(model, batch, setting.optimizer, setting.lr, setting.methods)
            extra = {**asdict(setting), "seed": seed, "n_methods": len(setting.methods), **batch_profile(batch),
                     "cpu_s": time.process_time() - clock}  # fmt: skip
            extra.pop("methods")
            block = pd.DataFrame([{**extra, **r} for r in rows])
            header = not out.is_file() or out.stat().st_size == 0
            buf = io.StringIO()
            block.to_csv(buf, index=False, header=header)
            durable.append(out, buf.getvalue().encode())
            grpo = block.set_index("method")["ratio"].get("GRPO")
            log(f"{setting.key()} seed {seed}: GRPO {grpo:.3f}, {extra['cpu_s']:.0f} CPU s")
        del model
    return _done(out)


# --- the table and the figure --------------------------------------------------------------------------------------


def with_reference(rows: pd.DataFrame, ref: Sequence[tuple[str, float]], axes=("batch", "start")):
    """``rows`` plus, for each of ``axes`` that has rows, a copy of the lr axis's rows at the ``ref`` (optimizer, lr)
    settings labelled with that axis: the lab model at one puzzle per count is the common point of every axis, and
    is measured once."""
    on_ref = pd.concat([rows[(rows["axis"] == "lr") & (rows["optimizer"] == o) & (rows["lr"] == lr)] for o, lr in ref])
    present = set(rows["axis"])
    copies = [on_ref.assign(axis=a) for a in axes if a in present]
    return pd.concat([rows, *copies], ignore_index=True)


def map_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (cell, method): mean and 95% t interval over seeds of the per-seed ratio, ``n_seeds``, the tokens and
    ties summed over seeds, the share of seeds below 0.5, and the paired difference from GRPO on the same frozen
    batches (mean and interval; NaN for GRPO itself)."""
    grpo = rows[rows["method"] == "GRPO"].set_index([*KEY, "seed"])["ratio"]
    diff = rows.set_index([*KEY, "seed"])["ratio"] - grpo.reindex(rows.set_index([*KEY, "seed"]).index).to_numpy()
    rows = rows.assign(diff=diff.to_numpy())
    grouped = rows.groupby([*KEY, "method"], sort=False)
    table = grouped.agg(
        n_seeds=("ratio", "count"), mean=("ratio", "mean"), ci95=("ratio", ci95), n_top=("n_top", "sum"),
        n_ties=("n_ties", "sum"), below_half=("ratio", lambda r: int((r < 0.5).sum())),
        diff_mean=("diff", "mean"), diff_ci95=("diff", ci95), solved=("solved", "mean"),
        top_share=("top_share", "mean"), rows=("rows", "mean"),
    ).reset_index()  # fmt: skip
    table.loc[table["method"] == "GRPO", ["diff_mean", "diff_ci95"]] = math.nan
    table["upper"] = table["mean"] + table["ci95"]
    table["lower"] = table["mean"] - table["ci95"]
    return table


AXIS_TITLES = {"lr": "learning rate (lab)", "batch": "batch size", "start": "warm start", "width": "model width"}


def plot_map(table: pd.DataFrame):
    """One panel per axis (two by two): GRPO's and each fix's top-bin correct ratio (mean and 95% interval over seeds)
    per setting, SGD filled markers and AdamW open ones, the 0.5 line and the paper's AR / Lopti band (0.52-0.53)."""
    from matplotlib.figure import Figure

    axes_present = [a for a in AXIS_TITLES if a in set(table["axis"])]
    cols = min(2, len(axes_present))
    rows = -(-len(axes_present) // cols)
    fig = Figure(figsize=(5.6 * cols, 4.2 * rows), layout="constrained")
    panels = fig.subplots(rows, cols, sharey=True, squeeze=False).ravel()
    methods = [m for m in MAP_METHODS if m in set(table["method"])]
    for i, (ax, axis) in enumerate(zip(panels, axes_present)):
        here = table[table["axis"] == axis]
        labels = list(dict.fromkeys(_label(r, axis) for _, r in _in_order(here).iterrows()))
        ax.axhspan(0.52, 0.53, color="0.85", zorder=0)
        ax.axhline(0.5, color="0.5", lw=0.8)
        for k, method in enumerate(methods):
            for optimizer, face in (("sgd", f"C{k}"), ("adamw", "white")):
                cells = here[(here["method"] == method) & (here["optimizer"] == optimizer)]
                x = [labels.index(_label(r, axis)) + 0.08 * (k - 1.5) for _, r in cells.iterrows()]
                ax.errorbar(x, cells["mean"], yerr=cells["ci95"], fmt="o", color=f"C{k}", mfc=face, ms=4, capsize=2,
                            label=f"{method}, {optimizer}" if axis == axes_present[0] else None)  # fmt: skip
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize="small")
        ax.set_title(AXIS_TITLES[axis], fontsize="medium")
        if i % cols == 0:
            ax.set_ylabel("top-bin (p > 0.75) correct ratio, A > 0", fontsize="small")
    for ax in panels[len(axes_present) :]:
        ax.set_visible(False)
    panels[0].legend(fontsize="xx-small", loc="lower left", ncol=2)
    return fig


START_ORDER = {"lab": 0, "lab-hard": 1, "half": 2}
"""The warm starts' order on the figure; the others (the widths) after them by the number in their name."""


def _in_order(here: pd.DataFrame) -> pd.DataFrame:
    """Rows by batch size, warm start, optimizer (SGD first) and lr."""

    def start_rank(name: str) -> tuple:
        digits = "".join(c for c in name if c.isdigit())
        return (START_ORDER.get(name, 3), int(digits) if digits else 0, name)

    keys = here.assign(
        _start=[start_rank(s) for s in here["start"]], _opt=(here["optimizer"] != "sgd").astype(int)
    )  # fmt: skip
    return keys.sort_values(["puzzles", "_start", "_opt", "lr"])


def _label(row, axis: str) -> str:
    opt = f"{row['optimizer']} {row['lr']:g}"
    if axis == "lr":
        return f"{row['lr']:g}"
    if axis == "batch":
        return f"{row['rows']:.0f} rows, {opt}"
    return f"{row['start']}, {opt}"
