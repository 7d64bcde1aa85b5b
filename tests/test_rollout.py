"""rollout.py: group layout, padding, EOS masks, and rollout log-probs equal to an independent full forward."""

import pytest
import torch

from lopti_lab.rollout import Rollout, add_logprobs, response_logprobs, sample

PROMPTS = ["<|im_start|>user\nZoey said that Oliver is a knight.<|im_end|>\n<|im_start|>assistant\n<think>", "Hi"]


@pytest.fixture()
def eos_biased(tiny_model, tokenizer):
    """The tiny model with +4 on the EOS logit, so responses end at varied lengths (EOS prob ~ 0.15 per token)."""
    forward = tiny_model.forward
    eos = tokenizer.eos_token_id

    def biased(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits[..., eos] += 4.0
        return out

    tiny_model.forward = biased
    return tiny_model


def _naive_logp(model, rollout: Rollout, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) of each response token from one full forward of [prompt | response]."""
    ids, mask = rollout.input_ids, rollout.attention_mask
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    T = rollout.response_ids.shape[1]
    logp = (logits[:, -T - 1 : -1] / temperature).log_softmax(-1)  # (B, T, V), position L-T-1+t predicts token t
    return logp.gather(-1, rollout.response_ids[..., None]).squeeze(-1) * rollout.response_mask


def test_sample_layout_masks_and_texts(eos_biased, tokenizer):
    torch.manual_seed(0)
    r = sample(eos_biased, tokenizer, PROMPTS, group_size=4, max_new_tokens=24, temperature=0.7)
    B, T = r.response_ids.shape
    assert B == 8 and len(r) == 8 and r.group_size == 4 and len(r.texts) == 8
    # rows of a group share their (left-padded) prompt; the short prompt is padded on the left
    assert torch.equal(r.prompt_ids[0], r.prompt_ids[3]) and not torch.equal(r.prompt_ids[3], r.prompt_ids[4])
    assert r.prompt_mask[4, 0] == 0 and r.prompt_mask[4, -1] == 1 and r.prompt_mask[0].all()
    eos = tokenizer.eos_token_id
    for b in range(B):
        n = int(r.lengths[b])
        assert torch.equal(r.response_mask[b, :n], torch.ones(n)) and not r.response_mask[b, n:].any()
        ended = bool((r.response_ids[b, :n] == eos).any())
        assert bool(r.finished[b]) == ended
        if ended:  # the mask stops right after the FIRST eos, which it includes
            assert r.response_ids[b, n - 1] == eos and not (r.response_ids[b, : n - 1] == eos).any()
            assert r.texts[b] == tokenizer.decode(r.response_ids[b, : n - 1])
        else:
            assert n == T == 24
    assert r.finished.any() and r.lengths.min() < r.lengths.max()  # the bias gives varied lengths
    assert r.old_logp.shape == (B, T) and (r.old_logp * (1 - r.response_mask) == 0).all()
    assert r.entropy.shape == (B, T) and r.ref_logp is None


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_old_logp_equals_a_full_forward_at_the_sampling_temperature(eos_biased, tokenizer, temperature):
    torch.manual_seed(1)
    r = sample(eos_biased, tokenizer, PROMPTS, group_size=3, max_new_tokens=16, temperature=temperature)
    torch.testing.assert_close(r.old_logp, _naive_logp(eos_biased, r, temperature), atol=1e-5, rtol=0)
    assert not r.old_logp.is_inference()  # usable inside the update's autograd graph


def test_response_logprobs_ignores_extra_padding(tiny_model, tokenizer):
    """Cutting shared padding columns must not change anything: add 3 pad columns left and 2 right and compare."""
    torch.manual_seed(2)
    r = sample(tiny_model, tokenizer, PROMPTS, 2, max_new_tokens=8, with_logprobs=False)
    pad = tokenizer.pad_token_id
    wide = Rollout(
        torch.nn.functional.pad(r.prompt_ids, (3, 0), value=pad),
        torch.nn.functional.pad(r.prompt_mask, (3, 0)),
        torch.nn.functional.pad(r.response_ids, (0, 2), value=pad),
        torch.nn.functional.pad(r.response_mask, (0, 2)),
        r.texts,
        2,
        r.finished,
    )
    with torch.no_grad():
        narrow, _ = response_logprobs(tiny_model, r.input_ids, r.attention_mask, r.response_mask)
        padded, _ = response_logprobs(tiny_model, wide.input_ids, wide.attention_mask, wide.response_mask)
    torch.testing.assert_close(padded[:, :-2], narrow, atol=1e-5, rtol=0)
    assert (padded[:, -2:] == 0).all()


def test_generation_config_of_the_checkpoint_is_overridden(tiny_model, tokenizer):
    """Qwen checkpoints ship top_k = 20 and repetition_penalty = 1.05; sampling must not inherit them (top_k = 1
    would make every row identical)."""
    tiny_model.generation_config.top_k = 1
    tiny_model.generation_config.repetition_penalty = 3.0
    torch.manual_seed(3)
    r = sample(tiny_model, tokenizer, ["Hi"], group_size=6, max_new_tokens=6, temperature=1.0)
    assert len(set(r.texts)) > 1


def test_greedy_is_deterministic_and_batching_does_not_change_it(tiny_model, tokenizer):
    a = sample(tiny_model, tokenizer, PROMPTS, 1, max_new_tokens=10, greedy=True)
    b = sample(tiny_model, tokenizer, PROMPTS, 1, max_new_tokens=10, greedy=True, batch_size=1, logprob_batch_size=1)
    assert a.texts == b.texts
    torch.testing.assert_close(a.old_logp, b.old_logp, atol=1e-5, rtol=0)


def test_reference_logprobs_and_select(tiny_model, tokenizer):
    from contextlib import contextmanager

    @contextmanager
    def reference():  # the same model as reference: ref_logp == old_logp
        yield tiny_model

    torch.manual_seed(4)
    r = sample(tiny_model, tokenizer, PROMPTS, 2, max_new_tokens=6, with_logprobs=False)
    add_logprobs(tiny_model, r, temperature=0.9, reference=reference)
    torch.testing.assert_close(r.ref_logp, r.old_logp)
    part = r.select(slice(2, 4))
    assert len(part) == 2 and part.texts == r.texts[2:4] and torch.equal(part.old_logp, r.old_logp[2:4])
    assert r.to("cpu").response_ids.device.type == "cpu"


def test_prompt_length_check(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        sample(tiny_model, tokenizer, PROMPTS, 2, max_new_tokens=2, max_prompt_tokens=3)
