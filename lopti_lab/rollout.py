"""Prompts in, groups of sampled completions out: token ids, masks, texts and the rollout log-probabilities.

    rollout = sample(model, tokenizer, prompts, group_size=8, max_new_tokens=512, temperature=0.7)
    rollout.old_logp          # (B, T) log pi_old of each sampled token at the sampling temperature, detached

Layout of one row (the contract the trainer and the probes share): ``input_ids = [prompt | response]`` of length
L = P + T, the prompt left-padded to P, the response right-padded to T, so the response is always the LAST T
positions and the logits at input position L - T - 1 + t predict response token t.

Shape legend: B rows = prompts x G (a prompt's G completions are contiguous), P prompt tokens, T response tokens,
V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from lopti_lab.objective import token_logprobs

__all__ = ["Rollout", "add_logprobs", "response_logprobs", "sample", "stop_token_ids"]


@dataclass
class Rollout:
    """One batch of sampled completions; tensors share the row order (B = prompts x group_size)."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) right-padded
    response_mask: torch.Tensor  # (B, T) float, 1 up to and including the stop token
    texts: list[str]  # (B,) decoded responses, stop token left out
    group_size: int
    finished: torch.Tensor  # (B,) bool, True when the response ended with a stop token (False: cut at the cap)
    old_logp: torch.Tensor | None = None  # (B, T) rollout log-probs at the sampling temperature, 0 on padding
    entropy: torch.Tensor | None = None  # (B, T) rollout policy entropy at each position
    ref_logp: torch.Tensor | None = None  # (B, T) reference policy log-probs (KL term), when asked for

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)  # (B, P + T)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], dim=1)  # (B, P + T)

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(1)  # (B,)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def to(self, device: torch.device | str) -> Rollout:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})

    def select(self, rows: slice) -> Rollout:
        """The rows ``rows`` (a minibatch); group_size is kept as is, so slice on group boundaries."""
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v[rows] for k, v in picked.items() if isinstance(v, (torch.Tensor, list))})


def stop_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (Qwen stops at <|im_end|> or <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return sorted(i for i in ids if i is not None)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    before_forward: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response token t | prefix) for the last T positions of each row, in one forward pass.

    Shared by the rollout (no grad) and the update (with grad), so old and new log-probs come from identical
    arithmetic and the first update's ratio is exactly 1. Padding columns that every row of this batch has (left of
    the prompts, right of the longest response) are cut before the forward, and the lm_head runs on the last
    t + 1 positions only (``logits_to_keep``), never on the prompt. ``before_forward(t)`` is called with the kept
    response length t: the forward's rows are then [prompt | first t response columns] (a gradient probe's
    ``set_tokens`` goes there).

    input_ids, attention_mask: (B, P + T); response_mask: (B, T). Returns logp (B, T) and entropy (B, T) or None,
    zero on padding.
    """
    total_t = response_mask.shape[1]
    n_prompt = input_ids.shape[1] - total_t
    start = int(attention_mask[:, :n_prompt].any(0).int().argmax())  # first column some prompt uses
    used = response_mask.any(0).nonzero()
    t = int(used.max()) + 1 if len(used) else 1  # longest response in this batch
    ids = input_ids[:, start : n_prompt + t]  # (B, L')
    mask = attention_mask[:, start : n_prompt + t]  # (B, L')
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
    if before_forward is not None:
        before_forward(t)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=t + 1, use_cache=False)
    # logits at position L' - t - 1 + j predict response token j; the last position predicts nothing (its row is
    # computed, and dropped, so the logits stay one contiguous (B, t + 1, V) tensor)
    targets = F.pad(ids[:, -t:], (0, 1))  # (B, t + 1)
    logp, entropy = token_logprobs(logits.logits, targets, temperature, with_entropy)  # (B, t + 1)
    logp = F.pad(logp[:, :-1], (0, total_t - t)) * response_mask  # (B, T)
    if entropy is not None:
        entropy = F.pad(entropy[:, :-1], (0, total_t - t)) * response_mask  # (B, T)
    return logp, entropy


def add_logprobs(
    model: torch.nn.Module,
    rollout: Rollout,
    temperature: float = 1.0,
    with_entropy: bool = True,
    reference: Callable | None = None,
    batch_size: int | None = None,
    policy: bool = True,
) -> Rollout:
    """Fill ``rollout.old_logp`` and ``entropy`` (``policy=False``: leave them None) and, given a ``models.Reference``,
    ``ref_logp``, in no-grad forwards of ``batch_size`` rows at the sampling temperature (the paper's code divides
    the logits by it too)."""
    input_ids, attention_mask, mask = rollout.input_ids, rollout.attention_mask, rollout.response_mask
    step = batch_size or len(rollout)

    def run(module, entropy: bool):
        parts = [
            response_logprobs(
                module, input_ids[i : i + step], attention_mask[i : i + step], mask[i : i + step], temperature, entropy
            )
            for i in range(0, len(rollout), step)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if entropy else None  # (B, T)

    old_logp = entropy = ref_logp = None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if policy:
                old_logp, entropy = run(model, with_entropy)
            if reference is not None:
                with reference() as ref_model:
                    ref_logp, _ = run(ref_model, False)
    finally:
        model.train(was_training)
    # clones leave inference mode, so the update can use these tensors inside autograd
    rollout.old_logp = None if old_logp is None else old_logp.clone()
    rollout.entropy = None if entropy is None else entropy.clone()
    rollout.ref_logp = None if ref_logp is None else ref_logp.clone()
    return rollout


CPU_GENERATE_ROWS = 64
"""Rows per generate call on a CPU when the caller sets none. Measured on the 2-core machine with the lab model
(400 sampled completions of 3-person puzzles, 200 new tokens, 2 threads): 13.9 s in calls of 64 rows, 15.8 s of 32,
17.0 s of 128, and over 10 minutes in one call of 400 (the KV cache, copied at every token, outgrows the caches)."""


def sample(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    group_size: int = 1,
    *,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    max_prompt_tokens: int | None = None,
    batch_size: int | None = None,
    logprob_batch_size: int | None = None,
    with_logprobs: bool = True,
    with_entropy: bool = True,
    reference: Callable | None = None,
) -> Rollout:
    """Sample ``group_size`` completions of each prompt with HF generate (KV cache, left padding, stop at EOS).

    Prompts are tokenized raw (no special tokens added: the K&K prompt strings already hold their chat markup). The
    sampling distribution is softmax(logits / temperature) restricted to the top-p nucleus; every other processor a
    checkpoint's generation_config may carry (Qwen's top_k = 20, repetition_penalty = 1.05) is switched off, so the
    rollout log-probs, computed afterwards at the same temperature, describe what was sampled (top-p aside, as in the
    paper's code). ``greedy`` decodes argmax (evaluation). ``reference``: a ``models.Reference`` for ``ref_logp``.

    batch_size caps the rows per generate call, logprob_batch_size the rows per log-prob forward (GPU memory). On a
    CPU, batch_size=None means CPU_GENERATE_ROWS rows per call (on a GPU: all rows in one call).
    """
    from transformers import GenerationConfig

    if group_size < 1 or not prompts:
        raise ValueError(f"need at least one prompt and group_size >= 1, got {len(prompts)} prompts, G={group_size}")
    device = next(model.parameters()).device
    encoded = tokenizer(list(prompts), add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    if max_prompt_tokens is not None and encoded["attention_mask"].sum(1).max() > max_prompt_tokens:
        longest = int(encoded["attention_mask"].sum(1).max())
        raise ValueError(f"max_prompt_tokens: a prompt has {longest} tokens, more than {max_prompt_tokens}")
    prompt_ids = encoded["input_ids"].repeat_interleave(group_size, dim=0).to(device)  # (B, P)
    prompt_mask = encoded["attention_mask"].repeat_interleave(group_size, dim=0).to(device)  # (B, P)
    stops = stop_token_ids(model, tokenizer)
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}  # top_k = 0: off
    config = GenerationConfig(
        do_sample=not greedy,
        repetition_penalty=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        **sampling,
    )
    n_rows = prompt_ids.shape[0]
    if batch_size is None:
        batch_size = n_rows if device.type == "cuda" else min(n_rows, CPU_GENERATE_ROWS)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            chunks = [
                model.generate(
                    input_ids=prompt_ids[i : i + batch_size],
                    attention_mask=prompt_mask[i : i + batch_size],
                    generation_config=config,
                )[:, prompt_ids.shape[1] :]  # (b, t) generated tokens only
                for i in range(0, n_rows, batch_size)
            ]
    finally:
        model.train(was_training)
    width = max(c.shape[1] for c in chunks)
    pad = tokenizer.pad_token_id
    response_ids = torch.cat([F.pad(c, (0, width - c.shape[1]), value=pad) for c in chunks]).clone()  # (B, T)
    # mask up to and including the first stop token; a row with none ran to max_new_tokens (all real)
    is_stop = torch.isin(response_ids, torch.tensor(stops, device=device))  # (B, T)
    first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), width)  # (B,)
    response_mask = (torch.arange(width, device=device)[None, :] <= first_stop[:, None]).float()  # (B, T)
    texts = tokenizer.batch_decode([row[:n].tolist() for row, n in zip(response_ids, first_stop.tolist(), strict=True)])
    rollout = Rollout(prompt_ids, prompt_mask, response_ids, response_mask, texts, group_size, is_stop.any(1))
    if with_logprobs:
        add_logprobs(model, rollout, 1.0 if greedy else temperature, with_entropy, reference, logprob_batch_size)
    return rollout
