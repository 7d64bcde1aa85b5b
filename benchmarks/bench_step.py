"""One lab RL step against its floating-point floor, per phase, on HF's path and / or the lean path.

    .venv/bin/python benchmarks/bench_step.py --steps 2                # the demo's step, HF beside lean, 2 threads
    .venv/bin/python benchmarks/bench_step.py --paths lean --steps 4   # the lean path alone
    .venv/bin/python benchmarks/bench_step.py --study hard --paths lean   # the hard lab's step (lab-hard model)
    .venv/bin/python benchmarks/bench_step.py --paths lean --probe     # a gradient-probe step against a plain one
    .venv/bin/python benchmarks/bench_step.py --model wide             # a random Qwen2, hidden 384 x 8 layers (13M)
    .venv/bin/python benchmarks/bench_step.py --eval --eval-size 100 --eval-samples 8 --paths lean   # an evaluation

The step is `trainer.train_step` at a study's settings: ``--study demo`` (`studies.config.DEMO_TRAIN`: the lab model,
4.4M parameters, hidden 256 x 6 layers, full fine-tuning; 8 two- and three-person puzzles x 8 samples at T 1.0,
max_new_tokens 640, minibatches of 32, GRPO) or ``--study hard`` (`HARD_TRAIN`: the lab-hard model, 4 puzzles x 8,
minibatches of 16), no probe unless ``--probe``, run with ``fast_path="hf"`` (HF generate, a log-prob forward, HF
forwards in the update: the code before the lean path) and / or ``fast_path="lean"``, alternating step by step from
identical weights on the same puzzles (a seed-0 run's first, in its order), one warm-up step each. Phases are CPU
and wall seconds of the wrapped ``sample`` / ``add_logprobs`` / ``update_policy`` calls; figures are medians over the
measured steps.

The floor of a phase is its matmul FLOP (linear layers, attention's QK^T and AV, the lm_head where logits are
taken; elementwise work left out) on the step's real tokens (padding left out), divided by this machine's fp32 GEMM
rate measured in the same run at the same thread count (4096^3, and the model's own shapes for reference):
- prefill: every row's prompt (what HF generate computes; the lean loop prefills each prompt once per group);
- decode: every response token but the last, each attending to its prompt and the response before it;
- logprob: one forward of [prompt | response] per row, lm_head on the response;
- update: 3 x that forward per pass over the batch (forward + backward ~ 3 forwards).
"floor" counts every row's prompt (the step as HF runs it, the issue's accounting); "lean floor" counts the work
the lean step must still do: each prompt once per group in prefill and update, no log-prob pass.

Generation is also read against its roofline (``decode_roofline``): a decode step cannot beat one read of the
weights nor one read of its live keys and values at the streaming read rate measured in the same run (``read_rate``),
so at the lab model's sizes the FLOP floor alone understates what a decode step must cost.

``--probe`` runs every measured step three times on each path, plain and with the gradient probe (``probe=True``,
as ``probe_every`` steps do), with and without the float64 shift of the whole batch (``probe_shift``), from the same
weights and seed, and prints each probe step's time over the plain one's, and where the extra time goes (the update
with the probe's hooks, the float64 shift forwards).

``--eval`` times `evaluate.evaluate` of ``--eval-size`` test puzzles per people count of the study (greedy and
``--eval-samples`` samples per puzzle at T = 1.0, the study's max_new_tokens) on each path and prints each accuracy
with its standard error (`evaluate.accuracy_se`), and its lean floor (each prompt's forward once, every response token
but the last, at the mean prompt and response lengths); at equal sample sizes the SEs agree up to sampling noise, so the
time ratio is the cost ratio per point of precision (time x SE^2 is constant as the sample grows).

The script only uses functions that every version of lopti_lab since the lean path has, so running it with
``PYTHONPATH`` at another checkout times that code with the same measurement (a before / after comparison).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

if not os.environ.get("PYTHONPATH"):  # this checkout, unless PYTHONPATH names another (a before / after timing)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopti_lab.trainer as trainer
from lopti_lab.kk import load_split
from lopti_lab.models import load_policy
from lopti_lab.studies.config import DemoConfig, HardLabConfig

PHASES = ("generate", "logprob", "update")
NAMES = {"generate": "sample", "logprob": "add_logprobs", "update": "update_policy", "shift": "shift_logprobs"}
"""The trainer function each timed phase wraps (``shift``: the probe's float64 log-probs, before and after)."""


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


def read_rate(mib: int = 256, reps: int = 3) -> tuple[float, float]:
    """Streaming read GB per wall second and per CPU second: the best of ``reps`` sums over a float32 buffer of
    ``mib`` MiB (bigger than the L2 caches, as a decode step's keys and values are)."""
    buffer = torch.ones(mib * 2**20 // 4)
    buffer.sum()
    best = (0.0, 0.0)
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        buffer.sum()
        wall, cpu = time.perf_counter() - wall, max(time.process_time() - cpu, 1e-9)
        best = max(best, (buffer.numel() * 4 / wall / 1e9, buffer.numel() * 4 / cpu / 1e9))
    return best


@dataclass
class Shape:
    """What a forward's FLOP depend on: per-token linear FLOP, attention FLOP per key, lm_head FLOP per row; and what
    a decode step must read: the weights once, and ``kv`` bytes per cached key position (keys and values, every
    layer) of each live row's response and each live prompt."""

    linear: float
    attention: float
    head: float
    weights: float = 0.0
    kv: float = 0.0

    @classmethod
    def of(cls, config, model=None) -> Shape:
        E, H, K = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        D = getattr(config, "head_dim", None) or E // H
        per_layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * config.intermediate_size
        weights = 0.0 if model is None else float(sum(p.numel() * p.element_size() for p in model.parameters()))
        return cls(
            2 * per_layer * config.num_hidden_layers, 4 * H * D * config.num_hidden_layers, 2 * E * config.vocab_size,
            weights, 2.0 * K * D * config.num_hidden_layers * 4,
        )  # fmt: skip

    def forward(self, prefix: int, new: int, head_rows: int) -> float:
        """FLOP of ``new`` tokens after ``prefix`` context tokens (causal), with logits at ``head_rows`` positions."""
        keys = new * prefix + new * (new + 1) / 2  # token i sees prefix + i + 1 keys
        return new * self.linear + keys * self.attention + head_rows * self.head


def decode_roofline(shape: Shape, prompt_lens, response_lens, group: int, flop_rate: float, read: float) -> dict:
    """The lean decode's floor step by step. Step s feeds response token s of every row longer than s + 1 tokens, in
    two parts that run one after the other: the projections and the head (their FLOP over ``flop_rate``, or the
    weights read once over ``read``, whichever is longer) and the attention (its FLOP, or the bytes of each live
    row's s + 1 response keys and values and of each live prompt's, read once for its group's rows). The roofline
    sums the parts' times over the steps; ``flop`` and ``bytes`` are all FLOP and all bytes alone, in seconds."""
    rows = list(zip(prompt_lens, response_lens, strict=True))
    out = {"flop": 0.0, "bytes": 0.0, "roofline": 0.0, "GB": 0.0}
    for s in range(max(response_lens) - 1):
        live = [i for i, (_, n) in enumerate(rows) if n - 1 > s]
        prompts = {i // group for i in live}
        dense = len(live) * (shape.linear + shape.head)  # FLOP
        attention = sum(shape.attention * (rows[i][0] + s + 1) for i in live)
        cached = shape.kv * (len(live) * (s + 1) + sum(prompt_lens[g * group] for g in prompts))  # bytes
        out["flop"] += (dense + attention) / flop_rate
        out["bytes"] += (shape.weights + cached) / read
        out["roofline"] += max(dense / flop_rate, shape.weights / read) + max(attention / flop_rate, cached / read)
        out["GB"] += (shape.weights + cached) / 1e9
    return out


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


def run_step(model, tokenizer, optimizer, puzzles, cfg, probe: bool = False) -> dict:
    """One train_step; CPU and wall seconds of each phase and of the step, and the rollout's token counts."""
    times, seen = {}, {}
    originals = {"generate": trainer.sample, "logprob": trainer.add_logprobs, "update": trainer.update_policy,
                 "shift": getattr(trainer, "shift_logprobs", None)}  # fmt: skip
    originals = {k: f for k, f in originals.items() if f is not None}  # older checkouts: no float64 shift

    def timed(phase, fn):
        def run(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            before = times.get(phase, (0.0, 0.0))  # the probe's float64 shift runs twice a step: summed
            times[phase] = (before[0] + time.process_time() - cpu, before[1] + time.perf_counter() - wall)
            if phase == "generate":
                seen["rollout"] = out
            return out

        return run

    try:
        for name, fn in originals.items():
            setattr(trainer, NAMES[name], timed(name, fn))
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train_step(model, tokenizer, optimizer, puzzles, cfg, probe=probe)
        times["step"] = (time.process_time() - cpu, time.perf_counter() - wall)
    finally:
        for name, fn in originals.items():
            setattr(trainer, NAMES[name], fn)
    rollout = seen["rollout"]
    times["prompt_lens"] = rollout.prompt_mask.sum(1).tolist()
    times["response_lens"] = [int(n) for n in rollout.lengths.tolist()]
    return times


def twin(model, optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A copy of ``model`` and of its AdamW with its state. The state dict is copied too: ``load_state_dict`` keeps
    the given tensors when their dtype and device already match, so without the copy the twin's steps would move the
    original optimizer's moments and step count in place."""
    copied = copy.deepcopy(model)
    copied_opt = torch.optim.AdamW(copied.parameters())  # its lr and betas come with the state dict
    copied_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return copied, copied_opt


def probe_twin(model, optimizer, tokenizer, batch, cfg, step: int) -> dict:
    """``run_step`` with the probe on a ``twin`` of ``model`` and its optimizer, from the plain step's seed."""
    copied, copied_opt = twin(model, optimizer)
    torch.manual_seed(1000 + step)
    return run_step(copied, tokenizer, copied_opt, batch, cfg, probe=True)


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


STUDIES = {"demo": DemoConfig, "hard": HardLabConfig}


def study_config(study: str):
    """The study's shared TrainConfig for one GRPO run: no probe, no evaluation inside the step."""
    cfg = STUDIES[study]().train_config("GRPO", 0, Path("unused"))
    return replace(cfg, probe_every=0, eval_people=(), shift_every=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=list(STUDIES), default="demo")
    parser.add_argument("--model", choices=["lab", "wide"], default="lab", help="wide: a random 13M Qwen2")
    parser.add_argument("--paths", nargs="+", choices=["hf", "lean"], default=["hf", "lean"])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=4, help="measured steps per path (after one warm-up step)")
    parser.add_argument("--probe", action="store_true", help="also a probe step from the same weights, each step")
    parser.add_argument("--eval", action="store_true", help="time the study's test evaluation instead of a step")
    parser.add_argument("--eval-size", type=int, default=None, help="test puzzles per people count")
    parser.add_argument("--eval-samples", type=int, default=None, help="sampled completions per puzzle")
    args = parser.parse_args()
    import lopti_lab

    print(f"lopti_lab from {Path(lopti_lab.__file__).parent}")
    if args.eval:
        for threads in args.threads:
            torch.set_num_threads(threads)
            bench_eval(threads, args)
        return

    full = STUDIES[args.study]().train
    lab, tokenizer = load_policy(full.model, lora=None)
    base = lab if args.model == "lab" else wide_model(tokenizer)
    cfg = study_config(args.study)
    puzzles = load_split("train", cfg.train_people)
    # in a seed-0 run's order (trainer.PuzzleStream): the split's files are by people count, so taken as they are the
    # first steps would all be two-person puzzles, whose responses are about half as long as the demo's mix
    puzzles = [puzzles[i] for i in np.random.default_rng([0, 0]).permutation(len(puzzles))]
    shape = Shape.of(base.config, base)
    n_params = sum(p.numel() for p in base.parameters())
    passes = cfg.ppo_epochs  # GRPO: one stage
    print(f"model {full.model if args.model == 'lab' else 'wide'}: {n_params / 1e6:.2f}M parameters, hidden "
          f"{base.config.hidden_size} x {base.config.num_hidden_layers} layers; step: {cfg.prompts_per_step} puzzles "
          f"x G {cfg.group_size}, max_new_tokens {cfg.max_new_tokens}, T {cfg.temperature}, minibatch "
          f"{cfg.minibatch_size}")  # fmt: skip

    for threads in args.threads:
        torch.set_num_threads(threads)
        E, I = base.config.hidden_size, base.config.intermediate_size
        rates = {
            "4096^3": gemm_rate(4096, 4096, 4096),
            f"{9600}x{E}x{I}": gemm_rate(9600, E, I),
            f"64x{E}x{I}": gemm_rate(64, E, I),
        }
        reads = {mib: read_rate(mib) for mib in (64, 256)}  # GB/s, wall and per CPU second
        models = {path: copy.deepcopy(base) for path in args.paths}
        optimizers = {p: torch.optim.AdamW(m.parameters(), lr=cfg.lr) for p, m in models.items()}
        results: dict[str, list[dict]] = {path: [] for path in args.paths}
        probed: dict[str, list[float]] = {path: [] for path in args.paths}  # probe step wall / plain step wall
        parts: dict[str, list[tuple]] = {path: [] for path in args.paths}  # CPU s: update, probed update, shift, step
        for step in range(args.steps + 1):
            batch = puzzles[step * cfg.prompts_per_step : (step + 1) * cfg.prompts_per_step]
            for path, model in models.items():
                path_cfg = replace(cfg, fast_path=path)
                if args.probe and step > 0:  # the probe steps first, from copies: the plain step then trains
                    with_probe = probe_twin(model, optimizers[path], tokenizer, batch, path_cfg, step)
                    alone = probe_twin(model, optimizers[path], tokenizer, batch, replace(path_cfg, probe_shift=False),
                                       step)  # fmt: skip
                torch.manual_seed(1000 + step)
                out = run_step(model, tokenizer, optimizers[path], batch, path_cfg)
                if step > 0:
                    results[path].append(out)
                    if args.probe:
                        probed[path].append((with_probe["step"][1] / out["step"][1], alone["step"][1] / out["step"][1]))
                        parts[path].append((out["update"][0], with_probe["update"][0],
                                            with_probe.get("shift", (0.0,))[0], out["step"][0]))  # fmt: skip
        log_ratio = None
        if "lean" in models:  # the first update's ratio on the lean path, on a fresh rollout of the trained model
            torch.manual_seed(0)
            from lopti_lab.kk import build_prompt

            prompts = [build_prompt(p, cfg.prompt_style, tokenizer) for p in puzzles[: cfg.prompts_per_step]]
            rollout = trainer.sample(models["lean"], tokenizer, prompts, cfg.group_size,
                                     max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                     fast_path="lean")  # fmt: skip
            log_ratio = ratio_check(models["lean"], rollout, cfg)
        rates["4096^3 (after)"] = gemm_rate(4096, 4096, 4096)
        report(threads, rates, results, shape, cfg, passes, log_ratio)
        roofline_report(rates, reads, results, shape, cfg)
        for path, pairs in probed.items():
            if not pairs:  # no --probe
                continue
            for i, what in enumerate(("with its float64 shift (probe_shift)", "the gradient shares alone")):
                ratios = [pair[i] for pair in pairs]
                print(f"  {path} probe step {what} / plain step (wall): median {statistics.median(ratios):.2f}x, "
                      f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} steps")  # fmt: skip
            plain, probed_update, shift, step = (statistics.median(p[i] for p in parts[path]) for i in range(4))
            print(f"    where it goes (CPU s, medians): update {plain:.2f} plain, {probed_update:.2f} with the "
                  f"probe's hooks; float64 shift forwards {shift:.2f}; plain step {step:.2f}")  # fmt: skip


def report(threads, rates, results, shape, cfg, passes, log_ratio) -> None:
    """The table: per phase, each path's FLOP (floor / lean floor) on its own tokens, the floor seconds at the 4096^3
    rate, and its median wall and CPU seconds with their multiples of the floor and of the lean floor."""

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
    print("  floors at the mean 4096^3 rate; x floor: wall s / wall floor; x lean: wall s / wall lean floor, and CPU s")
    print("  / CPU lean floor (the per-CPU-second rate)")
    everything = ["prefill", "decode", "logprob", "update"]
    rows = [("prefill", ["prefill"], None), ("decode", ["decode"], None),
            ("generate", ["prefill", "decode"], "generate"), ("logprob", ["logprob"], "logprob"),
            ("update", ["update"], "update"), ("step", everything, "step")]  # fmt: skip
    for path in results:
        prompt = statistics.mean(statistics.mean(r["prompt_lens"]) for r in results[path])
        response = statistics.mean(statistics.mean(r["response_lens"]) for r in results[path])
        print(f"  {path} path: mean prompt {prompt:.1f} tokens, mean response {response:.1f} tokens")
        print(f"  {'phase':9s} {'GFLOP':>7s} {'lean':>6s} {'floor s':>7s} {'lean s':>6s} | {'wall s':>6s} "
              f"{'x floor':>7s} {'x lean':>6s} | {'CPU s':>6s} {'x lean':>6s}")  # fmt: skip
        for name, parts, timed in rows:
            floor, lean = flop(path, parts, 0) / 1e9, flop(path, parts, 1) / 1e9  # GFLOP
            line = f"  {name:9s} {floor:7.1f} {lean:6.1f} {floor / peak_wall:7.2f} {lean / peak_wall:6.2f} |"
            if timed is not None:
                wall, cpu = med(path, timed), med(path, timed, 0)
                lean_wall = f"{wall / (lean / peak_wall):6.2f}" if lean else f"{'-':>6s}"
                lean_cpu = f"{cpu / (lean / peak_cpu):6.2f}" if lean else f"{'-':>6s}"
                line += f" {wall:6.2f} {wall / (floor / peak_wall):7.2f} {lean_wall} | {cpu:6.2f} {lean_cpu}"
            print(line)
    if len(results) == 2:
        print(f"  speedup hf / lean: {med('hf', 'step') / med('lean', 'step'):.2f}x wall, "
              f"{med('hf', 'step', 0) / med('lean', 'step', 0):.2f}x CPU")  # fmt: skip
    if log_ratio is not None:
        print(f"  first update's ratio on the lean path: max |log pi_update - log pi_old(decode)| = {log_ratio:.2e}")


def roofline_report(rates, reads, results, shape, cfg) -> None:
    """Per path, the generate phase in CPU seconds against its roofline: the lean prefill's FLOP floor plus the
    decode's step-by-step roofline (``decode_roofline``) at the best read rate and the mean 4096^3 rate per CPU
    second measured in this run (medians over the measured steps)."""
    flop_rate = statistics.mean(rates[k][1] for k in ("4096^3", "4096^3 (after)")) * 1e9
    read = max(r[1] for r in reads.values()) * 1e9
    print("  read GB/s per CPU second: " + ", ".join(f"{m} MiB {r[1]:.1f}" for m, r in reads.items())
          + f"; decode bytes per step: weights {shape.weights / 1e6:.1f} MB + {shape.kv / 1e3:.1f} kB per cached "
          f"position")  # fmt: skip
    for path, steps in results.items():
        parts = []
        for r in steps:
            roof = decode_roofline(shape, r["prompt_lens"], r["response_lens"], cfg.group_size, flop_rate, read)
            prefill = phase_flops(shape, r["prompt_lens"], r["response_lens"], cfg.group_size, 1)["prefill"][1]
            parts.append((r["generate"][0], prefill / flop_rate, roof))
        cpu, prefill = statistics.median(p[0] for p in parts), statistics.median(p[1] for p in parts)
        roof = {k: statistics.median(p[2][k] for p in parts) for k in parts[0][2]}
        floor = prefill + roof["roofline"]
        print(f"  {path} generate: {cpu:.2f} CPU s against its roofline {floor:.2f} s ({cpu / floor:.2f}x); against "
              f"the FLOP floor {prefill + roof['flop']:.2f} s ({cpu / (prefill + roof['flop']):.2f}x). Decode: FLOP "
              f"{roof['flop']:.2f} s, bytes {roof['bytes']:.2f} s ({roof['GB']:.1f} GB), roofline "
              f"{roof['roofline']:.2f} s")  # fmt: skip


def bench_eval(threads: int, args) -> None:
    """The study's test evaluation on each path: wall and CPU seconds, and every accuracy with its SE."""
    from lopti_lab.evaluate import evaluate
    from lopti_lab.kk import build_prompt
    from lopti_lab.models import prompt_style_of

    train = STUDIES[args.study]().train
    size, samples = args.eval_size or train.eval_size, args.eval_samples or train.eval_samples
    model, tokenizer = load_policy(train.model, lora=None)
    test = load_split("test", train.eval_people, limit=size)
    print(f"torch threads {threads}; {len(test)} test puzzles ({train.eval_people} people), greedy + "
          f"{samples} samples at T = 1.0, {train.max_new_tokens} new tokens")  # fmt: skip
    rate = gemm_rate(4096, 4096, 4096)
    seconds, metrics = {}, {}
    for path in args.paths:
        wall, cpu = time.perf_counter(), time.process_time()
        metrics[path] = evaluate(
            model, tokenizer, test, prompt_style=prompt_style_of(train.model), max_new_tokens=train.max_new_tokens,
            samples=samples, seed=0, fast_path=path,
        )  # fmt: skip
        seconds[path] = (time.perf_counter() - wall, time.process_time() - cpu)
        print(f"  {path:4s}: {seconds[path][0]:6.1f} s wall, {seconds[path][1]:6.1f} s CPU")
    rates = [(a + b) / 2 for a, b in zip(rate, gemm_rate(4096, 4096, 4096), strict=True)]  # wall, CPU GFLOP/s
    prompt_len = sum(len(tokenizer(build_prompt(p, train.prompt_style, tokenizer)).input_ids) for p in test) / len(test)
    shape = Shape.of(model.config, model)
    read = max(read_rate(mib)[1] for mib in (64, 256)) * 1e9  # GB per CPU second
    for path in args.paths:  # the lean floor: each prompt once, every response token but the last, at mean lengths
        flop, roof = 0.0, 0.0
        for mode, group in (("greedy", 1), ("sample", samples)):
            length = round(metrics[path][f"eval/{mode}/len_mean"])
            flop += len(test) * (
                shape.forward(0, prompt_len, 1) + group * shape.forward(prompt_len, length - 1, length - 1)
            )
            rows = len(test) * group  # the roofline as if every row had the mean lengths, all in one generate call
            roof += len(test) * shape.forward(0, prompt_len, 1) / (rates[1] * 1e9)
            roof += decode_roofline(shape, [round(prompt_len)] * rows, [length] * rows, group, rates[1] * 1e9,
                                    read)["roofline"]  # fmt: skip
        floor = [flop / 1e9 / r for r in rates]
        print(f"  {path}: {flop / 1e9:.1f} GFLOP at mean lengths (prompt {prompt_len:.1f}); floor {floor[0]:.2f} s "
              f"wall, {floor[1]:.2f} s CPU (4096^3: {rates[0]:.0f} / {rates[1]:.0f} GFLOP/s); x floor "
              f"{seconds[path][0] / floor[0]:.2f} wall, {seconds[path][1] / floor[1]:.2f} CPU; roofline at "
              f"{read / 1e9:.1f} GB/s {roof:.2f} s CPU, x roofline {seconds[path][1] / roof:.2f}")  # fmt: skip
    for key in sorted(k for k in metrics[args.paths[0]] if "/acc_" in k and not k.endswith("_se")):
        cells = [f"{p} {metrics[p][key]:.3f} ± {metrics[p][key + '_se']:.3f}" for p in args.paths]
        print(f"  {key:28s} " + "   ".join(cells))
    if len(args.paths) == 2:
        cost = {p: seconds[p][0] * metrics[p]["eval/sample/acc_all_se"] ** 2 for p in seconds}
        print(f"  time ratio hf / lean: {seconds['hf'][0] / seconds['lean'][0]:.2f}x wall, "
              f"{seconds['hf'][1] / seconds['lean'][1]:.2f}x CPU; wall x SE^2 of eval/sample/acc_all: "
              f"hf {cost['hf']:.2e}, lean {cost['lean']:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
