"""The demo's report folder: accuracy tables in the paper's layout (``studies.tables``), the learning curves on the test
split where the runs were evaluated during training (``studies.curves``), the mechanism over training, figures and
report.md. ``studies.run.run_demo`` trains; this module only reads run folders and writes files."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from lopti_lab import plots, plots_methods, runs
from lopti_lab.counterfactual import Counterfactual
from lopti_lab.studies import curves
from lopti_lab.studies.config import DemoConfig
from lopti_lab.studies.primary import PRIMARY_STEPS, primary_markdown, primary_table
from lopti_lab.studies.tables import (
    accuracy_markdown,
    accuracy_table,
    by_seed,
    compare_methods,
    gains_markdown,
    gains_per_seed,
    paired_intervals,
    paired_per_seed,
    paired_vs_grpo,
    se_line,
    spread_over_seeds,
)

# --- over training ----------------------------------------------------------------------------------------------------

LAST_K = 3
"""The paper's accuracy is the mean of the last 3 evaluations (docs/paper.md §6)."""


def over_training(config: DemoConfig, run_dirs: dict, warm: dict) -> dict[str, pd.DataFrame] | None:
    """The study's test-split measures over training (``studies.curves``), or None when the runs were evaluated once
    (the demo): per mode the curves (``curves_{mode}``), the last-3-evaluations accuracy (``last3_{mode}``) and its
    paired differences to GRPO (``paired_last3_{mode}``); on sampled accuracy the area under the curve (``auc``), its
    paired differences (``paired_auc``), the gain over the runs' last third (``late_gain``), the bands over seeds and
    the paired differences per step (``bands_{mode}``, ``paired_steps_{mode}``)."""
    people = list(config.train.eval_people)
    warm = by_seed(warm)
    tables = {f"curves_{mode}": curves.test_curves(run_dirs, warm, people, mode) for mode in ("sample", "greedy")}
    evaluated = tables["curves_sample"].query("step > 0").groupby(["model", "seed"]).size()
    if evaluated.empty or evaluated.max() < 2:
        return None
    columns = [*[f"{n}ppl" for n in people], "avg"]
    for mode in ("sample", "greedy"):
        table = curves.last_evaluations(tables[f"curves_{mode}"], LAST_K)
        tables[f"last3_{mode}"] = table
        tables[f"paired_last3_{mode}"] = paired_per_seed(table, columns)
        tables[f"bands_{mode}"] = curves.seed_bands(tables[f"curves_{mode}"], columns)
        tables[f"paired_steps_{mode}"] = curves.paired_over_steps(tables[f"curves_{mode}"], columns)
    tables["auc"] = curves.area_under_curve(tables["curves_sample"])
    tables["paired_auc"] = paired_per_seed(tables["auc"], columns)
    tables["late_gain"] = curves.late_gain(tables["curves_sample"])
    # the pre-registered primary comparisons (those whose method ran), on the full evaluations' steps
    present = set(config.methods) & {"GRPO"} and set(tables["curves_sample"].columns)
    chosen = [(m, c) for m, c in config.PRIMARY_COMPARISONS if m in config.methods and c in present]
    if chosen and config.seeds > 1:
        steps = config.train.eval_full_steps or PRIMARY_STEPS
        tables["primary"] = primary_table(tables["curves_sample"], chosen, steps)
    return tables


def _paired_markdown(diffs: pd.DataFrame) -> str:
    """`paired_per_seed`'s rows as a table: per method and column, the mean difference to GRPO, its 95% interval
    over seeds and (seeds above / level with / below GRPO)."""
    if diffs.empty:
        return "(no GRPO runs to pair with)\n"
    summary = paired_intervals(diffs)
    columns = list(dict.fromkeys(summary["column"]))
    lines = ["| method - GRPO | " + " | ".join(c.removesuffix("ppl") for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]  # fmt: skip
    for model, part in summary.groupby("model", sort=False):
        part = part.set_index("column")
        cells = [
            f"{part.loc[c, 'mean']:+.3f}" + ("" if pd.isna(part.loc[c, "ci95"]) else f" ± {part.loc[c, 'ci95']:.3f}")
            + f" ({part.loc[c, 'above']}/{part.loc[c, 'level']}/{part.loc[c, 'below']})"
            for c in columns
        ]  # fmt: skip
        lines.append(f"| {model.removeprefix('+ ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _primary_text(diffs: pd.DataFrame, column: str) -> str:
    """The pre-registered primary measure's verdict, one line per method: its paired difference to GRPO on
    ``column`` of the last-3 sampled accuracy, the 95% interval, the seeds above / level / below, and whether the
    interval excludes 0."""
    part = paired_intervals(diffs[diffs["column"] == column]) if not diffs.empty else diffs
    if part.empty:
        return ""
    lines = [f"\n**Primary measure** (pre-registered): sampled accuracy at {column.removesuffix('ppl')} people, the "
             f"mean of the last {LAST_K} evaluations, each method minus GRPO at the same seed:\n"]  # fmt: skip
    for _, row in part.iterrows():
        lo, hi = row["mean"] - row["ci95"], row["mean"] + row["ci95"]
        if pd.isna(row["ci95"]):
            verdict = "one seed: no interval"
        else:
            verdict = "better than GRPO" if lo > 0 else "worse than GRPO" if hi < 0 else "does not separate from GRPO"
        lines.append(
            f"- {row['model'].removeprefix('+ ')}: {row['mean']:+.3f} ± {row['ci95']:.3f} (95% interval over "
            f"{row['n']} seeds; above / level / below GRPO: {row['above']} / {row['level']} / {row['below']}): "
            f"{verdict}"
        )
    return "\n".join(lines) + "\n"


def _curve_markdown(bands: pd.DataFrame, column: str) -> str:
    """One column's learning curves: a row per method, a cell per evaluated step, "mean (min-max over seeds)"."""
    part = bands[bands["column"] == column]
    steps = sorted(part["step"].unique())
    lines = ["| method | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for model, rows in part.groupby("model", sort=False):
        rows = rows.set_index("step")
        cells = [
            "-" if s not in rows.index
            else f"{rows.loc[s, 'mean']:.2f} ({rows.loc[s, 'low']:.2f}-{rows.loc[s, 'high']:.2f})"
            for s in steps
        ]  # fmt: skip
        lines.append(f"| {model.removeprefix('+ ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _over_training_text(tables: dict[str, pd.DataFrame], config: DemoConfig) -> str:
    """report.md's section on the learning curves (``over_training``'s tables)."""
    seeds = config.seeds
    spread = "mean ± 95% interval over seeds" if seeds > 1 else "one seed"

    def accuracy(name: str) -> str:
        mean, ci = spread_over_seeds(tables[name].drop(columns=["evals"], errors="ignore"))
        return accuracy_markdown(mean, ci if seeds > 1 else None)

    late = tables["late_gain"]
    span = f"steps {int(late['from_step'].min())}-{int(late['to_step'].max())}" if not late.empty else ""
    late_lines = []
    for model, part in late.groupby("model", sort=False):
        cells = ", ".join(f"{c.removesuffix('ppl')} {part[c].mean():+.3f}" for c in late.columns if c.endswith("ppl"))
        late_lines.append(f"- {model.removeprefix('+ ')}: {cells}, avg {part['avg'].mean():+.3f}")
    primary = _primary_text(tables["paired_last3_sample"], config.PRIMARY) if config.PRIMARY else ""
    if "primary" in tables:  # the confirmatory study's own analysis replaces the single primary column
        table = tables["primary"]
        primary = (f"\n**The pre-registered primary comparisons** (`primary.csv`; docs/hard_lab.md, \"Confirmatory "
                   f"study: pre-registration\"): paired t over seeds, Holm's correction over the {len(table)}, "
                   f"detectable effect at 80% power:\n\n{primary_markdown(table)}")  # fmt: skip
    hardest = f"{max(config.train.train_people)}ppl"
    curve = _curve_markdown(tables["bands_sample"], hardest) if hardest in set(tables["bands_sample"]["column"]) else ""
    return f"""
## Over training: accuracy as the paper reports it

Every run was evaluated on the test split during training (the warm start is step 0). As in the paper, a run's
accuracy is the mean of its last {LAST_K} evaluations ({spread}; `last3_sample.csv`, `last3_greedy.csv`).
{primary}
Sampled at temperature 1.0:

{accuracy("last3_sample")}
Greedy:

{accuracy("last3_greedy")}
Each method minus GRPO at the same seed, on the last-{LAST_K} accuracy: mean ± 95% interval over seeds, and (seeds
above / level with / below GRPO). Sampled:

{_paired_markdown(tables["paired_last3_sample"])}
Greedy:

{_paired_markdown(tables["paired_last3_greedy"])}
Area under the sampled learning curve (step 0 to the last evaluation, divided by its span: the mean accuracy over
training; `auc.csv`):

{accuracy("auc")}
Paired to GRPO:

{_paired_markdown(tables["paired_auc"])}
Sampled accuracy at {hardest[:-3]} people (the hardest trained count) at each evaluated step, mean (min-max over
seeds; `curves_sample.csv`):

{curve}
Gain over the last third of training ({span}, sampled, mean over seeds; `late_gain.csv`): positive while a method
is still learning.

{chr(10).join(late_lines)}

![learning curves on the test split](study_curves.png)
"""


# --- the mechanism ----------------------------------------------------------------------------------------------------


def mechanism_table(long: pd.DataFrame, sign: str = "pos") -> pd.DataFrame:
    """The numbers behind mechanism.png: per (method, probed step, bin), the mean over seeds of the bin's share of
    the response tokens (Fig. 1a), its share of the gradient (Fig. 1d) and the correct ratio of the step's update
    among its ``sign``-advantage tokens that moved (Fig. 2b), with the tokens counted over all seeds. Where the runs
    measured the paper's Fig. 3 (``TrainConfig.shift_every``; A > 0 tokens only), also its float64 correct ratio per
    probability quartile (``fig3_correct``: the share of the measured A > 0 tokens whose log-prob the step's update
    raised, an unmoved token counted as not raised) and those tokens' count over the seeds (``fig3_n``)."""
    fig3 = "|fig3/float64/q/correct|fig3/q/n" if sign == "pos" else ""
    pattern = rf"^(tokens/share|grad/share|shift/correct_{sign}|shift/n_{sign}{fig3})_bin(\d+)$"
    wide = plots._per_bin(long, pattern, "no tokens/share_bin*, grad/share_bin* or shift/* metrics")
    columns = {"tokens/share": "token_share", "grad/share": "grad_share", f"shift/correct_{sign}": "correct_ratio",
               "fig3/float64/q/correct": "fig3_correct"}  # fmt: skip
    grouped = wide.groupby(["method", "step", "bin"], sort=False)
    table = grouped[[c for c in columns if c in wide.columns]].mean().rename(columns=columns)
    for counted, name in ((f"shift/n_{sign}", "n_tokens"), ("fig3/q/n", "fig3_n")):
        if counted in wide.columns:
            table[name] = grouped[counted].sum()
    order = {m: i for i, m in enumerate(plots._methods(wide))}
    table = table.reset_index()
    return table.sort_values(["method", "step", "bin"], key=lambda c: c.map(order) if c.name == "method" else c)


def _mechanism_markdown(table: pd.DataFrame) -> str:
    """One line per (method, step): the four bins' token shares, gradient shares (%) and correct ratios."""

    def cells(rows: pd.DataFrame, column: str, scale: float, digits: int) -> str:
        if column not in rows or rows[column].isna().all():
            return "-"
        return " / ".join("-" if pd.isna(v) else f"{scale * v:.{digits}f}" for v in rows[column])

    fig3 = "fig3_correct" in table and not table["fig3_correct"].isna().all()
    lines = [
        "| method | step | tokens % by bin | gradient % by bin | correct ratio (A > 0) by bin |"
        + (" Fig. 3 correct ratio, float64 (A > 0) by quartile |" if fig3 else ""),
        "|---|---|---|---|---|" + ("---|" if fig3 else ""),
    ]
    for (method, step), rows in table.groupby(["method", "step"], sort=False):
        rows = rows.sort_values("bin")
        lines.append(
            f"| {method} | {int(step)} | {cells(rows, 'token_share', 100, 0)} | {cells(rows, 'grad_share', 100, 0)} "
            f"| {cells(rows, 'correct_ratio', 1, 2)} |" + (f" {cells(rows, 'fig3_correct', 1, 2)} |" if fig3 else "")
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
        table = accuracy_markdown(means[mode], spread if config.seeds > 1 else None)
        tables[mode] = table + se_line(means[mode], config)
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
    training = over_training(config, run_dirs, warm)
    measured = "the final evaluation"
    if training is not None:  # evaluated during training: the curves, and the paper's last-3 accuracy
        for name, table in training.items():
            table.to_csv(out / f"{name}.csv", index=False)
        for mode, name in (("sample", "study_curves.png"), ("greedy", "study_curves_greedy.png")):
            figures[name] = plots_methods.study_curves(
                training[f"bands_{mode}"], training[f"paired_steps_{mode}"], ylabel=f"test accuracy ({mode})"
            )
        means["last3"], _ = spread_over_seeds(training["last3_sample"].drop(columns="evals"))
        paired = paired_vs_grpo(training["last3_sample"])
        measured = f"the mean of each run's last {LAST_K} evaluations"
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=110)
    verdict = compare_methods(means.get("last3", means["sample"]), config, paired)
    summary = {
        "config": asdict(config),
        "minutes": minutes,
        "runs_reused": reused,
        "warm_start": warm,
        "verdict": verdict,
        "accuracy_sample": means["sample"].to_dict(orient="index"),
        "accuracy_greedy": means["greedy"].to_dict(orient="index"),
        "gains_sample_avg": gains.to_dict(orient="index"),
        "verdict_measure": measured,
        "paired_vs_grpo_sample_avg": paired.to_dict(orient="index"),
    }
    if training is not None:
        summary["accuracy_last3_sample"] = means["last3"].to_dict(orient="index")
        summary["paired_last3_sample"] = paired_intervals(training["paired_last3_sample"]).to_dict(orient="records")
        summary["paired_auc_sample"] = paired_intervals(training["paired_auc"]).to_dict(orient="records")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    parts = {
        "gains": gains_markdown(gains),
        "frozen": _frozen_batch_markdown(shift.bins),
        "mechanism": mechanism,
        "reused": reused,
        "paired": "paired_differences.png" in figures,
        "training": "" if training is None else _over_training_text(training, config),
        "measured": measured,
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


def _samples_text(train) -> str:
    """How many samples per puzzle the first table's rows scored: the last step's evaluation may be the full one
    (``eval_full_steps``) while the warm start's is the curves' (``TrainConfig.eval_spec``)."""
    last, start = train.eval_spec(train.steps).samples, train.eval_spec(0).samples
    return f"{last} per puzzle" if last == start else f"{last} per puzzle; the warm start {start}"


def _report_text(config: DemoConfig, tables: dict, parts: dict, verdict: list[str], minutes: float) -> str:
    seeds = f"{config.seeds} seed{'s' if config.seeds > 1 else ''}"
    train = config.train
    tuning = "full fine-tuning" if train.lora_r is None else f"LoRA r = {train.lora_r}"
    return f"""# lopti_lab {config.TITLE}

{len(config.methods)} methods x {seeds}, {train.steps} RL steps each ({train.prompts_per_step} puzzles x
{train.group_size} samples, {", ".join(map(str, train.train_people))} people), {tuning} of `{train.model}`,
{minutes:.1f} minutes in all{_reused_text(parts["reused"], len(config.methods) * config.seeds)}.
Test accuracy is the share of completions scoring 3 on the bundled test split
({config.train.eval_size} puzzles per people count){"; mean ± 95% CI over seeds" if config.seeds > 1 else ""}.

## Sampled at temperature 1.0 ({_samples_text(train)})

{tables["sample"]}
## Greedy

{tables["greedy"]}
## Gain over the warm start, per seed (sampled, average over people counts, points; each run against the warm
start's evaluation under the same sampling seed)

{parts["gains"]}
## What it shows

On sampled accuracy, {parts["measured"]}:

{chr(10).join("- " + line for line in verdict)}
{parts["training"]}
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
