"""``objective.token_logprobs`` forward and backward by chunk size, one thread, CPU seconds (best of 5).

    .venv/bin/python benchmarks/bench_logprobs.py                       # 10,000 x 1,024 logits (the lab model's V)
    .venv/bin/python benchmarks/bench_logprobs.py --rows 600 --vocab 151936   # a Qwen2 vocabulary

Each chunk's passes (scale, log-sum-exp, gather; in backward exp, scale, scatter) run over its (rows x V) block;
a block that fits a core's L2 cache is read from there by every pass after the first. Prints, per chunk size, the
forward + backward time and the no-grad forward with entropies (the rollout's log-prob pass).
"""

from __future__ import annotations

import argparse
import time

import torch

from lopti_lab.objective import token_logprobs


def best_of(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2**25, 2**21, 2**20, 2**19])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, requires_grad=True)
    ids, grad = torch.randint(0, args.vocab, (args.rows,)), torch.randn(args.rows)
    print(f"token_logprobs on {args.rows} x {args.vocab} float32 logits, 1 thread, CPU s (best of 5)")
    for chunk in args.chunks:

        def train(chunk=chunk):
            logp, _ = token_logprobs(logits, ids, 1.0, chunk_elements=chunk)
            logp.backward(grad)

        def rollout(chunk=chunk):
            with torch.no_grad():
                token_logprobs(logits, ids, 1.0, with_entropy=True, chunk_elements=chunk)

        print(f"  chunks of {chunk:>10,} logits: forward + backward {best_of(train):.3f} s, "
              f"no-grad forward with entropy {best_of(rollout):.3f} s")  # fmt: skip


if __name__ == "__main__":
    main()
