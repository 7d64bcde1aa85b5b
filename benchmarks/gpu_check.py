"""The prepared GPU check of the one-GPU path: what the device is and what lopti_lab chooses on it, the memory and
time of a training micro-step with and without each probe beside the planner's prediction, fp16 / bf16 / fp32
gradient agreement, decode speed, and the notebook's own defaults trained for 2 steps with a resume.

One call on the device machine (random-weight models built from the bundled Qwen2.5 shapes, nothing downloaded):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT          # <= 10 minutes on an H100
    .venv/bin/python benchmarks/gpu_check.py --smoke --out /tmp/check       # every phase on tiny shapes, CPU, < 60 s

Each phase writes its results into ``<out>/gpu_check.json`` as it ends (a phase that fails records its error and
the next one runs), so a run cut off by its time limit still returns what it measured. ``--budget-s`` skips the
phases that would start after that many seconds. Memory on a GPU is torch's allocator peak (``PeakMemory``); the
planner's number beside it is ``plan.estimate`` for the same shapes, which is how the planner is checked on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from lopti_lab import models, plan  # noqa: E402
from lopti_lab.memory import PeakMemory  # noqa: E402
from lopti_lab.train_config import TrainConfig  # noqa: E402

GiB = plan.GiB
FULL = {"1.5B": "Qwen/Qwen2.5-1.5B-Instruct", "3B": "Qwen/Qwen2.5-3B-Instruct"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


class Report:
    """The json file, rewritten after every phase."""

    def __init__(self, out: Path | None):
        self.path = None if out is None else Path(out) / "gpu_check.json"
        self.data: dict = {}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, fn, *args) -> None:
        start = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as err:  # recorded, and the next phase still runs: a partial check beats none
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=6)}
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.data[name] = result
        print(f"[{name}] {json.dumps(result, default=str)[:1500]}", flush=True)
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


def shape_of(name: str, smoke: bool) -> dict:
    config = plan.model_config(FULL.get(name, name))
    return {**config, **TINY} if smoke else config


def build(config: dict, dtype: torch.dtype, device: str, lora: bool = True, checkpointing: bool = True):
    """A random-weight Qwen2 of ``config``'s shapes on ``device`` in ``dtype``, with LoRA r 16 and checkpointing."""
    from tiny import shaped_qwen2

    return shaped_qwen2(config, dtype, device, lora=lora, checkpointing=checkpointing)


def device_phase(device: str) -> dict:
    """The device, its capability, what "auto" precision resolves to and the attention backend a model gets."""
    dtype = models.resolve_dtype("auto", device)
    out = {"device": device, "torch": torch.__version__, "auto_dtype": str(dtype)}
    if device == "cuda":
        gpu = plan.device_gpu(device)
        out |= {"name": gpu.label, "capability": gpu.capability, "memory_gib": gpu.memory / GiB,
                "cuda": torch.version.cuda, "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
                "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled()}  # fmt: skip
    model = build({**plan.model_config(FULL["1.5B"]), **TINY}, dtype, device, lora=False, checkpointing=False)
    out["attn_implementation"] = model.config._attn_implementation
    return out


def micro_step(model, data, probe=None) -> None:
    from test_probe_memory import micro_step as step

    step(model, data, probe)


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int, device: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones(rows, response, dtype=torch.bool)
    probs = torch.rand(rows, response, generator=g)
    adv = torch.linspace(-1, 1, rows)
    return tuple(t.to(device) for t in (ids, torch.ones_like(ids), mask, probs, adv))


def update_phase(name: str, rows: int, prompt: int, response: int, device: str, smoke: bool) -> dict:
    """A micro-step plain, with the gradient probe, and the Fig. 3 measurement around it: peak and time of each,
    beside the planner's peak for the same config (resident + that phase)."""
    from lopti_lab.probes import GradientProbe, update_logprobs

    config = shape_of(name, smoke)
    dtype = models.resolve_dtype("auto", device)
    model = build(config, dtype, device).train()
    data = synthetic_batch(rows, prompt, response, config["vocab_size"], device)
    micro_step(model, data)  # warm-up
    cfg = TrainConfig(model=FULL.get(name, FULL["1.5B"]), micro_batch_size=rows, minibatch_size=rows,
                      prompts_per_step=rows, group_size=2, generate_batch_size=rows, max_new_tokens=response,
                      max_prompt_tokens=prompt, gradient_checkpointing=True, probe_every=1, shift_every=1,
                      shift_rows=rows, eval_people=())  # fmt: skip
    gpu = plan.device_gpu(device) if device == "cuda" else None
    predicted = plan.estimate(cfg, config, gpu, prompt_tokens=prompt)
    ids, attn, mask, _, _ = data

    def fig3():
        update_logprobs(model, ids, attn, mask, 1.0)
        micro_step(model, data)
        update_logprobs(model, ids, attn, mask, 1.0)

    runs = {"plain": lambda: micro_step(model, data), "probe": lambda: micro_step(model, data, GradientProbe(model)),
            "fig3": fig3}  # fmt: skip
    out = {"rows": rows, "prompt": prompt, "response": response, "dtype": str(dtype)}
    for variant, run in runs.items():
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with PeakMemory(device) as peak:
            run()
        out[variant] = {"peak_gib": peak.total / GiB, "above_start_gib": peak.bytes / GiB,
                        "seconds": time.perf_counter() - start}  # fmt: skip
    for variant, phase in (("plain", "update"), ("probe", "probe"), ("fig3", "shift")):
        out[variant]["planned_gib"] = (predicted.resident + predicted.total(phase)) / GiB
    out["probe"]["peak_ratio"] = out["probe"]["above_start_gib"] / max(out["plain"]["above_start_gib"], 1e-9)
    out["probe"]["time_ratio"] = out["probe"]["seconds"] / out["plain"]["seconds"]
    return out


def precision_phase(device: str, smoke: bool) -> dict:
    """The LoRA gradient of one loss in float32, bfloat16 and float16 (loss scaled by 2^16, as the GradScaler's
    start), from the same weights: cosine to float32's and exact zeros."""
    config = {**shape_of("1.5B", smoke), "num_hidden_layers": 2}
    data = synthetic_batch(4, 128, 64, config["vocab_size"], device)
    grads = {}
    for dtype, scale in ((torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float16, 2.0**16)):
        model = build(config, dtype, device, checkpointing=False).train()
        for n, p in model.named_parameters():  # LoRA B starts at zero: a nonzero one gives A a gradient too
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.01, generator=torch.Generator(device).manual_seed(0))
        from lopti_lab.rollout import response_logprobs

        ids, attn, mask, _, adv = data
        logp, _ = response_logprobs(model, ids, attn, mask, 1.0, fast_path="hf")
        loss = -(adv[:, None] * logp).masked_fill(~mask, 0).sum() / (64 * 1024)  # the notebook's token count
        (loss * scale).backward()
        grads[str(dtype)] = torch.cat([p.grad.float().flatten() / scale for p in model.parameters() if p.requires_grad])
    ref = grads["torch.float32"]
    return {k: {"cosine": torch.nn.functional.cosine_similarity(g, ref, dim=0).item(),
                "exact_zeros": int((g == 0).sum()), "n": g.numel()} for k, g in grads.items()}  # fmt: skip


def decode_phase(name: str, rows: int, prompt: int, new: int, device: str, smoke: bool) -> dict:
    """ms per generated token (all rows at once) with HF generate and its KV cache, as the GPU rollout runs it."""
    config = shape_of(name, smoke)
    model = build(config, models.resolve_dtype("auto", device), device, lora=True, checkpointing=False).eval()
    ids, attn, *_ = synthetic_batch(rows, prompt, 1, config["vocab_size"], device)
    kwargs = dict(attention_mask=attn, do_sample=True, min_new_tokens=new, max_new_tokens=new, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})  # warm-up
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        sync()
    seconds = time.perf_counter() - start
    return {"rows": rows, "prompt": prompt, "new_tokens": new, "ms_per_token": 1000 * seconds / new}


def notebook_phase(device: str, smoke: bool, folder: Path) -> dict:
    """The notebook's defaults for this device (``notebook.setup`` + ``training_defaults``: model, precision, batch
    sizes from the planner), with the chosen model's shapes in random weights: 1 step, then a resume to step 2."""
    from tiny import fake_score, tiny_tokenizer

    import lopti_lab.evaluate as evaluation
    from lopti_lab import notebook
    from lopti_lab.trainer import train

    env = notebook.setup(quick=False, device=device, gpu=None if device == "cuda" else "t4")
    config = shape_of(env.model, smoke)
    base = build(config, torch.float32 if device == "cpu" else torch.bfloat16, device, lora=False,
                 checkpointing=False)  # fmt: skip
    base.save_pretrained(folder / "model")
    tiny_tokenizer().save_pretrained(folder / "model")
    del base
    evaluation.score_response = fake_score  # a random model solves nothing: a hash of the text gives rewards
    cfg = notebook.training_defaults(env, steps=1)
    if smoke:  # the T4 plan's shape of config, at CPU sizes
        cfg = replace(cfg, prompts_per_step=2, group_size=2, minibatch_size=4, micro_batch_size=2,
                      generate_batch_size=4, max_new_tokens=8)  # fmt: skip
    cfg = replace(cfg, model=str(folder / "model"), device=device, run_dir=str(folder / "run"), save_every=1,
                  eval_every=0, eval_people=(3,), eval_size=4, progress=False)  # fmt: skip
    first = train(cfg).history
    resumed = train(replace(cfg, steps=2), resume=True).history
    last = resumed[-1]
    return {"model": env.model, "note": notebook.gpu_defaults(env.gpu or plan.GPUS["t4"], env.model)[2],
            "micro_batch_size": cfg.micro_batch_size, "generate_batch_size": cfg.generate_batch_size,
            "steps": [r["step"] for r in resumed], "first_step_kept": resumed[0] == first[0],
            "finite": all(v == v for v in last.values() if isinstance(v, float)),
            **{k: last[k] for k in last if k.startswith(("time/", "amp/"))}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for gpu_check.json (the device machine's $OUT)")
    parser.add_argument("--smoke", action="store_true", help="every phase on tiny shapes on a CPU")
    parser.add_argument("--budget-s", type=float, default=540, help="skip phases that would start after this")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a GPU (or --smoke)")
    torch.set_num_threads(1 if args.smoke else torch.get_num_threads())
    report, start, tmp = Report(args.out), time.perf_counter(), Path(tempfile.mkdtemp(prefix="gpu_check_"))
    micro = (2, 32, 16) if args.smoke else (8, 400, 1024)  # rows, prompt, response: the notebook's micro-batch
    phases = [
        ("device", device_phase, device),
        ("update_1.5B", update_phase, "1.5B", *micro, device, args.smoke),
        ("update_3B", update_phase, "3B", *micro, device, args.smoke),
        ("precision", precision_phase, device, args.smoke),
        ("decode_3B", decode_phase, "3B", *((4, 16, 8) if args.smoke else (128, 400, 256)), device, args.smoke),
        ("notebook_defaults", notebook_phase, device, args.smoke, tmp),
    ]
    for name, fn, *fn_args in phases:
        if time.perf_counter() - start > args.budget_s:
            report.data[name] = {"skipped": f"budget of {args.budget_s:.0f} s spent"}
            continue
        report.phase(name, fn, *fn_args)
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
