"""Tiny, random-weight Qwen2 models and a locally built tokenizer for tests (nothing is downloaded)."""

from __future__ import annotations

import zlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from lopti_lab.kk import Reward

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]

_CORPUS = [
    "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves "
    "always lie. You meet 3 inhabitants: Zoey, Oliver, and Emma.",
    'Zoey said that Oliver is a knight. Oliver stated, "Emma is a knave if and only if Zoey is a knight".',
    "If Emma is a knave then Oliver is a knight. So who is a knight and who is a knave?",
    "(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Emma is a knight",
    "You are a helpful assistant. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer.",
]


def tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE with Qwen's chat specials and template: every string encodes, decode(encode(s)) == s."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )
    fast.add_tokens(TAGS)
    return fast


def fake_score(text: str, puzzle) -> Reward:
    """A stand-in for the K&K reward in trainer tests: a tiny random model never solves a puzzle, so a hash of the
    text gives each group a spread of rewards (3 or -0.5) and therefore non-zero advantages."""
    total = 3.0 if zlib.crc32(text.encode()) % 3 == 0 else -0.5
    return Reward(total, 1.0, total - 1.0)


def tiny_qwen2(vocab_size: int, hidden: int = 32, layers: int = 2, seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A random-weight Qwen2ForCausalLM small enough for exact float64 gradient checks."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        max_position_embeddings=512,
        **{"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True, **overrides},
    )
    model = Qwen2ForCausalLM(config)
    model.eval()
    return model


_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps",
               "max_position_embeddings")  # fmt: skip


def spread_reward(completions, **kwargs) -> list[float]:
    """A TRL reward of 0, 1 or 2 from a hash of each text: a spread of rewards in every group."""
    return [float(zlib.crc32(c.encode()) % 3) for c in completions]


def peaky_qwen2_folder(path, **overrides) -> str:
    """A tiny random Qwen2 whose sampled tokens have probabilities spread over (0, 1) (large initial weights), saved
    with a left-padding tokenizer as a local model folder; ``overrides`` go to its config."""
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    tiny_qwen2(len(tok), initializer_range=1.0, **overrides).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def shaped_qwen2(config: dict, dtype=torch.float32, device="cpu", lora: bool = True, checkpointing: bool = True,
                 **overrides):  # fmt: skip
    """A random-weight Qwen2 with a real model's shapes (a config.json dict, e.g. ``plan.model_config(hub_id)``;
    ``overrides`` such as num_hidden_layers=4), on ``device`` in ``dtype``, with non-reentrant activation
    checkpointing and a LoRA r 16 adapter on the seven projections, as ``models.load_policy`` sets them up."""
    from peft import LoraConfig, get_peft_model

    from lopti_lab.models import DEFAULT_LORA_TARGETS

    torch.manual_seed(0)
    shape = {k: v for k, v in {**config, **overrides}.items() if k in _SHAPE_KEYS}
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa")).to(dtype)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        targets = list(DEFAULT_LORA_TARGETS)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, task_type="CAUSAL_LM"))
    return model


def frozen_test_batch(model, tokenizer, max_new_tokens: int, wins=(0,), losses=(1,)):
    """A FrozenBatch of 2 three-person training puzzles x 4 rollouts (torch seed 0) with a fixed spread of rewards
    (a random model never solves a puzzle): 3 or -1 by each text's checksum, rows ``wins`` set to 3 and ``losses`` to
    -1 so that the groups hold both signs of advantage."""
    from lopti_lab.counterfactual import FrozenBatch
    from lopti_lab.kk import build_prompt, load_split
    from lopti_lab.objective import group_advantages
    from lopti_lab.rollout import sample

    puzzles = load_split("train", 3, limit=2)
    torch.manual_seed(0)
    rollout = sample(model, tokenizer, [build_prompt(p, "base") for p in puzzles], 4, max_new_tokens=max_new_tokens)
    rewards = torch.tensor([3.0 if zlib.crc32(t.encode()) % 2 else -1.0 for t in rollout.texts])
    rewards[list(wins)], rewards[list(losses)] = 3.0, -1.0
    return FrozenBatch(puzzles, rollout, rewards, group_advantages(rewards, 4), 1.0)


def lora_update_rollout(model_dir, dtype: str = "float32", temperature: float = 0.7):
    """A LoRA policy (r 4) in ``dtype`` from ``model_dir`` and a frozen 8-row rollout, 2 prompts x 4 of random tokens
    (6 prompt, 10 response), with pi_old from the policy at ``temperature``: an update's inputs without a decode."""
    from lopti_lab.models import LoraSpec, load_policy
    from lopti_lab.rollout import Rollout, response_logprobs

    torch.manual_seed(0)
    model, _ = load_policy(str(model_dir), LoraSpec(r=4), dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=gen).repeat_interleave(4, 0)  # (B, P)
    response_ids = torch.randint(0, model.config.vocab_size, (8, 10), generator=gen)  # (B, T)
    response_mask = torch.ones(8, 10)
    rollout = Rollout(prompt_ids, torch.ones_like(prompt_ids), response_ids, response_mask, [""] * 8, 4,
                      torch.ones(8, dtype=torch.bool))  # fmt: skip
    with torch.no_grad():
        rollout.old_logp, _ = response_logprobs(
            model, rollout.input_ids, rollout.attention_mask, response_mask, temperature
        )
    return model, rollout
