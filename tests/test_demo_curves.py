"""A study's test-split learning curves (``studies.curves``) against hand-computed values: the curve rows read from run
folders, the paper's mean of the last 3 evaluations, the area under the curve, the last-third gain, the bands over
seeds and the paired difference to GRPO per step; then the report section and figure that show them."""

import math

import numpy as np
import pandas as pd
import pytest

from lopti_lab import plots_methods, runs
from lopti_lab.paths import data_dir, shown
from lopti_lab.studies import curves
from lopti_lab.studies import report as demo_report
from lopti_lab.studies.config import HardLabConfig

T4 = 2.7764451  # t(0.975, 4)
T2 = 4.3026527  # t(0.975, 2)


def _record(step: int, acc: dict[int, float], greedy: float = 1.0) -> dict:
    out = {"step": step, "acc/all": 0.5}
    for n, a in acc.items():
        out |= {f"eval/sample/acc_{n}ppl": a, f"eval/greedy/acc_{n}ppl": greedy}
    return out


def _run(folder, evaluations: dict[int, dict[int, float]], steps: int = 60):
    """A run folder whose metrics.jsonl has a record per step and, at the given steps, a test evaluation."""
    run = runs.RunFolder(folder)
    run.write_config({"note": "test"})
    for step in range(1, steps + 1):
        run.log(_record(step, evaluations[step]) if step in evaluations else {"step": step, "acc/all": 0.5})
    return folder


@pytest.fixture
def study(tmp_path):
    """Two methods x three seeds, evaluated at steps 20, 40, 60 at 2 and 3 people; the warm start per seed."""
    warm = {s: _record(0, {2: 0.5, 3: 0.4 + 0.01 * s}) for s in range(3)}
    run_dirs = {}
    for seed in range(3):
        grpo = {20: {2: 0.6, 3: 0.5}, 40: {2: 0.7, 3: 0.6 + 0.01 * seed}, 60: {2: 0.8, 3: 0.7}}
        ar = {20: {2: 0.6, 3: 0.55}, 40: {2: 0.7, 3: 0.6}, 60: {2: 0.8, 3: 0.7 + 0.05 * seed}}
        run_dirs[("GRPO", seed)] = _run(tmp_path / f"grpo{seed}", grpo)
        run_dirs[("GRPO+AR", seed)] = _run(tmp_path / f"ar{seed}", ar)
    return curves.test_curves(run_dirs, warm, people=(2, 3)), run_dirs, warm


def test_curves_have_the_warm_start_as_every_runs_step_zero_and_one_row_per_evaluation(study):
    frame, _, _ = study
    grpo1 = frame[(frame["model"] == "+ GRPO") & (frame["seed"] == 1)].set_index("step")
    assert list(grpo1.index) == [0, 20, 40, 60]  # steps without an evaluation leave no row
    assert grpo1.loc[0, "3ppl"] == pytest.approx(0.41)  # the warm start under seed 1's sampling seed
    assert grpo1.loc[40, "3ppl"] == pytest.approx(0.61)
    assert grpo1.loc[40, "avg"] == pytest.approx((0.7 + 0.61) / 2)
    assert (frame["model"] == curves.WARM).sum() == 3
    greedy = curves.test_curves(study[1], study[2], people=(2, 3), mode="greedy")
    assert set(greedy.query("step > 0")["2ppl"]) == {1.0}


def test_last_evaluations_average_the_last_k_after_the_warm_start(study):
    frame, _, _ = study
    last = curves.last_evaluations(frame, k=3).set_index(["model", "seed"])
    assert last.loc[("+ GRPO", 2), "3ppl"] == pytest.approx((0.5 + 0.62 + 0.7) / 3)
    assert last.loc[("+ GRPO", 2), "evals"] == 3  # step 0 is not one of them
    assert last.loc[(curves.WARM, 1), "3ppl"] == pytest.approx(0.41)
    two = curves.last_evaluations(frame, k=2).set_index(["model", "seed"])
    assert two.loc[("+ GRPO + AR", 1), "3ppl"] == pytest.approx((0.6 + 0.75) / 2)
    with pytest.raises(ValueError, match="k must be"):
        curves.last_evaluations(frame, k=0)


def test_area_under_curve_is_the_trapezoid_over_the_span_against_a_naive_sum(study):
    frame, _, _ = study
    auc = curves.area_under_curve(frame).set_index(["model", "seed"])
    # seed 0 of GRPO at 3 people: 0.40, 0.50, 0.60, 0.70 at steps 0, 20, 40, 60 -> trapezoids of width 20
    naive = (20 * (0.40 + 0.50) / 2 + 20 * (0.50 + 0.60) / 2 + 20 * (0.60 + 0.70) / 2) / 60
    assert auc.loc[("+ GRPO", 0), "3ppl"] == pytest.approx(naive)
    # a dense check: the area of a piecewise-linear curve, by 6,001 midpoints
    steps = np.array([0, 20, 40, 60.0])
    values = frame[(frame["model"] == "+ GRPO + AR") & (frame["seed"] == 2)].sort_values("step")["3ppl"].to_numpy()
    grid = np.linspace(0, 60, 6001)
    dense = np.interp((grid[1:] + grid[:-1]) / 2, steps, values).mean()
    assert auc.loc[("+ GRPO + AR", 2), "3ppl"] == pytest.approx(dense, abs=1e-9)
    assert curves.WARM not in auc.index.get_level_values(0)


def test_area_needs_two_evaluated_steps():
    one = pd.DataFrame([{"model": "+ GRPO", "seed": 0, "step": 0, "3ppl": 0.4, "avg": 0.4}])
    with pytest.raises(ValueError, match="two steps"):
        curves.area_under_curve(one)


def test_late_gain_is_the_last_evaluation_minus_the_one_at_two_thirds(study):
    frame, _, _ = study
    late = curves.late_gain(frame).set_index(["model", "seed"])
    assert (late["from_step"] == 40).all() and (late["to_step"] == 60).all()
    assert late.loc[("+ GRPO", 1), "3ppl"] == pytest.approx(0.70 - 0.61)
    assert late.loc[("+ GRPO + AR", 2), "3ppl"] == pytest.approx(0.80 - 0.60)


def test_seed_bands_give_mean_interval_and_range_over_seeds(study):
    frame, _, _ = study
    bands = curves.seed_bands(frame).set_index(["model", "column", "step"])
    cell = bands.loc[("+ GRPO + AR", "3ppl", 60)]
    values = [0.70, 0.75, 0.80]
    assert cell["mean"] == pytest.approx(0.75)
    assert cell["ci95"] == pytest.approx(T2 * np.std(values, ddof=1) / math.sqrt(3))
    assert (cell["low"], cell["high"], cell["n"]) == (pytest.approx(0.70), pytest.approx(0.80), 3)
    assert bands.loc[("+ GRPO", "2ppl", 20), "ci95"] == pytest.approx(0.0)
    assert curves.WARM not in bands.index.get_level_values(0)


def test_paired_over_steps_subtract_grpo_of_the_same_seed_and_step(study):
    frame, _, _ = study
    paired = curves.paired_over_steps(frame).set_index(["model", "column", "step"])
    assert 0 not in paired.index.get_level_values("step")
    # 3 people, step 40: AR 0.60 at every seed, GRPO 0.60 / 0.61 / 0.62 -> differences 0, -0.01, -0.02
    cell = paired.loc[("+ GRPO + AR", "3ppl", 40)]
    assert cell["mean"] == pytest.approx(-0.01)
    assert cell["ci95"] == pytest.approx(T2 * 0.01 / math.sqrt(3))
    assert cell["n"] == 3
    assert paired.loc[("+ GRPO + AR", "3ppl", 20), "mean"] == pytest.approx(0.05)
    assert curves.paired_over_steps(frame[frame["model"] != "+ GRPO"]).empty


def test_the_report_section_and_figure_show_the_curves(study, tmp_path):
    frame, run_dirs, warm = study
    config = HardLabConfig(out=str(tmp_path / "report"), seeds=3, methods=("GRPO", "GRPO+AR"),
                           train={"eval_people": (2, 3)})  # fmt: skip
    tables = demo_report.over_training(config, run_dirs, warm)
    pd.testing.assert_frame_equal(tables["curves_sample"], frame)
    paired = tables["paired_last3_sample"].query("column == '3ppl'").set_index("seed")["diff"]
    # last-3 means at 3 people: AR (0.55 + 0.60 + 0.70 + 0.05 s) / 3, GRPO (0.50 + 0.60 + 0.01 s + 0.70) / 3
    np.testing.assert_allclose(paired.to_numpy(), [(0.05 + 0.04 * s) / 3 for s in range(3)], atol=1e-12)
    text = demo_report._over_training_text(tables, config)
    assert "mean of its last 3 evaluations" in text
    ci = T2 * np.std([0.05 / 3, 0.09 / 3, 0.13 / 3], ddof=1) / math.sqrt(3)  # 0.033 > the mean 0.030: it holds 0
    primary = next(line for line in text.splitlines() if line.startswith("- GRPO + AR: "))
    assert primary.startswith(f"- GRPO + AR: +0.030 ± {ci:.3f} (95% interval over 3 seeds; above / level / below GRPO:")
    assert primary.endswith("3 / 0 / 0): does not separate from GRPO")
    row = next(line for line in text.splitlines() if line.startswith("| GRPO + AR | +"))
    assert row.startswith(f"| GRPO + AR | {0.0:+.3f} ± {0.0:.3f} (0/3/0) | {np.mean([0.05, 0.09, 0.13]) / 3:+.3f}")
    fig = plots_methods.study_curves(tables["bands_sample"], tables["paired_steps_sample"])
    assert len(fig.axes) == 2 * 3  # two rows (curves, paired) x (2, 3 people, avg)
    assert len(fig.axes[0].lines) == 2 and len(fig.axes[3].lines) == 2  # a curve per method; the 0 line and AR
    with pytest.raises(ValueError, match="seed_bands"):
        plots_methods.study_curves(pd.DataFrame())


def test_a_demo_evaluated_once_has_no_curve_section(tmp_path):
    run_dirs = {("GRPO", 0): _run(tmp_path / "g", {10: {2: 0.7, 3: 0.6}}, steps=10)}
    config = HardLabConfig(out=str(tmp_path / "r"), seeds=1, methods=("GRPO",), train={"eval_people": (2, 3)})
    assert demo_report.over_training(config, run_dirs, {0: _record(0, {2: 0.5, 3: 0.4})}) is None


def test_recorded_study_reads_a_study_folder_first_then_the_bundled_record(study, tmp_path):
    frame, _, _ = study
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in curves.RECORDED:
        frame.to_csv(folder / f"{name}.csv", index=False)
    tables, source = curves.recorded_study(folder)
    assert source == folder and set(tables) == set(curves.RECORDED)
    pd.testing.assert_frame_equal(tables["curves_sample"], frame)
    bundled, source = curves.recorded_study(tmp_path / "none")  # no study run here: the one recorded with lopti_lab
    assert source == data_dir() / "hard_lab"
    sampled = bundled["curves_sample"]
    assert set(sampled["model"]) >= {curves.WARM, "+ GRPO", "+ GRPO + AR", "+ GRPO + Lopti", "+ GRPO + AR + Lopti"}
    assert sorted(sampled["seed"].unique()) == [0, 1, 2, 3, 4] and sampled["step"].max() == 60
    assert {"fig3_correct", "grad_share", "token_share"} <= set(bundled["mechanism"].columns)


def test_a_notebook_names_a_table_source_without_this_machines_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shown(data_dir() / "hard_lab") == "lopti_lab data: hard_lab"
    assert shown(data_dir() / "methods" / "comparison_sample.csv") == "lopti_lab data: methods/comparison_sample.csv"
    assert shown(tmp_path / "reports" / "hard_lab") == "reports/hard_lab"
    assert shown("/elsewhere/table.csv") == "/elsewhere/table.csv"
