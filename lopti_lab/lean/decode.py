"""A lean batched decode loop for Qwen2-architecture models on a CPU: the same tokens as HF generate, less work.

    out = lean_generate(model, prompt_ids, prompt_mask, group_size=8, max_new_tokens=200, stop_ids=[2], pad_id=0,
                        temperature=0.7)
    out.response_ids, out.logp, out.entropy     # (B, T) each; logp: log pi at the sampling temperature

What HF generate does per token that this loop does not (on the lab model at 64 rows, re-concatenating the growing
KV cache with ``torch.cat`` at every token was the largest single cost of HF's decode):
- each prompt is prefilled once for its G rows (GRPO's groups share it), not G times;
- the KV cache is allocated once, at its final length, and written in place;
- a finished row leaves the batch (the batch is compacted once DEAD_SHARE of it is dead), instead of being decoded
  to the longest row's end;
- the rollout log-probabilities and entropies are read off the sampling logits, so no second forward is needed;
- a token costs about 20 operations a layer (``_Layers``): [q | k | v] and [gate | up] each one matmul, RMSNorm one
  call, no per-token bookkeeping by boolean indexing; each is HF's arithmetic bit for bit (tests/test_decode.py);
- optionally (DRAWS), a sampled token is drawn by inverting its float64 cumulative distribution with
  one uniform per row, not by ``torch.multinomial``'s V exponential variates per row.

The token selection is HF's arithmetic step by step: logits in float32, divided by the temperature, top-p as HF's
TopPLogitsWarper (smallest tokens removed while their cumulative mass is <= 1 - top_p, the top token always kept),
softmax, one draw per row of the batch; greedy takes the argmax. With the default draw (HF's ``torch.multinomial``)
and until the first compaction the batch is HF's, so under the same torch seed the tokens are HF's too
(tests/test_decode.py); after it, or with the inverse-CDF draw, the draws differ in value but not in distribution.

Shape legend: n prompts, G rows per prompt, B = n x G rows, b rows still in the batch, P prompt tokens, T response
tokens, K key/value heads, D head dim, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from lopti_lab.lean.forward import causal_lm, norm, prefill, rotate, rotation_sign

__all__ = ["DEAD_SHARE", "DRAWS", "Decoded", "lean_generate", "pick_tokens", "top_p_filter"]

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
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    greedy: bool,
    with_logprobs: bool,
    *,
    draw: str = "multinomial",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Next tokens (b,) from logits (b, V), and their log-probs and entropies at ``temperature`` (None if not asked).

    The log-probs are those of softmax(logits / temperature) before top-p, the distribution the update's ratio
    uses (as in the paper's code); greedy is scored at temperature 1, as ``rollout.sample`` does. ``draw`` (DRAWS)
    is how a sampled token is drawn from the same probabilities."""
    if draw not in DRAWS:
        raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
    logits = logits.float()
    scores = logits if greedy or temperature == 1.0 else logits / temperature  # (b, V)
    logp_all = scores.log_softmax(-1) if with_logprobs else None  # (b, V)
    probs_all = None if logp_all is None else logp_all.exp()  # (b, V)
    if greedy:
        tokens = scores.argmax(-1)  # (b,)
    else:
        if top_p < 1.0:
            probs = top_p_filter(scores, top_p).softmax(-1)
        else:
            probs = scores.softmax(-1) if probs_all is None or draw == "multinomial" else probs_all  # (b, V)
        tokens = _inverse_cdf(probs) if draw == "inverse_cdf" else torch.multinomial(probs, num_samples=1)[:, 0]
    if not with_logprobs:
        return tokens, None, None
    entropy = -(probs_all * logp_all).sum(-1)  # (b,)
    return tokens, logp_all.gather(1, tokens[:, None])[:, 0], entropy


DRAWS = ("multinomial", "inverse_cdf")
"""How a sampled token is drawn from its probabilities p (b, V). "multinomial" (the default): ``torch.multinomial``,
HF generate's draw, so the same seed gives HF's tokens (tests/test_decode.py) and the training runs' tokens stay
what they were; it spends V exponential variates per row (1.6 ms a token at 64 rows x 1024 tokens on the 2-core
machine, about a sixth of a decode step). "inverse_cdf": one uniform u per row, the first token whose float64
cumulative probability exceeds u x the total (exact in law: a token's interval has width p_i); an evaluation can
take it (``evaluate.EvalSpec.draw``; a run's evaluations keep the default, so their tokens repeat the recorded
ones)."""


def _inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of probs (b, V) by inversion of the cumulative distribution, drawn with the global torch
    generator. Example: p = (0.2, 0.0, 0.5, 0.3), cdf = (0.2, 0.2, 0.7, 1.0): u = 0.2 -> token 2 (the zero-probability
    token 1 has an empty interval [0.2, 0.2)), u = 0.95 -> token 3."""
    cdf = probs.cumsum(-1, dtype=torch.float64)  # (b, V) float64: a tiny p keeps its own interval
    total = cdf[:, -1:]  # (b, 1)
    if not bool((total > 0).all() & total.isfinite().all()):  # as torch.multinomial refuses them
        raise RuntimeError("lean decode: a row's probabilities contain inf or nan, or sum to zero")
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device)  # (b, 1)
    # u x total < total, also where it would round up to it, so no token past the last nonzero one is chosen
    target = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))  # (b, 1)
    return torch.searchsorted(cdf, target, right=True)[:, 0]  # (b,)


class _Cache:
    """Keys and values, allocated once at their final length and written in place. With G > 1 rows per prompt
    (``shared``), each prompt's once for its G rows (n, K, P, D), as the prefill gave them, beside the live rows'
    responses (b, K, max_new_tokens, D); with G = 1, each row's [prompt | response] (b, K, P + max_new_tokens, D).
    ``visible`` is 0 on a prompt's real tokens and -inf on its padding, (n, 1, 1, P) (shared; a row sees every
    response column so far), else a bool mask (b, 1, 1, P + max_new_tokens) as SDPA takes it. ``rows`` (b,) is each
    batch row's original row; a shared row's slot is (prompt, member) = (its prompt among the live ones, rows % G)."""

    def __init__(self, prompt_kv, prompt_mask: torch.Tensor, group_size: int, max_new_tokens: int):
        n, kv_heads, P, dim = prompt_kv[0][0].shape
        B, device = n * group_size, prompt_mask.device
        self.shared, self.group_size, self.length = group_size > 1, group_size, 0  # length: response tokens written
        self.offset = 0 if self.shared else P  # the cache column of response token 0
        self.keys = [k.new_empty(B, kv_heads, self.offset + max_new_tokens, dim) for k, _ in prompt_kv]  # (B, K, ., D)
        self.values = [v.new_empty(B, kv_heads, self.offset + max_new_tokens, dim) for _, v in prompt_kv]
        if self.shared:
            self.prompt = [(k.contiguous(), v.contiguous()) for k, v in prompt_kv]  # (n, K, P, D) each
            self.visible = torch.zeros(n, 1, 1, P, dtype=prompt_kv[0][0].dtype, device=device)
            self.visible.masked_fill_(~prompt_mask.bool()[:, None, None, :], -float("inf"))
        else:
            for (k, v), keys, values in zip(prompt_kv, self.keys, self.values, strict=True):
                keys[:, :, :P], values[:, :, :P] = k, v
            self.visible = torch.ones(B, 1, 1, P + max_new_tokens, dtype=torch.bool, device=device)
            self.visible[:, 0, 0, :P] = prompt_mask.bool()
        self.rows = torch.arange(B, device=device)  # (b,)
        self.prompt_of, self.member = self.rows // group_size, self.rows % group_size  # (b,) each

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch), and the prompts they answer; copies the used columns
        only."""
        used = self.offset + self.length
        for store in (self.keys, self.values):
            for i, full in enumerate(store):
                kept = full.new_empty(len(rows), *full.shape[1:])
                kept[:, :, :used] = full[rows, :, :used]
                store[i] = kept
        self.rows = self.rows[rows]
        if not self.shared:
            self.visible = self.visible[rows]
            return
        live, self.prompt_of = torch.unique(self.prompt_of[rows], return_inverse=True)  # (n',), (b,)
        self.prompt = [(k[live], v[live]) for k, v in self.prompt]
        self.visible = self.visible[live]
        self.member = self.rows % self.group_size

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """softmax(scale q k^T + mask) v of queries q (b, K, Q, D) (a key/value head's Q query heads as rows) over
        their prompt's keys and their response's keys so far: (b, K, Q, D). Shared: a prompt's keys are read once for
        its G rows, the queries sitting in (n, G) slots (a finished row's slot holds zeros, its output unused);
        else SDPA over each row's [prompt | response]."""
        keys, values, t = self.keys[layer], self.values[layer], self.offset + self.length + 1
        if not self.shared:
            return F.scaled_dot_product_attention(
                q, keys[:, :, :t], values[:, :, :t], attn_mask=self.visible[..., :t], scale=scale
            )
        prompt_k, prompt_v = self.prompt[layer]
        n, K, P, _ = prompt_k.shape
        b, Q, G = q.shape[0], q.shape[2], self.group_size
        full = b == n * G  # every row of every live prompt is live: batch row i is slot i
        q = q * scale

        def to_slots(x):  # (b, K, Q, m) -> (n, K, G Q, m), a prompt's rows together
            if full:
                return x.view(n, G, K, Q, -1).transpose(1, 2).reshape(n, K, G * Q, x.shape[-1])
            slots = x.new_zeros(n, K, G, Q, x.shape[-1])
            slots[self.prompt_of, :, self.member] = x
            return slots.view(n, K, G * Q, x.shape[-1])

        def from_slots(x):  # (n, K, G Q, m) -> (b, K, Q, m)
            x = x.view(n, K, G, Q, x.shape[-1])
            return x.transpose(1, 2).reshape(n * G, K, Q, x.shape[-1]) if full else x[self.prompt_of, :, self.member]

        scores = torch.cat(
            [
                from_slots(torch.matmul(to_slots(q), prompt_k.transpose(-1, -2)) + self.visible),
                torch.matmul(q, keys[:, :, :t].transpose(-1, -2)),
            ],
            dim=-1,
        ).softmax(-1)  # (b, K, Q, P + t)
        on_prompt = from_slots(torch.matmul(to_slots(scores[..., :P]), prompt_v))  # (b, K, Q, D)
        return on_prompt + torch.matmul(scores[..., P:], values[:, :, :t])


class _Layers:
    """A decoder's per-token arithmetic with the fewest operations: for each layer, [q | k | v] and [gate | up] as
    one matmul each (their weights concatenated once per generate call; every output element is the same dot
    product as in the separate projections, bit for bit), RMSNorm as ``forward.norm`` (HF's float32 arithmetic, bit
    for bit), the rotary embedding with rotate_half's sign moved onto sin (exact). A projection that is not a plain
    ``nn.Linear`` (a LoRA layer) is called as a module, its outputs concatenated."""

    def __init__(self, core):
        self.core = core
        config = core.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = core.layers[0].self_attn.head_dim
        self.sign = rotation_sign(self.head_dim, core.embed_tokens.weight)  # (D,)
        self.layers = []
        for layer in core.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    norm(layer.input_layernorm),
                    _fused([attn.q_proj, attn.k_proj, attn.v_proj]),
                    _fused([attn.o_proj]),
                    norm(layer.post_attention_layernorm),
                    _fused([mlp.gate_proj, mlp.up_proj]),
                    mlp.act_fn,
                    _fused([mlp.down_proj]),
                    attn.scaling,
                )
            )
        self.norm = norm(core.norm)

    def step(self, cache: _Cache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (b,) at ``positions`` (b,); append its keys and values; the last hidden state
        (b, E) after the final norm."""
        b, H, K, D = len(tokens), self.heads, self.kv_heads, self.head_dim
        column = cache.offset + cache.length
        x = self.core.embed_tokens(tokens)  # (b, E)
        cos, sin = self.core.rotary_emb(x, positions[:, None])  # (b, 1, D) each
        sin = sin * self.sign  # rotate_half(x) * sin == roll(x, D / 2) * (sign * sin), exactly
        for i, (norm1, qkv, o_proj, norm2, gate_up, act, down, scaling) in enumerate(self.layers):
            projected = qkv(norm1(x)).view(b, H + 2 * K, D)  # (b, H + 2K, D): [q | k | v] heads
            qk = projected[:, : H + K]
            qk = rotate(qk, cos, sin)  # (b, H + K, D) rotary, HF's apply_rotary_pos_emb
            cache.keys[i][:, :, column] = qk[:, H:]
            cache.values[i][:, :, column] = projected[:, H + K :]
            grouped = qk[:, :H].view(b, K, H // K, D)  # a key/value head's query heads as rows of one matrix
            attended = cache.attend(i, grouped, scaling)  # (b, K, H / K, D)
            x = x + o_proj(attended.reshape(b, H * D))  # (b, E)
            gate, up = gate_up(norm2(x)).chunk(2, -1)  # (b, I) each
            x = x + down(act(gate) * up)
        cache.length += 1
        return self.norm(x)  # (b, E)


def _fused(linears: list[torch.nn.Module]):
    """A function of h (..., E): the outputs of ``linears`` concatenated, in one matmul when all are plain
    ``nn.Linear`` (with biases on all or none), else each module called in turn."""
    plain = all(type(m) is torch.nn.Linear for m in linears)
    biases = [m.bias for m in linears] if plain else []
    if plain and (all(b is not None for b in biases) or all(b is None for b in biases)):
        weight = torch.cat([m.weight for m in linears])  # (sum of outputs, E)
        bias = None if biases[0] is None else torch.cat(biases)
        return partial(F.linear, weight=weight, bias=bias)
    if len(linears) == 1:
        return linears[0]
    return lambda h: torch.cat([m(h) for m in linears], -1)


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
    draw: str = "multinomial",
) -> Decoded:
    """Decode ``group_size`` completions of each left-padded prompt (n, P); see the module docstring.

    Call it under ``torch.inference_mode()`` with the model in eval mode (``rollout.sample`` does).
    ``dead_share`` > 1 never compacts (the tests use it to compare draws with HF's over whole runs); ``draw``
    (DRAWS) how sampled tokens are drawn."""
    if draw not in DRAWS:
        raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
    lm = causal_lm(model)
    layers = _Layers(lm.model)
    B = prompt_ids.shape[0] * group_size
    device = prompt_ids.device
    last_hidden, prompt_kv = prefill(lm, prompt_ids, prompt_mask)
    logits = lm.lm_head(last_hidden).repeat_interleave(group_size, 0)  # (B, V)
    cache = _Cache(prompt_kv, prompt_mask, group_size, max_new_tokens)
    del prompt_kv
    next_position = prompt_mask.long().sum(1).repeat_interleave(group_size)  # (B,) position of response token 0
    stops = torch.tensor(list(stop_ids), device=device)
    rows = torch.arange(B, device=device)  # (b,) the original row of each batch row
    stopped = torch.zeros(B, dtype=torch.bool, device=device)  # (b,) has emitted a stop token
    # each batch row's tokens so far (b, max_new), moved to the original rows when the row leaves the batch
    names = ("ids", "logp", "entropy") if with_logprobs else ("ids",)
    out = {
        k: torch.full((B, max_new_tokens), pad_id, device=device)
        if k == "ids"
        else torch.zeros(B, max_new_tokens, device=device)
        for k in names
    }
    live_out = {k: v.clone() for k, v in out.items()}  # (b, max_new) each
    steps = 0
    for t in range(max_new_tokens):
        picked = pick_tokens(logits, temperature, top_p, greedy, with_logprobs, draw=draw)  # (b,) each
        for name, value in zip(names, picked, strict=False):
            live_out[name][:, t] = value
        tokens = picked[0]
        steps = t + 1
        stopped |= torch.isin(tokens, stops)
        n_live = len(rows) - int(stopped.sum())
        if n_live == 0 or t == max_new_tokens - 1:
            break
        if n_live <= (1 - dead_share) * len(rows):  # compact: drop the finished rows
            gone, kept = stopped.nonzero()[:, 0], (~stopped).nonzero()[:, 0]
            for name in names:
                out[name][rows[gone]] = live_out[name][gone]
                live_out[name] = live_out[name][kept]
            cache.keep(kept)
            rows, stopped, tokens, next_position = rows[kept], stopped[kept], tokens[kept], next_position[kept]
        logits = lm.lm_head(layers.step(cache, tokens, next_position + t))  # (b, V)
    for name in names:
        out[name][rows] = live_out[name]
    ids = out["ids"][:, :steps]  # (B, T)
    is_stop = torch.isin(ids, stops)
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0  # (B, T) past each row's first stop token
    ids.masked_fill_(after_stop, pad_id)
    if not with_logprobs:
        return Decoded(ids, None, None)
    return Decoded(ids, *(out[k][:, :steps].masked_fill_(after_stop, 0.0) for k in ("logp", "entropy")))
