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

from lopti_lab.checks import FieldCheck

__all__ = [
    "AR_ALPHA",
    "LOPTI_ETA",
    "LOSSES",
    "METHODS",
    "METHOD_FIELDS",
    "ORDER",
    "PAPER",
    "Method",
    "check_switches",
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
    """Advantage Reweighting alpha in [0, 1] (docs/paper.md §3: A_hat = (alpha * pi_old + 1 - alpha) * A; the paper:
    0.3 on K&K); None = off"""
    lopti_eta: float | None = None
    """Lopti threshold in (0, 1) (§4): tokens with pi_old < eta are updated first, then the rest (the paper: 0.5);
    None = off"""
    lopti_order: str = "low_first"
    """"low_first" (Lopti) or "high_first" (the paper's ablation, which collapses)"""
    loss: str = "ppo"
    """the policy loss: "ppo" (GRPO's clipped surrogate with the dual clip, the paper's), "cispo" (CISPO: the
    importance weight clipped and detached, every token keeps its gradient), "clip_cov" (Clip-Cov: a small share of
    high-covariance tokens' gradient dropped) or "kl_cov" (KL-Cov: |log pi - log pi_old| on the top share by
    covariance); the dual clip applies to "ppo" only"""
    forking_rho: float | None = None
    """forking tokens: only the share rho of the step's response tokens with the highest entropy carry the gradient
    (Wang et al. 2025: 0.2); None = off"""
    entropy_adv_alpha: float | None = None
    """entropy-shaped advantage: A + min(alpha * H, |A| / kappa) per token (Cheng et al. 2025); None = off"""

    def __post_init__(self):
        check_switches(FieldCheck(self))

    @property
    def slug(self) -> str:
        """The label as a folder name: "GRPO+AR+Lopti" -> "grpo_ar_lopti"."""
        return slug(self.label)

    @property
    def stages(self) -> int:
        """Update stages per RL step: 2 with Lopti (low, high), else 1 (a Lopti run costs about twice the update)."""
        return 1 if self.lopti_eta is None else 2

    @property
    def uses_entropy(self) -> bool:
        """Whether the method reads the rollout policy's entropy (forking tokens, the entropy advantage)."""
        return self.forking_rho is not None or self.entropy_adv_alpha is not None

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
LOSSES = tuple(LOSS_LABELS)
"""``Method.loss`` choices: the paper's clipped loss and the token-level losses after it (token_credit)."""

FORKING_RHO = 0.2
"""Wang et al. 2025's share of forking tokens."""
ENTROPY_ADV_ALPHA = 0.4
"""The entropy-shaped advantage's alpha in the lab (Cheng et al.'s own defaults are not verified: docs/methods.md)."""

def check_switches(check: FieldCheck, names: tuple[str, ...] = METHOD_FIELDS) -> None:
    """Check the method's switches ``names`` on any object holding them: a ``Method``, a ``TrainConfig``, TRL's
    ``LoptiGRPOConfig`` (which has AR and Lopti's only); each error names the holder's field
    (``TrainConfig.ar_alpha must be ...``)."""
    checks = {
        "ar_alpha": lambda: check.real("ar_alpha", 0.0, 1.0, optional=True),
        # Lopti stage 1 holds the tokens with pi_old < eta: eta <= 0 empties it, eta >= 1 empties stage 2 (§4)
        "lopti_eta": lambda: check.real("lopti_eta", 0.0, 1.0, low_open=True, high_open=True, optional=True),
        "lopti_order": lambda: check.choice("lopti_order", ("low_first", "high_first")),
        "loss": lambda: check.choice("loss", LOSSES),
        "forking_rho": lambda: check.real("forking_rho", 0.0, 1.0, low_open=True, optional=True),
        "entropy_adv_alpha": lambda: check.real("entropy_adv_alpha", low=0.0, low_open=True, optional=True),
    }
    for name in names:
        checks[name]()


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
