"""TokenCreditCallback's overhead: a stock TRL GRPOTrainer step with the callback at every=1 over the same step
without it, side by side in one run (CPU, one torch thread).

    .venv/bin/python benchmarks/bench_trl_callback.py                       # lab model, full fine-tuning and LoRA
    .venv/bin/python benchmarks/bench_trl_callback.py --rounds 1 --steps 2 --tunings full

Each round trains two fresh trainers from the same weights and seed, plain then with the callback, for ``--steps``
optimizer steps: the bundled lab model on its own K&K prompts (2 people), B = 4 prompts x G 4, 256 new tokens,
one optimizer step per generation (TRL's default layout), lr 1e-5. The callback's forwards take no random number
and train nothing, so both runs generate the same completions and take the same steps (checked: equal losses), i.e.
the same work plus the callback's. A step is timed from ``on_step_begin`` to the end of ``on_step_end`` (generation,
reward, forward, backward, optimizer step, and the callback's Fig. 3 forward and reduction), in CPU seconds of this
process (``time.process_time``: robust to other jobs on the machine) with wall seconds beside. Printed: the median
per-step ratio callback / plain over every step of every round. Target: <= 1.3x.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from lopti_lab.integrations.trl import kk_dataset, kk_reward
from lopti_lab.integrations.trl_callback import TokenCreditCallback
from lopti_lab.kk import load_split
from lopti_lab.models import model_path, prompt_style_of


class StepClock(TrainerCallback):
    """CPU and wall seconds of each optimizer step; added last, so its on_step_end runs after the instrument's."""

    def __init__(self):
        self.cpu, self.wall, self._start = [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = (time.process_time(), time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.cpu.append(time.process_time() - self._start[0])
        self.wall.append(time.perf_counter() - self._start[1])


def run(tuning: str, steps: int, with_callback: bool, out: Path) -> tuple[StepClock, list[float]]:
    from peft import LoraConfig

    path = str(model_path("lab"))
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    puzzles = load_split("train", 2, limit=4 * steps)
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, activation_checkpointing=False, per_device_train_batch_size=16,
        num_generations=4, max_completion_length=256, temperature=1.0, learning_rate=1e-5 if tuning == "full" else 1e-4,
        max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    peft = None if tuning == "full" else LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    trainer = GRPOTrainer(
        model=path, reward_funcs=[kk_reward], args=args, processing_class=tokenizer, peft_config=peft,
        train_dataset=kk_dataset(puzzles, prompt_style_of("lab"), tokenizer),
    )  # fmt: skip
    if with_callback:
        TokenCreditCallback(every=1).attach(trainer)
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return clock, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tunings", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for tuning in args.tunings:
        ratios, cpu, wall = [], {False: [], True: []}, {False: [], True: []}
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                plain, plain_losses = run(tuning, args.steps, False, Path(tmp) / "plain")
                probed, probed_losses = run(tuning, args.steps, True, Path(tmp) / "probed")
            if plain_losses != probed_losses:
                raise RuntimeError(f"the runs diverged (losses {plain_losses} vs {probed_losses}): not the same work")
            ratios += [b / a for a, b in zip(plain.cpu, probed.cpu, strict=True)]
            for flag, clock in ((False, plain), (True, probed)):
                cpu[flag] += clock.cpu
                wall[flag] += clock.wall
        median = {flag: (statistics.median(cpu[flag]), statistics.median(wall[flag])) for flag in (False, True)}
        print(
            f"{tuning:>4}: plain step {median[False][0]:.2f} s CPU ({median[False][1]:.2f} s wall), with "
            f"TokenCreditCallback(every=1) {median[True][0]:.2f} s CPU ({median[True][1]:.2f} s wall); per-step ratio "
            f"median {statistics.median(ratios):.3f}x, max {max(ratios):.3f}x over {len(ratios)} steps",
            flush=True,
        )


if __name__ == "__main__":
    main()
