"""The mechanism map's arithmetic: its top-bin correct ratio against a naive hand-made update of a tiny model, its
counts on a hand-built table, and its seed intervals and paired differences against hand-computed values."""

import copy

import pandas as pd
import pytest
import torch
from tiny import frozen_test_batch

from lopti_lab.models import load_policy
from lopti_lab.studies.mechanism_map import KEY, _done, map_table, measure_cell, top_bin_counts, with_reference


@pytest.fixture(scope="module")
def policy(model_dir):
    model, tok = load_policy(str(model_dir), lora=None)
    return model, tok


@pytest.fixture(scope="module")
def batch(policy):
    return frozen_test_batch(*policy, max_new_tokens=8, wins=(0, 4), losses=(1, 5))  # both signs in both groups


def naive_logp64(model, rollout) -> torch.Tensor:
    """(B, T) float64 log-probs of the sampled response tokens: a float64 copy of the model, one plain forward."""
    wide = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits = wide(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits  # (B, L, V)
    t = rollout.response_mask.shape[1]
    logp = logits[:, -t - 1 : -1].log_softmax(-1)  # (B, T, V): position i predicts token i + 1
    return logp.gather(-1, rollout.input_ids[:, -t:, None])[..., 0]  # (B, T)


@pytest.mark.parametrize("method, alpha", [("GRPO", 0.0), ("GRPO+AR", 0.3)])
def test_a_cells_counts_are_those_of_a_hand_made_sgd_step(policy, batch, method, alpha):
    """One SGD step (lr 5: some tokens overshoot and fall) of the token-mean loss -A_hat * ratio at ratio 1 (AR:
    A_hat = (alpha * p_old + 1 - alpha) * A, Eq. 4), its gradient clipped to norm 1 as torch clips, then float64
    forwards before and after: the A > 0 tokens at p above the median probability that rose, fell and did not move
    are the cell's counts, one for one."""
    model, _ = policy
    rollout, mask = batch.rollout, batch.rollout.response_mask
    before = naive_logp64(model, rollout)
    probs = before.exp()[mask.bool()].sort().values  # the tiny random model has no p > 0.75: a bin it fills
    top = float(probs[len(probs) // 2 : len(probs) // 2 + 2].mean())  # between two tokens, far from either
    (got,) = measure_cell(model, batch, "sgd", 5.0, [method], top=top)  # a step long enough to overshoot

    step = copy.deepcopy(model).train()
    params = [p for p in step.parameters() if p.requires_grad]
    logits = step(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits
    t = mask.shape[1]
    logp = logits[:, -t - 1 : -1].log_softmax(-1).gather(-1, rollout.input_ids[:, -t:, None])[..., 0]  # (B, T)
    weight = alpha * rollout.old_logp.exp() + 1 - alpha  # (B, T)
    loss = -(weight * batch.advantages[:, None] * (logp - rollout.old_logp).exp() * mask).sum() / mask.sum()
    grads = torch.autograd.grad(loss, params)
    total = torch.sqrt(sum(g.square().sum() for g in grads))
    scale = min(1.0, 1.0 / (total.item() + 1e-6))
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= 5.0 * scale * g
    move = naive_logp64(step, rollout) - before  # (B, T)
    keep = mask.bool() & (batch.advantages[:, None] > 0) & (before.exp() >= top)
    up, down = int((move[keep] > 0).sum()), int((move[keep] < 0).sum())
    assert up + down > 10 and up > 0 and down > 0, "the case exercises both directions"
    assert (got["n_top"], got["n_up"], got["n_down"], got["n_ties"]) == (int(keep.sum()), up, down, 0)
    assert got["ratio"] == pytest.approx(up / (up + down))
    assert got["grad_norm"] == pytest.approx(total.item(), rel=1e-4)


def test_top_bin_counts_hand_built():
    """Top-bin A > 0 tokens with dlogp (+1e-9, -2e-9, 0, +3e-12); an A < 0 token and a p < 0.75 one are left out."""
    tokens = pd.DataFrame({
        "p_old": [0.9, 0.8, 0.99, 0.75, 0.9, 0.5],
        "advantage": [1.0, 0.5, 2.0, 1.0, -1.0, 1.0],
        "dlogp": [1e-9, -2e-9, 0.0, 3e-12, 1e-9, 1e-9],
    })  # fmt: skip
    got = top_bin_counts(tokens)
    assert (got["n_top"], got["n_up"], got["n_down"], got["n_ties"]) == (4, 2, 1, 1)
    assert got["ratio"] == pytest.approx(2 / 3) and got["ratio_ties_down"] == pytest.approx(0.5)


def rows_of(ratios: dict[str, list[float]]) -> pd.DataFrame:
    cell = {"axis": "lr", "start": "lab", "optimizer": "sgd", "lr": 1e-3, "puzzles": 1}
    return pd.DataFrame([
        {**cell, "seed": k, "method": m, "n_methods": len(ratios), "ratio": r, "n_top": 100, "n_ties": k,
         "solved": 0.5, "top_share": 0.7, "rows": 16}
        for m, values in ratios.items() for k, r in enumerate(values)
    ])  # fmt: skip


def test_map_table_interval_over_seeds_and_paired_difference():
    """GRPO (0.4, 0.5, 0.6): mean 0.5, sd 0.1, t(0.975, 2) = 4.302653 -> 0.5 +- 0.248414; AR (0.45, 0.6, 0.75): mean
    0.6 +- 0.372621, paired differences (0.05, 0.1, 0.15): 0.1 +- 0.124207; one GRPO seed below 0.5."""
    table = map_table(rows_of({"GRPO": [0.4, 0.5, 0.6], "GRPO+AR": [0.45, 0.6, 0.75]})).set_index("method")
    assert table.loc["GRPO", ["mean", "ci95"]].tolist() == pytest.approx([0.5, 0.248414], abs=1e-6)
    assert table.loc["GRPO+AR", ["mean", "ci95"]].tolist() == pytest.approx([0.6, 0.372621], abs=1e-6)
    assert table.loc["GRPO+AR", ["diff_mean", "diff_ci95"]].tolist() == pytest.approx([0.1, 0.124207], abs=1e-6)
    assert pd.isna(table.loc["GRPO", "diff_mean"])
    assert table.loc["GRPO", "below_half"] == 1 and table.loc["GRPO", "n_ties"] == 0 + 1 + 2
    assert table.loc["GRPO", "upper"] == pytest.approx(0.748414, abs=1e-6)


def test_the_reference_point_is_copied_to_each_axis_measured():
    rows = rows_of({"GRPO": [0.4, 0.5]})
    other = rows.assign(axis="start", start="lab-hard")
    both = with_reference(pd.concat([rows, other]), [("sgd", 1e-3)])
    assert sorted(both.groupby(["axis", "start"]).size().items()) == [
        (("lr", "lab"), 2), (("start", "lab"), 2), (("start", "lab-hard"), 2)
    ]  # fmt: skip


def test_a_block_cut_short_is_dropped_on_resume(tmp_path):
    rows = rows_of({"GRPO": [0.4, 0.5], "GRPO+AR": [0.45, 0.6]})
    out = tmp_path / "map.csv"
    rows.drop(index=3).to_csv(out, index=False)  # seed 1's GRPO+AR row never reached the file
    kept = _done(out)
    assert sorted(kept[[*KEY, "seed"]].drop_duplicates()["seed"]) == [0] and len(kept) == 2
    assert len(pd.read_csv(out)) == 2


def test_the_quoted_numbers_come_from_the_bundled_map():
    """docs/_mechanism_map_section.md's headline cells, recomputed from data/mechanism/map.csv."""
    from lopti_lab.paths import data_dir

    rows = pd.read_csv(data_dir() / "mechanism" / "map.csv")
    table = map_table(with_reference(rows, [("sgd", 1e-3), ("adamw", 1e-4), ("adamw", 1e-3)]))
    cell = table.set_index(["axis", "start", "optimizer", "lr", "puzzles", "method"])
    lab = ("lr", "lab", "adamw", 1e-3, 1)
    assert cell.loc[(*lab, "GRPO"), ["mean", "ci95"]].round(3).tolist() == [0.368, 0.018]
    assert cell.loc[(*lab, "GRPO+AR"), ["diff_mean", "diff_ci95"]].round(3).tolist() == [-0.001, 0.010]
    assert cell.loc[(*lab, "GRPO+Lopti"), ["diff_mean", "diff_ci95"]].round(3).tolist() == [-0.042, 0.126]
    assert cell.loc[("width", "w128", "adamw", 1e-4, 1, "GRPO"), ["mean", "ci95"]].round(3).tolist() == [0.315, 0.135]
    assert cell.loc[("lr", "lab", "sgd", 1e-3, 1, "GRPO"), ["mean", "ci95"]].round(3).tolist() == [0.533, 0.129]
