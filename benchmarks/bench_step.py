"""One lab RL step against its floating-point floor, per phase, HF's path ("before") beside the lean path ("after").

    .venv/bin/python benchmarks/bench_step.py                          # lab model, the demo's step, 2 threads
    .venv/bin/python benchmarks/bench_step.py --model wide             # a random Qwen2, hidden 384 x 8 layers (13M)
    .venv/bin/python benchmarks/bench_step.py --threads 1 2 --steps 3  # thread settings
    .venv/bin/python benchmarks/bench_step.py --eval                   # the demo's test evaluation, with SEs

The step is `trainer.train_step` at the demo's settings (`studies.config.DemoConfig`: 8 three-person puzzles x 8
samples, prompt style chat_quiz, max_new_tokens 200, T 0.7, minibatches of 32, full fine-tuning, GRPO, no probe),
run with ``fast_path="hf"`` (HF generate, a log-prob forward, HF forwards in the update: the code before the lean
path) and ``fast_path="lean"``, alternating step by step from identical weights on the same puzzles, one warm-up
step each. Phases are CPU and wall seconds of the wrapped ``sample`` / ``add_logprobs`` / ``update_policy`` calls;
figures are medians over the measured steps.

The floor of a phase is its matmul FLOP (linear layers, attention's QK^T and AV, the lm_head where logits are
taken; elementwise work left out) on the step's real tokens (padding left out), divided by this machine's fp32 GEMM
rate measured in the same run at the same thread count (4096^3, and the model's own shapes for reference):
- prefill: every row's prompt (what HF generate computes; the lean loop prefills each prompt once per group);
- decode: every response token but the last, each attending to its prompt and the response before it;
- logprob: one forward of [prompt | response] per row, lm_head on the response;
- update: 3 x that forward per pass over the batch (forward + backward ~ 3 forwards).
"floor" counts every row's prompt (the step as HF runs it, the issue's accounting); "lean floor" counts the work
the lean step must still do: each prompt once per group in prefill and update, no log-prob pass.

``--eval`` times `evaluate.evaluate` at the demo's settings (test split, 2-5 people x 100 puzzles, greedy and 2
samples per puzzle at T = 1.0, 200 new tokens) on both paths and prints each accuracy with its standard error
(`evaluate.accuracy_se`); at equal sample sizes the SEs agree up to sampling noise, so the time ratio is the cost
ratio per point of precision (time x SE^2 is constant as the sample grows).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopti_lab.trainer as trainer
from lopti_lab.kk import load_split
from lopti_lab.models import load_policy
from lopti_lab.studies.config import DemoConfig

PHASES = ("generate", "logprob", "update")


def gemm_rate(m: int, k: int, n: int, seconds: float = 1.0) -> tuple[float, float]:
    """fp32 GFLOP per wall second and per CPU second of an (m x k) @ (k x n) matmul."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    flop, reps = 2 * m * k * n, 0
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds or reps < 3:
        a @ b
        reps += 1
    return flop * reps / (time.perf_counter() - wall) / 1e9, flop * reps / (time.process_time() - cpu) / 1e9


@dataclass
class Shape:
    """What a forward's FLOP depend on: per-token linear FLOP, attention FLOP per key, lm_head FLOP per row."""

    linear: float
    attention: float
    head: float

    @classmethod
    def of(cls, config) -> Shape:
        E, H, K = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        D = getattr(config, "head_dim", None) or E // H
        per_layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * config.intermediate_size
        return cls(
            2 * per_layer * config.num_hidden_layers, 4 * H * D * config.num_hidden_layers, 2 * E * config.vocab_size
        )

    def forward(self, prefix: int, new: int, head_rows: int) -> float:
        """FLOP of ``new`` tokens after ``prefix`` context tokens (causal), with logits at ``head_rows`` positions."""
        keys = new * prefix + new * (new + 1) / 2  # token i sees prefix + i + 1 keys
        return new * self.linear + keys * self.attention + head_rows * self.head


def phase_flops(shape: Shape, prompt_lens: list[int], response_lens: list[int], group: int, passes: int) -> dict:
    """{phase: (floor FLOP, lean floor FLOP)} for rows with these real prompt and response lengths."""
    rows = list(zip(prompt_lens, response_lens, strict=True))
    prompts = prompt_lens[::group]
    prefill = sum(shape.forward(0, p, 1) for p, _ in rows)
    decode = sum(shape.forward(p, n - 1, n - 1) for p, n in rows)
    logprob = sum(shape.forward(0, p + n - 1, n) for p, n in rows)
    lean_forward = sum(shape.forward(0, p, 0) for p in prompts) + sum(shape.forward(p, n - 1, n) for p, n in rows)
    return {
        "prefill": (prefill, sum(shape.forward(0, p, 1) for p in prompts)),
        "decode": (decode, decode),
        "logprob": (logprob, 0.0),
        "update": (3 * passes * logprob, 3 * passes * lean_forward),
    }


def wide_model(tokenizer) -> torch.nn.Module:
    """A random-weight Qwen2 bigger than the lab model (hidden 384, 8 layers, 6 heads / 2 KV heads, MLP 1024, untied
    embeddings, the lab tokenizer's vocabulary): about 13M parameters. Random weights rarely stop, so its responses
    run to the cap (the long-response case)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config).eval()


def run_step(model, tokenizer, optimizer, puzzles, cfg) -> dict:
    """One train_step; CPU and wall seconds of each phase and of the step, and the rollout's token counts."""
    times, seen = {}, {}
    originals = {"generate": trainer.sample, "logprob": trainer.add_logprobs, "update": trainer.update_policy}

    def timed(phase, fn):
        def run(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            times[phase] = (time.process_time() - cpu, time.perf_counter() - wall)
            if phase == "generate":
                seen["rollout"] = out
            return out

        return run

    try:
        trainer.sample, trainer.add_logprobs, trainer.update_policy = (timed(k, f) for k, f in originals.items())
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train_step(model, tokenizer, optimizer, puzzles, cfg)
        times["step"] = (time.process_time() - cpu, time.perf_counter() - wall)
    finally:
        trainer.sample, trainer.add_logprobs, trainer.update_policy = originals.values()
    rollout = seen["rollout"]
    times["prompt_lens"] = rollout.prompt_mask.sum(1).tolist()
    times["response_lens"] = [int(n) for n in rollout.lengths.tolist()]
    return times


def ratio_check(model, rollout, cfg) -> float:
    """max |log pi_update - log pi_old| on the first minibatch: the update's own forward (train mode, before any
    optimizer step) against the decoder's log-probs; the first update's ratio is exp of this."""
    from lopti_lab.rollout import response_logprobs

    rows = slice(0, cfg.minibatch_size)
    model.train()
    with torch.no_grad():
        logp, _ = response_logprobs(
            model, rollout.input_ids[rows], rollout.attention_mask[rows], rollout.response_mask[rows], cfg.temperature
        )
    model.eval()
    return (logp - rollout.old_logp[rows]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["lab", "wide"], default="lab")
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=4, help="measured steps per path (after one warm-up step)")
    parser.add_argument("--eval", action="store_true", help="time the demo's test evaluation instead of a step")
    args = parser.parse_args()
    if args.eval:
        for threads in args.threads:
            torch.set_num_threads(threads)
            bench_eval(threads)
        return

    lab, tokenizer = load_policy("lab", lora=None)
    base = lab if args.model == "lab" else wide_model(tokenizer)
    demo = DemoConfig()
    cfg = replace(demo.train_config("GRPO", 0, Path("unused")), probe_every=0, eval_people=())
    puzzles = load_split("train", cfg.train_people)
    shape = Shape.of(base.config)
    n_params = sum(p.numel() for p in base.parameters())
    passes = cfg.ppo_epochs  # GRPO: one stage
    print(f"model {args.model}: {n_params / 1e6:.2f}M parameters, hidden {base.config.hidden_size} x "
          f"{base.config.num_hidden_layers} layers; step: {cfg.prompts_per_step} puzzles x G {cfg.group_size}, "
          f"max_new_tokens {cfg.max_new_tokens}, T {cfg.temperature}, minibatch {cfg.minibatch_size}")  # fmt: skip

    for threads in args.threads:
        torch.set_num_threads(threads)
        E, I = base.config.hidden_size, base.config.intermediate_size
        rates = {
            "4096^3": gemm_rate(4096, 4096, 4096),
            f"{9600}x{E}x{I}": gemm_rate(9600, E, I),
            f"64x{E}x{I}": gemm_rate(64, E, I),
        }
        models = {path: copy.deepcopy(base) for path in ("hf", "lean")}
        optimizers = {p: torch.optim.AdamW(m.parameters(), lr=cfg.lr) for p, m in models.items()}
        results: dict[str, list[dict]] = {"hf": [], "lean": []}
        log_ratio = None
        for step in range(args.steps + 1):
            batch = puzzles[step * cfg.prompts_per_step : (step + 1) * cfg.prompts_per_step]
            for path, model in models.items():
                torch.manual_seed(1000 + step)
                out = run_step(model, tokenizer, optimizers[path], batch, replace(cfg, fast_path=path))
                if step > 0:
                    results[path].append(out)
        # the first update's ratio on the lean path, on a fresh rollout of the (trained) lean model
        torch.manual_seed(0)
        from lopti_lab.kk import build_prompt

        rollout = trainer.sample(models["lean"], tokenizer, [build_prompt(p, cfg.prompt_style, tokenizer) for p in
                                 puzzles[: cfg.prompts_per_step]], cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                                 temperature=cfg.temperature, fast_path="lean")  # fmt: skip
        log_ratio = ratio_check(models["lean"], rollout, cfg)
        rates["4096^3 (after)"] = gemm_rate(4096, 4096, 4096)
        report(threads, rates, results, shape, cfg, passes, log_ratio)


def report(threads, rates, results, shape, cfg, passes, log_ratio) -> None:
    """The table: per phase, FLOP (floor / lean floor), floor seconds at the 4096^3 rate, and each path's median
    wall and CPU seconds, each with its multiple of the floor (the lean path's CPU seconds also of its own floor)."""

    def med(path, key, clock=1):  # clock 0: CPU seconds, 1: wall seconds
        return statistics.median(r[key][clock] if key in r else 0.0 for r in results[path])

    flops = {p: [phase_flops(shape, r["prompt_lens"], r["response_lens"], cfg.group_size, passes) for r in results[p]]
             for p in results}  # fmt: skip

    def flop(path, parts, which):  # which 0: floor, 1: lean floor
        return statistics.median(sum(f[k][which] for k in parts) for f in flops[path])

    peak_wall = statistics.mean(rates[k][0] for k in ("4096^3", "4096^3 (after)"))
    peak_cpu = statistics.mean(rates[k][1] for k in ("4096^3", "4096^3 (after)"))
    print(f"\ntorch threads {threads}; fp32 GEMM GFLOP/s, wall / per CPU second: "
          + ", ".join(f"{k} {w:.0f} / {c:.0f}" for k, (w, c) in rates.items()))  # fmt: skip
    for p in results:
        prompt = statistics.mean(statistics.mean(r["prompt_lens"]) for r in results[p])
        response = statistics.mean(statistics.mean(r["response_lens"]) for r in results[p])
        print(f"  {p}: mean prompt {prompt:.1f} tokens, mean response {response:.1f} tokens")
    print("  floors at the mean 4096^3 rate; 'x' columns: wall s / wall floor, CPU s / CPU floor (per-CPU-second rate)")
    x_cells = f"{'x':>5s} {'CPU s':>6s} {'x':>5s}"
    print(f"  {'phase':9s} {'GFLOP':>7s} {'lean':>6s} {'floor s':>7s} | {'before':>6s} {x_cells} | "
          f"{'after':>6s} {x_cells} {'x lean':>6s}")  # fmt: skip
    everything = ["prefill", "decode", "logprob", "update"]
    rows = [("prefill", ["prefill"], None), ("decode", ["decode"], None),
            ("generate", ["prefill", "decode"], "generate"), ("logprob", ["logprob"], "logprob"),
            ("update", ["update"], "update"), ("step", everything, "step")]  # fmt: skip
    for name, parts, timed in rows:
        floor, lean = flop("hf", parts, 0) / 1e9, flop("lean", parts, 1) / 1e9  # GFLOP
        line = f"  {name:9s} {floor:7.1f} {lean:6.1f} {floor / peak_wall:7.2f} |"
        if timed is not None:
            cells = []
            for path in ("hf", "lean"):
                wall, cpu = med(path, timed), med(path, timed, 0)
                cells.append(
                    f" {wall:6.2f} {wall / (floor / peak_wall):5.2f} {cpu:6.2f} {cpu / (floor / peak_cpu):5.2f}"
                )
            lean_x = f"{med('lean', timed, 0) / (lean / peak_cpu):6.2f}" if lean else f"{'-':>6s}"
            line += cells[0] + " |" + cells[1] + " " + lean_x
        print(line)
    print(f"  speedup: {med('hf', 'step') / med('lean', 'step'):.2f}x wall, "
          f"{med('hf', 'step', 0) / med('lean', 'step', 0):.2f}x CPU")  # fmt: skip
    print(f"  first update's ratio on the lean path: max |log pi_update - log pi_old(decode)| = {log_ratio:.2e}")


def bench_eval(threads: int) -> None:
    """The demo's final evaluation on both paths: wall and CPU seconds, and every accuracy with its SE."""
    from lopti_lab.evaluate import evaluate
    from lopti_lab.lab.trace import RL_PROMPT_STYLE

    demo = DemoConfig()
    model, tokenizer = load_policy("lab", lora=None)
    test = load_split("test", demo.train.eval_people, limit=demo.train.eval_size)
    print(f"torch threads {threads}; {len(test)} test puzzles ({demo.train.eval_people} people), greedy + "
          f"{demo.train.eval_samples} samples at T = 1.0, {demo.train.max_new_tokens} new tokens")  # fmt: skip
    seconds, metrics = {}, {}
    for path in ("hf", "lean"):
        wall, cpu = time.perf_counter(), time.process_time()
        metrics[path] = evaluate(
            model, tokenizer, test, prompt_style=RL_PROMPT_STYLE, max_new_tokens=demo.train.max_new_tokens,
            samples=demo.train.eval_samples, seed=0, fast_path=path,
        )  # fmt: skip
        seconds[path] = (time.perf_counter() - wall, time.process_time() - cpu)
        print(f"  {path:4s}: {seconds[path][0]:6.1f} s wall, {seconds[path][1]:6.1f} s CPU")
    for key in sorted(k for k in metrics["hf"] if "/acc_" in k and not k.endswith("_se")):
        cells = [f"{metrics[p][key]:.3f} ± {metrics[p][key + '_se']:.3f}" for p in ("hf", "lean")]
        print(f"  {key:28s} hf {cells[0]}   lean {cells[1]}")
    cost = {p: seconds[p][0] * metrics[p]["eval/sample/acc_all_se"] ** 2 for p in seconds}
    print(f"  time ratio hf / lean: {seconds['hf'][0] / seconds['lean'][0]:.2f}x wall, "
          f"{seconds['hf'][1] / seconds['lean'][1]:.2f}x CPU; wall x SE^2 of eval/sample/acc_all: "
          f"hf {cost['hf']:.2e}, lean {cost['lean']:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
