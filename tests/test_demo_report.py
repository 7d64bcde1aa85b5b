"""The demo report's statistics: Student t quantiles, 95% intervals over seeds, per-seed gains, paired differences."""

import math

import numpy as np
import pandas as pd
import pytest

from lopti_lab import plots_methods
from lopti_lab.studies import report as demo_report
from lopti_lab.studies import stats
from lopti_lab.studies import tables as demo_tables
from lopti_lab.studies.config import DemoConfig

WARM = demo_tables.WARM


@pytest.mark.parametrize(
    ("df", "published"),
    [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042), (120, 1.980)],  # two-sided 95% t table values
)
def test_t_quantile_matches_the_printed_t_table(df, published):
    assert abs(stats.t_quantile(0.975, df) - published) < 6e-4


def test_t_cdf_of_one_degree_of_freedom_is_the_cauchy_distribution():
    for x in (-3.0, -0.5, 0.0, 0.7, 5.0):
        assert abs(stats.t_cdf(x, 1) - (0.5 + math.atan(x) / math.pi)) < 1e-9


def test_ci95_is_t_times_the_standard_error_of_the_mean():
    values = [0.80, 0.86, 0.83, 0.91, 0.88]
    mean = sum(values) / 5
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 4)
    assert abs(stats.ci95(values) - 2.7764451 * sd / math.sqrt(5)) < 1e-6
    assert math.isnan(stats.ci95([0.5]))


@pytest.mark.parametrize(("p", "df"), [(0.4, 3), (1.0, 3), (0.975, 0)])
def test_t_quantile_rejects_bad_arguments(p, df):
    with pytest.raises(ValueError, match=r"p must|df must"):
        stats.t_quantile(p, df)


def _frame():
    """The layout of `accuracy_table`: the warm start once, two methods x three seeds."""
    rows = [(WARM, 0, 0.60)]
    rows += [("+ GRPO", s, a) for s, a in enumerate((0.80, 0.90, 0.85))]
    rows += [("+ GRPO + AR", s, a) for s, a in enumerate((0.80, 0.95, 0.90))]
    return pd.DataFrame(rows, columns=["model", "seed", "avg"])


def test_gains_per_seed_subtract_the_warm_start_from_each_run():
    gains = demo_tables.gains_per_seed(_frame())
    assert list(gains.index) == ["+ GRPO", "+ GRPO + AR"]
    assert gains.loc["+ GRPO", ["seed 0", "seed 1", "seed 2"]].round(12).tolist() == [0.2, 0.3, 0.25]
    assert abs(gains.loc["+ GRPO", "mean"] - 0.25) < 1e-12
    assert abs(gains.loc["+ GRPO", "ci95"] - 4.302653 * 0.05 / math.sqrt(3)) < 1e-6


def test_paired_differences_to_grpo_report_ties_apart():
    paired = demo_tables.paired_vs_grpo(_frame())
    ar = paired.loc["+ GRPO + AR"]
    assert abs(ar["mean"] - 0.10 / 3) < 1e-12  # differences (0, .05, .05)
    assert (ar["above"], ar["level"], ar["below"]) == (2, 1, 0)
    one_seed = _frame()[lambda f: f["seed"] == 0]
    assert demo_tables.paired_vs_grpo(one_seed).empty


def test_paired_per_seed_subtracts_grpo_of_the_same_seed_and_the_plot_draws_every_seed():
    frame = _frame()
    frame["2ppl"] = frame["avg"] - 0.1
    frame.loc[(frame["model"] == "+ GRPO + AR") & (frame["seed"] == 2), "2ppl"] = 0.70  # GRPO's seed 2: 0.75
    diffs = demo_tables.paired_per_seed(frame, ["2ppl", "avg"])
    assert set(diffs["model"]) == {"+ GRPO + AR"} and len(diffs) == 6  # GRPO itself and the warm start: no row
    two = diffs[diffs["column"] == "2ppl"].set_index("seed")["diff"]
    np.testing.assert_allclose(two.loc[[0, 1, 2]], [0.0, 0.05, -0.05], atol=1e-12)
    intervals = demo_tables.paired_intervals(diffs).set_index("column")
    assert intervals.loc["2ppl", "mean"] == pytest.approx(0.0, abs=1e-12) and intervals.loc["2ppl", "n"] == 3
    assert intervals.loc["avg", "ci95"] == pytest.approx(4.302653 * 0.05 / math.sqrt(3) / math.sqrt(3), rel=1e-5)
    fig = plots_methods.paired_differences(diffs, demo_tables.paired_intervals(diffs))
    axes = fig.axes
    assert [a.get_title() for a in axes] == ["2 people: method - GRPO", "avg: method - GRPO"]
    dots = axes[0].collections[0].get_offsets()
    np.testing.assert_allclose(sorted(dots[:, 0]), [-0.05, 0.0, 0.05], atol=1e-12)
    assert demo_tables.paired_per_seed(frame[frame["model"] != "+ GRPO"]).empty
    with pytest.raises(ValueError, match="paired_differences"):
        plots_methods.paired_differences(diffs.iloc[:0], demo_tables.paired_intervals(diffs))


def test_recorded_comparison_reads_the_study_folder_first(tmp_path):
    frame, source = demo_tables.recorded_comparison(tmp_path / "none")
    assert source.name == "comparison_sample.csv" and {"model", "seed", "avg"} <= set(frame.columns)
    _frame().to_csv(tmp_path / "accuracy_sample.csv", index=False)
    frame, source = demo_tables.recorded_comparison(tmp_path)
    assert source == tmp_path / "accuracy_sample.csv" and len(frame) == 7


def test_markdown_and_verdict_with_several_seeds():
    config = DemoConfig(seeds=3, methods=("GRPO", "GRPO+AR"), out="unused")
    frame = _frame()
    frame["avg_se"] = 0.02
    mean, spread = demo_tables.spread_over_seeds(frame)
    table = demo_tables.accuracy_markdown(mean, spread)
    assert f"| + GRPO | 0.85 ± {4.302653 * 0.05 / math.sqrt(3):.2f} |" in table  # ± 0.12
    assert f"| {WARM} | 0.60 |" in table  # one evaluation: no interval over seeds
    assert "95% confidence interval of the mean over 3 seeds" in demo_tables.se_line(mean, config)
    verdict = demo_tables.compare_methods(mean, config, demo_tables.paired_vs_grpo(frame))
    assert verdict[0].startswith("GRPO: avg 0.850 (+0.250 over the warm start")
    assert "not distinguishable" in verdict[1] and "level with / below GRPO: 2 / 1 / 0" in verdict[1]


def test_mechanism_table_averages_the_seeds_of_each_method_per_step_and_bin():
    rows = []
    for run, shares, correct in (("grpo-seed0", (0.2, 0.8), (0.3, 0.4)), ("grpo-seed1", (0.4, 0.6), (0.5, 0.6))):
        for b in (0, 1):
            rows += [
                (run, "GRPO", 5, f"tokens/share_bin{b}", shares[b]),
                (run, "GRPO", 5, f"grad/share_bin{b}", 1 - shares[b]),
                (run, "GRPO", 5, f"shift/correct_pos_bin{b}", correct[b]),
                (run, "GRPO", 5, f"shift/n_pos_bin{b}", 10.0),
                (run, "GRPO", 5, f"shift/correct_neg_bin{b}", 0.0),  # the other sign is not mixed in
            ]
    long = pd.DataFrame(rows, columns=["run", "method", "step", "metric", "value"])
    table = demo_report.mechanism_table(long).set_index("bin")
    assert table.loc[0, "token_share"] == pytest.approx(0.3) and table.loc[1, "grad_share"] == pytest.approx(0.3)
    assert table.loc[0, "correct_ratio"] == pytest.approx(0.4) and table.loc[1, "n_tokens"] == 20
    text = demo_report._mechanism_markdown(demo_report.mechanism_table(long))
    assert text.splitlines()[2] == "| GRPO | 5 | 30 / 70 | 70 / 30 | 0.40 / 0.50 |"
    # where the runs measured the paper's Fig. 3 at the same step: its float64 correct ratio and its token count
    fig3 = [(run, "GRPO", 5, f"fig3/float64/q/correct_bin{b}", 0.5 + 0.1 * b + 0.2 * (run == "grpo-seed1"))
            for run in ("grpo-seed0", "grpo-seed1") for b in (0, 1)]  # fmt: skip
    fig3 += [(run, "GRPO", 5, f"fig3/q/n_bin{b}", 7.0) for run in ("grpo-seed0", "grpo-seed1") for b in (0, 1)]
    fig3 += [("grpo-seed0", "GRPO", 5, "fig3/bfloat16/q/correct_bin0", 0.0)]  # the bf16 reading is not mixed in
    both = pd.concat([long, pd.DataFrame(fig3, columns=long.columns)])
    table = demo_report.mechanism_table(both).set_index("bin")
    assert table.loc[1, "fig3_correct"] == pytest.approx(0.7) and table.loc[0, "fig3_n"] == 14
    text = demo_report._mechanism_markdown(demo_report.mechanism_table(both))
    assert text.splitlines()[2] == "| GRPO | 5 | 30 / 70 | 70 / 30 | 0.40 / 0.50 | 0.60 / 0.70 |"
    assert "fig3_correct" not in demo_report.mechanism_table(both, sign="neg")


def test_frozen_batch_markdown_shows_positive_advantage_ratios_with_their_counts():
    bins = pd.DataFrame(
        {
            "method": ["GRPO"] * 4,
            "bin": [0, 0, 1, 1],
            "label": ["[0, 0.5)", "[0, 0.5)", "[0.5, 1]", "[0.5, 1]"],
            "sign": ["pos", "neg", "pos", "neg"],
            "n_tokens": [12, 7, 30, 9],
            "correct_ratio": [0.75, 0.1, float("nan"), 0.2],
        }
    )
    lines = demo_report._frozen_batch_markdown(bins).splitlines()
    assert lines[0] == "| method | [0, 0.5) (n) | [0.5, 1] (n) |"
    assert lines[2] == "| GRPO | 0.75 (12) | - |"


def test_each_seed_is_compared_with_the_warm_start_evaluated_under_its_own_sampling_seed(tmp_path):
    """`run_demo` evaluates the warm start once per seed; the table keeps one warm row per seed (its spread is the
    evaluation's noise) and each run's gain subtracts the warm start of its seed."""
    from lopti_lab import runs

    config = DemoConfig(out=str(tmp_path / "demo"), train={"eval_people": (3,)}, seeds=2)

    def record(acc):
        return {f"eval/{mode}/acc_3ppl": acc for mode in ("sample", "greedy")} | {"eval/sample/acc_3ppl_se": 0.03}

    run_dirs = {}
    for seed, acc in ((0, 0.9), (1, 0.8)):
        folder = runs.RunFolder(tmp_path / f"grpo-seed{seed}")
        folder.write_config({"note": "test"})
        folder.log({"step": 1, **record(acc)})
        run_dirs[("GRPO", seed)] = tmp_path / f"grpo-seed{seed}"
    frame = demo_tables.accuracy_table(config, run_dirs, {0: record(0.6), 1: record(0.7)}, "sample")
    assert frame[frame["model"] == WARM]["3ppl"].tolist() == [0.6, 0.7]
    gains = demo_tables.gains_per_seed(frame)
    assert gains.loc["+ GRPO", ["seed 0", "seed 1"]].round(12).tolist() == [0.3, 0.1]
    mean, spread = demo_tables.spread_over_seeds(frame)
    assert mean.loc[WARM, "3ppl"] == pytest.approx(0.65)
    assert spread.loc[WARM, "3ppl"] == pytest.approx(12.706205 * 0.05, rel=1e-6)  # sd .0707 / sqrt 2
    single = demo_tables.accuracy_table(config, run_dirs, record(0.6), "sample")  # one evaluation: seed 0's
    assert demo_tables.gains_per_seed(single).loc["+ GRPO", ["seed 0", "seed 1"]].round(12).tolist() == [0.3, 0.2]
