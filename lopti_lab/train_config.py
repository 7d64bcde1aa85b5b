"""``TrainConfig``: everything that defines a training run, one field each with its docstring, and its checks.

    cfg = TrainConfig(model="lab", lora_r=None, ar_alpha=0.3, lopti_eta=0.5, steps=50, run_dir="runs/both")
    cfg.method                       # "GRPO+AR+Lopti" (lopti_lab.methods)

Defaults follow the paper's K&K GRPO setup (docs/paper.md §6) where it applies. A config validates itself before any
model loads: a bad field is a ValueError naming it (docs/bad_inputs.md lists every one). The CLI's options, the
widgets' controls and the demo's runs are all built from this one dataclass.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from lopti_lab.checks import FieldCheck, is_int, is_real
from lopti_lab.configs import field_docs, from_dict
from lopti_lab.evaluate import EvalSpec
from lopti_lab.kk import PROMPT_STYLES
from lopti_lab.kk.data import split_files
from lopti_lab.methods import LOSSES, METHOD_FIELDS, Method, check_switches, method_label
from lopti_lab.models import (
    DEFAULT_LORA_TARGETS,
    PROMPT_STYLE_KEY,
    LoraSpec,
    check_model_name,
    half_full_finetune_error,
    prompt_style_of,
)
from lopti_lab.rollout import FAST_PATHS, SamplingSpec
from lopti_lab.update import OPTIMIZERS, Objective, OptimizerSpec, UpdateSpec, check_objective

__all__ = ["ATTN_IMPLEMENTATIONS", "LOSSES", "OPTIMIZERS", "RESUMABLE_CHANGES", "TrainConfig"]

HUB_PROMPT_STYLES = ("instruct", "base", "chat")
"""The prompt styles any model can take; the others of ``kk.PROMPT_STYLES`` (the quiz styles) are lab models' only."""
LAB_PROMPT_STYLES = tuple(s for s in PROMPT_STYLES if s not in HUB_PROMPT_STYLES)

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
"""``TrainConfig.attn_implementation`` choices (transformers' names)."""

RESUMABLE_CHANGES = (
    "steps", "eval_every", "save_every", "progress", "run_dir", "max_nonfinite_steps", "attn_implementation"
)  # fmt: skip
"""The fields a resumed run may change (everything else must match the saved config): the attention kernel among
them, so that a run begun with flash-attn resumes on a machine without it."""


@dataclass
class TrainConfig:
    """Everything that defines a run. Defaults follow the paper's K&K GRPO setup (docs/paper.md §6) where it applies."""

    # --- model ---
    model: str = "lab"
    """hub id ("Qwen/Qwen2.5-3B-Instruct"), a local folder saved with save_pretrained, or "lab" (bundled lab model)"""
    lora_r: int | None = 16
    """LoRA rank; None = full fine-tuning (what the paper did; right for the tiny lab model)"""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)"""
    lora_dropout: float = 0.0
    """LoRA dropout; 0 keeps the first update's ratio at exactly 1"""
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """module names that get adapters: attention and MLP projections"""
    dtype: str = "auto"
    """"auto" (what the device has natively, models.native_dtype: bfloat16 on a GPU of compute capability >= 8.0,
    float16 below it, as on a T4, float32 on a CPU), "float32", "bfloat16" or "float16". float16 trains with a loss
    scaler (torch.amp.GradScaler: an optimizer step whose gradients overflow is skipped, metrics amp/...). Full
    fine-tuning (lora_r None) keeps float32 weights: "auto" is float32 for it, and a half dtype is refused"""
    device: str = "auto"
    """"auto" (cuda if available), "cpu", "cuda", "cuda:1", ..."""
    gradient_checkpointing: bool = False
    """recompute activations in backward: less GPU memory for long responses, about 30% slower updates"""
    attn_implementation: str = "sdpa"
    """the attention kernel the model loads with (ATTN_IMPLEMENTATIONS): "sdpa" (torch's fused attention, any device),
    "eager" (plain matmuls and softmax) or "flash_attention_2" (needs the flash-attn package and a bf16/fp16 GPU);
    a resumed run may change it (the same math, other rounding)"""

    # --- data ---
    prompt_style: str | None = None
    """the prompt format (kk.PROMPT_STYLES): "instruct" (the Logic-RL Qwen chat string), "base" (plain text), "chat"
    (the tokenizer's chat template) or a lab model's quiz style; None = the style the model's config.json names (a
    lab model's: models.prompt_style_of), else "instruct". A style other than the one a model's config names is
    refused: the model was not trained on it; a lab model's quiz style with a model that names none becomes
    "instruct" (what `replace(lab_config, model="Qwen/...")` means)"""
    train_people: tuple[int, ...] = (3, 4, 5, 6, 7)
    """people counts mixed in the training set (the paper: 3-7)"""
    eval_people: tuple[int, ...] = (3, 4, 5, 6, 7)
    """people counts of the evaluation (empty: no evaluation)"""
    data_root: str | None = None
    """folder holding train/ and test/ K&K JSONL files; None = the bundled data/kk"""
    train_limit: int | None = None
    """use only the first N training puzzles of each people count (None = all)"""

    # --- rollout ---
    prompts_per_step: int = 64
    """puzzles per RL step (the paper: 64)"""
    group_size: int = 8
    """completions sampled per puzzle, G (the paper: 8); B = prompts_per_step x group_size"""
    temperature: float = 0.7
    """rollout sampling temperature; old_logp and the update's log-probs use it too (the paper: 0.7)"""
    top_p: float = 1.0
    """nucleus sampling mass for rollouts (1 = off)"""
    max_new_tokens: int = 4096
    """response length cap (the paper: 4096)"""
    max_prompt_tokens: int | None = None
    """fail if a prompt is longer (the paper: 400); None = no check"""
    generate_batch_size: int | None = None
    """rows per generate call (GPU memory; None = the whole batch) and, without micro_batch_size, per log-prob
    forward"""
    fast_path: str = "auto"
    """"auto": on a CPU, Qwen2 models decode with lopti_lab's lean loop (whose sampling logits also give pi_old) and
    run the update's forward with each prompt computed once per group; other models and GPUs use HF generate and
    forward. "lean": require that path (fail if the model cannot take it); "hf": HF everywhere (rollout.FAST_PATHS)"""

    # --- optimisation ---
    optimizer: str = OptimizerSpec.optimizer
    """"adamw" (how the paper trains) or "sgd" (plain SGD, no momentum: the optimizer of the paper's Fig. 1 and Fig. 3
    measurements, under which a token's probability moves with the size of its gradient); with "sgd", betas and
    adam_eps must stay at their defaults"""
    lr: float = OptimizerSpec.lr
    weight_decay: float = OptimizerSpec.weight_decay
    betas: tuple[float, float] = OptimizerSpec.betas
    adam_eps: float = OptimizerSpec.adam_eps
    warmup_steps: int = 0
    """linear learning-rate warmup over the first N RL steps (lr x step / N); 0 = constant lr"""
    grad_clip: float | None = UpdateSpec.grad_clip
    minibatch_size: int = UpdateSpec.minibatch_size
    micro_batch_size: int | None = None
    """responses per forward/backward inside a minibatch (gradient accumulation) and per no-grad log-prob forward;
    None = the whole minibatch"""
    ppo_epochs: int = UpdateSpec.ppo_epochs
    max_nonfinite_steps: int = 3
    """stop the run (checkpoint saved, resumable) after this many consecutive RL steps whose update met a NaN/inf loss
    or gradient; such updates are skipped, never applied; 0 = never stop"""

    # --- objective: the method's switches (declared, documented and checked in methods.Method) and its loss's
    # settings (update.Objective); a field whose default is Method.x or Objective.x has that field's docstring
    advantage_scale: str = Objective.advantage_scale
    clip_low: float = Objective.clip_low
    clip_high: float = Objective.clip_high
    dual_clip: float | None = Objective.dual_clip
    kl_coef: float = Objective.kl_coef
    ar_alpha: float | None = Method.ar_alpha
    lopti_eta: float | None = Method.lopti_eta
    lopti_order: str = Method.lopti_order

    # --- the token-level methods after the paper (lopti_lab.token_credit; docs/methods.md) ---
    loss: str = Method.loss
    cispo_eps_max: float = Objective.cispo_eps_max
    cov_share: float = Objective.cov_share
    clip_cov_band: tuple[float, float] = Objective.clip_cov_band
    kl_cov_coef: float = Objective.kl_cov_coef
    forking_rho: float | None = Method.forking_rho
    entropy_adv_alpha: float | None = Method.entropy_adv_alpha
    entropy_adv_kappa: float = Objective.entropy_adv_kappa

    # --- schedule, evaluation, probes, output ---
    steps: int = 100
    """RL steps to train"""
    seed: int = 0
    """seeds python, numpy and torch (model init, LoRA init, data order, sampling)"""
    eval_every: int = 50
    """evaluate every N steps and after the last step; 0 = only after the last step"""
    eval_size: int = 100
    """test puzzles per people count (the test split has 100)"""
    eval_modes: tuple[str, ...] = EvalSpec.modes
    """"greedy" decoding and/or "sample" (eval_samples completions per puzzle at eval_temperature; the paper: both)"""
    eval_samples: int = EvalSpec.samples
    """completions per puzzle in the "sample" mode: accuracy is their mean (more samples, less noise)"""
    eval_temperature: float = EvalSpec.temperature
    """temperature of the "sample" evaluation (the paper: 1.0)"""
    eval_max_new_tokens: int | None = None
    """response cap at evaluation; None = max_new_tokens"""
    eval_full_steps: tuple[int, ...] = ()
    """steps whose evaluation is the full one, eval_full_samples completions per puzzle in the "sample" mode (the
    confirmatory study's last three: its primary measure), evaluated whatever eval_every says; () = none"""
    eval_full_samples: int | None = None
    """completions per puzzle in the "sample" mode at eval_full_steps; None = eval_samples"""
    probe_every: int = 0
    """log per-bin token and gradient shares every N steps (lopti_lab.probes); 0 = off"""
    probe_shift: bool = True
    """on a probe step, also measure the probability shift of the update on every row of the batch (keys shift/...):
    two float64 forwards of the whole batch, about as much as the rest of the probe step (benchmarks/README.md);
    False = the gradient shares alone"""
    shift_every: int = 0
    """measure the paper's Fig. 3 every N steps (probes.update_shift): the share of positive-advantage tokens whose
    probability the step's real update raised, per probability quartile and decile, from float64 and from bf16
    forwards before and after it (keys fig3/...); 0 = off"""
    shift_rows: int | None = 4
    """at most this many positive-advantage rollouts measured per Fig. 3 step, evenly spaced over them (no random
    draw; its four forwards cost in proportion to the rows, the two float64 ones most: a few rows keep its cost small,
    benchmarks/README.md); None = all of them, as the paper's code (and `lopti-lab mechanism`) measures"""
    probe_bins: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """edges of the probability bins of the probes (the paper's Fig. 1: quarters)"""
    save_every: int = 50
    """checkpoint every N steps; the last step (and a stop requested by a callback) always saves; 0 = only those"""
    run_dir: str | None = None
    """the run folder (runs.py); None = runs/<method>-<date-time> under the working directory"""
    progress: bool = True
    """show a tqdm progress bar"""

    def __post_init__(self):
        for name in (
            "lora_targets",
            "train_people",
            "eval_people",
            "betas",
            "eval_modes",
            "probe_bins",
            "clip_cov_band",
            "eval_full_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):  # JSON gives lists; keep tuples so configs compare equal
                setattr(self, name, tuple(value))
        _validate(self)

    @property
    def method(self) -> str:
        """ "GRPO", "GRPO+AR", "GRPO+Lopti" or "GRPO+AR+Lopti" (``methods.method_label``)."""
        return method_label(self)

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def logprob_batch_size(self) -> int | None:
        """Rows per no-grad log-prob forward (pi_old, reference): the update's micro-batch, which is sized to fit
        with gradients, else generate_batch_size. Its logits are rows x response length x vocabulary: 128 rows of
        4096 tokens over Qwen's 151,936-token vocabulary would be 148 GiB in bf16."""
        return self.micro_batch_size or self.generate_batch_size

    @property
    def optimizer_steps_per_stage(self) -> int:
        return self.update_spec().optimizer_steps_per_stage(self.batch_size)

    # --- the small specs the layers below the trainer take, each carrying the fields of the same names

    def method_spec(self) -> Method:
        """The method's switches (``methods.Method``), labelled as ``method``."""
        return Method(self.method, **{name: getattr(self, name) for name in METHOD_FIELDS})

    def objective(self) -> Objective:
        """What the update optimizes (``update.advantages_and_stages``, ``update.token_loss``)."""
        return self._carry(Objective, method=self.method_spec())

    def update_spec(self) -> UpdateSpec:
        """How the update cuts the batch into optimizer steps (``update.update_policy``)."""
        return self._carry(UpdateSpec, objective=self.objective())

    def optimizer_spec(self) -> OptimizerSpec:
        return self._carry(OptimizerSpec)

    def sampling(self) -> SamplingSpec:
        """How rollouts are sampled and scored (``rollout.sample``, ``rollout.add_logprobs``)."""
        # training draws as HF does (SamplingSpec's default), so a run's tokens repeat under its seed on either path
        return self._carry(SamplingSpec, batch_size=self.generate_batch_size,
                           logprob_batch_size=self.logprob_batch_size, draw=SamplingSpec.draw)  # fmt: skip

    def eval_spec(self, step: int | None = None) -> EvalSpec:
        """The run's test evaluation (``evaluate.evaluate``) at ``step``, seeded with the run's seed: the full one
        (eval_full_samples) at eval_full_steps, else eval_samples per puzzle (``step`` None: the latter)."""
        full = step in self.eval_full_steps and self.eval_full_samples is not None
        samples = self.eval_full_samples if full else self.eval_samples
        return EvalSpec(prompt_style=self.prompt_style, max_new_tokens=self.eval_max_new_tokens or self.max_new_tokens,
                        modes=self.eval_modes, samples=samples, temperature=self.eval_temperature,
                        batch_size=self.generate_batch_size, seed=self.seed, fast_path=self.fast_path)  # fmt: skip

    def evaluates_at(self, step: int) -> bool:
        """Whether RL step ``step`` ends with a test evaluation: every eval_every steps, at eval_full_steps and after
        the last step (eval_people empty: never)."""
        every = bool(self.eval_every) and step % self.eval_every == 0
        return bool(self.eval_people) and (step == self.steps or every or step in self.eval_full_steps)

    def _carry(self, spec: type, **given):
        """``spec`` with ``given``, its other fields carried from this config's fields of the same names."""
        return spec(**given, **{f.name: getattr(self, f.name) for f in fields(spec) if f.name not in given})

    def lora_spec(self) -> LoraSpec | None:
        if self.lora_r is None:
            return None
        return LoraSpec(
            r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout, target_modules=self.lora_targets
        )

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))  # tuples become lists: exactly what config.json holds

    @classmethod
    def from_dict(cls, values: Mapping) -> TrainConfig:
        """From a JSON object (a run's config.json): unknown fields are refused by name (``configs.from_dict``)."""
        return from_dict(cls, values)

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """{field: the docstring under it} (CLI help, widget tooltips)."""
        return field_docs(cls)


def _validate(c: TrainConfig) -> None:
    """Raise ValueError naming the first bad field (``TrainConfig.<field> ...``); runs before any model loads.

    Types before ranges (a string where a number belongs is refused by name, not left to fail as a TypeError deep in
    training), then combinations: a minibatch that does not divide the batch, a Lopti threshold that empties a stage
    by construction, an evaluation without a mode, people counts without data files. docs/bad_inputs.md is the table
    of every field with the bad values tried and the error each gets (``python tests/bad_input_table.py``).
    """
    check = FieldCheck(c)
    for section in (_check_model, _check_data, _check_rollout, _check_optimisation, _check_objective, _check_schedule):
        section(c, check)


def _check_model(c: TrainConfig, check: FieldCheck) -> None:
    """The model, its adapters, dtype, device and attention kernel."""
    check.text("model")
    try:
        check_model_name(c.model)
    except ValueError as err:
        raise ValueError(f"TrainConfig.{err}") from None
    check.integer("lora_r", low=1, optional=True)
    check.integer("lora_alpha", low=1)
    check.real("lora_dropout", 0.0, 1.0, high_open=True)
    check.items("lora_targets", lambda t: isinstance(t, str) and t != "", "module names", distinct=True)
    check.choice("dtype", ("auto", "float32", "bfloat16", "float16"))
    half_full = half_full_finetune_error(c.dtype) if c.lora_r is None else None
    check.need(half_full is None, "dtype", f"is refused: {half_full}")
    check.text("device")
    check.need(c.device == "auto" or _is_device(c.device), "device", "must be 'auto' or a torch device ('cuda:1')")
    check.flag("gradient_checkpointing")
    check.choice("attn_implementation", ATTN_IMPLEMENTATIONS)


def _check_data(c: TrainConfig, check: FieldCheck) -> None:
    """The prompt style (resolved here when None) and the K&K data."""
    try:
        own = prompt_style_of(c.model)  # the prompt a lab model was trained on (None: the model names none)
    except (OSError, ValueError) as err:
        raise ValueError(f"TrainConfig.model: {err}") from None
    if c.prompt_style is None:
        c.prompt_style = own or "instruct"
    check.choice("prompt_style", PROMPT_STYLES)
    # quiz styles exist only for lab models: beside a model naming none, one was carried over by replace(), not chosen
    if own is None and c.prompt_style in LAB_PROMPT_STYLES:
        c.prompt_style = "instruct"
    # a lab model names its own style: any other (another lab model's included) is refused, not silently swapped,
    # as an explicit choice and a carried-over one look the same here and the model was trained on one prompt only
    check.need(own is None or c.prompt_style == own, "prompt_style", f"must be {own!r}, the prompt model {c.model!r} "
               f"was trained on (its config.json's {PROMPT_STYLE_KEY}); leave it unset (None) to use it")  # fmt: skip
    check.items("train_people", _people_count, "people counts >= 2", distinct=True)
    check.items("eval_people", _people_count, "people counts >= 2", nonempty=False, distinct=True)
    check.text("data_root", optional=True)
    check.need(c.data_root is None or Path(c.data_root).is_dir(), "data_root", "must be an existing folder or None")
    check.integer("train_limit", low=1, optional=True)


def _check_rollout(c: TrainConfig, check: FieldCheck) -> None:
    """Sampling settings."""
    check.integer("prompts_per_step", low=1)
    check.integer("group_size", low=2)  # GRPO's advantage is relative to a group
    check.real("temperature", low=0, low_open=True)
    check.real("top_p", 0.0, 1.0, low_open=True)
    check.integer("max_new_tokens", low=1)
    check.integer("max_prompt_tokens", low=1, optional=True)
    check.integer("generate_batch_size", low=1, optional=True)
    check.choice("fast_path", FAST_PATHS)


def _check_optimisation(c: TrainConfig, check: FieldCheck) -> None:
    """The optimizer and how the batch is cut into optimizer steps."""
    check.choice("optimizer", OPTIMIZERS)
    if c.optimizer == "sgd":  # AdamW's own settings would be silently unused
        for name in ("betas", "adam_eps"):
            default = getattr(OptimizerSpec, name)
            check.need(getattr(c, name) == default, name, f"is an AdamW setting: with optimizer='sgd' leave it at "
                       f"{default!r}")  # fmt: skip
    check.real("lr", low=0, low_open=True)
    check.real("weight_decay", low=0)
    check.items("betas", lambda b: is_real(b) and 0 <= b < 1, "two numbers in [0, 1)")
    check.need(len(c.betas) == 2, "betas", "must be two numbers in [0, 1)")
    check.real("adam_eps", low=0, low_open=True)
    check.integer("warmup_steps", low=0)
    check.real("grad_clip", low=0, low_open=True, optional=True)
    check.integer("minibatch_size", low=1)
    batch = c.batch_size
    check.need(batch % c.minibatch_size == 0, "minibatch_size", f"must divide the batch B = {batch} (prompts x group)")
    check.integer("micro_batch_size", low=1, optional=True)
    micro = c.micro_batch_size
    check.need(micro is None or c.minibatch_size % micro == 0, "micro_batch_size", "must divide minibatch_size")
    check.integer("ppo_epochs", low=1)
    check.integer("max_nonfinite_steps", low=0)


def _check_objective(c: TrainConfig, check: FieldCheck) -> None:
    """The loss's settings and the method's switches (one check each, shared with the specs)."""
    check_objective(check)
    check_switches(check)
    # Cui et al.'s covariance is the batch's: inside a Lopti stage (only low, or only high, tokens) it would be a
    # different population's, so the two are not combined
    split = f"{c.loss!r} measures each token's covariance over the minibatch, which a Lopti stage splits: use one"
    check.need(c.loss not in ("clip_cov", "kl_cov") or c.lopti_eta is None, "loss", split)


def _check_schedule(c: TrainConfig, check: FieldCheck) -> None:
    """Steps, seed, evaluation, probes, output; the data files last (it touches the disk)."""
    check.integer("steps", low=1)
    check.integer("seed", 0, 2**32 - 1)  # numpy's seed range
    check.integer("eval_every", low=0)
    check.integer("eval_size", low=1)
    check.items("eval_modes", lambda m: m in ("greedy", "sample"), "'greedy' / 'sample'", nonempty=False, distinct=True)
    check.need(bool(c.eval_modes) or not c.eval_people, "eval_modes", "must name a mode (eval_people=() turns it off)")
    check.integer("eval_samples", low=1)
    check.real("eval_temperature", low=0, low_open=True)
    check.integer("eval_max_new_tokens", low=1, optional=True)
    check.items("eval_full_steps", lambda k: is_int(k) and 1 <= k <= c.steps, f"steps in 1 .. steps ({c.steps})",
                nonempty=False, distinct=True)  # fmt: skip
    check.integer("eval_full_samples", low=1, optional=True)
    full_off = c.eval_full_samples is None or bool(c.eval_full_steps)
    check.need(full_off, "eval_full_samples", "is unused without eval_full_steps: name the steps, or leave it None")
    check.integer("probe_every", low=0)
    check.flag("probe_shift")
    check.integer("shift_every", low=0)
    check.integer("shift_rows", low=1, optional=True)
    edges = c.probe_bins
    check.items("probe_bins", is_real, "numbers")
    increasing = all(a < b for a, b in itertools.pairwise(edges))
    check.need(len(edges) >= 2 and edges[0] == 0 and edges[-1] == 1 and increasing, "probe_bins", "must be increasing "
               "bin edges from 0 to 1")  # fmt: skip
    check.integer("save_every", low=0)
    check.text("run_dir", optional=True)
    check.need(c.run_dir is None or not Path(c.run_dir).is_file(), "run_dir", "must be a folder, not a file")
    check.flag("progress")
    # last, as it touches the disk (a few globs): a people count without a data file fails here, not after loading
    for split, name in (("train", "train_people"), ("test", "eval_people")):
        try:
            split_files(split, getattr(c, name), c.data_root) if getattr(c, name) else None
        except FileNotFoundError as err:
            raise ValueError(f"TrainConfig.{name}: {err}") from None


def _people_count(n) -> bool:
    return is_int(n) and n >= 2


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True
