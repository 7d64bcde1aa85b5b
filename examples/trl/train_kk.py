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
``--config`` YAML file sets their defaults. ``--model_name_or_path lab`` trains the bundled lab model (a standard
checkpoint: the tokenizer comes from ``AutoTokenizer``, and the prompt style from its config.json).

Precision follows the device unless named: ``--bf16`` on a GPU of compute capability >= 8.0, ``--fp16`` (with its
loss scaler) below it (a T4), neither on a CPU (``models.resolve_dtype("auto")``); without ``--dtype`` a LoRA base
loads in that precision and a fully fine-tuned model in float32, its master weights (``model_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config

from lopti_lab.integrations.trl import LoptiGRPOConfig, LoptiGRPOTrainer, kk_dataset, kk_reward
from lopti_lab.kk import PROMPT_STYLES, load_split
from lopti_lab.kk.data import parse_people
from lopti_lab.models import PROMPT_STYLE_KEY, model_path, prompt_style_of, resolve_device, resolve_dtype


@dataclass
class KKArguments:
    """The K&K training data."""

    people: str = field(default="3-7", metadata={"help": "people counts of the training puzzles: '3-7' or '3,5'"})
    train_limit: int | None = field(default=None, metadata={"help": "first N training puzzles per people count"})
    data_root: str | None = field(default=None, metadata={"help": "folder with train/*.jsonl (default: bundled)"})
    prompt_style: str | None = field(
        default=None,
        metadata={
            "help": "the prompt format (lopti_lab.kk.PROMPT_STYLES); default: the one the model's config.json names "
            "(a lab model's), else instruct (Qwen's Logic-RL prompt)"
        },
    )


def precision_defaults() -> dict:
    """The parser's defaults for this machine: the mixed-precision flag its device computes in natively (TRL's own
    default, bf16, is refused by a T4) and no ``dtype`` (then ``model_dtype`` picks it); a recipe or an option
    overrides them."""
    native = resolve_dtype("auto", resolve_device("auto"))
    return {"bf16": native == torch.bfloat16, "fp16": native == torch.float16, "dtype": None}


def model_dtype(args: LoptiGRPOConfig, model_args: ModelConfig) -> str:
    """``--dtype`` when given, else: beneath LoRA the frozen base in the precision the flags train in (bfloat16
    under bf16, float16 under fp16); full fine-tuning in float32, the master weights (a half-precision weight
    swallows updates of lr ~1e-6, and the fp16 loss scaler cannot unscale float16 gradients), autocast computing in
    the flags' precision; float32 with neither flag."""
    if model_args.dtype is not None:
        return model_args.dtype
    if not model_args.use_peft:
        return "float32"
    return "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"


def kk_inputs(parser: TrlParser, data: KKArguments, args, model_args: ModelConfig) -> tuple[dict, list, str]:
    """A GRPO trainer's keyword arguments on K&K (the model, its tokenizer, the dataset in the prompt style the model
    was trained on, the reward, LoRA), the training puzzles and the style; a bad setting is a usage error."""
    if model_args.model_name_or_path is None:
        parser.error("--model_name_or_path is required (a hub id, a local folder or 'lab')")
    model = model_path(model_args.model_name_or_path)  # "lab": the bundled lab model's folder
    own = prompt_style_of(model_args.model_name_or_path)  # the prompt a lab model was trained on; None: not named
    style = data.prompt_style or own or "instruct"
    if style not in PROMPT_STYLES:
        parser.error(f"--prompt_style must be one of {PROMPT_STYLES}, got {style!r}")
    if own is not None and style != own:
        parser.error(f"--prompt_style {style!r}: {model} was trained on {own!r} (its config.json's "
                     f"{PROMPT_STYLE_KEY}); leave --prompt_style unset to use it")  # fmt: skip
    args.model_init_kwargs = {"dtype": model_dtype(args, model_args), "revision": model_args.model_revision}
    if model_args.attn_implementation is not None:
        args.model_init_kwargs["attn_implementation"] = model_args.attn_implementation

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left", revision=model_args.model_revision)
    puzzles = load_split("train", parse_people(data.people), data.data_root, data.train_limit)
    inputs = dict(
        model=model,
        reward_funcs=[kk_reward],
        args=args,
        train_dataset=kk_dataset(puzzles, style, tokenizer),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    return inputs, puzzles, style


def main(argv: list[str] | None = None) -> None:
    parser = TrlParser((KKArguments, LoptiGRPOConfig, ModelConfig))
    parser.set_defaults(**precision_defaults())
    data, args, model_args = parser.parse_args_and_config(argv)
    inputs, puzzles, style = kk_inputs(parser, data, args, model_args)
    trainer = LoptiGRPOTrainer(**inputs)
    if trainer.accelerator.is_main_process:
        method = "GRPO" + "+AR" * (args.ar_alpha is not None) + "+Lopti" * (args.lopti_eta is not None)
        state = trainer.accelerator.state
        print(
            f"train_kk: {method} on {state.num_processes} process(es) ({state.distributed_type.value}, backend "
            f"{state.backend}), {len(puzzles)} puzzles, prompt style {style}, "
            f"{args.optimizer_steps_per_generation} optimizer steps per RL step, max_steps {args.max_steps}",
            flush=True,
        )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
