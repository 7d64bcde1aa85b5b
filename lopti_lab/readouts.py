"""What a figure shows, said in a few sentences computed from the same tables the figure is drawn from.

A notebook displays one of these right after its figure, so the words cannot drift from the picture: rerun the cell
and both change together. Each function returns a ``Readout``, a string that a notebook renders as Markdown. Where
the paper predicts something the numbers do not show, the readout says so, and why when the reason is known.

    wedge(tokens, vocab_size)         Fig. 2a: the 1 - p law on sampled tokens
    softmax(frame, temperature)       one softmax's tokens (notebook 01's explorer)
    toy(result)                       the theory toy trained four ways (notebook 01)
    fig1(tokens, grads)               Fig. 1: which probability bin carries the update (selective_sweep)
    correct_ratios(shift, ...)        Fig. 2b: did the top bin's A > 0 tokens go up, per method
    mechanism(table, parts, ...)      Fig. 3 during training, and the live decomposition of one optimizer's step
    mechanism_map(table)              where GRPO's top bin falls below one half, and what the fixes change there
    confirmatory(primary, curves)     the confirmatory study's three pre-registered comparisons, with their power
    kk_dataset(stats)                 how the puzzles grow with the people count
    training_run(frame)               one training run: reward, training-batch accuracy, test accuracy
    final_accuracy(table, intervals)  one seed's final accuracies against the recorded spread across seeds
    gradient_share(long), correct_ratio_runs(long)   the trainer's probes over runs (notebook 05)
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lopti_lab.methods import ORDER
from lopti_lab.paper import FIG3_GRPO
from lopti_lab.plots import pool_shift
from lopti_lab.studies.curves import model_name
from lopti_lab.studies.primary import PRIMARY_STEPS
from lopti_lab.theory import grad_norm_bounds


class Readout(str):
    """A paragraph of Markdown (a ``str``), shown as Markdown by Jupyter, as plain text elsewhere."""

    def _repr_markdown_(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return str(self)


def _say(*sentences: str) -> Readout:
    return Readout("**What we see.** " + " ".join(s for s in sentences if s))


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ordered(values: pd.Series) -> pd.Series:
    """``values`` indexed by method, in the paper's method order (``methods.ORDER``), unregistered names last."""
    rank = {m: i for i, m in enumerate(ORDER)}
    return values.reindex(sorted(values.index, key=lambda m: rank.get(m, len(rank))))


def _spread(values: pd.Series) -> float:
    values = values.dropna()
    return float(values.max() - values.min()) if len(values) else float("nan")


def wedge(tokens: pd.DataFrame, vocab_size: int) -> Readout:
    """Fig. 2a: how many tokens lie between the bounds, and how much larger a rare token's gradient is than a
    confident one's.

    >>> wedge(pd.DataFrame({"prob": [0.1, 0.9], "grad_norm": [1.0, 0.1]}), 10)[:40]
    '**What we see.** All 2 tokens lie inside'
    """
    prob, norm = tokens["prob"].to_numpy(float), tokens["grad_norm"].to_numpy(float)
    lower, upper = grad_norm_bounds(prob, vocab_size)
    slack = 1e-6 + 1e-5 * upper  # a float32 norm's rounding
    inside = (norm >= lower - slack) & (norm <= upper + slack)
    n = len(prob)
    where = "All" if inside.all() else f"{inside.sum():,} of"
    low, high = norm[prob < 0.25], norm[prob >= 0.75]
    sentences = [f"{where} {n:,} tokens lie inside the wedge."]
    if len(low) and len(high):
        ratio = low.mean() / max(high.mean(), 1e-12)
        sentences.append(
            f"Tokens sampled below p = 0.25 ({_pct(len(low) / n)} of them) have a mean gradient norm of "
            f"{low.mean():.2f} at the logits; those above p = 0.75 ({_pct(len(high) / n)}) have {high.mean():.3f}, "
            f"{ratio:.0f} times less."
        )
    return _say(*sentences)


def softmax(frame: pd.DataFrame, temperature: float) -> Readout:
    """The softmax explorer (``widgets.softmax_table``): the most and least likely token's probability and gradient."""
    top, rare = frame.loc[frame["prob"].idxmax()], frame.loc[frame["prob"].idxmin()]
    return _say(
        f"At temperature {temperature:g} the likeliest token ({top['token']}, p = {top['prob']:.2f}) has a gradient "
        f"norm of {top['grad_norm']:.2f} at the logits and the rarest ({rare['token']}, p = {rare['prob']:.4f}) "
        f"{rare['grad_norm']:.2f}: the rare token pushes {rare['grad_norm'] / max(top['grad_norm'], 1e-12):.1f} "
        "times harder."
    )


def toy(result) -> Readout:
    """The toy trained four ways (``toy.simulate``): the lowest bin's share of tokens and of the gradient at the first
    step, the reward each method reached, and the top bin's correct ratio against the paper's GRPO."""
    first = result.bins[(result.bins["step"] == result.bins["step"].min()) & (result.bins["bin"] == 0)]
    grpo_first = first[first["method"] == first["method"].iloc[0]].iloc[0]
    last_step = result.steps["step"].max()
    reward = _ordered(result.steps[result.steps["step"] == last_step].set_index("method")["reward"])
    start = result.steps[result.steps["step"] == result.steps["step"].min()]["reward"].mean()
    pos = result.shift[(result.shift["sign"] == "pos") & (result.shift["n_tokens"] > 0)]
    pooled = pool_shift(pos, ["method", "bin"])
    top = _ordered(pooled[pooled["bin"] == pooled["bin"].max()].set_index("method")["correct_ratio"])
    sentences = [
        f"At the first step the lowest probability bin holds {_pct(grpo_first['token_share'])} of the tokens and "
        f"carries {_pct(grpo_first['grad_share'])} of {grpo_first['method']}'s gradient (b).",
        f"The batch's mean reward goes from {start:.2f} at the first step to, at step {last_step}: "
        + ", ".join(f"{m} {r:.2f}" for m, r in reward.items())
        + f" (a spread of {_spread(reward):.2f} between methods, from one seed).",
        "The top bin's A > 0 tokens rose in "
        + ", ".join(f"{_pct(v)} ({m})" for m, v in top.items())
        + " of cases (c).",
    ]
    if top.min() >= 0.5:
        sentences.append(
            "No method falls below 0.5 there, unlike the paper's GRPO: the toy's one linear head on fixed features "
            "couples the tokens far less than a deep network's shared layers."
        )
    return _say(*sentences)


def _mean_abs(tokens: pd.DataFrame, update: str, bin_: int) -> float:
    rows = tokens[(tokens["update"] == update) & (tokens["bin"] == bin_)]
    return float(rows["delta_p"].abs().mean()) if len(rows) else float("nan")


def fig1(tokens: pd.DataFrame, grads: pd.DataFrame) -> Readout:
    """Fig. 1: the lowest bin's share of tokens and of the gradient norm, and how much each single-bin update moves
    the top bin's tokens compared with the update on all tokens (panels e and f against c)."""
    everything = tokens[tokens["update"] == "all"]
    bins = sorted(everything["bin"].unique())
    low, top = int(bins[0]), int(bins[-1])
    share = everything["bin"].value_counts(normalize=True)
    norms = grads.set_index("update")["grad_norm"]
    moved_all = _mean_abs(tokens, "all", top)
    by_low, by_top = _mean_abs(tokens, f"bin{low}", top), _mean_abs(tokens, f"bin{top}", top)
    sentences = [
        f"The lowest bin holds {_pct(share.get(low, 0.0))} of the response tokens and the highest "
        f"{_pct(share.get(top, 0.0))} (a).",
        f"The lowest bin's tokens alone give a gradient of norm {norms.get(f'bin{low}', np.nan):.3g}, the highest "
        f"bin's {norms.get(f'bin{top}', np.nan):.3g}, all tokens together {norms.get('all', np.nan):.3g} (d).",
    ]
    if moved_all > 0:
        sentences.append(
            f"The highest bin's tokens move by {moved_all:.2e} in probability on average under the update on all "
            f"tokens (c); the update on the lowest bin alone moves them by {by_low:.2e} ({by_low / moved_all:.0%} of "
            f"that, e), the update on the highest bin itself by {by_top:.2e} ({by_top / moved_all:.0%}, f). Each "
            "panel has its own scale."
        )
    if by_low < by_top:
        sentences.append(
            "The paper finds the lowest bin's update moving the confident tokens more than their own update does; "
            "on this batch it does not."
        )
    return _say(*sentences)


def _first_order_note(methods: list[str], optimizer: str | None) -> str:
    if optimizer != "sgd":
        return ""
    note = (
        "This is one small SGD step: Lopti's two stages add up to GRPO's step to first order in the learning rate "
        "(the second stage's gradient is taken after a tiny first move), so Lopti's lines match GRPO's"
    )
    if any("AR" in m for m in methods):
        note += ", and AR only scales the rare tokens' weights by 0.7 to 1 (alpha = 0.3), a small turn of the step"
    return note + "; the paper's differences build up over many steps."


def correct_ratios(shift: pd.DataFrame, *, optimizer: str | None = None, sign: str = "pos") -> Readout:
    """Fig. 2b on one frozen batch (``counterfactual(...).bins``): the top bin's correct ratio per method, whether
    the methods differ, and what the paper's GRPO does there."""
    cells = shift[(shift["sign"] == sign) & (shift["n_tokens"] > 0)].copy()
    if "method" not in cells.columns:
        cells["method"] = "update"
    pooled = pool_shift(cells, ["method", "bin"])
    top = _ordered(pooled[pooled["bin"] == pooled["bin"].max()].set_index("method")["correct_ratio"])
    overall = pool_shift(cells, ["method"]).set_index("method")["correct_ratio"]
    sentences = [
        "In the top probability bin the share of A > 0 tokens that went up is "
        + ", ".join(f"{v:.3f} ({m})" for m, v in top.items())
        + f"; over all bins {overall.min():.3f} to {overall.max():.3f}."
    ]
    if len(top) > 1 and _spread(top) < 0.02:
        sentences.append(f"The methods' lines lie within {_spread(top):.3f} of each other: on this batch they agree.")
        sentences.append(_first_order_note(list(top.index), optimizer))
    grpo = top.get("GRPO", np.nan)
    if grpo >= 0.5:
        sentences.append(f"The paper's GRPO falls below 0.5 in the top bin; here it stays at {grpo:.2f}.")
    return _say(*sentences)


def mechanism(table: pd.DataFrame, parts: pd.DataFrame | None = None, *, precision: str = "float64") -> Readout:
    """Fig. 3 from a mechanism study (``studies.mechanism.fig3_source``): the top quantile bin's correct ratio among
    the tokens that moved, per optimizer and method, against the paper's GRPO; and ``parts``
    (``studies.mechanism.decomposition``), where the top bin's move came from on the frozen batch."""
    rows = table[(table["binning"] == "q") & (table["stat"] == "correct_moved") & (table["precision"] == precision)]
    top = rows[rows["bin"] == rows["bin"].max()]
    by_optimizer = [
        f"{optimizer}: " + ", ".join(f"{v:.2f} ({m})" for m, v in _ordered(cells.set_index("method")["mean"]).items())
        for optimizer, cells in top.groupby("optimizer", sort=False)
    ]
    sentences = [
        f"In the study's top bin ({precision}, among the tokens that moved) the share of A > 0 tokens that went up "
        "was, " + "; ".join(by_optimizer) + "."
    ]
    grpo = top[top["method"] == "GRPO"]["mean"]
    if len(grpo) and (grpo >= 0.5).all():
        sentences.append(f"No optimizer puts GRPO {FIG3_GRPO['p > 0.75']} in that bin, where the paper's GRPO falls.")
    if parts is not None:
        for _, part in parts.iterrows():
            sentences.append(
                f"On this notebook's batch under {part['optimizer']}: {part['correct_all']:.2f} go up when every "
                f"token is updated, {part['correct_top']:.2f} when only the top bin is, {part['correct_rest']:.2f} "
                f"when only the other bins are; {part['from_rest']:.0%} of the all-token move lies along the other "
                f"bins' move (additivity {part['additivity']:.2g})."
            )
    return _say(*sentences)


def _side(diffs: pd.DataFrame) -> str:
    """How many paired differences from GRPO lie above zero, below it, or include it (95% interval, uncorrected)."""
    above = int((diffs["diff_mean"] - diffs["diff_ci95"] > 0).sum())
    below = int((diffs["diff_mean"] + diffs["diff_ci95"] < 0).sum())
    return f"above zero in {above}, below in {below}, level in {len(diffs) - above - below}"


def mechanism_map(table: pd.DataFrame) -> Readout:
    """The mechanism map (``studies.mechanism_map.map_table``): GRPO's top-bin correct ratio across the lab's learning
    rates per optimizer, the cells where it falls below one half, and the fixes' paired differences from GRPO there.
    A cell measured once but listed on several axes (the lab model at one puzzle per count) is counted once."""
    cells = table.drop_duplicates(["start", "optimizer", "lr", "puzzles", "method"])
    grpo = cells[cells["method"] == "GRPO"]
    lab = grpo[(grpo["start"] == "lab") & (grpo["puzzles"] == grpo["puzzles"].min())]
    sentences = []
    for optimizer, rows in lab.groupby("optimizer", sort=False):
        held = rows[rows["mean"] >= 0.5]
        if len(held):
            sentences.append(
                f"On the lab model under {optimizer}, GRPO's top-bin ratio stays at {held['mean'].min():.2f}-"
                f"{held['mean'].max():.2f} at lr " + ", ".join(f"{lr:g}" for lr in sorted(held["lr"])) + "."
            )
    low = grpo[grpo["mean"] < 0.5]
    if not len(low):
        return _say(*sentences, "GRPO's mean stays at or above one half in every cell of the map.")
    parts = []
    for solving, group in ((True, low[low["solved"] > 0]), (False, low[low["solved"] == 0])):
        if len(group):
            how = ", ".join(f"{o} at lr {', '.join(f'{lr:g}' for lr in sorted(set(g['lr'])))}"
                            for o, g in group.groupby("optimizer", sort=False))  # fmt: skip
            whose = "starts that solve some of their puzzles" if solving else "starts that solve none (" + ", ".join(
                sorted(set(group["start"]))) + ")"  # fmt: skip
            parts.append(f"{len(group)} from {whose}, {how} ({group['mean'].min():.2f}-{group['mean'].max():.2f})")
    sentences.append(f"It falls below one half in {len(low)} of {len(grpo)} cells: " + "; ".join(parts) + ".")
    key = ["start", "optimizer", "lr", "puzzles"]
    there = cells.merge(low[key], on=key)
    by_fix = {m: there[there["method"] == m] for m in ("GRPO+AR", "GRPO+Lopti")}
    sides = [f"{m}'s is {_side(d)} (of {len(d)})" for m, d in by_fix.items() if len(d)]
    if sides:
        sentences.append("In those cells, the paired difference from GRPO (95% interval over seeds, uncorrected): "
                         + "; ".join(sides) + ".")  # fmt: skip
    return _say(*sentences)


def confirmatory(primary: pd.DataFrame, curves: pd.DataFrame) -> Readout:
    """The confirmatory study's verdict (``studies.primary.primary_table`` and the sampled ``curves`` it was computed
    from): GRPO's gain from the warm start to its primary measure, then each pre-registered comparison's paired
    difference in points with its 95% interval, Holm's p, the seeds on each side and the effect it could detect."""
    steps = list(PRIMARY_STEPS)
    grpo = curves[curves["model"] == model_name("GRPO")]
    sentences = []
    for column in dict.fromkeys(primary["column"]):
        start = grpo.loc[grpo["step"] == 0, column].mean()
        end = grpo.loc[grpo["step"].isin(steps), column].mean()
        sentences.append(
            f"At {column.removesuffix('ppl')} people GRPO goes from {start:.2f} at step 0 to {end:.2f} (its mean "
            f"over steps {', '.join(map(str, steps))}, {grpo['seed'].nunique()} seeds)."
        )
    parts = []
    for r in primary.itertuples():
        verdict = "separates from GRPO" if r.holm_reject else "does not separate from GRPO"
        parts.append(
            f"{r.method} - GRPO at {r.column.removesuffix('ppl')} people {100 * r.mean:+.1f} ± {100 * r.half:.1f} "
            f"points (p {r.p:.3f}, Holm p {r.p_holm:.3f}; above / level / below in {r.above} / {r.level} / {r.below} "
            f"seeds) "
            f"{verdict}; at 80% power it could detect {100 * r.detectable:.1f} points"
        )
    sentences.append("Pre-registered, paired by seed, Holm-corrected over the three: " + "; ".join(parts) + ".")

    def named(rows: pd.DataFrame) -> list[str]:
        return [f"{r.method} at {r.column.removesuffix('ppl')} people" for r in rows.itertuples()]

    separate = primary[primary["holm_reject"]]
    names = named(separate)
    sentences.append(
        f"Separating after the correction, {len(separate)} of {len(primary)}: {', '.join(names)}."
        if names
        else f"None of the {len(primary)} primary comparisons separates: a true difference as large as its detectable "
        "effect would have been found 4 times in 5, a smaller one may have been missed."
    )
    alone = primary[~primary["holm_reject"] & (primary["p"] <= 0.05)]
    if len(alone):  # the correction, not the interval, decides them: say so rather than leave "does not separate"
        names, one = named(alone), len(alone) == 1
        listed = names[0] if one else f"{', '.join(names[:-1])} and {names[-1]}"
        sentences.append(
            f"Taken alone (uncorrected), the 95% interval{'' if one else 's'} of {listed} exclude{'s' if one else ''} "
            f"0: {'it fails' if one else 'they fail'} only the pre-registered correction over the {len(primary)} "
            "comparisons."
        )
    return _say(*sentences)


def kk_dataset(stats: pd.DataFrame) -> Readout:
    """How the quiz, the trace and the search grow from the fewest to the most people (``kk.dataset_stats``)."""
    means = stats.groupby("people").mean(numeric_only=True)
    a, b = means.index.min(), means.index.max()
    return _say(
        f"From {a} to {b} people the quiz grows from {means.loc[a, 'quiz_words']:.0f} to "
        f"{means.loc[b, 'quiz_words']:.0f} words and the compact trace from {means.loc[a, 'compact_trace_words']:.0f} "
        f"to {means.loc[b, 'compact_trace_words']:.0f}; the solver's search takes {means.loc[a, 'trace_steps']:.1f} "
        f"then {means.loc[b, 'trace_steps']:.1f} steps with {means.loc[a, 'backtracks']:.1f} then "
        f"{means.loc[b, 'backtracks']:.1f} backtracks on average."
    )


def _evaluated(frame: pd.DataFrame, column: str) -> pd.Series:
    if column not in frame.columns:
        return pd.Series(dtype=float)
    return frame.set_index("step")[column].dropna()


def training_run(frame: pd.DataFrame) -> Readout:
    """One run (``runs.load_run``): reward and the training batch's accuracy from the first to the last step, and the
    test accuracy (sampled and greedy) at the first and last evaluation."""
    first, last = frame.iloc[0], frame.iloc[-1]
    sentences = [
        f"Over steps {int(first['step'])}-{int(last['step'])} the mean reward went from {first['reward/mean']:.2f} "
        f"to {last['reward/mean']:.2f}, and the training batch's accuracy (`acc/all`: the share of this step's "
        f"sampled responses scoring 3, on the puzzles it trains on) from {first['acc/all']:.2f} to "
        f"{last['acc/all']:.2f}."
    ]
    for mode, name in (("sample", "sampled at the rollout temperature"), ("greedy", "greedy")):
        test = _evaluated(frame, f"eval/{mode}/acc_all")
        if len(test) >= 2:
            sentences.append(
                f"Test accuracy, {name}: {test.iloc[0]:.2f} at step {test.index[0]}, {test.iloc[-1]:.2f} at step "
                f"{test.index[-1]}."
            )
        elif len(test) == 1:
            sentences.append(f"Test accuracy, {name}: {test.iloc[0]:.2f} at step {test.index[0]}.")
    if len(_evaluated(frame, "eval/sample/acc_all")) == 0:
        sentences.append("No test evaluation was logged (eval_every = 0).")
    return _say(*sentences)


def final_accuracy(table: pd.DataFrame, intervals: pd.DataFrame | None = None) -> Readout:
    """One final accuracy per run (``widgets.final_accuracy``), read against ``intervals``: the paired 95% intervals
    of each method minus GRPO over seeds at the same settings (``studies.tables.paired_intervals``, column "avg",
    rows named as ``studies.curves.model_name`` names them)."""
    avg = _ordered(table["avg"].groupby(level="method").mean())
    runs_per = table.groupby(level="method").size()
    sentences = ["Average test accuracy: " + ", ".join(f"{m} {v:.3f}" for m, v in avg.items()) + "."]
    if runs_per.max() == 1:
        sentences.append("Each method has one run (one seed).")
    if "GRPO" in avg.index and intervals is not None and len(intervals):
        recorded = intervals.set_index("model")
        gaps = [
            (m, avg[m] - avg["GRPO"], recorded.loc[model_name(m)]) for m in avg.index if model_name(m) in recorded.index
        ]
        inside = sum(abs(gap) < row["ci95"] for _, gap, row in gaps)
        sentences.append(
            f"Minus GRPO, beside the recorded comparison at these settings ({int(recorded['n'].max())} seeds, mean ± "
            "95% interval): "
            + ", ".join(f"{m} {gap:+.3f} ({row['mean']:+.3f} ± {row['ci95']:.3f})" for m, gap, row in gaps)
            + f". {inside} of these {len(gaps)} one-seed gaps are smaller than their method's spread across seeds: "
            "no evidence either way. The paper's table below comes from other models, data sizes and step counts."
        )
    return _say(*sentences)


def _bin_shares(long: pd.DataFrame) -> pd.DataFrame:
    binned = long[long["metric"].str.match(r"^(tokens|grad)/share_bin\d+$")].copy()
    binned["what"] = binned["metric"].str.split("/").str[0]
    binned["bin"] = binned["metric"].str.extract(r"bin(\d+)$")[0].astype(int)
    return binned.groupby(["method", "what", "bin"])["value"].mean().unstack("what")


def gradient_share(long: pd.DataFrame) -> Readout:
    """The trainer's probes (``plots.gradient_share``): the lowest bin's share of tokens and of the gradient."""
    shares = _bin_shares(long)
    low = shares.xs(shares.index.get_level_values("bin").min(), level="bin")
    low = low.loc[_ordered(pd.Series(0, index=low.index)).index]
    return _say(
        "Averaged over the probed steps, the lowest probability bin holds "
        + ", ".join(
            f"{_pct(r['tokens'])} of the tokens and {_pct(r['grad'])} of the gradient ({m})" for m, r in low.iterrows()
        )
        + "."
    )


def correct_ratio_runs(long: pd.DataFrame, sign: str = "pos") -> Readout:
    """The trainer's ``shift/*`` probes over runs (``plots.correct_ratio``): the top bin's pooled correct ratio per
    method, against the paper's GRPO."""
    cells = long[long["metric"].str.match(rf"^shift/(correct|n|unmoved)_{sign}_bin\d+$")].copy()
    parts = cells["metric"].str.extract(rf"^shift/(\w+?)_{sign}_bin(\d+)$")
    cells["what"], cells["bin"] = parts[0], parts[1].astype(int)
    wide = cells.pivot_table(index=["method", "run", "step", "bin"], columns="what", values="value").reset_index()
    wide = wide.rename(columns={"n": "n_tokens", "correct": "correct_ratio"})
    if "unmoved" in wide.columns:
        wide["n_moved"] = wide["n_tokens"] * (1 - wide["unmoved"].fillna(0))
    pooled = pool_shift(wide, ["method", "bin"])
    top = _ordered(pooled[pooled["bin"] == pooled["bin"].max()].set_index("method")["correct_ratio"])
    sentences = [
        "Pooled over the probed steps, the top bin's A > 0 tokens went up in "
        + ", ".join(f"{v:.2f} ({m})" for m, v in top.items())
        + " of the cases."
    ]
    grpo = top.get("GRPO", np.nan)
    if grpo >= 0.5:
        sentences.append(f"The paper's GRPO falls below 0.5 there; in these runs it stays at {grpo:.2f}.")
    if len(top) > 1 and _spread(top) < 0.03:
        sentences.append(
            f"The paper's AR and Lopti hold this bin above GRPO; here the methods lie within {_spread(top):.2f} of "
            "each other (docs/mechanism.md measures the top bin's move under each optimizer at this scale)."
        )
    return _say(*sentences)
