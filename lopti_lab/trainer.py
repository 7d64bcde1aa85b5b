"""GRPO with Advantage Reweighting and Lopti: one loop, LoRA on one GPU, the same code on a laptop CPU.

    from lopti_lab.train_config import TrainConfig
    from lopti_lab.trainer import train
    result = train(TrainConfig(model="lab", lora_r=None, ar_alpha=0.3, lopti_eta=0.5, steps=50, run_dir="runs/both"))
    result.history[-1]["acc/all"]

One RL step, ``train_step`` (the README's "One RL step"):

    puzzles -> prompts -> rollout.sample: G completions per prompt, old_logp at the sampling temperature
      -> kk.score_response -> rewards -> group_advantages -> AR weights (once per step, docs/paper.md §3)
      -> stages: Lopti [low, high] (docs/paper.md §4) or [all]
      -> for each stage, for each epoch, for each minibatch: policy_loss -> backward -> clip -> optimizer.step
         (old_logp is NOT recomputed between the Lopti stages: stage 2's ratio sees stage 1's drift)
      -> metrics (runs.py lists the keys) -> metrics.jsonl

Shape legend: B rows = prompts x G, G group size, T response tokens, V vocabulary.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lopti_lab import runs
from lopti_lab.bins import entropy_rank
from lopti_lab.evaluate import evaluate, score_rollout
from lopti_lab.kk import Puzzle, build_prompt, load_split
from lopti_lab.methods import run_name
from lopti_lab.models import Reference, load_policy, resolve_device, training_dtype
from lopti_lab.objective import (
    group_advantages,
    masked_mean,
)
from lopti_lab.plan import fit_to_device
from lopti_lab.probes import GradientProbe, fig3_metrics, positive_rows, probability_shift, update_logprobs
from lopti_lab.probes.shift import float64_logprobs
from lopti_lab.resume import repair_for_resume, resume_point
from lopti_lab.rollout import Rollout, add_logprobs, sample, use_lean
from lopti_lab.train_config import TrainConfig
from lopti_lab.update import advantages_and_stages, build_optimizer, update_policy, uses_entropy

__all__ = [
    "NonFiniteError",
    "TrainResult",
    "learning_rate",
    "load_trained",
    "train",
    "train_step",
]

Callback = Callable[[dict], Any]  # gets each step's metrics; a truthy return asks training to stop after the step


# --- one RL step ------------------------------------------------------------------------------------------------------


def train_step(
    model: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    puzzles: Sequence[Puzzle],
    config: TrainConfig,
    reference: Reference | None = None,
    probe: bool = False,
    measure_shift: bool = False,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, float]:
    """One RL step on ``puzzles`` (prompts_per_step of them): rollout, reward, advantages, update; its metrics.
    ``probe``: the gradient probe's per-bin shares and the float64 shift of the update (``shift/...``);
    ``measure_shift``: the paper's Fig. 3 measurement of the update (``fig3/...``, ``probes.update_shift``);
    ``scaler``: a float16 policy's loss scaler (``update.update_policy``), kept by the caller across steps."""
    cfg, group = config, config.group_size
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    # pi_old before the update: AR weights and Lopti stages read it, a probe bins by it, and a second optimizer step
    # needs it from the weights before the first. Plain GRPO with one optimizer step per rollout gets it exactly from
    # its update forward instead (weights unchanged until the step), which saves a forward pass, as TRL does.
    needs_old = cfg.ar_alpha is not None or cfg.lopti_eta is not None or probe or measure_shift
    needs_old = needs_old or cfg.optimizer_steps_per_stage > 1 or uses_entropy(cfg)
    # The lean decoder's sampling logits give pi_old for free: the rollout policy at the sampling temperature, which
    # is what the ratio's denominator is (docs/paper.md §2), equal to a forward's log-probs to float32 rounding
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
    t_shift = time.perf_counter()
    fig3 = Fig3Batch(model, rollout, advantages, cfg) if measure_shift else None
    t_shift = time.perf_counter() - t_shift
    scale = scaler.get_scale() if scaler is not None else 1.0  # the probe sees the scaled backward
    with gradient_probe or nullcontext():
        metrics.update(update_policy(model, optimizer, rollout, token_adv, stages, cfg, gradient_probe, scaler=scaler))
    sync()
    t4 = time.perf_counter()
    if gradient_probe is not None and metrics["update/optimizer_steps"] > 0:
        if not metrics.get("amp/skipped_steps"):  # an overflowed backward's record is inf: no bins this step
            probed = gradient_probe.metrics()
            metrics.update({k: v / scale if k.startswith("grad/norm_") else v for k, v in probed.items()})
        metrics.update(shift_metrics(model, rollout, advantages, cfg, before))
    if fig3 is not None:
        metrics.update(fig3.after(model))
        metrics["time/shift"] = t_shift + time.perf_counter() - t4
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


class Fig3Batch:
    """The paper's Fig. 3 for one step (``probes.update_shift``): the A > 0 rows' log-probs in float64 and bf16,
    taken when this is built (before the update); ``after(model)`` takes them again and returns the metrics."""

    def __init__(self, model: torch.nn.Module, rollout: Rollout, advantages: torch.Tensor, cfg: TrainConfig):
        self.rows = positive_rows(advantages, cfg.shift_rows)  # (k,): by the advantages before AR, as the paper's code
        self.cfg, self.rollout = cfg, rollout
        self.before = self._logprobs(model) if len(self.rows) else {}

    def _logprobs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        r, rows = self.rollout, self.rows
        return update_logprobs(model, r.input_ids[rows], r.attention_mask[rows], r.response_mask[rows],
                               self.cfg.temperature, self.cfg.fast_path)  # fmt: skip

    def after(self, model: torch.nn.Module) -> dict[str, float]:
        if not len(self.rows):
            return {}
        rows, r = self.rows, self.rollout
        return fig3_metrics(self.before, self._logprobs(model), r.old_logp[rows].exp(), r.response_mask[rows])


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
    ``shift/n_{pos,neg}_bin{i}`` (token counts) and ``shift/dp_mean_bin{i}``; where the rollout has its entropy, the
    same three by the batch's entropy quartiles (``bins.entropy_rank``) under ``shift_entropy/``.
    """
    after = shift_logprobs(model, rollout, cfg)
    mask = rollout.response_mask
    shift = probability_shift(before, after, advantages, mask, cfg.probe_bins)
    out = _shift_bins(shift, "shift")
    means = shift.tokens.groupby("bin")["delta_p"].mean()
    out.update({f"shift/dp_mean_bin{k}": float(v) for k, v in means.items()})
    if rollout.entropy is not None:
        by_entropy = probability_shift(
            before, after, advantages, mask, cfg.probe_bins, entropy_rank(rollout.entropy, mask)
        )
        out.update(_shift_bins(by_entropy, "shift_entropy"))
    return out


def _shift_bins(shift, prefix: str) -> dict[str, float]:
    out = {}
    for row in shift.bins.itertuples():
        out[f"{prefix}/n_{row.sign}_bin{row.bin}"] = float(row.n_tokens)
        out[f"{prefix}/correct_{row.sign}_bin{row.bin}"] = float(row.correct_ratio) if row.n_moved else math.nan
        out[f"{prefix}/unmoved_{row.sign}_bin{row.bin}"] = float(row.unmoved_share) if row.n_tokens else math.nan
    return out


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

    The run folder has one writer at a time (``runs.writer_lock``): a second ``train`` on a folder another live
    process is writing is refused at once with RunFolderLocked naming it. A full disk stops the run with a
    ``durable.DiskFullError`` naming the file, the folder left consistent: free space and resume.
    """
    # a GPU: batch sizes that fit, or a refusal naming the fields to lower, before the run folder and the weights
    cfg = fit_to_device(config, resolve_device(config.device))
    if cfg.run_dir is None:
        cfg = replace(cfg, run_dir=str(Path("runs") / run_name(cfg.method)))
    with runs.writer_lock(cfg.run_dir):
        return _train(cfg, callbacks, resume)


def _train(cfg: TrainConfig, callbacks: Iterable[Callback], resume: bool) -> TrainResult:
    """``train``'s body, under the folder's writer lock."""
    device = resolve_device(cfg.device)
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
    dtype = training_dtype(cfg.dtype, device, full_finetune=cfg.lora_r is None)
    model, tokenizer = load_policy(cfg.model, cfg.lora_spec(), dtype, device, cfg.gradient_checkpointing,
                                   attn_implementation=cfg.attn_implementation)  # fmt: skip
    reference = Reference(model) if cfg.kl_coef > 0 else None
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    # float16 (a GPU below compute capability 8.0): loss scaling, its state checkpointed with the optimizer's
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    start, history = 0, []
    if point is not None:
        if point.checkpoint is not None:  # else: the initial weights and the seeded RNG, as a straight run starts
            start = runs.load_checkpoint(point.checkpoint, model, optimizer, scaler=scaler)
        repair_for_resume(folder.path, point)
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
        measure = cfg.shift_every > 0 and step % cfg.shift_every == 0
        batch = stream.batch(step)
        metrics = {
            "step": step,
            **train_step(model, tokenizer, optimizer, batch, cfg, reference, probe, measure, scaler=scaler),
        }
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
            runs.save_checkpoint(folder.path, step, model, optimizer, tokenizer, scaler=scaler)
        bar.set_postfix({"reward": f"{metrics['reward/mean']:.2f}", "acc": f"{metrics['acc/all']:.2f}"})
        if halt:
            bar.close()
            result = TrainResult(folder.path, model, tokenizer, cfg, history, stopped=True)
            raise NonFiniteError(_nonfinite_message(cfg, step, sick), result)
        if stopped:
            break
    bar.close()
    return TrainResult(folder.path, model, tokenizer, cfg, history, stopped and history[-1]["step"] < cfg.steps)


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
    device = resolve_device(device or cfg.device)
    dtype = training_dtype(cfg.dtype, device, full_finetune=cfg.lora_r is None)  # the dtype it was trained in
    model, tokenizer = load_policy(cfg.model, cfg.lora_spec(), dtype, device,
                                   attn_implementation=cfg.attn_implementation)  # fmt: skip
    runs.load_checkpoint(folder, model, restore_rng=False)
    return model, tokenizer, cfg
