"""The notebooks' first cell: where we run (Colab or local, GPU or CPU), which policy we train, and training settings
that fit.

    env = setup(quick=QUICK)             # Qwen2.5-1.5B-Instruct with LoRA on a GPU, the bundled lab model on a CPU
    config = training_defaults(env)      # a TrainConfig for this machine
    lab_regimes(env)                     # on a CPU: {"demo lab": ..., "hard lab": ...}, the training panel's picker
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from lopti_lab.demo.config import DemoConfig, HardLabConfig, demo_train
from lopti_lab.models import prompt_style_of
from lopti_lab.train_config import TrainConfig

__all__ = ["Environment", "lab_regimes", "setup", "training_defaults"]


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

    def _repr_markdown_(self) -> str:
        where = "Colab" if self.in_colab else "local"
        tuning = "full fine-tuning" if self.lora_r is None else f"LoRA r={self.lora_r}"
        return (
            f"**{where}, {self.device}**: policy `{self.model}` ({tuning}, prompt style `{self.prompt_style}`)"
            f"{', QUICK mode' if self.quick else ''}"
        )


def setup(quick: bool = False, model: str | None = None, device: str | None = None) -> Environment:
    """Detect Colab and a GPU and pick the policy: Qwen/Qwen2.5-1.5B-Instruct with LoRA on a GPU, the lab model on a
    CPU (and always in QUICK mode). Pass ``model`` to override (any hub id, local folder or "lab")."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if model is None:
        model = "Qwen/Qwen2.5-1.5B-Instruct" if device == "cuda" and not quick else "lab"
    own = prompt_style_of(model)  # a lab model's (its config names it); None for Qwen
    return Environment(
        in_colab="google.colab" in sys.modules,
        device=device,
        model=model,
        lora_r=None if own is not None else 16,
        prompt_style=own or "instruct",
        quick=quick,
    )


def training_defaults(env: Environment, steps: int | None = None):
    """A TrainConfig that fits the environment: the demo's CPU settings for the lab model (QUICK: 2 steps and a tiny
    evaluation), a one-GPU LoRA setup for Qwen2.5 (the paper's RL settings with shorter responses and fewer prompts
    per step). ``steps`` overrides the number of RL steps."""
    if env.lora_r is None:  # a lab model: the demo's CPU settings
        demo = DemoConfig(quick=env.quick, train=demo_train(model=env.model))
        config = replace(demo.train_config("GRPO", 0, Path("runs") / "unnamed"), eval_every=0 if env.quick else 5)
    else:
        config = TrainConfig(
            model=env.model,
            lora_r=env.lora_r,
            prompt_style=env.prompt_style,
            device=env.device,
            gradient_checkpointing=True,
            prompts_per_step=16,
            group_size=8,
            minibatch_size=64,
            generate_batch_size=64,
            micro_batch_size=8,  # the update and log-prob forwards: 8 x 1024 x 151,936 bf16 logits = 2.3 GiB
            max_new_tokens=1024,
            lr=2e-5,
            steps=100,
            eval_every=25,
            eval_size=50,
            probe_every=10,
            save_every=25,
        )
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
