"""Short warm-start probes for the lab model: train a candidate for a few minutes, then measure what RL needs.

    .venv/bin/python benchmarks/lab_model_probe.py --name base --minutes 20 --set steps=3000
    .venv/bin/python benchmarks/lab_model_probe.py --name wide --minutes 20 --set spec.hidden_size=320 trace.slip=0.02

Each probe runs `labmodel.pretrain` with the overrides given (``field=value``, nested fields with a dot; values are
Python literals), then reports the targets of the RL-ready lab model (issue 11) on the bundled test split: greedy and
sampled accuracy at 2 and 3 people, format errors, and the token-probability profile of its own rollouts (3-person
training puzzles, 8 samples each at the rollout temperature). Results go to reports/lab_probes/<name>/probe.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import time
from dataclasses import asdict
from pathlib import Path

from lopti_lab import labmodel


def parse_overrides(items: list[str]) -> dict:
    out: dict = {}
    for item in items:
        key, _, text = item.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="PretrainConfig overrides field=value")
    parser.add_argument("--people", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--size", type=int, default=100, help="test puzzles per people count")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    out = Path("reports/lab_probes") / args.name
    overrides = parse_overrides(args.set)
    base = asdict(labmodel.PretrainConfig())
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    base.update(max_minutes=args.minutes, threads=args.threads, final_people=tuple(args.people), final_size=args.size)
    config = labmodel.PretrainConfig(**base)
    start = time.perf_counter()
    summary = labmodel.pretrain(config, out)
    model, tokenizer = labmodel.load_lab_model(out)
    profile = labmodel.rollout_profile(model, tokenizer, people=3, temperature=args.temperature)
    result = {
        "name": args.name,
        "overrides": overrides,
        "steps_done": summary["steps_done"],
        "train_minutes": summary["minutes"],
        "parameters": summary["parameters"],
        "final_eval": summary["final_eval"],
        "profile": profile,
        "last_loss": sum(r["loss"] for r in summary["log"][-50:]) / max(1, len(summary["log"][-50:])),
        "wall_minutes": (time.perf_counter() - start) / 60,
    }
    (out / "probe.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "overrides"}, indent=1))


if __name__ == "__main__":
    main()
