"""The cost of the per-step Fig. 3 measurement (``TrainConfig.shift_every``, ``probes.update_shift``): RL steps of
the lab model with and without it, side by side, alternating, in one process.

    .venv/bin/python benchmarks/bench_fig3.py --steps 6 --threads 2          # the demo's batch: 8 puzzles x 8
    .venv/bin/python benchmarks/bench_fig3.py --prompts 4 --method GRPO+AR+Lopti

Two copies of the bundled lab model, each with its own optimizer, take the same puzzles step by step; step k of the
measured copy runs right after step k of the plain one, so the machine's drift hits both alike. Prints each step's
seconds, the median ratio (measured / plain) and the measurement's own share (``time/shift``): the measured step
over the same step less its measurement, the ratio that does not depend on the two copies sampling alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from lopti_lab.kk import load_split
from lopti_lab.methods import METHODS
from lopti_lab.models import load_policy
from lopti_lab.studies.config import demo_train
from lopti_lab.trainer import PuzzleStream, train_step
from lopti_lab.update import build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8, help="puzzles per step (the demo: 8)")
    parser.add_argument("--method", default="GRPO", choices=list(METHODS))
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--shift-rows", default="4", help="TrainConfig.shift_rows: an int, or 'all'")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {"optimizer": "sgd", "lr": 1e-3, "adam_eps": 1e-8} if args.optimizer == "sgd" else {}
    extra["shift_rows"] = None if args.shift_rows == "all" else int(args.shift_rows)
    cfg = demo_train(prompts_per_step=args.prompts, eval_people=(), **extra, **METHODS[args.method].overrides())
    plain, tokenizer = load_policy(cfg.model, lora=None)
    measured = copy.deepcopy(plain)
    optimizers = {False: build_optimizer(plain.parameters(), cfg.optimizer_spec()),
                  True: build_optimizer(measured.parameters(), cfg.optimizer_spec())}
    models = {False: plain, True: measured}
    stream = PuzzleStream(load_split("train", cfg.train_people), cfg.prompts_per_step, cfg.seed)
    seconds = {False: [], True: []}
    shift = []
    for step in range(1, args.steps + 1):
        for measure in (False, True):
            torch.manual_seed(step)  # the same rollout draws for both copies at this step
            start = time.perf_counter()
            metrics = train_step(models[measure], tokenizer, optimizers[measure], stream.batch(step), cfg,
                                 measure_shift=measure)  # fmt: skip
            seconds[measure].append(time.perf_counter() - start)
            if measure:
                shift.append(metrics.get("time/shift", 0.0))
        print(f"step {step}: plain {seconds[False][-1]:.1f} s, measured {seconds[True][-1]:.1f} s "
              f"(of which the measurement {shift[-1]:.1f} s)", flush=True)  # fmt: skip
    ratios = [m / p for m, p in zip(seconds[True], seconds[False], strict=True)]
    # the same step with and without its measurement: the copies' rollouts can differ in length (the measured copy
    # samples through the decoder that also returns pi_old), so this ratio is the one that isolates the cost
    within = [m / (m - s) for m, s in zip(seconds[True], shift, strict=True)]
    print(f"{args.method}, {args.optimizer}, {args.prompts} x {cfg.group_size} rollouts, threads "
          f"{torch.get_num_threads()}: median step plain {statistics.median(seconds[False]):.1f} s, measured "
          f"{statistics.median(seconds[True]):.1f} s, median ratio {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); the measurement itself {statistics.median(shift):.1f} s "
          f"median; measured step / the same step less its measurement: median {statistics.median(within):.3f} "
          f"(range {min(within):.3f}-{max(within):.3f}), shift_rows {cfg.shift_rows}")  # fmt: skip


if __name__ == "__main__":
    main()
