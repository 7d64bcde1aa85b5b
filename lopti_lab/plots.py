"""Figures, one function per figure, each drawing from lopti_lab's tidy tables and returning a matplotlib Figure.

Figures are built on `matplotlib.figure.Figure` directly, not pyplot: no global state, no backend needed (they render
with Agg), and a notebook shows the returned Figure exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lopti_lab.methods import ORDER
from lopti_lab.paper import FIG3_AR_LOPTI, FIG3_GRPO
from lopti_lab.theory import grad_norm_bounds

SIGN_COLORS = {"pos": "tab:blue", "neg": "tab:red"}
SIGN_NAMES = {"pos": "A > 0", "neg": "A < 0"}
METRIC_TITLES = {
    "reward/mean": "mean reward, training batch",
    "acc/all": "accuracy, training batch (acc/all)",
    "eval/sample/acc_all": "test accuracy, sampled (T = rollout)",
    "eval/greedy/acc_all": "test accuracy, greedy",
}
"""Panel titles of the metrics a reader meets first: the training batch's numbers apart from the test set's."""


def _require(frame: pd.DataFrame, name: str, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{name} lacks columns {missing}")


def pool_shift(cells: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Pool `shift_summary` cells over everything but ``keys``, weighting by token counts: the correct ratio among
    the tokens that moved (sum of correct movers / sum of movers) and the unmoved share (1 - movers / tokens).
    Cells without an ``n_moved`` column (older runs) count every token as moved."""
    cells = cells.copy()
    if "n_moved" not in cells.columns:
        cells["n_moved"] = cells["n_tokens"]
    cells["n_correct"] = cells["correct_ratio"].fillna(0) * cells["n_moved"]
    pooled = cells.groupby(list(keys), sort=False)[["n_correct", "n_moved", "n_tokens"]].sum().reset_index()
    pooled["correct_ratio"] = pooled["n_correct"] / pooled["n_moved"].where(pooled["n_moved"] > 0)
    pooled["unmoved_share"] = 1 - pooled["n_moved"] / pooled["n_tokens"].where(pooled["n_tokens"] > 0)
    return pooled


def _unmoved_bars(ax, pooled: pd.DataFrame, positions: dict, methods: list) -> None:
    """The unmoved share of each (method, bin) as light bars on a twin axis, beside the correct-ratio lines."""
    twin = ax.twinx()
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        rows = pooled[pooled["method"] == method]
        xs = [positions[b] - 0.4 + width * (i + 0.5) for b in rows["bin"]]
        twin.bar(xs, rows["unmoved_share"].fillna(0), width=width, color=f"C{i}", alpha=0.18, zorder=0)
    twin.set_ylim(0, 1)
    twin.set_ylabel("share that did not move (bars)", color="0.4")
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)


def _bin_axis(frame: pd.DataFrame) -> tuple[list[int], list[str]]:
    """Bins in order with their labels ("[0, 0.25)", ...), as the tables carry them."""
    pairs = frame[["bin", "label"]].drop_duplicates().sort_values("bin")
    return [int(b) for b in pairs["bin"]], list(pairs["label"])


def _boxes_by_sign(ax, tokens: pd.DataFrame, value: str, bins: list[int], labels: list[str]) -> None:
    """Side-by-side boxes of `value` per bin for A > 0 and A < 0 tokens."""
    for offset, sign in ((-0.2, "pos"), (0.2, "neg")):
        picked = tokens[tokens["advantage"] > 0] if sign == "pos" else tokens[tokens["advantage"] < 0]
        data = [picked.loc[picked["bin"] == b, value].to_numpy(dtype=float) for b in bins]
        keep = [i for i, d in enumerate(data) if len(d)]
        if not keep:
            continue
        parts = ax.boxplot(
            [data[i] for i in keep],
            positions=[i + offset for i in keep],
            widths=0.35,
            patch_artist=True,
            showfliers=False,
            manage_ticks=False,
        )
        for box in parts["boxes"]:
            box.set_facecolor(SIGN_COLORS[sign])
            box.set_alpha(0.6)
        parts["boxes"][0].set_label(SIGN_NAMES[sign])
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(bins)), labels)
    ax.set_xlabel("probability bin (old policy)")


def fig1(tokens: pd.DataFrame, grads: pd.DataFrame, *, title: str | None = None) -> Figure:
    """The paper's Fig. 1, panels (a)-(f), from `probes.selective_sweep(...)` (tokens, grads).

    (a) share of tokens per probability bin; (b) advantage distribution per bin; (c) probability change per bin after
    one update on all tokens; (d) gradient norm when updating only one bin, against all tokens; (e) probability change
    after updating only the lowest bin; (f) only the highest bin. (c), (e), (f) each have their own y axis (a single
    bin's update can move tokens orders of magnitude less than the full one; a shared axis would hide it): read their
    scales, or the notebook's read-out, to compare them. `tokens` needs update, bin, label, advantage, delta_p; `grads`
    needs update and grad_norm, updates named "all" and "bin{k}".
    """
    _require(tokens, "tokens", ["update", "bin", "label", "advantage", "delta_p"])
    _require(grads, "grads", ["update", "grad_norm"])
    if "all" not in set(tokens["update"]):
        raise ValueError("tokens needs the rows of the update on all tokens (update == 'all')")
    everything = tokens[tokens["update"] == "all"]
    bins, labels = _bin_axis(everything)
    x = np.arange(len(bins))
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    axes = fig.subplots(2, 3)
    ax_a, ax_b, ax_c, ax_d, ax_e, ax_f = axes.ravel()

    counts = everything["bin"].value_counts().reindex(bins, fill_value=0).to_numpy()
    ax_a.bar(x, counts / counts.sum(), color="tab:gray")
    ax_a.set_xticks(x, labels)
    ax_a.set_ylabel("share of tokens")
    ax_a.set_title("(a) tokens per probability bin")

    adv = [everything.loc[everything["bin"] == b, "advantage"].to_numpy(dtype=float) for b in bins]
    keep = [i for i, a in enumerate(adv) if len(a)]
    ax_b.boxplot([adv[i] for i in keep], positions=keep, widths=0.5, showfliers=False, manage_ticks=False)
    ax_b.set_xticks(x, labels)
    ax_b.axhline(0.0, color="0.5", lw=0.8)
    ax_b.set_ylabel("advantage")
    ax_b.set_title("(b) advantages per bin")

    panels = [(ax_c, "all", "(c) update on all tokens"), (ax_e, f"bin{bins[0]}", "(e) update on the lowest bin only")]
    panels.append((ax_f, f"bin{bins[-1]}", "(f) update on the highest bin only"))
    for ax, update, name in panels:
        picked = tokens[tokens["update"] == update]
        if picked.empty:
            raise ValueError(f"tokens has no rows for update == {update!r}")
        _boxes_by_sign(ax, picked, "delta_p", bins, labels)
        ax.set_ylabel("probability change")
        ax.set_title(name)
    ax_c.legend(loc="best", fontsize="small")

    names = [*(f"bin{b}" for b in bins), "all"]
    norms = grads.set_index("update")["grad_norm"].reindex(names)
    colors = ["tab:orange"] * len(bins) + ["tab:gray"]
    ax_d.bar(np.arange(len(names)), norms.fillna(0.0).to_numpy(), color=colors)
    ax_d.set_xticks(np.arange(len(names)), [*labels, "all"])
    ax_d.set_ylabel("gradient norm")
    ax_d.set_title("(d) gradient of one bin's tokens vs all")
    if title:
        fig.suptitle(title)
    return fig


def fig2(
    tokens: pd.DataFrame | None = None,
    vocab_size: int | None = None,
    shift: pd.DataFrame | None = None,
    *,
    sign: str = "pos",
    max_points: int = 20000,
    seed: int = 0,
) -> Figure:
    """The paper's Fig. 2: (a) the wedge, (b) the correct ratio by probability bin, one line per method.

    (a) needs `tokens` with columns prob and grad_norm (`TokenStats.to_frame()`, `ToyResult.tokens`) and the
    vocabulary size: a scatter of ||e_y - pi|| against pi (at most `max_points`, sampled with `seed`) between the bounds
    sqrt(N/(N-1)) (1 - p) and sqrt(2) (1 - p). (b) needs `shift`, a `shift_summary` table (bin, label, sign, n_tokens,
    n_moved, correct_ratio) with a `method` column when there are several: cells repeated over other columns (steps,
    batches) are pooled, weighted by their token counts; lines are the correct ratio among the tokens that moved,
    light bars the share that did not move at all (counted apart, never as wrong); `sign` picks A > 0 ("pos", the
    paper's panel) or A < 0 ("neg"). Pass either or both; the figure has one panel per table given.
    """
    if tokens is None and shift is None:
        raise ValueError("fig2 needs tokens (panel a) or shift (panel b)")
    if sign not in SIGN_NAMES:
        raise ValueError(f"sign must be 'pos' or 'neg', got {sign!r}")
    n_panels = (tokens is not None) + (shift is not None)
    fig = Figure(figsize=(6.5 * n_panels, 4.8), layout="constrained")
    axes = list(np.atleast_1d(fig.subplots(1, n_panels)))

    if tokens is not None:
        _require(tokens, "tokens", ["prob", "grad_norm"])
        if vocab_size is None:
            raise ValueError("vocab_size is needed to draw the bounds of panel (a)")
        ax = axes.pop(0)
        pts = tokens if len(tokens) <= max_points else tokens.sample(max_points, random_state=seed)
        ax.scatter(pts["prob"], pts["grad_norm"], s=4, alpha=0.3, color="tab:blue", label="tokens", rasterized=True)
        p = np.linspace(0.0, 1.0, 201)
        lower, upper = grad_norm_bounds(p, vocab_size)
        ax.plot(p, upper, color="tab:red", label=r"$\sqrt{2}\,(1-\pi)$")
        ax.plot(p, lower, color="tab:green", label=r"$\sqrt{N/(N-1)}\,(1-\pi)$")
        ax.fill_between(p, lower, upper, color="0.85", alpha=0.5, zorder=0)
        ax.set_xlabel(r"token probability $\pi$")
        ax.set_ylabel(r"$\|e_y - \pi\|$ (gradient norm at the logits)")
        ax.set_title(f"(a) gradient norm vs probability, N = {vocab_size}")
        ax.legend(loc="upper right", fontsize="small")

    if shift is not None:
        _require(shift, "shift", ["bin", "label", "sign", "n_tokens", "correct_ratio"])
        ax = axes.pop(0)
        cells = shift[(shift["sign"] == sign) & (shift["n_tokens"] > 0)].copy()
        if "method" not in cells.columns:
            cells["method"] = ""
        pooled = pool_shift(cells, ["method", "bin", "label"])
        bins, labels = _bin_axis(shift)
        methods = list(dict.fromkeys(pooled["method"]))
        for i, method in enumerate(methods):
            rows = pooled[pooled["method"] == method].set_index("bin").reindex(bins)
            ax.plot(range(len(bins)), rows["correct_ratio"], marker="o", color=f"C{i}", label=method or None)
        _unmoved_bars(ax, pooled, {b: i for i, b in enumerate(bins)}, methods)
        ax.axhline(0.5, color="0.5", lw=0.8, ls="--")
        ax.set_xticks(range(len(bins)), labels)
        ax.set_xlabel("probability bin (old policy)")
        ax.set_ylabel(f"correct ratio among tokens that moved ({SIGN_NAMES[sign]})")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("(b) tokens moved the way their advantage asks")
        if any(pooled["method"] != ""):
            ax.legend(loc="best", fontsize="small")
    return fig


def fig3(table: pd.DataFrame, binning: str = "q") -> Figure:
    """The paper's Fig. 3 as measured during training (``studies.mechanism.fig3_table``): one panel per (precision,
    optimizer setting), the correct ratio of positive-advantage tokens per probability bin for each method, mean and
    95% interval over seeds x steps; solid: among the tokens that moved, dashed: an unmoved token counted as not up.
    Drawn beside, the paper's values (``paper.FIG3_*``): AR and Lopti flat at 0.52-0.53 (band), GRPO about 0.53 in
    the lower bins and below 0.50 above p = 0.75 (a bound, drawn as a bar down from 0.50)."""
    _require(table, "table", ["optimizer", "method", "precision", "binning", "bin", "stat", "mean", "ci95"])
    cells = table[table["binning"] == binning]
    if cells.empty:  # every advantage was 0 (all rewards of each group equal): nothing was measured
        fig = Figure(figsize=(6, 2), layout="constrained")
        fig.add_subplot().text(0.5, 0.5, "no positive-advantage token was measured", ha="center", va="center")
        return fig
    precisions = list(dict.fromkeys(cells["precision"]))
    optimizers = list(dict.fromkeys(cells["optimizer"]))
    fig = Figure(figsize=(4.6 * len(optimizers), 3.6 * len(precisions)), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(precisions), len(optimizers), sharey=True, squeeze=False))
    bins = sorted(cells["bin"].unique())
    top = bins[-1]
    for i, precision in enumerate(precisions):
        for j, optimizer in enumerate(optimizers):
            ax = axes[i, j]
            ax.axhspan(*FIG3_AR_LOPTI, color="0.85", zorder=0, label="paper: AR / Lopti (flat)")
            ax.plot([bins[0], top - 0.5], [FIG3_GRPO["p <= 0.75"]] * 2, color="0.4", lw=1, ls=":", label="paper: GRPO")
            ax.annotate("", (top, 0.47), (top, 0.50), arrowprops={"arrowstyle": "->", "color": "0.4"})
            ax.axhline(0.5, color="0.6", lw=0.6)
            here = cells[(cells["precision"] == precision) & (cells["optimizer"] == optimizer)]
            for k, method in enumerate(_methods(here)):
                for stat, style in (("correct_moved", "-"), ("correct", "--")):
                    rows = here[(here["method"] == method) & (here["stat"] == stat)].set_index("bin").reindex(bins)
                    label = method if stat == "correct_moved" else None
                    ax.errorbar(np.array(bins) + 0.04 * k, rows["mean"], yerr=rows["ci95"], color=f"C{k}", ls=style,
                                marker="o", ms=3, capsize=2, label=label)  # fmt: skip
            ax.set_title(f"{optimizer}, {precision} forwards", fontsize="medium")
            ax.set_xticks(bins)
            if i == len(precisions) - 1:
                ax.set_xlabel("probability bin of the rollout (0 = lowest)")
            if j == 0:
                ax.set_ylabel("correct ratio, A > 0")
    axes[0, 0].legend(fontsize="x-small", loc="lower left")
    return fig


def kk_dataset(stats: pd.DataFrame) -> Figure:
    """K&K puzzles by people count, from `kk.dataset_stats`: (a) quiz and compact-trace length in words, (b) search
    steps and backtracks of the solver, (c) the mix of statement kinds."""
    _require(stats, "stats", ["people", "quiz_words", "compact_trace_words", "trace_steps", "backtracks"])
    means = stats.groupby("people").mean(numeric_only=True)
    fig = Figure(figsize=(15, 4), layout="constrained")
    ax_len, ax_search, ax_kinds = fig.subplots(1, 3)
    people = means.index.to_numpy()
    ax_len.plot(people, means["quiz_words"], marker="o", label="quiz")
    ax_len.plot(people, means["compact_trace_words"], marker="s", label="compact trace")
    ax_len.set_xlabel("people")
    ax_len.set_ylabel("words (mean)")
    ax_len.set_title("(a) how long the text is")
    ax_len.legend()
    ax_search.plot(people, means["trace_steps"], marker="o", label="search steps")
    ax_search.plot(people, means["backtracks"], marker="s", label="backtracks")
    ax_search.set_xlabel("people")
    ax_search.set_title("(b) how hard the search is")
    ax_search.legend()
    kinds = [c for c in means.columns if c.startswith("kind_")]
    bottom = np.zeros(len(people))
    for column in kinds:
        ax_kinds.bar(people, means[column], bottom=bottom, label=column.removeprefix("kind_"))
        bottom += means[column].to_numpy()
    ax_kinds.set_xlabel("people")
    ax_kinds.set_ylabel("share of statements")
    ax_kinds.set_title("(c) statement kinds")
    ax_kinds.legend(fontsize="small", ncols=3, loc="lower right")
    return fig


def softmax_gradients(table: pd.DataFrame, temperature: float | None = None) -> Figure:
    """(a) a small vocabulary's probabilities; (b) each token's gradient norm ||e_y - pi|| against its probability,
    inside the wedge of the two bounds. ``table`` is `widgets.softmax_table`: token, prob, grad_norm."""
    _require(table, "table", ["token", "prob", "grad_norm"])
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    ax_p, ax_g = fig.subplots(1, 2)
    x = np.arange(len(table))
    ax_p.bar(x, table["prob"], color="tab:blue")
    ax_p.set_xticks(x, table["token"])
    ax_p.set_ylim(0, 1)
    ax_p.set_ylabel(r"probability $\pi_y$")
    ax_p.set_title("(a) softmax" + (f" at temperature {temperature:.2f}" if temperature else ""))
    p = np.linspace(0, 1, 101)
    lower, upper = grad_norm_bounds(p, len(table))
    ax_g.fill_between(p, lower, upper, color="0.88")
    ax_g.plot(p, upper, color="tab:red", lw=1, label=r"$\sqrt{2}(1-\pi)$")
    ax_g.plot(p, lower, color="tab:green", lw=1, label=r"$\sqrt{N/(N-1)}(1-\pi)$")
    ax_g.scatter(table["prob"], table["grad_norm"], color="tab:blue", zorder=3)
    for _, row in table.iterrows():
        ax_g.annotate(
            row["token"], (row["prob"], row["grad_norm"]), textcoords="offset points", xytext=(4, 4), fontsize="small"
        )
    ax_g.set_xlim(0, 1)
    ax_g.set_ylim(0, 1.5)
    ax_g.set_xlabel(r"probability $\pi_y$ of the sampled token")
    ax_g.set_ylabel(r"$\|e_y - \pi\|$")
    ax_g.set_title("(b) its gradient at the logits")
    ax_g.legend(loc="upper right", fontsize="small")
    return fig


def toy_dynamics(result) -> Figure:
    """The theory toy's learning dynamics per method (`toy.simulate`): (a) reward, (b) the lowest and highest
    probability bins' share of the gradient, (c) the correct ratio of A > 0 tokens per bin over all steps (Fig. 2b)."""
    steps, bins, shift = result.steps, result.bins, result.shift
    fig = Figure(figsize=(16, 4), layout="constrained")
    ax_r, ax_s, ax_c = fig.subplots(1, 3)
    for method, rows in steps.groupby("method", sort=False):
        ax_r.plot(rows["step"], rows["reward"], label=method)
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("mean reward")
    ax_r.set_title("(a) learning curve")
    ax_r.legend(fontsize="small")
    top = bins["bin"].max()
    for i, (method, rows) in enumerate(bins.groupby("method", sort=False)):
        color = f"C{i}"
        low, high = rows[rows["bin"] == 0], rows[rows["bin"] == top]
        ax_s.plot(low["step"], low["grad_share"], color=color, label=f"{method}: lowest bin")
        ax_s.plot(high["step"], high["grad_share"], color=color, ls="--", label=f"{method}: highest bin")
    ax_s.set_xlabel("step")
    ax_s.set_ylabel("share of the gradient")
    ax_s.set_title("(b) lowest (solid) vs highest (dashed) bin")
    ax_s.legend(fontsize="x-small", ncols=2)
    pooled = pool_shift(shift[(shift["sign"] == "pos") & (shift["n_tokens"] > 0)], ["method", "bin", "label"])
    for method, rows in pooled.groupby("method", sort=False):
        ax_c.plot(rows["bin"], rows["correct_ratio"], marker="o", label=method)
    labels = shift[["bin", "label"]].drop_duplicates().sort_values("bin")
    ax_c.set_xticks(labels["bin"], labels["label"])
    ax_c.axhline(0.5, color="0.5", lw=0.8, ls="--")
    ax_c.set_xlabel("probability bin (old policy)")
    ax_c.set_ylabel("correct ratio among tokens that moved (A > 0)")
    ax_c.set_title("(c) tokens moved the way their advantage asks")
    ax_c.legend(fontsize="small")
    return fig


def _methods(long: pd.DataFrame) -> list[str]:
    """The methods of a table, registered ones in table order (``methods.ORDER``), then any others as they come."""
    present = list(dict.fromkeys(long["method"]))
    return [m for m in ORDER if m in present] + [m for m in present if m not in ORDER]


def learning_curves(
    long: pd.DataFrame, metrics: Sequence[str] = ("reward/mean", "acc/all"), *, smooth: int = 1
) -> Figure:
    """One panel per metric, one line per method: the mean over the method's runs (seeds), with the min-max band
    across runs. ``long`` is `runs.compare`'s tidy table; ``smooth`` > 1 applies a centred rolling mean."""
    _require(long, "long", ["run", "method", "step", "metric", "value"])
    metrics = [m for m in metrics if m in set(long["metric"])]
    if not metrics:
        raise ValueError("none of the requested metrics is in the table")
    fig = Figure(figsize=(4.6 * len(metrics), 3.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(metrics)))
    for ax, metric in zip(axes, metrics, strict=True):
        rows = long[long["metric"] == metric]
        for i, method in enumerate(_methods(rows)):
            wide = rows[rows["method"] == method].pivot_table(index="step", columns="run", values="value")
            if smooth > 1:
                wide = wide.rolling(smooth, center=True, min_periods=1).mean()
            sparse = len(wide) <= 12  # test evaluations, every few steps: show each one
            ax.plot(wide.index, wide.mean(axis=1), color=f"C{i}", label=method, marker="o" if sparse else None)
            if wide.shape[1] > 1:
                ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1), color=f"C{i}", alpha=0.15)
        ax.set_xlabel("RL step")
        ax.set_title(METRIC_TITLES.get(metric, metric), fontsize="medium")
    axes[0].legend(fontsize="small")
    return fig


def gradient_share(long: pd.DataFrame) -> Figure:
    """Per probability bin, the share of response tokens and the share of the gradient (``tokens/share_bin{i}``,
    ``grad/share_bin{i}`` from the trainer's probes), averaged over every probed step of each method's runs: the
    paper's Fig. 1a against 1d, during training."""
    _require(long, "long", ["method", "metric", "value"])
    binned = long[long["metric"].str.match(r"^(tokens|grad)/share_bin\d+$")].copy()
    if binned.empty:
        raise ValueError("no tokens/share_bin* or grad/share_bin* metrics: train with probe_every > 0")
    binned["what"] = binned["metric"].str.split("/").str[0]
    binned["bin"] = binned["metric"].str.extract(r"bin(\d+)$")[0].astype(int)
    means = binned.groupby(["method", "what", "bin"])["value"].mean()
    methods = _methods(binned)
    bins = sorted(binned["bin"].unique())
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_tok, ax_grad = fig.subplots(1, 2, sharey=True)
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        x = np.arange(len(bins)) + (i - (len(methods) - 1) / 2) * width
        ax_tok.bar(x, [means.get((method, "tokens", b), np.nan) for b in bins], width, color=f"C{i}", label=method)
        ax_grad.bar(x, [means.get((method, "grad", b), np.nan) for b in bins], width, color=f"C{i}", label=method)
    edges = [f"bin {b}" for b in bins]
    for ax, title in ((ax_tok, "(a) share of response tokens"), (ax_grad, "(b) share of the gradient")):
        ax.set_xticks(range(len(bins)), edges)
        ax.set_xlabel("probability bin (old policy), low to high")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_title(title)
    # "position" attribution also credits the prompt positions (attention carries the response's loss through them):
    # drawn as its own bar, so the gradient shares visibly add up to 1
    context = long[long["metric"] == "grad/share_context"].groupby("method")["value"].mean()
    if not context.empty:
        for i, method in enumerate(methods):
            x = len(bins) + (i - (len(methods) - 1) / 2) * width
            ax_grad.bar(x, context.get(method, np.nan), width, color=f"C{i}", alpha=0.45)
        ax_grad.set_xticks(range(len(bins) + 1), [*edges, "prompt"])
    ax_tok.legend(fontsize="small")
    return fig


def _per_bin(long: pd.DataFrame, pattern: str, missing: str) -> pd.DataFrame:
    """The metrics of ``long`` matching ``pattern`` (groups: quantity, bin) as one row per (method, run, step, bin)
    and one column per quantity."""
    cells = long[long["metric"].str.match(pattern)].copy()
    if cells.empty:
        raise ValueError(f"{missing}: train with probe_every > 0")
    parts = cells["metric"].str.extract(pattern)
    cells["what"], cells["bin"] = parts[0], parts[1].astype(int)
    wide = cells.pivot_table(index=["method", "run", "step", "bin"], columns="what", values="value")
    # pivot_table drops a quantity that is NaN everywhere (a correct ratio where no token moved): keep it, as NaN
    return wide.reindex(columns=sorted(cells["what"].unique())).reset_index()


def mechanism_over_steps(long: pd.DataFrame, sign: str = "pos", smooth: int = 1) -> Figure:
    """The paper's mechanism during training, per method over the probed steps: one column per probability bin, rows
    (a) the bin's share of the response tokens (Fig. 1a), (b) its share of the gradient (Fig. 1d, "position"
    attribution), (c) the correct ratio among its tokens that moved (Fig. 2b; ``sign`` "pos" for A > 0). Lines are
    the mean over each method's runs (seeds); ``smooth`` > 1 applies a centred rolling mean over steps."""
    _require(long, "long", ["run", "method", "step", "metric", "value"])
    pattern = rf"^(tokens/share|grad/share|shift/correct_{sign}|shift/n_{sign}|shift/unmoved_{sign})_bin(\d+)$"
    wide = _per_bin(long, pattern, "no tokens/share_bin*, grad/share_bin* or shift/* metrics")
    rows = {"tokens/share": "share of tokens", "grad/share": "share of the gradient",
            f"shift/correct_{sign}": f"correct ratio ({SIGN_NAMES[sign]})"}  # fmt: skip
    rows = {k: v for k, v in rows.items() if k in wide.columns}
    means = wide.groupby(["method", "step", "bin"], sort=False)[list(rows)].mean().reset_index()
    return mechanism_by_step(means, rows, smooth=smooth)


def mechanism_by_step(table: pd.DataFrame, measures: dict[str, str], smooth: int = 1) -> Figure:
    """Per-bin measures over training, a line per method: one column per probability bin, one row per measure
    (``measures``: {column of ``table``: label}; a column whose name holds "correct" is a ratio, drawn with 0.5
    dashed). ``table``: one row per (method, step, bin), as ``studies.report.mechanism_table`` writes mechanism.csv
    (token_share, grad_share, correct_ratio, fig3_correct)."""
    _require(table, "table", ["method", "step", "bin"])
    rows = [(c, label) for c, label in measures.items() if c in table.columns and not table[c].isna().all()]
    if not rows:
        raise ValueError(f"none of {list(measures)} has a value in the table")
    bins = sorted(table["bin"].unique())
    fig = Figure(figsize=(3.4 * len(bins), 2.6 * len(rows)), layout="constrained")
    axes = np.asarray(fig.subplots(len(rows), len(bins), sharex=True, squeeze=False))
    methods = _methods(table)
    for r, (what, label) in enumerate(rows):
        for c, b in enumerate(bins):
            ax = axes[r, c]
            for i, method in enumerate(methods):
                curve = table[(table["method"] == method) & (table["bin"] == b)].groupby("step")[what].mean()
                if curve.isna().all():
                    continue
                if smooth > 1:
                    curve = curve.rolling(smooth, center=True, min_periods=1).mean()
                ax.plot(curve.index, curve.to_numpy(), color=f"C{i}", label=method)
            if "correct" in what:
                ax.axhline(0.5, color="0.5", lw=0.8, ls="--")
                ax.set_ylim(-0.02, 1.02)
            if r == 0:
                ax.set_title(f"bin {b}")
            if c == 0:
                ax.set_ylabel(label)
            if r == len(rows) - 1:
                ax.set_xlabel("RL step")
    axes[0, 0].legend(fontsize="x-small")
    return fig


def live_training(history: Sequence[dict]) -> Figure:
    """A running training's dashboard from its metrics so far: (a) reward, (b) accuracy by people count in the
    training batches, (c) the latest probed step's token and gradient shares per probability bin."""
    frame = pd.DataFrame(list(history))
    fig = Figure(figsize=(15, 3.6), layout="constrained")
    ax_r, ax_a, ax_g = fig.subplots(1, 3)
    if frame.empty:
        return fig
    ax_r.plot(frame["step"], frame["reward/mean"], marker=".", color="C0")
    ax_r.set_ylim(-3.2, 3.2)
    ax_r.set_xlabel("RL step")
    ax_r.set_title("(a) mean reward (3 = solved)")
    for column in sorted(
        (c for c in frame.columns if c.startswith("acc/") and c.endswith("ppl")), key=lambda c: int(c[4:-3])
    ):
        ax_a.plot(frame["step"], frame[column], marker=".", label=column[4:])
    for mode, style in (("sample", "s"), ("greedy", "D")):
        test = frame.dropna(subset=[f"eval/{mode}/acc_all"]) if f"eval/{mode}/acc_all" in frame else frame.iloc[0:0]
        if not test.empty:
            ax_a.plot(
                test["step"], test[f"eval/{mode}/acc_all"], marker=style, color="k", ls=":", label=f"test, {mode}"
            )
    ax_a.set_ylim(-0.02, 1.02)
    ax_a.set_xlabel("RL step")
    ax_a.set_title("(b) accuracy: training batch by people count, test (avg)")
    if ax_a.get_lines():
        ax_a.legend(fontsize="small")
    shares = [c for c in frame.columns if c.startswith("grad/share_bin")]
    probed = frame.dropna(subset=shares) if shares else frame.iloc[0:0]
    if not probed.empty:
        last = probed.iloc[-1]
        k = np.arange(len(shares))
        ax_g.bar(k - 0.2, [last[f"tokens/share_bin{i}"] for i in k], 0.4, label="tokens")
        ax_g.bar(k + 0.2, [last[f"grad/share_bin{i}"] for i in k], 0.4, label="gradient")
        ax_g.set_xticks(k, [f"bin {i}" for i in k])
        ax_g.legend(fontsize="small")
        ax_g.set_title(f"(c) shares by probability bin, step {int(last['step'])}")
    else:
        ax_g.set_title("(c) shares by probability bin (probes off)")
    return fig


def correct_ratio(long: pd.DataFrame, sign: str = "pos") -> Figure:
    """From the trainer's ``shift/*`` metrics (every probed step): (a) the correct ratio per probability bin among the
    tokens that moved, pooled over the probed steps of each method's runs (the paper's Fig. 2b during training), with
    the share that did not move as light bars; (b) the top bin's correct ratio over the steps. ``sign``: "pos" (A > 0
    tokens that went up) or "neg" (A < 0 tokens that went down)."""
    _require(long, "long", ["method", "step", "metric", "value"])
    pattern = rf"^shift/(correct|n|unmoved)_{sign}_bin(\d+)$"
    wide = _per_bin(long, pattern, "no shift/* metrics")
    wide = wide.rename(columns={"n": "n_tokens", "correct": "correct_ratio"})
    if "unmoved" in wide.columns:  # runs before the unmoved share was logged count every token as moved
        wide["n_moved"] = wide["n_tokens"] * (1 - wide["unmoved"].fillna(0))
    fig = Figure(figsize=(12, 4), layout="constrained")
    ax_bins, ax_steps = fig.subplots(1, 2)
    top = wide["bin"].max()
    methods = _methods(wide)
    pooled = pool_shift(wide, ["method", "bin"])
    for i, method in enumerate(methods):
        rows = pooled[pooled["method"] == method]
        ax_bins.plot(rows["bin"], rows["correct_ratio"], marker="o", color=f"C{i}", label=method)
        over = pool_shift(wide[(wide["method"] == method) & (wide["bin"] == top)], ["step"])
        ax_steps.plot(over["step"], over["correct_ratio"], marker=".", color=f"C{i}", label=method)
    bins = sorted(wide["bin"].unique())
    _unmoved_bars(ax_bins, pooled, {b: b for b in bins}, methods)
    ax_bins.set_xticks(bins, [f"bin {b}" for b in bins])
    ax_bins.set_xlabel("probability bin (old policy), low to high")
    ax_bins.set_ylabel(f"correct ratio among movers ({SIGN_NAMES[sign]})")
    ax_bins.set_title("(a) pooled over the probed steps")
    ax_steps.set_xlabel("RL step")
    ax_steps.set_title(f"(b) the top bin (bin {top}) over training")
    for ax in (ax_bins, ax_steps):
        ax.axhline(0.5, color="0.5", lw=0.8, ls="--")
        ax.set_ylim(-0.02, 1.02)
    ax_bins.legend(fontsize="small")
    return fig


def token_html(pieces: Sequence[str], probs: Sequence[float], cmap: str = "RdYlGn") -> str:
    """Response tokens as HTML spans coloured by their probability (red = rare, green = confident), with the
    probability in each token's tooltip. Show it with ``IPython.display.HTML``."""
    import html

    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    colours = colormaps[cmap]
    spans = []
    for piece, p in zip(pieces, probs, strict=True):
        text = html.escape(piece).replace("\n", "&#8629;<br>")
        spans.append(
            f'<span title="p = {p:.3f}" style="background:{to_hex(colours(float(p)))};'
            f'padding:1px 0;border-radius:2px">{text}</span>'
        )
    legend = "".join(
        f'<span style="background:{to_hex(colours(p))};padding:0 6px">{p:.1f}</span>' for p in (0, 0.25, 0.5, 0.75, 1)
    )
    return (
        f'<div style="font-family:monospace;line-height:1.9">{"".join(spans)}</div>'
        f'<div style="font-size:smaller;margin-top:4px">probability: {legend}</div>'
    )
