"""A probed update runs the same forwards as a plain one: the rows and positions without a gradient are skipped
(``update._acting_rows``), which adds only exact zeros to each bin's gradient, while the token shares still count
every token of the minibatch (``GradientProbe.set_tokens(census=...)``)."""

import pytest
import torch
from tiny import lora_update_rollout

from lopti_lab import update
from lopti_lab.models import trainable_state_dict
from lopti_lab.probes import GradientProbe
from lopti_lab.train_config import TrainConfig


def _setup(model_dir):
    """A LoRA policy, an 8-row rollout of 2 prompts x 4 with pi_old from the policy; prompt 1's group has equal
    rewards (advantage 0 on every token) and row 0's last 4 tokens have none: what the plain update skips. The bins
    come from fixed values spread over [0, 1) (``probe_by``), so the token shares depend on which tokens count."""
    model, rollout = lora_update_rollout(model_dir, temperature=1.0)
    gen = torch.Generator().manual_seed(4)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])[:, None].repeat(1, 10)  # (B, T)
    advantages[0, 6:] = 0.0
    probe_by = torch.rand(8, 10, generator=gen)  # (B, T)
    cfg = TrainConfig(model=str(model_dir), lora_r=4, prompt_style="base", prompts_per_step=2, group_size=4,
                      minibatch_size=8, kl_coef=0.0, lr=1e-2, temperature=1.0)  # fmt: skip
    return model, rollout, advantages, probe_by, cfg


def _run(model_dir, monkeypatch, probed: bool, trim: bool):
    model, rollout, advantages, probe_by, cfg = _setup(model_dir)
    if not trim:  # the update before this change: a probe made every row run to its full length
        post_init = update._Pass.__post_init__

        def untrimmed(self):
            post_init(self)
            self.trim = False

        monkeypatch.setattr(update._Pass, "__post_init__", untrimmed)
    seen = []
    real = update.response_logprobs
    monkeypatch.setattr(
        update, "response_logprobs", lambda m, ids, *a, **k: seen.append(len(ids)) or real(m, ids, *a, **k)
    )
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    stages = [("all", rollout.response_mask)]
    if probed:
        with GradientProbe(model) as probe:
            update.update_policy(model, optimizer, rollout, advantages, stages, cfg.update_spec(), probe, probe_by)
        metrics = probe.metrics()
    else:
        metrics = {}
        update.update_policy(model, optimizer, rollout, advantages, stages, cfg.update_spec())
    monkeypatch.undo()
    return metrics, trainable_state_dict(model), seen


def test_a_probed_update_skips_the_rows_without_a_gradient_and_measures_the_same(model_dir, monkeypatch):
    trimmed, weights, rows = _run(model_dir, monkeypatch, probed=True, trim=True)
    full, full_weights, full_rows = _run(model_dir, monkeypatch, probed=True, trim=False)
    _, plain_weights, plain_rows = _run(model_dir, monkeypatch, probed=False, trim=True)
    assert rows == plain_rows == [4] and full_rows == [8], "the probed forward runs the plain update's rows"
    tokens = sorted(k for k in full if k.startswith("tokens/share"))
    assert tokens and {k: trimmed[k] for k in tokens} == {k: full[k] for k in tokens}, "every token counted"
    assert len({round(full[k], 6) for k in tokens}) > 1, "the bins are spread, so a dropped row would show"
    grads = sorted(k for k in full if k.startswith(("grad/share", "grad/norm")))
    assert grads
    for k in grads:  # the skipped positions add exact zeros: the same sums, in another order
        assert trimmed[k] == pytest.approx(full[k], rel=1e-5, abs=1e-9), k
    for name, w in weights.items():
        torch.testing.assert_close(w, full_weights[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(w, plain_weights[name], rtol=1e-5, atol=1e-7)
