"""The paper's Fig. 3 as its code measures it: at an RL step, the share of the positive-advantage response tokens
whose probability the step's real update raised, per bin of their rollout probability (docs/paper.md §5).

The paper's code keeps the rollout's log-probs, runs the real update (both Lopti stages), recomputes the log-probs on
the same batch, and bins ``delta_p = exp(new) - exp(old)`` of the A > 0 tokens (the advantages before AR) by
probability quartiles and deciles. Its forwards run in bf16 (FSDP mixed precision), where a token near p = 1 often
cannot show a move at all: how such zeros were counted is not stated. So this measures both ways, in two precisions:

    precision "float64": the log-probs of float64 forwards before and after the update (a move of 1e-12 shows);
              "bfloat16": bf16 autocast forwards (matmuls in bf16, as mixed precision computes), as the paper's code;
              on a CPU each matmul's bf16 operands are multiplied in float32 and the product rounded to bf16
              (``Bf16ByFloat32``: a GPU's bf16 arithmetic, 5x faster here than torch's CPU bf16 kernels, which give
              the same product on 99.99% of elements);
    correct        share of the bin's A > 0 tokens whose log-prob rose (a token that did not move counts as not up)
    correct_moved  the same among the tokens that moved (an unmoved token is left out)
    zero_share     share that did not move at all (log-prob unchanged to the last bit)

Metric keys: ``fig3/{precision}/{binning}/{stat}_bin{i}`` with binning "q" (quartiles, ``bins.DEFAULT_BINS``) or "d"
(deciles, ``bins.DECILES``), and ``fig3/{binning}/n_bin{i}`` the bin's A > 0 token count. Only rows with a positive
advantage are forwarded (at most ``TrainConfig.shift_rows`` of them), so the measurement costs four forwards of those
rows: two float64 (2.5x a float32 forward on a CPU) and two bf16 (about half a float32 forward, with
``Bf16ByFloat32``). Each holds one module's weights in float64 (or bf16) at a time and runs the lm_head over the kept
response tokens in vocabulary chunks (``probes.float64``): no whole-model cast, no (k, T, V) logits; its peak stays
under a training micro-step's on the same rows (tests/test_float64_memory.py).

Shape legend: k rows with A > 0, T response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lopti_lab.bins import DECILES, DEFAULT_BINS, bin_index
from lopti_lab.probes.float64 import float64_response_logprobs, stream_unsupported, streamed_logprobs
from lopti_lab.rollout import response_logprobs

__all__ = ["BINNINGS", "PRECISIONS", "Bf16ByFloat32", "fig3_metrics", "positive_rows", "update_logprobs"]

PRECISIONS = ("float64", "bfloat16")
BINNINGS: dict[str, tuple[float, ...]] = {"q": DEFAULT_BINS, "d": DECILES}


class Bf16ByFloat32(TorchDispatchMode):
    """Inside ``torch.autocast(dtype=torch.bfloat16)``: each matmul that autocast gives bf16 operands is computed in
    float32 from those bf16 values and its result rounded to bf16: bf16 in, float32 accumulation, bf16 out, the
    arithmetic of a GPU's bf16 matmuls (and of FSDP's mixed precision forward). On a CPU without bf16 hardware,
    torch's own bf16 matmul kernels give the same result on 99.99% of elements (one bf16 ulp off on the rest, from a
    different summation order; tests/test_update_shift.py), in about 5x the time on 8 of the lab model's responses.
    The other ops (attention, softmax, norms) run as autocast runs them."""

    OPS = frozenset(
        {
            torch.ops.aten.linear.default,
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default,
            torch.ops.aten.matmul.default,
        }
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            wide = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def positive_rows(advantages: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    """The rows whose sequence advantage (before AR) is positive: (B,) -> (k,) indices; at most ``limit`` of them,
    evenly spaced over the positive rows in batch order (so over the groups), without drawing a random number.

    >>> positive_rows(torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, 0.3, 0.1]), limit=3).tolist()
    [0, 4, 6]
    """
    rows = (advantages > 0).nonzero()[:, 0]
    if limit is None or len(rows) <= limit:
        return rows
    pick = torch.linspace(0, len(rows) - 1, limit, device=rows.device).round().long()  # (limit,) distinct
    return rows[pick]


def update_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    fast_path: str = "auto",
) -> dict[str, torch.Tensor]:
    """{precision: (k, T) log-probs of the rows' response tokens} under the model as it is now, no grad, eval mode.

    Both forwards are ``rollout.response_logprobs``'s body with the lm_head streamed over the kept response tokens
    in vocabulary chunks (``probes.float64``): the float64 one holds one module's weights in float64 at a time
    (``float64_response_logprobs``), the bf16 one computes each chunk's logits under the autocast, so neither a
    (k, T, V) logits tensor nor a cast copy of the whole lm_head ever exists."""
    was_training = model.training
    model.eval()
    out = {}
    device = next(model.parameters()).device.type
    try:
        out["float64"] = float64_response_logprobs(model, input_ids, attention_mask, response_mask, temperature,
                                                   fast_path)  # fmt: skip
        with torch.autocast(device, dtype=torch.bfloat16), Bf16ByFloat32() if device == "cpu" else nullcontext():
            out["bfloat16"] = _bf16_logprobs(model, input_ids, attention_mask, response_mask, temperature, fast_path)
    finally:
        model.train(was_training)
    return out


def _bf16_logprobs(model, input_ids, attention_mask, response_mask, temperature: float, fast_path: str):
    """(k, T) float32 log-probs of a bf16 autocast forward (the ambient autocast), the head streamed where the
    model allows it (``stream_unsupported``), else ``rollout.response_logprobs`` whole."""
    if stream_unsupported(model) is None:
        return streamed_logprobs(model, input_ids, attention_mask, response_mask, temperature, fast_path)
    with torch.inference_mode():
        logp = response_logprobs(model, input_ids, attention_mask, response_mask, temperature, fast_path=fast_path)
    return logp[0].float().clone()  # out of inference mode


def fig3_metrics(
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    p_old: torch.Tensor,
    mask: torch.Tensor,
    binnings: Mapping[str, Sequence[float]] = BINNINGS,
) -> dict[str, float]:
    """The per-bin counts of the module docstring from log-probs taken before and after one update.

    before, after: {precision: (k, T)}; p_old: (k, T) the rollout probabilities that bin the tokens; mask: (k, T)
    the response tokens (all of these rows' tokens have A > 0). Worked example, one bin, tokens moving by
    dlogp = (+1e-9, 0, -1e-9, +2e-9): correct 2/4, correct_moved 2/3, zero_share 1/4.
    """
    keep = mask.bool()
    out: dict[str, float] = {}
    for name, edges in binnings.items():
        bins = bin_index(p_old.double(), edges)[keep]  # (n,)
        n = torch.bincount(bins, minlength=len(edges) - 1)  # (K,)
        out |= {f"fig3/{name}/n_bin{i}": float(c) for i, c in enumerate(n.tolist())}
        for precision in before:
            move = (after[precision].double() - before[precision].double())[keep]  # (n,)
            up = torch.bincount(bins[move > 0], minlength=len(n))
            zero = torch.bincount(bins[move == 0], minlength=len(n))
            for i, (n_i, up_i, zero_i) in enumerate(zip(n.tolist(), up.tolist(), zero.tolist(), strict=True)):
                moved = n_i - zero_i
                key = f"fig3/{precision}/{name}"
                out[f"{key}/correct_bin{i}"] = up_i / n_i if n_i else math.nan
                out[f"{key}/correct_moved_bin{i}"] = up_i / moved if moved else math.nan
                out[f"{key}/zero_share_bin{i}"] = zero_i / n_i if n_i else math.nan
    return out
