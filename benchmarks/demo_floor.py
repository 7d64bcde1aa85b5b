"""A finished `lopti-lab demo` against its arithmetic: each phase's recorded time beside its FLOP floor, and the wall
time the demo would take were every phase at its floor.

    .venv/bin/python benchmarks/demo_floor.py reports/demo            # a report folder written by `lopti-lab demo`

For every run under ``<report>/runs`` and every step of its metrics.jsonl, the floors are bench_step.py's (its
``Shape`` and ``phase_flops``) at the step's recorded mean response length and the mean prompt length of the run's
puzzles (the train split of its people counts; the test split for the evaluation), over this machine's fp32 GEMM
rate on one thread (each demo worker has one), measured here:
- generate: the lean decode (each prompt prefilled once per group, every response token but the last);
- update: 3 forwards per pass over the rows that have a gradient (a group whose rewards are all equal has none, and
  the update skips it: ``groups/zero_var_share``), one pass per stage (Lopti: 2);
- evaluation: the final evaluation's rows (greedy and the samples per puzzle) at its recorded mean lengths.
Mean lengths stand in for each row's: attention's part grows with the square of the length, so the floors are a
little low, and the ratios a little high, for the spread of lengths a batch has (a few percent at these lengths).

The floor wall time divides the summed floors by the workers (``DemoConfig.workers``), as if the runs packed
perfectly, and adds nothing for loading, the warm start, the counterfactual or the report.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import Shape, gemm_rate, phase_flops

from lopti_lab.kk import build_prompt, load_split
from lopti_lab.models import load_policy


@functools.cache
def mean_prompt(tokenizer, split: str, people: tuple[int, ...], style: str, limit: int | None = None) -> float:
    """Mean token count of the prompts of ``split`` for ``people`` (``limit`` per count), tokenized as
    ``rollout.sample`` does; computed once per split and settings (every run of a demo shares them)."""
    puzzles = load_split(split, people, limit=limit)
    lengths = [len(tokenizer(build_prompt(p, style, tokenizer), add_special_tokens=False).input_ids) for p in puzzles]
    return sum(lengths) / len(lengths)


def run_floors(run: Path, shape: Shape, tokenizer, rate: float) -> dict[str, list[float]]:
    """{phase: [recorded seconds, floor seconds]} summed over a run's steps."""
    config = json.loads((run / "config.json").read_text())
    style, group, rows = config["prompt_style"], config["group_size"], config["prompts_per_step"] * config["group_size"]
    train_prompt = round(mean_prompt(tokenizer, "train", tuple(config["train_people"]), style))
    stages = 1 if config.get("lopti_eta") is None else 2  # Lopti: a pass over the low tokens, then the high
    out = {"generate": [0.0, 0.0], "update": [0.0, 0.0], "evaluation": [0.0, 0.0]}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        n = max(2, round(record["len/response_mean"]))
        flops = phase_flops(shape, [train_prompt] * rows, [n] * rows, group, passes=1)
        prefill, decode = flops["prefill"][1], flops["decode"][1]
        live = 1.0 - record.get("groups/zero_var_share", 0.0)
        out["generate"][0] += record["time/generate"]
        out["generate"][1] += (prefill + decode) / rate
        out["update"][0] += record["time/update"]
        out["update"][1] += stages * live * flops["update"][1] / rate
        if "time/eval" in record:
            out["evaluation"][0] += record["time/eval"]
            out["evaluation"][1] += eval_floor(record, config, shape, tokenizer) / rate
    return out


def eval_floor(record: dict, config: dict, shape: Shape, tokenizer) -> float:
    """FLOP of the evaluation recorded in ``record``: each prompt's forward once, every response token but the last."""
    people, size = config["eval_people"], config["eval_size"]
    prompt = round(mean_prompt(tokenizer, "test", tuple(people), config["prompt_style"], limit=size))
    puzzles = size * len(people)
    total = 0.0
    for mode, group in (("greedy", 1), ("sample", config["eval_samples"])):
        n = max(2, round(record.get(f"eval/{mode}/len_mean", 0.0)))
        flops = phase_flops(shape, [prompt] * puzzles * group, [n] * puzzles * group, group, passes=1)
        total += flops["prefill"][1] + flops["decode"][1]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", help="a report folder of `lopti-lab demo` (runs/ inside)")
    parser.add_argument("--workers", type=int, default=2, help="the demo's workers (DemoConfig.workers)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = sorted(p for p in (Path(args.report) / "runs").iterdir() if (p / "metrics.jsonl").is_file())
    config = json.loads((runs[0] / "config.json").read_text())
    model, tokenizer = load_policy(config["model"], lora=None)
    shape = Shape.of(model.config, model)
    rate = gemm_rate(4096, 4096, 4096)[0] * 1e9  # FLOP per second
    print(f"{len(runs)} runs of {args.report}; fp32 GEMM {rate / 1e9:.0f} GFLOP/s on one thread (4096^3)")
    total = {}
    for run in runs:
        for phase, (seconds, floor) in run_floors(run, shape, tokenizer, rate).items():
            total.setdefault(phase, [0.0, 0.0])
            total[phase][0] += seconds
            total[phase][1] += floor
    print(f"{'phase':<11} {'recorded s':>10} {'floor s':>8} {'x floor':>8}   (summed over the runs' workers)")
    for phase, (seconds, floor) in total.items():
        print(f"{phase:<11} {seconds:10.1f} {floor:8.1f} {seconds / floor:8.2f}")
    seconds, floor = (sum(v[i] for v in total.values()) for i in (0, 1))
    print(f"{'all':<11} {seconds:10.1f} {floor:8.1f} {seconds / floor:8.2f}")
    print(f"wall at the floor, {args.workers} workers packed perfectly: {floor / args.workers / 60:.1f} min "
          f"(recorded phases: {seconds / args.workers / 60:.1f} min)")  # fmt: skip


if __name__ == "__main__":
    main()
