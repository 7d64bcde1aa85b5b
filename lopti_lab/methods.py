"""The methods, defined once: their names, labels, order, run-folder names and the TrainConfig fields they set.

    METHODS["GRPO+AR"].overrides()        # {"ar_alpha": 0.3, "lopti_eta": None}
    method_label({"lopti_eta": 0.5})      # "GRPO+Lopti"
    run_name("GRPO+AR+Lopti", seed=2)     # "grpo_ar_lopti-seed2"

The paper's four variants (docs/paper.md §3-4) with its K&K settings: Advantage Reweighting with alpha = 0.3, Lopti
with eta = 0.5, each alone and both together, all on top of GRPO. Every place that lists, orders, labels or names the
methods (the trainer's run folders, the demo, the counterfactual, the toy, the plots, the widgets) reads them here.
No torch: the CLI and the plots import this without loading a model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass, replace

__all__ = ["AR_ALPHA", "LOPTI_ETA", "METHODS", "ORDER", "Method", "method_label", "method_of", "run_name"]

AR_ALPHA = 0.3
"""The paper's AR strength on K&K (docs/paper.md §6)."""
LOPTI_ETA = 0.5
"""The paper's Lopti threshold on K&K."""


@dataclass(frozen=True)
class Method:
    """One training variant: GRPO with AR and / or Lopti switched on. ``ar_alpha = None`` and ``lopti_eta = None``
    is plain GRPO (and ``ar_alpha = 0`` is GRPO exactly: every weight is 1)."""

    label: str
    """"GRPO", "GRPO+AR", "GRPO+Lopti" or "GRPO+AR+Lopti" (the paper's table rows without the model)."""
    ar_alpha: float | None = None
    """AR strength (docs/paper.md §3): A_hat = (alpha * pi_old + 1 - alpha) * A; None: off."""
    lopti_eta: float | None = None
    """Lopti threshold (§4): tokens with pi_old < eta are updated first, then the rest; None: one update on all."""
    lopti_order: str = "low_first"
    """"low_first" (Lopti) or "high_first" (the paper's ablation)."""

    def __post_init__(self):
        if self.ar_alpha is not None and not 0.0 <= self.ar_alpha <= 1.0:
            raise ValueError(f"Method.ar_alpha must be in [0, 1] or None, got {self.ar_alpha!r}")
        if self.lopti_eta is not None and not 0.0 < self.lopti_eta < 1.0:
            raise ValueError(f"Method.lopti_eta must be in (0, 1) or None, got {self.lopti_eta!r}")
        if self.lopti_order not in ("low_first", "high_first"):
            raise ValueError(f"Method.lopti_order must be 'low_first' or 'high_first', got {self.lopti_order!r}")

    @property
    def slug(self) -> str:
        """The label as a folder name: "GRPO+AR+Lopti" -> "grpo_ar_lopti"."""
        return slug(self.label)

    @property
    def stages(self) -> int:
        """Update stages per RL step: 2 with Lopti (low, high), else 1 (a Lopti run costs about twice the update)."""
        return 1 if self.lopti_eta is None else 2

    def overrides(self) -> dict:
        """The TrainConfig fields this method sets (every other field is shared by all methods of a comparison)."""
        return {"ar_alpha": self.ar_alpha, "lopti_eta": self.lopti_eta, "lopti_order": self.lopti_order}

    def with_settings(self, ar_alpha: float | None = None, lopti_eta: float | None = None) -> Method:
        """The same method at another alpha or eta (a switch that is off stays off)."""
        return replace(
            self,
            ar_alpha=None if self.ar_alpha is None else (self.ar_alpha if ar_alpha is None else ar_alpha),
            lopti_eta=None if self.lopti_eta is None else (self.lopti_eta if lopti_eta is None else lopti_eta),
        )


METHODS: dict[str, Method] = {
    m.label: m
    for m in (
        Method("GRPO"),
        Method("GRPO+AR", ar_alpha=AR_ALPHA),
        Method("GRPO+Lopti", lopti_eta=LOPTI_ETA),
        Method("GRPO+AR+Lopti", ar_alpha=AR_ALPHA, lopti_eta=LOPTI_ETA),
    )
}
"""The paper's four variants, in the order of its tables."""

ORDER: tuple[str, ...] = tuple(METHODS)
"""Labels in table order: GRPO, GRPO+AR, GRPO+Lopti, GRPO+AR+Lopti."""


def method_label(config: Mapping | object) -> str:
    """ "GRPO", "GRPO+AR", "GRPO+Lopti" or "GRPO+AR+Lopti" from a config (a dict or a dataclass with ``ar_alpha``,
    ``lopti_eta``, ``lopti_order``).

    AR counts as on when ar_alpha is set and > 0 (alpha = 0 is GRPO exactly); Lopti with order "high_first" (the
    paper's ablation) reads "GRPO+Lopti(high-first)".

    >>> method_label({"ar_alpha": 0.3, "lopti_eta": 0.5})
    'GRPO+AR+Lopti'
    """
    cfg = asdict(config) if is_dataclass(config) else dict(config)
    label = "GRPO"
    if cfg.get("ar_alpha"):
        label += "+AR"
    if cfg.get("lopti_eta"):
        label += "+Lopti" + ("(high-first)" if cfg.get("lopti_order") == "high_first" else "")
    return label


def method_of(label: str) -> Method:
    """The registered method of a label; ValueError naming the known ones otherwise."""
    try:
        return METHODS[label]
    except KeyError:
        raise ValueError(f"unknown method {label!r}; choose from {list(METHODS)}") from None


def slug(label: str) -> str:
    """ "GRPO+Lopti(high-first)" -> "grpo_lopti_high_first": lower case, every run of other characters one "_"."""
    out, gap = [], False
    for ch in label.lower():
        if ch.isalnum():
            out.append("_" if gap and out else "")
            out.append(ch)
            gap = False
        else:
            gap = True
    return "".join(out)


def run_name(label: str, seed: int | None = None, stamp: str | None = None) -> str:
    """The run folder's name for a method: "<slug>-seed<seed>" in a study, else "<slug>-<date-time>" (now, unless
    ``stamp`` is given). The one rule for every run folder lopti_lab names.

    >>> run_name("GRPO+AR", seed=0), run_name("GRPO", stamp="20261203-101500")
    ('grpo_ar-seed0', 'grpo-20261203-101500')
    """
    if seed is not None:
        return f"{slug(label)}-seed{seed}"
    return f"{slug(label)}-{stamp or time.strftime('%Y%m%d-%H%M%S')}"
