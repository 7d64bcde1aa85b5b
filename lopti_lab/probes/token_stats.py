"""Per-token statistics of the response tokens (probability, entropy, exact logit-gradient norm), without a backward
pass (see lopti_lab.probes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

from lopti_lab.bins import DEFAULT_BINS, bin_index
from lopti_lab.probes._common import (
    _check_batch,
    _response_logits,
)

# ----------------------------------------------------------------------------------------------------------------------
# Per-token statistics, without a backward pass


@dataclass
class TokenStats:
    """Per response token (B, T): the token id and its log-probability, probability, entropy of the distribution it was
    drawn from, and ||e_y - softmax(z)||, the exact norm of its gradient through the logits (theory.logit_grad_norm).
    Entries outside `mask` hold the values for whatever token sits there (padding); use the mask."""

    tokens: torch.Tensor
    logp: torch.Tensor
    prob: torch.Tensor
    entropy: torch.Tensor
    grad_norm: torch.Tensor
    mask: torch.Tensor
    vocab_size: int

    def to_frame(self, bins: Sequence[float] = DEFAULT_BINS) -> pd.DataFrame:
        """One row per masked token: seq, pos, token, logp, prob, entropy, grad_norm, bin (Fig. 2a's scatter)."""
        seq, pos = self.mask.nonzero(as_tuple=True)
        pick = {k: getattr(self, k)[seq, pos].detach().double().cpu().numpy() for k in ("logp", "prob", "entropy")}
        return pd.DataFrame(
            {
                "seq": seq.cpu().numpy(),
                "pos": pos.cpu().numpy(),
                "token": self.tokens[seq, pos].cpu().numpy(),
                **pick,
                "grad_norm": self.grad_norm[seq, pos].detach().double().cpu().numpy(),
                "bin": bin_index(self.prob[seq, pos].detach(), bins).cpu().numpy(),
            }
        )


@torch.no_grad()
def token_stats(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,
    max_chunk: int = 2**25,
) -> TokenStats:
    """Per-token log-prob, prob, entropy and exact logit-gradient norm of the response tokens, in one no-grad forward.

    The response is the last T = response_mask.shape[1] positions of `input_ids` (module docstring). `temperature`
    divides the logits as the rollout did (the paper's pi_old uses the rollout temperature). `position_ids` default to
    the attention mask's running count, as `generate` uses for left-padded prompts. Softmax statistics are computed
    over chunks of sequences of at most `max_chunk` logits, in float32 (float64 for a float64 model).

    grad_norm is ||e_y - softmax(z / temperature)||: for y = 0 and logits (0, 0) it is sqrt(.5); it lies in the wedge
    `theory.grad_norm_bounds(prob, V)`.
    """
    mask, T = _check_batch(input_ids, attention_mask, response_mask)
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    logits = _response_logits(model, input_ids, attention_mask, T, position_ids)  # (B, T, V)
    tokens = input_ids[:, -T:]  # (B, T)
    B, _, V = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = {k: torch.empty(B, T, dtype=dtype, device=logits.device) for k in ("logp", "entropy", "grad_norm")}
    rows = max(1, max_chunk // max(1, T * V))
    for b0 in range(0, B, rows):
        z = logits[b0 : b0 + rows].to(dtype) / temperature  # (b, T, V)
        y = tokens[b0 : b0 + rows, :, None]  # (b, T, 1)
        logp_all = z.log_softmax(-1)
        p_all = logp_all.exp()
        out["logp"][b0 : b0 + rows] = logp_all.gather(-1, y).squeeze(-1)
        out["entropy"][b0 : b0 + rows] = -(p_all * logp_all).sum(-1)
        del logp_all
        p_all.scatter_add_(-1, y, torch.full_like(p_all[..., :1], -1.0))  # p - e_y, as theory.logit_grad_norm
        out["grad_norm"][b0 : b0 + rows] = torch.linalg.vector_norm(p_all, dim=-1)
    return TokenStats(
        tokens=tokens,
        logp=out["logp"],
        prob=out["logp"].exp(),
        entropy=out["entropy"],
        grad_norm=out["grad_norm"],
        mask=mask,
        vocab_size=V,
    )
