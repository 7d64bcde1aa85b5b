"""GRPO with Advantage Reweighting and Lopti: one loop, LoRA on one GPU, the same code on a laptop CPU.

    from lopti_lab.trainer import TrainConfig, train
    result = train(TrainConfig(model="lab", lora_r=None, ar_alpha=0.3, lopti_eta=0.5, steps=50, run_dir="runs/both"))
    result.history[-1]["acc/all"]

One RL step (DESIGN.md), ``train_step``:

    puzzles -> prompts -> rollout.sample: G completions per prompt, old_logp at the sampling temperature
      -> kk.score_response -> rewards -> group_advantages -> AR weights (once per step, PAPER.md §3)
      -> stages: Lopti [low, high] (PAPER.md §4) or [all]
      -> for each stage, for each epoch, for each minibatch: policy_loss -> backward -> clip -> optimizer.step
         (old_logp is NOT recomputed between the Lopti stages: stage 2's ratio sees stage 1's drift)
      -> metrics (runs.py lists the keys) -> metrics.jsonl

Shape legend: B rows = prompts x G, G group size, T response tokens, V vocabulary.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lopti_lab import runs
from lopti_lab.checks import FieldCheck, is_int, is_real
from lopti_lab.kk import PROMPT_STYLES, Puzzle, build_prompt, load_split, score_response
from lopti_lab.kk.data import split_files
from lopti_lab.models import DEFAULT_LORA_TARGETS, LoraSpec, Reference, check_model_name, load_policy
from lopti_lab.objective import group_advantages, lopti_stages, masked_mean, policy_loss, reweight_advantages
from lopti_lab.probes import GradientProbe, probability_shift
from lopti_lab.probes.shift import float64_logprobs
from lopti_lab.rollout import FAST_PATHS, Rollout, add_logprobs, response_logprobs, sample, use_lean

__all__ = [
    "TrainConfig",
    "TrainResult",
    "accuracy_se",
    "advantages_and_stages",
    "evaluate",
    "load_trained",
    "score_rollout",
    "train",
    "train_step",
    "update_policy",
]

Callback = Callable[[dict], Any]  # gets each step's metrics; a truthy return asks training to stop after the step


@dataclass
class TrainConfig:
    """Everything that defines a run. Defaults follow the paper's K&K GRPO setup (PAPER.md §6) where it applies."""

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
    """"auto" (bf16 on a GPU, float32 on CPU), "float32", "bfloat16" or "float16\""""
    device: str = "auto"
    """"auto" (cuda if available), "cpu", "cuda", "cuda:1", ..."""
    gradient_checkpointing: bool = False
    """recompute activations in backward: less GPU memory for long responses, about 30% slower updates"""

    # --- data ---
    prompt_style: str = "instruct"
    """"instruct" (the Logic-RL Qwen chat string), "base" (plain text) or "chat" (the tokenizer's chat template)"""
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
    lr: float = 1e-6
    """AdamW learning rate (the paper: 1e-6 with full fine-tuning; LoRA usually wants 1e-5 to 1e-4)"""
    weight_decay: float = 0.01
    """AdamW weight decay (the paper: 0.01)"""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    adam_eps: float = 1e-8
    """AdamW epsilon (larger values damp the updates of parameters whose gradients are tiny)"""
    warmup_steps: int = 0
    """linear learning-rate warmup over the first N RL steps (lr x step / N); 0 = constant lr"""
    grad_clip: float | None = 1.0
    """clip the gradient norm of each optimizer step (the paper: 1.0); None = no clipping"""
    minibatch_size: int = 256
    """responses per optimizer step (the paper: 256); must divide B"""
    micro_batch_size: int | None = None
    """responses per forward/backward inside a minibatch (gradient accumulation) and per no-grad log-prob forward;
    None = the whole minibatch"""
    ppo_epochs: int = 1
    """passes over the step's batch per stage (the paper: 1)"""
    max_nonfinite_steps: int = 3
    """stop the run (checkpoint saved, resumable) after this many consecutive RL steps whose update met a NaN/inf loss
    or gradient; such updates are skipped, never applied; 0 = never stop"""

    # --- objective ---
    advantage_scale: str = "std"
    """"std": GRPO's (r - mean) / (std + eps) per group; "none": r - mean (Dr. GRPO)"""
    clip_low: float = 0.2
    """lower clip range: ratio >= 1 - clip_low (the paper: 0.2)"""
    clip_high: float = 0.24
    """upper clip range: ratio <= 1 + clip_high (the paper: 0.24)"""
    dual_clip: float | None = 10.0
    """dual-clip constant c > 1 for negative advantages (the paper: 10); None = off"""
    kl_coef: float = 0.001
    """k3 KL-to-reference loss coefficient (the paper: 0.001); 0 = no reference forward at all"""
    ar_alpha: float | None = None
    """Advantage Reweighting alpha in [0, 1] (the paper: 0.3 on K&K); None = off"""
    lopti_eta: float | None = None
    """Lopti threshold in (0, 1): tokens with pi_old < eta are updated first (the paper: 0.5); None = off"""
    lopti_order: str = "low_first"
    """"low_first" (Lopti) or "high_first" (the paper's ablation, which collapses)"""

    # --- schedule, evaluation, probes, output ---
    steps: int = 100
    """RL steps to train"""
    seed: int = 0
    """seeds python, numpy and torch (model init, LoRA init, data order, sampling)"""
    eval_every: int = 50
    """evaluate every N steps and after the last step; 0 = only after the last step"""
    eval_size: int = 100
    """test puzzles per people count (the test split has 100)"""
    eval_modes: tuple[str, ...] = ("greedy", "sample")
    """"greedy" decoding and/or "sample" (eval_samples completions per puzzle at eval_temperature; the paper: both)"""
    eval_samples: int = 1
    """completions per puzzle in the "sample" mode: accuracy is their mean (more samples, less noise)"""
    eval_temperature: float = 1.0
    """temperature of the "sample" evaluation (the paper: 1.0)"""
    eval_max_new_tokens: int | None = None
    """response cap at evaluation; None = max_new_tokens"""
    probe_every: int = 0
    """log per-bin token and gradient shares every N steps (lopti_lab.probes); 0 = off"""
    probe_bins: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """edges of the probability bins of the probes (the paper's Fig. 1: quarters)"""
    save_every: int = 50
    """checkpoint every N steps; the last step (and a stop requested by a callback) always saves; 0 = only those"""
    run_dir: str | None = None
    """the run folder (runs.py); None = runs/<method>-<date-time> under the working directory"""
    progress: bool = True
    """show a tqdm progress bar"""

    def __post_init__(self):
        for name in ("lora_targets", "train_people", "eval_people", "betas", "eval_modes", "probe_bins"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):  # JSON gives lists; keep tuples so configs compare equal
                setattr(self, name, tuple(value))
        _validate(self)

    @property
    def method(self) -> str:
        """ "GRPO", "GRPO+AR", "GRPO+Lopti" or "GRPO+AR+Lopti"."""
        return runs.method_label(self)

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
        return self.batch_size // self.minibatch_size * self.ppo_epochs

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
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"TrainConfig: unknown field(s) {sorted(unknown)}")
        return cls(**values)

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """{field: the docstring under it} (CLI help, widget tooltips)."""
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body
        docs = {}
        for node, nxt in itertools.pairwise(body):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
        return docs


def _validate(c: TrainConfig) -> None:
    """Raise ValueError naming the first bad field (``TrainConfig.<field> ...``); runs before any model loads.

    Types before ranges (a string where a number belongs is refused by name, not left to fail as a TypeError deep in
    training), then combinations: a minibatch that does not divide the batch, a Lopti threshold that empties a stage
    by construction, an evaluation without a mode, people counts without data files. docs/bad_inputs.md is the table
    of every field with the bad values tried and the error each gets (``python -m lopti_lab.bad_inputs``).
    """
    check = FieldCheck(c)
    # --- model
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
    check.text("device")
    check.need(c.device == "auto" or _is_device(c.device), "device", "must be 'auto' or a torch device ('cuda:1')")
    check.flag("gradient_checkpointing")
    # --- data
    check.choice("prompt_style", PROMPT_STYLES)
    check.items("train_people", _people_count, "people counts >= 2", distinct=True)
    check.items("eval_people", _people_count, "people counts >= 2", nonempty=False, distinct=True)
    check.text("data_root", optional=True)
    check.need(c.data_root is None or Path(c.data_root).is_dir(), "data_root", "must be an existing folder or None")
    check.integer("train_limit", low=1, optional=True)
    # --- rollout
    check.integer("prompts_per_step", low=1)
    check.integer("group_size", low=2)  # GRPO's advantage is relative to a group
    check.real("temperature", low=0, low_open=True)
    check.real("top_p", 0.0, 1.0, low_open=True)
    check.integer("max_new_tokens", low=1)
    check.integer("max_prompt_tokens", low=1, optional=True)
    check.integer("generate_batch_size", low=1, optional=True)
    check.choice("fast_path", FAST_PATHS)
    # --- optimisation
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
    # --- objective
    check.choice("advantage_scale", ("std", "none"))
    check.real("clip_low", 0.0, 1.0, high_open=True)
    check.real("clip_high", low=0.0)
    check.real("dual_clip", low=1.0, low_open=True, optional=True)
    check.real("kl_coef", low=0.0)
    check.real("ar_alpha", 0.0, 1.0, optional=True)
    # Lopti stage 1 holds the tokens with pi_old < eta: eta <= 0 empties it, eta >= 1 empties stage 2 (PAPER.md §4)
    check.real("lopti_eta", 0.0, 1.0, low_open=True, high_open=True, optional=True)
    check.choice("lopti_order", ("low_first", "high_first"))
    # --- schedule, evaluation, probes, output
    check.integer("steps", low=1)
    check.integer("seed", 0, 2**32 - 1)  # numpy's seed range
    check.integer("eval_every", low=0)
    check.integer("eval_size", low=1)
    check.items("eval_modes", lambda m: m in ("greedy", "sample"), "'greedy' / 'sample'", nonempty=False, distinct=True)
    check.need(bool(c.eval_modes) or not c.eval_people, "eval_modes", "must name a mode (eval_people=() turns it off)")
    check.integer("eval_samples", low=1)
    check.real("eval_temperature", low=0, low_open=True)
    check.integer("eval_max_new_tokens", low=1, optional=True)
    check.integer("probe_every", low=0)
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


# --- one RL step ------------------------------------------------------------------------------------------------------


def score_rollout(rollout: Rollout, puzzles: Sequence[Puzzle]) -> list:
    """The Logic-RL reward of each row (row b answers puzzles[b // G]); the prompt ended in "<think>", which
    ``score_response`` puts back in front of the response."""
    group = rollout.group_size
    return [score_response(text, puzzles[b // group]) for b, text in enumerate(rollout.texts)]


def _schedule(stages, n_rows: int, minibatch: int, epochs: int) -> Iterator[tuple[str, torch.Tensor, slice]]:
    """The update order: every minibatch of stage 1 (Lopti: low tokens), then every minibatch of stage 2.

    A minibatch with no token in the stage still takes its optimizer step (zero gradient, but AdamW's momentum and
    weight decay move the weights), as the paper's code does, so Lopti always takes twice GRPO's steps."""
    for name, stage_mask in stages:
        for _ in range(epochs):
            for start in range(0, n_rows, minibatch):
                yield name, stage_mask, slice(start, start + minibatch)


def _probe_tokens(probe: GradientProbe | None, rollout: Rollout, rows: slice) -> Callable[[int], None] | None:
    """Tell the probe, before each forward, the rollout probabilities of the t response columns that forward keeps."""
    if probe is None:
        return None
    return lambda t: probe.set_tokens(rollout.old_logp[rows, :t].exp(), rollout.response_mask[rows, :t])


def _acting_rows(acting: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a micro-batch that have a token with a gradient, acting (b, T) bool, and for each of them the
    response mask cut after its last such token (k, T): the forward those tokens need (causal attention)."""
    reach = acting.flip(1).cumsum(1).flip(1) > 0  # (b, T): up to and including the row's last acting token
    rows = acting.any(1).nonzero()[:, 0]  # (k,)
    return rows, (response_mask * reach)[rows]


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    advantages: torch.Tensor,
    stages: Sequence[tuple[str, torch.Tensor]],
    config: TrainConfig,
    probe: GradientProbe | None = None,
) -> dict[str, float]:
    """All optimizer steps of one RL step; returns the update's metrics.

    advantages: (B, T) per token (AR already applied); stages: [(name, mask (B, T))], [("all", response_mask)] for
    GRPO. Each minibatch's loss is a token mean with the minibatch's full response-token count as denominator, also
    inside a Lopti stage (the paper's code). A non-finite loss or gradient norm skips that optimizer step, zeroes
    the gradients and ends the step's updates (``skipped/nonfinite`` = 1). An attached ``probe`` gets each
    micro-batch's rollout probabilities before its forward and records the per-bin gradients of its backward.

    Only the stage's tokens with a nonzero advantage (every stage token when a KL term acts) have a gradient: the
    diagnostics (approx_kl, clip fractions, kl) are means over those, and, when pi_old is given and no probe is
    attached, the forwards skip the rest (``_acting_rows``): a group whose rewards are all equal is not run at all,
    and each row stops at its last such token. The gradient is the same sum, less its exact zeros.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    micro = config.micro_batch_size or config.minibatch_size
    on_policy = rollout.old_logp is None  # pi_old comes from the update's own forward: one optimizer step only
    if on_policy and (len(stages) > 1 or config.optimizer_steps_per_stage > 1):
        raise ValueError("rollout.old_logp is required when the update takes more than one optimizer step")
    input_ids, attention_mask = rollout.input_ids, rollout.attention_mask  # (B, P + T)
    keys = ("approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "kl", "tokens", "loss", "entropy")
    sums = {key: torch.zeros((), device=input_ids.device) for key in keys}
    grad_norms, n_steps, nonfinite = [], 0, False
    with_kl = rollout.ref_logp is not None and config.kl_coef != 0.0
    trim = not on_policy and probe is None  # on-policy: every row's forward is pi_old and its entropy
    model.train()
    try:
        for _name, stage_mask, rows in _schedule(stages, len(rollout), config.minibatch_size, config.ppo_epochs):
            denom = rollout.response_mask[rows].sum()  # all response tokens of the minibatch, whatever the stage
            optimizer.zero_grad(set_to_none=True)
            minibatch_loss, ran = torch.zeros((), device=input_ids.device), False
            for start in range(rows.start, rows.stop, micro):
                m = slice(start, start + micro)
                acting = stage_mask[m].bool() if with_kl else stage_mask[m].bool() & (advantages[m] != 0)  # (b, T)
                r, reach = m, rollout.response_mask[m]  # the rows run and their response columns
                if trim:
                    kept, reach = _acting_rows(acting, reach)
                    if len(kept) == 0:
                        continue  # no token of this micro-batch has a gradient
                    r, acting = kept + start, acting[kept]
                logp, entropy = response_logprobs(
                    model,
                    input_ids[r],
                    attention_mask[r],
                    reach,
                    config.temperature,
                    with_entropy=on_policy,
                    before_forward=_probe_tokens(probe, rollout, m),
                    fast_path=config.fast_path,
                )  # (b, T)
                if on_policy:  # the weights are still the rollout's: this forward IS pi_old, exactly
                    sums["entropy"] += (entropy * rollout.response_mask[m]).sum()
                loss, stats = policy_loss(
                    logp,
                    logp.detach() if on_policy else rollout.old_logp[r],
                    advantages[r],
                    acting,
                    clip_low=config.clip_low,
                    clip_high=config.clip_high,
                    dual_clip=config.dual_clip,
                    ref_logp=None if rollout.ref_logp is None else rollout.ref_logp[r],
                    kl_coef=config.kl_coef,
                    denom=denom,
                )
                loss.backward()
                ran = True
                minibatch_loss += loss.detach()
                for key in ("approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "kl"):
                    sums[key] += stats[key] * stats["tokens"]
                sums["tokens"] += stats["tokens"]
            if not ran:  # every forward skipped: the step is still taken, on the zero gradient a backward gives
                for p in params:
                    p.grad = torch.zeros_like(p)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip or math.inf)
            if not (torch.isfinite(minibatch_loss) and torch.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                nonfinite = True
                break
            optimizer.step()
            n_steps += 1
            grad_norms.append(grad_norm.detach())
            sums["loss"] += minibatch_loss
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
    n_minibatches = config.optimizer_steps_per_stage
    tokens = max(sums["tokens"].item(), 1.0)
    return {
        "policy/approx_kl": sums["approx_kl"].item() / tokens,
        "policy/clip_frac_low": sums["clip_frac_low"].item() / tokens,
        "policy/clip_frac_high": sums["clip_frac_high"].item() / tokens,
        "policy/dual_clip_frac": sums["dual_clip_frac"].item() / tokens,
        "policy/kl": sums["kl"].item() / tokens,
        "loss/policy": sums["loss"].item() / n_minibatches,  # Lopti: its two stages add up to one loss
        "grad/norm": torch.stack(grad_norms).mean().item() if grad_norms else math.nan,
        "update/optimizer_steps": float(n_steps),
        "skipped/nonfinite": float(nonfinite),
        **({"policy/entropy": sums["entropy"].item() / rollout.response_mask.sum().item()} if on_policy else {}),
    }


def advantages_and_stages(
    rollout: Rollout, advantages: torch.Tensor, config: TrainConfig
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], dict[str, float]]:
    """Per-token advantages (B, T) with AR applied, the update stages [(name, mask (B, T))] and their metrics.

    AR (PAPER.md §3) weights each token once per step, and every stage and minibatch uses those weights; Lopti
    (§4) gives [("low", ...), ("high", ...)] in ``config.lopti_order``, GRPO [("all", response_mask)]. Both read
    ``rollout.old_logp``; advantages: (B,) per sequence.
    """
    mask = rollout.response_mask  # (B, T)
    token_adv = advantages[:, None].expand_as(mask)  # (B, T)
    metrics: dict[str, float] = {}
    if config.ar_alpha is not None:  # AR, Eq. 4
        alpha = config.ar_alpha
        token_adv = reweight_advantages(advantages, rollout.old_logp, alpha)  # (B, T)
        metrics["ar/weight_mean"] = masked_mean(alpha * rollout.old_logp.exp() + 1 - alpha, mask).item()
    if config.lopti_eta is None:
        return token_adv, [("all", mask)], metrics
    stages = lopti_stages(rollout.old_logp, mask, config.lopti_eta, config.lopti_order)  # stage 1 low, stage 2 high
    metrics["lopti/low_share"] = (dict(stages)["low"].sum() / mask.sum()).item()
    return token_adv, stages, metrics


def train_step(
    model: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    puzzles: Sequence[Puzzle],
    config: TrainConfig,
    reference: Reference | None = None,
    probe: bool = False,
) -> dict[str, float]:
    """One RL step on ``puzzles`` (prompts_per_step of them): rollout, reward, advantages, update; its metrics."""
    cfg, group = config, config.group_size
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    # pi_old before the update: AR weights and Lopti stages read it, a probe bins by it, and a second optimizer step
    # needs it from the weights before the first. Plain GRPO with one optimizer step per rollout gets it exactly from
    # its update forward instead (weights unchanged until the step), which saves a forward pass, as TRL does.
    needs_old = cfg.ar_alpha is not None or cfg.lopti_eta is not None or probe or cfg.optimizer_steps_per_stage > 1
    # The lean decoder's sampling logits give pi_old for free: the rollout policy at the sampling temperature, which
    # is what the ratio's denominator is (PAPER.md §2), equal to a forward's log-probs to float32 rounding
    # (tests/test_decode.py). A probe step too: its probability shift compares two float64 forwards of its own
    # (shift_logprobs), and pi_old only bins the tokens.
    from_decode = needs_old and use_lean(model, cfg.fast_path)
    t0 = time.perf_counter()
    prompts = [build_prompt(p, cfg.prompt_style, tokenizer) for p in puzzles]
    rollout = sample(
        model,
        tokenizer,
        prompts,
        group,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_prompt_tokens=cfg.max_prompt_tokens,
        batch_size=cfg.generate_batch_size,
        with_logprobs=from_decode,
        fast_path=cfg.fast_path,
    )
    sync()
    t1 = time.perf_counter()
    policy = needs_old and rollout.old_logp is None
    add_logprobs(model, rollout, cfg.temperature, True, reference, cfg.logprob_batch_size, policy, cfg.fast_path)
    sync()
    t2 = time.perf_counter()
    rewards = score_rollout(rollout, puzzles)
    t3 = time.perf_counter()

    device = rollout.response_ids.device
    mask = rollout.response_mask  # (B, T)
    totals = torch.tensor([r.total for r in rewards], dtype=torch.float32, device=device)  # (B,)
    advantages = group_advantages(totals, group, cfg.advantage_scale)  # (B,)
    token_adv, stages, metrics = advantages_and_stages(rollout, advantages, cfg)

    # every probe_every steps: per-bin gradient shares of the real update (position attribution, probes.py), and
    # the probability shift it causes, measured between float64 forwards before and after it (shift_metrics)
    gradient_probe = GradientProbe(model, bins=cfg.probe_bins) if probe else None
    before = shift_logprobs(model, rollout, cfg) if probe else None
    with gradient_probe or nullcontext():
        metrics.update(update_policy(model, optimizer, rollout, token_adv, stages, cfg, gradient_probe))
    sync()
    t4 = time.perf_counter()
    if gradient_probe is not None and metrics["update/optimizer_steps"] > 0:
        metrics.update(gradient_probe.metrics())
        metrics.update(shift_metrics(model, rollout, advantages, cfg, before))
    if rollout.entropy is not None:
        metrics["policy/entropy"] = masked_mean(rollout.entropy, mask).item()

    people = torch.tensor([p.n_people for p in puzzles for _ in range(group)], device=device)  # (B,)
    correct = (totals == 3.0).float()  # (B,)
    grouped = totals.view(-1, group)  # (B/G, G)
    metrics.update(
        {
            "reward/mean": totals.mean().item(),
            "reward/std": totals.std(correction=0).item(),
            "acc/all": correct.mean().item(),
            **{f"acc/{n}ppl": correct[people == n].mean().item() for n in sorted(set(people.tolist()))},
            "format/error_rate": float(np.mean([r.format_score < 0 for r in rewards])),
            "len/response_mean": rollout.lengths.mean().item(),
            "len/response_max": rollout.lengths.max().item(),
            "len/truncated_share": (~rollout.finished).float().mean().item(),
            "groups/zero_var_share": (grouped.max(1).values == grouped.min(1).values).float().mean().item(),
            "adv/abs_mean": masked_mean(token_adv.abs(), mask).item(),
            "time/generate": t1 - t0,
            "time/logprob": t2 - t1,
            "time/score": t3 - t2,
            "time/update": t4 - t3,
        }
    )
    return metrics


def shift_logprobs(model: torch.nn.Module, rollout: Rollout, cfg: TrainConfig) -> torch.Tensor:
    """(B, T) float64 log-probs of the rollout's tokens under the model as it is now (``probes.float64_logprobs``)."""
    return float64_logprobs(
        model, rollout.input_ids, rollout.attention_mask, rollout.response_mask, cfg.temperature,
        cfg.logprob_batch_size,
    )  # fmt: skip


def shift_metrics(
    model: torch.nn.Module, rollout: Rollout, advantages: torch.Tensor, cfg: TrainConfig, before: torch.Tensor
) -> dict:
    """How the step's update moved each response token's probability, per probability bin (the paper's Fig. 2b,
    measured as its code does: log-probs recomputed on the same batch after the update, here in float64 so that a
    token near p = 1 is seen to move). ``before``: ``shift_logprobs`` taken before the update.

    Keys: ``shift/correct_{pos,neg}_bin{i}`` (among the A > 0 tokens that moved, the share that went up; among the
    A < 0 ones, the share that went down), ``shift/unmoved_{pos,neg}_bin{i}`` (share that did not move at all),
    ``shift/n_{pos,neg}_bin{i}`` (token counts) and ``shift/dp_mean_bin{i}``.
    """
    after = shift_logprobs(model, rollout, cfg)
    shift = probability_shift(before, after, advantages, rollout.response_mask, cfg.probe_bins)
    out = {}
    for row in shift.bins.itertuples():
        out[f"shift/n_{row.sign}_bin{row.bin}"] = float(row.n_tokens)
        out[f"shift/correct_{row.sign}_bin{row.bin}"] = float(row.correct_ratio) if row.n_moved else math.nan
        out[f"shift/unmoved_{row.sign}_bin{row.bin}"] = float(row.unmoved_share) if row.n_tokens else math.nan
    means = shift.tokens.groupby("bin")["delta_p"].mean()
    out.update({f"shift/dp_mean_bin{k}": float(v) for k, v in means.items()})
    return out


# --- evaluation -------------------------------------------------------------------------------------------------------


def evaluate(
    model: torch.nn.Module,
    tokenizer,
    puzzles: Iterable[Puzzle],
    *,
    prompt_style: str = "instruct",
    max_new_tokens: int = 4096,
    modes: Sequence[str] = ("greedy", "sample"),
    samples: int = 1,
    temperature: float = 1.0,
    batch_size: int | None = None,
    seed: int = 0,
    prefix: str = "eval",
    fast_path: str = "auto",
) -> dict[str, float]:
    """Test accuracy (share of completions with reward 3) by people count, greedy and/or ``samples`` sampled
    completions per puzzle at ``temperature``, each with its standard error.

    Keys: ``{prefix}/{mode}/acc_{n}ppl``, ``{prefix}/{mode}/acc_all`` (the mean over people counts, the paper's
    "avg"), each with an ``_se`` twin (``accuracy_se``), ``{prefix}/{mode}/format_error_rate`` and
    ``{prefix}/{mode}/len_mean``. Sampling runs under a forked torch RNG seeded with ``seed``, so evaluating never
    changes the training run's random stream. ``fast_path``: the decoder (``rollout.FAST_PATHS``).
    """
    puzzles = list(puzzles)
    if not puzzles:
        return {}
    device = next(model.parameters()).device
    prompts = [build_prompt(p, prompt_style, tokenizer) for p in puzzles]
    people = np.array([p.n_people for p in puzzles])
    out: dict[str, float] = {}
    for mode in modes:
        group = 1 if mode == "greedy" else samples
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            rollout = sample(
                model,
                tokenizer,
                prompts,
                group,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                greedy=mode == "greedy",
                batch_size=batch_size,
                with_logprobs=False,
                fast_path=fast_path,
            )
        rewards = score_rollout(rollout, puzzles)
        correct = np.array([r.total == 3.0 for r in rewards], dtype=float).reshape(len(puzzles), group)  # (n, G)
        counts = sorted(set(people.tolist()))
        per_people = {n: float(correct[people == n].mean()) for n in counts}
        se = {n: accuracy_se(correct[people == n]) for n in counts}
        out.update({f"{prefix}/{mode}/acc_{n}ppl": acc for n, acc in per_people.items()})
        out.update({f"{prefix}/{mode}/acc_{n}ppl_se": value for n, value in se.items()})
        out[f"{prefix}/{mode}/acc_all"] = float(np.mean(list(per_people.values())))
        out[f"{prefix}/{mode}/acc_all_se"] = math.sqrt(sum(v**2 for v in se.values())) / len(counts)
        out[f"{prefix}/{mode}/format_error_rate"] = float(np.mean([r.format_score < 0 for r in rewards]))
        out[f"{prefix}/{mode}/len_mean"] = rollout.lengths.float().mean().item()
    return out


def accuracy_se(correct: np.ndarray) -> float:
    """Standard error of the accuracy of n puzzles x G completions, correct: (n, G) of 0/1.

    The puzzles are the independent units (a puzzle's completions share its difficulty, so they are not
    independent draws): the accuracy is the mean of the n per-puzzle means c_i, and its standard error is
    sd(c_i) / sqrt(n) (sample sd, ddof 1), the cluster-robust binomial error. G = 1 gives the binomial
    sqrt(p (1 - p) / (n - 1)). Example: correct [[1, 0], [1, 1], [0, 0], [1, 0]] has c = (0.5, 1, 0, 0.5), accuracy
    0.5, sd 0.408, SE 0.204 (treating the 8 completions as independent would give 0.189). NaN for one puzzle."""
    per_puzzle = correct.mean(1)  # (n,)
    if len(per_puzzle) < 2:
        return math.nan
    return float(per_puzzle.std(ddof=1) / math.sqrt(len(per_puzzle)))


# --- the loop ---------------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What ``train`` hands back: the run folder, the trained policy (still in memory) and every step's metrics."""

    run_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    config: TrainConfig
    history: list[dict] = field(default_factory=list)
    stopped: bool = False  # a callback asked to stop before config.steps


class PuzzleStream:
    """The training puzzles in a fresh seeded order each epoch; ``batch(step)`` depends only on (seed, step), so a
    resumed run sees the same puzzles as a straight one without saving any sampler state."""

    def __init__(self, puzzles: Sequence[Puzzle], per_step: int, seed: int):
        self.puzzles, self.per_step, self.seed = list(puzzles), per_step, seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.puzzles))}
        return self._orders[epoch]

    def batch(self, step: int) -> list[Puzzle]:
        """Puzzles of RL step ``step`` (1-based)."""
        n = len(self.puzzles)
        flat = range((step - 1) * self.per_step, step * self.per_step)
        return [self.puzzles[self._order(i // n)[i % n]] for i in flat]


# fields a resumed run may change (everything else must match the saved config)
RESUMABLE_CHANGES = ("steps", "eval_every", "save_every", "progress", "run_dir", "max_nonfinite_steps")


class NonFiniteError(FloatingPointError):
    """Raised by ``train`` after ``max_nonfinite_steps`` consecutive steps whose updates were skipped for a NaN/inf
    loss or gradient. The run folder is saved at the last of them and can resume; ``result`` is the TrainResult."""

    def __init__(self, message: str, result: TrainResult):
        super().__init__(message)
        self.result = result


def train(config: TrainConfig, callbacks: Iterable[Callback] = (), resume: bool = False) -> TrainResult:
    """Run ``config.steps`` RL steps, logging each to ``config.run_dir``; see the module docstring for one step.

    callbacks: each is called with every step's metrics dict (after it is written); a truthy return ends training
    cleanly after that step (a checkpoint is saved, so the run can resume). ``resume=True`` continues from the run
    folder's latest consistent checkpoint (``runs.check_resume``: a folder that holds no run, or a damaged one, is a
    RunFolderError naming the file and line): weights, optimizer and RNG states are restored and metrics.jsonl is cut
    back to that step, so on CPU the continued run reproduces a straight one exactly. After
    ``config.max_nonfinite_steps`` consecutive non-finite steps it saves a checkpoint and raises NonFiniteError.
    """
    cfg = config
    if cfg.run_dir is None:
        cfg = replace(cfg, run_dir=str(Path("runs") / f"{cfg.method.lower()}-{time.strftime('%Y%m%d-%H%M%S')}"))
    folder = runs.RunFolder(cfg.run_dir)
    point = resume_point(cfg) if resume else None
    if not resume and folder.exists():
        raise runs.RunFolderError(
            f"TrainConfig.run_dir {cfg.run_dir!r} already holds a run; pass resume=True or a new folder"
        )

    # data first: cheap, and a missing file fails before any model loads
    stream = PuzzleStream(
        load_split("train", cfg.train_people, cfg.data_root, cfg.train_limit), cfg.prompts_per_step, cfg.seed
    )
    eval_set = load_split("test", cfg.eval_people, cfg.data_root, cfg.eval_size) if cfg.eval_people else []
    if point is None:
        folder.write_config(cfg.to_dict())  # the run exists from here: a kill while the model loads can resume

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(cfg.model, cfg.lora_spec(), cfg.dtype, cfg.device, cfg.gradient_checkpointing)
    reference = Reference(model) if cfg.kl_coef > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].is_cuda
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=fused
    )

    start, history = 0, []
    if point is not None:
        if point.checkpoint is not None:  # else: the initial weights and the seeded RNG, as a straight run starts
            start = runs.load_checkpoint(point.checkpoint, model, optimizer)
        runs.repair_for_resume(folder.path, point)
        for note in point.notes:
            print(f"resume {folder.path}: {note}", file=sys.stderr)
        history = list(point.records)
        folder.write_config(cfg.to_dict())

    stopped = False
    bar = tqdm(
        range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc=cfg.method, disable=not cfg.progress
    )
    for step in bar:
        t0 = time.perf_counter()
        probe = cfg.probe_every > 0 and step % cfg.probe_every == 0
        for group in optimizer.param_groups:  # a function of the step alone, so a resumed run continues it exactly
            group["lr"] = learning_rate(cfg, step)
        metrics = {"step": step, **train_step(model, tokenizer, optimizer, stream.batch(step), cfg, reference, probe)}
        if eval_set and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            t_eval = time.perf_counter()
            metrics.update(
                evaluate(
                    model,
                    tokenizer,
                    eval_set,
                    prompt_style=cfg.prompt_style,
                    max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                    modes=cfg.eval_modes,
                    samples=cfg.eval_samples,
                    temperature=cfg.eval_temperature,
                    batch_size=cfg.generate_batch_size,
                    seed=cfg.seed,
                    fast_path=cfg.fast_path,
                )
            )
            metrics["time/eval"] = time.perf_counter() - t_eval
        metrics["time/step"] = time.perf_counter() - t0
        folder.log(metrics)
        history.append(metrics)
        stopped = any([bool(callback(metrics)) for callback in callbacks])  # every callback sees every step
        sick = _nonfinite_streak(history)
        halt = bool(cfg.max_nonfinite_steps) and sick >= cfg.max_nonfinite_steps
        if stopped or halt or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
            runs.save_checkpoint(folder.path, step, model, optimizer, tokenizer)
        bar.set_postfix({"reward": f"{metrics['reward/mean']:.2f}", "acc": f"{metrics['acc/all']:.2f}"})
        if halt:
            bar.close()
            result = TrainResult(folder.path, model, tokenizer, cfg, history, stopped=True)
            raise NonFiniteError(_nonfinite_message(cfg, step, sick), result)
        if stopped:
            break
    bar.close()
    return TrainResult(folder.path, model, tokenizer, cfg, history, stopped and history[-1]["step"] < cfg.steps)


def resume_point(cfg: TrainConfig) -> runs.ResumePoint:
    """Everything a resume checks before any model loads: the folder (``runs.check_resume``), that its config.json
    still validates and matches ``cfg`` but for RESUMABLE_CHANGES, and that the run is not past ``cfg.steps``."""
    path = Path(cfg.run_dir)
    point = runs.check_resume(path)
    try:
        saved = TrainConfig.from_dict(point.config)
    except (ValueError, TypeError) as err:
        raise runs.RunFolderError(f"{path / runs.CONFIG} no longer validates: {err}") from None
    changed = [f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(saved, f.name)]
    changed = [name for name in changed if name not in RESUMABLE_CHANGES]
    if changed:
        raise runs.RunFolderError(f"resume: config differs from {path / runs.CONFIG} in {changed}")
    if point.step > cfg.steps:
        raise runs.RunFolderError(f"resume: {path} is at step {point.step}, past TrainConfig.steps={cfg.steps}")
    return point


def _nonfinite_streak(history: Sequence[Mapping]) -> int:
    """How many of the last steps in a row skipped their update for a non-finite loss or gradient."""
    streak = 0
    for record in reversed(history):
        if not record.get("skipped/nonfinite"):
            break
        streak += 1
    return streak


def _nonfinite_message(cfg: TrainConfig, step: int, streak: int) -> str:
    return (
        f"stopped: steps {step - streak + 1}-{step} ({streak} in a row, TrainConfig.max_nonfinite_steps="
        f"{cfg.max_nonfinite_steps}) met a NaN/inf loss or gradient, so their updates were skipped and the weights "
        f"are those of step {step - streak}. Usual causes: a learning rate too high for the dtype, or float16 "
        f"overflow. The run is saved at step {step} in {cfg.run_dir}; `lopti-lab train --run-dir {cfg.run_dir} "
        "--resume` continues it."
    )


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """The learning rate of RL step ``step`` (1-based): linear warmup over ``warmup_steps``, then constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    return cfg.lr


def load_trained(run_dir: str | Path, step: int | None = None, device: str | None = None):
    """(model, tokenizer, config) of a run folder at its latest checkpoint, or at ``step``."""
    cfg = TrainConfig.from_dict(runs.load_config(run_dir))
    folder = Path(run_dir) / runs.CHECKPOINTS / f"step_{step}" if step is not None else runs.latest_checkpoint(run_dir)
    if folder is None or not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint {'step_' + str(step) if step else ''} in {run_dir}/checkpoints")
    model, tokenizer = load_policy(cfg.model, cfg.lora_spec(), cfg.dtype, device or cfg.device)
    runs.load_checkpoint(folder, model, restore_rng=False)
    return model, tokenizer, cfg


# --- command line -----------------------------------------------------------------------------------------------------

_ALIASES = {"ar_alpha": ["--ar"], "lopti_eta": ["--lopti"], "model": ["-m"]}


def _none_or(kind: type) -> Callable[[str], Any]:
    def parse(text: str):
        return None if text.lower() in ("none", "null", "off") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per TrainConfig field (--lora-r, --ar-alpha, ...), help from the field docstrings; unset options
    keep the defaults (or the --config file's values)."""
    docs = TrainConfig.field_docs()
    hints = {f.name: f.type for f in fields(TrainConfig)}
    for f in fields(TrainConfig):
        flags = [f"--{f.name.replace('_', '-')}", *_ALIASES.get(f.name, [])]
        hint, help_text = str(hints[f.name]), docs.get(f.name, "")
        kind = int if "int" in hint else float if "float" in hint else str
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text.replace("%", "%%"), "dest": f.name}
        if hint == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif hint.startswith("tuple"):
            kwargs.update(nargs="*" if f.name == "eval_people" else "+", type=kind)
        else:
            kwargs["type"] = _none_or(kind) if "None" in hint else kind
        parser.add_argument(*flags, **kwargs)


def add_cli(subparsers) -> None:
    """``lopti-lab train`` and ``lopti-lab eval`` (both live here; a second call adds nothing)."""
    if "train" not in subparsers.choices:
        p = subparsers.add_parser(
            "train",
            help="train a GRPO policy on K&K (AR: --ar ALPHA, Lopti: --lopti ETA)",
            description=__doc__.splitlines()[0],
        )
        p.add_argument("--config", help="a JSON file of TrainConfig fields (e.g. a run's config.json)")
        p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
        _add_config_options(p)
        p.set_defaults(func=_cli_train)
    if "eval" not in subparsers.choices:
        p = subparsers.add_parser("eval", help="K&K test accuracy of a model or a trained run, by people count")
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--model", "-m", help="hub id, local folder or 'lab' (no adapter)")
        source.add_argument("--run", help="a run folder: its model with the latest (or --step) checkpoint")
        p.add_argument("--step", type=int, help="checkpoint step of --run (default: latest)")
        p.add_argument("--people", type=int, nargs="+", default=[3, 4, 5, 6, 7])
        p.add_argument("--size", type=int, default=100, help="test puzzles per people count")
        p.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"])
        p.add_argument("--temperature", type=float, default=1.0, help="temperature of the 'sample' mode")
        p.add_argument("--max-new-tokens", type=int, default=4096)
        p.add_argument("--prompt-style", default=None, help="default: the run's, else instruct")
        p.add_argument("--data-root", default=None)
        p.add_argument("--batch-size", type=int, default=None, help="rows per generate call")
        p.add_argument("--device", default="auto")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="also write the metrics to this JSON file")
        p.set_defaults(func=_cli_eval)


def _cli_train(args: argparse.Namespace) -> int:
    """Exit codes: 0 done, 2 bad input (a config field, a run folder), 3 stopped by non-finite steps (resumable)."""
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    try:
        cfg = TrainConfig.from_dict({**_cli_base_values(args, given.get("run_dir")), **given})
    except ValueError as err:  # a field, or a run folder (RunFolderError)
        print(f"lopti-lab train: {err}", file=sys.stderr)
        return 2
    try:
        result = train(cfg, resume=args.resume)
    except runs.RunFolderError as err:  # raised before any model loads
        print(f"lopti-lab train: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"lopti-lab train: {err}", file=sys.stderr)
        return 3
    last = result.history[-1] if result.history else {}
    print(f"{cfg.method}: {len(result.history)} steps in {result.run_dir}")
    for key in sorted(k for k in last if k.startswith(("eval/", "acc/all", "reward/mean"))):
        print(f"  {key:32s} {last[key]:.4f}")
    return 0


def _cli_base_values(args: argparse.Namespace, run_dir: str | None) -> dict:
    """The values that options not given keep: the --config file's, else on --resume the run's own config.json
    (so `lopti-lab train --run-dir runs/x --resume` needs no other option), else the defaults."""
    if args.config:
        return _json(args.config)
    if not args.resume:
        return {}
    if run_dir is None:
        raise runs.RunFolderError("--resume needs --run-dir, the folder of the run to continue")
    if not (Path(run_dir) / runs.CONFIG).is_file():
        runs.check_resume(run_dir)  # raises: the folder holds no run
    return runs.load_config(run_dir)


def _json(file: str) -> dict:
    try:
        values = json.loads(Path(file).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise runs.RunFolderError(f"{file} line {err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(values, dict):
        raise runs.RunFolderError(f"{file}: a JSON {type(values).__name__}, not an object of TrainConfig fields")
    return values


def _cli_eval(args: argparse.Namespace) -> int:
    if args.run:
        model, tokenizer, cfg = load_trained(args.run, args.step, args.device)
        style, root = args.prompt_style or cfg.prompt_style, args.data_root or cfg.data_root
    else:
        model, tokenizer = load_policy(args.model, lora=None, dtype=args.dtype, device=args.device)
        style, root = args.prompt_style or "instruct", args.data_root
    puzzles = load_split("test", args.people, root, args.size)
    metrics = evaluate(
        model,
        tokenizer,
        puzzles,
        prompt_style=style,
        max_new_tokens=args.max_new_tokens,
        modes=args.modes,
        temperature=args.temperature,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    for key, value in metrics.items():
        print(f"{key:32s} {value:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return 0
