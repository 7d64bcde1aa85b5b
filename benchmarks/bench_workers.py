"""Rollouts per second of the demo's decode: one process on two threads against two one-thread processes at once.

    .venv/bin/python benchmarks/bench_workers.py --batches 4 --rounds 2

Each batch is one demo rollout batch (8 training puzzles of 2-3 people x 8 samples at T = 1.0, up to 512 new tokens,
the bundled lab model, the lean decoder), under torch seed i for batch i, so every layout decodes the same batches.
Per round: one process on ``--threads`` threads decodes the batches, then ``--threads`` processes of one thread
decode them each at the same time. Prints the wall seconds of each and the throughput ratio (rollouts per second of
the one-thread processes together over the one process's). This is why `lopti-lab demo` trains its runs in
``DemoConfig.workers`` processes of one thread (lopti_lab/pool.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def decode(threads: int, batches: int) -> dict:
    """In this process: decode ``batches`` demo batches on ``threads`` threads; their wall seconds and token count."""
    import torch

    from lopti_lab.kk import build_prompt, load_split
    from lopti_lab.models import load_policy, prompt_style_of
    from lopti_lab.rollout import sample

    torch.set_num_threads(threads)
    model, tokenizer = load_policy("lab", lora=None)
    model.eval()
    style = prompt_style_of("lab")
    prompts = [build_prompt(p, style, tokenizer) for p in load_split("train", (2, 3), limit=4)]
    tokens, start = 0, time.perf_counter()
    for i in range(batches):
        torch.manual_seed(i)
        rollout = sample(model, tokenizer, prompts, 8, max_new_tokens=512, temperature=1.0, with_logprobs=True)
        tokens += int(rollout.lengths.sum())
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "rollouts": batches * len(prompts) * 8}


def child(threads: int, batches: int) -> subprocess.Popen:
    code = f"import json, bench_workers as b; print(json.dumps(b.decode({threads}, {batches})))"
    return subprocess.Popen([sys.executable, "-c", code], cwd=sys.path[0], stdout=subprocess.PIPE, text=True)


def result(process: subprocess.Popen) -> dict:
    out, _ = process.communicate()
    if process.returncode:
        raise SystemExit(f"a decode process failed with exit code {process.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="cores to share out (default 2)")
    parser.add_argument("--batches", type=int, default=4, help="demo rollout batches per process (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="side-by-side rounds (default 2)")
    args = parser.parse_args()
    ratios = []
    for r in range(args.rounds):
        one = result(child(args.threads, args.batches))
        start = time.perf_counter()
        many = [result(p) for p in [child(1, args.batches) for _ in range(args.threads)]]
        wall = time.perf_counter() - start  # with their start-up (imports, loading), which both rates leave out
        rate_one = one["rollouts"] / one["seconds"]
        rate_many = sum(m["rollouts"] for m in many) / max(m["seconds"] for m in many)
        ratios.append(rate_many / rate_one)
        print(
            f"round {r + 1}: 1 process x {args.threads} threads {one['seconds']:.1f} s for {one['rollouts']} rollouts"
            f" ({one['tokens']} tokens); {args.threads} processes x 1 thread "
            f"{max(m['seconds'] for m in many):.1f} s for {sum(m['rollouts'] for m in many)} rollouts"
            f" ({sum(m['tokens'] for m in many)} tokens; {wall:.1f} s with start-up): {ratios[-1]:.2f}x the rollouts"
            " per second"
        )
    print(f"throughput ratio, {args.threads} one-thread processes over one {args.threads}-thread process: "
          f"{', '.join(f'{x:.2f}x' for x in ratios)}")  # fmt: skip


if __name__ == "__main__":
    main()
