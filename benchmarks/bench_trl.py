"""Stock TRL GRPO vs LoptiGRPOTrainer with AR / Lopti / AR+Lopti, and our own trainer beside them, in one run (CPU).

    .venv/bin/python benchmarks/bench_trl.py                                        # 18 min on a loaded 2-core machine
    .venv/bin/python benchmarks/bench_trl.py --rounds 1 --steps 1 --new-tokens 16   # 8 min

Every variant trains the same random Qwen2 (bench_trainer.make_model: hidden 128, 4 layers, loaded by path) with
LoRA r 16 on the same K&K prompts (base style), B = 4 prompts x G 8, 32 new tokens, micro-batches of 8,
temperature 0.7, clip 0.2, no KL, no evaluation, in two layouts: "1 mb" (one optimizer step per RL step: TRL's
aligned path, where pi_old is the update's own forward) and "2 mb" (the paper's two minibatches per stage, where
every variant needs the pi_old forward). A random model rarely emits EOS (one token of 324), so rows run to about
the full length: nearly equal work.

Figures are CPU seconds of this process per RL step (``time.process_time``, one torch thread; robust to other jobs)
with wall seconds beside them, medians over the measured RL steps of every round (one warm-up RL step per run),
variants alternating within a round. The TRL split: ``generate`` = ``_generate_and_score_completions`` minus its
no-grad log-prob forwards (``logprob``: pi_old), ``update`` = the rest of the step. Targets: AR / TRL <= 1.05x, Lopti
/ TRL <= 1 + (update share of the TRL step).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import make_model, ours  # the same model builder and our trainer's clock

from lopti_lab.integrations.trl import LoptiGRPOConfig, LoptiGRPOTrainer, kk_dataset, kk_reward
from lopti_lab.kk import load_split
from lopti_lab.kk.data import parse_people
from lopti_lab.train_config import TrainConfig

METHODS = {
    "GRPO": {},
    "AR": {"ar_alpha": 0.3},
    "Lopti": {"lopti_eta": 0.5},
    "AR+Lopti": {"ar_alpha": 0.3, "lopti_eta": 0.5},
}


# GRPOConfig field -> the TrainConfig field it equals
SAME_AS = {
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "beta": "kl_coef",
    "epsilon": "clip_low",
    "epsilon_high": "clip_high",
    "learning_rate": "lr",
    "weight_decay": "weight_decay",
    "max_grad_norm": "grad_clip",
    "seed": "seed",
}


def trl_settings(cfg: TrainConfig, out: Path, max_steps: int) -> dict:
    """GRPOConfig fields equal to ``cfg`` (one process): S micro-steps per generation, GA of them per optimizer step,
    TRL's token mean (dapo), no top-k, a constant lr, no logging or saving beyond the step records."""
    micro = cfg.micro_batch_size
    layout = {
        "per_device_train_batch_size": micro,
        "steps_per_generation": cfg.batch_size // micro,
        "gradient_accumulation_steps": cfg.minibatch_size // micro,
    }
    quiet = {"logging_steps": 1, "save_strategy": "no", "report_to": [], "disable_tqdm": True}
    return {
        "output_dir": str(out),
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "max_steps": max_steps,
        "top_k": 0,
        "loss_type": "dapo",
        "lr_scheduler_type": "constant",
        "dataloader_num_workers": 0,
        **layout,
        **quiet,
        **{trl_field: getattr(cfg, ours) for trl_field, ours in SAME_AS.items()},
    }


def clocked(fn, totals: dict, key: str, when=lambda: True):
    """fn, adding its CPU seconds to totals[key] on each call where when() holds."""

    def run(*args, **kwargs):
        start = time.process_time()
        out = fn(*args, **kwargs)
        if when():
            totals[key] = totals.get(key, 0.0) + time.process_time() - start
        return out

    return run


def trl_run(method: dict | None, model_path: str, cfg: TrainConfig, steps: int, out: Path) -> dict:
    """CPU and wall seconds of each RL step after one warm-up RL step, and the TRL split of each.
    ``method`` None: stock GRPOTrainer; else LoptiGRPOTrainer with these fields (ar_alpha, lopti_eta)."""
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    stages = 2 if method and method.get("lopti_eta") is not None else 1
    per_generation = stages * cfg.batch_size // cfg.minibatch_size  # optimizer steps per RL step
    settings = trl_settings(cfg, out, (steps + 1) * per_generation)
    args = GRPOConfig(**settings) if method is None else LoptiGRPOConfig(**settings, **method)
    marks, parts, split = [], {}, []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.process_time(), time.time()))
            if len(marks) % per_generation == 0:  # an RL step ended
                split.append(dict(parts))
                parts.clear()

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=list(cfg.lora_targets))
    puzzles = load_split("train", cfg.train_people, limit=cfg.train_limit)
    trainer = (GRPOTrainer if method is None else LoptiGRPOTrainer)(
        model=model_path,
        reward_funcs=[kk_reward],
        args=args,
        train_dataset=kk_dataset(puzzles, cfg.prompt_style),
        processing_class=AutoTokenizer.from_pretrained(model_path, padding_side="left"),
        peft_config=lora,
        callbacks=[Clock()],
    )
    trainer._generate_and_score_completions = clocked(trainer._generate_and_score_completions, parts, "generation")
    trainer._get_per_token_logps_and_entropies = clocked(
        trainer._get_per_token_logps_and_entropies, parts, "logprob", when=lambda: not torch.is_grad_enabled()
    )
    trainer.train()
    ends = marks[per_generation - 1 :: per_generation]
    cpu = [b[0] - a[0] for a, b in itertools.pairwise(ends)]
    measured = split[1:]  # the first RL step is warm-up
    return {
        "cpu": cpu,
        "wall": [b[1] - a[1] for a, b in itertools.pairwise(ends)],
        "generate": [p["generation"] - p.get("logprob", 0.0) for p in measured],
        "logprob": [p.get("logprob", 0.0) for p in measured],
        "update": [c - p["generation"] for c, p in zip(cpu, measured, strict=True)],
    }


def stock_ratio(med: dict, layout: str, name: str, engine: str = "TRL") -> float:
    """CPU seconds per RL step of ``engine name`` over stock TRL's, in one layout."""
    return med[f"{layout} | {engine} {name}"]["cpu"] / med[f"{layout} | TRL stock"]["cpu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="measured RL steps per variant per round")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--people", default="3")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tmp = Path(tempfile.mkdtemp(prefix="bench_trl_"))
    model_path = make_model(tmp / "model", args.hidden, args.layers)
    base = TrainConfig(
        model=model_path, lora_r=16, lora_alpha=32, prompt_style="base", train_people=tuple(parse_people(args.people)),
        train_limit=64, eval_people=(), prompts_per_step=args.prompts, group_size=args.group,
        minibatch_size=args.prompts * args.group, micro_batch_size=args.micro, max_new_tokens=args.new_tokens,
        lr=1e-5, kl_coef=0.0, clip_low=0.2, clip_high=0.2, dual_clip=None, save_every=0, progress=False,
    )  # fmt: skip
    print(
        f"random Qwen2 hidden {args.hidden} x {args.layers} layers, {args.prompts} prompts x G {args.group}, "
        f"{args.new_tokens} new tokens, micro-batch {args.micro}, LoRA r 16, torch threads 1"
    )
    layouts = {"1 mb": base, "2 mb": replace(base, minibatch_size=base.batch_size // 2)}
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for layout, cfg in layouts.items():
            for name, method in METHODS.items():
                for engine in ("TRL", "ours"):
                    if engine == "ours" and name == "AR+Lopti":
                        continue
                    key = f"{layout} | {engine} {name}"
                    folder = tmp / f"{key}-{r}".replace(" ", "_").replace("|", "").replace("+", "_")
                    if engine == "ours":
                        got = ours(replace(cfg, run_dir=str(folder), **method), args.steps)
                    else:
                        got = trl_run(method, model_path, cfg, args.steps, folder)
                    for k, v in got.items():
                        times.setdefault(key, {}).setdefault(k, []).extend(v)
                if name == "GRPO":  # stock TRL beside our subclass with everything off
                    got = trl_run(None, model_path, cfg, args.steps, tmp / f"stock-{layout[0]}-{r}")
                    for k, v in got.items():
                        times.setdefault(f"{layout} | TRL stock", {}).setdefault(k, []).extend(v)

    med = {key: {k: statistics.median(v) for k, v in parts.items()} for key, parts in times.items()}
    print("\nseconds per RL step (CPU of this process; wall beside it):")
    for key, parts in med.items():
        split = "  ".join(f"{k} {parts[k]:.2f}" for k in ("generate", "logprob", "update") if k in parts)
        print(f"  {key:24s} CPU {parts['cpu']:6.2f}   wall {parts['wall']:6.2f}   {split}")
    for layout in layouts:
        stock = med[f"{layout} | TRL stock"]
        ratio = functools.partial(stock_ratio, med, layout)
        share = stock["update"] / stock["cpu"]
        print(f"\n{layout}: update share of the stock TRL step {share:.0%} (CPU)")
        print(f"  subclass, all off / stock   {ratio('GRPO'):.3f}x")
        print(f"  subclass AR / stock         {ratio('AR'):.3f}x   (target <= 1.05x)")
        print(f"  subclass Lopti / stock      {ratio('Lopti'):.3f}x   (target <= {1 + share:.3f}x = 1 + update share)")
        print(f"  subclass AR+Lopti / stock   {ratio('AR+Lopti'):.3f}x")
        for name in ("GRPO", "AR", "Lopti"):
            mine, theirs = med[f"{layout} | ours {name}"]["cpu"], med[f"{layout} | TRL {name}"]["cpu"]
            print(f"  ours {name} / subclass {name}: {mine / theirs:.2f}x   / stock: {ratio(name, 'ours'):.2f}x")


if __name__ == "__main__":
    main()
