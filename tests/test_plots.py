"""The Fig. 1 and Fig. 2 functions draw what their tables hold (Agg, no display)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.collections import PathCollection, PolyCollection
from tiny import tiny_qwen2

from lopti_lab.plots import fig1, fig2
from lopti_lab.probes import probability_shift, selective_sweep, token_stats
from lopti_lab.toy import ToyConfig, simulate

TOY = ToyConfig(vocab_size=64, n_states=16, feature_dim=4, seq_len=8, n_prompts=4, group_size=4, steps=2)


@pytest.fixture(scope="module")
def sweep():
    """Fig. 1's data on a tiny model made confident (final norm x 11) so that its own samples fill every bin."""
    model = tiny_qwen2(300).double()
    with torch.no_grad():
        model.model.norm.weight.mul_(11.0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (8, 24), generator=gen)
    with torch.no_grad():  # responses sampled from the model itself, as in RL
        for t in range(12, 24):
            logits = model(input_ids=ids[:, :t]).logits[:, -1]
            ids[:, t] = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)
    attn = torch.ones_like(ids)
    mask = torch.ones(8, 12, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.0, -1.0], dtype=torch.float64)
    tokens, grads = selective_sweep(model, ids, attn, mask, adv, lr=0.1)
    return tokens, grads, model, (ids, attn, mask, adv)


def rendered(fig) -> None:
    fig.savefig(io.BytesIO(), format="png")  # draws every artist: fails on bad data


def test_fig1_has_the_six_panels_with_their_data(sweep):
    tokens, grads, _, _ = sweep
    fig = fig1(tokens, grads, title="tiny model")
    axes = fig.axes
    assert [ax.get_title()[:3] for ax in axes] == ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)"]
    everything = tokens[tokens["update"] == "all"]
    shares = everything["bin"].value_counts(normalize=True).sort_index().to_numpy()
    heights = [p.get_height() for p in axes[0].patches]
    np.testing.assert_allclose(heights, shares)  # (a): the token share of each bin
    assert len(axes[1].lines) > 0  # (b): box plots are lines
    # (d): one bar per bin and one for all, at the sweep's gradient norms
    np.testing.assert_allclose(
        [p.get_height() for p in axes[3].patches],
        grads.set_index("update")["grad_norm"].loc[["bin0", "bin1", "bin2", "bin3", "all"]],
    )
    for ax in (axes[2], axes[4], axes[5]):  # (c), (e), (f): boxes of both advantage signs, each on its own scale
        assert len(ax.patches) >= 2 and ax.get_ylabel() == "probability change"
    assert not axes[4].get_shared_y_axes().joined(axes[2], axes[4])
    assert not axes[5].get_shared_y_axes().joined(axes[2], axes[5])
    assert [t.get_text() for t in axes[2].get_legend().get_texts()] == ["A > 0", "A < 0"]
    rendered(fig)


def test_fig1_rejects_incomplete_tables(sweep):
    tokens, grads, _, _ = sweep
    with pytest.raises(ValueError, match="delta_p"):
        fig1(tokens.drop(columns="delta_p"), grads)
    with pytest.raises(ValueError, match="bin3"):
        fig1(tokens[tokens["update"] != "bin3"], grads)


def test_fig2_wedge_from_a_model_and_correct_ratio_per_method(sweep):
    _, _, model, (ids, attn, mask, adv) = sweep
    stats = token_stats(model, ids, attn, mask)
    tokens = stats.to_frame()
    # a correct-ratio table per "method": two fake updates of known effect
    old = stats.logp
    shifts = []
    for method, new in (("up", old + 0.1), ("down", old - 0.1)):
        shifts.append(probability_shift(old, new, adv, mask, bins=(0, 0.5, 1)).bins.assign(method=method))
    fig = fig2(tokens, stats.vocab_size, pd.concat(shifts))
    wedge, ratio, unmoved = fig.axes
    scatter = [c for c in wedge.collections if isinstance(c, PathCollection)]
    assert len(scatter) == 1 and len(scatter[0].get_offsets()) == len(tokens)
    np.testing.assert_allclose(np.asarray(scatter[0].get_offsets())[:, 1], tokens["grad_norm"])
    upper, lower = wedge.lines[:2]
    assert upper.get_ydata()[0] == pytest.approx(np.sqrt(2)) and upper.get_ydata()[-1] == pytest.approx(0)
    assert lower.get_ydata()[0] == pytest.approx(np.sqrt(stats.vocab_size / (stats.vocab_size - 1)))
    assert any(isinstance(c, PolyCollection) for c in wedge.collections)  # the shaded wedge
    lines = {line.get_label(): line.get_ydata() for line in ratio.lines if not line.get_label().startswith("_")}
    assert set(lines) == {"up", "down"}
    np.testing.assert_allclose(lines["up"], [1.0, 1.0])  # every A > 0 token went up
    np.testing.assert_allclose(lines["down"], [0.0, 0.0])
    assert [b.get_height() for b in unmoved.patches] == [0.0] * 4  # every token moved: no unmoved bars
    rendered(fig)


def test_fig2_pools_the_toy_steps_and_draws_one_line_per_method():
    res = simulate(TOY)
    fig = fig2(res.tokens, TOY.vocab_size, res.shift)
    wedge, ratio, unmoved = fig.axes
    scatter = next(c for c in wedge.collections if isinstance(c, PathCollection))
    assert len(scatter.get_offsets()) == len(res.tokens)
    methods = [line.get_label() for line in ratio.lines if not line.get_label().startswith("_")]
    assert methods == list(res.steps["method"].unique())
    # pooled over steps, weighted by the tokens that moved: the GRPO line is the mover-weighted mean of its cells
    cells = res.shift[(res.shift["method"] == "GRPO") & (res.shift["sign"] == "pos") & (res.shift["n_tokens"] > 0)]
    pooled = cells.groupby("bin").apply(lambda c: (c.correct_ratio.fillna(0) * c.n_moved).sum() / c.n_moved.sum())
    grpo = next(line for line in ratio.lines if line.get_label() == "GRPO").get_ydata()
    np.testing.assert_allclose(np.asarray(grpo)[pooled.index], pooled.to_numpy())
    unmoved_share = cells.groupby("bin").apply(lambda c: 1 - c.n_moved.sum() / c.n_tokens.sum())
    n_methods = res.shift["method"].nunique()
    np.testing.assert_allclose([b.get_height() for b in unmoved.patches][: len(unmoved_share)], unmoved_share)
    assert len(unmoved.patches) == n_methods * len(unmoved_share)
    only_b = fig2(shift=res.shift, sign="neg")
    assert len(only_b.axes) == 2 and "A < 0" in only_b.axes[0].get_ylabel()
    sampled = fig2(res.tokens, TOY.vocab_size, max_points=100)
    assert len(next(c for c in sampled.axes[0].collections if isinstance(c, PathCollection)).get_offsets()) == 100
    rendered(fig)


def test_fig2_bad_input():
    with pytest.raises(ValueError, match="tokens"):
        fig2()
    with pytest.raises(ValueError, match="vocab_size"):
        fig2(pd.DataFrame({"prob": [0.5], "grad_norm": [0.6]}))
    with pytest.raises(ValueError, match="sign"):
        fig2(shift=pd.DataFrame(), sign="both")


# --- the dashboards built on the trainer's metrics ----------------------------------------------------------------


def _long_table() -> pd.DataFrame:
    """A runs.compare-shaped table: two methods x two seeds, three steps, probe and shift metrics on steps 2-3."""
    rows = []
    for method in ("GRPO+AR", "GRPO"):
        for seed in (0, 1):
            run = f"{method}-{seed}"
            for step in (1, 2, 3):
                reward = step + seed + (method == "GRPO+AR")
                rows += [(run, method, step, "reward/mean", float(reward)), (run, method, step, "acc/all", 0.1 * step)]
                if step > 1:
                    for k in range(4):
                        rows += [
                            (run, method, step, f"tokens/share_bin{k}", [0.2, 0.1, 0.1, 0.6][k]),
                            (run, method, step, f"grad/share_bin{k}", [0.7, 0.2, 0.05, 0.05][k] * (1 + seed)),
                            (run, method, step, f"shift/n_pos_bin{k}", 10.0),
                            (run, method, step, f"shift/correct_pos_bin{k}", 0.5 + 0.1 * (method == "GRPO+AR")),
                        ]
    return pd.DataFrame(rows, columns=["run", "method", "step", "metric", "value"])


def test_learning_curves_plot_the_seed_mean_with_a_band():
    from lopti_lab.plots import learning_curves

    fig = learning_curves(_long_table(), ["reward/mean", "acc/all", "not/there"])
    rendered(fig)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["GRPO", "GRPO+AR"], "the paper's method order"
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [1.5, 2.5, 3.5])  # GRPO: mean of seeds 0 and 1
    assert fig.axes[1].get_title() == "accuracy, training batch (acc/all)", "acc/all is the training batch's"
    assert len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 2  # a min-max band per method
    with pytest.raises(ValueError, match="none of the requested metrics"):
        learning_curves(_long_table(), ["x"])


def test_gradient_share_bars_average_the_probed_steps():
    from lopti_lab.plots import gradient_share

    fig = gradient_share(_long_table())
    rendered(fig)
    grad_bars = [p.get_height() for p in fig.axes[1].patches]
    np.testing.assert_allclose(grad_bars[:4], [1.05, 0.3, 0.075, 0.075])  # GRPO first; mean over seeds x1 and x2
    with pytest.raises(ValueError, match="probe_every"):
        gradient_share(_long_table().query("not metric.str.contains('share')"))
    # with "position" attribution the prompt's share gets its own bar per method, after the bins
    long = _long_table()
    probed = long[long["metric"] == "grad/share_bin0"].assign(metric="grad/share_context")
    probed["value"] = np.where(probed["method"] == "GRPO", 0.4, 0.2)
    fig = gradient_share(pd.concat([long, probed]))
    grad_bars = [p.get_height() for p in fig.axes[1].patches]
    assert len(grad_bars) == 2 * 4 + 2
    np.testing.assert_allclose(grad_bars[-2:], [0.4, 0.2])  # GRPO first, as the bins
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()][-1] == "prompt"


def test_correct_ratio_pools_bins_and_follows_the_top_bin():
    from lopti_lab.plots import correct_ratio

    fig = correct_ratio(_long_table())
    rendered(fig)
    by_bin, over_steps, unmoved = fig.axes
    np.testing.assert_allclose(by_bin.lines[1].get_ydata(), [0.6] * 4)  # GRPO+AR, pooled
    assert [b.get_height() for b in unmoved.patches] == [0.0] * 8  # no shift/unmoved_* logged: all counted as moved
    np.testing.assert_allclose(over_steps.lines[0].get_xdata(), [2, 3])
    with pytest.raises(ValueError, match="shift"):
        correct_ratio(_long_table().query("not metric.str.startswith('shift')"))
    long = _long_table()  # no token moved at any probed step (as the trainer logs it: unmoved share 1, correct NaN)
    correct = long["metric"].str.startswith("shift/correct")
    unmoved = long[correct].assign(metric=lambda t: t["metric"].str.replace("correct", "unmoved"), value=1.0)
    long = pd.concat([long.assign(value=long["value"].mask(correct)), unmoved], ignore_index=True)
    fig = correct_ratio(long)
    rendered(fig)
    method_lines = [line for line in fig.axes[0].lines if line.get_label() in ("GRPO", "GRPO+AR")]
    assert len(method_lines) == 2 and all(np.isnan(line.get_ydata()).all() for line in method_lines)


def test_live_training_draws_what_has_been_logged():
    from lopti_lab.plots import live_training

    history = [
        {"step": 1, "reward/mean": -1.0, "acc/all": 0.0, "acc/3ppl": 0.0, "acc/4ppl": 0.0},
        {
            "step": 2,
            "reward/mean": 0.5,
            "acc/all": 0.5,
            "acc/3ppl": 1.0,
            "acc/4ppl": 0.0,
            **{f"grad/share_bin{k}": 0.25 for k in range(4)},
            **{f"tokens/share_bin{k}": 0.25 for k in range(4)},
        },
    ]
    fig = live_training(history)
    rendered(fig)
    assert [line.get_label() for line in fig.axes[1].lines] == ["3ppl", "4ppl"]
    # a test evaluation shows beside the training batch's accuracy, greedy and sampled
    history[1] |= {"eval/sample/acc_all": 0.25, "eval/greedy/acc_all": 0.75}
    lines = {line.get_label(): line for line in live_training(history).axes[1].lines}
    assert list(lines) == ["3ppl", "4ppl", "test, sample", "test, greedy"]
    np.testing.assert_allclose(lines["test, greedy"].get_ydata(), [0.75])
    assert len(fig.axes[2].patches) == 8 and "step 2" in fig.axes[2].get_title()
    assert len(live_training([]).axes[0].lines) == 0


def test_theory_figures_and_token_colours():
    from lopti_lab.kk import dataset_stats, load_split
    from lopti_lab.plots import kk_dataset, softmax_gradients, token_html, toy_dynamics
    from lopti_lab.widgets import softmax_table

    table = softmax_table([2.0, 0.0, -1.0])
    fig = softmax_gradients(table, 1.0)
    rendered(fig)
    np.testing.assert_allclose(fig.axes[1].collections[-1].get_offsets()[:, 1], table["grad_norm"])
    rendered(toy_dynamics(simulate(TOY)))
    rendered(kk_dataset(dataset_stats(load_split("test", [2, 5], limit=5))))
    html = token_html(["<think>", " a\nb"], [0.05, 0.95])
    assert html.count("<span title=") == 2 and "&lt;think&gt;" in html and "p = 0.050" in html


def test_mechanism_over_steps_draws_the_seed_mean_per_bin_and_method():
    from lopti_lab.plots import mechanism_over_steps

    fig = mechanism_over_steps(_long_table())
    rendered(fig)
    assert len(fig.axes) == 3 * 4  # token share, gradient share, correct ratio x 4 bins
    grad_bin0 = fig.axes[4]
    grpo = next(line for line in grad_bin0.lines if line.get_label() == "GRPO")
    np.testing.assert_allclose(grpo.get_xdata(), [2, 3])
    np.testing.assert_allclose(grpo.get_ydata(), [0.7 * 1.5] * 2)  # seeds x1 and x2: mean 1.05
    ar = next(line for line in fig.axes[8].lines if line.get_label() == "GRPO+AR")
    np.testing.assert_allclose(ar.get_ydata(), [0.6, 0.6])
    with pytest.raises(ValueError, match="probe_every"):
        mechanism_over_steps(_long_table().query("metric in ('reward/mean', 'acc/all')"))


def test_mechanism_by_step_draws_a_study_table_row_per_measure():
    """The same figure from mechanism.csv's layout (a bundled study table): one row per measure that has values,
    a line per method at its steps, a 0.5 guide on ratios."""
    from lopti_lab.plots import mechanism_by_step

    rows = [{"method": m, "step": s, "bin": b, "token_share": 0.25, "grad_share": 0.1 * (b + 1),
             "fig3_correct": 0.5 + 0.1 * b if m == "GRPO" else float("nan")}
            for m in ("GRPO", "GRPO+AR") for s in (10, 20) for b in range(4)]  # fmt: skip
    table = pd.DataFrame(rows)
    fig = mechanism_by_step(table, {"token_share": "tokens", "grad_share": "gradient", "fig3_correct": "Fig. 3",
                                    "correct_ratio": "absent"})  # fmt: skip
    rendered(fig)
    assert len(fig.axes) == 3 * 4  # the absent column draws no row
    fig3_bin2 = fig.axes[8 + 2]
    assert [line.get_label() for line in fig3_bin2.lines if not line.get_label().startswith("_")] == ["GRPO"]
    np.testing.assert_allclose(fig3_bin2.lines[0].get_ydata(), [0.7, 0.7])
    with pytest.raises(ValueError, match="has a value"):
        mechanism_by_step(table, {"correct_ratio": "absent"})
