"""Exact float64 log-probs for the probability-shift measurements, without the whole model in float64 (DESIGN.md,
"Precision and memory").

    logp = float64_response_logprobs(model, input_ids, attention_mask, response_mask, temperature)  # (B, T) float64

the numbers of ``in_float64`` (the whole model cast to float64) around ``rollout.response_logprobs``, to ~1e-13
(tests/test_shift_precision.py), with this memory above the model's own:

    one cast unit's weights in float64     a Linear with its LoRA adapters, or a norm: at most an MLP projection,
                                           4864 x 896 x 8 B = 33 MiB for Qwen2.5-0.5B (the whole model: 3.7 GiB)
    the rows' float64 activations          the hidden states and one layer's intermediates, (B, L, 4864) in the MLP
    one (TOKEN_CHUNK, VOCAB_CHUNK) block   of float64 logits (32 MiB) and a (VOCAB_CHUNK, E) float64 slice of the
                                           lm_head (28 MiB at 0.5B): never a float64 lm_head, nor (B, T, V) logits

How (``layerwise_float64`` and ``streamed_logprobs``):

- each cast unit (a module that owns parameters, or a peft LoRA layer with its base layer and adapters, since peft
  casts a LoRA layer's input to lora_A's dtype) runs in float64 between a forward pre-hook and a forward hook that
  swap its ``param.data`` to a float64 copy and back to the ORIGINAL tensor: nothing is rounded, and an optimizer
  holding the weights sees them unchanged. Both the HF forward and the lean one (lean/forward.py) call these units.
- the embedding's output is cast, not its matrix (a lookup is exact); the other buffers (rotary) are small and cast
  for the block; RMSNorms compute in float64 (``_rms_norm_float64``: HF's compute in float32).
- the lm_head is never called: ``headless`` makes it return its input, and ``streamed_head_logprobs`` takes only the
  kept response positions through it, VOCAB_CHUNK rows of its weight at a time, with a running logsumexp.

``streamed_logprobs`` is the same head for a forward in another precision (update_shift's bf16 autocast forward).
A model it cannot stream (``stream_unsupported``: not a Qwen2, or a head or embedding that is not a plain Linear or
Embedding, as with LoRA on them) falls back to ``in_float64``: correct, at the whole model's float64 cost.

Shape legend: B rows, L kept columns (prompt + response), T response tokens, t kept response columns, n kept response
tokens, E hidden size, V vocabulary, c vocabulary chunk.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from lopti_lab.lean.forward import causal_lm
from lopti_lab.probes._common import _response_logp
from lopti_lab.rollout import kept_columns, response_logprobs, shared_prompt_forward, use_lean

__all__ = [
    "TOKEN_CHUNK",
    "VOCAB_CHUNK",
    "float64_response_logprobs",
    "headless",
    "in_float64",
    "layerwise_float64",
    "stream_unsupported",
    "streamed_head_logprobs",
    "streamed_logprobs",
]

VOCAB_CHUNK = 4096
"""Rows of the lm_head weight per step of the streamed head (a (VOCAB_CHUNK, E) slice in the head's dtype)."""
TOKEN_CHUNK = 1024
"""Response tokens per tile of the streamed head: with VOCAB_CHUNK, a 32 MB float64 block of logits."""


def _rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """An RMSNorm in the input's own dtype (HF's Qwen2/Llama norms compute in float32 whatever the input is)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "variance_epsilon") and isinstance(m.weight, torch.Tensor)]


@contextmanager
def in_float64(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` in float64 inside the block, then give every parameter and buffer back its own dtype.

    float32 -> float64 -> float32 (and bf16 -> float64 -> bf16) round-trips bit for bit, so the weights, and an
    optimizer holding them, are exactly as before. RMSNorm modules (those with a ``variance_epsilon``, as in Qwen2,
    Llama and Mistral), which transformers computes in float32 even for float64 inputs, run in float64 too inside
    the block. For measurements only: about 2x a float32 forward on a CPU, and twice the model's float32 memory
    (``layerwise_float64`` casts one module at a time). Take every gradient before entering it: a dtype change gives
    each weight a new gradient accumulator, so a graph built before the block finds no weight (``autograd.grad``
    returns None for all of them)."""
    saved = {id(t): (t, t.dtype) for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()}
    norms = _norms(model)
    for t, _ in saved.values():
        t.data = t.data.double()
    for m in norms:
        m.forward = types.MethodType(_rms_norm_float64, m)
    try:
        yield model
    finally:
        for m in norms:
            del m.forward  # back to the class's own forward
        for t, dtype in saved.values():
            t.data = t.data.to(dtype)


# ----------------------------------------------------------------------------------------------------------------------
# One module at a time in float64


def stream_unsupported(model: nn.Module) -> str | None:
    """None when ``float64_response_logprobs`` can stream ``model`` (one module in float64 at a time, the head in
    vocabulary chunks), else why not (it then casts the whole model, ``in_float64``)."""
    base = causal_lm(model)
    if not isinstance(base, Qwen2ForCausalLM):
        return f"{type(base).__name__} is not a Qwen2ForCausalLM (its head is known to be a plain linear map)"
    head, embed = base.lm_head, base.model.embed_tokens
    if type(head) is not nn.Linear or type(embed) is not nn.Embedding:
        return f"the lm_head ({type(head).__name__}) or embedding ({type(embed).__name__}) is wrapped (LoRA on it)"
    if any("forward" in vars(m) for m in (model, base, head, embed)):
        return "a forward was replaced on the instance"
    return None


def _cast_units(module: nn.Module, skip: tuple[nn.Module, ...]) -> list[nn.Module]:
    """The smallest modules whose parameters are used together: a peft LoRA layer (base layer and adapters), else a
    module that owns parameters (with everything under it); ``skip`` and what lies under it left out."""
    if any(module is s for s in skip):
        return []
    is_lora = hasattr(module, "base_layer") and hasattr(module, "lora_A")
    if is_lora or any(True for _ in module.parameters(recurse=False)):
        return [module]
    return [unit for child in module.children() for unit in _cast_units(child, skip)]


def _floats(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]


class _Swaps:
    """``param.data`` swapped to float64 copies and back: a stack of (owner, swaps) of the unit calls now running."""

    def __init__(self):
        self.stack: list[tuple[object, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def cast(self, owner: object, tensors: list[torch.Tensor]) -> None:
        swapped = [(t, t.data) for t in tensors if t.dtype != torch.float64]
        for t, data in swapped:
            t.data = data.double()
        self.stack.append((owner, swapped))

    def restore(self, owner: object | None = None) -> None:
        """Give back the latest swaps (only if ``owner`` made them: a pre-hook that raised cast nothing)."""
        if self.stack and (owner is None or self.stack[-1][0] is owner):
            for t, data in self.stack.pop()[1]:
                t.data = data  # the original tensor object: not a rounded copy


@contextmanager
def layerwise_float64(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block each cast unit of ``model`` (``_cast_units``) computes in float64 during its own call only,
    the embedding returns float64, RMSNorms compute in float64 and the other floating buffers (rotary) are float64.
    Outside a unit's call every weight is its original tensor. The lm_head and embedding matrices are never cast:
    call the head through ``streamed_head_logprobs``. Take every gradient before entering (as for ``in_float64``).

    Example: ``with layerwise_float64(m), torch.no_grad(): h = causal_lm(m).model(ids).last_hidden_state`` gives
    the float64 hidden states of ``in_float64``'s forward, with at most one Linear's weights in float64 at a time."""
    base = causal_lm(model)
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    swaps, hooks = _Swaps(), []
    loose = [t for t in model.buffers() if t.is_floating_point()]  # in no unit: rotary's inv_freq
    for unit in _cast_units(model, (embed, head)):
        tensors = _floats(unit)
        loose = [t for t in loose if all(t is not u for u in tensors)]
        hooks.append(unit.register_forward_pre_hook(lambda m, args, ts=tensors: swaps.cast(m, ts)))
        hooks.append(unit.register_forward_hook(lambda m, args, out: swaps.restore(m), always_call=True))
    hooks.append(embed.register_forward_hook(lambda m, args, out: out.double()))  # a lookup: exact
    norms = _norms(model)
    for m in norms:
        m.forward = types.MethodType(_rms_norm_float64, m)
    swaps.cast(model, loose)
    try:
        yield model
    finally:
        for hook in hooks:
            hook.remove()
        for m in norms:
            del m.forward
        while swaps.stack:  # the loose buffers, and any unit whose forward raised before its hook
            swaps.restore()


@contextmanager
def headless(model: nn.Module) -> Iterator[nn.Linear]:
    """Inside the block the lm_head returns its input (the final hidden states), so a forward yields (..., E) hidden
    states in place of (..., V) logits; yields the head, whose weight ``streamed_head_logprobs`` reads."""
    head = causal_lm(model).get_output_embeddings()
    head.forward = lambda hidden: hidden
    try:
        yield head
    finally:
        del head.forward


# ----------------------------------------------------------------------------------------------------------------------
# The head in vocabulary chunks


def streamed_head_logprobs(
    head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, cast: torch.dtype | None = None
) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[targets], VOCAB_CHUNK logits of TOKEN_CHUNK tokens at a time, with a
    running logsumexp: lse = max + log sum exp(z - max), the max and the sum rescaled as each chunk arrives.

    hidden: (n, E); targets: (n,). ``cast``: the dtype each weight slice is cast to (float64), or None to leave the
    matmul's dtypes to the ambient autocast (a bf16 forward). The logits are taken to at least float32 before the
    temperature, as ``objective.token_logprobs`` does. Returns (n,) in that dtype.
    """
    n, vocab = hidden.shape[0], head.weight.shape[0]
    out = []
    for rows in torch.arange(n, device=hidden.device).split(TOKEN_CHUNK):
        h, y = hidden[rows], targets[rows]  # (n', E), (n',)
        top = picked = total = None
        for start in range(0, vocab, VOCAB_CHUNK):
            w = head.weight[start : start + VOCAB_CHUNK]  # (c, E)
            b = None if head.bias is None else head.bias[start : start + VOCAB_CHUNK]
            if cast is not None:
                w, b = w.to(cast), None if b is None else b.to(cast)
            logits = F.linear(h, w, b)  # (n', c)
            z = logits.to(torch.promote_types(logits.dtype, torch.float32)).div_(temperature)  # (n', c)
            del logits  # one (n', c) block alive at a time
            if top is None:
                top, total = torch.full_like(z[:, 0], -math.inf), torch.zeros_like(z[:, 0])
                picked = torch.empty_like(z[:, 0])
            hit = (y >= start) & (y < start + w.shape[0])  # (n',) tokens whose target is in this chunk
            picked[hit] = z[hit, y[hit] - start]
            new_top = torch.maximum(top, z.amax(1))  # (n',)
            total = total * (top - new_top).exp() + z.sub_(new_top[:, None]).exp_().sum(1)
            top = new_top
        out.append(picked - (top + total.log()))
    return torch.cat(out) if out else hidden.new_zeros(0)  # (n,)


def streamed_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    fast_path: str = "auto",
    position_ids: torch.Tensor | None = None,
    cast: torch.dtype | None = None,
) -> torch.Tensor:
    """(B, T) response log-probs, 0 off the mask, from the model's body in whatever precision the caller set up
    (``layerwise_float64``, an autocast) and the head streamed (``streamed_head_logprobs``) over the kept response
    tokens only. The body runs as ``rollout.response_logprobs`` runs it (padding columns cut; the lean shared-prompt
    forward where ``use_lean``), or, given ``position_ids`` (B, P + T), as the model's own forward over the whole
    batch (``probes._common._response_logp``). No grad; call it in eval mode."""
    keep = response_mask.bool()  # (B, T)
    base = causal_lm(model)
    with headless(model) as head, torch.no_grad():
        if position_ids is not None:
            t = keep.shape[1]
            out = base.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False)  # fmt: skip
            hidden, targets = out.last_hidden_state[:, -(t + 1) : -1], input_ids[:, -t:]  # (B, t, E), (B, t)
        else:
            ids, mask, n_prompt, t = kept_columns(input_ids, attention_mask, response_mask)
            if use_lean(model, fast_path):
                lengths = response_mask.sum(1).long()  # (B,)
                hidden = shared_prompt_forward(model, ids, mask, n_prompt, lengths)  # (B, t, E): the head is off
            else:
                positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
                out = base.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
                hidden = out.last_hidden_state[:, -(t + 1) : -1]  # (B, t, E): position L - t - 1 + j predicts j
            targets = ids[:, -t:]  # (B, t)
        kept = keep[:, :t]  # (B, t)
        logp = streamed_head_logprobs(head, hidden[kept], targets[kept], temperature, cast)  # (n,)
    full = torch.zeros(keep.shape, dtype=logp.dtype, device=logp.device)  # (B, T)
    full[:, :t][kept] = logp
    return full


def float64_response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    fast_path: str = "auto",
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, T) float64 log pi(response token | prefix), 0 off the mask, no grad: ``rollout.response_logprobs`` (or,
    given ``position_ids``, the model's own forward over the whole batch) as ``in_float64`` computes it, in the
    memory of the module docstring: ``layerwise_float64`` and ``streamed_logprobs``. A model that
    ``stream_unsupported`` names takes ``in_float64`` itself. Call it in eval mode."""
    if stream_unsupported(model) is None:
        with layerwise_float64(model):
            return streamed_logprobs(model, input_ids, attention_mask, response_mask, temperature, fast_path,
                                     position_ids, cast=torch.float64)  # fmt: skip
    mask = response_mask.bool()
    with in_float64(model), torch.no_grad():
        if position_ids is not None:
            return _response_logp(model, input_ids, attention_mask, mask.shape[1], position_ids, temperature) * mask
        return response_logprobs(model, input_ids, attention_mask, response_mask, temperature, fast_path=fast_path)[0]
