"""TokenCreditCallback's memory on a real shape: a Qwen2.5-0.5B-shaped model (random weights, 4 of its 24 layers, as
tests/test_probe_memory.py) with LoRA r 16 and activation checkpointing inside TRL's own GRPOTrainer, one micro-step
of 2 rows x (600 prompt + 16 response) tokens through TRL's compute_loss and backward. With the callback measuring
the step (its no-grad forward before TRL's, the probe on TRL's backward, the Fig. 3 forward and the reduction at
the step's end) the peak stays within 1.25x of the plain micro-step: nothing multiplies the model's footprint."""

from __future__ import annotations

import pytest
import torch
from tiny import shaped_qwen2, tiny_tokenizer

pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[trl]')")

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from lopti_lab.integrations.trl_callback import TokenCreditCallback
from lopti_lab.memory import PeakMemory, cpu_peak_supported
from lopti_lab.plan import model_config

pytestmark = pytest.mark.skipif(not cpu_peak_supported(), reason="CPU peak memory needs torch's memory profiler")

QWEN_0P5B = model_config("Qwen/Qwen2.5-0.5B-Instruct")
PROMPT, RESPONSE, ROWS = 600, 16, 2


def inputs(vocab: int) -> dict:
    """One micro-batch as TRL's _prepare_inputs hands it to compute_loss (one optimizer step per generation)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(ROWS, RESPONSE, dtype=torch.long)
    mask[1, RESPONSE // 2 :] = 0
    return {
        "prompt_ids": torch.randint(0, vocab, (ROWS, PROMPT), generator=g),
        "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (ROWS, RESPONSE), generator=g),
        "completion_mask": mask,
        "advantages": torch.tensor([1.0, -1.0]),
        "num_items_in_batch": mask.sum().float(),
    }


def test_the_callbacks_peak_is_within_1p25x_of_the_plain_trl_micro_step(tmp_path):
    model = shaped_qwen2(QWEN_0P5B, num_hidden_layers=4).train()
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                      num_generations=2, max_completion_length=RESPONSE, report_to=[], save_strategy="no")  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a"] * 4})
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=data, processing_class=tiny_tokenizer())  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    batch = inputs(QWEN_0P5B["vocab_size"])
    callback = TokenCreditCallback()

    def micro_step() -> None:
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        if callback._active:
            callback.on_step_end(trainer.args, trainer.state, trainer.control)
        trainer.model.zero_grad(set_to_none=True)

    micro_step()  # warm-up: first-call allocations
    peaks = {}
    for name in ("plain", "callback"):
        if name == "callback":
            callback.attach(trainer)
            callback.on_step_begin(trainer.args, trainer.state, trainer.control)
        with PeakMemory() as peak:
            micro_step()
        peaks[name] = peak.bytes
    shares = callback.last
    grad = sum(v for k, v in shares.items() if k.startswith("grad/share_"))
    assert grad == pytest.approx(1.0, abs=1e-4) and "fig3/float32/q/correct_bin0" in shares
    assert peaks["callback"] <= 1.25 * peaks["plain"], {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}
