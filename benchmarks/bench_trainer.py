"""One RL step of our trainer against TRL's GRPOTrainer, and Lopti's cost over GRPO, side by side in one run (CPU).

    .venv/bin/pip install trl        # the benchmark only; not a lopti_lab dependency
    .venv/bin/python benchmarks/bench_trainer.py                       # ~20 min on one CPU thread
    .venv/bin/python benchmarks/bench_trainer.py --rounds 1 --new-tokens 64  # ~2 min

Both trainers get the same random-weight Qwen2 (saved to a temp folder and loaded by path), the same tokenizer, the
same K&K prompts (base style), the same LoRA (r 16 on the attention and MLP projections), B = prompts x G completions
from one HF generate call at temperature 0.7 with the same length cap, one optimizer step per RL step over
micro-batches of the same size, the same clip range and no KL term (TRL's default beta = 0). A random model rarely
emits EOS, so both generate the full length every step: equal work.

The TRL comparison uses one optimizer step per RL step (TRL's GA-aligned setting): both trainers then take pi_old
from the update's own forward and skip the old-log-prob pass. Lopti is compared with GRPO in the paper's setting,
two minibatches per stage ("2 mb"), where GRPO needs that pass too (``logprob``) and Lopti takes 4 optimizer steps
to GRPO's 2.

Clocks: CPU seconds of this process (``time.process_time``, torch on one thread), which other jobs on a shared
machine barely disturb, and wall seconds beside them. Each figure is the median over the measured steps of every
round (one warm-up step per trainer per round), trainers alternating within a round. Our split (generate / logprob /
update) is CPU time of those calls, taken by wrapping them.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import tiny_qwen2, tiny_tokenizer

import lopti_lab.trainer as trainer
from lopti_lab.kk import build_prompt, load_split, score_response
from lopti_lab.train_config import TrainConfig
from lopti_lab.trainer import train


def make_model(folder: Path, hidden: int, layers: int) -> str:
    tokenizer = tiny_tokenizer()
    model = tiny_qwen2(len(tokenizer), hidden=hidden, layers=layers)
    model.config.max_position_embeddings = 4096
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def ours(cfg: TrainConfig, steps: int) -> dict[str, list[float]]:
    """CPU and wall seconds of each step after one warm-up step, and the CPU split of each step."""
    marks, split = [], {"generate": [], "logprob": [], "update": []}
    originals = {"generate": trainer.sample, "logprob": trainer.add_logprobs, "update": trainer.update_policy}

    def timed(part, fn):
        def run(*args, **kwargs):
            start = time.process_time()
            out = fn(*args, **kwargs)
            split[part].append(time.process_time() - start)
            return out

        return run

    try:
        trainer.sample, trainer.add_logprobs, trainer.update_policy = (timed(k, f) for k, f in originals.items())
        train(replace(cfg, steps=steps + 1), callbacks=[lambda m: marks.append((time.process_time(), time.time()))])
    finally:
        trainer.sample, trainer.add_logprobs, trainer.update_policy = originals.values()
    return {
        "cpu": [b[0] - a[0] for a, b in itertools.pairwise(marks)],
        "wall": [b[1] - a[1] for a, b in itertools.pairwise(marks)],
        **{k: v[1:] for k, v in split.items()},
    }


def trl_grpo(model_path: str, cfg: TrainConfig, steps: int, out: Path) -> dict[str, list[float]]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    puzzles = load_split("train", cfg.train_people, limit=cfg.train_limit)
    data = Dataset.from_dict(
        {"prompt": [build_prompt(p, cfg.prompt_style) for p in puzzles], "puzzle": list(range(len(puzzles)))}
    )

    def kk_reward(prompts, completions, puzzle, **kwargs):
        return [score_response(c, puzzles[i]).total for c, i in zip(completions, puzzle, strict=True)]

    marks = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.process_time(), time.time()))

    micro = cfg.micro_batch_size
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        max_steps=steps + 1,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=cfg.batch_size // micro,  # one optimizer step per generation batch
        num_generations=cfg.group_size,
        max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=1.0,
        top_k=0,
        beta=cfg.kl_coef,
        epsilon=cfg.clip_low,
        epsilon_high=cfg.clip_high,
        loss_type="dapo",  # token mean over the batch, like ours
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.grad_clip,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=cfg.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=list(cfg.lora_targets))
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=[kk_reward],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Clock()],
    )
    trainer.train()
    return {
        "cpu": [b[0] - a[0] for a, b in itertools.pairwise(marks)],
        "wall": [b[1] - a[1] for a, b in itertools.pairwise(marks)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per trainer per round")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    torch.set_num_threads(1)

    tmp = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    model_path = make_model(tmp / "model", args.hidden, args.layers)
    print(
        f"random Qwen2 hidden {args.hidden} x {args.layers} layers, {args.prompts} prompts x G {args.group}, "
        f"micro-batch {args.micro}, LoRA r 16, torch threads 1"
    )
    for new_tokens in args.new_tokens:
        base = TrainConfig(
            model=model_path,
            lora_r=16,
            lora_alpha=32,
            prompt_style="base",
            train_people=(3,),
            train_limit=64,
            eval_people=(),
            prompts_per_step=args.prompts,
            group_size=args.group,
            minibatch_size=args.prompts * args.group,
            micro_batch_size=args.micro,
            max_new_tokens=new_tokens,
            lr=1e-5,
            kl_coef=0.0,
            clip_low=0.2,
            clip_high=0.2,
            dual_clip=None,
            save_every=0,
            progress=False,
        )
        two = replace(base, minibatch_size=base.batch_size // 2)  # the paper's 2 optimizer steps per stage
        variants = {
            "ours GRPO": base,
            "ours GRPO, 2 mb": two,
            "ours Lopti, 2 mb": replace(two, lopti_eta=0.5),
            "ours AR+Lopti, 2 mb": replace(two, ar_alpha=0.3, lopti_eta=0.5),
        }
        times: dict[str, dict[str, list[float]]] = {}
        for r in range(args.rounds):
            for name, cfg in variants.items():
                folder = tmp / f"{name}-{new_tokens}-{r}".replace(" ", "_").replace(",", "")
                for k, v in ours(replace(cfg, run_dir=str(folder)), args.steps).items():
                    times.setdefault(name, {}).setdefault(k, []).extend(v)
            for k, v in trl_grpo(model_path, base, args.steps, tmp / f"trl-{new_tokens}-{r}").items():
                times.setdefault("TRL GRPOTrainer", {}).setdefault(k, []).extend(v)

        med = {name: {k: statistics.median(v) for k, v in parts.items()} for name, parts in times.items()}
        print(f"\nmax_new_tokens {new_tokens} (B = {base.batch_size}; mb = minibatches per stage, else 1), seconds:")
        for name, parts in med.items():
            split = "  ".join(f"{k} {parts[k]:.2f}" for k in ("generate", "logprob", "update") if k in parts)
            print(f"  {name:20s} CPU {parts['cpu']:6.2f}   wall {parts['wall']:6.2f}   {split}")
        grpo, grpo2, lopti, trl = (
            med[k] for k in ("ours GRPO", "ours GRPO, 2 mb", "ours Lopti, 2 mb", "TRL GRPOTrainer")
        )
        print(
            f"  ours / TRL, GRPO step (1 optimizer step):  {grpo['cpu'] / trl['cpu']:.2f}x CPU, "
            f"{grpo['wall'] / trl['wall']:.2f}x wall"
        )
        print(
            f"  Lopti / GRPO, whole step (2 mb):           {lopti['cpu'] / grpo2['cpu']:.2f}x CPU, "
            f"{lopti['wall'] / grpo2['wall']:.2f}x wall"
        )
        print(f"  Lopti / GRPO, update only (2 mb):          {lopti['update'] / grpo2['update']:.2f}x CPU")
        print(f"  generate share of a GRPO step (2 mb):      {grpo2['generate'] / grpo2['cpu']:.0%} CPU")


if __name__ == "__main__":
    main()
