"""A lean batched decode loop for Qwen2-architecture models on a CPU: the same tokens as HF generate, less work.

    out = lean_generate(model, prompt_ids, prompt_mask, group_size=8, max_new_tokens=200, stop_ids=[2], pad_id=0,
                        temperature=0.7)
    out.response_ids, out.logp, out.entropy     # (B, T) each; logp: log pi at the sampling temperature

What HF generate does per token that this loop does not (measured on the lab model, 64 rows: ``torch.cat`` of the
growing KV cache was 37% of generate's CPU time, benchmarks/README.md "One lab RL step against its floor"):
- each prompt is prefilled once for its G rows (GRPO's groups share it), not G times;
- the KV cache is allocated once, at its final length, and written in place;
- a finished row leaves the batch (the batch is compacted once DEAD_SHARE of it is dead), instead of being decoded
  to the longest row's end;
- the rollout log-probabilities and entropies are read off the sampling logits, so no second forward is needed.

The token selection is HF's arithmetic step by step: logits in float32, divided by the temperature, top-p as HF's
TopPLogitsWarper (smallest tokens removed while their cumulative mass is <= 1 - top_p, the top token always kept),
softmax, one ``torch.multinomial`` draw per row of the batch; greedy takes the argmax. Until the first compaction the
batch is HF's, so under the same torch seed the tokens are HF's too (tests/test_decode.py); after it the draws are
spent on fewer rows, so they differ in value but not in distribution.

Shape legend: n prompts, G rows per prompt, B = n x G rows, b rows still in the batch, P prompt tokens, T response
tokens, K key/value heads, D head dim, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lopti_lab.lean.forward import attend_one, causal_lm, layer_input, layer_output, prefill

__all__ = ["DEAD_SHARE", "Decoded", "lean_generate", "pick_tokens", "top_p_filter"]

DEAD_SHARE = 0.125
"""Compact the batch once this share of its rows has finished. Compacting copies the live rows' KV cache (about one
decode step's attention reads); decoding a dead row wastes its share of every step until then. Measured (lab model,
the demo's 64-row rollouts, 1 thread, CPU seconds, mean of 6): 2.31 s at 0.05, 2.30 at 0.125, 2.35 at 0.25, 2.48
at 0.5, 3.24 never compacting."""


@dataclass
class Decoded:
    """What the loop produced, rows in the prompts' order (a prompt's G rows contiguous)."""

    response_ids: torch.Tensor  # (B, T) pad after the stop token; T = the longest row (or max_new_tokens)
    logp: torch.Tensor | None  # (B, T) log softmax(logits / temperature) of each token, 0 after the stop token
    entropy: torch.Tensor | None  # (B, T) entropy of softmax(logits / temperature), 0 after the stop token


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """scores (b, V) with every token outside the top-p nucleus set to -inf (HF's TopPLogitsWarper arithmetic).

    Example: probabilities (0.5, 0.3, 0.2) with top_p = 0.6 keep the first two: sorted ascending, the cumulative mass
    is (0.2, 0.5, 1.0), and only 0.2 <= 1 - 0.6 = 0.4 goes."""
    ascending, order = torch.sort(scores, descending=False)  # (b, V)
    remove_sorted = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # (b, V)
    remove_sorted[:, -1] = False  # the most likely token always stays
    remove = remove_sorted.scatter(1, order, remove_sorted)  # (b, V) back in vocabulary order
    return scores.masked_fill(remove, -float("inf"))


def pick_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, greedy: bool, with_logprobs: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Next tokens (b,) from logits (b, V), and their log-probs and entropies at ``temperature`` (None if not asked).

    The log-probs are those of softmax(logits / temperature) before top-p, the distribution the update's ratio
    uses (as in the paper's code); greedy is scored at temperature 1, as ``rollout.sample`` does."""
    logits = logits.float()
    scores = logits if greedy or temperature == 1.0 else logits / temperature  # (b, V)
    if greedy:
        tokens = scores.argmax(-1)  # (b,)
    else:
        kept = scores if top_p >= 1.0 else top_p_filter(scores, top_p)
        tokens = torch.multinomial(kept.softmax(-1), num_samples=1)[:, 0]  # (b,)
    if not with_logprobs:
        return tokens, None, None
    logp_all = scores.log_softmax(-1)  # (b, V)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (b,)
    return tokens, logp_all.gather(1, tokens[:, None])[:, 0], entropy


class _Cache:
    """The live rows' keys and values, allocated at their final length L = P + max_new_tokens and written in place.
    ``visible`` (b, L) marks the keys a row may attend to: its real prompt tokens and its response so far."""

    def __init__(self, prompt_kv, prompt_mask: torch.Tensor, group_size: int, max_new_tokens: int):
        n, kv_heads, P, dim = prompt_kv[0][0].shape
        B, L = n * group_size, P + max_new_tokens
        self.keys, self.values = [], []
        for k, v in prompt_kv:
            keys, values = k.new_empty(B, kv_heads, L, dim), v.new_empty(B, kv_heads, L, dim)  # (B, K, L, D)
            keys[:, :, :P] = k.repeat_interleave(group_size, 0)
            values[:, :, :P] = v.repeat_interleave(group_size, 0)
            self.keys.append(keys)
            self.values.append(values)
        self.visible = torch.zeros(B, L, dtype=torch.bool, device=prompt_mask.device)  # (B, L)
        self.visible[:, :P] = prompt_mask.bool().repeat_interleave(group_size, 0)
        self.length = P

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch); copies the used columns only."""
        used = self.length
        for store in (self.keys, self.values):
            for i, full in enumerate(store):
                kept = full.new_empty(len(rows), *full.shape[1:])
                kept[:, :, :used] = full[rows, :, :used]
                store[i] = kept
        self.visible = self.visible[rows]


def lean_generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    group_size: int,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    with_logprobs: bool = True,
    dead_share: float = DEAD_SHARE,
) -> Decoded:
    """Decode ``group_size`` completions of each left-padded prompt (n, P); see the module docstring.

    Call it under ``torch.inference_mode()`` with the model in eval mode (``rollout.sample`` does).
    ``dead_share`` > 1 never compacts (the tests use it to compare draws with HF's over whole runs)."""
    lm = causal_lm(model)
    core = lm.model
    B = prompt_ids.shape[0] * group_size
    device = prompt_ids.device
    last_hidden, prompt_kv = prefill(lm, prompt_ids, prompt_mask)
    logits = lm.lm_head(last_hidden).repeat_interleave(group_size, 0)  # (B, V)
    cache = _Cache(prompt_kv, prompt_mask, group_size, max_new_tokens)
    del prompt_kv
    next_position = prompt_mask.long().sum(1).repeat_interleave(group_size)  # (B,) position of response token 0
    stops = torch.tensor(list(stop_ids), device=device)
    rows = torch.arange(B, device=device)  # (b,) the original row of each batch row
    live = torch.ones(B, dtype=torch.bool, device=device)  # (b,) not yet stopped
    out_ids = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)  # (B, max_new)
    out_logp = torch.zeros(B, max_new_tokens, device=device) if with_logprobs else None
    out_entropy = torch.zeros(B, max_new_tokens, device=device) if with_logprobs else None
    steps = 0
    for t in range(max_new_tokens):
        tokens, logp, entropy = pick_tokens(logits, temperature, top_p, greedy, with_logprobs)  # (b,) each
        writing = rows[live]
        out_ids[writing, t] = tokens[live]
        if with_logprobs:
            out_logp[writing, t] = logp[live]
            out_entropy[writing, t] = entropy[live]
        steps = t + 1
        live = live & ~torch.isin(tokens, stops)
        n_live = int(live.sum())
        if n_live == 0 or t == max_new_tokens - 1:
            break
        if n_live <= (1 - dead_share) * len(rows):  # compact: drop the finished rows
            kept = live.nonzero()[:, 0]
            cache.keep(kept)
            rows, live, tokens, next_position = rows[kept], live[kept], tokens[kept], next_position[kept]
        logits = _step(lm, core, cache, tokens, next_position + t)
    return Decoded(
        out_ids[:, :steps],
        None if out_logp is None else out_logp[:, :steps],
        None if out_entropy is None else out_entropy[:, :steps],
    )


def _step(lm, core, cache: _Cache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Feed one token per row (b,) at ``positions`` (b,); append its keys and values; the next logits (b, V)."""
    column = cache.length
    cache.visible[:, column] = True
    x = core.embed_tokens(tokens[:, None])  # (b, 1, E)
    cos, sin = core.rotary_emb(x, positions[:, None])
    visible = cache.visible[:, None, None, : column + 1]  # (b, 1, 1, L')
    for layer, keys, values in zip(core.layers, cache.keys, cache.values, strict=True):
        q, k, v = layer_input(layer, x, cos, sin)  # q (b, H, 1, D), k, v (b, K, 1, D)
        keys[:, :, column] = k[:, :, 0]
        values[:, :, column] = v[:, :, 0]
        attended = attend_one(layer, q, keys[:, :, : column + 1], values[:, :, : column + 1], visible)
        x = layer_output(layer, x, attended)
    cache.length = column + 1
    return lm.lm_head(core.norm(x[:, 0]))  # (b, V)
