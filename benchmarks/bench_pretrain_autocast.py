"""One warm-start training step of the lab model in float32 and under bfloat16 autocast, side by side.

    .venv/bin/python benchmarks/bench_pretrain_autocast.py --threads 2 --batches 12 --rounds 2

Draws ``--batches`` training batches of the bundled model's pretrain (``PretrainConfig()``: its trace, people counts,
batch size and length buckets; drawn after the curriculum, so 2- and 3-person batches as in most of the run), then
times the same batches through forward, backward and the AdamW step, alternating float32 and bfloat16 rounds, and
prints the seconds per step of each and their ratio. The loss of the first batch is printed for both precisions
(same weights), so the cost of bfloat16 in precision is seen beside its gain in speed.
"""

from __future__ import annotations

import argparse
import time

import torch

from lopti_lab.lab.model import build_model
from lopti_lab.lab.pretrain import PretrainConfig, TraceStream
from lopti_lab.lab.tokenizer import build_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2, help="float32 / bfloat16 rounds, alternating")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = PretrainConfig()
    tokenizer = build_tokenizer(seed=config.seed, style=config.trace)
    model = build_model(tokenizer, config.spec, seed=config.seed)
    stream = TraceStream(tokenizer, config)
    batches = [stream.batch(config.curriculum_steps)[1] for _ in range(args.batches)]
    tokens = sum(int(mask.sum()) for _, mask, _ in batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # small: the weights barely move between rounds

    def loss_of(batch, bf16: bool) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    with torch.no_grad():
        first = {name: loss_of(batches[0], name == "bfloat16").item() for name in ("float32", "bfloat16")}
    seconds: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for _ in range(args.rounds):
        for name in seconds:
            start = time.perf_counter()
            for batch in batches:
                loss_of(batch, name == "bfloat16").backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            seconds[name].append((time.perf_counter() - start) / len(batches))
    print(f"{len(batches)} batches of {config.batch_size}, {tokens} tokens, {args.threads} threads")
    for name, values in seconds.items():
        print(f"{name:>9}: {min(values):.3f} s per step (rounds: {', '.join(f'{v:.3f}' for v in values)}); "
              f"first batch's loss {first[name]:.5f}")  # fmt: skip
    print(f"float32 / bfloat16: {min(seconds['float32']) / min(seconds['bfloat16']):.2f}x")


if __name__ == "__main__":
    main()
