"""The Fig. 3 measurement's memory on a real shape (DESIGN.md, "Precision and memory": an exact probability-shift
measurement never turns the whole model into float64 at once).

A random-weight Qwen2 with Qwen2.5-0.5B's shapes (hidden 896, intermediate 4864, 14 heads, 2 key/value heads,
vocabulary 151,936, tied embeddings) but 4 decoder layers of its 24, to keep the test fast (the embedding, which a
whole-model float64 cast doubles, is then most of the weights, and the layers' share of the measurement's own bound
is one Linear whatever their number), with a LoRA r 16 adapter on the seven projections as ``models.load_policy``
attaches it, and gradient checkpointing on. The peak of ``update_logprobs`` before and after (two float64 and two
bf16 forwards of the rows) must stay within 1.25x the peak of one plain training micro-step of the same rows (the
update's forward through ``rollout.response_logprobs`` and its backward). Peaks are ``memory.PeakMemory``'s: on a CPU
the live tensor bytes the block allocated, from torch's memory profiler.

Run as a script for the numbers of benchmarks/README.md (today's whole-model float64 beside the streamed one, and
their times side by side): ``.venv/bin/python tests/test_float64_memory.py``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import pytest
import torch
from tiny import shaped_qwen2

from lopti_lab.memory import PeakMemory, cpu_peak_supported
from lopti_lab.plan import model_config
from lopti_lab.probes import update_logprobs
from lopti_lab.probes.float64 import in_float64
from lopti_lab.probes.update_shift import Bf16ByFloat32
from lopti_lab.rollout import response_logprobs

BOUND = 1.25
ROWS, PROMPT, RESPONSE = 2, 56, 200  # 2 rows of 256 tokens; the first row's response stops 40 tokens early


def qwen25_05b_shaped(layers: int = 4):
    """Qwen2.5-0.5B's shapes with ``layers`` decoder layers, random weights, LoRA r 16, gradient checkpointing."""
    return shaped_qwen2(model_config("Qwen/Qwen2.5-0.5B-Instruct"), num_hidden_layers=layers).eval()


def rows_of(model, rows: int = ROWS, prompt: int = PROMPT, response: int = RESPONSE):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt + response), generator=gen)
    attn = torch.ones_like(ids)
    mask = torch.ones(rows, response)
    mask[0, response - 40 :] = 0
    attn[0, prompt + response - 40 :] = 0
    return ids, attn, mask


def training_micro_step(model, ids, attn, mask) -> None:
    """The update's forward and backward of these rows (GRPO's token-mean loss at advantage 1), as update_policy."""
    model.train()
    try:
        logp = response_logprobs(model, ids, attn, mask, 1.0)[0]  # (B, T)
        (-(logp * mask).sum() / mask.sum()).backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def fig3_measurement(model, ids, attn, mask) -> None:
    """update_logprobs before and after (the update itself left out: it is the training step's memory)."""
    for _ in range(2):
        update_logprobs(model, ids, attn, mask, 1.0)


def todays_fig3_measurement(model, ids, attn, mask) -> None:
    """The measurement before probes.float64: the whole model cast to float64, and whole (k, T, V) logits."""
    for _ in range(2):
        with in_float64(model), torch.inference_mode():
            response_logprobs(model, ids, attn, mask, 1.0)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), Bf16ByFloat32():
            response_logprobs(model, ids, attn, mask, 1.0)


def peak_bytes(work, *args) -> int:
    gc.collect()
    with PeakMemory("cpu") as peak:
        work(*args)
    return peak.bytes


@pytest.mark.skipif(not cpu_peak_supported(), reason="a CPU peak needs torch's memory profiler")
def test_fig3_measurement_peaks_within_a_training_micro_step_on_a_05b_shape():
    """The streamed float64 measurement peaks far below a training micro-step (4 layers, 2 rows of 256 tokens), where
    a whole-model float64 copy peaks at about twice it (the measured MiB: benchmarks/README.md)."""
    model = qwen25_05b_shaped()
    ids, attn, mask = rows_of(model)
    warm = rows_of(model, rows=1, prompt=4, response=4)
    training_micro_step(model, *warm)  # one-time allocations (thread pools, kernels) outside the measured blocks
    fig3_measurement(model, *warm)
    step = peak_bytes(training_micro_step, model, ids, attn, mask)
    measure = peak_bytes(fig3_measurement, model, ids, attn, mask)
    # the plain step's own floor: its (B, T, V) float32 logits and their gradient
    assert step > 2 * ROWS * RESPONSE * model.config.vocab_size * 4 * 0.8
    assert measure <= BOUND * step, f"measurement {measure / 2**20:.0f} MiB, micro-step {step / 2**20:.0f} MiB"


def lab_rows():
    """The bundled lab model (full weights, float32) and 8 of its own responses (up to 256 tokens) to 2 puzzles."""
    from lopti_lab.kk import build_prompt, load_split
    from lopti_lab.models import load_policy, prompt_style_of
    from lopti_lab.rollout import sample

    model, tok = load_policy("lab", lora=None)
    torch.manual_seed(0)
    prompts = [build_prompt(p, prompt_style_of("lab"), tok) for p in load_split("train", 3, limit=2)]
    rollout = sample(model, tok, prompts, 4, max_new_tokens=256)
    return model, (rollout.input_ids, rollout.attention_mask, rollout.response_mask)


def main() -> None:
    """Peaks and times of the micro-step, today's measurement and the streamed one, side by side in one process:
    ``[threads] [lab]``, "lab" for the bundled lab model's own responses in place of the 0.5B shape's rows."""
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    if "lab" in sys.argv[2:]:
        model, (ids, attn, mask) = lab_rows()
    else:
        model = qwen25_05b_shaped()
        ids, attn, mask = rows_of(model)
    work = {"micro-step": training_micro_step, "today": todays_fig3_measurement, "streamed": fig3_measurement}
    peaks, seconds, cpu = ({k: [] for k in work} for _ in range(3))
    for _ in range(3 if "lab" not in sys.argv[2:] else 9):
        for name, run in work.items():  # alternating, so the machine's drift hits all alike
            peaks[name].append(peak_bytes(run, model, ids, attn, mask))
            start, start_cpu = time.perf_counter(), time.process_time()  # timed apart: the memory profiler slows it
            run(model, ids, attn, mask)
            seconds[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)  # less moved than wall time by a busy machine
    step = statistics.median(peaks["micro-step"])
    for name in work:
        peak = statistics.median(peaks[name])
        print(f"{name}: peak {peak / 2**20:.0f} MiB ({peak / step:.2f}x the micro-step), median "
              f"{statistics.median(seconds[name]):.2f} s wall, {statistics.median(cpu[name]):.2f} s CPU")  # fmt: skip
    for clock, times in (("wall", seconds), ("CPU", cpu)):
        ratios = [s / t for s, t in zip(times["streamed"], times["today"], strict=True)]
        print(f"streamed / today {clock} time: median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}), threads {torch.get_num_threads()}")  # fmt: skip


if __name__ == "__main__":
    main()
