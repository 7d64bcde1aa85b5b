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

__all__ = [
    "AR_ALPHA",
    "LOPTI_ETA",
    "METHODS",
    "METHOD_FIELDS",
    "ORDER",
    "PAPER",
    "Method",
    "method_label",
    "method_of",
    "run_name",
]

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
    loss: str = "ppo"
    """the policy loss (TrainConfig.loss): "ppo" (the paper's), "cispo", "clip_cov" or "kl_cov"."""
    forking_rho: float | None = None
    """forking tokens: only the top-rho entropy tokens carry the gradient; None: off."""
    entropy_adv_alpha: float | None = None
    """the entropy-shaped advantage's alpha; None: off."""

    def __post_init__(self):
        if self.ar_alpha is not None and not 0.0 <= self.ar_alpha <= 1.0:
            raise ValueError(f"Method.ar_alpha must be in [0, 1] or None, got {self.ar_alpha!r}")
        if self.lopti_eta is not None and not 0.0 < self.lopti_eta < 1.0:
            raise ValueError(f"Method.lopti_eta must be in (0, 1) or None, got {self.lopti_eta!r}")
        if self.lopti_order not in ("low_first", "high_first"):
            raise ValueError(f"Method.lopti_order must be 'low_first' or 'high_first', got {self.lopti_order!r}")
        if self.loss not in LOSS_LABELS:
            raise ValueError(f"Method.loss must be one of {tuple(LOSS_LABELS)}, got {self.loss!r}")

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
        return {name: getattr(self, name) for name in METHOD_FIELDS}

    @property
    def is_papers(self) -> bool:
        """Whether this is one of the paper's four (GRPO with AR and / or Lopti, the clipped loss)."""
        return self.loss == "ppo" and self.forking_rho is None and self.entropy_adv_alpha is None

    def with_settings(self, ar_alpha: float | None = None, lopti_eta: float | None = None) -> Method:
        """The same method at another alpha or eta (a switch that is off stays off)."""
        return replace(
            self,
            ar_alpha=None if self.ar_alpha is None else (self.ar_alpha if ar_alpha is None else ar_alpha),
            lopti_eta=None if self.lopti_eta is None else (self.lopti_eta if lopti_eta is None else lopti_eta),
        )


METHOD_FIELDS = ("ar_alpha", "lopti_eta", "lopti_order", "loss", "forking_rho", "entropy_adv_alpha")
"""The TrainConfig fields a method sets; a comparison shares every other one."""

LOSS_LABELS = {"ppo": "", "cispo": "+CISPO", "clip_cov": "+Clip-Cov", "kl_cov": "+KL-Cov"}
"""How each TrainConfig.loss reads in a method's label."""

FORKING_RHO = 0.2
"""Wang et al. 2025's share of forking tokens."""
ENTROPY_ADV_ALPHA = 0.4
"""The entropy-shaped advantage's alpha in the lab (Cheng et al.'s own defaults are not verified: docs/methods.md)."""

METHODS: dict[str, Method] = {
    m.label: m
    for m in (
        Method("GRPO"),
        Method("GRPO+AR", ar_alpha=AR_ALPHA),
        Method("GRPO+Lopti", lopti_eta=LOPTI_ETA),
        Method("GRPO+AR+Lopti", ar_alpha=AR_ALPHA, lopti_eta=LOPTI_ETA),
        Method("GRPO+Forking", forking_rho=FORKING_RHO),
        Method("GRPO+AR+Forking", ar_alpha=AR_ALPHA, forking_rho=FORKING_RHO),
        Method("GRPO+EntAdv", entropy_adv_alpha=ENTROPY_ADV_ALPHA),
        Method("GRPO+CISPO", loss="cispo"),
        Method("GRPO+Lopti+CISPO", lopti_eta=LOPTI_ETA, loss="cispo"),
        Method("GRPO+Clip-Cov", loss="clip_cov"),
        Method("GRPO+KL-Cov", loss="kl_cov"),
    )
}
"""The paper's four variants first, in the order of its tables, then the token-level methods after it
(docs/methods.md) and the combinations of both that are defined."""

ORDER: tuple[str, ...] = tuple(METHODS)
"""Every label in table order (the paper's four first)."""

PAPER: tuple[str, ...] = tuple(label for label, m in METHODS.items() if m.is_papers)
"""The paper's four: GRPO, GRPO+AR, GRPO+Lopti, GRPO+AR+Lopti (the demo's default)."""


def method_label(config: Mapping | object) -> str:
    """A method's label from a config (a dict or a dataclass with the ``METHOD_FIELDS``): "GRPO", then "+AR",
    "+Lopti", "+Forking", "+EntAdv" for each switch on, then the loss ("+CISPO", "+Clip-Cov", "+KL-Cov").

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
    if cfg.get("forking_rho") is not None and cfg["forking_rho"] < 1:
        label += "+Forking"
    if cfg.get("entropy_adv_alpha"):
        label += "+EntAdv"
    return label + LOSS_LABELS.get(cfg.get("loss", "ppo"), f"+{cfg.get('loss')}")


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
