"""Peak memory and time of one training micro-step on a Qwen2.5-0.5B-shaped model (random weights built from its
shapes, no download), LoRA r 16, gradient checkpointing, float32 on a CPU: plain, with the gradient probe, and with
the probe as it was before its memory bound (``--old REV``: position.py from that git revision, loaded beside).

    .venv/bin/python benchmarks/probe_memory.py --layers 24 --rows 2 --prompt 600 --response 16 --old e496fa4

Prints one line per run (peak above the loaded model, in MiB, and seconds) and the ratios to the plain step; the
order alternates plain / probe so that a drift in the machine's load shows up in both. Peaks come from
``lopti_lab.memory.PeakMemory`` (live tensor bytes, from torch's memory profiler); times from a second, unprofiled
run of each."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_probe_memory import QWEN_0P5B, micro_step, qwen_0p5b_lora  # noqa: E402

from lopti_lab.memory import PeakMemory  # noqa: E402
from lopti_lab.probes import GradientProbe  # noqa: E402


def old_probe_class(rev: str):
    """GradientProbe from lopti_lab/probes/position.py at git revision ``rev``, imported as a separate module."""
    source = subprocess.run(["git", "show", f"{rev}:lopti_lab/probes/position.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "old_position.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_position", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_position"] = module
    spec.loader.exec_module(module)
    return module.GradientProbe


def make_batch(rows: int, prompt: int, response: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, QWEN_0P5B["vocab_size"], (rows, prompt + response), generator=g)
    mask = torch.ones(rows, response, dtype=torch.bool)
    return ids, torch.ones_like(ids), mask, torch.rand(rows, response, generator=g), torch.linspace(-1, 1, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=600)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--old", default=None, help="git revision whose GradientProbe to measure beside")
    args = parser.parse_args()
    torch.set_num_threads(2)
    probes = {"plain": None, "probe": GradientProbe}
    if args.old:
        probes[f"probe@{args.old}"] = old_probe_class(args.old)
    model = qwen_0p5b_lora(args.layers)
    data = make_batch(args.rows, args.prompt, args.response)
    micro_step(model, data, None)  # warm-up
    results: dict[str, list] = {name: [] for name in probes}
    for _ in range(args.repeats):
        for name, cls in probes.items():
            with PeakMemory() as peak:  # the memory profiler slows the step: timed apart, below
                micro_step(model, data, None if cls is None else cls(model))
            start = time.perf_counter()
            micro_step(model, data, None if cls is None else cls(model))
            results[name].append((peak.bytes / 2**20, time.perf_counter() - start))
            print(f"{name:>16}: peak +{peak.bytes / 2**20:7.0f} MiB  {results[name][-1][1]:6.2f} s", flush=True)
    plain_mib = min(m for m, _ in results["plain"])
    plain_s = min(s for _, s in results["plain"])
    summary = {
        name: {"peak_mib": min(m for m, _ in runs), "seconds": min(s for _, s in runs),
               "peak_ratio": min(m for m, _ in runs) / plain_mib, "time_ratio": min(s for _, s in runs) / plain_s}
        for name, runs in results.items()
    }  # fmt: skip
    print(json.dumps({"args": vars(args), "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
