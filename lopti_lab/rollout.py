"""Prompts in, groups of sampled completions out: token ids, masks, texts and the rollout log-probabilities.

    rollout = sample(model, tokenizer, prompts, group_size=8, max_new_tokens=512, temperature=0.7)
    rollout.old_logp          # (B, T) log pi_old of each sampled token at the sampling temperature, detached

Layout of one row (the contract the trainer and the probes share): ``input_ids = [prompt | response]`` of length
L = P + T, the prompt left-padded to P, the response right-padded to T, so the response is always the LAST T
positions and the logits at input position L - T - 1 + t predict response token t.

Two paths compute the same thing (``fast_path``, FAST_PATHS): on a CPU a Qwen2 takes the lean path (lean/decode.py's
loop, lean/forward.py's shared-prompt forward), anything else HF generate and forward.

Shape legend: B rows = prompts x G (a prompt's G completions are contiguous), P prompt tokens, T response tokens,
V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from lopti_lab.lean.decode import lean_generate
from lopti_lab.lean.forward import causal_lm, lean_unsupported, shared_prompt_logits
from lopti_lab.objective import token_logprobs

__all__ = [
    "FAST_PATHS",
    "Rollout",
    "add_logprobs",
    "kept_columns",
    "response_logprobs",
    "sample",
    "shared_prompt_forward",
    "stop_token_ids",
    "use_lean",
]


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


FAST_PATHS = ("auto", "lean", "hf")
"""How a model is run: "auto" takes lopti_lab's lean Qwen2 path (lean/decode.py's loop, lean/forward.py's shared-prompt
forward) wherever it applies (``fast.forward.lean_unsupported``: a Qwen2 on a CPU), HF generate / forward elsewhere;
"lean" requires it (ValueError naming why not); "hf" is HF's generate and forward everywhere."""


@dataclass(frozen=True)
class SamplingSpec:
    """How completions are drawn and scored: what ``sample``, ``add_logprobs`` and ``evaluate.evaluate`` take
    (``TrainConfig.sampling()`` builds the training run's)."""

    max_new_tokens: int = 256
    """response length cap"""
    temperature: float = 1.0
    """sampling temperature; the rollout log-probs are taken at it too"""
    top_p: float = 1.0
    """nucleus sampling mass (1 = off)"""
    max_prompt_tokens: int | None = None
    """fail if a prompt is longer; None = no check"""
    batch_size: int | None = None
    """rows per generate call (None: CPU_GENERATE_ROWS on a CPU, LEAN_CACHE_BYTES' worth on the lean path, all on a
    GPU)"""
    logprob_batch_size: int | None = None
    """rows per no-grad log-prob forward (None: all)"""
    fast_path: str = "auto"
    """the decoder and forward (FAST_PATHS)"""
    draw: str = "multinomial"
    """how the lean decoder draws a sampled token (``lean.decode.DRAWS``): "multinomial" (HF's draw: the same tokens
    as HF generate under a seed) or "inverse_cdf" (one uniform per row, the same law, faster)"""

    @classmethod
    def of(cls, spec: SamplingSpec | None, settings: dict) -> SamplingSpec:
        """``spec`` (default: the defaults) with the fields given as keywords replaced."""
        return replace(spec or cls(), **settings)


def use_lean(model: torch.nn.Module, fast_path: str = "auto") -> bool:
    """Whether ``model`` runs on the lean path under ``fast_path`` (FAST_PATHS), in its current train/eval mode."""
    if fast_path not in FAST_PATHS:
        raise ValueError(f"fast_path must be one of {FAST_PATHS}, got {fast_path!r}")
    if fast_path == "hf":
        return False
    reason = lean_unsupported(model)
    if reason is not None and fast_path == "lean":
        raise ValueError(f"fast_path='lean' cannot run this model: {reason}")
    return reason is None


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    before_forward: Callable[[int], None] | None = None,
    fast_path: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response token t | prefix) for the last T positions of each row, in one forward pass.

    Shared by the rollout's log-prob pass (no grad) and the update (with grad), so old and new log-probs come from
    the same arithmetic. Padding columns that every row of this batch has (left of the prompts, right of the longest
    response) are cut before the forward, and the lm_head runs on the response positions only, never on the prompt.

    On the lean path (``use_lean``) rows with the same prompt (a GRPO group) share one forward of it
    (``fast.forward.shared_prompt_logits``): the same function, (G - 1) / G of the prompt's work saved. A
    ``before_forward`` hook is called with the kept response length t before the forward, whose rows are then
    [prompt | first t response columns] (a gradient probe's ``set_tokens`` goes there); on the lean path that
    forward computes each row's last prompt position in the row and announces its blocks of positions
    (``lean.forward.SEGMENT``), which is what the probe splits by.

    input_ids, attention_mask: (B, P + T); response_mask: (B, T). Returns logp (B, T) and entropy (B, T) or None,
    zero on padding.
    """
    total_t = response_mask.shape[1]
    ids, mask, n_prompt, t = kept_columns(input_ids, attention_mask, response_mask)  # (B, L') each
    if before_forward is not None:
        before_forward(t)
    if use_lean(model, fast_path):
        lengths = response_mask.sum(1).long()  # (B,)
        logits = shared_prompt_forward(model, ids, mask, n_prompt, lengths, own_last=before_forward is not None)
        logp, entropy = token_logprobs(logits, ids[:, -t:], temperature, with_entropy)  # (B, t)
    else:
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=t + 1, use_cache=False)
        # logits at position L' - t - 1 + j predict response token j; the last position predicts nothing (its row is
        # computed, and dropped, so the logits stay one contiguous (B, t + 1, V) tensor)
        targets = F.pad(ids[:, -t:], (0, 1))  # (B, t + 1)
        logp, entropy = token_logprobs(out.logits, targets, temperature, with_entropy)  # (B, t + 1)
        logp, entropy = logp[:, :-1], None if entropy is None else entropy[:, :-1]  # (B, t)
    logp = F.pad(logp, (0, total_t - t)) * response_mask  # (B, T)
    if entropy is not None:
        entropy = F.pad(entropy, (0, total_t - t)) * response_mask  # (B, T)
    return logp, entropy


def kept_columns(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor):
    """The columns a response forward needs: from the first column some prompt uses to the end of the longest
    response. Returns ids, mask (B, L'), the prompt length in them and t, the kept response columns; one host sync.

    Example: prompts left-padded to 5 of which every row leaves the first 2 empty, responses padded to 6 of which
    the longest has 4 -> columns 2 .. 5 + 4, prompt length 3, t = 4."""
    total_t = response_mask.shape[1]
    n_prompt = input_ids.shape[1] - total_t
    first = attention_mask[:, :n_prompt].any(0).int().argmax()  # first column some prompt uses
    columns = torch.arange(1, total_t + 1, device=response_mask.device)  # (T,)
    longest = torch.where(response_mask.bool().any(0), columns, 0).max().clamp(min=1)  # longest response here
    start, t = torch.stack([first, longest]).tolist()  # the slice's bounds: one host sync, not three
    return input_ids[:, start : n_prompt + t], attention_mask[:, start : n_prompt + t], n_prompt - start, t


def shared_prompt_forward(
    model, ids: torch.Tensor, mask: torch.Tensor, n_prompt: int, lengths, own_last: bool = False
) -> torch.Tensor:
    """Logits (B, t, V) predicting the response columns of ids (B, n_prompt + t), each distinct prompt (its ids and
    padding) computed once; lengths (B,): the real response tokens of each row; ``own_last``: as
    ``shared_prompt_logits``."""
    prompt_ids, prompt_mask = ids[:, :n_prompt], mask[:, :n_prompt]  # (B, P)
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # (B, 2P)
    distinct, row_prompt = torch.unique(keys, dim=0, return_inverse=True)  # (n, 2P), (B,)
    prompt_ids, prompt_mask = distinct[:, :n_prompt], distinct[:, n_prompt:]
    return shared_prompt_logits(model, prompt_ids, prompt_mask, row_prompt, ids[:, n_prompt:], lengths, own_last)


def add_logprobs(
    model: torch.nn.Module,
    rollout: Rollout,
    spec: SamplingSpec | None = None,
    *,
    with_entropy: bool = True,
    reference: Callable | None = None,
    policy: bool = True,
    **settings,
) -> Rollout:
    """Fill ``rollout.old_logp`` and ``entropy`` (``policy=False``: leave them as they are) and, given a
    ``models.Reference``, ``ref_logp``, in no-grad forwards of ``spec.logprob_batch_size`` rows at the sampling
    temperature (the paper's code divides the logits by it too). ``settings``: SamplingSpec fields to replace."""
    spec = SamplingSpec.of(spec, settings)
    temperature, batch_size, fast_path = spec.temperature, spec.logprob_batch_size, spec.fast_path
    input_ids, attention_mask, mask = rollout.input_ids, rollout.attention_mask, rollout.response_mask
    step = batch_size or len(rollout)

    def run(module, entropy: bool):
        parts = [
            response_logprobs(
                module,
                input_ids[i : i + step],
                attention_mask[i : i + step],
                mask[i : i + step],
                temperature,
                entropy,
                fast_path=fast_path,
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
                old_logp, entropy = run(model, entropy=with_entropy)
            if reference is not None:
                with reference() as ref_model:
                    ref_logp, _ = run(ref_model, entropy=False)
    finally:
        model.train(was_training)
    # clones leave inference mode, so the update can use these tensors inside autograd
    if policy:
        rollout.old_logp = old_logp.clone()
        rollout.entropy = None if entropy is None else entropy.clone()
    rollout.ref_logp = None if ref_logp is None else ref_logp.clone()
    return rollout


CPU_GENERATE_ROWS = 64
"""Rows per HF generate call on a CPU when the caller sets none: HF copies its KV cache at every token, so larger calls
outgrow the CPU's caches (the fastest size measured: benchmarks/README.md). The lean decoder writes its cache in place,
so it takes as many rows per call as LEAN_CACHE_BYTES of cache holds."""

LEAN_CACHE_BYTES = 2**30
"""KV-cache budget of one lean decode call (rows per call when the caller sets none): fewer, wider calls pay the cost of
reading the weights once per token fewer times (benchmarks/README.md)."""


def _lean_rows(model, n_prompt: int, max_new_tokens: int, group_size: int = 1) -> int:
    """Rows whose KV cache fits LEAN_CACHE_BYTES: every layer's keys and values at max_new_tokens positions per row
    and P per prompt, which its group_size rows share."""
    config = causal_lm(model).config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    per_row = per_position * (n_prompt / group_size + max_new_tokens) * next(model.parameters()).element_size()
    return max(1, int(LEAN_CACHE_BYTES // per_row))


def sample(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    group_size: int = 1,
    spec: SamplingSpec | None = None,
    *,
    greedy: bool = False,
    with_logprobs: bool = True,
    with_entropy: bool = True,
    reference: Callable | None = None,
    **settings,
) -> Rollout:
    """Sample ``group_size`` completions of each prompt (KV cache, left padding, stop at EOS).

    Prompts are tokenized raw (no special tokens added: the K&K prompt strings already hold their chat markup). The
    sampling distribution is softmax(logits / temperature) restricted to the top-p nucleus; every other processor a
    checkpoint's generation_config may carry (Qwen's top_k = 20, repetition_penalty = 1.05) is switched off, so the
    rollout log-probs, at the same temperature, describe what was sampled (top-p aside, as in the paper's code).
    ``greedy`` decodes argmax (evaluation). ``reference``: a ``models.Reference`` for ``ref_logp``. ``spec``: how to
    sample (``SamplingSpec``); ``settings``: its fields to replace (``sample(..., max_new_tokens=64)``).

    ``spec.fast_path`` (FAST_PATHS) picks the decoder: on the lean path ``decode.lean_generate`` (each prompt prefilled
    once for its group, finished rows dropped), whose sampling logits also give ``old_logp`` and ``entropy`` with no
    second forward; elsewhere HF generate, then a log-prob forward (``add_logprobs``). Both select tokens with the same
    arithmetic (tests/test_decode.py).

    ``spec.batch_size`` caps the rows per generate call, ``logprob_batch_size`` the rows per log-prob forward (GPU
    memory). On a CPU, batch_size=None means CPU_GENERATE_ROWS rows per HF call, or on the lean path as many as
    LEAN_CACHE_BYTES of KV cache holds (on a GPU: all rows in one call).
    ``spec.draw``: how the lean decoder draws a sampled token (``lean.decode.DRAWS``: "multinomial", HF's draw, or
    "inverse_cdf", one uniform per row); HF's path always draws with ``torch.multinomial``.
    """
    spec = SamplingSpec.of(spec, settings)
    max_new_tokens, max_prompt_tokens, batch_size = spec.max_new_tokens, spec.max_prompt_tokens, spec.batch_size
    if group_size < 1 or not prompts:
        raise ValueError(f"need at least one prompt and group_size >= 1, got {len(prompts)} prompts, G={group_size}")
    device = next(model.parameters()).device
    encoded = tokenizer(list(prompts), add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    if max_prompt_tokens is not None and encoded["attention_mask"].sum(1).max() > max_prompt_tokens:
        longest = int(encoded["attention_mask"].sum(1).max())
        raise ValueError(f"max_prompt_tokens: a prompt has {longest} tokens, more than {max_prompt_tokens}")
    unique_ids, unique_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)  # (n, P)
    prompt_ids = unique_ids.repeat_interleave(group_size, dim=0)  # (B, P)
    prompt_mask = unique_mask.repeat_interleave(group_size, dim=0)  # (B, P)
    stops = stop_token_ids(model, tokenizer)
    n_rows = prompt_ids.shape[0]
    was_training = model.training
    model.eval()
    try:
        lean = use_lean(model, spec.fast_path)
        if batch_size is None and lean:
            fit = _lean_rows(model, prompt_ids.shape[1], max_new_tokens, group_size)
            batch_size = min(n_rows, max(group_size, fit))
        elif batch_size is None:
            batch_size = n_rows if device.type == "cuda" else min(n_rows, CPU_GENERATE_ROWS)
        decode = {"max_new_tokens": max_new_tokens, "temperature": spec.temperature, "top_p": spec.top_p,
                  "greedy": greedy}  # fmt: skip
        with torch.inference_mode():
            if lean:
                decoded = _lean_generate(model, unique_ids, unique_mask, group_size, batch_size, stops,
                                         tokenizer.pad_token_id, with_logprobs, draw=spec.draw, **decode)  # fmt: skip
                chunks = [d.response_ids for d in decoded]
            else:
                chunks = _hf_generate(
                    model, prompt_ids, prompt_mask, stops, tokenizer.pad_token_id, batch_size, **decode
                )
    finally:
        model.train(was_training)
    rollout = _assemble(tokenizer, chunks, prompt_ids, prompt_mask, stops, group_size)
    scored = replace(spec, temperature=1.0 if greedy else spec.temperature)
    if lean and with_logprobs:  # pi_old read off the sampling logits: the rollout policy at its temperature
        _decoded_logprobs(rollout, decoded, with_entropy=with_entropy)
        if reference is not None:
            add_logprobs(model, rollout, scored, with_entropy=False, reference=reference, policy=False)
    elif with_logprobs:
        add_logprobs(model, rollout, scored, with_entropy=with_entropy, reference=reference)
    return rollout


def _assemble(tokenizer, chunks: list, prompt_ids, prompt_mask, stops: list[int], group_size: int) -> Rollout:
    """The generated tokens of every call, right-padded into one (B, T) batch, masked up to and including each row's
    first stop token (a row with none ran to max_new_tokens: all real), and decoded."""
    width, pad, device = max(c.shape[1] for c in chunks), tokenizer.pad_token_id, prompt_ids.device
    response_ids = torch.cat([F.pad(c, (0, width - c.shape[1]), value=pad) for c in chunks]).clone()  # (B, T)
    is_stop = torch.isin(response_ids, torch.tensor(stops, device=device))  # (B, T)
    first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), width)  # (B,)
    response_mask = (torch.arange(width, device=device)[None, :] <= first_stop[:, None]).float()  # (B, T)
    rows, ends = response_ids.tolist(), first_stop.tolist()  # one copy to the host, not one per row
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(rows, ends, strict=True)])
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, texts, group_size, is_stop.any(1))


def _decoded_logprobs(rollout: Rollout, decoded: list, *, with_entropy: bool) -> None:
    """pi_old (and the entropy) of the lean decoder's calls, padded to the rollout's width, zero on padding."""
    width, mask = rollout.response_ids.shape[1], rollout.response_mask
    rollout.old_logp = torch.cat([F.pad(d.logp, (0, width - d.logp.shape[1])) for d in decoded]) * mask
    if with_entropy:
        entropy = torch.cat([F.pad(d.entropy, (0, width - d.entropy.shape[1])) for d in decoded])  # (B, T)
        rollout.entropy = entropy * mask


def _lean_generate(model, ids, mask, group_size, rows_per_call, stops, pad_id, with_logprobs, **decode) -> list:
    """lean_generate over prompts (n, P) in calls of whole groups (a group shares its prefill), each call's prompts
    cut to the padding columns they need; one ``decode.Decoded`` per call."""
    per_call = max(1, rows_per_call // group_size)
    out = []
    for i in range(0, len(ids), per_call):
        part_ids, part_mask = ids[i : i + per_call], mask[i : i + per_call]  # (n', P)
        start = int(part_mask.any(0).int().argmax())  # first column some prompt of this call uses
        part = lean_generate(model, part_ids[:, start:], part_mask[:, start:], group_size, stop_ids=stops,
                             pad_id=pad_id, with_logprobs=with_logprobs, **decode)  # fmt: skip
        out.append(part)
    return out


def _hf_generate(model, prompt_ids, prompt_mask, stops, pad_id, batch_size, *, max_new_tokens, temperature, top_p,
                 greedy) -> list[torch.Tensor]:  # fmt: skip
    """HF generate in calls of ``batch_size`` rows; the generated tokens (b, t) of each call."""
    from transformers import GenerationConfig

    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}  # top_k = 0: off
    config = GenerationConfig(
        do_sample=not greedy,
        repetition_penalty=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=stops,
        pad_token_id=pad_id,
        use_cache=True,
        **sampling,
    )
    return [
        model.generate(
            input_ids=prompt_ids[i : i + batch_size],
            attention_mask=prompt_mask[i : i + batch_size],
            generation_config=config,
        )[:, prompt_ids.shape[1] :]  # (b, t) generated tokens only
        for i in range(0, prompt_ids.shape[0], batch_size)
    ]
