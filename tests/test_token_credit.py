"""The token-level methods after the paper (lopti_lab.token_credit): each against the reference implementation's
own code on the same random tensors (TRL's from the installed package; verl's read from its wheel, since verl itself
cannot be installed beside transformers 5), and by hand."""

from __future__ import annotations

import ast
import math
import types
import zipfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch

from lopti_lab.token_credit import (
    cispo_loss,
    clip_cov_loss,
    covariance,
    entropy_advantage,
    forking_mask,
    kl_cov_loss,
)

VERL_VERSION = "0.9.1"


def random_batch(seed: int, B: int = 6, T: int = 15):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen) * 3  # log-probs of tokens between p = 0.05 and 1
    logp = (old + 0.4 * torch.randn(B, T, generator=gen)).requires_grad_()
    adv = torch.randn(B, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.2).float()
    entropy = torch.rand(B, T, generator=gen) * 3
    return logp, old, adv, mask, entropy


# --- TRL -----------------------------------------------------------------------------------------------------------


class OneProcess:
    """The accelerator TRL's functions see, on one process: gathering and padding across processes are identities."""

    num_processes = 1
    sync_gradients = True

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def pad_across_processes(self, t, dim=0, pad_index=0):
        return t

    def reduce(self, t, reduction="sum"):
        return t


def trl_entropy_mask(entropy, mask, rho):
    from trl import GRPOTrainer

    return GRPOTrainer.get_high_entropy_mask(NS(accelerator=OneProcess()), entropy, mask, 1 - rho)


def trl_loss(logp, old, adv, mask, entropy, *, loss_type, eps_high, rho=1.0):
    """TRL's own GRPOTrainer._compute_loss on given log-probs (no model: its per-token forward returns them)."""
    from trl import GRPOTrainer

    trainer = types.SimpleNamespace(
        accelerator=OneProcess(), loss_type=loss_type, top_entropy_quantile=rho, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, epsilon_low=0.2, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=NS(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        max_completion_length=mask.shape[1], args=NS(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
    )  # fmt: skip
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, entropy, None)
    trainer.get_high_entropy_mask = lambda e, m, t: GRPOTrainer.get_high_entropy_mask(trainer, e, m, t)
    B, T = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(), "advantages": adv,
        "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho", [0.2, 0.5, 1.0])
def test_forking_mask_is_trls_top_entropy_quantile(seed, rho):
    _, _, _, mask, entropy = random_batch(seed)
    ours = forking_mask(entropy, mask, rho)
    assert torch.equal(ours, trl_entropy_mask(entropy, mask, rho))
    assert abs(ours.sum().item() - rho * mask.sum().item()) <= 1  # a share rho of the tokens


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho", [0.2, 1.0])
def test_cispo_is_trls_loss_type_cispo_with_its_forking_mask(seed, rho):
    """The loss and its gradient, worst absolute difference over the random batches well below float32 rounding."""
    logp, old, adv, mask, entropy = random_batch(seed)
    theirs = trl_loss(logp, old, adv, mask, entropy, loss_type="cispo", eps_high=5.0, rho=rho)
    (their_grad,) = torch.autograd.grad(theirs, logp)
    keep = forking_mask(entropy, mask, rho) if rho < 1 else mask.bool()
    ours, _ = cispo_loss(logp, old, adv, keep.float(), eps_max=5.0, denom=mask.sum())
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (our_grad - their_grad).abs().max().item() < 1e-7


def test_cispo_by_hand_keeps_the_gradient_where_ppo_clips_it():
    """The docstring's case: pi_old 0.1, pi 0.8, A = 1, eps_max 5: loss -5 log 0.8, gradient -5 in log pi."""
    logp = torch.tensor([[math.log(0.8)]], requires_grad=True)
    loss, stats = cispo_loss(logp, torch.tensor([[math.log(0.1)]]), torch.tensor([1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-5 * math.log(0.8)) and stats["capped_frac"].item() == 1.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.item() == pytest.approx(-5.0)


def test_forking_mask_by_hand():
    mask = forking_mask(torch.tensor([[0.1, 0.9, 0.5, 0.7]]), torch.tensor([[1, 1, 1, 0]]), 0.5)
    assert mask.tolist() == [[False, True, True, False]]


# --- verl ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl():
    """verl's own compute_policy_loss_clip_cov / compute_policy_loss_kl_cov and agg_loss, read from its wheel (set-up
    downloads it: scripts/setup.sh) and run as written, with the few names they use from the rest of verl (its
    masked_sum / masked_mean, read from the same wheel; its config classes, which they only type-check)."""
    wheels = sorted((Path(__file__).resolve().parents[1] / ".venv" / "reference").glob(f"verl-{VERL_VERSION}-*.whl"))
    if not wheels:
        pytest.skip(f"verl {VERL_VERSION}'s wheel is not in .venv/reference (scripts/setup.sh downloads it)")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        core = wheel.read("verl/trainer/ppo/core_algos.py").decode()
        functional = wheel.read("verl/utils/torch_functional.py").decode()

    def functions(source: str, names: set[str]) -> ast.Module:
        nodes = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name in names]
        for node in nodes:
            node.decorator_list = []  # verl's registry decorators
        assert {n.name for n in nodes} == names, "verl's code changed: these functions moved"
        return ast.Module(body=nodes, type_ignores=[])

    helpers: dict[str, Any] = {"torch": torch}
    exec(compile(functions(functional, {"masked_sum", "masked_mean"}), "verl/utils/torch_functional.py", "exec"),
         helpers)  # fmt: skip
    names = {"torch": torch, "verl_F": NS(masked_sum=helpers["masked_sum"], masked_mean=helpers["masked_mean"]),
             "AlgoConfig": type("AlgoConfig", (), {}), "ActorConfig": object, "DictConfig": object, "Any": Any,
             "Optional": __import__("typing").Optional}  # fmt: skip
    wanted = {"agg_loss", "compute_policy_loss_clip_cov", "compute_policy_loss_kl_cov"}
    exec(compile(functions(core, wanted), "verl/trainer/ppo/core_algos.py", "exec"), names)
    return names


def verl_config(**policy_loss):
    return NS(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, global_batch_info={},
              policy_loss=NS(**{"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 2e-4,
                                "ppo_kl_coef": 1.0, **policy_loss}))  # fmt: skip


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("share", [2e-4, 0.1])
def test_clip_cov_is_verls_own(verl, seed, share):
    """Same tensors, same random draw (both take it from torch's global generator): the same loss and gradient, and
    the same tokens dropped. The band is set to where this batch's covariances lie, so that tokens are dropped."""
    logp, old, adv, mask, _ = random_batch(seed)
    cov = covariance(logp, adv, mask)[mask.bool()]
    low, high = cov.quantile(0.3).item(), cov.max().item() + 1
    adv_t = adv[:, None].expand_as(logp)
    torch.manual_seed(seed)
    theirs, _ = verl["compute_policy_loss_clip_cov"](
        old, logp, adv_t, mask, "token-mean", verl_config(clip_cov_ratio=share, clip_cov_lb=low, clip_cov_ub=high)
    )
    (their_grad,) = torch.autograd.grad(theirs, logp)
    torch.manual_seed(seed)
    ours, stats = clip_cov_loss(logp, old, adv, mask, share=share, cov_low=low, cov_high=high)
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert abs(ours.item() - theirs.item()) < 1e-6 and (our_grad - their_grad).abs().max().item() < 1e-7
    assert stats["dropped"].sum() == max(1, int(share * mask.sum()))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("share", [2e-4, 0.1])
def test_kl_cov_is_verls_own(verl, seed, share):
    logp, old, adv, mask, _ = random_batch(seed)
    adv_t = adv[:, None].expand_as(logp)
    theirs, _ = verl["compute_policy_loss_kl_cov"](
        old, logp, adv_t, mask, "token-mean", verl_config(kl_cov_ratio=share, ppo_kl_coef=0.5)
    )
    (their_grad,) = torch.autograd.grad(theirs, logp)
    ours, stats = kl_cov_loss(logp, old, adv, mask, share=share, kl_coef=0.5)
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert abs(ours.item() - theirs.item()) < 1e-6 and (our_grad - their_grad).abs().max().item() < 1e-7
    assert stats["penalised"].sum() == max(1, int(share * mask.sum()))


def test_covariance_and_clip_cov_by_hand():
    """The docstrings' cases: cov = [1, 1] for A = [1, -1], log pi = [-0.1, -2.1]; Clip-Cov with both tokens in the
    band and share 0.5 drops one of them."""
    cov = covariance(torch.tensor([[-0.1, -2.1]]), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    torch.testing.assert_close(cov, torch.tensor([[1.0, 1.0]]))
    logp = torch.tensor([[-0.1, -3.1]], requires_grad=True)
    loss, stats = clip_cov_loss(logp, logp.detach(), torch.tensor([[2.0, -2.0]]), torch.ones(1, 2), share=0.5)
    assert stats["dropped"].sum() == 1
    kept = 1 - stats["dropped"]
    assert loss.item() == pytest.approx((-torch.tensor([[2.0, -2.0]]) * kept).sum().item() / 2)


def test_entropy_advantage_by_hand_never_flips_a_sign():
    shaped = entropy_advantage(torch.tensor([1.0, -1.0]), torch.tensor([[2.0], [0.1]]), torch.ones(2, 1))
    torch.testing.assert_close(shaped, torch.tensor([[1.5], [-0.96]]))
    adv = torch.randn(64)
    big = entropy_advantage(adv, torch.full((64, 3), 100.0), torch.ones(64, 3), alpha=1.0, kappa=1.5)
    assert (torch.sign(big[:, 0]) == torch.sign(adv)).all()  # the bonus is capped at |A| / kappa
    with pytest.raises(ValueError, match="kappa"):
        entropy_advantage(adv, torch.ones(64, 1), torch.ones(64, 1), kappa=1.0)
