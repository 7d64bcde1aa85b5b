"""The paper's Fig. 3 measured as its code does (probes.update_shift): by hand, against a naive per-token count from
plain float64 copies of the model, and inside training at every step."""

import copy
import itertools
import math
from dataclasses import replace

import pytest
import torch

from lopti_lab.bins import DECILES
from lopti_lab.kk import build_prompt, load_split
from lopti_lab.models import LoraSpec, load_policy, prompt_style_of
from lopti_lab.probes import fig3_metrics, positive_rows, update_logprobs
from lopti_lab.probes.shift import in_float64
from lopti_lab.probes.update_shift import Bf16ByFloat32
from lopti_lab.rollout import response_logprobs, sample
from lopti_lab.train_config import TrainConfig
from lopti_lab.trainer import train


def test_the_docstrings_worked_example_counts_zeros_both_ways():
    """One bin, four A > 0 tokens moving by dlogp = (+1e-9, 0, -1e-9, +2e-9): correct 2/4 (the unmoved one counts as
    not up), correct_moved 2/3 (left out), zero_share 1/4; both precisions alike here."""
    before = torch.full((1, 4), -0.1, dtype=torch.float64)
    after = before + torch.tensor([[1e-9, 0.0, -1e-9, 2e-9]], dtype=torch.float64)
    p_old = torch.full((1, 4), 0.9)
    metrics = fig3_metrics({"float64": before}, {"float64": after}, p_old, torch.ones(1, 4), {"q": (0.0, 0.5, 1.0)})
    assert metrics["fig3/q/n_bin1"] == 4 and metrics["fig3/q/n_bin0"] == 0
    assert metrics["fig3/float64/q/correct_bin1"] == 0.5
    assert metrics["fig3/float64/q/correct_moved_bin1"] == pytest.approx(2 / 3)
    assert metrics["fig3/float64/q/zero_share_bin1"] == 0.25
    assert math.isnan(metrics["fig3/float64/q/correct_bin0"])  # an empty bin is NaN, not 0


def test_only_rows_with_a_positive_advantage_are_measured():
    assert positive_rows(torch.tensor([0.5, -1.0, 0.0, 2.0])).tolist() == [0, 3]


def test_a_row_limit_keeps_positive_rows_evenly_spaced_and_distinct():
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, 0.3, 0.1])  # positive rows 0, 2, 4, 5, 6
    assert positive_rows(advantages, limit=3).tolist() == [0, 4, 6]
    assert positive_rows(advantages, limit=5).tolist() == [0, 2, 4, 5, 6]
    assert positive_rows(advantages, limit=9).tolist() == [0, 2, 4, 5, 6]
    many = positive_rows(torch.ones(64), limit=8).tolist()
    assert len(set(many)) == 8 and many == sorted(many) and many[0] == 0 and many[-1] == 63
    assert max(b - a for a, b in itertools.pairwise(many)) <= 10  # spread over the batch, not its head


@pytest.fixture(scope="module")
def lab_rollout():
    """The bundled lab model and 2 x 2 of its own responses (at most 96 tokens) to 3-person train puzzles."""
    model, tok = load_policy("lab", lora=None)
    torch.manual_seed(0)
    prompts = [build_prompt(p, prompt_style_of("lab"), tok) for p in load_split("train", 3, limit=2)]
    return model.eval(), sample(model, tok, prompts, 2, max_new_tokens=96)


@pytest.mark.parametrize("op", ["linear", "linear_no_bias", "mm", "bmm", "matmul", "addmm"])
def test_bf16_by_float32_is_torchs_bf16_matmul_to_its_last_bit(op):
    """Under bf16 autocast, a matmul of Bf16ByFloat32 is torch's own CPU bf16 one: the same bf16 product on at least
    99.9% of the elements, one bf16 ulp (2^-7 of the value) off on the rest, and far from a float32 product."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((96, 64), (80, 64), (80,)))
    xs, ws = torch.randn(3, 40, 64, generator=gen), torch.randn(3, 64, 48, generator=gen)
    run = {
        "linear": lambda: torch.nn.functional.linear(x, w, b),
        "linear_no_bias": lambda: torch.nn.functional.linear(x, w),
        "mm": lambda: x @ w.T,
        "bmm": lambda: torch.bmm(xs, ws),
        "matmul": lambda: torch.matmul(xs, ws),
        "addmm": lambda: torch.addmm(b, x, w.T),
    }[op]
    exact = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = run()
        with Bf16ByFloat32():
            ours = run()
    assert native.dtype == ours.dtype == torch.bfloat16
    native, ours = native.float(), ours.float()
    assert (native == ours).float().mean() >= 0.999
    assert bool(((native - ours).abs() <= native.abs() * 2**-7 + 1e-30).all())
    assert (ours - exact).abs().max() > 1e-3 * exact.abs().max()  # bf16's rounding, not float32's


def test_bf16_by_float32_forward_of_the_lab_model_is_bf16_as_torchs(lab_rollout):
    """On the bundled lab model, the response log-probs from Bf16ByFloat32 differ from torch's own bf16 autocast
    forward by no more than either differs from a float64 forward (both are bf16 arithmetic; one ulp's difference in
    a hidden state moves later roundings), and both are bf16-far from float64."""
    model, rollout = lab_rollout
    args = (rollout.input_ids, rollout.attention_mask, rollout.response_mask, 1.0)
    mask = rollout.response_mask.bool()
    with in_float64(model), torch.inference_mode():
        exact = response_logprobs(model, *args)[0][mask]
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        native = response_logprobs(model, *args)[0].float()[mask]
        with Bf16ByFloat32():
            ours = response_logprobs(model, *args)[0].float()[mask]
    native_err, our_err = (native - exact).abs().mean(), (ours - exact).abs().mean()
    assert min(native_err, our_err) > 1e-4
    assert (ours - native).abs().mean() <= 2 * max(native_err, our_err)
    assert our_err <= 2 * native_err and native_err <= 2 * our_err
    assert bool((ours != native).any())  # the mode did the matmuls (torch's kernels give the same bits each run)


@pytest.mark.parametrize("chunks", [None, (100, 7)], ids=["default_chunks", "small_chunks"])
def test_update_logprobs_equal_the_whole_model_forwards(lab_rollout, chunks, monkeypatch):
    """update_logprobs streams the head (probes.float64) in both precisions and casts one module at a time to
    float64: its float64 log-probs are the whole-model float64 forward's to 1e-12, its bf16 ones the whole bf16
    autocast forward's to float32 rounding (the logsumexp runs over vocabulary chunks; measured 0 with the lab
    model's vocabulary in one chunk, 2e-6 in chunks of 100), far below bf16's own error (~1e-1 here)."""
    from lopti_lab.probes import float64 as f64

    if chunks is not None:
        monkeypatch.setattr(f64, "VOCAB_CHUNK", chunks[0])
        monkeypatch.setattr(f64, "TOKEN_CHUNK", chunks[1])
    model, rollout = lab_rollout
    args = (rollout.input_ids, rollout.attention_mask, rollout.response_mask, 0.7)
    mask = rollout.response_mask.bool()
    with in_float64(model), torch.inference_mode():
        exact = response_logprobs(model, *args)[0]
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), Bf16ByFloat32():
        bf16 = response_logprobs(model, *args)[0].float()
    out = update_logprobs(model, *args)
    assert out["float64"].dtype == torch.float64 and out["bfloat16"].dtype == torch.float32
    torch.testing.assert_close(out["float64"], exact, rtol=0, atol=1e-12)
    assert (out["bfloat16"] - bf16)[mask].abs().max() <= 1e-5 < (bf16 - exact)[mask].abs().max()
    assert bool((out["bfloat16"][~mask] == 0).all())


def test_fig3_matches_a_per_token_count_from_float64_copies(model_dir):
    """float64: each bin's share of A > 0 tokens whose probability rose, counted token by token from plain full
    forwards of float64 copies of the model before and after an update. The bf16 log-probs are those of a bf16
    forward: off the float64 ones by bf16's rounding, not by float32's."""
    model, tok = load_policy(str(model_dir), LoraSpec(r=4, alpha=8))
    puzzles = load_split("train", 3, limit=3)
    torch.manual_seed(0)
    rollout = sample(model, tok, [build_prompt(p, "base") for p in puzzles], 4, max_new_tokens=6, with_logprobs=True)
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, 0.5, -2.0, 0.0, 1.0, 0.3, -0.5, -0.1])
    rows = positive_rows(advantages)
    ids, attn, mask = rollout.input_ids[rows], rollout.attention_mask[rows], rollout.response_mask[rows]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)

    def probs_of_a_copy():
        with torch.no_grad():
            logits = copy.deepcopy(model).double()(input_ids=ids, attention_mask=attn, position_ids=positions).logits
        return logits.softmax(-1)  # (k, L, V)

    before = update_logprobs(model, ids, attn, mask, 1.0)
    old_probs = probs_of_a_copy()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)  # a small update: some tokens barely move
    after = update_logprobs(model, ids, attn, mask, 1.0)
    new_probs = probs_of_a_copy()
    p_old = rollout.old_logp[rows].exp()
    metrics = fig3_metrics(before, after, p_old, mask)
    T = rollout.response_ids.shape[1]
    counts: dict[int, list[int]] = {}
    for b in range(len(rows)):
        for t in range(T):
            if not mask[b, t]:
                continue
            at, token = ids.shape[1] - T - 1 + t, rollout.response_ids[rows[b], t]
            k = min(int(p_old[b, t].item() * 10), 9)  # the decile of the rollout probability
            n, up = counts.get(k, [0, 0])
            counts[k] = [n + 1, up + (new_probs[b, at, token] > old_probs[b, at, token]).item()]
    assert counts and sum(n for n, _ in counts.values()) == int(mask.sum())
    for k in range(len(DECILES) - 1):
        n, up = counts.get(k, [0, 0])
        assert metrics[f"fig3/d/n_bin{k}"] == n
        if n:
            assert metrics[f"fig3/float64/d/correct_bin{k}"] == pytest.approx(up / n)
            assert metrics[f"fig3/float64/d/zero_share_bin{k}"] == 0.0  # float64 sees every move
    rounding = (before["bfloat16"] - before["float64"])[mask.bool()].abs().max().item()
    assert 1e-4 < rounding < 0.5, rounding  # bf16 (8 bits of mantissa), not float32 (~1e-6)


@pytest.mark.parametrize("method", [{}, {"ar_alpha": 0.3, "lopti_eta": 0.5}])
def test_training_measures_fig3_at_every_step_with_the_real_update(model_dir, tmp_path, method):
    cfg = TrainConfig(
        model=str(model_dir), lora_r=4, lora_alpha=8, prompt_style="base", train_people=(3,), train_limit=8,
        eval_people=(), prompts_per_step=2, group_size=4, minibatch_size=8, max_new_tokens=8, lr=1e-3, steps=2,
        save_every=0, shift_every=1, optimizer="sgd", run_dir=str(tmp_path / "run"), progress=False, **method,
    )  # fmt: skip
    history = train(cfg).history
    for record in history:
        if record["groups/zero_var_share"] == 1.0:
            continue  # every advantage 0: no token to measure
        n = sum(record[f"fig3/q/n_bin{i}"] for i in range(4))
        assert n == sum(record[f"fig3/d/n_bin{i}"] for i in range(10)) > 0
        assert 0 <= record["fig3/float64/q/correct_bin0"] <= 1 or math.isnan(record["fig3/float64/q/correct_bin0"])
        assert record["time/shift"] > 0
    off = train(replace(cfg, shift_every=0, run_dir=str(tmp_path / "off"))).history
    assert not any(k.startswith("fig3/") for r in off for k in r)
    one = train(replace(cfg, shift_rows=1, run_dir=str(tmp_path / "one"))).history  # one rollout's tokens at most
    for a, b in zip(history, one, strict=True):
        if a["groups/zero_var_share"] < 1.0:
            assert 0 < sum(b[f"fig3/q/n_bin{i}"] for i in range(4)) <= b["len/response_max"]
            assert sum(b[f"fig3/q/n_bin{i}"] for i in range(4)) <= sum(a[f"fig3/q/n_bin{i}"] for i in range(4))
    # measuring changes nothing about training (no RNG drawn, weights restored to their dtype)
    for a, b in zip(history, off, strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["loss/policy"] == b["loss/policy"]
