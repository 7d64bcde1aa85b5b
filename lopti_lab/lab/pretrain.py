"""The lab model's supervised warm start: ``lopti-lab pretrain`` trains a lab model from random weights (or from
another lab model's, ``init_from``) on solver traces (``lab.trace``) of generated puzzles, evaluates it on the test
split and saves it (``lab.model``).

    summary = pretrain(PretrainConfig(), "my_lab_model")  # the from-scratch recipe: 3,700 steps, ~76 min on 2 cores

docs/lab_model.md says how the bundled model was made (two ``init_from`` stages from the previous lab model).
"""

from __future__ import annotations

import math
import random
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from lopti_lab.checks import FieldCheck, is_int, is_real
from lopti_lab.configs import ConfigError, read_json
from lopti_lab.evaluate import evaluate
from lopti_lab.kk import Puzzle, build_prompt, generate_puzzle
from lopti_lab.kk.data import load_split, puzzle_seed, split_files
from lopti_lab.lab.evaluate import evaluate_warm_start
from lopti_lab.lab.model import LabModelSpec, build_model, save_lab_model, start_from
from lopti_lab.lab.tokenizer import build_tokenizer, lab_response
from lopti_lab.lab.trace import RL_TRACE, TraceStyle, prompt_style

__all__ = [
    "AUTOCAST",
    "PretrainConfig",
    "config_fields",
    "encode_example",
    "native_bf16",
    "pretrain",
    "training_precision",
]

AUTOCAST = ("auto", "bfloat16", "float32")
"""``PretrainConfig.autocast`` choices."""


def native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 matmul instructions (avx512_bf16 or amx_bf16 among the flags of ``cpuinfo``, Linux's
    list). Without them torch's CPU bf16 kernels are far slower than float32 (benchmarks/README.md has the timings).
    False where the file cannot be read (macOS, Windows)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", text) is not None


def training_precision(autocast: str, cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The precision ``PretrainConfig.autocast`` trains in on this machine: "auto" is "bfloat16" on a CPU with bf16
    instructions (``native_bf16``), else "float32"; the other choices are themselves."""
    if autocast != "auto":
        return autocast
    return "bfloat16" if native_bf16(cpuinfo) else "float32"


@dataclass
class PretrainConfig:
    """Supervised warm start of the lab model on solver traces. Defaults: the from-scratch recipe (the bundled model
    continued the previous lab model with ``init_from``; docs/lab_model.md has both runs)."""

    people: tuple[int, ...] = (2, 3)
    """People counts of the training puzzles (one count per batch, drawn with ``people_weights``)."""
    people_weights: tuple[float, ...] = (1.0, 2.0)
    curriculum_steps: int = 400
    """For the first steps, only the two smallest people counts: short sequences, where the model first learns to
    find and copy names from the quiz (until it can, the loss sits on a plateau near 0.9 nats per token)."""
    steps: int = 3700
    """Optimizer steps: the learning-rate schedule's length, and where the run stops (unless ``max_minutes`` or
    ``stop_after`` stops it first)."""
    max_minutes: float = 150.0
    """A wall-clock limit (3,700 steps from scratch took 76 minutes on two cores; a run stopped by the clock depends on
    the machine's speed, one stopped by ``steps`` does not)."""
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
    """The supervised traces: a ``lab.trace.TraceStyle`` (or a dict of its fields), the local-decision trace
    with that wording, check order and slip rate (``RL_TRACE``, the bundled model's); None, the compact solver trace
    (the first lab model's)."""
    length_buckets: int = 4
    """Batches of one people count drawn at once and cut by length (lab traces vary about twofold in length:
    4 keeps padding small); 1 keeps each batch in the order drawn, as the first lab model was trained."""
    max_new_tokens: int = 640
    """Response cap of the evaluations (``RL_TRACE`` runs to ~450 tokens at 3 people; compact traces fit 256 up to 6
    people)."""
    stop_after: int | None = None
    """Stop after this many steps with the schedule still set by ``steps`` (None: run them all): what reproduces a
    run that ``max_minutes`` stopped early, as the previous lab model was (docs/lab_model.md)."""
    threads: int | None = None
    """torch threads (None: torch's default)."""
    init_from: str | None = None
    """A lab model folder to start from (``lab.model.start_from``: its weights, each token's embedding taken by token
    string, so a model trained with another tokenizer can be carried over), with a fresh optimizer and this config's
    schedule; None: random weights (``lab.model.build_model``)."""
    autocast: str = "auto"
    """Precision of the training forward and backward: "bfloat16" (torch.autocast: matmuls in bf16, weights, loss
    and optimizer in float32; faster than float32 on a CPU with AVX512-BF16, far slower on one without:
    benchmarks/README.md), "float32" (how models recorded before this field were trained), or "auto": bfloat16 where
    the CPU has bf16 instructions, else float32 (``training_precision``; the saved record names the one that ran).
    Evaluations always run in float32."""

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
        if self.init_from is not None:
            check.need(
                isinstance(self.init_from, str) and (Path(self.init_from) / "config.json").is_file(),
                "init_from", "must be a lab model folder (with a config.json)",
            )  # fmt: skip
        trace_ok = self.trace is None or isinstance(self.trace, TraceStyle)
        check.need(trace_ok, "trace", "must be None, a lab.trace.TraceStyle or a dict of its fields")
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
    prompt = tokenizer(build_prompt(puzzle, prompt_style(style), tokenizer), add_special_tokens=False)["input_ids"]
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

    if config.threads:
        torch.set_num_threads(config.threads)
    config = replace(config, autocast=training_precision(config.autocast))  # recorded as run: a replay is exact
    if config.autocast == "bfloat16" and not native_bf16():
        print("lopti-lab pretrain: PretrainConfig.autocast is 'bfloat16' but this CPU lists no bf16 instructions "
              "(avx512_bf16, amx_bf16): each step may take ~20x as long as in float32; pass --autocast float32 "
              "or auto", file=sys.stderr)  # fmt: skip
    torch.manual_seed(config.seed)
    start = time.perf_counter()
    tokenizer = build_tokenizer(seed=config.seed, style=config.trace)
    mapped = None
    if config.init_from is None:
        model = build_model(tokenizer, config.spec, seed=config.seed)
    else:
        model, mapped = start_from(config.init_from, tokenizer, config.spec)
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
                    prompt_style=prompt_style(config.trace),
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
        prompt_style=prompt_style(config.trace),
    )
    summary = {
        "config": asdict(config),
        "steps_done": step,
        "minutes": (time.perf_counter() - start) / 60,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "init_from_vocab_share": mapped,
        "final_eval": final,
        "log": log,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    save_lab_model(model, tokenizer, out, summary, prompt_style(config.trace))
    return summary


FIELDS_BEFORE_RECORDED = {"trace": None, "length_buckets": 1, "max_new_tokens": 256, "autocast": "float32"}
"""How a lab model recorded before a PretrainConfig field existed was trained: what `lopti-lab pretrain --config
<its lab_model.json>` takes for a field the record lacks (the first lab model's record has none of these)."""


def config_fields(path: str | Path) -> dict:
    """PretrainConfig fields from a JSON file: an object of fields, or a lab_model.json (its recorded ``config``;
    a field the record lacks takes the value it had before the field existed, ``FIELDS_BEFORE_RECORDED``; a run
    that ``max_minutes`` stopped early is stopped at the same step, ``stop_after``). Raises ValueError naming the
    file."""
    loaded = read_json(path)  # ConfigError (a ValueError) naming the file and line
    fields_given = loaded.get("config", loaded)
    if not isinstance(fields_given, dict):
        raise ConfigError(f"{path}: its 'config' is a JSON {type(fields_given).__name__}, not an object of fields")
    if "config" in loaded:  # a recorded config: a field it lacks came later
        fields_given = {**FIELDS_BEFORE_RECORDED, **fields_given}
        done = loaded.get("steps_done")
        if fields_given.get("stop_after") is None and isinstance(done, int) and done < fields_given.get("steps", done):
            fields_given["stop_after"] = done  # the clock stopped it: stop at the same step, on the same schedule
    return fields_given
