"""The notebooks' 'what we see' paragraphs say what their tables hold: hand-built tables, hand-read numbers."""

import pandas as pd

from lopti_lab import readouts


def test_wedge_counts_the_tokens_inside_and_compares_rare_with_confident():
    # N = 10: bounds at p = 0.1 are [0.949, 1.273]; at p = 0.9 [0.105, 0.141]. The third token (norm 2) is outside.
    tokens = pd.DataFrame({"prob": [0.1, 0.9, 0.1], "grad_norm": [1.0, 0.12, 2.0]})
    text = readouts.wedge(tokens, 10)
    assert "2 of 3 tokens lie inside the wedge" in text
    assert "mean gradient norm of 1.50" in text and "0.120, 12 times less" in text  # (1 + 2) / 2 against 0.12
    assert text._repr_markdown_() == str(text)


def _shift(top: dict[str, float]) -> pd.DataFrame:
    """A shift table with two bins: the low bin's correct ratio 0.6 for every method, the top bin's from ``top``."""
    rows = []
    for method, ratio in top.items():
        for b, r in ((0, 0.6), (3, ratio)):
            rows.append({"method": method, "bin": b, "label": str(b), "sign": "pos", "n_tokens": 10, "n_moved": 10,
                         "correct_ratio": r})  # fmt: skip
    return pd.DataFrame(rows)


def test_correct_ratios_say_when_the_methods_agree_and_why_under_sgd():
    same = readouts.correct_ratios(_shift({"GRPO": 0.7, "GRPO+Lopti": 0.71}), optimizer="sgd")
    assert "0.700 (GRPO), 0.710 (GRPO+Lopti)" in same
    assert "within 0.010 of each other" in same and "first order" in same
    assert "The paper's GRPO falls below 0.5 in the top bin; here it stays at 0.70." in same
    apart = readouts.correct_ratios(_shift({"GRPO": 0.4, "GRPO+AR": 0.6}), optimizer="sgd")
    assert "first order" not in apart and "stays at" not in apart


def test_fig1_compares_each_single_bin_update_with_the_full_one():
    rows = []
    for update, move in (("all", 0.02), ("bin0", 0.01), ("bin3", 0.001)):
        for b in (0, 3):
            rows.append({"update": update, "bin": b, "label": str(b), "advantage": 1.0, "delta_p": move})
    grads = pd.DataFrame({"update": ["bin0", "bin3", "all"], "grad_norm": [2.0, 0.1, 2.1]})
    text = readouts.fig1(pd.DataFrame(rows), grads)
    assert "holds 50% of the response tokens and the highest 50%" in text
    assert "norm 2, the highest bin's 0.1, all tokens together 2.1" in text
    assert "2.00e-02" in text and "1.00e-02 (50% of that, e)" in text and "1.00e-03 (5%, f)" in text
    assert "on this batch it does not" not in text  # the lowest bin moves them more than their own update


def test_training_run_keeps_the_training_batch_apart_from_the_test_set():
    tests = {"eval/sample/acc_all": [None, 0.4, 0.5], "eval/greedy/acc_all": [None, None, 0.9]}
    frame = pd.DataFrame({"step": [1, 2, 3], "reward/mean": [-1.0, 0.0, 1.5], "acc/all": [0.1, 0.3, 0.6], **tests})
    text = readouts.training_run(frame)
    assert "from -1.00 to 1.50" in text and "training batch's accuracy" in text and "from 0.10 to 0.60" in text
    assert "sampled at the rollout temperature: 0.40 at step 2, 0.50 at step 3" in text
    assert "greedy: 0.90 at step 3" in text


def test_final_accuracy_reads_one_seed_against_the_recorded_spread():
    table = pd.DataFrame({"run": ["a", "b"], "method": ["GRPO", "GRPO+AR"], "avg": [0.8, 0.9]}).set_index(
        ["run", "method"]
    )
    intervals = pd.DataFrame({"model": ["+ GRPO + AR", "y"], "mean": [-0.01, 0.0], "ci95": [0.139, 0.38], "n": [3, 3]})
    text = readouts.final_accuracy(table, intervals)
    assert "one run (one seed)" in text and "3 seeds" in text
    assert "GRPO+AR +0.100 (-0.010 ± 0.139)" in text and "1 of these 1 one-seed gaps are smaller" in text


def test_correct_ratio_over_runs_says_when_the_fixes_do_not_hold_the_top_bin_up():
    rows = [("r1", "GRPO", 0.48), ("r2", "GRPO+Lopti", 0.49)]
    long = pd.DataFrame(
        [(run, method, 5, f"shift/{what}_pos_bin{b}", value if what == "correct" else 10.0)
         for run, method, value in rows for b in (0, 3) for what in ("correct", "n")],
        columns=["run", "method", "step", "metric", "value"],
    )  # fmt: skip
    text = readouts.correct_ratio_runs(long)
    assert "0.48 (GRPO), 0.49 (GRPO+Lopti)" in text and "within 0.01 of each other" in text
    assert "stays at" not in text  # GRPO is below 0.5, as in the paper


def _map_cell(start, optimizer, lr, method, mean, diff=(float("nan"), float("nan")), solved=0.5, puzzles=1):
    return {"axis": "lr", "start": start, "optimizer": optimizer, "lr": lr, "puzzles": puzzles, "method": method,
            "n_seeds": 4, "mean": mean, "ci95": 0.05, "solved": solved,
            "diff_mean": diff[0], "diff_ci95": diff[1]}  # fmt: skip


def test_mechanism_map_names_the_cells_below_one_half_and_which_side_the_fixes_fall():
    rows = [
        _map_cell("lab", "sgd", 1e-3, "GRPO", 0.53),
        _map_cell("lab", "sgd", 1e-2, "GRPO", 0.55),
        _map_cell("lab", "adamw", 1e-4, "GRPO", 0.51),
        _map_cell("lab", "adamw", 1e-3, "GRPO", 0.37),
        _map_cell("lab", "adamw", 1e-3, "GRPO+AR", 0.40, diff=(0.03, 0.01)),  # above zero
        _map_cell("lab", "adamw", 1e-3, "GRPO+Lopti", 0.36, diff=(-0.01, 0.02)),  # level
        _map_cell("w128", "sgd", 1e-3, "GRPO", 0.30, solved=0.0),
        _map_cell("w128", "sgd", 1e-3, "GRPO+AR", 0.28, diff=(-0.02, 0.01), solved=0.0),  # below zero
        _map_cell("w128", "sgd", 1e-3, "GRPO+Lopti", 0.30, diff=(0.0, 0.0), solved=0.0),  # level
    ]
    table = pd.DataFrame(rows)
    # the lab model's adamw 1e-3 cell listed again on another axis is counted once
    table = pd.concat([table, table.iloc[[3, 4, 5]].assign(axis="batch")], ignore_index=True)
    text = readouts.mechanism_map(table)
    assert "under sgd, GRPO's top-bin ratio stays at 0.53-0.55 at lr 0.001, 0.01." in text
    assert "under adamw, GRPO's top-bin ratio stays at 0.51-0.51 at lr 0.0001." in text
    assert "below one half in 2 of 5 cells" in text
    assert "1 from starts that solve some of their puzzles, adamw at lr 0.001 (0.37-0.37)" in text
    assert "1 from starts that solve none (w128), sgd at lr 0.001 (0.30-0.30)" in text
    assert "GRPO+AR's is above zero in 1, below in 1, level in 0 (of 2)" in text
    assert "GRPO+Lopti's is above zero in 0, below in 0, level in 2 (of 2)" in text
    held = readouts.mechanism_map(pd.DataFrame(rows[:3]))
    assert "stays at or above one half in every cell" in held
