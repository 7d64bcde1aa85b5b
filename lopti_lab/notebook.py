"""The notebooks' first cell: where we run (Colab or local, GPU or CPU), which policy we train, and training settings
that fit.

    env = setup(quick=QUICK)             # on a GPU: the largest Qwen2.5 Instruct that fits (plan.py); on a CPU: the lab
    config = training_defaults(env)      # a TrainConfig for this machine, its batch sizes from the memory planner
    lab_regimes(env)                     # on a CPU: {"demo lab": ..., "hard lab": ...}, the training panel's picker
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from lopti_lab import plan
from lopti_lab.models import prompt_style_of
from lopti_lab.studies.config import DemoConfig, HardLabConfig, demo_train
from lopti_lab.train_config import TrainConfig

__all__ = [
    "GPU_MODELS",
    "Environment",
    "gpu_defaults",
    "gpu_defaults_markdown",
    "gpu_defaults_table",
    "lab_regimes",
    "setup",
    "training_defaults",
]

GPU_MODELS = ("Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct")
"""The policies ``setup`` picks from on a GPU, first choice first: 3B is the paper's smallest model that learns K&K;
a smaller one only where 3B does not fit (plan.py)."""
MIN_MICRO_BATCH = 2
"""A model is picked only if at least this many rows fit a micro-batch: one row a forward would make a step crawl."""


@dataclass(frozen=True)
class Environment:
    """What the first cell of every notebook decides: where we run and which policy we train."""

    in_colab: bool
    device: str
    """"cuda" or "cpu"."""
    model: str
    """A Qwen2.5 Instruct hub id on a GPU, "lab" (the bundled lab model) on a CPU."""
    lora_r: int | None
    """LoRA rank for hub models; None (full fine-tuning) for the tiny lab model."""
    prompt_style: str
    """"instruct" (the Logic-RL prompt) for Qwen; for a lab model the prompt its traces were trained on, as its
    config names it (``models.prompt_style_of``: for the bundled one "chat_quiz_numfirst_bare", the quiz alone with
    each person's number before their name)."""
    quick: bool
    gpu: plan.GPU | None = None
    """The GPU found (its name, memory and compute capability), which the memory planner sizes the step for."""

    def _repr_markdown_(self) -> str:
        where = "Colab" if self.in_colab else "local"
        tuning = "full fine-tuning" if self.lora_r is None else f"LoRA r={self.lora_r}"
        device = self.device if self.gpu is None else f"{self.gpu.label}, {self.gpu.memory / plan.GiB:.0f} GiB"
        precision = "" if self.gpu is None else f", {_precision(self.gpu)}"
        return (
            f"**{where}, {device}**: policy `{self.model}` ({tuning}{precision}, prompt style `{self.prompt_style}`)"
            f"{', QUICK mode' if self.quick else ''}"
        )


def _precision(gpu: plan.GPU) -> str:
    """What "auto" runs in on this GPU (models.resolve_dtype's rule), said plainly."""
    if gpu.capability >= (8, 0):
        return "bfloat16"
    return "float16 with loss scaling (no native bfloat16 below compute capability 8.0)"


def setup(
    quick: bool = False, model: str | None = None, device: str | None = None, gpu: plan.GPU | str | None = None
) -> Environment:
    """Detect Colab and a GPU and pick the policy: on a GPU the first of ``GPU_MODELS`` whose LoRA step fits it at
    the notebook's settings (``gpu_defaults``), on a CPU the lab model (and always in QUICK mode). Pass ``model`` to
    override (any hub id, local folder or "lab"), ``gpu`` (a ``plan.GPUS`` key or a ``plan.GPU``) to plan for
    another GPU than the one found."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(gpu, str):
        gpu = plan.GPUS[gpu]
    if gpu is None and device.startswith("cuda"):
        gpu = plan.device_gpu(device)
    if model is None:
        model = "lab" if gpu is None or quick else gpu_defaults(gpu)[0]
    own = prompt_style_of(model)  # a lab model's (its config names it); None for Qwen
    return Environment(
        in_colab="google.colab" in sys.modules,
        device=device,
        model=model,
        lora_r=None if own is not None else 16,
        prompt_style=own or "instruct",
        quick=quick,
        gpu=gpu if own is None else None,
    )


def _gpu_base(model: str, env_device: str = "cuda") -> TrainConfig:
    """The notebook's one-GPU LoRA setting before the planner sizes it: the paper's RL settings with shorter
    responses and fewer prompts per step; the batch sizes left to ``plan.resolve_batch_sizes``."""
    return TrainConfig(
        model=model, lora_r=16, prompt_style="instruct", device=env_device, gradient_checkpointing=True,
        prompts_per_step=16, group_size=8, minibatch_size=64, max_new_tokens=1024, lr=2e-5, steps=100,
        eval_every=25, eval_size=50, probe_every=10, save_every=25,
    )  # fmt: skip


def gpu_defaults(gpu: plan.GPU, model: str | None = None) -> tuple[str, TrainConfig, str]:
    """(model, TrainConfig, note) for a GPU: ``model`` (default: the first of ``GPU_MODELS`` that fits with at least
    ``MIN_MICRO_BATCH`` rows a micro-batch) with its batch sizes resolved by the planner, and the probe cadence off
    if the probe's step would not fit. The note says what was chosen and why, in one line."""
    for name in [model] if model else GPU_MODELS:
        base = _gpu_base(name)
        shape = plan.model_config(name)
        for probe_every in (base.probe_every, 0):
            try:
                cfg = plan.resolve_batch_sizes(replace(base, probe_every=probe_every), shape, gpu)
            except ValueError:
                continue
            if model or cfg.micro_batch_size >= MIN_MICRO_BATCH:
                peak = plan.estimate(cfg, shape, gpu).peak / plan.GiB
                probes = (
                    f"gradient probe every {probe_every} steps"
                    if probe_every
                    else "no gradient probe (it would not fit)"
                )
                note = (f"{name} on the {gpu.label} in {_precision(gpu)}: micro-batch {cfg.micro_batch_size}, "
                        f"generation batch {cfg.generate_batch_size}, {probes}; planned peak {peak:.1f} GiB of "
                        f"{gpu.usable / plan.GiB:.1f}")  # fmt: skip
                return name, cfg, note
    raise ValueError(f"model: no LoRA step of {model or ' / '.join(GPU_MODELS)} fits the {gpu.label} "
                     f"({gpu.usable / plan.GiB:.1f} GiB usable; lopti-lab plan shows why)")  # fmt: skip


def gpu_defaults_table():
    """What ``setup`` and ``training_defaults`` choose on each GPU of ``plan.GPUS`` (a DataFrame; docs/gpu.md
    quotes it, ``lopti-lab plan --defaults`` prints it)."""
    import pandas as pd

    rows = []
    for gpu in plan.GPUS.values():
        model, cfg, _ = gpu_defaults(gpu)
        peak = plan.estimate(cfg, plan.model_config(model), gpu)
        row = {"GPU": f"{gpu.label} ({gpu.usable / plan.GiB:.1f} GiB usable)", "model": model}
        row |= {"precision": _precision(gpu).split(" (")[0], "micro-batch": cfg.micro_batch_size}
        row |= {"generation batch": cfg.generate_batch_size, "probe every": cfg.probe_every or "off"}
        rows.append(row | {"planned peak (GiB)": round(peak.peak / plan.GiB, 1), "largest phase": peak.peak_phase})
    return pd.DataFrame(rows)


def gpu_defaults_markdown() -> str:
    """``gpu_defaults_table`` as a markdown table (docs/gpu.md)."""
    table = gpu_defaults_table()
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def training_defaults(env: Environment, steps: int | None = None):
    """A TrainConfig that fits the environment: the demo's CPU settings for the lab model (QUICK: 2 steps and a tiny
    evaluation); on a GPU the notebook's LoRA setting sized by the memory planner (``gpu_defaults``); a hub model on
    a CPU gets that setting with small fixed batches. ``steps`` overrides the number of RL steps."""
    if env.lora_r is None:  # a lab model: the demo's CPU settings
        demo = DemoConfig(quick=env.quick, train=demo_train(model=env.model))
        config = replace(demo.train_config("GRPO", 0, Path("runs") / "unnamed"), eval_every=0 if env.quick else 5)
    elif env.gpu is not None:
        config = replace(gpu_defaults(env.gpu, env.model)[1], device=env.device, prompt_style=env.prompt_style)
    else:
        config = replace(_gpu_base(env.model, env.device), prompt_style=env.prompt_style, micro_batch_size=8,
                         generate_batch_size=64)  # fmt: skip
    return replace(config, steps=steps or config.steps)


def lab_regimes(env: Environment) -> dict[str, TrainConfig]:
    """The training panel's regimes on a lab model (``widgets.TrainPanel(regimes=...)``): "demo lab", the
    demo's settings on ``env.model`` (``training_defaults``: the warm start already solves its puzzles, RL removes
    its slips in about 10 steps), and "hard lab", the hard lab study's GRPO run (``HardLabConfig``: the "lab-hard"
    warm start, which misreads 'or', 'if' and 'iff' as 'and', 60 steps with test evaluations on the way;
    docs/hard_lab.md). QUICK: both cut to 2 steps. {} for a hub model (one regime: ``training_defaults``)."""
    if env.lora_r is not None:
        return {}
    hard = HardLabConfig(quick=env.quick).train_config("GRPO", 0, Path("runs") / "unnamed")
    return {"demo lab": training_defaults(env), "hard lab": hard}
