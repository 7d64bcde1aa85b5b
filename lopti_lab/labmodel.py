"""The lab model: a tiny Qwen2-architecture K&K reasoner that runs the whole experiment on a laptop CPU.

Three parts, all reproducible from ``lopti-lab pretrain``:

1. A byte-level BPE tokenizer trained on K&K text (quizzes, prompts, chains of thought, answers) with Qwen's chat
   special tokens and a Qwen-style chat template. Byte-level means every string encodes and decodes back exactly
   (no unknown tokens); the reasoning tags <think>, </think>, <answer>, </answer> are single tokens that decode
   as text, so rewards see them.
2. A Qwen2ForCausalLM of a few million parameters (``LAB_CONFIG``), loaded through ``transformers`` like any hub
   model, so rollouts, the trainer, LoRA and the probes run the same code as for Qwen2.5.
3. ``pretrain``: a supervised warm start on solver traces (the compact chain of thought, then the answer) for
   2-5 people, leaving room for RL on the harder puzzles.

The lab model reads the quiz through its chat template without the long Logic-RL system prompt (prompt style
``"chat_quiz"``), which keeps sequences short enough to train on two CPU cores. Its evaluations (test accuracy,
the rollouts' token profile, the audit of greedy traces) are in ``lopti_lab.labeval``, also reachable from here.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from lopti_lab.checks import FieldCheck, is_int, is_real
from lopti_lab.kk import NAMES, Puzzle, build_prompt, generate_puzzle, instruct_prompt
from lopti_lab.kk.data import load_split, puzzle_seed, split_files
from lopti_lab.kk.reward import bare_quiz, numbered_quiz
from lopti_lab.labeval import (  # noqa: F401  (re-exported: labmodel.audit_greedy etc. stay where they were)
    LAB_PROMPT_STYLE,
    audit_greedy,
    evaluate_warm_start,
    lab_prompt_style,
    rollout_profile,
)
from lopti_lab.labtrace import TraceStyle, lab_trace

# ---------------------------------------------------------------------------------------------------------------------
# tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 1024
AUTOCAST = ("bfloat16", "float32")
"""``PretrainConfig.autocast`` choices."""
RL_TRACE = TraceStyle(
    slip=0.05,
    random_check_order=False,
    shuffle_transcription=False,
    swap_symmetric=False,
    passes=("ok", "fine", "good"),
    fails=("no", "fails", "wrong"),
    leaf_roles=("is", "really", "actually", "truly", "indeed"),
    check_openers=("see", "check", "ask", "hear", "test"),
    coded=True,
    numbered_quiz=True,
    bare_quiz=True,
    numbers_only=True,
    number_first=True,
)
"""The bundled lab model's trace (benchmarks/README.md, "Toward an RL-ready lab model", says why each option is on):
every look-up by place or by a fixed word, never by matching a name; 5% slips, the errors RL is there to remove;
free words (verbs, connectives, verdicts, leaf words, check openers) for the paper's share of low-probability
tokens."""


def lab_response(puzzle: Puzzle, rng: random.Random | None = None, style: TraceStyle | None = None) -> str:
    """The supervised target after the prompt's "<think>": a solver trace, then the answer.

    ``style=None``: the compact solver trace the bundled lab model learned (``Puzzle.compact_trace``). A
    ``labtrace.TraceStyle``: labtrace's trace in that style; without ``rng`` its wording and check order are drawn
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
    thought, the traces of ``style`` (``lab_response``; labtrace's only up to 5 people, where they stay short) and
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
    """Train the lab tokenizer (a few seconds) and wrap it as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(n_puzzles, seed, style), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=2048,
    )
    fast.add_tokens(list(TAG_TOKENS))  # plain added tokens: atomic, and kept by decode(skip_special_tokens=True)
    return fast


# ---------------------------------------------------------------------------------------------------------------------
# model


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


# ---------------------------------------------------------------------------------------------------------------------
# supervised warm start


@dataclass
class PretrainConfig:
    """Supervised warm start of the lab model on solver traces. Defaults are the bundled model's."""

    people: tuple[int, ...] = (2, 3)
    """People counts of the training puzzles (one count per batch, drawn with ``people_weights``)."""
    people_weights: tuple[float, ...] = (1.0, 2.0)
    curriculum_steps: int = 400
    """For the first steps, only the two smallest people counts: short sequences, where the model first learns to
    find and copy names from the quiz (until it can, the loss sits on a plateau near 0.9 nats per token)."""
    steps: int = 3800
    """Optimizer steps (the run also stops at ``max_minutes``)."""
    max_minutes: float = 57.0
    batch_size: int = 16
    lr: float = 1e-3
    """Peak AdamW learning rate (2e-3 kept the model on the plateau for 600 steps in our runs)."""
    warmup_steps: int = 40
    min_lr_ratio: float = 0.1
    """Cosine decay from lr to lr * min_lr_ratio over ``steps``."""
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 1900
    eval_size: int = 40
    """Test puzzles per people count for the greedy accuracy logged during training."""
    final_people: tuple[int, ...] = (2, 3)
    """People counts of the final evaluation (the whole test split of each; saved in lab_model.json)."""
    final_samples: int = 4
    """Completions per test puzzle at temperature 1.0 in the final evaluation (besides greedy)."""
    final_size: int | None = None
    """Test puzzles per people count in the final evaluation (None: all 100)."""
    spec: LabModelSpec = field(default_factory=LabModelSpec)
    trace: TraceStyle | None = RL_TRACE
    """The supervised traces: a ``labtrace.TraceStyle`` (or a dict of its fields), labtrace's local-decision trace
    with that wording, check order and slip rate (``RL_TRACE``, the bundled model's); None, the compact solver trace
    (the first lab model's)."""
    length_buckets: int = 4
    """Batches of one people count drawn at once and cut by length (labtrace's traces vary about twofold in length:
    4 keeps padding small); 1 keeps each batch in the order drawn, as the first lab model was trained."""
    max_new_tokens: int = 640
    """Response cap of the evaluations (``RL_TRACE`` runs to ~450 tokens at 3 people; compact traces fit 256 up to 6
    people)."""
    stop_after: int | None = None
    """Stop after this many steps with the schedule still set by ``steps`` (None: run them all): what reproduces a
    run that ``max_minutes`` stopped early, as the bundled model was (README, "The lab model")."""
    threads: int | None = None
    """torch threads (None: torch's default)."""
    autocast: str = "bfloat16"
    """Precision of the training forward and backward: "bfloat16" (torch.autocast: matmuls in bf16, weights, loss
    and optimizer in float32; 2.2x faster steps on a CPU with AVX512-BF16, measured in benchmarks/README.md) or
    "float32" (how models recorded before this field were trained). Evaluations always run in float32."""

    def __post_init__(self):
        if isinstance(self.spec, dict):
            try:
                self.spec = LabModelSpec(**self.spec)
            except TypeError as err:
                raise ValueError(f"PretrainConfig.spec: {err}") from None
        if isinstance(self.trace, dict):
            try:
                self.trace = TraceStyle(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.trace.items()})
            except (TypeError, ValueError) as err:
                raise ValueError(f"PretrainConfig.trace: {err}") from None
        for name in ("people", "people_weights", "final_people"):
            if isinstance(getattr(self, name), list):  # JSON gives lists
                setattr(self, name, tuple(getattr(self, name)))
        check = FieldCheck(self)  # every field by name, before any model is built (docs/bad_inputs.md)
        for name in ("people", "final_people"):
            check.items(name, lambda n: is_int(n) and n >= 2, "people counts >= 2", distinct=True)
        check.items("people_weights", lambda w: is_real(w) and w >= 0, "weights >= 0")
        check.need(
            len(self.people_weights) == len(self.people), "people_weights", "must give one weight per people count"
        )
        check.need(sum(self.people_weights) > 0, "people_weights", "must not all be 0")
        for name in ("steps", "batch_size", "eval_every", "eval_size", "final_samples", "max_new_tokens",
                     "length_buckets"):  # fmt: skip
            check.integer(name, low=1)
        for name in ("curriculum_steps", "warmup_steps", "seed"):
            check.integer(name, low=0)
        check.integer("final_size", low=1, optional=True)
        check.integer("threads", low=1, optional=True)
        check.integer("stop_after", low=1, optional=True)
        check.choice("autocast", AUTOCAST)
        check.real("max_minutes", low=0, low_open=True)
        check.real("lr", low=0, low_open=True)
        check.real("min_lr_ratio", 0.0, 1.0)
        check.real("weight_decay", low=0)
        check.real("grad_clip", low=0, low_open=True)
        trace_ok = self.trace is None or isinstance(self.trace, TraceStyle)
        check.need(trace_ok, "trace", "must be None, a labtrace.TraceStyle or a dict of its fields")
        check.need(isinstance(self.spec, LabModelSpec), "spec", "must be a LabModelSpec or a dict of its fields")
        spec = FieldCheck(self.spec, "PretrainConfig.spec")
        for f in fields(self.spec):
            spec.integer(f.name, low=1)
        heads, kv = self.spec.num_attention_heads, self.spec.num_key_value_heads
        head = self.spec.hidden_size / heads  # rotary embeddings rotate pairs of each head's dimensions
        spec.need(head == int(head) and head % 2 == 0, "num_attention_heads", "must divide hidden_size into even heads")
        spec.need(heads % kv == 0, "num_key_value_heads", "must divide num_attention_heads")
        for name in ("people", "final_people"):  # the test split: held out of training, and evaluated on
            try:
                split_files("test", getattr(self, name))
            except FileNotFoundError as err:
                raise ValueError(f"PretrainConfig.{name}: {err}") from None


def encode_example(
    tokenizer, puzzle: Puzzle, rng: random.Random | None = None, style: TraceStyle | None = None
) -> tuple[list[int], int]:
    """Token ids of prompt + target response + <|im_end|>, and the prompt length (the loss starts after it)."""
    prompt = tokenizer(build_prompt(puzzle, lab_prompt_style(style), tokenizer), add_special_tokens=False)["input_ids"]
    response = tokenizer(lab_response(puzzle, rng, style), add_special_tokens=False)["input_ids"]
    return prompt + response + [tokenizer.eos_token_id], len(prompt)


def collate(examples: Sequence[tuple[list[int], int]], pad_id: int):
    """Right-padded (input_ids, attention_mask, labels) with labels -100 on prompt and padding."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (N, L)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)  # (N, L)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)  # (N, L)
    for row, (ids, n_prompt) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask, labels


def held_out_statements(people: Iterable[int]) -> set:
    """Statement sets of the bundled test split: the warm start never trains on them."""
    return {p.statements for p in load_split("test", list(people))}


def lr_at(step: int, config: PretrainConfig) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class TraceStream:
    """Warm-start examples: fresh generated puzzles (never a test-split statement set), one people count per batch,
    ``config.length_buckets`` batches of it drawn at once and cut by length, so padding stays small. Deterministic in
    the seed and the order of calls."""

    def __init__(self, tokenizer, config: PretrainConfig):
        self.tokenizer, self.config = tokenizer, config
        self.held_out = held_out_statements(config.people)
        self.rng = random.Random(config.seed)
        self.counter = 0
        self.pending: list[tuple[int, list]] = []

    def _examples(self, n: int, count: int) -> list[tuple[list[int], int]]:
        cfg, examples = self.config, []
        while len(examples) < count:
            p = generate_puzzle(n, puzzle_seed(cfg.seed, "pretrain", n, self.counter))
            self.counter += 1
            if p.statements not in self.held_out:
                rng = None if cfg.trace is None else random.Random(puzzle_seed(cfg.seed, "trace", n, self.counter))
                examples.append(encode_example(self.tokenizer, p, rng, cfg.trace))
        return examples

    def batch(self, step: int = 0):
        cfg = self.config
        if not self.pending:
            early = step < cfg.curriculum_steps
            people = sorted(cfg.people)[:2] if early else cfg.people
            weights = [cfg.people_weights[cfg.people.index(n)] for n in people]
            n = self.rng.choices(people, weights)[0]
            pool = self._examples(n, cfg.batch_size * cfg.length_buckets)
            if cfg.length_buckets > 1:
                pool.sort(key=lambda e: len(e[0]))
            batches = [pool[i : i + cfg.batch_size] for i in range(0, len(pool), cfg.batch_size)]
            self.rng.shuffle(batches)
            self.pending = [(n, b) for b in batches]
        n, examples = self.pending.pop()
        return n, collate(examples, self.tokenizer.pad_token_id)


def pretrain(config: PretrainConfig, out: str | Path, progress: bool = True) -> dict:
    """Train the lab model from scratch on compact solver traces and save it (tokenizer, config, safetensors weights,
    and ``lab_model.json`` with the config, the loss curve, test accuracy and wall time) to ``out``.

    Stops after ``config.steps`` optimizer steps or ``config.max_minutes``, whichever comes first.
    """
    import torch
    from tqdm.auto import tqdm

    from lopti_lab.trainer import evaluate

    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    start = time.perf_counter()
    tokenizer = build_tokenizer(seed=config.seed, style=config.trace)
    model = build_model(tokenizer, config.spec, seed=config.seed)
    model.train()
    stream = TraceStream(tokenizer, config)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    test = [p for n in config.people for p in load_split("test", n, limit=config.eval_size)]
    log: list[dict] = []
    bar = tqdm(total=config.steps, desc="lab model warm start", disable=not progress)
    step = 0
    last = config.steps if config.stop_after is None else min(config.steps, config.stop_after)
    while step < last and time.perf_counter() - start < 60 * config.max_minutes:
        n, (input_ids, attention_mask, labels) = stream.batch(step)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast == "bfloat16"):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        record = {
            "step": step,
            "people": n,
            "loss": loss.item(),
            "grad_norm": grad_norm.item(),
            "lr": lr_at(step - 1, config),
            "minutes": (time.perf_counter() - start) / 60,
        }
        if step % config.eval_every == 0:
            record.update(
                evaluate(
                    model,
                    tokenizer,
                    test,
                    prompt_style=lab_prompt_style(config.trace),
                    max_new_tokens=config.max_new_tokens,
                    modes=("greedy",),
                    prefix="test",
                )
            )
            model.train()
        log.append(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", ppl=n)
        bar.update(1)
    bar.close()
    model.eval()
    final = evaluate_warm_start(
        model,
        tokenizer,
        config.final_people,
        config.final_samples,
        config.final_size,
        config.max_new_tokens,
        prompt_style=lab_prompt_style(config.trace),
    )
    summary = {
        "config": asdict(config),
        "steps_done": step,
        "minutes": (time.perf_counter() - start) / 60,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_eval": final,
        "log": log,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    save_lab_model(model, tokenizer, out, summary)
    return summary


def save_lab_model(model, tokenizer, out: str | Path, summary: dict) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "lab_model.json").write_text(json.dumps(summary, indent=1) + "\n")
    return out


def lab_model_dir() -> Path:
    from lopti_lab.paths import data_dir

    return data_dir() / "lab_model"


def prompt_style_of(model: str) -> str:
    """The prompt style a lab model reads: "lab" (the bundled one) or a lab model folder, from the trace style in
    its lab_model.json (``lab_prompt_style``); any other model, or a folder without one, reads ``LAB_PROMPT_STYLE``."""
    folder = lab_model_dir() if model == "lab" else Path(model)
    summary = folder / "lab_model.json"
    if not summary.is_file():
        return LAB_PROMPT_STYLE
    trace = json.loads(summary.read_text()).get("config", {}).get("trace")
    return lab_prompt_style(PretrainConfig(trace=trace).trace)  # the JSON dict, read as the pretrain reads it


def load_lab_model(path: str | Path | None = None, device: str = "cpu", dtype=None):
    """The bundled lab model and its tokenizer, offline (local files only)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = Path(path) if path is not None else lab_model_dir()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"lab model not found at {path}: build it with `lopti-lab pretrain --out {path}`")
    # Not AutoTokenizer: for a qwen2 config it builds Qwen2Tokenizer, whose own pre-tokenizer (digits split one by
    # one) replaces ours and silently changes the token ids the model was trained on ("Ġ2" -> "Ġ", "2").
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or torch.float32)
    return model.to(device), tokenizer


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("pretrain", help="train the lab model's warm start from scratch (CPU, <= 60 min)")
    defaults = PretrainConfig()
    p.add_argument("--out", default="data/lab_model", help="output folder (default data/lab_model)")
    p.add_argument(
        "--config",
        default=None,
        help="a JSON file of PretrainConfig fields, or a lab_model.json (its recorded config): the flags below "
        "override it",
    )
    p.add_argument("--steps", type=int, default=None, help=f"default {defaults.steps}")
    p.add_argument("--stop-after", type=int, default=None, help="stop after N steps, the schedule still over --steps")
    p.add_argument("--max-minutes", type=float, default=None, help=f"default {defaults.max_minutes}")
    p.add_argument("--batch-size", type=int, default=None, help=f"default {defaults.batch_size}")
    p.add_argument("--lr", type=float, default=None, help=f"default {defaults.lr}")
    p.add_argument("--seed", type=int, default=None, help=f"default {defaults.seed}")
    p.add_argument("--eval-every", type=int, default=None, help=f"default {defaults.eval_every}")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.set_defaults(func=_cli_pretrain)


FIELDS_BEFORE_RECORDED = {"trace": None, "length_buckets": 1, "max_new_tokens": 256, "autocast": "float32"}
"""How a lab model recorded before a PretrainConfig field existed was trained: what `lopti-lab pretrain --config
<its lab_model.json>` takes for a field the record lacks (the first lab model's record has none of these)."""


def config_fields(path: str | Path) -> dict:
    """PretrainConfig fields from a JSON file: an object of fields, or a lab_model.json (its recorded ``config``;
    a field the record lacks takes the value it had before the field existed, ``FIELDS_BEFORE_RECORDED``; a run
    that ``max_minutes`` stopped early is stopped at the same step, ``stop_after``). Raises ValueError naming the
    file."""
    try:
        loaded = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--config {path}: {err}") from None
    fields_given = loaded.get("config", loaded) if isinstance(loaded, dict) else loaded
    if not isinstance(fields_given, dict):
        raise ValueError(f"--config {path}: expected a JSON object of PretrainConfig fields")
    if "config" in loaded:  # a recorded config: a field it lacks came later
        fields_given = {**FIELDS_BEFORE_RECORDED, **fields_given}
        done = loaded.get("steps_done")
        if fields_given.get("stop_after") is None and isinstance(done, int) and done < fields_given.get("steps", done):
            fields_given["stop_after"] = done  # the clock stopped it: stop at the same step, on the same schedule
    return fields_given


def _cli_pretrain(args) -> int:
    try:
        fields_given = {} if args.config is None else config_fields(args.config)
    except ValueError as err:
        raise SystemExit(f"lopti-lab pretrain: {err}") from None
    names = ("steps", "stop_after", "max_minutes", "batch_size", "lr", "seed", "eval_every", "threads")
    fields_given |= {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        config = PretrainConfig(**fields_given)
    except TypeError as err:  # an unknown field
        raise SystemExit(f"lopti-lab pretrain: --config {args.config}: {err}") from None
    except ValueError as err:
        raise SystemExit(f"lopti-lab pretrain: {err}") from None
    summary = pretrain(config, args.out)
    final = summary["final_eval"]
    accs = "; ".join(
        f"{mode} " + ", ".join(f"{n} people {final[f'test/{mode}/acc_{n}ppl']:.0%}" for n in config.final_people)
        for mode in ("greedy", "sample")
    )
    print(f"saved {args.out} after {summary['steps_done']} steps in {summary['minutes']:.1f} min; test: {accs}")
    return 0
