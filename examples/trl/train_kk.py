"""GRPO with AR and Lopti on Knights-and-Knaves through TRL: one script for one GPU, N GPUs, DeepSpeed and vLLM.

    # one GPU, LoRA
    accelerate launch --config_file examples/trl/accelerate/single_gpu.yaml examples/trl/train_kk.py \\
        --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --use_peft --lora_r 16 --learning_rate 2e-5 \\
        --ar_alpha 0.3 --lopti_eta 0.5 --rl_steps 200 --output_dir runs/trl-1p5b
    # the paper's 3B run, full fine-tuning on 4 GPUs with DeepSpeed ZeRO-3 (add --use_vllm true for vLLM colocate)
    accelerate launch --config_file examples/trl/accelerate/deepspeed_zero3.yaml --num_processes 4 \\
        examples/trl/train_kk.py --config examples/trl/recipes/kk_qwen2.5_3b.yaml

Every ``LoptiGRPOConfig`` field (TRL's GRPOConfig + ar_alpha, lopti_eta, lopti_order, minibatch_token_mean,
rl_steps) and every TRL ``ModelConfig`` field (model_name_or_path, dtype, use_peft, lora_r, ...) is an option; a
``--config`` YAML file sets their defaults. ``--model_name_or_path lab`` trains the bundled lab model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config

from lopti_lab.integrations.trl import LoptiGRPOConfig, LoptiGRPOTrainer, kk_dataset, kk_reward
from lopti_lab.kk import load_split
from lopti_lab.kk.data import parse_people
from lopti_lab.paths import data_dir


@dataclass
class KKArguments:
    """The K&K training data."""

    people: str = field(default="3-7", metadata={"help": "people counts of the training puzzles: '3-7' or '3,5'"})
    train_limit: int | None = field(default=None, metadata={"help": "first N training puzzles per people count"})
    data_root: str | None = field(default=None, metadata={"help": "folder with train/*.jsonl (default: bundled)"})
    prompt_style: str = field(default="instruct", metadata={"help": "instruct, base, chat or chat_quiz"})


def main(argv: list[str] | None = None) -> None:
    parser = TrlParser((KKArguments, LoptiGRPOConfig, ModelConfig))
    data, args, model_args = parser.parse_args_and_config(argv)
    if model_args.model_name_or_path is None:
        parser.error("--model_name_or_path is required (a hub id, a local folder or 'lab')")
    model = str(data_dir() / "lab_model") if model_args.model_name_or_path == "lab" else model_args.model_name_or_path
    args.model_init_kwargs = {"dtype": model_args.dtype or "float32", "revision": model_args.model_revision}
    if model_args.attn_implementation is not None:
        args.model_init_kwargs["attn_implementation"] = model_args.attn_implementation

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left", revision=model_args.model_revision)
    puzzles = load_split("train", parse_people(data.people), data.data_root, data.train_limit)
    trainer = LoptiGRPOTrainer(
        model=model,
        reward_funcs=[kk_reward],
        args=args,
        train_dataset=kk_dataset(puzzles, data.prompt_style, tokenizer),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    if trainer.accelerator.is_main_process:
        method = "GRPO" + "+AR" * (args.ar_alpha is not None) + "+Lopti" * (args.lopti_eta is not None)
        state = trainer.accelerator.state
        print(
            f"train_kk: {method} on {state.num_processes} process(es) ({state.distributed_type.value}, backend "
            f"{state.backend}), {len(puzzles)} puzzles, "
            f"{args.optimizer_steps_per_generation} optimizer steps per RL step, max_steps {args.max_steps}",
            flush=True,
        )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
