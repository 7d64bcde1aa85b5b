"""Qwen2-architecture forwards built from a model's own modules, for the two places where HF's generic forward
wastes a CPU's time in GRPO: the G completions of one prompt recompute that prompt G times, and every decoded
token pays for a growing, re-concatenated KV cache.

    reason = lean_unsupported(model)           # None, or why the HF path must be used
    logits = shared_prompt_logits(model, prompt_ids, prompt_mask, row_prompt, response_ids)  # (B, T, V)

Only the attention and the RMSNorm's backward are written here. Embeddings, the q/k/v/o projections (LoRA layers
included), the rotary embedding and the MLP are the model's own modules, called as its forward calls them; a plain
float32 RMSNorm computes HF's forward with a backward written out (``norm``). So the values are HF's up to the
attention kernel's rounding, the gradients up to float32 rounding (tests/test_decode.py compares tokens, log-probs
and gradients with HF).

Shape legend: n prompts, B rows (each row answers one prompt; a prompt's rows are any subset), P prompt tokens
(left-padded), T response tokens, H query heads, K key/value heads, D head dim, E hidden size, V vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, Qwen2RMSNorm

__all__ = [
    "SEGMENT",
    "attend_one",
    "causal_lm",
    "layer_input",
    "layer_output",
    "lean_unsupported",
    "norm",
    "prefill",
    "shared_prompt_logits",
]

SEGMENT: ContextVar[tuple | None] = ContextVar("lopti_lab_lean_segment", default=None)
"""Which positions the module calls running now compute, for a hook that splits a weight's gradient by position
(``probes.GradientProbe``), set by ``shared_prompt_logits(..., own_last=True)``: None outside it (a plain (B, L)
forward); ("context",) for the prompts' calls, whose positions predict no response token; ("rows", rows) for a
(b, t) block of the batch's rows ``rows`` (b,), whose position j predicts response token j."""


@contextmanager
def _segment(value: tuple | None):
    token = SEGMENT.set(value)
    try:
        yield
    finally:
        SEGMENT.reset(token)


def causal_lm(model: torch.nn.Module) -> Qwen2ForCausalLM:
    """The Qwen2ForCausalLM inside ``model`` (itself, or the base model of a peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base


def lean_unsupported(model: torch.nn.Module) -> str | None:
    """None when the lean forwards compute exactly what ``model``'s own forward does, else the reason they don't.

    They need a Qwen2ForCausalLM on a CPU (a peft wrapper around one is fine: its LoRA layers are called as modules)
    whose forward nobody replaced, with full attention in every layer (no sliding window) and no attention dropout
    while training. Anything else takes HF's path."""
    base = causal_lm(model)
    if not isinstance(base, Qwen2ForCausalLM):
        return f"{type(base).__name__} is not a Qwen2ForCausalLM"
    if "forward" in vars(model) or "forward" in vars(base):
        return "the model's forward was replaced on the instance"
    device = next(base.parameters()).device
    if device.type != "cpu":
        return f"the model is on {device.type}, and the lean path is for CPUs (HF generate suits GPUs)"
    config = base.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or []) or getattr(
        config, "use_sliding_window", False
    ):
        return "the model uses sliding-window attention"
    if base.training and config.attention_dropout > 0:
        return "attention dropout is active (training mode)"
    return None


class _RMSNorm(torch.autograd.Function):
    """HF's float32 RMSNorm, y = w x r with r = rsqrt(mean(x^2) + eps), its forward the same operations in the same
    order (bit for bit), its backward written out: dx = r (g w - n mean(g w n)) with n = x r, dw = sum over rows of
    g n. Autograd through HF's composite runs about 14 elementwise passes over the hidden states backward (pow,
    mean, rsqrt and two products, each differentiated) and keeps x, r and n; this runs 8 and keeps n and r."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        n = x * r
        ctx.save_for_backward(n, r, weight)
        return weight * n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, r, weight = ctx.saved_tensors
        grad_n = grad * weight  # (..., E)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_n.sub_(n * (grad_n * n).mean(-1, keepdim=True)).mul_(r)  # in place: grad_n is ours
        grad_w = (grad * n).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def norm(module: torch.nn.Module):
    """A function of x computing ``module(x)`` with HF's values bit for bit, for a float32 Qwen2RMSNorm called as its
    class defines it (no hook, no forward replaced on the instance: the float64 probe replaces it): ``_RMSNorm``
    (a cheaper backward) where autograd records, else ``F.rms_norm`` (one call: the decode loop's per-token norms).
    Any other norm: the module itself."""
    weight = getattr(module, "weight", None)
    plain = type(module) is Qwen2RMSNorm and "forward" not in vars(module)
    if not plain or module._forward_hooks or module._forward_pre_hooks or weight.dtype != torch.float32:
        return module
    eps = module.variance_epsilon

    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return module(x)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _RMSNorm.apply(x, weight, eps)
        return F.rms_norm(x, weight.shape, weight, eps)

    return rms_norm


def rotation_sign(head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """(D,) -1 on the first half, +1 on the second: HF's apply_rotary_pos_emb computes x cos + rotate_half(x) sin with
    rotate_half(x) = [-x2 | x1], which is roll(x, D / 2) x (sign x sin), the same products and sums bit for bit (and
    in backward: roll's adjoint is the inverse roll), without a negation and a concatenation of every q and k."""
    half = head_dim // 2
    return torch.cat([-torch.ones(half), torch.ones(head_dim - half)]).to(like)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x (..., D): x cos + roll(x, D / 2) x signed_sin (``rotation_sign``)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rotary(lm, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (b, 1, s, D) for positions (b, s), as ``layer_input`` takes them."""
    cos, sin = lm.rotary_emb(x, positions)  # (b, s, D) each
    return cos[:, None], (sin * rotation_sign(sin.shape[-1], sin))[:, None]


def layer_input(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q (b, H, s, D) and k, v (b, K, s, D) of a decoder layer for hidden states x (b, s, E), rotary applied with
    ``rotary``'s cos and signed sin (b, 1, s, D)."""
    attn = layer.self_attn
    h = norm(layer.input_layernorm)(x)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(h).view(shape).transpose(1, 2)  # (b, H, s, D)
    k = attn.k_proj(h).view(shape).transpose(1, 2)  # (b, K, s, D)
    v = attn.v_proj(h).view(shape).transpose(1, 2)  # (b, K, s, D)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def layer_output(layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer: o_proj of the attention output (b, H, s, D), residual, MLP, residual."""
    x = x + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(*x.shape[:-1], -1))  # (b, s, E)
    return x + layer.mlp(norm(layer.post_attention_layernorm)(x))


def attend(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Masked attention of queries (b, H, s, D) over keys (b, K, L, D); allowed, broadcast to (b, 1, s, L): bool, or
    ``additive``'s float mask (the same attention, without SDPA converting the bool mask at every call)."""
    # a key/value head serves its H / K query heads inside the kernel: HF's SDPA path repeats k and v to H heads
    # first (repeat_kv), a copy forward and a sum backward, for the same products
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=layer.self_attn.scaling, enable_gqa=True)


def attend_one(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """One query token per row, q (b, H, 1, D) over keys (b, K, L, D), allowed (b, 1, 1, L): the query heads of a
    key/value head are stacked as rows of one matrix, so each key is read once per key/value head (HF decodes so)."""
    b, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads, dim)  # (b, K, H/K, D)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=allowed, scale=layer.self_attn.scaling)
    return out.reshape(b, heads, 1, dim)  # (b, H, 1, D)


def prompt_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, as generate numbers them: 0 at the first real token. mask: (b, P)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)  # (b, P)


def additive(allowed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A bool attention mask as the float mask SDPA turns it into (0 where allowed, -inf elsewhere, ``like``'s dtype),
    made once per forward rather than by SDPA in each layer's call, forward and backward."""
    return torch.zeros(allowed.shape, dtype=like.dtype, device=allowed.device).masked_fill_(~allowed, -float("inf"))


def prompt_allowed(mask: torch.Tensor) -> torch.Tensor:
    """(b, 1, P, P) bool: causal, real keys only; a padding query sees itself, so no row of the softmax is empty."""
    P = mask.shape[1]
    causal = torch.ones(P, P, dtype=torch.bool, device=mask.device).tril()  # (P, P)
    allowed = causal[None] & mask.bool()[:, None, :]  # (b, P, P)
    return (allowed | torch.eye(P, dtype=torch.bool, device=mask.device)[None])[:, None]  # (b, 1, P, P)


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The prompts' forward: the last position's hidden state (n, E) after the final norm, and each layer's (k, v)
    (n, K, P, D). Prompts are left-padded, so the last position is every prompt's last real token."""
    lm = causal_lm(model).model
    x = lm.embed_tokens(prompt_ids)  # (n, P, E)
    cos, sin = rotary(lm, x, prompt_positions(prompt_mask))
    allowed = additive(prompt_allowed(prompt_mask), x)
    cache = []
    for layer in lm.layers:
        q, k, v = layer_input(layer, x, cos, sin)
        cache.append((k, v))
        x = layer_output(layer, x, attend(layer, q, k, v, allowed))
    return norm(lm.norm)(x[:, -1]), cache  # (n, E), [(n, K, P, D) x 2] per layer


def shared_prompt_logits(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    row_prompt: torch.Tensor,
    response_ids: torch.Tensor,
    lengths: torch.Tensor | None = None,
    own_last: bool = False,
) -> torch.Tensor:
    """Logits predicting each response token, with every prompt's forward computed once for all its rows.

    prompt_ids, prompt_mask: (n, P) left-padded; row_prompt: (B,) the prompt of each row; response_ids: (B, T);
    lengths: (B,) real response tokens per row (None: all T). Returns (B, T, V): row b's logits at the position before
    response token t (the prompt's last position for t = 0); positions past a row's length hold no information.

    A prompt's hidden states do not depend on the responses (causal attention), so computing them once and letting
    each response attend to them is the same function of the weights as B full forwards; autograd sums the G rows'
    gradients through the shared prompt, as the B forwards would. Saves (G - 1) / G of the prompt's work. The
    responses run in groups of similar length (``length_buckets``), each only as long as its
    longest row, so short responses do not pay for the longest one's padding.

    ``own_last``: each row computes its prompt's last position itself (the one predicting response token 0), so every
    shared position predicts no response token, and the calls announce their positions (``SEGMENT``): what a
    gradient split by position needs (the shared positions' terms add up over the rows exactly). One more position
    per row than without.
    """
    lm = causal_lm(model).model
    n_resp, cut = response_ids.shape[1], int(own_last)
    if lengths is None:
        lengths = torch.full((len(row_prompt),), n_resp, device=response_ids.device)
    shared_ids, shared_mask = prompt_ids[:, : prompt_ids.shape[1] - cut], prompt_mask[:, : prompt_mask.shape[1] - cut]
    with _segment(("context",) if own_last else None):
        x_prompt = lm.embed_tokens(shared_ids)  # (n, P - cut, E)
    allowed = additive(prompt_allowed(shared_mask), x_prompt)
    prompt_geometry = (*rotary(lm, x_prompt, prompt_positions(shared_mask)), allowed, own_last)
    buckets = length_buckets(lengths.clamp(min=1))
    xs, geometries = [], []
    for rows in buckets:
        t = int(lengths[rows].max().clamp(min=1))  # response tokens this bucket scores
        fed = response_ids[rows, : t - 1]  # (b, t - 1): the last token predicts nothing
        if own_last:
            fed = torch.cat([prompt_ids[row_prompt[rows], -1:], fed], 1)  # (b, t): position j predicts token j
        with _segment(("rows", rows) if own_last else None):
            x = lm.embed_tokens(fed)
        xs.append(x)
        geometries.append((*_response_geometry(lm, x, shared_mask, row_prompt[rows]), rows if own_last else None))
    checkpointed = lm.training and any(getattr(layer, "gradient_checkpointing", False) for layer in lm.layers)
    for layer in lm.layers:
        args = (layer, x_prompt, prompt_geometry, geometries, *xs)
        if checkpointed:  # recompute the layer in backward, as HF's checkpointed layers do
            x_prompt, *xs = checkpoint(_shared_prompt_layer, *args, use_reentrant=False)
        else:
            x_prompt, *xs = _shared_prompt_layer(*args)
    if not own_last:
        last = x_prompt[:, -1]  # (n, E): predicts response token 0
        xs = [torch.cat([last[row_prompt[rows]][:, None], x], 1) for rows, x in zip(buckets, xs, strict=True)]
    hidden = torch.cat([F.pad(x, (0, 0, 0, n_resp - x.shape[1])) for x in xs])  # (B, T, E) in bucket order
    order = torch.cat(buckets)
    hidden = hidden[torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))]
    with _segment(("rows", torch.arange(len(order), device=order.device)) if own_last else None):
        return causal_lm(model).lm_head(norm(lm.norm)(hidden))  # (B, T, V) in row order


BUCKET_TOKENS = 32
"""What one more response-length group costs a shared-prompt forward, in padded tokens: its ~75 operations per layer
(forward and backward) take about the time of 32 tokens' arithmetic on the lab model (benchmarks/README.md)."""


def length_buckets(lengths: torch.Tensor, bucket_tokens: float | None = None) -> list[torch.Tensor]:
    """Row indices split into groups of similar length, each run as long as its longest row: the split of the rows,
    sorted by length, into consecutive groups that makes the padded tokens sum(rows x longest) plus bucket_tokens
    per group (None: BUCKET_TOKENS) smallest (dynamic programming over the cut points, exact).

    Example: lengths (10, 90, 12, 88) -> [rows 0, 2], [rows 3, 1]: 2 x 12 + 2 x 90 = 204 padded tokens, not 360."""
    bucket_tokens = BUCKET_TOKENS if bucket_tokens is None else bucket_tokens
    order = lengths.argsort(stable=True)
    sorted_lengths = lengths[order].double().cpu().numpy()  # (n,) ascending
    n = len(order)
    # best[j]: the least cost of the first j sorted rows; a group of rows i..j-1 costs (j - i) x length[j - 1] + c
    best, cut = np.zeros(n + 1), np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        costs = best[:j] + (j - np.arange(j)) * sorted_lengths[j - 1] + bucket_tokens  # (j,) over the cut i
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    bounds, j = [], n
    while j > 0:
        bounds.append(j)
        j = cut[j]
    return list(order.tensor_split(sorted(bounds)[:-1]))


def _response_geometry(lm, x: torch.Tensor, prompt_mask: torch.Tensor, row_prompt: torch.Tensor):
    """Rotary cos, sin and the attention mask of responses x (b, t', E) over [their prompt (P) | themselves (t')]:
    response token j sits at position (real prompt length) + j and sees its prompt's real tokens and tokens 0..j."""
    n_fed = x.shape[1]
    start = prompt_mask.long().sum(1)[row_prompt]  # (b,)
    positions = start[:, None] + torch.arange(n_fed, device=x.device)[None]  # (b, t')
    cos, sin = rotary(lm, x, positions)
    causal = torch.ones(n_fed, n_fed, dtype=torch.bool, device=x.device).tril()  # (t', t')
    see_prompt = prompt_mask.bool()[row_prompt][:, None, :].expand(-1, n_fed, -1)  # (b, t', P)
    allowed = torch.cat([see_prompt, causal[None].expand(len(row_prompt), -1, -1)], dim=2)[:, None]  # (b, 1, t', L)
    return cos, sin, additive(allowed, x), row_prompt


def _shared_prompt_layer(layer, x_prompt, prompt_geometry, response_geometries, *xs):
    """One decoder layer over the prompts (n, P, E) and each bucket's responses (b, t', E) that attend to them; each
    part's module calls under its ``SEGMENT`` when the geometries carry one (``own_last``)."""
    cos_p, sin_p, allowed_p, announce = prompt_geometry
    with _segment(("context",) if announce else None):
        q_p, k_p, v_p = layer_input(layer, x_prompt, cos_p, sin_p)
        out = [
            layer_output(layer, x_prompt, attend(layer, q_p, k_p, v_p, allowed_p)) if x_prompt.shape[1] else x_prompt
        ]
    for x, (cos, sin, allowed, row_prompt, rows) in zip(xs, response_geometries, strict=True):
        if x.shape[1] == 0:  # one response token: only the prompt's last position predicts
            out.append(x)
            continue
        with _segment(("rows", rows) if announce else None):
            q, k, v = layer_input(layer, x, cos, sin)
            k = torch.cat([k_p[row_prompt], k], dim=2)  # (b, K, P + t', D)
            v = torch.cat([v_p[row_prompt], v], dim=2)
            out.append(layer_output(layer, x, attend(layer, q, k, v, allowed)))
    return tuple(out)
