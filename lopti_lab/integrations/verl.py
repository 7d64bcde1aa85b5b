"""The K&K reward for verl, and where AR and Lopti go in verl's GRPO.

verl is not a lopti_lab dependency and was not run for this module (it needs GPUs and Ray); what is tested here is
the reward function on our parquet export and on the Logic-RL file, against ``kk.score_response``.

Reward. verl calls a custom reward function as ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)`` for each response (``custom_reward_function.path`` = this file, ``.name`` = ``compute_score``),
with ``solution_str`` the decoded response and ``ground_truth`` the row's ``reward_model.ground_truth``. Our
``kk.export_parquet`` (and Logic-RL's files) store ``{"solution_text_format", "statements"}`` there; the prompt ends
inside ``<think>``, so the response is scored as ``kk.score_response`` scores it (the opening tag put back).

    python -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=kk_train.parquet \\
        custom_reward_function.path=$(python -c "import lopti_lab.integrations.verl as m; print(m.__file__)") \\
        custom_reward_function.name=compute_score ...

Prompts. The parquet's ``prompt`` column holds the whole Logic-RL chat string (system, user, "assistant\\n<think>")
as one user message, which the paper's verl fork tokenizes verbatim (``chat[0]["content"]``). Stock verl's
``RLHFDataset`` applies the tokenizer's chat template to that message instead, wrapping the string in a second chat
turn; use a dataset class that reads the content as is (``data.custom_cls.path/name``), or the paper's fork.

Where AR and Lopti go (docs/paper.md §3-4; the paper's code is a fork of verl 0.1, github.com/zhyang2226/AR-Lopti):

1. ``old_log_probs``: verl's actor recomputes them once per step (``compute_log_prob``) at the rollout
   temperature, before any update: exactly pi_old. Nothing to add.
2. AR: in the trainer's ``fit`` loop, right after ``compute_advantage`` (GRPO's advantages are already per token,
   (B, T)), replace ``batch.batch["advantages"]`` by
   ``objective.reweight_advantages(advantages, batch.batch["old_log_probs"], alpha) * response_mask``.
3. Lopti: compute ``objective.lopti_stages(old_log_probs, response_mask, eta)`` once; call the actor update
   (``update_actor`` -> ``DataParallelPPOActor.update_policy``) twice on the same batch, first with the advantages
   zeroed outside the low mask, then outside the high mask, without recomputing ``old_log_probs`` in between. Mask
   the KL (and entropy) terms by the stage mask too, and keep the token-mean denominator counting every response
   token (the stage mask must not reach the loss aggregation's mask argument). The paper's fork does this with a
   ``kl_entropy_mask`` batch key multiplied into the KL and entropy terms.

``integrations.engines`` has these as functions (``ar_advantages``, ``lopti_stage_advantages``) and AR as a policy
loss for verl's ``register_policy_loss`` (``verl_policy_loss``); docs/engines.md says where each goes in verl,
OpenRLHF and prime-rl, read from their source.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping

from lopti_lab.kk import Puzzle, score_response

__all__ = ["compute_score", "compute_score_breakdown", "puzzle_from_ground_truth"]

_ROLE_LINE = re.compile(r"^\((\d+)\)\s+(.+?)\s+is\s+a\s+(knight|knave)\s*$")


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """verl's custom reward: the Logic-RL total (3, -0.5, -1 or -3) of one decoded response to a K&K prompt.

    Example: with ground_truth ``{"solution_text_format": "(1) Zoey is a knave\\n(2) Oliver is a knight",
    "statements": ...}``, ``compute_score("kk_logic", " x </think><answer> (1) Zoey is a knave\\n(2) Oliver is a
    knight </answer>", ground_truth)`` is 3.0.
    """
    return score_response(solution_str, puzzle_from_ground_truth(ground_truth)).total


def compute_score_breakdown(data_source, solution_str: str, ground_truth, extra_info=None) -> dict[str, float]:
    """The same reward as a dict, which recent verl reward managers log key by key (``score`` is the reward)."""
    reward = score_response(solution_str, puzzle_from_ground_truth(ground_truth))
    return {
        "score": reward.total,
        "format": reward.format_score,
        "answer": reward.answer_score,
        "acc": float(reward.correct),
    }


def puzzle_from_ground_truth(ground_truth) -> Puzzle:
    """The puzzle a Logic-RL ``ground_truth`` describes (a mapping, or its JSON): names and roles from
    ``solution_text_format``, checked to be the unique solution of ``statements``."""
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    if not isinstance(ground_truth, Mapping) or not {"solution_text_format", "statements"} <= set(ground_truth):
        raise ValueError(f"ground_truth must hold solution_text_format and statements, got {ground_truth!r}")
    return _puzzle(str(ground_truth["solution_text_format"]), str(ground_truth["statements"]))


@functools.lru_cache(maxsize=65536)
def _puzzle(solution_text_format: str, statements: str) -> Puzzle:
    """'(1) Zoey is a knave\\n(2) Oliver is a knight' -> names (Zoey, Oliver), solution (False, True)."""
    names, solution = [], []
    for k, line in enumerate(solution_text_format.strip().splitlines(), start=1):
        match = _ROLE_LINE.match(line.strip())
        if match is None or int(match.group(1)) != k:
            raise ValueError(
                f"ground_truth.solution_text_format line {k} is not '({k}) NAME is a knight|knave': {line!r}"
            )
        names.append(match.group(2))
        solution.append(match.group(3) == "knight")
    record = {"quiz": "", "names": names, "solution": solution, "statements": statements}
    return Puzzle.from_record(record, check=True)
