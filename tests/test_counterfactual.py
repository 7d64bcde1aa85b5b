"""The frozen-batch counterfactual against a hand-made update, and the attribution tables."""


import pytest
import torch
from tiny import frozen_test_batch

from lopti_lab.bins import entropy_rank
from lopti_lab.counterfactual import (
    attribution_tables,
    counterfactual,
    method_probes,
)
from lopti_lab.methods import METHODS
from lopti_lab.models import LoraSpec, load_policy
from lopti_lab.rollout import response_logprobs
from lopti_lab.update import OptimizerSpec


@pytest.fixture(scope="module")
def policy(model_dir):
    model, tok = load_policy(str(model_dir), LoraSpec(r=4, alpha=8))
    with torch.no_grad():  # LoRA B starts at zero; give the adapter a non-trivial start
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model, tok


@pytest.fixture(scope="module")
def batch(policy):
    return frozen_test_batch(*policy, max_new_tokens=6)


def test_counterfactual_grpo_equals_one_hand_made_sgd_step(policy, batch):
    model, _ = policy
    before = [p.detach().clone() for p in model.parameters()]
    cf = counterfactual(model, batch, {"GRPO": {}}, lr=0.5, optimizer="sgd")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "weights restored"

    rollout, mask = batch.rollout, batch.rollout.response_mask
    params = [p for p in model.parameters() if p.requires_grad]
    logp, _ = response_logprobs(model, rollout.input_ids, rollout.attention_mask, mask, 1.0)
    # at ratio 1 the clipped loss is -A * ratio, token mean over the batch
    loss = -(batch.advantages[:, None] * (logp - rollout.old_logp).exp() * mask).sum() / mask.sum()
    grads = torch.autograd.grad(loss, params)
    total = torch.sqrt(sum(g.square().sum() for g in grads))
    scale = min(1.0, 1.0 / (total.item() + 1e-6))  # the trainer clips the norm at grad_clip = 1.0, as torch does
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= 0.5 * scale * g
        new_logp, _ = response_logprobs(model, rollout.input_ids, rollout.attention_mask, mask, 1.0)
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    expected = (new_logp.exp() - rollout.old_logp.exp())[mask.bool()]
    got = torch.tensor(cf.tokens.sort_values(["seq", "pos"])["delta_p"].to_numpy(), dtype=expected.dtype)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
    assert cf.updates.set_index("method").loc["GRPO", "optimizer_steps"] == 1


def test_counterfactual_adamw_uses_the_runs_epsilon(policy, batch):
    """Adam's first step moves a parameter by lr * g / (|g| + eps): with base.adam_eps far above every (clipped)
    gradient it is SGD at lr / eps, so the two counterfactuals agree; at torch's default eps it is sign-like."""
    model, _ = policy

    def delta_p(optimizer, lr, eps):
        cf = counterfactual(
            model, batch, {"GRPO": {}}, lr=lr, optimizer=optimizer, adamw=OptimizerSpec(adam_eps=eps)
        )
        return torch.tensor(cf.tokens.sort_values(["seq", "pos"])["delta_p"].to_numpy())

    sgd = delta_p("sgd", 0.5, 1e-8)
    torch.testing.assert_close(delta_p("adamw", 0.5 * 1e5, 1e5), sgd, atol=1e-6, rtol=1e-3)
    assert not torch.allclose(delta_p("adamw", 0.5 * 1e5, 1e-8), sgd, atol=1e-4)


def test_counterfactual_methods_differ_and_lopti_takes_two_steps(policy, batch):
    model, _ = policy
    methods = {**{m.label: m.overrides() for m in METHODS.values()}, "AR(alpha=0)": {"ar_alpha": 0.0}}
    cf = counterfactual(model, batch, methods, lr=0.5, optimizer="sgd")
    steps = cf.updates.set_index("method")["optimizer_steps"]
    assert steps["GRPO"] == steps["GRPO+AR"] == 1 and steps["GRPO+Lopti"] == steps["GRPO+AR+Lopti"] == 2
    dp = {m: t.sort_values(["seq", "pos"])["delta_p"].to_numpy() for m, t in cf.tokens.groupby("method")}
    assert (dp["AR(alpha=0)"] == dp["GRPO"]).all()
    assert not (dp["GRPO+AR"] == dp["GRPO"]).all()
    assert set(cf.bins["sign"]) == {"pos", "neg"} and set(cf.bins["method"]) == set(methods)


def test_counterfactual_rejects_an_unknown_optimizer(policy, batch):
    with pytest.raises(ValueError, match="optimizer"):
        counterfactual(policy[0], batch, optimizer="lion")


def test_attribution_tables_add_up(policy, batch):
    model, _ = policy
    tables = attribution_tables(model, batch)
    for attribution, rows in tables[tables["scope"] == "model"].groupby("attribution"):
        parts = rows[rows["label"] != "all"]
        assert parts["grad_share"].sum() == pytest.approx(1.0, abs=1e-4), attribution
    assert set(tables["attribution"]) == {"loss", "position"}
    assert all(p.grad is None for p in model.parameters())


def test_entropy_rank_is_the_naive_rank():
    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(4, 7, generator=g).round(decimals=1)  # ties on purpose
    mask = (torch.rand(4, 7, generator=g) > 0.3).long()
    ranks = entropy_rank(entropy, mask)
    values = entropy[mask.bool()].tolist()
    for (i, j), r in zip(mask.nonzero().tolist(), ranks[mask.bool()].tolist(), strict=True):
        assert r == pytest.approx(sum(v < entropy[i, j].item() for v in values) / len(values))
    assert (ranks[~mask.bool()] == 0).all()


def test_method_probes_match_the_counterfactual_and_the_entropy_quartiles(policy, batch):
    model, _ = policy
    before = [p.detach().clone() for p in model.parameters()]
    methods = {"GRPO": {}, "GRPO+Lopti": METHODS["GRPO+Lopti"].overrides()}
    table = method_probes(model, batch, methods, lr=0.5, optimizer="sgd")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "weights restored"
    assert set(table["binning"]) == {"probability", "entropy"} and set(table["method"]) == set(methods)
    for (_, binning), rows in table.groupby(["method", "binning"]):
        assert rows["token_share"].sum() == pytest.approx(1.0, abs=1e-6), binning
        whole = rows["grad_share"].sum() + rows["context_grad_share"].iloc[0]  # the prompt's share is the rest
        assert whole == pytest.approx(1.0, abs=1e-4), binning
    # the probability bins' correct ratio is the counterfactual's own
    cf = counterfactual(model, batch, methods, lr=0.5, optimizer="sgd")
    pos = cf.bins[cf.bins["sign"] == "pos"].set_index(["method", "bin"])["correct_ratio"]
    prob = table[table["binning"] == "probability"].set_index(["method", "bin"])["correct_ratio"]
    for key, value in prob.items():
        assert value == pytest.approx(pos[key], nan_ok=True), key
    # entropy bins: each token counted by its naive entropy rank among the batch's response tokens
    mask = batch.rollout.response_mask.bool()
    values = batch.rollout.entropy[mask]
    rank = torch.tensor([(values < v).sum().item() / len(values) for v in values.tolist()])
    naive = torch.bucketize(rank, torch.tensor([0.25, 0.5, 0.75]), right=True)
    got = table[(table["binning"] == "entropy") & (table["method"] == "GRPO")].set_index("bin")["token_share"]
    for k in range(len(got)):
        assert got[k] == pytest.approx((naive == k).float().mean().item()), k
