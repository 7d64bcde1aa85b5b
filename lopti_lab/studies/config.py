"""``DemoConfig``: the lab demo's methods, seeds and report folder, around one ``TrainConfig`` that every run shares.

    config = DemoConfig(seeds=3)                              # `lopti-lab demo --seeds 3`
    config.train.lr, config.train.steps                       # the shared RL settings (DEMO_TRAIN)
    config.train_config("GRPO+AR", seed=1, run_dir=...)       # one run: the shared settings + its method and seed

The RL settings are the paper's (docs/paper.md §6: clip 0.2 / 0.24, dual clip 10, token-mean loss, AR alpha 0.3,
Lopti eta 0.5) scaled down to a CPU: fewer prompts per step, shorter responses, and no KL term (it costs a second
forward per step; at 0.001 it barely acts in a few dozen steps). Nothing is tuned per method: the shared settings were
picked on GRPO alone (docs/demo.md says how).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar

from lopti_lab.checks import FieldCheck, rename_owner
from lopti_lab.configs import from_dict
from lopti_lab.methods import METHOD_FIELDS, METHODS, PAPER, run_name
from lopti_lab.train_config import TrainConfig

__all__ = [
    "CONFIRM_METHODS",
    "CONFIRM_PRIMARY",
    "CONFIRM_TRAIN",
    "DEMO_TRAIN",
    "HARD_TRAIN",
    "PER_RUN",
    "QUICK_TRAIN",
    "ConfirmConfig",
    "DemoConfig",
    "HardLabConfig",
    "StudyConfig",
    "demo_train",
]

DEMO_TRAIN = {
    "model": "lab",
    "lora_r": None,
    "train_people": (2, 3),
    "eval_people": (2, 3),
    "prompts_per_step": 8,
    "group_size": 8,
    "temperature": 1.0,
    "max_new_tokens": 640,
    "lr": 5e-4,
    "adam_eps": 1e-3,
    "minibatch_size": 32,
    "kl_coef": 0.0,
    "steps": 10,
    "eval_every": 0,
    "eval_size": 100,
    "eval_samples": 2,
    "probe_every": 5,
    "save_every": 0,
}
"""The demo's TrainConfig fields where they differ from TrainConfig's defaults (docs/demo.md gives the reasons):
the bundled lab model with full fine-tuning on its 2-3-person puzzles; 8 puzzles x 8 rollouts per step at T = 1.0,
the sampled evaluation's temperature, so that training sees the slips the evaluation counts; two minibatches per
step; AdamW lr 5e-4 (chosen on GRPO alone on this lab model: docs/methods.md) with epsilon 1e-3 (at 1e-8 Adam's
first steps move every parameter by about lr whatever its gradient, and the parameters whose gradients are sampling
noise wreck the lab model); 10 steps; the test split sampled twice per puzzle at the end."""

QUICK_TRAIN = {
    "steps": 2,
    "prompts_per_step": 4,
    "group_size": 4,
    "minibatch_size": 16,
    "eval_size": 8,
    "eval_samples": 1,
    "probe_every": 1,
}
"""What ``DemoConfig(quick=True)`` changes: every code path once, on the smallest batches that exercise it (tests,
notebook QUICK), on the smallest people count only (the shortest traces)."""

PER_RUN = ("seed", "run_dir", "progress", *METHOD_FIELDS)
"""TrainConfig fields each run sets itself (its seed, folder and method): ``DemoConfig.train`` must leave them at
their defaults."""


def demo_train(**changes) -> TrainConfig:
    """The demo's shared TrainConfig (``DEMO_TRAIN``), with ``changes``."""
    return TrainConfig(**{**DEMO_TRAIN, **changes})


@dataclass
class StudyConfig:
    """What every study of the lab shares: the methods trained with every other setting in common, their seeds, the
    one TrainConfig all runs share, a report folder, and the worker processes. ``DemoConfig`` and
    ``studies.mechanism.MechanismConfig`` are its two studies; each names its own defaults (``TRAIN_DEFAULTS``)."""

    TRAIN_DEFAULTS: ClassVar[dict] = DEMO_TRAIN
    """The study's TrainConfig fields where they differ from TrainConfig's (a ``train`` dict changes these)."""
    TITLE: ClassVar[str] = "demo: GRPO, AR and Lopti on the lab model"
    """The report's heading."""
    QUICK: ClassVar[dict] = QUICK_TRAIN
    """What ``quick`` changes in ``train``."""
    SET_PER_RUN: ClassVar[tuple[str, ...]] = PER_RUN
    """The ``train`` fields the study sets in each run (the CLI gives them no option)."""
    PRIMARY: ClassVar[str | None] = None
    """A pre-registered primary measure, the column of the last-3 sampled accuracy whose paired difference to GRPO
    the report states first (None: none)."""
    PRIMARY_COMPARISONS: ClassVar[tuple[tuple[str, str], ...]] = ()
    """Pre-registered primary comparisons, (method, column) each against GRPO, Holm-corrected together
    (``studies.primary.primary_table``; (): none)."""

    out: str = "reports/study"
    """report folder (created; runs/ inside holds each run folder)"""
    seeds: int = 1
    """seeds per method (> 1 gives 95% intervals over seeds)"""
    methods: tuple[str, ...] = PAPER
    """the methods to train (lopti_lab.methods), each with every shared setting"""
    train: TrainConfig = field(default_factory=demo_train)
    """the settings every run shares (a dict of fields is read as changes to the study's defaults); each run sets its
    own seed, folder and method switches (PER_RUN)"""
    quick: bool = False
    """a smoke version (tests, notebook QUICK): QUICK_TRAIN's smaller batches, 2 steps (``QUICK``)"""
    threads: int | None = None
    """torch threads of the study (None: torch's default), shared out among the workers"""
    workers: int = 2
    """runs trained at once, each in a process of its own with threads // workers torch threads (at least 1); 1
    trains them one after another in this process"""

    def __post_init__(self):
        owner = type(self).__name__
        if isinstance(self.methods, list):  # JSON and argparse give lists
            self.methods = tuple(self.methods)
        if isinstance(self.train, Mapping):  # a JSON object (or the CLI's options): changes to the defaults
            changes = self.train
            self.train = self._renamed(lambda: from_dict(TrainConfig, {**self.TRAIN_DEFAULTS, **changes}))
        check = FieldCheck(self)  # every field by name, before any model loads (docs/bad_inputs.md)
        check.text("out")
        check.need(not Path(self.out).is_file(), "out", "must be a folder, not a file")
        check.integer("seeds", low=1)
        check.items("methods", lambda m: m in METHODS, f"methods from {list(METHODS)}", distinct=True)
        check.need(isinstance(self.train, TrainConfig), "train", "must be a TrainConfig")
        check.flag("quick")
        check.integer("threads", low=1, optional=True)
        check.integer("workers", low=1)
        self.check(check)
        defaults = TrainConfig(model=self.train.model)
        for name in PER_RUN:
            value, default = getattr(self.train, name), getattr(defaults, name)
            if value != default:
                what = (
                    "each run sets its seed (seed_list)" if name == "seed" else "each run sets it (its method, folder)"
                )
                raise ValueError(f"{owner}.train.{name} must be left at its default {default!r}: {what}, got "
                                 f"{value!r}")  # fmt: skip
        if self.quick:
            people = {"train_people": self.train.train_people[:1], "eval_people": self.train.eval_people[:1]}
            self.train = self._renamed(lambda: replace(self.train, **self.QUICK, **people))
        for config in self.run_configs().values():  # the combinations (a missing data file, ...): as each run sees them
            self._renamed(lambda c=config: replace(c))

    def check(self, check: FieldCheck) -> None:
        """A study's own fields' checks (the base checks the shared ones)."""

    def _renamed(self, build):
        """``build()``, with a TrainConfig error restated as this config's ``train`` field's."""
        try:
            return build()
        except ValueError as err:
            owner = f"{type(self).__name__}.train"
            raise rename_owner(err, "TrainConfig", owner, [f.name for f in fields(TrainConfig)]) from None

    def train_config(self, method: str, seed: int, run_dir: Path) -> TrainConfig:
        """The TrainConfig of one run: every method shares everything but its own switches."""
        return replace(self.train, seed=seed, run_dir=str(run_dir), **METHODS[method].overrides())

    @property
    def seed_list(self) -> tuple[int, ...]:
        """The seeds of the runs: 0 .. seeds - 1 (a confirmatory study starts past the exploratory one's)."""
        return tuple(range(self.seeds))

    def run_dirs(self) -> dict[tuple[str, int], Path]:
        """{(method, seed): run folder} of every run of the study, in training order (seed by seed)."""
        root = Path(self.out) / "runs"
        return {(m, s): root / run_name(m, seed=s) for s in self.seed_list for m in self.methods}

    def run_configs(self) -> dict[tuple, TrainConfig]:
        """{key: the TrainConfig of that run} for every run of the study (key: its run_dirs key)."""
        return {(m, s): self.train_config(m, s, d) for (m, s), d in self.run_dirs().items()}


@dataclass
class DemoConfig(StudyConfig):
    """`lopti-lab demo`: the four methods on the lab model, same data and seeds, then a report folder."""

    out: str = "reports/demo"
    """report folder (created; runs/ inside holds each run folder)"""
    cache_warm_start: bool = True
    """reuse a recorded warm-start evaluation of the same weights and settings (studies.run.warm_start_eval)"""

    def check(self, check: FieldCheck) -> None:
        check.flag("cache_warm_start")


HARD_TRAIN = {
    **DEMO_TRAIN,
    "model": "lab-hard",
    "eval_people": (2, 3, 4),
    "prompts_per_step": 4,
    "minibatch_size": 16,
    "lr": 1e-4,
    "steps": 60,
    "eval_every": 10,
    "eval_size": 30,
    "probe_every": 10,
    "shift_every": 10,
    "save_every": 10,
}
"""The hard lab study's TrainConfig fields where they differ from TrainConfig's defaults, fixed on GRPO alone before
any other method ran (docs/hard_lab.md, "Pre-registration"): the "lab-hard" warm start, RL on its 2-3-person puzzles
for 60 steps of 4 puzzles x 8 rollouts at T = 1.0 (two minibatches of 16), the demo's AdamW (epsilon 1e-3) at lr
1e-4 (5e-4, the demo's, unlearnt the 3-person skill after step 30 in the pilot; at 2e-4 GRPO had reached its ceiling
by step 40: docs/hard_lab.md); a test evaluation
every 10 steps at 2, 3 and 4 people (4: beyond the trained counts) on 30 puzzles per count, greedy and 2 samples at
T = 1.0, and at the same steps the gradient share per probability bin and the paper's Fig. 3; a checkpoint every 10
steps. 30 puzzles rather than the test split's 100, and 4 x 8 rollouts rather than the demo's 8 x 8, aiming the 20
runs at 150 minutes on two CPU cores (measured: about 170, docs/hard_lab.md)."""


@dataclass
class HardLabConfig(DemoConfig):
    """`lopti-lab hardlab`: the four methods on the hard lab model (a warm start that misreads 'or', 'if' and 'iff'
    as 'and' 60% of the time, docs/hard_lab.md), 5 seeds, for 60 steps: the regime where RL must learn a skill, not
    only remove slips."""

    TRAIN_DEFAULTS: ClassVar[dict] = HARD_TRAIN
    TITLE: ClassVar[str] = "hard lab: GRPO, AR and Lopti where RL must learn a skill"
    QUICK: ClassVar[dict] = {**QUICK_TRAIN, "eval_every": 1, "shift_every": 1}
    """the smoke version evaluates and measures Fig. 3 at both of its steps, so that its report has curves"""
    PRIMARY: ClassVar[str | None] = "3ppl"
    """docs/hard_lab.md, "Pre-registration": sampled accuracy at 3 people, the hardest trained count"""
    out: str = "reports/hard_lab"
    """report folder (created; runs/ inside holds each run folder)"""
    seeds: int = 5
    """seeds per method (the pre-registered study: 5)"""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(**HARD_TRAIN))
    """the settings every run shares (a dict of fields is read as changes to HARD_TRAIN); each run sets its own
    seed, folder and method switches (PER_RUN)"""


CONFIRM_TRAIN = {
    **HARD_TRAIN,
    "eval_people": (2, 3),
    "eval_size": 100,
    "eval_samples": 2,
    "eval_full_steps": (40, 50, 60),
    "eval_full_samples": 8,
}
"""The confirmatory study's TrainConfig fields (docs/hard_lab.md, "Confirmatory study: pre-registration"): the hard
lab's training settings unchanged (``HARD_TRAIN``), evaluated at 2 and 3 people only (4 people scored 0.00 in every
run of the exploratory study) on all 100 test puzzles per count: greedy and 8 samples at T = 1.0 at steps 40, 50 and
60 (the primary measure's three points), greedy and 2 samples at steps 10, 20 and 30 (the curves)."""

CONFIRM_PRIMARY = (("GRPO+Lopti", "3ppl"), ("GRPO+AR", "3ppl"), ("GRPO+Lopti", "2ppl"))
"""The confirmatory study's primary comparisons, (method, people column) each against GRPO at the same seed: the
two fixes at 3 people, the hardest trained count, and Lopti at 2 people, the exploratory study's lead."""

CONFIRM_METHODS = ("GRPO", "GRPO+AR", "GRPO+Lopti")
"""The confirmatory study's methods: GRPO and the two fixes its primary comparisons name (GRPO+AR+Lopti only with
``with_ar_lopti``: the budget did not allow it, docs/hard_lab.md)."""


@dataclass
class ConfirmConfig(HardLabConfig):
    """`lopti-lab confirm`: the hard lab's confirmatory study on fresh seeds (5 .. 14, none of the exploratory
    study's), pre-registered in docs/hard_lab.md before its first run; its primary analysis is
    ``studies.stats.primary_table``."""

    TITLE: ClassVar[str] = "hard lab, confirmatory: GRPO, AR and Lopti on fresh seeds"
    TRAIN_DEFAULTS: ClassVar[dict] = CONFIRM_TRAIN
    PRIMARY_COMPARISONS: ClassVar[tuple[tuple[str, str], ...]] = CONFIRM_PRIMARY
    QUICK: ClassVar[dict] = {**QUICK_TRAIN, "eval_every": 1, "shift_every": 1, "eval_full_steps": (2,),
                             "eval_full_samples": 2}  # fmt: skip
    """the smoke version: the curve evaluation at step 1, the full one (2 samples) at step 2"""
    out: str = "reports/hard_lab_confirm"
    """report folder (created; runs/ inside holds each run folder)"""
    seeds: int = 10
    """seeds per method (the pre-registered study: 10, first_seed .. first_seed + 9)"""
    first_seed: int = 5
    """the first seed (the exploratory study used 0-4: the confirmatory one starts at 5)"""
    methods: tuple[str, ...] = CONFIRM_METHODS
    """the methods to train (lopti_lab.methods); GRPO and the primary comparisons' two fixes"""
    with_ar_lopti: bool = False
    """also train GRPO+AR+Lopti (a secondary comparison; about 2 more hours on two cores: docs/hard_lab.md)"""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(**CONFIRM_TRAIN))
    """the settings every run shares (a dict of fields is read as changes to CONFIRM_TRAIN); each run sets its own
    seed, folder and method switches (PER_RUN)"""

    def check(self, check: FieldCheck) -> None:
        super().check(check)
        check.integer("first_seed", 0, 2**32 - 1 - self.seeds)
        check.flag("with_ar_lopti")
        check.need("GRPO" in self.methods, "methods", "must hold GRPO: every primary comparison is paired with it")
        if self.with_ar_lopti and "GRPO+AR+Lopti" not in self.methods:
            self.methods = (*self.methods, "GRPO+AR+Lopti")

    @property
    def seed_list(self) -> tuple[int, ...]:
        return tuple(range(self.first_seed, self.first_seed + self.seeds))

    def curve_steps(self) -> tuple[int, ...]:
        """The steps evaluated with the curves' cheaper evaluation (every eval_every steps, not a full one)."""
        train = self.train
        return tuple(k for k in range(1, train.steps + 1) if train.evaluates_at(k) and k not in train.eval_full_steps)
