"""The token-credit instrument on a stock TRL ``GRPOTrainer``: K&K on your model, per-bin metrics over steps to a PNG.

    # the bundled lab model on two CPU processes (gloo)
    torchrun --nproc_per_node 2 examples/trl/probe_any_run.py --model_name_or_path lab --people 2 --train_limit 8 \\
        --max_steps 3 --per_device_train_batch_size 8 --num_generations 4 --max_completion_length 256 \\
        --learning_rate 1e-5 --output_dir runs/probe-cpu --use_cpu true --bf16 false \\
        --activation_checkpointing false --report_to none --save_strategy no --logging_steps 1 --seed 0
    # any hub model on one GPU, LoRA
    accelerate launch --config_file examples/trl/accelerate/single_gpu.yaml examples/trl/probe_any_run.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --use_peft --lora_r 16 --learning_rate 2e-5 \\
        --max_steps 50 --output_dir runs/probe-0p5b

The trainer is TRL's own, unchanged; three lines attach the instrument:

    from lopti_lab.integrations.trl_callback import TokenCreditCallback
    trainer = GRPOTrainer(model=..., reward_funcs=[kk_reward], args=GRPOConfig(...), train_dataset=...)
    TokenCreditCallback(every=1).attach(trainer)

Every ``GRPOConfig`` and ``ModelConfig`` field is an option, as in ``train_kk.py`` (same data options and precision
defaults); ``--every``, ``--fig3_precision`` and ``--plot`` set the instrument. The per-bin rows land in
``trainer.state.log_history`` (and TensorBoard / W&B / trackio with ``--report_to``); the main process draws them to
``--plot`` (default OUTPUT_DIR/token_credit.png) and writes them to OUTPUT_DIR/token_credit.jsonl.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from train_kk import KKArguments, kk_inputs, precision_defaults
from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser

from lopti_lab.bins import bin_labels
from lopti_lab.integrations.trl_callback import PRECISIONS, TokenCreditCallback, credit_rows

PANELS = [  # (metric key before _bin{k}, panel title)
    ("tokens/share", "token share"),
    ("adv/pos_share", "share of A > 0 mass"),
    ("adv/neg_share", "share of A < 0 mass"),
    ("grad/share", "gradient share"),
    ("clip/low_share", "clipped below (A < 0)"),
    ("clip/high_share", "clipped above (A > 0)"),
    ("entropy/mean", "mean entropy"),
    ("fig3/{precision}/q/correct", "Fig. 3: A > 0 tokens raised"),
]


@dataclass
class ProbeArguments:
    """The instrument."""

    every: int = field(default=1, metadata={"help": "measure every N-th optimizer step (1, 1 + N, ...)"})
    fig3_precision: str = field(default="float32", metadata={"help": f"Fig. 3's log-probs: one of {PRECISIONS}"})
    plot: str | None = field(default=None, metadata={"help": "PNG path (default: OUTPUT_DIR/token_credit.png)"})


def draw(rows: list[dict], path: Path, precision: str) -> None:
    """One panel per metric, one line per probability bin, over the measured steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = bin_labels()
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5), sharex=True)
    steps = [row["step"] for row in rows]
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        key = key.format(precision=precision)
        for k, label in enumerate(labels):
            values = [row.get(f"{key}_bin{k}") for row in rows]
            ax.plot(steps, [float("nan") if v is None else v for v in values], marker="o", label=f"p_old in {label}")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Token credit by rollout probability (TokenCreditCallback on a stock GRPOTrainer)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = TrlParser((KKArguments, ProbeArguments, GRPOConfig, ModelConfig))
    parser.set_defaults(**precision_defaults())
    data, probe, args, model_args = parser.parse_args_and_config(argv)
    if probe.fig3_precision not in PRECISIONS:
        parser.error(f"--fig3_precision must be one of {PRECISIONS}, got {probe.fig3_precision!r}")
    inputs, _, _ = kk_inputs(parser, data, args, model_args)
    trainer = GRPOTrainer(**inputs)
    TokenCreditCallback(every=probe.every, fig3_precision=probe.fig3_precision).attach(trainer)
    trainer.train()

    if trainer.accelerator.is_main_process:
        rows = credit_rows(trainer.state.log_history)
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "token_credit.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        plot = Path(probe.plot) if probe.plot else out / "token_credit.png"
        draw(rows, plot, probe.fig3_precision)
        state = trainer.accelerator.state
        print(f"probe_any_run: {len(rows)} measured steps on {state.num_processes} process(es) "
              f"({state.distributed_type.value}); per-bin rows in {out / 'token_credit.jsonl'}, plot {plot}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
