"""GRPO settings on the lab model: several configurations trained side by side, each in its own process.

Picks the demo's shared RL settings (`studies.config.DemoConfig`) on GRPO alone; AR and Lopti are never tuned here.
Every configuration starts from the bundled lab model, trains on 3-person puzzles and is evaluated on the 3-person
test puzzles (sampled at T = 1.0) every ``--eval-every`` steps, so learning curves can be compared at equal steps and,
since each row logs its time, at equal seconds.

    .venv/bin/python benchmarks/lab_rl_sweep.py --out /tmp/sweep --steps 50 --threads 2 --configs base t1 t1_lr2e-4
    .venv/bin/python benchmarks/lab_rl_sweep.py --out /tmp/sweep --summarize      # the table of a finished sweep
    .venv/bin/python benchmarks/lab_rl_sweep.py --warm-start 16                     # warm start, and its pass@1..16

Runs in parallel (one process per configuration, ``--threads`` torch threads each): on a many-core machine the
whole sweep takes about as long as one configuration.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> TrainConfig overrides on top of the demo's settings (sweep_config)
CONFIGS: dict[str, dict] = {
    "base": {},
    "t1": {"temperature": 1.0},
    "t1_lr2e-4": {"temperature": 1.0, "lr": 2e-4},
    "t1_lr2e-4_kl1e-2": {"temperature": 1.0, "lr": 2e-4, "kl_coef": 0.01},
    "lr2e-4": {"lr": 2e-4},
    "t1_p16": {"temperature": 1.0, "prompts_per_step": 16, "minibatch_size": 64},
    "t1_epochs2": {"temperature": 1.0, "ppo_epochs": 2},
    "t1_lr3e-4_kl1e-2": {"temperature": 1.0, "lr": 3e-4, "kl_coef": 0.01},
    "t1_none": {"temperature": 1.0, "advantage_scale": "none"},
    "t1_warmup10": {"temperature": 1.0, "warmup_steps": 10},
    "g16": {"temperature": 1.0, "prompts_per_step": 4, "group_size": 16},
    "t1_p16_lr2e-4": {"temperature": 1.0, "prompts_per_step": 16, "minibatch_size": 64, "lr": 2e-4},
    "t1_lr2e-4_eps1e-4": {"temperature": 1.0, "lr": 2e-4, "adam_eps": 1e-4},
}


def sweep_config(name: str, seed: int, args: argparse.Namespace):
    """The demo's TrainConfig for GRPO (`DemoConfig` defaults, so the sweep's "base" is the demo) with a sampled
    evaluation of the demo's people counts every ``--eval-every`` steps, no probes, then the configuration's
    overrides."""
    from dataclasses import replace

    from lopti_lab.studies.config import DemoConfig

    demo_train = {"steps": args.steps, **({"model": args.model} if args.model else {})}  # changes to DEMO_TRAIN
    demo = DemoConfig(train=demo_train).train_config("GRPO", seed, Path(args.out) / f"{name}-seed{seed}")
    return replace(
        demo,
        eval_modes=("sample",),
        eval_samples=args.eval_samples,
        eval_every=args.eval_every,
        probe_every=0,
        progress=False,
        **CONFIGS[name],
    )


def parse_setting(items: list[str]) -> tuple[str, dict]:
    """``--set NAME field=value ...`` (values are Python literals) -> (NAME, TrainConfig overrides)."""
    import ast

    name, *pairs = items
    overrides = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {name}: expected field=value, got {pair!r}")
        try:
            overrides[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            overrides[key] = text
    return name, overrides


def parse_run(text: str) -> tuple[str, int]:
    """ "name" or "name@seed" -> (name, seed)."""
    name, _, seed = text.partition("@")
    if name not in CONFIGS:
        raise SystemExit(f"unknown configuration {name!r}; choose from {list(CONFIGS)}")
    return name, int(seed) if seed else -1


def run_one(name: str, seed: int, args: argparse.Namespace) -> None:
    import torch

    from lopti_lab.trainer import train

    torch.set_num_threads(args.threads)
    CONFIGS.update(parse_setting(items) for items in args.set)  # a spawned process starts from the module's own
    cfg = sweep_config(name, seed, args)
    start = time.perf_counter()

    def log(metrics: dict) -> None:
        row = {k: v for k, v in metrics.items() if k.startswith(("step", "acc/", "eval/", "reward/", "policy/ent"))}
        row.update(name=name, seed=seed, seconds=time.perf_counter() - start)
        with open(Path(args.out) / f"{name}-seed{seed}.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")

    train(cfg, callbacks=[log])


def warm_start(pass_k: int, args: argparse.Namespace) -> None:
    """The warm start under the sweep's evaluation (one row per seed), and pass@k of k samples per test puzzle."""
    import numpy as np
    import torch

    from lopti_lab.evaluate import evaluate, score_rollout
    from lopti_lab.kk import build_prompt, load_split
    from lopti_lab.models import load_policy
    from lopti_lab.rollout import sample

    torch.set_num_threads(args.threads)
    cfg = sweep_config("base", 0, args)
    model, tokenizer = load_policy(cfg.model, lora=None)
    puzzles = load_split("test", cfg.eval_people, limit=cfg.eval_size)
    for seed in range(args.seeds_for_warm):
        acc = evaluate(
            model, tokenizer, puzzles, prompt_style=cfg.prompt_style, max_new_tokens=cfg.max_new_tokens,
            modes=cfg.eval_modes, samples=cfg.eval_samples, temperature=cfg.eval_temperature, seed=seed,
        )["eval/sample/acc_3ppl"]  # fmt: skip
        print(f"warm start, seed {seed}: 3-person accuracy {acc:.4f} ({cfg.eval_samples} samples per puzzle, T = 1.0)")
    torch.manual_seed(0)
    prompts = [build_prompt(p, cfg.prompt_style, tokenizer) for p in puzzles]
    rollout = sample(
        model, tokenizer, prompts, pass_k, max_new_tokens=cfg.max_new_tokens, temperature=cfg.eval_temperature,
        with_logprobs=False,
    )  # fmt: skip
    correct = np.array([r.total == 3 for r in score_rollout(rollout, puzzles)]).reshape(len(puzzles), pass_k)
    ks = sorted({1, *(k for k in (2, 4, 8, 16, 32, 64) if k <= pass_k), pass_k})
    print(f"accuracy over all {pass_k} samples per puzzle: {correct.mean():.3f}")
    print("pass@k (first k samples):", {k: round(float(correct[:, :k].any(1).mean()), 3) for k in ks})


def summarize(out: Path) -> None:
    import pandas as pd

    rows = [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text().splitlines()]
    if not rows:
        print(f"no results under {out}")
        return
    df = pd.DataFrame(rows)
    df["run"] = df["name"] + "/s" + df["seed"].astype(str)
    for key in sorted(k for k in df.columns if k.startswith("eval/sample/acc_") and not k.endswith("_se")):
        table = df.dropna(subset=[key]).pivot_table(index="run", columns="step", values=key)
        print(f"{key.removeprefix('eval/sample/acc_')} test accuracy (sampled, T = 1.0) by step:")
        print(table.round(3).to_string())
    train_acc = df.assign(block=(df["step"] - 1) // 10).pivot_table(index="run", columns="block", values="acc/all")
    print("\ntraining accuracy, mean over steps 1-10, 11-20, ...:")
    print(train_acc.round(3).to_string())
    per_step = df.groupby("run")["seconds"].max() / df.groupby("run")["step"].max()
    print("\nseconds per step:", per_step.round(2).to_dict())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/lab_rl_sweep")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="names, or name@seed for another seed (default: all, or the --set ones)",
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-samples", type=int, default=4, help="sampled completions per test puzzle")
    parser.add_argument("--seed", type=int, default=0, help="seed of the names given without @seed")
    parser.add_argument("--seeds-for-warm", type=int, default=2, help="with --warm-start: evaluation seeds 0..N-1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="a lab model folder (default: the demo's, the bundled one)")
    parser.add_argument("--set", nargs="+", action="append", default=[], metavar="NAME FIELD=VALUE",
                        help="one more configuration: a name, then TrainConfig overrides")  # fmt: skip
    parser.add_argument("--summarize", action="store_true", help="only print the table of a finished sweep")
    parser.add_argument("--warm-start", type=int, default=0, metavar="K",
                        help="only evaluate the warm start (--seeds-for-warm seeds) and its pass@1..K")  # fmt: skip
    args = parser.parse_args()
    for items in args.set:
        name, overrides = parse_setting(items)
        CONFIGS[name] = overrides
    if args.warm_start:
        warm_start(args.warm_start, args)
        return
    out = Path(args.out)
    if not args.summarize:
        out.mkdir(parents=True, exist_ok=True)
        ctx = mp.get_context("spawn")
        named = [parse_run(text) for text in args.configs or []]  # after --set: its names are known now
        added = [(name, -1) for name, _ in map(parse_setting, args.set) if name not in {n for n, _ in named}]
        chosen = [*named, *added] or [(name, -1) for name in CONFIGS]
        runs = [(name, args.seed if seed < 0 else seed) for name, seed in chosen]
        procs = [ctx.Process(target=run_one, args=(n, s, args), name=f"{n}@{s}") for n, s in runs]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [p.name for p in procs if p.exitcode != 0]
        if failed:
            print(f"failed: {failed}", file=sys.stderr)
    summarize(out)


if __name__ == "__main__":
    main()
