"""GPU memory planner: a training step's peak memory from the model's config.json and a ``TrainConfig``, before any
weight loads (DESIGN.md, "Precision and memory").

    plan = estimate(cfg, model_config("Qwen/Qwen2.5-3B-Instruct"), gpu="t4")
    plan.table()                      # one row per component: phase, GiB, how it was counted
    check_fits(cfg, model_config(cfg.model), "t4")          # ValueError naming the fields to lower
    cfg = resolve_batch_sizes(cfg, model_config(cfg.model), "t4")   # None batch sizes -> the largest that fit

A step's peak is its resident part (weights, trainable parameters and optimizer state, a full fine-tuning
reference copy) plus the largest of its phases, which run one after another and free what they made:
    generate   the KV cache of one generate call
    logprob    the no-grad log-prob forwards (pi_old, the KL reference) at the log-prob batch
    update     one micro-batch's forward and backward: gradients, activations, logits and their gradient
    probe      the update with the gradient probe attached (one layer's LoRA inputs kept extra)
    shift      the float64 probability-shift / Fig. 3 measurement, one decoder layer at a time
Shape legend: b bytes per element of the compute dtype, L layers, h hidden, i intermediate, V vocabulary,
P prompt tokens, T = max_new_tokens, S = P + T.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from lopti_lab.models import check_model_name, model_path
from lopti_lab.objective import CHUNK_ELEMENTS
from lopti_lab.paths import data_dir
from lopti_lab.probes.float64 import TOKEN_CHUNK, VOCAB_CHUNK
from lopti_lab.train_config import TrainConfig

__all__ = [
    "GPU",
    "GPUS",
    "Component",
    "MemoryPlan",
    "ModelShape",
    "check_fits",
    "device_gpu",
    "estimate",
    "fit_to_device",
    "model_config",
    "plan_matrix",
    "resolve_batch_sizes",
]

GiB = 2**30
PROMPT_TOKENS = 400
"""Prompt length when ``TrainConfig.max_prompt_tokens`` is None: the paper's cap on K&K prompts."""
CONTEXT_BYTES = GiB // 2
"""Held back from each GPU's memory: the CUDA context, cuBLAS workspaces and allocator slack (~0.3-0.5 GiB)."""


@dataclass(frozen=True)
class GPU:
    label: str
    memory: int
    """bytes the card reports to torch (Colab's T4: 15 GiB of its 16 GB)"""
    capability: tuple[int, int]

    @property
    def usable(self) -> int:
        return self.memory - CONTEXT_BYTES

    @property
    def dtype_bytes(self) -> int:
        return 2  # "auto": bfloat16 at capability >= 8.0, float16 with a loss scaler below (models.resolve_dtype)


GPUS: dict[str, GPU] = {
    "t4": GPU("T4", 15 * GiB, (7, 5)),
    "l4": GPU("L4", 22 * GiB, (8, 9)),
    "a100-40": GPU("A100-40", 40 * GiB, (8, 0)),
    "a100-80": GPU("A100-80", 80 * GiB, (8, 0)),
    "h100": GPU("H100", 80 * GiB, (9, 0)),
}
"""The one-GPU targets. Usable memory = memory - CONTEXT_BYTES (T4: 14.5 GiB)."""


# --- the model's shape ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The fields of a decoder-only config.json that size memory (Qwen2 / Llama layout: q/k/v/o, gate/up/down).

    >>> ModelShape.from_config(model_config("Qwen/Qwen2.5-0.5B-Instruct")).n_params()
    494032768
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = True

    @classmethod
    def from_config(cls, config: Mapping) -> ModelShape:
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=config.get("model_type", "qwen2") == "qwen2" or bool(config.get("attention_bias")),
            )
        except KeyError as err:
            raise ValueError(f"model config: no {err.args[0]!r} (a decoder-only config.json is needed)") from None

    def linears(self) -> dict[str, tuple[int, int]]:
        """{module name: (in features, out features)} of one decoder layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def layer_params(self) -> int:
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return sum(a * b for a, b in self.linears().values()) + bias + 2 * self.hidden  # + two RMSNorms

    def n_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params() + self.hidden

    def lora_params(self, r: int, targets: tuple[str, ...]) -> int:
        """A (r x in) and B (out x r) per targeted module of each layer."""
        return self.layers * sum(r * (a + b) for name, (a, b) in self.linears().items() if name in targets)


def model_config(name_or_path: str) -> dict:
    """A model's config.json as a dict, no weights: the bundled copy for a Qwen2.5 Instruct hub id
    (data/hub_configs), another hub id's from the local Hugging Face cache, else the folder ``models.model_path``
    names ("lab", a local checkpoint).

    >>> model_config("Qwen/Qwen2.5-7B-Instruct")["vocab_size"]
    152064
    """
    bundled = data_dir() / "hub_configs" / f"{name_or_path}" / "config.json"
    if check_model_name(name_or_path) == "hub":
        if not bundled.is_file():
            from huggingface_hub import try_to_load_from_cache  # the local cache only: never a download

            cached = try_to_load_from_cache(name_or_path, "config.json")
            bundled = Path(cached) if isinstance(cached, str) else bundled
        if not bundled.is_file():
            known = sorted(f"{p.parent.name}/{p.name}" for p in (data_dir() / "hub_configs").glob("*/*"))
            raise ValueError(f"model: no bundled config for hub id {name_or_path!r}; bundled: {known}, or give a "
                             "local folder holding its config.json")  # fmt: skip
        path = bundled
    else:
        path = Path(model_path(name_or_path)) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"model: cannot read {path} ({err})") from None


# --- the components ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    name: str
    phase: str
    """"resident" or the phase it lives in (module docstring)"""
    bytes: int
    how: str


PHASES = ("generate", "logprob", "update", "probe", "shift")


@dataclass(frozen=True)
class MemoryPlan:
    """The components of one step and its peak: resident + the largest phase."""

    components: tuple[Component, ...]
    label: str = ""

    def total(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if c.phase == phase)

    @property
    def resident(self) -> int:
        return self.total("resident")

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.total)

    @property
    def peak(self) -> int:
        return self.resident + self.total(self.peak_phase)

    def table(self):
        """A DataFrame: one row per component (phase, name, GiB, how), then each phase's total with the resident."""
        import pandas as pd

        rows = [(c.phase, c.name, c.bytes / GiB, c.how) for c in self.components]
        rows += [(p, "= resident + phase", (self.resident + self.total(p)) / GiB, "") for p in PHASES if self.total(p)]
        return pd.DataFrame(rows, columns=["phase", "component", "GiB", "how"])


def _sizes(cfg: TrainConfig, prompt_tokens: int | None) -> tuple[int, int, int, int, int]:
    """(P, T, rows per generate call, rows per log-prob forward, rows per update forward)."""
    prompt = prompt_tokens or cfg.max_prompt_tokens or PROMPT_TOKENS
    batch = cfg.batch_size
    micro = cfg.micro_batch_size or cfg.minibatch_size
    return prompt, cfg.max_new_tokens, cfg.generate_batch_size or batch, cfg.logprob_batch_size or batch, micro


def _resident(cfg: TrainConfig, m: ModelShape, b: int) -> list[Component]:
    n = m.n_params()
    out = [Component("weights", "resident", n * b, f"{n / 1e9:.2f}B params x {b} B")]
    adam = 8 if cfg.optimizer == "adamw" else 0  # AdamW: exp_avg and exp_avg_sq in float32; SGD without momentum: none
    if cfg.lora_r is not None:
        k = m.lora_params(cfg.lora_r, cfg.lora_targets)
        # peft keeps adapters in float32 under a bf16 base (autocast_adapter_dtype)
        out.append(Component("LoRA params + optimizer", "resident", k * (4 + adam), f"{k / 1e6:.1f}M x (4 + {adam}) B"))
        return out
    master = 4 if b < 4 else 0  # full fine-tuning keeps float32 master weights under a 16-bit model
    out.append(
        Component("master weights + optimizer", "resident", n * (master + adam), f"params x ({master} + {adam}) B")
    )
    if cfg.kl_coef > 0:  # models.Reference: a frozen deep copy when there is no adapter to switch off
        out.append(Component("reference copy", "resident", n * b, "params x b (full fine-tuning: a deep copy)"))
    return out


def _layer_activations(m: ModelShape) -> int:
    """Elements one decoder layer saves for backward per token: the two RMSNorms' input and output (4h), q, k, v
    after RoPE and the attention output with its contiguous copy for o_proj (3q + 2kv), and the MLP's gate, SiLU, up
    and product (4i). Measured on CPU float32 (tests/test_plan.py)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return 4 * m.hidden + 3 * q + 2 * kv + 4 * m.intermediate


def _layer_working(m: ModelShape) -> int:
    """Elements per token a no-grad layer forward holds at once: the MLP's SiLU(gate), up and their product (3i; each
    freed as soon as it is used) and the residual stream with its normed copy (2h)."""
    return 3 * m.intermediate + 2 * m.hidden


def _logprob_chunk(rows_tokens: int, vocab: int, copies: int, chunk: int) -> int:
    """float32 bytes of ``token_logprobs``'s live chunks: min(all rows, a chunk of ``chunk`` logits) x V, ``copies``
    at once, one more when there are several chunks (the loop's previous chunk lives until its variable is
    reassigned)."""
    chunk_rows = max(1, chunk // vocab)
    copies += rows_tokens > chunk_rows
    return min(rows_tokens, chunk_rows) * vocab * 4 * copies


def _generate(m: ModelShape, b: int, rows: int, prompt: int, new: int) -> list[Component]:
    per_position = rows * m.layers * 2 * m.kv_heads * m.head_dim * b
    cache = per_position * (prompt + new)
    # decoding: DynamicCache grows by torch.cat, so one layer's keys exist twice for a moment, and sampling holds
    # float32 logits, their scaled copy and the softmax (3 x rows x V)
    decode = cache // (2 * m.layers) + 3 * rows * m.vocab * 4
    # the prefill runs one layer of rows x P at a time while the cache holds only the P prompt positions: it counts
    # where it exceeds what decoding adds later
    prefill = per_position * prompt + rows * prompt * _layer_working(m) * b
    return [
        Component("KV cache", "generate", cache, f"{rows} rows x {prompt + new} x {m.layers} layers x 2 x kv x d x b"),
        Component("prefill or decode step", "generate", max(decode, prefill - cache),
                  "max(one layer's cache copy + float32 sampling logits, one layer of the prefill - the T positions)"),
    ]  # fmt: skip


def _logprob(m: ModelShape, b: int, rows: int, prompt: int, new: int, chunk: int) -> list[Component]:
    s, kept = prompt + new, rows * (new + 1)
    # pi_old with its entropy: the float32 scaled chunk, its softmax and their product; the layers ran before the
    # logits exist, one at a time (no grad: each frees its input)
    chunks = _logprob_chunk(kept, m.vocab, 3, chunk)
    layer = rows * s * _layer_working(m) * b
    return [
        Component("logits (no grad)", "logprob", kept * m.vocab * b, f"{rows} rows x (T + 1) x V x b"),
        Component("log-softmax chunks, or a layer", "logprob", max(chunks, layer - kept * m.vocab * b),
                  "max(3 float32 chunks (objective), one layer's working set rows x S - the logits)"),
    ]  # fmt: skip


def _update(cfg: TrainConfig, m: ModelShape, b: int, rows: int, prompt: int, new: int, chunk: int) -> list[Component]:
    s, kept = prompt + new, rows * (new + 1)
    trainable = m.lora_params(cfg.lora_r, cfg.lora_targets) if cfg.lora_r is not None else m.n_params()
    layer = rows * s * _layer_activations(m) * b
    # _TokenLogprobs saves the logits in their dtype; its backward, the first to run, makes their gradient
    # (empty_like) and holds the float32 softmax, its product with the gradient and the scaled result of one chunk
    logits = 2 * kept * m.vocab * b + _logprob_chunk(kept, m.vocab, 3, chunk)
    # a layer's backward holds the gradients of its MLP's intermediates (2i) and of the residual stream (2h)
    backward = rows * s * (2 * m.intermediate + 2 * m.hidden) * b
    if cfg.gradient_checkpointing:  # one hidden state per layer; one layer's activations exist only in its recompute,
        saved, how = m.layers * rows * s * m.hidden * b, f"{m.layers} layer inputs, {rows} rows x {s}"
        transient = max(logits, layer + backward)  # which comes after the logits and their gradient are freed
    else:
        saved, how = m.layers * layer, f"{m.layers} layers' saved tensors, {rows} rows x {s}"
        transient = max(logits, backward)
    return [
        Component("gradients", "update", trainable * 4, "trainable params x 4 B (float32)"),
        Component("activations", "update", saved, how),
        Component(
            "logits + their gradient, or a layer's backward",
            "update",
            transient,
            f"max(2 x {rows} rows x (T + 1) x V x b + 3 float32 chunks, one layer's backward)",
        ),
    ]


def _probe(cfg: TrainConfig, m: ModelShape, b: int, rows: int, prompt: int, new: int, chunk: int) -> list[Component]:
    if cfg.probe_every <= 0:
        return []
    q = m.heads * m.head_dim
    extra = rows * (prompt + new) * (2 * m.hidden + q + m.intermediate) * b  # q/k/v, o, gate/up, down inputs
    return [*(replace(c, phase="probe") for c in _update(cfg, m, b, rows, prompt, new, chunk)),
            Component("probe: one layer's LoRA inputs", "probe", extra, "rows x S x (2h + q + i) x b")]  # fmt: skip


def _shift(cfg: TrainConfig, m: ModelShape, logprob_rows: int, prompt: int, new: int) -> list[Component]:
    """The float64 forwards: the probe's shift at the log-prob batch (``probe_shift``), Fig. 3 at ``shift_rows`` rows
    (None: all)."""
    rows = max(logprob_rows if cfg.probe_every > 0 and cfg.probe_shift else 0,
               (cfg.shift_rows or cfg.batch_size) if cfg.shift_every > 0 else 0)  # fmt: skip
    if rows == 0:
        return []
    s = prompt + new
    # probes.float64: one module's weights in float64 at a time (the largest: the MLP's up/gate/down or a head slice)
    weights = max(m.hidden * m.intermediate, TOKEN_CHUNK * VOCAB_CHUNK // 4) * 8
    hidden = rows * s * (2 * m.hidden + _layer_working(m)) * 8
    head = (TOKEN_CHUNK * VOCAB_CHUNK + VOCAB_CHUNK * m.hidden) * 8  # a float64 logit tile and its lm_head slice
    return [
        Component("float64 module weights", "shift", weights, "the largest single module x 8 B"),
        Component("float64 hidden states", "shift", hidden, f"{rows} rows x S x (2h + layer working set) x 8 B"),
        Component("float64 head tile", "shift", head, "(1024 tokens x 4096 vocab + 4096 x h) x 8 B, streamed"),
    ]


# --- the plan and its checks ---------------------------------------------------------------------------------------


def _gpu(gpu: str | GPU | int | None) -> GPU | None:
    if gpu is None or isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, int):
        return GPU(f"{gpu / GiB:.1f} GiB GPU", gpu + CONTEXT_BYTES, (8, 0))
    try:
        return GPUS[gpu.lower()]
    except KeyError:
        raise ValueError(f"gpu: {gpu!r} is not one of {list(GPUS)}") from None


def dtype_bytes(cfg: TrainConfig, on_gpu: bool = True) -> int:
    """Bytes per weight / activation element: 4 for float32, 2 for the 16-bit dtypes and for "auto" on a GPU (full
    fine-tuning on "auto" trains in float32: models.training_dtype)."""
    if cfg.dtype == "float32" or (cfg.dtype == "auto" and (not on_gpu or cfg.lora_r is None)):
        return 4
    return 2


def estimate(
    cfg: TrainConfig, config: Mapping | ModelShape, gpu: str | GPU | int | None = None, prompt_tokens: int | None = None
) -> MemoryPlan:
    """The components of one step of ``cfg`` on a model of ``config`` (a config.json dict). ``gpu`` only sets what
    "auto" means (2 bytes on a GPU; None: a CPU, where "auto" is float32).

    Worked example, Qwen2.5-0.5B (494M params) with LoRA r=16 in bf16: weights 494M x 2 B = 0.92 GiB; its 8.8M LoRA
    params with their AdamW state 8.8M x 12 B = 0.10 GiB; a generate call of 64 rows x 1,424 positions holds a KV
    cache of 64 x 1424 x 24 layers x 2 x 2 kv heads x 64 x 2 B = 1.04 GiB.
    """
    m = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    device = _gpu(gpu)
    b = dtype_bytes(cfg, on_gpu=gpu is not None)
    prompt, new, gen_rows, lp_rows, micro = _sizes(cfg, prompt_tokens)
    chunk = CHUNK_ELEMENTS["cpu" if gpu is None else "accelerator"]  # token_logprobs' chunk of logits there
    components = [
        *_resident(cfg, m, b),
        *_generate(m, b, gen_rows, prompt, new),
        *_logprob(m, b, lp_rows, prompt, new, chunk),
        *_update(cfg, m, b, micro, prompt, new, chunk),
        *_probe(cfg, m, b, micro, prompt, new, chunk),
        *_shift(cfg, m, lp_rows, prompt, new),
    ]
    return MemoryPlan(tuple(components), label=device.label if device else "CPU")


def _divisors(n: int) -> list[int]:
    """Descending: _divisors(12) -> [12, 6, 4, 3, 2, 1]."""
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def _largest_fitting(cfg: TrainConfig, config, device: GPU, field: str, candidates: list[int]) -> TrainConfig | None:
    """``cfg`` with ``field`` at the largest candidate whose phases (all but generate, for micro_batch_size; generate,
    for generate_batch_size) fit; None if none does."""
    phases = ("generate",) if field == "generate_batch_size" else tuple(p for p in PHASES if p != "generate")
    for value in candidates:
        trial = replace(cfg, **{field: value})
        plan = estimate(trial, config, device)
        if plan.resident + max(plan.total(p) for p in phases) <= device.usable:
            return trial
    return None


def resolve_batch_sizes(cfg: TrainConfig, config: Mapping, gpu: str | GPU | int) -> TrainConfig:
    """``cfg`` with a None ``micro_batch_size`` (a divisor of minibatch_size) and a None ``generate_batch_size`` (a
    divisor of the step's batch) set to the largest values that fit ``gpu``; then ``check_fits``.

    Example: the notebook's Qwen2.5-0.5B setting with micro_batch_size=None on a T4 gets the largest divisor of
    minibatch_size=64 whose update fits next to the weights.
    """
    device = _gpu(gpu)
    if cfg.micro_batch_size is None:
        cfg = _largest_fitting(cfg, config, device, "micro_batch_size", _divisors(cfg.minibatch_size)) or replace(
            cfg, micro_batch_size=1
        )
    if cfg.generate_batch_size is None:
        cfg = _largest_fitting(cfg, config, device, "generate_batch_size", _divisors(cfg.batch_size)) or replace(
            cfg, generate_batch_size=1
        )
    check_fits(cfg, config, device)
    return cfg


def device_gpu(device="cuda") -> GPU:
    """The GPU torch sees as a ``GPU``: its name, total memory and compute capability."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return GPU(props.name, props.total_memory, (props.major, props.minor))


def fit_to_device(cfg: TrainConfig, device) -> TrainConfig:
    """What the trainer runs on ``device`` (a torch.device): on a GPU, ``cfg`` with None batch sizes resolved to
    sizes that fit (``resolve_batch_sizes``), or a ValueError naming the fields to lower (``check_fits``), before
    any weight loads; on a CPU ``cfg`` unchanged. A model whose config.json is not at hand (a hub id neither
    bundled nor in the local cache) cannot be sized: it runs unchecked, with a warning that says so."""
    if device.type != "cuda":
        return cfg
    try:
        shape = model_config(cfg.model)
    except ValueError as err:
        warnings.warn(f"memory not checked before loading {cfg.model!r}: {err}", stacklevel=2)
        return cfg
    gpu = device_gpu(device)
    if cfg.micro_batch_size is None or cfg.generate_batch_size is None:
        return resolve_batch_sizes(cfg, shape, gpu)
    check_fits(cfg, shape, gpu)
    return cfg


def check_fits(cfg: TrainConfig, config: Mapping, gpu: str | GPU | int) -> MemoryPlan:
    """Return the plan if a step of ``cfg`` fits ``gpu``'s usable memory, else raise ValueError naming the
    TrainConfig fields to lower and values that fit, e.g. "TrainConfig.micro_batch_size, generate_batch_size: a step
    needs ~21.3 GiB of the T4's 14.5 GiB (update phase); micro_batch_size=4 and generate_batch_size=32 fit (11.9 GiB)".
    """
    device = _gpu(gpu)
    plan = estimate(cfg, config, device)
    if plan.peak <= device.usable:
        return plan
    need = f"a step needs ~{plan.peak / GiB:.1f} GiB of the {device.label}'s {device.usable / GiB:.1f} GiB"
    if plan.resident > device.usable:
        lower = "lora_r, or a smaller model" if cfg.lora_r is not None else "lora_r (LoRA instead of full fine-tuning)"
        raise ValueError(f"TrainConfig.model: {need}; the weights and optimizer state alone need "
                         f"{plan.resident / GiB:.1f} GiB: lower {lower}")  # fmt: skip
    fitted = _fitting_sizes(cfg, config, device)
    if fitted is not None:
        fields, values, fit = fitted
        raise ValueError(f"TrainConfig.{', '.join(fields)}: {need} ({plan.peak_phase} phase); {values} fit "
                         f"({estimate(fit, config, device).peak / GiB:.1f} GiB)")  # fmt: skip
    fields, advice = _other_fields(cfg, plan.peak_phase)
    raise ValueError(
        f"TrainConfig.{', '.join(fields)}: {need} ({plan.peak_phase} phase), still over at micro_batch_size=1 and "
        f"generate_batch_size=1; {advice}"
    )


def _fitting_sizes(cfg: TrainConfig, config, device: GPU):
    """(fields changed, "a=1 and b=2", the config) with the batch-size fields lowered to the largest that fit, or
    None when even one row per call does not."""
    trial = cfg
    for field, candidates in (("micro_batch_size", _divisors(cfg.minibatch_size)),
                              ("generate_batch_size", _divisors(cfg.batch_size))):  # fmt: skip
        current = getattr(cfg, field)
        smaller = [c for c in candidates if current is None or c <= current]
        trial = _largest_fitting(trial, config, device, field, smaller)
        if trial is None:
            return None
    if estimate(trial, config, device).peak > device.usable:
        return None
    changed = [f for f in ("micro_batch_size", "generate_batch_size") if getattr(trial, f) != getattr(cfg, f)]
    if not changed:
        return None
    return changed, " and ".join(f"{f}={getattr(trial, f)}" for f in changed), trial


def _other_fields(cfg: TrainConfig, phase: str) -> tuple[list[str], str]:
    """The fields that shrink ``phase`` once the batch sizes are at one row, and what to do with them."""
    if phase == "shift":
        return ["shift_rows", "probe_every"], "lower shift_rows, set probe_every=0, or lower max_new_tokens"
    if phase in ("update", "probe") and not cfg.gradient_checkpointing:
        return ["gradient_checkpointing", "max_new_tokens"], "set gradient_checkpointing=True or lower max_new_tokens"
    return ["max_new_tokens"], "lower max_new_tokens"


def plan_matrix(settings: Mapping[str, Callable[[str], TrainConfig]], models: list[str], gpus: list[str]):
    """A DataFrame: one row per (setting, model), one column per GPU. A cell is the step's peak in GiB with "ok",
    or "over" and the batch sizes that fit (``resolve_batch_sizes`` from None), or "over; none fits".
    ``settings``: {name: model id -> its TrainConfig}. Each card's "auto" dtype is 2 bytes."""
    import pandas as pd

    rows = []
    for setting, make in settings.items():
        for name in models:
            cfg, config = make(name), model_config(name)
            cells = {GPUS[key].label: _cell(cfg, config, GPUS[key]) for key in gpus}
            rows.append({"setting": setting, "model": name.split("/")[-1], **cells})
    return pd.DataFrame(rows)


def _cell(cfg: TrainConfig, config: Mapping, gpu: GPU) -> str:
    peak = estimate(cfg, config, gpu).peak
    if peak <= gpu.usable:
        return f"{peak / GiB:.1f} ok"
    try:
        fit = resolve_batch_sizes(replace(cfg, micro_batch_size=None, generate_batch_size=None), config, gpu)
    except ValueError:
        return f"{peak / GiB:.0f} over; none fits"
    return (f"{peak / GiB:.0f} over; micro {fit.micro_batch_size}, gen {fit.generate_batch_size}: "
            f"{estimate(fit, config, gpu).peak / GiB:.1f}")  # fmt: skip
