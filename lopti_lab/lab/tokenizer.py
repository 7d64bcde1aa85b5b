"""The lab model's tokenizer: byte-level BPE learned on K&K text, in the same ``Qwen2Tokenizer`` a Qwen2.5 model
ships with, and the supervised text it is learned from.

Byte-level means every string encodes and decodes back exactly (no unknown tokens); Qwen's chat special tokens and a
Qwen-style chat template let the lab model read prompts the way Qwen2.5-Instruct does; the reasoning tags <think>,
</think>, <answer>, </answer> are single tokens that decode as text, so rewards see them.
"""

from __future__ import annotations

import json
import random

from lopti_lab.kk import NAMES, Puzzle, generate_puzzle, instruct_prompt
from lopti_lab.kk.data import puzzle_seed
from lopti_lab.kk.reward import bare_quiz, numbered_quiz
from lopti_lab.lab.trace import TraceStyle, lab_trace

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TAG_TOKENS", "build_tokenizer", "lab_response", "tokenizer_corpus"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 1024
MAX_LENGTH = 1024
"""The longest sequence a lab model reads (its ``max_position_embeddings``): the tokenizer's ``model_max_length``."""


def lab_response(puzzle: Puzzle, rng: random.Random | None = None, style: TraceStyle | None = None) -> str:
    """The supervised target after the prompt's "<think>": a solver trace, then the answer.

    ``style=None``: the compact solver trace the bundled lab model learned (``Puzzle.compact_trace``). A
    ``lab.trace.TraceStyle``: the lab trace in that style; without ``rng`` its wording and check order are drawn
    from a generator seeded by the puzzle itself, so the same puzzle always gives the same text.

    >>> p = generate_puzzle(2, 0)
    >>> lab_response(p).endswith("</think><answer>" + p.solution_text_format + "</answer>")
    True
    """
    if style is None:
        return f" {puzzle.compact_trace()}</think><answer>{puzzle.solution_text_format}</answer>"
    rng = rng if rng is not None else random.Random(repr((puzzle.statements, puzzle.names)))
    return lab_trace(puzzle, rng, style)


def tokenizer_corpus(n_puzzles: int = 3000, seed: int = 0, style: TraceStyle | None = None) -> list[str]:
    """Text the BPE merges are learned from: generated quizzes for 2-8 people in every prompt style, their chains of
    thought, the traces of ``style`` (``lab_response``; lab traces only up to 5 people, where they stay short) and
    answers, and every name in every position."""
    texts = []
    for i in range(n_puzzles):
        p = generate_puzzle(2 + i % 7, puzzle_seed(seed, "tokenizer", 2 + i % 7, i))
        trace = lab_response(p, random.Random(i), style) if style is None or p.n_people <= 5 else ""
        texts += [instruct_prompt(p), p.quiz, trace, " ".join(p.cot_repeat_steps), p.solution_text]
        first = style is not None and style.number_first
        texts += [numbered_quiz(p, first)] if style is not None and style.numbered_quiz else []
        texts += [bare_quiz(numbered_quiz(p, first))] if style is not None and style.bare_quiz else []
    texts += [f'"{n} is a knight," {n} said. {n}\'s {n}' for n in NAMES]
    return texts


def build_tokenizer(
    vocab_size: int = TOKENIZER_VOCAB, n_puzzles: int = 3000, seed: int = 0, style: TraceStyle | None = None
):
    """Train the lab tokenizer (a few seconds): byte-level BPE merges learned on K&K text, in a ``Qwen2Tokenizer``.

    The merges are learned behind the very normalizer and pre-tokenizer that transformers' ``Qwen2Tokenizer`` builds
    (NFC; Qwen's split, which puts every digit in a token of its own: " 12" -> "Ġ", "1", "2"), taken from an empty
    Qwen2Tokenizer rather than re-typed. So ``AutoTokenizer.from_pretrained`` on a saved lab model, which gives a
    qwen2 config a Qwen2Tokenizer whatever tokenizer.json says, encodes exactly as the model was trained.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    qwen2 = Qwen2Tokenizer().backend_tokenizer  # transformers' Qwen2 pipeline (an empty vocabulary)
    tok = Tokenizer(models.BPE())
    tok.normalizer, tok.pre_tokenizer = qwen2.normalizer, qwen2.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(n_puzzles, seed, style), trainer=trainer)
    bpe = json.loads(tok.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=bpe["vocab"],
        merges=[tuple(pair) for pair in bpe["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=MAX_LENGTH,
    )
    tokenizer.add_tokens(list(TAG_TOKENS))  # plain added tokens: atomic, and kept by decode(skip_special_tokens=True)
    return tokenizer
