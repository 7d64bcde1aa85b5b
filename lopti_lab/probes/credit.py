"""Token credit by probability bin: the one definition of the per-bin metrics that lopti_lab's trainer and the TRL
callback (``integrations.trl_callback.TokenCreditCallback``) both log, under the same names (docs/paper.md §5).

A step's metrics are SUMS per bin (``CreditSums``), so that they add over micro-batches and over processes before
any ratio is taken; ``metrics()`` turns them into the logged floats:

    tokens/share_bin{k}        share of the step's response tokens in bin k (bin = rollout probability pi_old)
    adv/pos_share_bin{k}       share of the step's positive advantage mass, sum of A over A > 0 tokens, in bin k
    adv/neg_share_bin{k}       the same for the negative mass (sum of |A| over A < 0 tokens)
    grad/share_bin{k}          <g_k, g> / ||g||^2 by ``GradientProbe`` (position attribution), the mean over the
                               step's backwards (every process's); ``grad/share_context`` the positions predicting
                               no response token, so bins + context = 1
    clip/low_share_bin{k}      share of bin k's tokens whose ratio is clipped below (A < 0, ratio < 1 - eps_low)
    clip/high_share_bin{k}     share clipped above (A > 0, ratio > 1 + eps_high); both 0 where the ratio is 1
    entropy/mean_bin{k}        mean entropy of the policy's distribution at bin k's tokens
    fig3/{precision}/{b}/correct_bin{k}        the paper's Fig. 3: share of bin k's A > 0 tokens whose log-prob the
                                               step's update raised (an unmoved token counts as not raised)
    fig3/{precision}/{b}/correct_moved_bin{k}  the same among the tokens that moved (ties left out)
    fig3/{precision}/{b}/zero_share_bin{k}     share that did not move at all (ties, reported apart)
    fig3/{b}/n_bin{k}                          the bin's A > 0 token count

with b = "q" for the quarters (``bins.DEFAULT_BINS``), "d" for deciles, "b" for other edges: the Fig. 3 keys are
``probes.update_shift.fig3_metrics``'s, and a test holds the two equal. A bin with no token gets NaN; a quantity
not measured this step (no probe, no entropy, no Fig. 3) gets no key.

Worked example, one row, quarters: p_old = (.1, .6, .9), A = +1 on every token -> tokens/share = (1/3, 0, 1/3,
1/3), adv/pos_share the same, adv/neg_share NaN (no negative mass).

Shape legend: B rows, T response tokens, K bins, G = K + 1 position groups (bins + context).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lopti_lab.bins import DECILES, DEFAULT_BINS, bin_index, check_bins
from lopti_lab.probes.position import GradientProbe

__all__ = ["CreditSums", "fig3_sums", "gradient_sums", "token_sums"]

# name -> width in bins (K) or position groups (G); the packed vector (what processes reduce) follows this order
_FIELDS = {
    "tokens": "K",
    "adv_pos": "K",
    "adv_neg": "K",
    "clip_low": "K",
    "clip_high": "K",
    "entropy": "K",
    "grad_share": "G",  # sum over backwards of <g_k, g> / ||g||^2
    "grad_records": "G",  # backwards with a finite share
    "fig3_n": "K",
    "fig3_up": "K",
    "fig3_zero": "K",
}
# what was measured: a count per family, summed over micro-batches and processes (0 = no keys logged)
_MEASURED = ("tokens", "clip", "entropy", "grad", "fig3")


def _binning_name(bins: tuple[float, ...]) -> str:
    return "q" if bins == DEFAULT_BINS else "d" if bins == DECILES else "b"


@dataclass
class CreditSums:
    """Per-bin sums of one step (module docstring); ``a + b`` adds two micro-batches', ``reduced`` all processes'.

    ``precision`` names the Fig. 3 log-probs ("float32" or "float64") in the keys."""

    bins: tuple[float, ...] = DEFAULT_BINS
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    precision: str = "float32"

    @property
    def K(self) -> int:
        return len(self.bins) - 1

    def _width(self, name: str) -> int:
        return self.K if _FIELDS[name] == "K" else self.K + 1

    def __add__(self, other: CreditSums) -> CreditSums:
        if tuple(other.bins) != tuple(self.bins):
            raise ValueError(f"CreditSums: cannot add bins {other.bins} to bins {self.bins}")
        sums = dict(self.sums)
        for name, value in other.sums.items():
            sums[name] = value if name not in sums else sums[name] + value.to(sums[name].device)
        measured = {
            k: self.measured.get(k, 0.0) + other.measured.get(k, 0.0) for k in {*self.measured, *other.measured}
        }
        precision = other.precision if other.measured.get("fig3") else self.precision
        return CreditSums(self.bins, sums, measured, precision)

    def pack(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Every sum in one float64 vector of fixed length (zeros where absent), then the measured counts."""
        parts = [
            self.sums[n].to(device, torch.float64) if n in self.sums else torch.zeros(self._width(n), device=device,
                                                                                     dtype=torch.float64)
            for n in _FIELDS
        ]  # fmt: skip
        parts.append(torch.tensor([self.measured.get(m, 0.0) for m in _MEASURED], device=device, dtype=torch.float64))
        return torch.cat(parts)

    def reduced(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor], device="cpu") -> CreditSums:
        """The sums over every process: ``reduce_sum`` adds a tensor over them (``accelerator.reduce(t, "sum")``)."""
        packed = reduce_sum(self.pack(device)).double().cpu()
        sums, start = {}, 0
        for name in _FIELDS:
            width = self._width(name)
            sums[name] = packed[start : start + width]
            start += width
        measured = dict(zip(_MEASURED, packed[start:].tolist(), strict=True))
        return CreditSums(self.bins, sums, measured, self.precision)

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The logged floats of the module docstring, keyed as there (after ``prefix``)."""
        s = {n: v.double().cpu().numpy() for n, v in self.sums.items()}
        out: dict[str, float] = {}

        def share(part: np.ndarray, total: np.ndarray | float) -> list[float]:
            with np.errstate(divide="ignore", invalid="ignore"):
                return [float(x) for x in np.where(total > 0, part / np.where(total > 0, total, 1), math.nan)]

        def put(name: str, values: Sequence[float]) -> None:
            for k, v in enumerate(values):
                out[f"{prefix}{name}_bin{k}"] = v

        if self.measured.get("tokens"):
            put("tokens/share", share(s["tokens"], s["tokens"].sum()))
            put("adv/pos_share", share(s["adv_pos"], s["adv_pos"].sum()))
            put("adv/neg_share", share(s["adv_neg"], s["adv_neg"].sum()))
        if self.measured.get("clip"):
            put("clip/low_share", share(s["clip_low"], s["tokens"]))
            put("clip/high_share", share(s["clip_high"], s["tokens"]))
        if self.measured.get("entropy"):
            put("entropy/mean", share(s["entropy"], s["tokens"]))
        if self.measured.get("grad"):
            shares = share(s["grad_share"], s["grad_records"])
            put("grad/share", shares[: self.K])
            out[f"{prefix}grad/share_context"] = shares[self.K]
        if self.measured.get("fig3"):
            b, n, up, zero = _binning_name(tuple(self.bins)), s["fig3_n"], s["fig3_up"], s["fig3_zero"]
            put(f"fig3/{b}/n", [float(x) for x in n])
            put(f"fig3/{self.precision}/{b}/correct", share(up, n))
            put(f"fig3/{self.precision}/{b}/correct_moved", share(up, n - zero))
            put(f"fig3/{self.precision}/{b}/zero_share", share(zero, n))
        return out


def _count(bins_of: torch.Tensor, weight: torch.Tensor, K: int) -> torch.Tensor:
    return torch.zeros(K, dtype=torch.float64, device=bins_of.device).index_add_(0, bins_of, weight.double())


def token_sums(
    p_old: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bins: Sequence[float] = DEFAULT_BINS,
    entropy: torch.Tensor | None = None,
    log_ratio: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> CreditSums:
    """Token, advantage, clip and entropy sums of one micro-batch (no gradient needed).

    p_old: (B, T) the rollout probabilities that bin the tokens; mask: (B, T) the response tokens the loss covers;
    advantages: (B, T) per token as the loss sees them (AR applied), or (B,) per sequence; entropy: (B, T) the
    policy's entropy at each token; log_ratio: (B, T) log pi_theta - log pi_old of the forward the loss takes (0 on
    TRL's and our single-iteration path, where the forward IS pi_old). Clipping as ``objective.policy_loss``'s
    ``clip_frac_low`` / ``clip_frac_high`` and TRL's ``clip_ratio/low_mean`` / ``high_mean``.
    """
    edges = check_bins(bins)
    keep = mask.bool()
    K = len(edges) - 1
    k = bin_index(p_old.detach().float(), edges)[keep]  # (n,)
    adv = advantages.detach()
    adv = (adv[:, None].expand(keep.shape) if adv.dim() == 1 else adv)[keep].double()  # (n,)
    sums = {
        "tokens": _count(k, torch.ones_like(adv), K),
        "adv_pos": _count(k, adv.clamp(min=0), K),
        "adv_neg": _count(k, (-adv).clamp(min=0), K),
    }
    measured = {"tokens": 1.0}
    if log_ratio is not None:
        ratio = log_ratio.detach()[keep].double().exp()  # (n,)
        sums["clip_low"] = _count(k, ((ratio < 1.0 - clip_low) & (adv < 0)).double(), K)
        sums["clip_high"] = _count(k, ((ratio > 1.0 + clip_high) & (adv > 0)).double(), K)
        measured["clip"] = 1.0
    if entropy is not None:
        sums["entropy"] = _count(k, entropy.detach()[keep].double(), K)
        measured["entropy"] = 1.0
    return CreditSums(edges, sums, measured)


def gradient_sums(probe: GradientProbe) -> CreditSums:
    """The probe's per-bin gradient shares as sums over its records (one per backward): their mean is
    ``probe.metrics()``'s ``grad/share_bin{k}`` (``probes.summarize`` averages the finite shares of the records)."""
    table = probe.frame()
    K = len(probe.bins) - 1
    share, records = np.zeros(K + 1), np.zeros(K + 1)
    rows = table[(table["scope"] == "model") & (table["label"] != "all")]
    for row in rows.itertuples(index=False):
        g = K if row.label == "context" else int(row.bin)
        if math.isfinite(row.grad_share):
            share[g] += row.grad_share
            records[g] += 1
    sums = {"grad_share": torch.from_numpy(share), "grad_records": torch.from_numpy(records)}
    return CreditSums(tuple(probe.bins), sums, {"grad": float(records.sum() > 0)})


def fig3_sums(
    before: torch.Tensor,
    after: torch.Tensor,
    p_old: torch.Tensor,
    mask: torch.Tensor,
    *,
    bins: Sequence[float] = DEFAULT_BINS,
    precision: str = "float32",
) -> CreditSums:
    """Fig. 3 counts of the A > 0 tokens in ``mask`` (k, T): how many, how many rose, how many did not move, per bin
    of p_old, from their log-probs (k, T) before and after the update, compared in float64 (a tie is an unchanged
    log-prob to the last bit of ``precision``). Worked example, one bin, dlogp = (+1e-9, 0, -1e-9, +2e-9): correct
    2/4, correct_moved 2/3, zero_share 1/4."""
    edges = check_bins(bins)
    keep = mask.bool()
    K = len(edges) - 1
    k = bin_index(p_old.detach().double(), edges)[keep]  # (n,)
    move = (after.detach().double() - before.detach().double())[keep]  # (n,)
    sums = {
        "fig3_n": _count(k, torch.ones_like(move), K),
        "fig3_up": _count(k, (move > 0).double(), K),
        "fig3_zero": _count(k, (move == 0).double(), K),
    }
    return CreditSums(edges, sums, {"fig3": 1.0}, precision)
