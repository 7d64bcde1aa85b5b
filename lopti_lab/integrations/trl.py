"""AR and Lopti inside TRL's ``GRPOTrainer``: the same objective as our trainer, with TRL's distribution around it.

    from lopti_lab.integrations.trl import LoptiGRPOConfig, LoptiGRPOTrainer, kk_dataset, kk_reward
    args = LoptiGRPOConfig(output_dir="runs/trl", ar_alpha=0.3, lopti_eta=0.5, rl_steps=100, ...)
    trainer = LoptiGRPOTrainer(model="Qwen/Qwen2.5-3B-Instruct", reward_funcs=[kk_reward], args=args,
                               train_dataset=kk_dataset(puzzles))
    trainer.train()

Everything TRL does stays TRL's: generation (HF or vLLM), reward gathering, group advantages, the optimizer, the
scheduler, gradient accumulation, clipping, DeepSpeed/FSDP step counting, checkpoints. The subclass overrides four
methods, each because it changes the loss (a callback cannot: the per-bin measurements live in
``integrations.trl_callback.TokenCreditCallback``, which attaches to this trainer as to TRL's), and calls
``lopti_lab.objective`` for the math (docs/paper.md §3-4). ``OVERRIDES`` records the signature of each hooked method
in the TRL version it was written against; tests/test_integrations_trl.py fails, naming the TRL version, when one
changes:

``_generate_and_score_completions``  once per generation: AR advantages (B, T) = [alpha * pi_old + (1 - alpha)] * A
    from the rollout policy's old log-probs (at the sampling temperature: TRL's fused LM head divides by it), and
    the Lopti stage masks from the same pi_old. Stored in the generation buffer, so never recomputed.
``_prepare_inputs``  Lopti: TRL's multi-iteration buffer replays each generation batch once per stage
    (``num_iterations`` passes per stage); each micro-step gets a view of its buffered slice with the stage's
    advantage mask. pi_old (``old_per_token_logps``) is the buffered tensor, NOT recomputed between the stages, so
    stage 2's ratio and clipping see stage 1's drift, as in the paper's code. Also rewrites ``num_items_in_batch``
    so that DAPO's normaliser is each optimizer step's own response-token count (``minibatch_token_mean``).
``compute_loss`` (public) + ``_get_per_token_logps_and_entropies``  AR where TRL keeps no old log-probs (one
    optimizer step per generation, weights unchanged until it): the update's own forward IS pi_old, so AR reads it
    there, detached, before TRL reads the advantages. This costs no extra forward. ``compute_loss`` only marks the
    micro-step's inputs, on Trainer's public method (a stabler signature than the private ``_compute_loss``).

The stage mask goes in as TRL's ``tool_mask`` (a loss-only mask; the attention mask is untouched), so the policy
term, the KL term and the clip metrics of a stage cover only its tokens, while DAPO's denominator, fixed at
generation, still counts every response token, as ``policy_loss(..., denom=...)`` does in our trainer
(docs/paper.md §4).
``loss_type="dapo"`` (TRL's default) is the token mean: sum over the optimizer step's tokens / their count, whatever
the accumulation or the number of processes.

TRL's KL is not quite the paper's: set ``use_bias_correction_kl=False`` (TRL's default multiplies the k3 term by the
importance ratio); TRL's k3 is not clamped, where verl's ``low_var_kl`` and ``objective.policy_loss`` clamp it at 10.

Shape legend: B rows of a process's slice (prompts x G / processes / steps), T completion tokens.
"""

from __future__ import annotations

import functools
import inspect
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer

from lopti_lab.checks import FieldCheck
from lopti_lab.configs import field_docs
from lopti_lab.kk import Puzzle, build_prompt, score_response
from lopti_lab.methods import Method, check_switches
from lopti_lab.objective import lopti_stages, reweight_advantages

__all__ = [
    "OVERRIDES",
    "TESTED_TRL",
    "LoptiGRPOConfig",
    "LoptiGRPOTrainer",
    "kk_dataset",
    "kk_reward",
    "signature_drift",
]

TESTED_TRL = ("1.16.0", "1.17.0")  # [low, high): the TRL versions this adapter was tested against (pyproject pins it)
# the GRPOTrainer methods the subclass overrides, with their signatures (annotations left out) in TESTED_TRL[0]
OVERRIDES = {
    "_generate_and_score_completions": "(self, inputs)",
    "_prepare_inputs": "(self, generation_batch)",
    "compute_loss": "(self, model, inputs, return_outputs=False, num_items_in_batch=None)",
    "_get_per_token_logps_and_entropies": (
        "(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, "
        "compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, pixel_attention_mask=None, "
        "spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, mm_token_type_ids=None, "
        "image_position_ids=None)"
    ),
}
LOPTI_LOSS_TYPES = ("dapo", "dr_grpo", "cispo")  # losses whose denominator does not depend on the mask (Lopti's need)
STAGE_MASK = "lopti_stage_mask"  # buffered (B, stages, T) masks, in stage order
SWITCH_DOCS = field_docs(Method)  # the help of the switches LoptiGRPOConfig carries
SEQUENCE_ADVANTAGES = "sequence_advantages"  # buffered (B,) GRPO advantages before AR, for logs and tests


@dataclass
class LoptiGRPOConfig(GRPOConfig):
    """TRL's ``GRPOConfig`` plus AR and Lopti; every TRL field keeps its meaning and default.

    With Lopti, ``num_iterations`` is the number of passes over each generation batch PER STAGE (the paper: 1), so
    one generation takes ``optimizer_steps_per_generation`` = stages x num_iterations x S / GA optimizer steps
    (S = steps_per_generation, GA = gradient_accumulation_steps): twice GRPO's. ``max_steps`` counts optimizer steps,
    as in TRL; ``rl_steps`` counts generations.
    """

    # the method's switches: declared, documented and checked in methods.Method
    ar_alpha: float | None = field(default=Method.ar_alpha, metadata={"help": SWITCH_DOCS["ar_alpha"]})
    lopti_eta: float | None = field(default=Method.lopti_eta, metadata={"help": SWITCH_DOCS["lopti_eta"]})
    lopti_order: str = field(default=Method.lopti_order, metadata={"help": SWITCH_DOCS["lopti_order"]})
    minibatch_token_mean: bool = field(
        default=True,
        metadata={
            "help": "Divide each optimizer step's DAPO loss by that step's own response-token count (all processes), "
            "as lopti_lab's trainer does; False keeps TRL's generation-batch average. The same when "
            "steps_per_generation == gradient_accumulation_steps (TRL's default layout)."
        },
    )
    rl_steps: int | None = field(
        default=None,
        metadata={
            "help": "RL steps (generations) to train: sets max_steps = rl_steps x optimizer_steps_per_generation."
        },
    )
    # TRL's default (on) under transformers 5's name: TRL sets the old name, whose every use warns that v6 removes it
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (transformers 5), removed in v6."},
    )

    def __post_init__(self):
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default; an explicit old name still wins (and warns)
        super().__post_init__()
        _validate(self)
        if self.rl_steps is not None:
            self.max_steps = self.rl_steps * self.optimizer_steps_per_generation

    @property
    def stages(self) -> int:
        """Update stages per generation: 2 with Lopti (low, high), else 1."""
        return 1 if self.lopti_eta is None else 2

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps of one RL step (one generation batch); 0 when one optimizer step spans generations."""
        return self.stages * self.num_iterations * self.steps_per_generation // self.gradient_accumulation_steps


def _validate(c: LoptiGRPOConfig) -> None:
    """Raise ValueError naming the first bad setting; runs at construction, before any model loads."""

    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ValueError(f"LoptiGRPOConfig.{name} {what}, got {getattr(c, name)!r}")

    check_switches(FieldCheck(c), ("ar_alpha", "lopti_eta", "lopti_order"))
    need(c.rl_steps is None or (isinstance(c.rl_steps, int) and c.rl_steps >= 1), "rl_steps", "must be an int >= 1")
    steps, accumulation = c.steps_per_generation, c.gradient_accumulation_steps
    layout = f"(steps_per_generation S = {steps}, gradient_accumulation_steps GA = {accumulation})"
    splits = steps % accumulation == 0  # every optimizer step inside one generation's pass
    if c.lopti_eta is not None:  # each optimizer step must lie inside one stage
        need(splits, "gradient_accumulation_steps", f"must divide steps_per_generation for Lopti {layout}")
    need(c.rl_steps is None or splits, "rl_steps", f"needs S to be a multiple of GA {layout}; set max_steps instead")
    per_minibatch = c.minibatch_token_mean and c.loss_type in ("dapo", "cispo", "vespo")
    need(splits or not per_minibatch, "minibatch_token_mean", f"needs S to be a multiple of GA {layout}; set it False "
         "to keep TRL's")  # fmt: skip
    if c.lopti_eta is None:
        return
    # Lopti: the denominator must not depend on the stage mask, nor any term's normalisation
    need(c.loss_type in LOPTI_LOSS_TYPES, "loss_type", f"must be one of {LOPTI_LOSS_TYPES} with Lopti (token mean)")
    need(c.importance_sampling_level == "token", "importance_sampling_level", "must be 'token' with Lopti")
    # TRL divides its entropy bonus by the stage's own token count (the paper: by all response tokens), which does not
    # match Lopti's masking: rejected rather than silently changed. Forking tokens (top_entropy_quantile) combine:
    # TRL takes the entropy quantile over the tokens of the loss mask, here a stage's, so each stage trains its own
    # top-rho entropy tokens (README: docs/trl.md, "AR and Lopti with TRL's token methods")
    need(c.entropy_coef == 0.0 and not c.use_adaptive_entropy, "entropy_coef", "must be 0 with Lopti")
    per_generation = c.optimizer_steps_per_generation
    # a run or a checkpoint that stops between the stages would resume into a fresh generation's first stage
    if c.max_steps > 0 and c.rl_steps is None:
        need(c.max_steps % per_generation == 0, "max_steps", f"must be a multiple of {per_generation} with Lopti")
    if c.save_strategy == "steps" and c.save_steps >= 1:
        need(c.save_steps % per_generation == 0, "save_steps", f"must be a multiple of {per_generation} with Lopti")


def loss_mask(inputs: dict) -> torch.Tensor:
    """TRL's loss mask: completion tokens, minus tool output where there is a tool_mask. (B, T)"""
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


class LoptiGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with AR (``args.ar_alpha``) and Lopti (``args.lopti_eta``); with both off it is stock TRL.

    Takes exactly ``GRPOTrainer``'s arguments; ``args`` must be a ``LoptiGRPOConfig``. See the module docstring for
    the hooks and the ``minibatch_token_mean`` denominator.
    """

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if not isinstance(config, LoptiGRPOConfig):
            raise TypeError(f"LoptiGRPOTrainer needs args=LoptiGRPOConfig(...), got {type(config).__name__}")
        _warn_untested_trl()
        super().__init__(*args, **kwargs)
        # Lopti: TRL's sampler and buffer replay each generation batch num_iterations times; one replay set per stage
        self.num_iterations = self.args.num_iterations * self.args.stages
        self._ar_from_forward: dict | None = None

    # --- once per generation ----------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        return self._add_token_terms(output)

    def _add_token_terms(self, output: dict) -> dict:
        """AR advantages and Lopti stage masks from the rollout's pi_old, computed once and buffered with the batch."""
        args, old_logp = self.args, output.get("old_per_token_logps")
        mask = loss_mask(output)  # (B, T)
        output[SEQUENCE_ADVANTAGES] = output["advantages"]  # (B,)
        if args.lopti_eta is not None:
            if old_logp is None:  # _validate makes TRL compute it (num_iterations > 1); this guards a TRL change
                raise RuntimeError("Lopti needs TRL's old_per_token_logps, which this generation did not compute")
            stages = lopti_stages(old_logp, mask, args.lopti_eta, args.lopti_order)  # Lopti, docs/paper.md §4
            output[STAGE_MASK] = torch.stack([m for _, m in stages], dim=1)  # (B, stages, T)
            low = dict(stages)["low"]
            self._log_global_mean("lopti/low_share", low.float(), mask)
        if args.ar_alpha is not None and old_logp is not None:
            output["advantages"] = self._reweighted(output["advantages"], old_logp, mask)  # (B, T)
        return output

    def _reweighted(self, advantages: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """AR, Eq. 4: per-token advantages (B, T), zero on padding (TRL's log-probs there are not meaningful)."""
        alpha = self.args.ar_alpha
        weighted = reweight_advantages(advantages, old_logp.detach(), alpha) * mask  # (B, T)
        self._log_global_mean("ar/weight_mean", alpha * old_logp.detach().exp() + (1 - alpha), mask)
        return weighted

    def _log_global_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Token mean over every process (a collective: every process reaches it at the same step)."""
        local = torch.stack([(values.float() * mask).sum(), mask.float().sum()])
        total, count = self.accelerator.reduce(local, reduction="sum").tolist()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][name].append(total / max(count, 1.0))

    # --- every micro-step -------------------------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            return inputs
        if self._buffered_inputs is not buffered and self.args.minibatch_token_mean:
            self._minibatch_denominators(self._buffered_inputs)  # a new generation was just buffered
        return self._stage_view(inputs, self._stage_index())

    def _stage_index(self) -> int:
        """The stage of micro-step ``self._step``: TRL replays each buffered generation (S micro-steps per pass)
        num_iterations x stages times; the first num_iterations passes are stage 1."""
        replay = (self._step // self.args.steps_per_generation) % self.num_iterations
        return replay // self.args.num_iterations

    def _stage_view(self, inputs: dict, stage: int) -> dict:
        """The buffered slice as stage ``stage`` sees it: advantages zeroed outside the stage and the stage mask as
        the loss mask (policy, KL and metric terms). The buffer itself is left untouched for the next stage."""
        if STAGE_MASK not in inputs:
            return inputs
        stage_mask = inputs[STAGE_MASK][:, stage]  # (B, T)
        advantages = inputs["advantages"]
        if advantages.ndim == 1:
            advantages = advantages[:, None]  # (B, 1)
        view = dict(inputs)
        view["advantages"] = advantages * stage_mask  # (B, T); Lopti stage 1 low, stage 2 high tokens
        view["tool_mask"] = stage_mask if inputs.get("tool_mask") is None else inputs["tool_mask"] * stage_mask
        return view

    def _minibatch_denominators(self, slices: list[dict]) -> None:
        """Make DAPO's normaliser (num_items_in_batch / P x GA / S) each optimizer step's own token count.

        Micro-step j trains on slice j % S and optimizer step k spans micro-steps [k GA, (k + 1) GA), so with S a
        multiple of GA (validated) the slices of one optimizer step are the contiguous block s // GA.
        """
        steps, accumulation = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        local = torch.stack([loss_mask(s).sum() for s in slices]).float()  # (S,) this process's tokens per slice
        per_slice = self.accelerator.gather(local).view(-1, steps).sum(0)  # (S,) over processes
        per_step = per_slice.view(steps // accumulation, accumulation).sum(1)  # (S / GA,) per optimizer step
        for i, s in enumerate(slices):
            s["num_items_in_batch"] = per_step[i // accumulation] * steps / accumulation

    # --- AR from the update's own forward (TRL's single-iteration path) --------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.ar_alpha is not None and inputs.get("old_per_token_logps") is None:
            # one optimizer step per generation and no step yet: this forward's log-probs are the rollout policy's
            inputs = dict(inputs)
            self._ar_from_forward = inputs
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._ar_from_forward = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        pending, self._ar_from_forward = self._ar_from_forward, None
        if pending is not None:  # the policy forward of compute_loss, before it reads inputs["advantages"]
            pending["advantages"] = self._reweighted(pending["advantages"], logps.detach(), loss_mask(pending))
        return logps, entropies, aux_loss


def _unannotated(method) -> str:
    """A method's signature without annotations: "(self, model, inputs)"."""
    sig = inspect.signature(method)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def signature_drift(base: type = GRPOTrainer) -> dict[str, str]:
    """{method: message} for each overridden method of ``base`` whose signature is not the one ``OVERRIDES``
    recorded (or that ``base`` no longer has); empty when TRL still has every hooked method as recorded."""
    import trl

    drift = {}
    for name, recorded in OVERRIDES.items():
        method = getattr(base, name, None)
        now = "(missing)" if method is None else _unannotated(method)
        if now != recorded:
            drift[name] = (
                f"TRL {trl.__version__} changed {base.__name__}.{name}{now}; LoptiGRPOTrainer overrides the "
                f"{name}{recorded} of TRL {TESTED_TRL[0]}: check the override against the new code, then record it"
            )
    return drift


def _warn_untested_trl() -> None:
    import trl

    for message in signature_drift().values():
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    low, high = (Version(v) for v in TESTED_TRL)
    if not low <= Version(trl.__version__) < high:
        warnings.warn(
            f"lopti_lab.integrations.trl was tested with trl >= {low}, < {high}; you have {trl.__version__}. "
            "It overrides TRL internals: run tests/test_integrations_trl.py (its canary test) before trusting it.",
            RuntimeWarning,
            stacklevel=3,
        )


# --- K&K data and reward for TRL --------------------------------------------------------------------------------------


def kk_dataset(puzzles: Sequence[Puzzle], prompt_style: str = "instruct", tokenizer=None):
    """A ``datasets.Dataset`` for GRPOTrainer: ``prompt`` (a string ending in "<think>", so TRL applies no chat
    template and the response starts inside the think block), ``puzzle`` (the K&K record as JSON, what ``kk_reward``
    scores against) and ``n_people``.

    Example: ``kk_dataset([generate_puzzle(3, seed=0)])[0]["prompt"].endswith("<think>")`` is True.
    """
    from datasets import Dataset

    if not puzzles:
        raise ValueError("kk_dataset: no puzzles given")
    return Dataset.from_dict(
        {
            "prompt": [build_prompt(p, prompt_style, tokenizer) for p in puzzles],
            "puzzle": [json.dumps(p.to_record()) for p in puzzles],
            "n_people": [p.n_people for p in puzzles],
        }
    )


@functools.lru_cache(maxsize=65536)
def _puzzle(record: str) -> Puzzle:
    return Puzzle.from_record(json.loads(record), check=False)


def kk_reward(completions: list[str], puzzle: list[str], log_metric=None, **kwargs: Any) -> list[float]:
    """The Logic-RL reward (``kk.score_response``) of each completion, as a TRL reward function.

    TRL passes the dataset's columns as keyword lists (``puzzle`` from ``kk_dataset``) and a ``log_metric``
    callback, through which the breakdown is logged as TRL metrics, averaged over processes and logging steps:
    ``kk/format`` (format part: +1 / -1), ``kk/answer`` (+2 / -1.5 / -2), ``kk/accuracy`` (share scoring 3),
    ``kk/format_error_rate`` and ``kk/accuracy_{n}ppl`` per people count. Worked example: a completion
    ``" ... </think><answer> (1) Zoey is a knave\\n(2) Oliver is a knight </answer>"`` for that puzzle scores 3.0.
    """
    if len(completions) != len(puzzle):
        raise ValueError(f"kk_reward: {len(completions)} completions but {len(puzzle)} puzzles")
    if completions and not isinstance(completions[0], str):
        raise TypeError("kk_reward scores plain-text completions: build prompts with kk_dataset (strings)")
    rewards = [score_response(text, _puzzle(record)) for text, record in zip(completions, puzzle, strict=True)]
    if log_metric is not None and rewards:
        n = len(rewards)
        log_metric("kk/format", sum(r.format_score for r in rewards) / n)
        log_metric("kk/answer", sum(r.answer_score for r in rewards) / n)
        log_metric("kk/accuracy", sum(r.correct for r in rewards) / n)
        log_metric("kk/format_error_rate", sum(r.format_score < 0 for r in rewards) / n)
        people = [_puzzle(record).n_people for record in puzzle]
        for k in sorted(set(people)):
            hits = [r.correct for r, p in zip(rewards, people, strict=True) if p == k]
            log_metric(f"kk/accuracy_{k}ppl", sum(hits) / len(hits))
    return [r.total for r in rewards]
