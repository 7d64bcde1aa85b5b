"""Scoring rollouts and measuring test accuracy, the paper's way: the share of completions with the full Logic-RL
reward (3), by people count, greedy and sampled (docs/paper.md §6), each with its standard error.

    metrics = evaluate(model, tokenizer, load_split("test", [3, 4]), prompt_style="instruct", samples=4)
    metrics["eval/sample/acc_all"], metrics["eval/sample/acc_all_se"]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from lopti_lab.checks import FieldCheck, is_int
from lopti_lab.kk import PROMPT_STYLES, Puzzle, build_prompt, score_response
from lopti_lab.kk.data import split_files
from lopti_lab.models import check_model_name
from lopti_lab.rollout import Rollout, SamplingSpec, sample

__all__ = ["EvalConfig", "EvalSpec", "accuracy_se", "evaluate", "score_rollout"]


def score_rollout(rollout: Rollout, puzzles: Sequence[Puzzle]) -> list:
    """The Logic-RL reward of each row (row b answers puzzles[b // G]); the prompt ended in "<think>", which
    ``score_response`` puts back in front of the response."""
    group = rollout.group_size
    return [score_response(text, puzzles[b // group]) for b, text in enumerate(rollout.texts)]


@dataclass(frozen=True)
class EvalSpec:
    """How a test evaluation decodes: what ``evaluate`` takes, built by ``TrainConfig.eval_spec()`` for a run's
    evaluations and by ``EvalConfig.spec()`` for ``lopti-lab eval``."""

    prompt_style: str = "instruct"
    """the prompt format (kk.PROMPT_STYLES)"""
    max_new_tokens: int = 4096
    """response length cap"""
    modes: tuple[str, ...] = ("greedy", "sample")
    """"greedy" decoding and / or "sample" (``samples`` completions per puzzle at ``temperature``; the paper: both)"""
    samples: int = 1
    """completions per puzzle in the "sample" mode: accuracy is their mean (more samples, less noise)"""
    temperature: float = 1.0
    """temperature of the "sample" mode (the paper: 1.0)"""
    batch_size: int | None = None
    """rows per generate call (None: rollout.sample's default)"""
    seed: int = 0
    """seed of the sampled mode"""
    fast_path: str = "auto"
    """the decoder (rollout.FAST_PATHS)"""
    draw: str = "multinomial"
    """the lean decoder's draw of a sampled token (``rollout.SamplingSpec.draw``): "inverse_cdf" is faster, in the same
    law, but gives other tokens than the runs recorded so far under the same seed"""


def evaluate(
    model: torch.nn.Module,
    tokenizer,
    puzzles: Iterable[Puzzle],
    spec: EvalSpec | None = None,
    *,
    prefix: str = "eval",
    **settings,
) -> dict[str, float]:
    """Test accuracy (share of completions with reward 3) by people count, greedy and/or ``samples`` sampled
    completions per puzzle at ``temperature``, each with its standard error.

    Keys: ``{prefix}/{mode}/acc_{n}ppl``, ``{prefix}/{mode}/acc_all`` (the mean over people counts, the paper's
    "avg"), each with an ``_se`` twin (``accuracy_se``), ``{prefix}/{mode}/format_error_rate`` and
    ``{prefix}/{mode}/len_mean``. Sampling runs under a forked torch RNG seeded with ``seed``, so evaluating never
    changes the training run's random stream. ``settings``: EvalSpec fields to replace (``evaluate(..., samples=4)``).
    """
    spec = replace(spec or EvalSpec(), **settings)
    puzzles = list(puzzles)
    if not puzzles:
        return {}
    device = next(model.parameters()).device
    prompts = [build_prompt(p, spec.prompt_style, tokenizer) for p in puzzles]
    decode = SamplingSpec(spec.max_new_tokens, spec.temperature, batch_size=spec.batch_size, fast_path=spec.fast_path,
                          draw=spec.draw)  # fmt: skip
    people = np.array([p.n_people for p in puzzles])
    out: dict[str, float] = {}
    for mode in spec.modes:
        group = 1 if mode == "greedy" else spec.samples
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(spec.seed)
            rollout = sample(model, tokenizer, prompts, group, decode, greedy=mode == "greedy", with_logprobs=False)
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


@dataclass
class EvalConfig:
    """`lopti-lab eval`: the test accuracy of a model (``model``) or of a trained run at a checkpoint (``run``)."""

    model: str | None = None
    """hub id, local folder or "lab" (evaluated as it is, no adapter); give this or ``run``"""
    run: str | None = None
    """a run folder: its model with the latest checkpoint (or ``step``'s); give this or ``model``"""
    step: int | None = None
    """checkpoint step of ``run`` (None: the latest)"""
    people: tuple[int, ...] = (3, 4, 5, 6, 7)
    """people counts of the test split (the paper: 3-7)"""
    size: int = 100
    """test puzzles per people count (the split has 100)"""
    modes: tuple[str, ...] = EvalSpec.modes
    samples: int = EvalSpec.samples
    temperature: float = EvalSpec.temperature
    max_new_tokens: int = EvalSpec.max_new_tokens
    prompt_style: str | None = None
    """None: the run's, else the one the model's config names (a lab model's), else "instruct\""""
    data_root: str | None = None
    """folder holding test/ K&K JSONL files; None = the bundled data/kk"""
    batch_size: int | None = None
    """rows per generate call (None: all at once)"""
    device: str = "auto"
    dtype: str = "auto"
    seed: int = EvalSpec.seed
    json: str | None = None
    """also write the metrics to this JSON file"""

    def __post_init__(self):
        for name in ("people", "modes"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        check = FieldCheck(self)
        check.text("model", optional=True)
        check.text("run", optional=True)
        check.need((self.model is None) != (self.run is None), "model", "or run must be given, not both")
        if self.model is not None:
            try:
                check_model_name(self.model)
            except ValueError as err:
                raise ValueError(f"EvalConfig.{err}") from None
        check.need(self.run is None or Path(self.run).is_dir(), "run", "must be an existing run folder")
        check.integer("step", low=1, optional=True)
        check.need(self.step is None or self.run is not None, "step", "needs run (a checkpoint of a run folder)")
        check.items("people", lambda n: is_int(n) and n >= 2, "people counts >= 2", distinct=True)
        check.integer("size", low=1)
        check.items("modes", lambda m: m in ("greedy", "sample"), "'greedy' / 'sample'", distinct=True)
        check.integer("samples", low=1)
        check.real("temperature", low=0, low_open=True)
        check.integer("max_new_tokens", low=1)
        check.need(self.prompt_style is None or self.prompt_style in PROMPT_STYLES, "prompt_style",
                   f"must be None or one of {PROMPT_STYLES}")  # fmt: skip
        check.text("data_root", optional=True)
        check.need(self.data_root is None or Path(self.data_root).is_dir(), "data_root", "must be an existing folder")
        check.integer("batch_size", low=1, optional=True)
        check.text("device")
        check.choice("dtype", ("auto", "float32", "bfloat16", "float16"))
        check.integer("seed", 0, 2**32 - 1)
        check.text("json", optional=True)
        try:
            split_files("test", self.people, self.data_root)
        except FileNotFoundError as err:
            raise ValueError(f"EvalConfig.people: {err}") from None

    def spec(self, prompt_style: str) -> EvalSpec:
        """The evaluation this config asks for, in ``prompt_style`` (the run's or the model's, resolved by the CLI)."""
        return EvalSpec(prompt_style, self.max_new_tokens, self.modes, self.samples, self.temperature, self.batch_size,
                        self.seed)  # fmt: skip
