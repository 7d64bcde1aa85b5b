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
from lopti_lab.objective import group_advantages, masked_mean
from lopti_lab.plan import fit_to_device
from lopti_lab.probes import GradientProbe, fig3_metrics, positive_rows, probability_shift, update_logprobs
from lopti_lab.probes.credit import gradient_sums, token_sums
from lopti_lab.probes.shift import float64_logprobs
from lopti_lab.resume import repair_for_resume, resume_point
from lopti_lab.rollout import Rollout, add_logprobs, sample, use_lean
from lopti_lab.train_config import TrainConfig
from lopti_lab.update import UpdateSpec, advantages_and_stages, build_optimizer, update_policy

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
    clock, update = _Clock(model), config.update_spec()
    method = update.objective.method
    # pi_old before the update: AR weights and Lopti stages read it, a probe bins by it, and a second optimizer step
    # needs it from the weights before the first. Plain GRPO with one optimizer step per rollout gets it exactly from
    # its update forward instead (weights unchanged until the step), which saves a forward pass, as TRL does.
    needs_old = method.ar_alpha is not None or method.lopti_eta is not None or probe or measure_shift
    needs_old = needs_old or update.optimizer_steps_per_stage(config.batch_size) > 1 or method.uses_entropy
    rollout = _rollout(model, tokenizer, puzzles, config, reference, needs_old, clock)
    rewards = score_rollout(rollout, puzzles)
    clock.mark("time/score", sync=False)
    totals = torch.tensor([r.total for r in rewards], dtype=torch.float32, device=rollout.response_ids.device)  # (B,)
    advantages = group_advantages(totals, config.group_size, update.objective.advantage_scale)  # (B,)
    token_adv, stages, metrics = advantages_and_stages(rollout, advantages, update.objective)
    step = _Update(model, optimizer, rollout, advantages, token_adv, stages, update, scaler)
    metrics.update(step.run(config, clock, probe=probe, measure_shift=measure_shift))
    if rollout.entropy is not None:
        metrics["policy/entropy"] = masked_mean(rollout.entropy, rollout.response_mask).item()
    metrics.update(_batch_metrics(rollout, puzzles, rewards, totals, token_adv))
    return metrics | {key: clock.times[key] for key in ("time/generate", "time/logprob", "time/score", "time/update")}


class _Clock:
    """Wall seconds of each phase of a step; a GPU is synchronized at each mark (its kernels run asynchronously)."""

    def __init__(self, model: torch.nn.Module):
        self.sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
        self.last, self.times = time.perf_counter(), {}

    def mark(self, key: str, sync: bool = True) -> None:
        """``key`` gets the time since the last mark."""
        if sync:
            self.sync()
        now = time.perf_counter()
        self.times[key], self.last = now - self.last, now


def _rollout(model, tokenizer, puzzles, cfg: TrainConfig, reference, needs_old: bool, clock: _Clock) -> Rollout:
    """The step's completions, with pi_old when the update needs it and the reference's log-probs when a KL acts."""
    spec = cfg.sampling()
    # The lean decoder's sampling logits give pi_old for free: the rollout policy at the sampling temperature, which
    # is what the ratio's denominator is (docs/paper.md §2), equal to a forward's log-probs to float32 rounding
    # (tests/test_decode.py). A probe step too: its probability shift compares two float64 forwards of its own.
    from_decode = needs_old and use_lean(model, spec.fast_path)
    prompts = [build_prompt(p, cfg.prompt_style, tokenizer) for p in puzzles]
    rollout = sample(model, tokenizer, prompts, cfg.group_size, spec, with_logprobs=from_decode)
    clock.mark("time/generate")
    add_logprobs(model, rollout, spec, reference=reference, policy=needs_old and rollout.old_logp is None)
    clock.mark("time/logprob")
    return rollout


@dataclass
class _Update:
    """The step's update, with the measurements that must bracket it: the gradient probe, its float64 shift, Fig. 3."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rollout: Rollout
    advantages: torch.Tensor  # (B,) before AR
    token_adv: torch.Tensor  # (B, T)
    stages: list
    spec: UpdateSpec
    scaler: torch.amp.GradScaler | None

    def run(self, cfg: TrainConfig, clock: _Clock, *, probe: bool, measure_shift: bool) -> dict[str, float]:
        model, rollout, advantages = self.model, self.rollout, self.advantages
        # every probe_every steps: per-bin gradient shares of the real update (position attribution, probes.py), and
        # (probe_shift) the probability shift it causes, between float64 forwards before and after it (shift_metrics)
        gradient_probe = GradientProbe(model, bins=cfg.probe_bins) if probe else None
        before = shift_logprobs(model, rollout, cfg) if probe and cfg.probe_shift else None
        t_shift = time.perf_counter()
        fig3 = Fig3Batch(model, rollout, advantages, cfg) if measure_shift else None
        t_shift = time.perf_counter() - t_shift
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0  # the probe sees the scaled backward
        with gradient_probe or nullcontext():
            metrics = update_policy(model, self.optimizer, rollout, self.token_adv, self.stages, self.spec,
                                    gradient_probe, scaler=self.scaler)  # fmt: skip
        clock.mark("time/update")
        if gradient_probe is not None and metrics["update/optimizer_steps"] > 0:
            metrics.update(
                self._credit(gradient_probe, cfg.probe_bins, scale, skipped=bool(metrics.get("amp/skipped_steps")))
            )
            if before is not None:
                metrics.update(shift_metrics(model, rollout, advantages, cfg, before))
        if fig3 is not None:
            metrics.update(fig3.after(model))
            metrics["time/shift"] = t_shift + time.perf_counter() - clock.last
        return metrics

    def _credit(self, probe: GradientProbe, bins, scale: float, *, skipped: bool) -> dict[str, float]:
        """A probed step's per-bin token credit (``probes.credit``, the TRL callback's metrics under the same names):
        token and advantage shares, mean entropy and the gradient shares; the probe's per-bin gradient norms, unscaled
        from a float16 loss scale. An overflowed backward's record is inf: no gradient bins that step."""
        r = self.rollout
        credit = token_sums(r.old_logp.exp(), r.response_mask, self.token_adv, bins=bins, entropy=r.entropy)
        norms = {}
        if not skipped:
            credit = credit + gradient_sums(probe)
            norms = {k: v / scale for k, v in probe.metrics().items() if k.startswith("grad/norm_")}
        return {**norms, **credit.metrics()}


def _batch_metrics(rollout: Rollout, puzzles, rewards, totals: torch.Tensor, token_adv: torch.Tensor) -> dict:
    """The batch's rewards, accuracy by people count, formats and lengths."""
    group, mask = rollout.group_size, rollout.response_mask
    people = torch.tensor([p.n_people for p in puzzles for _ in range(group)], device=totals.device)  # (B,)
    correct = (totals == 3.0).float()  # (B,)
    grouped = totals.view(-1, group)  # (B/G, G)
    return {
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
    }


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
    device = resolve_device(cfg.device)  # a device the machine lacks fails before the run folder is written
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
    folder.mark("start")  # times.json: a resume keeps the first start and adds its own session
    run = _Run.load(cfg, device, folder, stream, eval_set)
    if point is not None:
        run.resume(point)
    result = run.steps(callbacks)
    if run.history and run.history[-1]["step"] == cfg.steps:
        folder.mark("end")
    return result


@dataclass
class _Run:
    """A run's state between steps: the policy, its optimizer (and float16 loss scaler), the records so far."""

    cfg: TrainConfig
    folder: runs.RunFolder
    stream: PuzzleStream
    eval_set: list
    model: torch.nn.Module
    tokenizer: Any
    reference: Reference | None
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    start: int = 0
    history: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, cfg: TrainConfig, device, folder: runs.RunFolder, stream: PuzzleStream, eval_set: list) -> _Run:
        """The policy as a fresh run starts it: seeded, loaded, with its optimizer."""
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        dtype = training_dtype(cfg.dtype, device, full_finetune=cfg.lora_r is None)
        model, tokenizer = load_policy(cfg.model, cfg.lora_spec(), dtype, device, cfg.gradient_checkpointing,
                                       attn_implementation=cfg.attn_implementation)  # fmt: skip
        reference = Reference(model) if cfg.kl_coef > 0 else None
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer_spec())
        # float16 (a GPU below compute capability 8.0): loss scaling, its state checkpointed with the optimizer's
        scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        return cls(cfg, folder, stream, eval_set, model, tokenizer, reference, optimizer, scaler)

    def resume(self, point) -> None:
        """Continue from a checked resume point: its checkpoint's weights, optimizer and scaler, its records."""
        if point.checkpoint is not None:  # else: the initial weights and the seeded RNG, as a straight run starts
            self.start = runs.load_checkpoint(point.checkpoint, self.model, self.optimizer, scaler=self.scaler)
        repair_for_resume(self.folder.path, point)
        for note in point.notes:
            print(f"resume {self.folder.path}: {note}", file=sys.stderr)
        self.history = list(point.records)
        self.folder.write_config(self.cfg.to_dict())

    def step(self, step: int) -> dict:
        """One RL step at its learning rate, its test evaluation when due; its metrics, logged."""
        cfg, t0 = self.cfg, time.perf_counter()
        for group in self.optimizer.param_groups:  # a function of the step alone, so a resumed run continues it
            group["lr"] = learning_rate(cfg, step)
        probe = cfg.probe_every > 0 and step % cfg.probe_every == 0
        measure = cfg.shift_every > 0 and step % cfg.shift_every == 0
        metrics = {"step": step, **train_step(self.model, self.tokenizer, self.optimizer, self.stream.batch(step), cfg,
                                              self.reference, probe, measure, scaler=self.scaler)}  # fmt: skip
        if self.eval_set and cfg.evaluates_at(step):
            t_eval = time.perf_counter()
            metrics.update(evaluate(self.model, self.tokenizer, self.eval_set, cfg.eval_spec(step)))
            metrics["time/eval"] = time.perf_counter() - t_eval
        metrics["time/step"] = time.perf_counter() - t0
        self.folder.log(metrics)
        self.history.append(metrics)
        return metrics

    def steps(self, callbacks: Iterable[Callback]) -> TrainResult:
        """Every step from the start to ``cfg.steps``, checkpointing as configured, until a callback asks to stop."""
        cfg, stopped = self.cfg, False
        bar = tqdm(range(self.start + 1, cfg.steps + 1), initial=self.start, total=cfg.steps, desc=cfg.method,
                   disable=not cfg.progress)  # fmt: skip
        for step in bar:
            metrics = self.step(step)
            stopped = any([bool(callback(metrics)) for callback in callbacks])  # every callback sees every step
            sick = _nonfinite_streak(self.history)
            halt = bool(cfg.max_nonfinite_steps) and sick >= cfg.max_nonfinite_steps
            if stopped or halt or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                runs.save_checkpoint(self.folder.path, step, self.model, self.optimizer, self.tokenizer,
                                     scaler=self.scaler)  # fmt: skip
                self.folder.mark("saved")  # a kill after this keeps the process's work up to now
            bar.set_postfix({"reward": f"{metrics['reward/mean']:.2f}", "acc": f"{metrics['acc/all']:.2f}"})
            if halt:
                bar.close()
                raise NonFiniteError(_nonfinite_message(cfg, step, sick), self.result(stopped=True))
            if stopped:
                break
        bar.close()
        return self.result(stopped=stopped and self.history[-1]["step"] < cfg.steps)

    def result(self, stopped: bool) -> TrainResult:
        return TrainResult(self.folder.path, self.model, self.tokenizer, self.cfg, self.history, stopped)


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
