"""`lopti-lab mechanism`: its config, the Fig. 3 table read back from run folders, the frozen-batch measurements
(the first-order argument and the decomposition) on a tiny model, and a quick real run on the lab model."""

import math
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from lopti_lab import runs
from lopti_lab.counterfactual import FrozenBatch
from lopti_lab.kk import build_prompt, load_split
from lopti_lab.models import LoraSpec, load_policy
from lopti_lab.objective import group_advantages
from lopti_lab.paths import lab_model_dir
from lopti_lab.rollout import sample
from lopti_lab.studies import mechanism
from lopti_lab.studies.mechanism import OPTIMIZER_SETTINGS, MechanismConfig


def test_every_run_takes_its_optimizer_setting_and_shares_the_rest(tmp_path):
    config = MechanismConfig(out=str(tmp_path), seeds=2)
    configs = config.run_configs()
    assert len(configs) == 3 * 4 * 2 and len({c.run_dir for c in configs.values()}) == len(configs)
    for (optimizer, method, seed), run in configs.items():
        setting = OPTIMIZER_SETTINGS[optimizer]
        assert (run.optimizer, run.lr, run.adam_eps, run.weight_decay) == tuple(
            setting[k] for k in ("optimizer", "lr", "adam_eps", "weight_decay")
        )
        assert run.method == method and run.seed == seed and run.shift_every == 1
        assert Path(run.run_dir).parent.name == optimizer
    with pytest.raises(ValueError, match=r"MechanismConfig\.train\.lr is set by each optimizer setting"):
        MechanismConfig(out=str(tmp_path), train={"lr": 1e-2})
    with pytest.raises(ValueError, match=r"MechanismConfig\.optimizers"):
        MechanismConfig(out=str(tmp_path), optimizers=("lion",))


def test_fig3_table_averages_every_step_of_every_seed_with_an_interval(tmp_path):
    config = MechanismConfig(out=str(tmp_path), seeds=2, methods=("GRPO",), optimizers=("sgd",))
    values = {0: [0.5, 0.6], 1: [0.7, math.nan]}  # seed -> the top bin's correct ratio at steps 1, 2
    for (_, _, seed), run_dir in config.run_dirs().items():
        folder = runs.RunFolder(run_dir)
        folder.write_config({"note": "test"})
        for step, value in enumerate(values[seed], 1):
            folder.log({"step": step, "fig3/float64/q/correct_bin3": value, "fig3/q/n_bin3": 4.0})
    long = mechanism.fig3_long(config)
    assert len(long) == 4 and set(long["stat"]) == {"correct"}  # the counts (fig3/q/n_bin3) are not ratios
    row = mechanism.fig3_table(long).iloc[0]
    assert (row["bin"], row["n"], row["mean"]) == (3, 3, pytest.approx(0.6))  # NaN (no token) left out
    assert row["ci95"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)


@pytest.fixture(scope="module")
def tiny_batch(model_dir):
    model, tok = load_policy(str(model_dir), LoraSpec(r=4, alpha=8))
    with torch.no_grad():  # a non-trivial adapter, so every token's gradient differs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    puzzles = load_split("train", 3, limit=2)
    torch.manual_seed(0)
    rollout = sample(model, tok, [build_prompt(p, "base") for p in puzzles], 4, max_new_tokens=6, with_logprobs=True)
    rewards = torch.tensor([3.0 if zlib.crc32(t.encode()) % 2 else -1.0 for t in rollout.texts])
    rewards[0], rewards[1] = 3.0, -1.0
    return model, FrozenBatch(puzzles, rollout, rewards, group_advantages(rewards, 4), 1.0)


def test_lopti_departs_from_grpo_at_second_order_in_the_step_size(tiny_batch):
    """Without clipping, Lopti's two SGD stages add up to GRPO's step to first order in lr: their difference,
    relative to GRPO's own move, grows about in proportion to lr (so ten times the lr, about ten times the gap)."""
    model, batch = tiny_batch
    median = float(batch.rollout.old_logp.exp()[batch.rollout.response_mask.bool()].median())  # both stages non-empty
    scan = mechanism.step_size_scan(model, batch, (1e-3, 1e-2, 1e-1), eta=median).set_index("lr")
    slope = np.polyfit(np.log10(scan.index), np.log10(scan["rel_diff"]), 1)[0]
    assert 0.7 < slope < 1.3, scan
    assert (scan["grpo_dlogp_norm"].diff().dropna() > 0).all()


def test_sgd_is_additive_over_bins_and_adamws_first_step_is_not(tiny_batch):
    """SGD: the all-token move is the top bin's plus the other bins' (to first order: small lr); AdamW's first step
    g / (|g| + eps) is not linear in the gradient, so the parts do not add up."""
    model, batch = tiny_batch
    # a random tiny model gives every token p ~ 1 / V: two bins split at the median probability, to have both parts
    probs = batch.rollout.old_logp.exp()[batch.rollout.response_mask.bool()]
    bins = (0.0, float(probs.median()), 1.0)
    parts = mechanism.decomposition(model, batch, ("sgd", "adamw-eps1e-8"), bins).set_index("optimizer")
    assert parts.loc["sgd", "tokens"] > 0
    assert parts.loc["sgd", "additivity"] < 0.05
    assert parts.loc["adamw-eps1e-8", "additivity"] > 0.2


@pytest.mark.slow
@pytest.mark.skipif(not (lab_model_dir() / "config.json").is_file(), reason="needs the bundled lab model")
def test_a_quick_study_on_the_lab_model_writes_every_file(tmp_path):
    config = MechanismConfig(out=str(tmp_path / "m"), quick=True, seeds=1, methods=("GRPO", "GRPO+Lopti"),
                             optimizers=("sgd", "adamw-eps1e-3"), workers=1)  # fmt: skip
    out = mechanism.run_mechanism(config)
    for name in ("fig3.csv", "fig3_steps.csv", "fig1.csv", "step_size.csv", "decomposition.csv", "report.md"):
        assert (out / name).stat().st_size > 0, name
    for name in ("fig3.png", "fig1.png"):
        assert (out / name).stat().st_size > 5_000, name
    assert len(list((out / "runs").glob("*/*"))) == 4
    _, source = mechanism.fig3_source(out)
    assert source == out / "fig3.csv"
