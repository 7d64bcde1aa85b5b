"""Measuring a lab model: test accuracy of its warm start, the token profile of its own rollouts (the paper's
Fig. 1a), and an audit of its greedy traces."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lopti_lab.evaluate import evaluate, score_rollout
from lopti_lab.kk import build_prompt, score_response
from lopti_lab.kk.data import load_split
from lopti_lab.lab.trace import RL_PROMPT_STYLE, TraceStyle, add_at, audit_trace, prompt_style
from lopti_lab.rollout import sample

__all__ = ["audit_greedy", "audit_rollouts", "evaluate_warm_start", "rollout_profile"]


def evaluate_warm_start(
    model,
    tokenizer,
    people: Sequence[int] = (2, 3, 4, 5, 6),
    samples: int = 4,
    size: int | None = None,
    max_new_tokens: int = 256,
    prompt_style: str = RL_PROMPT_STYLE,
    *,
    seed: int = 0,
    prefix: str = "test",
    fast_path: str = "auto",
) -> dict:
    """Test accuracy of a lab model's warm start on the test split of each people count (the first ``size``
    puzzles of each, None: all): greedy, and ``samples`` completions per puzzle at temperature 1.0 sampled under
    ``seed`` (keys ``{prefix}/{greedy,sample}/acc_{n}ppl`` with their ``_se``, ``.../format_error_rate``);
    ``prompt_style``: the one the model was trained on (``lab.trace.prompt_style`` of its trace). The one warm-start
    evaluation: pretraining's final one and the demo's (``studies.run.warm_start_eval``, with ``prefix="eval"``, the
    runs' own keys) both call it."""
    test = load_split("test", list(people), limit=size)
    return evaluate(
        model,
        tokenizer,
        test,
        prompt_style=prompt_style,
        max_new_tokens=max_new_tokens,
        samples=samples,
        seed=seed,
        prefix=prefix,
        fast_path=fast_path,
    )


def rollout_profile(
    model,
    tokenizer,
    people: int = 3,
    puzzles: int = 16,
    group_size: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 896,
    bins: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    seed: int = 0,
    prompt_style: str = RL_PROMPT_STYLE,
) -> dict:
    """The token-probability profile of the model's own GRPO-style rollouts (the paper's Fig. 1a): ``puzzles``
    training puzzles x ``group_size`` samples at ``temperature``; the share of response tokens whose sampling
    probability exp(old_logp) falls in each bin, with the rollouts' accuracy and mean length.

    Keys: ``share_bin{i}`` (i = 0 is [bins[0], bins[1])), ``tokens``, ``accuracy``, ``len_mean``."""
    chosen = load_split("train", people, limit=puzzles)
    prompts = [build_prompt(p, prompt_style, tokenizer) for p in chosen]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        rollout = sample(model, tokenizer, prompts, group_size, max_new_tokens=max_new_tokens, temperature=temperature)
    probs = rollout.old_logp.exp()[rollout.response_mask.bool()].double().numpy()  # (tokens,)
    counts, _ = np.histogram(probs, bins=np.asarray(bins, dtype=float))
    rewards = score_rollout(rollout, chosen)
    return {
        **{f"share_bin{i}": float(c / max(1, counts.sum())) for i, c in enumerate(counts)},
        "tokens": int(counts.sum()),
        "accuracy": float(np.mean([r.total == 3.0 for r in rewards])),
        "len_mean": float(rollout.lengths.float().mean()),
        "temperature": temperature,
    }


def audit_greedy(
    model, tokenizer, style: TraceStyle, people: int = 2, size: int = 40, max_new_tokens: int = 896
) -> dict:
    """Where a lab-trace-trained model goes wrong: ``audit_rollouts`` of its greedy traces."""
    return audit_rollouts(model, tokenizer, style, people, size, max_new_tokens)


def audit_rollouts(
    model,
    tokenizer,
    style: TraceStyle,
    people: int = 2,
    size: int = 40,
    max_new_tokens: int = 896,
    *,
    samples: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
) -> dict:
    """Where a lab-trace-trained model goes wrong: its traces of the first ``size`` test puzzles read back with
    ``lab.trace.audit_trace`` (greedy with ``samples`` = 0, else ``samples`` per puzzle at ``temperature`` under
    ``seed``). Totals of each audit count over the traces, ``clean`` (traces without copy, logic or transcription
    errors) and ``clean_transcription`` (every statement restated right), and the accuracy overall and on each of
    those two subsets (``None`` when a subset is empty). ``conflations / as_and_chances`` is the share of the 'or' /
    'if' / 'iff' claims the traces misread as 'and' (the hard lab model's misconception, docs/hard_lab.md)."""
    chosen = load_split("test", people, limit=size)
    prompts = [build_prompt(p, prompt_style(style), tokenizer) for p in chosen]
    if samples:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            rollout = sample(model, tokenizer, prompts, samples, max_new_tokens=max_new_tokens, temperature=temperature)
        chosen = [p for p in chosen for _ in range(samples)]  # the rollout's rows: each prompt's group in turn
    else:
        rollout = sample(model, tokenizer, prompts, greedy=True, max_new_tokens=max_new_tokens)
    counts = (
        "parsed",
        "decisions",
        "slips",
        "conflations",
        "as_and_chances",
        "copy_errors",
        "logic_errors",
        "lookup_errors",
        "transcribed",
    )
    counts += ("transcription_errors", "leaves", "leaf_errors", "changed_leaves", "changed_leaf_errors")
    counts += ("number_errors", "code_reads", "code_misreads", "verdict_errors", "line_errors", "answer_errors")
    totals = dict.fromkeys(counts, 0)
    by_line: dict[str, list[int]] = {"leaves_by_line": [], "leaf_errors_by_line": []}
    right: dict[str, list[bool]] = {"all": [], "clean": [], "clean_transcription": []}
    for p, text in zip(chosen, rollout.texts, strict=True):
        audit = audit_trace(text, p, style)
        for key in counts:
            totals[key] += int(getattr(audit, key))
        for key, per_line in by_line.items():
            for i, c in enumerate(getattr(audit, key)):
                add_at(per_line, i, c)
        ok = score_response(text, p).total == 3
        right["all"].append(ok)
        if audit.clean:
            right["clean"].append(ok)
        if audit.parsed and not audit.transcription_errors:
            right["clean_transcription"].append(ok)
    return {
        "people": people,
        "traces": len(chosen),
        **totals,
        **by_line,
        "clean": len(right["clean"]),
        "clean_transcription": len(right["clean_transcription"]),
        **{f"accuracy_{k}": (sum(v) / len(v) if v else None) for k, v in right.items()},
    }
