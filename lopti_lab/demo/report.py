"""The demo's report folder: accuracy tables in the paper's layout (mean ± 95% confidence interval over seeds, or one
run's evaluation standard error), each seed's gain over the warm start, paired differences to GRPO, figures and
report.md. ``demo.run.run_demo`` trains; this module only reads run folders and writes files."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from lopti_lab import plots, plots_methods, runs
from lopti_lab.counterfactual import Counterfactual
from lopti_lab.demo.config import DemoConfig
from lopti_lab.demo.stats import ci95
from lopti_lab.paths import data_dir

WARM = "Lab model (warm start)"
GRPO_ROW = "+ GRPO"


# --- tables -----------------------------------------------------------------------------------------------------------


def _by_seed(warm: dict) -> dict[int, dict]:
    """``warm`` as {seed: metrics}: `run_demo` passes one evaluation per seed; a plain metrics dict is seed 0's."""
    return warm if warm and all(isinstance(v, dict) for v in warm.values()) else {0: warm}


def accuracy_table(config: DemoConfig, run_dirs: dict, warm: dict, mode: str = "sample") -> pd.DataFrame:
    """The paper's layout: one row per (model, seed) (warm start under each seed's evaluation seed, + each method),
    one column per people count and avg, and beside each its evaluation standard error (``{n}ppl_se``, ``avg_se``:
    `evaluate.accuracy_se`; the avg's from the independent people counts, sqrt(sum se^2) / k)."""
    people = list(config.train.eval_people)
    models = [(WARM, seed, metrics) for seed, metrics in sorted(_by_seed(warm).items())]
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


def spread_over_seeds(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(mean, 95% CI half-width) per model and column over the seeds of `accuracy_table`'s frame (for the warm start
    the spread of its evaluation alone); NaN where a model has one row. The ``_se`` columns' mean is one
    evaluation's SE."""
    grouped = frame.drop(columns="seed").groupby("model", sort=False)
    return grouped.mean(), grouped.agg(ci95)


def gains_per_seed(frame: pd.DataFrame, column: str = "avg") -> pd.DataFrame:
    """Each run's ``column`` minus the warm start's under the same evaluation seed (seed 0's where the warm start was
    evaluated once): one row per method, one column per seed, then mean and its 95% CI half-width."""
    warm = frame[frame["model"] == WARM].set_index("seed")[column]
    runs_only = frame[frame["model"] != WARM]
    table = runs_only.pivot(index="model", columns="seed", values=column).reindex(runs_only["model"].unique())
    table = table - pd.Series({seed: warm.get(seed, warm.iloc[0]) for seed in table.columns})
    table.columns = [f"seed {s}" for s in table.columns]
    seeds = list(table.columns)
    table["mean"] = table[seeds].mean(axis=1)
    table["ci95"] = table[seeds].apply(ci95, axis=1)
    return table


def paired_per_seed(frame: pd.DataFrame, columns: Sequence[str] = ("avg",)) -> pd.DataFrame:
    """Each method minus GRPO at the same seed (same puzzles in the same order, same sampling seed), for each of
    ``columns`` of `accuracy_table`'s frame: one row per (model, column, seed) with its ``diff``. Empty without GRPO."""
    rows = []
    order = [m for m in dict.fromkeys(frame["model"]) if m not in (WARM, GRPO_ROW)]
    for column in columns:
        wide = frame[frame["model"] != WARM].pivot(index="seed", columns="model", values=column)
        if GRPO_ROW not in wide.columns:
            continue
        for model in order:
            for seed, diff in (wide[model] - wide[GRPO_ROW]).dropna().items():
                rows.append({"model": model, "column": column, "seed": int(seed), "diff": float(diff)})
    return pd.DataFrame(rows, columns=["model", "column", "seed", "diff"])


def paired_vs_grpo(frame: pd.DataFrame, column: str = "avg") -> pd.DataFrame:
    """`paired_per_seed` of one column summarised: per method the mean difference to GRPO, its 95% CI half-width and
    the seeds where it was above / level / below. Empty without GRPO or with one seed."""
    diffs = paired_per_seed(frame, [column])
    if diffs.empty or diffs["seed"].nunique() < 2:
        return pd.DataFrame(columns=["mean", "ci95", "above", "level", "below"])
    rows = {}
    for model, part in diffs.groupby("model", sort=False):
        diff = part["diff"]
        rows[model] = {
            "mean": diff.mean(),
            "ci95": ci95(diff),
            "above": int((diff > 1e-12).sum()),
            "level": int((diff.abs() <= 1e-12).sum()),  # ties reported apart, not counted either way
            "below": int((diff < -1e-12).sum()),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def paired_intervals(diffs: pd.DataFrame) -> pd.DataFrame:
    """`paired_per_seed`'s rows summarised per (model, column): mean difference, 95% CI half-width (t over seeds), n."""
    grouped = diffs.groupby(["model", "column"], sort=False)["diff"]
    return grouped.agg(mean="mean", ci95=ci95, n="count").reset_index()


def recorded_comparison(folder: str | Path = "reports/methods") -> tuple[pd.DataFrame, Path]:
    """(a study's sampled `accuracy_table` frame, where it was read): ``folder``'s accuracy_sample.csv when `lopti-lab
    demo --out folder` wrote one there, else the token-credit comparison recorded with lopti_lab
    (``data/methods/comparison_sample.csv``; docs/methods.md says how it was run)."""
    for file in (Path(folder) / "accuracy_sample.csv", data_dir() / "methods" / "comparison_sample.csv"):
        if file.is_file():
            return pd.read_csv(file), file
    raise FileNotFoundError(f"no accuracy_sample.csv in {folder} or comparison_sample.csv in {data_dir() / 'methods'}")


def _markdown(mean: pd.DataFrame, spread: pd.DataFrame | None) -> str:
    """Cells "mean ± spread" (``spread`` given: the 95% CI over seeds) or "accuracy ± its evaluation SE" (one seed)."""
    columns = [c for c in mean.columns if not c.endswith("_se")]
    if spread is None and all(f"{c}_se" in mean.columns for c in columns):
        spread = mean[[f"{c}_se" for c in columns]].rename(columns=lambda c: c.removesuffix("_se"))
    lines = [
        "| " + " | ".join(["K&K accuracy (people)", *[c.removesuffix("ppl") for c in columns]]) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for model, row in mean.iterrows():
        cells = []
        for c in columns:
            sd = None if spread is None or pd.isna(spread.loc[model, c]) else spread.loc[model, c]
            cells.append(f"{row[c]:.2f}" + ("" if sd is None else f" ± {sd:.2f}"))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _se_line(mean: pd.DataFrame, config: DemoConfig) -> str:
    """Below a table: what the ± means, and with several seeds the evaluation's own SE of one run."""
    if config.seeds == 1:
        return "\n± is the evaluation's standard error (test puzzles as the unit: `evaluate.accuracy_se`).\n"
    columns = [c for c in mean.columns if c.endswith("_se")]

    def cells(row) -> str:
        return ", ".join(f"{c.removesuffix('ppl_se').removesuffix('_se')} {row[c]:.3f}" for c in columns)

    runs_only = mean.drop(index=WARM, errors="ignore")
    text = (
        f"\n± is the 95% confidence interval of the mean over {config.seeds} seeds (t distribution, "
        f"{config.seeds - 1} degrees of freedom); the warm start is evaluated once per seed, with that seed's "
        f"sampling seed, so its ± is the evaluation's noise alone. One evaluation's own standard error (test "
        f"puzzles as the unit), averaged over the runs: {cells(runs_only.mean())}"
    )
    if WARM in mean.index and not mean.loc[WARM, columns].isna().all():
        text += f"; over the warm start's evaluations: {cells(mean.loc[WARM])}"
    return text + ".\n"


def _gains_markdown(gains: pd.DataFrame) -> str:
    seeds = [c for c in gains.columns if c.startswith("seed")]
    lines = ["| method | " + " | ".join(seeds) + " | mean ± 95% CI |", "|---" * (len(seeds) + 2) + "|"]
    for model, row in gains.iterrows():
        ci = "" if pd.isna(row["ci95"]) else f" ± {100 * row['ci95']:.1f}"
        cells = [f"{100 * row[s]:+.1f}" for s in seeds]
        lines.append(f"| {model.removeprefix('+ ')} | " + " | ".join(cells) + f" | {100 * row['mean']:+.1f}{ci} |")
    return "\n".join(lines) + "\n"


def compare_methods(mean: pd.DataFrame, config: DemoConfig, paired: pd.DataFrame | None = None) -> list[str]:
    """Plain sentences: each method's average sampled accuracy against the warm start's and GRPO's; with several
    seeds, the difference to GRPO paired by seed with its 95% CI, and whether that interval excludes zero."""
    lines = []
    warm = mean.loc[WARM, "avg"]
    for model, row in mean.iterrows():
        if model == WARM:
            continue
        line = f"{model.removeprefix('+ ')}: avg {row['avg']:.3f} ({row['avg'] - warm:+.3f} over the warm start"
        if model != GRPO_ROW and GRPO_ROW in mean.index:
            line += f", {row['avg'] - mean.loc[GRPO_ROW, 'avg']:+.3f} over GRPO"
            if paired is not None and model in paired.index and not pd.isna(paired.loc[model, "ci95"]):
                p = paired.loc[model]
                lo, hi = p["mean"] - p["ci95"], p["mean"] + p["ci95"]
                verdict = "better than GRPO" if lo > 0 else "worse than GRPO" if hi < 0 else "not distinguishable"
                line += (
                    f"; paired by seed {p['mean']:+.3f} ± {p['ci95']:.3f}, {verdict}; seeds above / level with / "
                    f"below GRPO: {int(p['above'])} / {int(p['level'])} / {int(p['below'])}"
                )
        lines.append(line + ")")
    if config.seeds == 1:
        lines.append("One seed only: differences of a few points are within sampling noise (run --seeds 3).")
    return lines


# --- the mechanism ----------------------------------------------------------------------------------------------------


def mechanism_table(long: pd.DataFrame, sign: str = "pos") -> pd.DataFrame:
    """The numbers behind mechanism.png: per (method, probed step, bin), the mean over seeds of the bin's share of
    the response tokens (Fig. 1a), its share of the gradient (Fig. 1d) and the correct ratio of the step's update
    among its ``sign``-advantage tokens that moved (Fig. 2b), with the tokens counted over all seeds."""
    pattern = rf"^(tokens/share|grad/share|shift/correct_{sign}|shift/n_{sign})_bin(\d+)$"
    wide = plots._per_bin(long, pattern, "no tokens/share_bin*, grad/share_bin* or shift/* metrics")
    columns = {"tokens/share": "token_share", "grad/share": "grad_share", f"shift/correct_{sign}": "correct_ratio"}
    grouped = wide.groupby(["method", "step", "bin"], sort=False)
    table = grouped[[c for c in columns if c in wide.columns]].mean().rename(columns=columns)
    if f"shift/n_{sign}" in wide.columns:
        table["n_tokens"] = grouped[f"shift/n_{sign}"].sum()
    order = {m: i for i, m in enumerate(plots._methods(wide))}
    table = table.reset_index()
    return table.sort_values(["method", "step", "bin"], key=lambda c: c.map(order) if c.name == "method" else c)


def _mechanism_markdown(table: pd.DataFrame) -> str:
    """One line per (method, step): the four bins' token shares, gradient shares (%) and correct ratios."""

    def cells(rows: pd.DataFrame, column: str, scale: float, digits: int) -> str:
        if column not in rows or rows[column].isna().all():
            return "-"
        return " / ".join("-" if pd.isna(v) else f"{scale * v:.{digits}f}" for v in rows[column])

    lines = [
        "| method | step | tokens % by bin | gradient % by bin | correct ratio (A > 0) by bin |",
        "|---|---|---|---|---|",
    ]
    for (method, step), rows in table.groupby(["method", "step"], sort=False):
        rows = rows.sort_values("bin")
        lines.append(
            f"| {method} | {int(step)} | {cells(rows, 'token_share', 100, 0)} | {cells(rows, 'grad_share', 100, 0)} "
            f"| {cells(rows, 'correct_ratio', 1, 2)} |"
        )
    return "\n".join(lines) + "\n"


def _frozen_batch_markdown(bins: pd.DataFrame, sign: str = "pos") -> str:
    """The frozen-batch counterfactual's correct ratio per method and bin (positive-advantage tokens)."""
    cells = bins[bins["sign"] == sign] if "sign" in bins.columns else bins
    labels = cells[["bin", "label"]].drop_duplicates().sort_values("bin")
    lines = [
        "| method | " + " | ".join(f"{label} (n)" for label in labels["label"]) + " |",
        "|---" * (len(labels) + 1) + "|",
    ]
    for method, rows in cells.groupby("method", sort=False):
        rows = rows.set_index("bin")
        row = [
            "-" if b not in rows.index or pd.isna(rows.loc[b, "correct_ratio"])
            else f"{rows.loc[b, 'correct_ratio']:.2f} ({int(rows.loc[b, 'n_tokens'])})"
            for b in labels["bin"]
        ]  # fmt: skip
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# --- the folder -------------------------------------------------------------------------------------------------------


def write_report(
    config: DemoConfig, out: Path, run_dirs: dict, warm: dict, shift: Counterfactual, minutes: float, reused: int = 0
) -> Path:
    """Everything a reader needs from the demo, as files in ``out``: metrics.csv, accuracy_{sample,greedy}.{csv,md},
    gains_sample.csv, learning_curves.png, gradient_share.png, correct_ratio.png, counterfactual.csv, mechanism.png
    and mechanism.csv (with probes on), paired_vs_grpo_sample.csv and paired_differences.png (with GRPO and more
    than one seed), summary.json and report.md."""
    long = runs.compare(list(run_dirs.values()))
    long.to_csv(out / "metrics.csv", index=False)
    tables, means, frames = {}, {}, {}
    for mode in ("sample", "greedy"):
        frames[mode] = accuracy_table(config, run_dirs, warm, mode)
        frames[mode].to_csv(out / f"accuracy_{mode}.csv", index=False)
        means[mode], spread = spread_over_seeds(frames[mode])
        tables[mode] = _markdown(means[mode], spread if config.seeds > 1 else None) + _se_line(means[mode], config)
        (out / f"accuracy_{mode}.md").write_text(tables[mode])
    gains = gains_per_seed(frames["sample"])
    gains.to_csv(out / "gains_sample.csv")
    paired = paired_vs_grpo(frames["sample"])
    shift.bins.to_csv(out / "counterfactual.csv", index=False)
    figures = {
        "learning_curves.png": plots.learning_curves(
            long, ["reward/mean", "acc/all", "len/response_mean", "policy/entropy"]
        ),
        "gradient_share.png": plots.gradient_share(long),
        "correct_ratio.png": plots.fig2(shift=shift.bins),
    }
    people = [f"{n}ppl" for n in config.train.eval_people]
    diffs = paired_per_seed(frames["sample"], [*people, "avg"])
    if config.seeds > 1 and not diffs.empty:  # each method against GRPO, seed by seed
        diffs.to_csv(out / "paired_vs_grpo_sample.csv", index=False)
        figures["paired_differences.png"] = plots_methods.paired_differences(diffs, paired_intervals(diffs))
    mechanism = ""
    if config.train.probe_every > 0:  # the probe steps' bins over training (Fig. 1a, 1d and 2b per step)
        figures["mechanism.png"] = plots.mechanism_over_steps(long)
        table = mechanism_table(long)
        table.to_csv(out / "mechanism.csv", index=False)
        mechanism = _mechanism_markdown(table)
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=110)
    verdict = compare_methods(means["sample"], config, paired)
    summary = {
        "config": asdict(config),
        "minutes": minutes,
        "runs_reused": reused,
        "warm_start": warm,
        "verdict": verdict,
        "accuracy_sample": means["sample"].to_dict(orient="index"),
        "accuracy_greedy": means["greedy"].to_dict(orient="index"),
        "gains_sample_avg": gains.to_dict(orient="index"),
        "paired_vs_grpo_sample_avg": paired.to_dict(orient="index"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    parts = {
        "gains": _gains_markdown(gains),
        "frozen": _frozen_batch_markdown(shift.bins),
        "mechanism": mechanism,
        "reused": reused,
        "paired": "paired_differences.png" in figures,
    }
    (out / "report.md").write_text(_report_text(config, tables, parts, verdict, minutes))
    return out


def _reused_text(reused: int, total: int) -> str:
    if not reused:
        return ""
    return f" ({reused} of the {total} runs were complete from an earlier invocation and reused: minutes of this one)"


def _paired_text(shown: bool) -> str:
    if not shown:
        return ""
    return """- `paired_differences.png` (`paired_vs_grpo_sample.csv`): each method's sampled accuracy minus GRPO's at
  the same seed, per people count and their average: one dot per seed, the mean and its 95% interval over seeds."""


def _training_mechanism_text(table: str) -> str:
    if not table:
        return ""
    return f"""
During training, at every probed step (mean over seeds; `mechanism.csv`): each bin's share of the response tokens
(Fig. 1a) and of the gradient (Fig. 1d; the rest flows through the prompt positions), and the correct ratio of that
step's update (Fig. 2b). Bins: p < 0.25 / 0.25-0.5 / 0.5-0.75 / >= 0.75.

{table}"""


def _report_text(config: DemoConfig, tables: dict, parts: dict, verdict: list[str], minutes: float) -> str:
    seeds = f"{config.seeds} seed{'s' if config.seeds > 1 else ''}"
    train = config.train
    tuning = "full fine-tuning" if train.lora_r is None else f"LoRA r = {train.lora_r}"
    return f"""# lopti_lab demo: GRPO, AR and Lopti on the lab model

{len(config.methods)} methods x {seeds}, {train.steps} RL steps each ({train.prompts_per_step} puzzles x
{train.group_size} samples, {", ".join(map(str, train.train_people))} people), {tuning} of `{train.model}`,
{minutes:.1f} minutes in all{_reused_text(parts["reused"], len(config.methods) * config.seeds)}.
Test accuracy is the share of completions scoring 3 on the bundled test split
({config.train.eval_size} puzzles per people count){"; mean ± 95% CI over seeds" if config.seeds > 1 else ""}.

## Sampled at temperature 1.0 ({config.train.eval_samples} per puzzle)

{tables["sample"]}
## Greedy

{tables["greedy"]}
## Gain over the warm start, per seed (sampled, average over people counts, points; each run against the warm
start's evaluation under the same sampling seed)

{parts["gains"]}
## What it shows

{chr(10).join("- " + line for line in verdict)}

Whether AR or Lopti beats GRPO at this scale is an experimental result of this run, not a claim: read the spread.

## The mechanism

One update of each method on the same frozen batch from the warm start (AdamW with the runs' learning rate and
epsilon): the share of positive-advantage tokens whose probability went up, per bin of their probability under the
rollout policy (tokens in brackets; the paper's Fig. 2b):

{parts["frozen"]}{_training_mechanism_text(parts["mechanism"])}
## Figures

- `learning_curves.png`: reward, training accuracy, response length and entropy per step (mean over seeds).
- `gradient_share.png`: each probability bin's share of the tokens and of the gradient (the paper's Fig. 1a/1d).
- `correct_ratio.png`: one update of each method on the same frozen batch from the warm start: the share of
  positive-advantage tokens whose probability went up, per probability bin (the paper's Fig. 2b).
- `mechanism.png`: the same quantities during training, at every probe step: each bin's share of the tokens and of
  the gradient, and the correct ratio of the step's update among the tokens that moved (mean over seeds).
{_paired_text(parts["paired"])}

![learning curves](learning_curves.png)
![gradient share](gradient_share.png)
![correct ratio](correct_ratio.png)
{"![mechanism over training](mechanism.png)" if config.train.probe_every > 0 else ""}
{"![paired differences to GRPO](paired_differences.png)" if parts["paired"] else ""}
"""
