"""What the hard lab's policies believe about 'or', 'if' and 'iff': the misreading rate of their traces, greedy and
sampled, beside their accuracy, for lab models and for the study's runs (at their latest or a given checkpoint).

    .venv/bin/python benchmarks/hard_lab_probe.py lab-hard lab                  # the two bundled warm starts
    .venv/bin/python benchmarks/hard_lab_probe.py reports/hard_lab/runs/grpo-seed0 reports/hard_lab/runs/grpo-seed0@30

Each policy writes traces for the first ``--size`` test puzzles of each ``--people`` count, greedy and ``--samples``
per puzzle at T = 1.0 (sampling seed 0), and each trace is read back with ``lab.trace.audit_trace``: the accuracy,
the share of the 'or' / 'if' / 'iff' claims true while the 'and' of their sides is false that the trace wrote false
(``conflations / as_and_chances``: 0.6 in ``lab-hard``'s training traces, 0 in the bundled lab model's), and the
other slips per written truth value. ``--profile`` adds the token-probability profile of the policy's own rollouts
(8 samples of 16 training puzzles at 3 people, the paper's Fig. 1a bins). Prints one JSON object per policy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lopti_lab import runs
from lopti_lab.lab.evaluate import audit_rollouts, rollout_profile
from lopti_lab.lab.pretrain import PretrainConfig
from lopti_lab.models import load_policy, model_path
from lopti_lab.trainer import load_trained


def _policy(name: str):
    """(model, tokenizer, the lab model folder whose traces it learned) of a lab model name or folder, or of a run
    folder, ``run@step`` for a given checkpoint."""
    path, _, step = name.partition("@")
    if (Path(path) / runs.CHECKPOINTS).is_dir():
        model, tokenizer, cfg = load_trained(path, int(step) if step else None, device="cpu")
        return model, tokenizer, model_path(cfg.model)
    model, tokenizer = load_policy(path, lora=None, device="cpu")
    return model, tokenizer, model_path(path)


def probe(name: str, people: list[int], size: int, samples: int, profile: bool) -> dict:
    model, tokenizer, folder = _policy(name)
    model.eval()
    record = json.loads((Path(folder) / "lab_model.json").read_text())
    style = PretrainConfig(**{k: v for k, v in record["config"].items() if k != "init_from"}).trace
    out: dict = {"policy": name, "trace_compound_as_and": style.compound_as_and}
    for n in people:
        for mode, k in (("greedy", 0), ("sampled", samples)):
            audit = audit_rollouts(model, tokenizer, style, n, size, 640, samples=k)
            chances = audit["as_and_chances"]
            other_slips = audit["slips"] - audit["conflations"]
            out[f"{n}ppl/{mode}"] = {
                "traces": audit["traces"],
                "accuracy": round(audit["accuracy_all"], 4),
                "misread": f"{audit['conflations']} / {chances}"
                + (f" = {audit['conflations'] / chances:.3f}" if chances else ""),
                "other_slips_per_value": round(other_slips / max(1, audit["decisions"]), 4),
                "format_or_copy_errors": audit["copy_errors"] + audit["logic_errors"],
            }
    if profile:
        shares = rollout_profile(model, tokenizer, people=3, temperature=1.0, max_new_tokens=640,
                                 prompt_style=model.config.kk_prompt_style)  # fmt: skip
        out["profile [0,.25) [.25,.5) [.5,.75) [.75,1]"] = [round(shares[f"share_bin{i}"], 3) for i in range(4)]
        out["profile_tokens"] = shares["tokens"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policies", nargs="+", help="lab model names or folders, run folders, run@step")
    parser.add_argument("--people", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--size", type=int, default=50, help="test puzzles per people count")
    parser.add_argument("--samples", type=int, default=4, help="sampled traces per puzzle at T = 1.0")
    parser.add_argument("--profile", action="store_true", help="also the token profile of its own rollouts")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.policies:
        start = time.perf_counter()
        result = probe(name, args.people, args.size, args.samples, args.profile)
        result["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
