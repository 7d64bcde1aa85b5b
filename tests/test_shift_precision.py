"""Fig. 2b's measurement must not confuse "did not move" with "moved the wrong way" (issue: exact Fig. 2b).

A token near p = 1 moves by ~1e-8 in log-probability under one small update. exp() of a float32 log-prob near 0 rounds
such a move away (float32 spacing just below 1 is 6e-8), and the old rule counted a token that did not move as
wrong; and a float32 forward's own rounding (~1e-7 in log p) is larger than the move it should measure. These tests
pin the fixed measurement: direction from the log-prob change, ties counted apart, float64 forwards.
"""

import numpy as np
import pytest
import torch

from lopti_lab.probes import probability_shift
from lopti_lab.probes.shift import float64_logprobs, in_float64
from lopti_lab.rollout import response_logprobs


def test_tiny_moves_near_p_1_count_as_moves_and_ties_count_apart():
    """Float32 log-probs as the trainer stores them, p_old = exp(-3e-5) = 0.99997 for every token:

        token 0: A = +1, log p up by ~1e-8    -> moved up: correct
        token 1: A = +1, log p up by ~2e-8    -> correct
        token 2: A = -1, log p down by ~1e-8  -> moved down: correct
        token 3: A = +1, log p unchanged      -> unmoved: neither right nor wrong

    exp() in float32 cannot resolve these moves: float32 numbers just below 1 are 6e-8 apart, so exp(new) - exp(old)
    is 0 or one rounding step (which step depends on the CPU's exp kernel), never the move itself, and the old
    measurement (delta_p = exp(new) - exp(old) in float32, "did not move" = wrong) counted rounding. Now: 2 of the 2
    that moved, unmoved share 1/3, and the A < 0 cell 1 of 1.
    """
    old = torch.full((1, 4), -3e-5, dtype=torch.float32)
    new = old + torch.tensor([[1e-8, 2e-8, -1e-8, 0.0]], dtype=torch.float32)
    assert (new[0, :3] != old[0, :3]).all(), "the log-probs do differ in float32"
    float32_moves = (new.exp() - old.exp()).abs()
    spacing = 1 - torch.finfo(torch.float32).eps / 2  # the float32 number just below 1, so the spacing there is 6e-8
    assert ((float32_moves == 0) | (float32_moves >= 1 - spacing)).all(), "float32 shows 0 or a whole rounding step"
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    shift = probability_shift(old, new, adv, mask, bins=(0, 0.5, 1))
    table = shift.bins.set_index(["bin", "sign"])
    assert table.loc[(1, "pos"), ["n_tokens", "n_moved"]].tolist() == [3, 2]
    assert table.loc[(1, "pos"), "correct_ratio"] == 1.0
    assert table.loc[(1, "pos"), "unmoved_share"] == pytest.approx(1 / 3)
    assert table.loc[(1, "neg"), "correct_ratio"] == 1.0
    assert shift.tokens["moved"].tolist() == [True, True, True, False]
    # delta_p = p_old * expm1(dlogp) in float64: the move itself, not a rounding of it
    dlogp = (new.double() - old.double())[0].numpy()
    np.testing.assert_allclose(shift.delta_p[0].numpy(), np.exp(old.double()[0].numpy()) * np.expm1(dlogp), rtol=1e-12)
    assert (shift.delta_p[0, :3] != 0).all()


def test_in_float64_restores_every_weight_and_dtype_bit_for_bit(tiny_model):
    before = {k: (v.clone(), v.dtype) for k, v in tiny_model.state_dict().items()}
    params = list(tiny_model.parameters())
    with in_float64(tiny_model):
        assert all(p.dtype == torch.float64 for p in tiny_model.parameters())
    assert [id(p) for p in tiny_model.parameters()] == [id(p) for p in params], "the same Parameter objects"
    for k, v in tiny_model.state_dict().items():
        assert v.dtype == before[k][1] and torch.equal(v, before[k][0]), k


def _moves(model, ids, attn, resp, step, measure):
    """log-prob moves of the response tokens when ``step`` is added to the weights (restored afterwards)."""
    params = list(model.parameters())
    saved = [p.detach().clone() for p in params]
    before = measure()
    with torch.no_grad():
        for p, d in zip(params, step):
            p.add_(d)
    after = measure()
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    return (after.double() - before.double()).flatten()


def test_float64_forwards_measure_a_small_step_that_float32_forwards_cannot(tiny_model, tokenizer):
    """A weight step d so small that the response log-probs move by ~1e-8 to 1e-7 (one small update, on tokens near
    p = 1).
    The truth for each token's direction is the same step scaled up 1000x (moves ~1e-5, which even float32 forwards
    resolve; first order dominates there, so the move scales linearly). float64_logprobs before and after the small
    step agrees with that direction on every token and with its size to 2%; float32 forwards, whose own rounding
    (~1e-7) exceeds the move, get many directions wrong."""
    torch.manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (4, 14))
    attn, resp = torch.ones_like(ids), torch.ones(4, 8)
    torch.manual_seed(1)
    direction = [torch.randn_like(p) for p in tiny_model.parameters()]

    def f32():
        with torch.no_grad():
            return response_logprobs(tiny_model, ids, attn, resp)[0]

    def f64():
        return float64_logprobs(tiny_model, ids, attn, resp)

    # the step the float32 weights can actually take (p + d rounds), and 1000 times it
    small = [(p.detach() + 1e-8 * d) - p.detach() for p, d in zip(tiny_model.parameters(), direction)]
    large = [1000 * d for d in small]
    truth = _moves(tiny_model, ids, attn, resp, large, f32) / 1000
    moves64 = _moves(tiny_model, ids, attn, resp, small, f64)
    moves32 = _moves(tiny_model, ids, attn, resp, small, f32)
    assert truth.abs().min() > 1e-11
    assert (torch.sign(moves64) == torch.sign(truth)).all()
    # and its size: first order, so 1000x the step moves 1000x as far (measured in float64 too)
    torch.testing.assert_close(moves64, _moves(tiny_model, ids, attn, resp, large, f64) / 1000, rtol=2e-2, atol=0)
    agree32 = (torch.sign(moves32) == torch.sign(truth)).float().mean().item()
    assert agree32 < 0.9, f"float32 forwards should not resolve moves this small (agreement {agree32:.2f})"


def test_float64_logprobs_by_length_chunks_equal_one_row_at_a_time():
    """Without batch_size the rows go by response length in chunks of _LENGTH_CHUNK (each cutting its own padding)
    and come back in the batch's order: the same log-probs as forwarding each row alone, to float64 rounding, on the
    bundled lab model with 20 responses of different lengths (more than two chunks)."""
    from lopti_lab.models import load_policy
    from lopti_lab.probes import shift as shift_module

    model, tok = load_policy("lab", lora=None)
    lengths = [3, 17, 9, 30, 1, 22, 5, 12, 26, 8, 14, 2, 19, 11, 28, 6, 24, 4, 16, 10]
    assert len(lengths) > 2 * shift_module._LENGTH_CHUNK
    gen = torch.Generator().manual_seed(0)
    B, P, T = len(lengths), 6, max(lengths)
    ids = torch.randint(3, len(tok), (B, P + T), generator=gen)
    attn = torch.ones(B, P + T, dtype=torch.long)
    attn[::3, :2] = 0  # some prompts left-padded
    resp = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) right-padded responses
    attn[:, P:] = resp.long()
    chunked = float64_logprobs(model, ids, attn, resp)
    alone = float64_logprobs(model, ids, attn, resp, batch_size=1)
    assert chunked.dtype == torch.float64 and bool((chunked[resp] != 0).all())
    torch.testing.assert_close(chunked, alone, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# The float64 forward one module at a time (probes.float64): today's whole-model float64 numbers, in bounded memory


def _ragged_batch(vocab: int, lengths: list[int], prompt: int = 6):
    """Rows of random tokens: some prompts left-padded, rows 0 and 1 one prompt (a group: the lean path shares it),
    responses right-padded to the longest."""
    gen = torch.Generator().manual_seed(0)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (B, prompt + T), generator=gen)
    attn = torch.ones(B, prompt + T, dtype=torch.long)
    attn[::3, :2] = 0
    ids[1, :prompt], attn[1, :prompt] = ids[0, :prompt], attn[0, :prompt]
    resp = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    attn[:, prompt:] = resp.long()
    return ids, attn, resp


def _lora_policy(model_dir, lm_head: bool = False):
    """The tiny policy with a LoRA adapter whose B matrices are not zero (so the adapters change every output)."""
    from lopti_lab.models import DEFAULT_LORA_TARGETS, LoraSpec, load_policy

    targets = (*DEFAULT_LORA_TARGETS, "lm_head") if lm_head else DEFAULT_LORA_TARGETS
    model, tok = load_policy(str(model_dir), LoraSpec(r=4, alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model, tok


@pytest.fixture(scope="module")
def lab_model():
    from lopti_lab.models import load_policy

    return load_policy("lab", lora=None)


@pytest.mark.parametrize("chunks", [None, (100, 7)], ids=["default_chunks", "small_chunks"])
@pytest.mark.parametrize("path", ["lean", "hf", "positions"])
@pytest.mark.parametrize("which", ["lab", "tiny_lora"])
def test_layerwise_float64_equals_the_whole_model_in_float64(which, path, chunks, lab_model, model_dir, monkeypatch):
    """float64_response_logprobs against today's forward of the whole model cast to float64 (in_float64 around
    rollout.response_logprobs, or the model's own forward given position ids), on the bundled lab model and on a tiny
    LoRA policy: equal to 1e-12 (measured: bit for bit when the vocabulary is one chunk, 1e-14 when the head runs in
    chunks of 100 logits of 7 tokens, a running logsumexp over 11 chunks of the lab model's 1024)."""
    from lopti_lab.probes import float64 as f64
    from lopti_lab.probes._common import _default_position_ids, _response_logp

    if chunks is not None:
        monkeypatch.setattr(f64, "VOCAB_CHUNK", chunks[0])
        monkeypatch.setattr(f64, "TOKEN_CHUNK", chunks[1])
    model, tok = lab_model if which == "lab" else _lora_policy(model_dir)
    assert f64.stream_unsupported(model) is None
    ids, attn, resp = _ragged_batch(len(tok), [3, 17, 9, 30, 1, 22, 5])
    positions = _default_position_ids(attn) if path == "positions" else None
    fast_path = "hf" if path == "hf" else "auto"
    with in_float64(model), torch.inference_mode():
        if positions is None:
            today = response_logprobs(model, ids, attn, resp, 0.7, fast_path=fast_path)[0]
        else:
            today = _response_logp(model, ids, attn, resp.shape[1], positions, 0.7) * resp
    new = f64.float64_response_logprobs(model, ids, attn, resp, 0.7, fast_path, position_ids=positions)
    assert new.dtype == torch.float64 and bool((new[resp] != 0).all()) and bool((new[~resp] == 0).all())
    torch.testing.assert_close(new, today, rtol=0, atol=1e-12)


@pytest.mark.parametrize("which", ["bare", "lora"])
def test_at_most_one_module_is_in_float64_at_a_time(which, tiny_model, model_dir, tokenizer):
    """The memory bound itself: at every module's return inside the forward, the float64 parameters of the model are
    those of one cast unit at most (a Linear with its LoRA adapters, or a norm), never the whole model; the
    embedding/lm_head matrix is never cast. Afterwards every parameter is the same tensor on the same storage, bits
    and dtype unchanged (an optimizer holding them sees nothing)."""
    from lopti_lab.probes.float64 import _cast_units, float64_response_logprobs

    model = tiny_model if which == "bare" else _lora_policy(model_dir)[0]
    params = list(model.parameters())
    before = [(p.data_ptr(), p.dtype, p.detach().clone()) for p in params]
    base = model.get_base_model() if which == "lora" else model
    units = _cast_units(model, (base.get_input_embeddings(), base.get_output_embeddings()))
    largest = max(sum(p.numel() for p in unit.parameters()) for unit in units)
    seen = []

    def count(module, args, out):
        seen.append(sum(p.numel() for p in params if p.dtype == torch.float64))

    hook = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        ids, attn, resp = _ragged_batch(len(tokenizer), [4, 9, 2])
        float64_response_logprobs(model, ids, attn, resp)
    finally:
        hook.remove()
    assert 0 < max(seen) <= largest < sum(p.numel() for p in params) / 10
    for p, (ptr, dtype, value) in zip(params, before, strict=True):
        assert p.data_ptr() == ptr and p.dtype == dtype and torch.equal(p, value)


def test_a_failing_forward_leaves_every_weight_as_it_was(tiny_model, tokenizer):
    """A unit whose forward raises (its weights in float64 at that moment), or whose own earlier pre-hook raises,
    inside layerwise_float64: every weight gets its original storage and dtype back."""
    from lopti_lab.probes.float64 import float64_response_logprobs

    params = list(tiny_model.parameters())
    before = [(p.data_ptr(), p.dtype) for p in params]
    down = tiny_model.model.layers[1].mlp.down_proj

    def boom(*args):
        assert down.weight.dtype == torch.float64  # the unit is cast when its forward runs
        raise RuntimeError("boom")

    ids, attn, resp = _ragged_batch(len(tokenizer), [4, 9])
    down.forward = boom
    with pytest.raises(RuntimeError, match="boom"):
        float64_response_logprobs(tiny_model, ids, attn, resp, fast_path="hf")
    del down.forward
    assert [(p.data_ptr(), p.dtype) for p in params] == before
    hook = down.register_forward_pre_hook(boom)  # before layerwise_float64's own: raises with nothing cast
    with pytest.raises(AssertionError):
        float64_response_logprobs(tiny_model, ids, attn, resp, fast_path="hf")
    hook.remove()
    assert [(p.data_ptr(), p.dtype) for p in params] == before
    assert not any("forward" in vars(m) for m in tiny_model.modules())  # norms and head have their own forward back


def test_a_model_it_cannot_stream_falls_back_to_the_whole_model_in_float64(model_dir):
    """LoRA on the lm_head wraps it (it is no plain Linear to stream): stream_unsupported names why, and the
    measurement is in_float64's, exactly."""
    from lopti_lab.probes.float64 import float64_response_logprobs, stream_unsupported

    model, tok = _lora_policy(model_dir, lm_head=True)
    assert "lm_head" in stream_unsupported(model)
    ids, attn, resp = _ragged_batch(len(tok), [5, 12, 3])
    with in_float64(model), torch.inference_mode():
        today = response_logprobs(model, ids, attn, resp)[0]
    assert torch.equal(float64_response_logprobs(model, ids, attn, resp), today)
