"""Load a policy: an HF causal LM (hub id, local folder, or the bundled ``"lab"`` model) with a LoRA adapter.

    model, tokenizer = load_policy("Qwen/Qwen2.5-3B-Instruct", lora=LoraSpec(r=32), dtype="bfloat16")
    model, tokenizer = load_policy("lab", lora=None)          # full fine-tuning of the tiny lab model

Every model, the lab model included, loads through ``AutoTokenizer`` and ``AutoModelForCausalLM``: a lab model folder
is a standard checkpoint (``lab.model``), and "lab" only names the bundled one's folder.

With LoRA the reference policy of the KL term is the same model with its adapter disabled (``Reference``), so KL
costs one extra no-grad forward per step and no second copy of the weights.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from lopti_lab.paths import BUNDLED_MODELS, lab_model_dir

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "PROMPT_STYLE_KEY",
    "LoraSpec",
    "Reference",
    "check_model_name",
    "half_full_finetune_error",
    "is_peft",
    "load_policy",
    "model_path",
    "native_dtype",
    "prompt_style_of",
    "resolve_device",
    "resolve_dtype",
    "trainable_state_dict",
    "training_dtype",
]

# attention and MLP projections of Qwen2 / Llama / Mistral style blocks (the paper's models are Qwen2.5)
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "owner/name", exactly one slash
PROMPT_STYLE_KEY = "kk_prompt_style"
"""The config.json key naming the K&K prompt style (``kk.PROMPT_STYLES``) a model was trained on: lab models write
it (``lab.model.save_lab_model``); Hugging Face keeps such keys as config attributes."""


@dataclass(frozen=True)
class LoraSpec:
    """LoRA settings (peft). dropout defaults to 0 so the first update's ratio is exactly 1 (rollout log-probs come
    from the same model in eval mode, where dropout is off)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = DEFAULT_LORA_TARGETS


def check_model_name(name_or_path: str) -> str:
    """Return "lab" (a bundled lab model's name, ``paths.BUNDLED_MODELS``), "local" or "hub"; ValueError when it
    names a local path that does not exist.

    A string that exists on disk is a local folder; "owner/name" that does not exist locally is taken as a hub id
    (resolved from the HF cache or the hub); anything else path-like ("./x", "/abs/x", "a/b/c") must exist.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"model must be a non-empty string (hub id, local path or 'lab'), got {name_or_path!r}")
    if name_or_path in BUNDLED_MODELS:
        return "lab"
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model: {name_or_path!r} is a file; give the folder holding config.json")
        return "local"
    if _HUB_ID.match(name_or_path) and not name_or_path.startswith("."):
        return "hub"
    raise ValueError(f"model: path {name_or_path!r} does not exist (and is not a hub id of the form 'owner/name')")


def model_path(name_or_path: str) -> str:
    """What ``from_pretrained`` loads: the bundled lab model's folder for "lab", else ``name_or_path`` itself
    (checked by ``check_model_name``)."""
    if check_model_name(name_or_path) != "lab":
        return name_or_path
    folder = lab_model_dir(name_or_path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"lab model not found at {folder}: build it with `lopti-lab pretrain --out {folder}`")
    return str(folder)


def prompt_style_of(name_or_path: str) -> str | None:
    """The prompt style a local model folder (or "lab") names in its config.json (``PROMPT_STYLE_KEY``): the prompt a
    lab model was trained on. None for a hub id or a folder whose config names none (Qwen: "instruct" is the
    caller's default). Reads one small file; loads no model.

    >>> prompt_style_of("lab")
    'chat_quiz_numfirst_bare'
    """
    path = model_path(name_or_path)
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text(encoding="utf-8")).get(PROMPT_STYLE_KEY)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"model: {config} is not readable JSON ({err})") from None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def native_dtype(capability: tuple[int, int] | None) -> torch.dtype:
    """The precision a device computes in natively, from its CUDA compute capability (None: a CPU): bfloat16 from
    8.0 (Ampere: A100, L4, H100), float16 below it (a Colab T4 is 7.5: it has no bf16 units and only emulates bf16,
    slowly, which ``torch.cuda.is_bf16_supported()`` still counts as support), float32 on a CPU (bf16 matmuls are
    slow there and fp16 ones slower).

    >>> native_dtype((7, 5)), native_dtype((8, 0)), native_dtype((9, 0)), native_dtype(None)
    (torch.float16, torch.bfloat16, torch.bfloat16, torch.float32)
    """
    if capability is None:
        return torch.float32
    return torch.bfloat16 if tuple(capability) >= (8, 0) else torch.float16


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu") -> torch.dtype:
    """ "auto" is what ``device`` has natively (``native_dtype``: bf16 from compute capability 8.0, fp16 below it,
    float32 on a CPU); a name ("float32", "bfloat16", "float16") or a torch.dtype is taken as it is."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        device = torch.device(device)
        return native_dtype(torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}") from None


def half_full_finetune_error(dtype: torch.dtype | str) -> str | None:
    """Why full fine-tuning in ``dtype`` is refused, or None when it is allowed (float32): the weights are the
    optimizer's master weights, and half-precision ones swallow small updates. A bf16 weight of magnitude ~0.02 is
    ~1.2e-4 from its neighbours (fp16: ~1.5e-5), so at the paper's lr 1e-6 an Adam update of ~1e-6 rounds back to
    the same weight: most of the model never moves."""
    name = str(dtype).removeprefix("torch.")
    if name not in ("bfloat16", "float16"):
        return None
    spacing = "1.2e-4" if name == "bfloat16" else "1.5e-5"
    return (f"full fine-tuning (lora_r=None) in {name} has no float32 master weights: at the paper's lr 1e-6 most "
            f"updates round to zero (a {name} weight of magnitude ~0.02 is spaced ~{spacing} from the next, so an "
            "Adam update of ~lr = 1e-6 vanishes); use dtype='float32', or LoRA (lora_r=16: the adapter's weights stay "
            "in float32)")  # fmt: skip


def training_dtype(dtype: str | torch.dtype, device: torch.device | str, *, full_finetune: bool) -> torch.dtype:
    """The dtype a run trains in: ``resolve_dtype``, except that full fine-tuning keeps float32 master weights, so
    for it "auto" is float32 on every device and an explicit half dtype is a ValueError saying why
    (``half_full_finetune_error``; TrainConfig refuses it before any model loads). LoRA under a half-precision
    base trains float32 adapter weights (peft's ``autocast_adapter_dtype``)."""
    if full_finetune and dtype == "auto":
        return torch.float32
    resolved = resolve_dtype(dtype, device)
    problem = half_full_finetune_error(resolved) if full_finetune else None
    if problem:
        raise ValueError(problem)
    return resolved


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def load_policy(
    name_or_path: str,
    lora: LoraSpec | None = LoraSpec(),
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
):
    """Load (model, tokenizer) ready for RL: LoRA adapter attached (or all weights trainable when ``lora`` is None),
    on ``device`` in ``dtype``, tokenizer padding on the left (generation appends on the right).

    ``name_or_path``: a hub id ("Qwen/Qwen2.5-0.5B-Instruct"), a local folder saved with ``save_pretrained`` (a lab
    model folder among them), or "lab" for the bundled lab model (``model_path``). ``gradient_checkpointing``:
    activation checkpointing (transformers' ``activation_checkpointing_enable``), recomputing each layer in backward.
    ``attn_implementation``: "sdpa", "eager" or "flash_attention_2" (``TrainConfig.attn_implementation``).
    """
    path = model_path(name_or_path)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # masks come from the first EOS, so pad == eos is harmless
    model.to(device)

    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}  # non-reentrant: LoRA needs no input grads
        if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x; the old one warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # an early transformers 5 release (pyproject allows >= 5.0)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False  # the cache is re-enabled explicitly in generate
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        # peft keeps the (small) adapter weights in float32 under a bf16 base (autocast_adapter_dtype)
        with warnings.catch_warnings():  # peft reads transformers' deprecated alias: its warning, nothing to act on
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            model = get_peft_model(model, config)
    else:
        model.requires_grad_(True)
    model.eval()  # dropout off; the trainer switches to train() only around its update
    return model, tokenizer


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes (the LoRA weights, or all of them), detached on CPU."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


class Reference:
    """The frozen reference policy of the KL term.

    LoRA: the policy itself with its adapter disabled (no copy). Full fine-tuning: a frozen deep copy made now, so
    build it before the first update.

        ref = Reference(model)
        with ref() as ref_model:
            logits = ref_model(input_ids).logits
    """

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy
        self.copy = None if is_peft(policy) else copy.deepcopy(policy).eval().requires_grad_(False)

    @contextmanager
    def __call__(self) -> Iterator[torch.nn.Module]:
        if self.copy is not None:
            yield self.copy
        else:
            with self.policy.disable_adapter():
                yield self.policy
