"""Every study's training settings side by side, read from the studies' own configs: the table of docs/settings.md
(written there by ``scripts/number_table.py``), beside the paper's.

    rows = [*study_rows(), PAPER_SETTINGS]  # [{"key", "study", "command", "source", "cells", "numbers"}]
    print(settings_markdown(rows))
"""

from __future__ import annotations

from lopti_lab.studies.config import ConfirmConfig, DemoConfig, HardLabConfig, StudyConfig
from lopti_lab.studies.mechanism import MechanismConfig
from lopti_lab.train_config import TrainConfig

__all__ = ["COLUMNS", "PAPER_SETTINGS", "settings_markdown", "study_rows", "train_row"]

COLUMNS = ("study", "command", "policy", "optimizer", "lr", "rollouts per step", "minibatch", "steps", "runs",
           "defined in")  # fmt: skip

PAPER_SETTINGS = {
    "key": "paper",
    "study": "the paper (K&K)",
    "command": "the official verl code",
    "source": "[paper.md](paper.md) §6",
    "cells": {
        "policy": "Qwen2.5-3B-Instruct / 7B-Instruct-1M, full fine-tuning",
        "optimizer": "AdamW, weight decay 0.01",
        "lr": "1e-6",
        "rollouts per step": "64 puzzles x 8, T 0.7, <= 4096 tokens",
        "minibatch": "256",
        "steps": "about 350 (5 epochs)",
        "runs": "one per method",
    },
    "numbers": {"lr": 1e-6, "prompts": 64, "group": 8, "minibatch": 256, "steps": 350, "temperature": 0.7},
}
"""The paper's GRPO settings, from its text (no config of ours trains them)."""


def _e(x: float) -> str:
    """1e-3 for 0.001: how the pages print learning rates and epsilons."""
    return f"{x:.0e}".replace("e-0", "e-")


def train_row(key: str, study: str, command: str, source: str, cfg: TrainConfig, runs: str) -> dict:
    """One row of the table from a run's TrainConfig: its cells as printed and its numbers by field."""
    optimizer = cfg.optimizer_spec()
    if optimizer.optimizer == "sgd":
        name = f"SGD (no momentum, weight decay {optimizer.weight_decay:g})"
    else:
        name = f"AdamW, eps {_e(optimizer.adam_eps)}, weight decay {optimizer.weight_decay:g}"
    tuning = "full fine-tuning" if cfg.lora_r is None else f"LoRA r {cfg.lora_r}"
    cells = {
        "policy": f"`{cfg.model}`, {tuning}",
        "optimizer": name,
        "lr": _e(cfg.lr),
        "rollouts per step": f"{cfg.prompts_per_step} puzzles x {cfg.group_size}, T {cfg.temperature:.1f}, "
        f"<= {cfg.max_new_tokens} tokens",
        "minibatch": str(cfg.minibatch_size),
        "steps": str(cfg.steps),
        "runs": runs,
    }
    numbers = {"lr": cfg.lr, "prompts": cfg.prompts_per_step, "group": cfg.group_size,
               "minibatch": cfg.minibatch_size, "steps": cfg.steps, "temperature": cfg.temperature}  # fmt: skip
    return {"key": key, "study": study, "command": command, "source": source, "cells": cells, "numbers": numbers}


def _runs(config: StudyConfig, extra: str = "") -> str:
    return f"{len(config.methods)} methods x {config.seeds} seed{'s' * (config.seeds > 1)}{extra}"


def study_rows() -> list[dict]:
    """The demo, the methods comparison, the hard lab, its confirmatory study, and the mechanism study's three
    optimizer settings, each from its config's defaults."""
    demo, hard, confirm, mech = DemoConfig(), HardLabConfig(), ConfirmConfig(), MechanismConfig()
    seeds = f" ({confirm.seed_list[0]}-{confirm.seed_list[-1]})"
    rows = [
        train_row("demo", "the demo", "`lopti-lab demo`", "`DEMO_TRAIN`", demo.train, _runs(demo)),
        train_row("methods", "the methods comparison", "`lopti-lab demo --seeds 3 --methods <eleven> --lr 5e-4`",
                  "`DEMO_TRAIN` ([methods.md](methods.md))", demo.train, "11 methods x 3 seeds"),
        train_row("hardlab", "the hard lab (exploratory)", "`lopti-lab hardlab`", "`HARD_TRAIN`", hard.train,
                  _runs(hard)),
        train_row("confirm", "the confirmatory study", "`lopti-lab confirm`", "`CONFIRM_TRAIN`", confirm.train,
                  _runs(confirm, seeds)),
    ]  # fmt: skip
    configs = mech.run_configs()
    for name in mech.optimizers:
        cfg = configs[(name, "GRPO", 0)]
        rows.append(train_row(f"mechanism.{name}", f"the mechanism study, {name}", "`lopti-lab mechanism`",
                              "`MECHANISM_TRAIN`, `OPTIMIZER_SETTINGS`", cfg, _runs(mech)))  # fmt: skip
    return rows


def settings_markdown(rows: list[dict]) -> str:
    """The rows as one markdown table (``COLUMNS``)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = {"study": row["study"], "command": row["command"], "defined in": row["source"], **row["cells"]}
        lines.append("| " + " | ".join(cells[c] for c in COLUMNS) + " |")
    return "\n".join(lines)
