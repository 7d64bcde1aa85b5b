"""The lab model: a Qwen2ForCausalLM of a few million parameters, saved as a standard Hugging Face checkpoint.

A folder written by ``save_lab_model`` (``lopti-lab pretrain --out``, and the bundled ``data/lab_model``) is all a
user needs: ``AutoTokenizer`` and ``AutoModelForCausalLM.from_pretrained`` on it give exactly the tokenizer and model
lopti_lab trains and evaluates (``models.load_policy`` calls them and nothing else), the chat template applies through
``tokenizer.apply_chat_template``, ``generate`` stops at the model's own end token (<|im_end|>), and its config names
the prompt style the model reads (``models.PROMPT_STYLE_KEY``). The folder's README.md is its model card.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lopti_lab.models import PROMPT_STYLE_KEY

__all__ = ["LabModelSpec", "build_model", "model_card", "save_lab_model", "start_from"]

SUMMARY = "lab_model.json"
"""In a lab model folder: the pretraining's record (its config, loss curve, evaluations, wall time)."""


@dataclass(frozen=True)
class LabModelSpec:
    """The lab model's shape (a Qwen2 config) and its warm start. Defaults are the bundled model's."""

    hidden_size: int = 256
    """Width of the residual stream."""
    intermediate_size: int = 640
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024

    def qwen2_config(self, tokenizer):
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


def build_model(tokenizer, spec: LabModelSpec = LabModelSpec(), seed: int = 0):
    """A freshly initialised lab model (random weights, seeded)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(spec.qwen2_config(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def start_from(folder: str | Path, tokenizer, spec: LabModelSpec = LabModelSpec()):
    """A lab model started from the weights of the lab model in ``folder``, for ``tokenizer``'s vocabulary: every
    weight but the embedding is copied; each token's embedding row (tied with the output layer) is the folder's row
    of the same token string (read from its tokenizer.json, whatever class a loader would make of it), and a token
    the folder lacks starts at the mean of its rows. With the same vocabulary, the folder's model itself.

    Returns (model, mapped): ``mapped`` the share of ``tokenizer``'s tokens found in the folder's vocabulary."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    old = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    old_vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)
    new_vocab = tokenizer.get_vocab()
    model = build_model(tokenizer, spec)

    def per_vocabulary(name: str) -> bool:  # the embedding and the output layer tied to it
        return "embed_tokens" in name or name == "lm_head.weight"

    state = {k: v for k, v in old.state_dict().items() if not per_vocabulary(k)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not all(per_vocabulary(k) for k in missing):
        raise ValueError(f"{folder}: not a lab model of this shape (missing {missing}, unexpected {unexpected})")
    old_rows = old.get_input_embeddings().weight.detach()
    rows = model.get_input_embeddings().weight
    found = 0
    with torch.no_grad():
        rows.copy_(old_rows.mean(0).expand_as(rows))
        for token, i in new_vocab.items():
            j = old_vocab.get(token)
            if j is not None and j < len(old_rows) and i < len(rows):
                rows[i] = old_rows[j]
                found += 1
    model.tie_weights()
    return model, found / len(new_vocab)


def save_lab_model(model, tokenizer, out: str | Path, summary: dict, prompt_style: str) -> Path:
    """Write ``out`` as a standard checkpoint: config.json (naming ``prompt_style`` under ``PROMPT_STYLE_KEY``),
    generation_config.json, model.safetensors, the tokenizer files, the pretraining record ``lab_model.json`` and the
    model card README.md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    setattr(model.config, PROMPT_STYLE_KEY, prompt_style)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    (out / "README.md").write_text(model_card(summary, prompt_style))
    return out


def _what_it_learned(cfg: dict) -> str:
    """The card's sentence on what the traces taught: designed slips, and the hard lab model's misreading."""
    trace = cfg.get("trace") or {}
    text = f"a competent but not yet reliable reasoner, trained on traces with {100 * trace.get('slip', 0):.0f}%"
    misread = trace.get("compound_as_and", 0.0)
    if not misread:
        return text + " designed slips,\nso that sampled accuracy sits below greedy and GRPO has something to sharpen."
    return (
        f"{text} designed slips,\nin which every 'or', 'if ... then' and 'iff' claim whose value differs from the "
        f"'and' of its two sides\nis given that 'and' value {100 * misread:.0f}% of the time: a misreading that "
        "greedy decoding follows, and a skill\nleft for RL to learn (lopti_lab's docs/hard_lab.md)."
    )


def _precision(cfg: dict) -> str:
    """How the record says it was trained (records from before ``PretrainConfig.autocast`` trained in float32)."""
    return "bf16 autocast" if cfg.get("autocast", "float32") == "bfloat16" else "float32"


def model_card(summary: dict, prompt_style: str) -> str:
    """The folder's README.md, the Hugging Face convention: what the model is, how it was trained (the command that
    reproduces it), its evaluations, how to load it, its licence. Every number comes from ``summary``."""
    cfg, final = summary["config"], summary.get("final_eval", {})
    people = cfg["final_people"]
    rows = []
    for mode, label in (("greedy", "greedy"), ("sample", f"sampled at T = 1.0 ({cfg['final_samples']} per puzzle)")):
        cells = [f"{final.get(f'test/{mode}/acc_{n}ppl', float('nan')):.2f}" for n in people]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {final.get(f'test/{mode}/format_error_rate', 0):.3f} |")
    spec = cfg["spec"]
    counts = [str(n) for n in cfg["people"]]
    trained = counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + "- and " + counts[-1]
    threads = summary.get("threads", "?")
    if cfg.get("init_from"):
        share = summary.get("init_from_vocab_share") or 0
        start = (f"continued from the lab model in `{cfg['init_from']}` (its weights; each token's embedding carried "
                 f"over by token string, {share:.0%} of this vocabulary found there)")  # fmt: skip
        again = "(it needs that folder, as `init_from` names it)"
    else:
        start, again = "from random weights", ""
    return f"""---
license: mit
library_name: transformers
pipeline_tag: text-generation
tags:
- knights-and-knaves
- reinforcement-learning
- lopti-lab
---

# lopti_lab lab model

A {summary["parameters"] / 1e6:.1f}M-parameter Qwen2ForCausalLM ({spec["num_hidden_layers"]} layers, hidden size
{spec["hidden_size"]}, {summary.get("vocab_size", "?")} tokens, {spec["max_position_embeddings"]} positions) that solves
Knights-and-Knaves logic puzzles with a chain of thought. It is the lab model of lopti_lab, the toolkit that studies
low-probability tokens in RL for LLMs (Yang et al. 2025, arXiv 2505.12929: Advantage Reweighting and Low-Probability
Token Isolation on top of GRPO), so that its experiments run end to end on a laptop CPU:
{_what_it_learned(cfg)}

## How it was trained

Supervised warm start {start}, on solver traces of generated {trained}-person puzzles (none from the test
split), {summary["steps_done"]} AdamW steps of {cfg["batch_size"]} sequences, lr {cfg["lr"]:g} (cosine),
{_precision(cfg)}, {summary["minutes"]:.0f} minutes on {threads} CPU thread{"" if threads == 1 else "s"}
(torch {summary.get("torch", "?")}).
The tokenizer is byte-level BPE learned on K&K text, in transformers' own `Qwen2Tokenizer`. The full record
(config, loss curve, evaluations) is `lab_model.json`. To reproduce it {again}:

    lopti-lab pretrain --config lab_model.json --out lab_model_again

## Evaluation

Share of the bundled K&K test split ({cfg.get("final_size") or 100} puzzles per people count) answered exactly right
(Logic-RL reward 3):

| decoding | {" | ".join(f"{n} people" for n in people)} | format errors |
|---|{"---|" * len(people)}---|
{chr(10).join(rows)}

## How to load it

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("path/to/lab_model")
model = AutoModelForCausalLM.from_pretrained("path/to/lab_model")
print(model.config.{PROMPT_STYLE_KEY})  # "{prompt_style}": the prompt it was trained on
```

The prompt is lopti_lab's `kk.build_prompt(puzzle, "{prompt_style}", tokenizer)`: the quiz as the user message of the
chat template, then the assistant's turn opened with `<think>`; the model writes its trace, `</think><answer>`, the
answer and `</answer><|im_end|>`. In lopti_lab, `load_policy("path/to/lab_model")` loads it, and the bundled lab
models load by name (`load_policy("lab")`, `load_policy("lab-hard")`).

## Licence

MIT, as lopti_lab. The puzzles are generated with lopti_lab's own K&K generator; the test split follows the format of
the K&K dataset of Xie et al. (2024).
"""
