"""The memory planner (lopti_lab.plan): its per-phase estimates against peaks measured on CPU (float32) for three
random-weight Qwen2 shapes, the refusal of a config that does not fit, the batch sizes it resolves, and the bundled
Qwen2.5 configs."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

from lopti_lab.memory import PeakMemory, cpu_peak_supported
from lopti_lab.objective import policy_loss
from lopti_lab.plan import GPUS, GiB, ModelShape, check_fits, estimate, model_config, resolve_batch_sizes
from lopti_lab.rollout import response_logprobs
from lopti_lab.train_config import TrainConfig

TOLERANCE = 0.25


@dataclass(frozen=True)
class Shape:
    """A model and the rows and lengths its phases run at; each phase is 50-500 MB, so the few MB a CPU measurement
    counts beyond tensors (memory.PeakMemory) stay small against it."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    checkpointing: bool
    generate: tuple[int, int, int]
    """rows, prompt tokens, new tokens of the generate call (few new tokens: each one copies the cache)"""
    update: tuple[int, int, int]
    """rows, prompt tokens, response tokens of the log-prob forward and the update's micro-batch"""

    def config(self) -> dict:
        return {"hidden_size": self.hidden, "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab,
                "tie_word_embeddings": True, "model_type": "qwen2"}  # fmt: skip

    def train_config(self, phase: str) -> TrainConfig:
        rows, prompt, new = self.generate if phase == "generate" else self.update
        sizes = {"minibatch_size": rows, "micro_batch_size": rows, "generate_batch_size": rows}
        return TrainConfig(model="lab", dtype="float32", lora_r=8, prompts_per_step=rows // 2, group_size=2,
                           max_new_tokens=new, max_prompt_tokens=prompt, **sizes,
                           gradient_checkpointing=self.checkpointing, kl_coef=0.0)  # fmt: skip


SHAPES = {
    "h256-v16k-L2": Shape(256, 1024, 2, 4, 2, 16000, False, generate=(32, 256, 8), update=(4, 32, 256)),
    "h512-v8k-L4-ckpt": Shape(512, 2048, 4, 8, 2, 8000, True, generate=(16, 320, 8), update=(8, 64, 192)),
    "h384-v32k-L3-mha": Shape(384, 1536, 3, 6, 6, 32000, False, generate=(24, 192, 8), update=(2, 64, 160)),
}


def _generate(model, shape: Shape, rows: int, prompt: int, new: int) -> None:
    """HF generate with a KV cache, exactly ``new`` sampled tokens per row (rollout._hf_generate's settings)."""
    ids = torch.randint(5, shape.vocab, (rows, prompt))
    config = GenerationConfig(do_sample=True, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                              pad_token_id=0, use_cache=True, top_k=0, temperature=1.0)  # fmt: skip
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)


def _batch(shape: Shape, rows: int, prompt: int, new: int):
    ids = torch.randint(5, shape.vocab, (rows, prompt + new))
    return ids, torch.ones_like(ids), torch.ones(rows, new)


def _logprob(model, shape: Shape, rows: int, prompt: int, new: int) -> None:
    """The rollout's no-grad log-prob forward with its entropy (rollout.add_logprobs)."""
    ids, mask, response = _batch(shape, rows, prompt, new)
    with torch.inference_mode():
        response_logprobs(model, ids, mask, response, 0.7, with_entropy=True, fast_path="hf")


def _update(model, shape: Shape, rows: int, prompt: int, new: int) -> None:
    """One micro-batch of update.update_policy: the forward with grad, the clipped loss, its backward."""
    ids, mask, response = _batch(shape, rows, prompt, new)
    logp, _ = response_logprobs(model, ids, mask, response, 0.7, fast_path="hf")
    loss, _ = policy_loss(logp, logp.detach() - 0.01, torch.randn(rows), response, 0.2, 0.24, 10.0)
    loss.backward()
    model.zero_grad(set_to_none=True)


def _lora(model, shape: Shape):
    from peft import LoraConfig, get_peft_model

    if shape.checkpointing:  # as models.load_policy enables it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    targets = list(TrainConfig().lora_targets)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")).train()


def measured_and_estimated(shape: Shape) -> dict[str, tuple[int, int]]:
    """{phase: (measured peak bytes above the weights, the planner's estimate)}. Each phase runs once small first:
    the first call of a code path maps library pages and caches that a measurement would count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**shape.config(), max_position_embeddings=1024)).eval()
    out = {}
    for phase, run in (("generate", _generate), ("logprob", _logprob), ("update", _update)):
        if phase == "update":
            model = _lora(model, shape)
        rows, prompt, new = shape.generate if phase == "generate" else shape.update
        run(model, shape, 2, 8, 4)  # warm-up
        with PeakMemory() as peak:
            run(model, shape, rows, prompt, new)
        plan = estimate(shape.train_config(phase), shape.config(), None, prompt_tokens=prompt)
        out[phase] = (peak.bytes, plan.total(phase))
    return out


@pytest.fixture(scope="module", params=list(SHAPES))
def measured(request):
    if not cpu_peak_supported():
        pytest.skip("needs torch's memory profiler to measure a CPU peak")
    return request.param, measured_and_estimated(SHAPES[request.param])


@pytest.mark.parametrize("phase", ["generate", "logprob", "update"])
def test_each_phase_is_estimated_within_a_quarter_of_its_measured_peak(measured, phase):
    name, phases = measured
    peak, estimate_ = phases[phase]
    assert 50 * 2**20 <= peak <= 600 * 2**20, f"{name} {phase}: {peak / 2**20:.0f} MB, outside the sized range"
    error = (estimate_ - peak) / peak
    assert abs(error) < TOLERANCE, f"{name} {phase}: measured {peak / 2**20:.1f} MB, estimated " \
        f"{estimate_ / 2**20:.1f} MB ({error:+.1%})"  # fmt: skip


# --- the bundled configs, the refusal, the resolved sizes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [("0.5B", 494_032_768), ("1.5B", 1_543_714_304), ("3B", 3_085_938_688), ("7B", 7_615_616_512)],
)
def test_bundled_qwen_configs_give_the_published_parameter_counts(name, params):
    """HF's num_parameters() of the released checkpoints (tied embeddings up to 3B, untied at 7B)."""
    shape = ModelShape.from_config(model_config(f"Qwen/Qwen2.5-{name}-Instruct"))
    assert shape.n_params() == params


def test_the_lab_model_config_is_read_from_its_folder():
    config = model_config("lab")
    assert ModelShape.from_config(config).vocab == config["vocab_size"]


def test_an_unknown_hub_id_is_refused_by_name():
    with pytest.raises(ValueError, match="Qwen/Qwen9-1B"):
        model_config("Qwen/Qwen9-1B")


def paper_config(model: str) -> TrainConfig:
    return TrainConfig(model=model, lora_r=16)  # the paper's batch: 64 x 8, 4096 new tokens, minibatch 256


def test_a_config_that_does_not_fit_is_refused_naming_the_fields_and_sizes_that_fit():
    cfg = paper_config("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ValueError) as err:
        check_fits(cfg, model_config(cfg.model), "a100-80")
    message = str(err.value)
    assert message.startswith("TrainConfig.micro_batch_size")
    assert "generate_batch_size" in message and "A100-80's 79.5 GiB" in message and "fit (" in message


def test_weights_that_do_not_fit_name_the_model():
    cfg = replace(paper_config("Qwen/Qwen2.5-7B-Instruct"), lora_r=None)
    with pytest.raises(ValueError, match=r"^TrainConfig.model: .*weights and optimizer state alone"):
        check_fits(cfg, model_config(cfg.model), "t4")


def test_one_row_that_still_does_not_fit_names_the_other_fields():
    cfg = replace(paper_config("Qwen/Qwen2.5-3B-Instruct"), micro_batch_size=1, generate_batch_size=1)
    with pytest.raises(ValueError, match=r"gradient_checkpointing.*max_new_tokens"):
        check_fits(cfg, model_config(cfg.model), "t4")


@pytest.mark.parametrize("gpu", ["t4", "a100-40", "h100"])
@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"])
def test_resolved_batch_sizes_fit_and_are_the_largest_that_do(gpu, model):
    cfg = replace(paper_config(model), max_new_tokens=1024, gradient_checkpointing=True)
    config = model_config(model)
    resolved = resolve_batch_sizes(cfg, config, gpu)
    plan = check_fits(resolved, config, gpu)  # raises if not
    assert plan.peak <= GPUS[gpu].usable
    assert cfg.minibatch_size % resolved.micro_batch_size == 0 and cfg.batch_size % resolved.generate_batch_size == 0
    larger = [m for m in range(resolved.micro_batch_size + 1, cfg.minibatch_size + 1) if cfg.minibatch_size % m == 0]
    if larger:  # the next divisor up does not fit
        with pytest.raises(ValueError):
            check_fits(replace(resolved, micro_batch_size=larger[0]), config, gpu)


def test_the_worked_example_of_estimate():
    """estimate's docstring: 0.92 GiB of bf16 weights, 1.04 GiB of KV cache for 64 rows of 1,424 positions."""
    cfg = TrainConfig(model="Qwen/Qwen2.5-0.5B-Instruct", max_new_tokens=1024, generate_batch_size=64)
    plan = estimate(cfg, model_config(cfg.model), "t4")
    parts = {c.name: c.bytes / GiB for c in plan.components}
    assert parts["weights"] == pytest.approx(0.92, abs=0.005)
    assert parts["KV cache"] == pytest.approx(1.04, abs=0.005)


def test_the_trainer_refuses_a_config_that_will_not_fit_before_any_weight_loads(tmp_path, monkeypatch):
    """On a GPU (a T4 planned for: no GPU needed) a step that will not fit is a ValueError naming the fields to
    lower, raised before the run folder exists and before load_policy is called; None batch sizes are resolved."""
    from lopti_lab import plan, trainer

    monkeypatch.setattr(plan, "device_gpu", lambda device: plan.GPUS["t4"])
    monkeypatch.setattr(trainer, "load_policy", lambda *a, **k: pytest.fail("a weight was loaded"))
    run_dir = tmp_path / "run"
    cfg = TrainConfig(model="Qwen/Qwen2.5-3B-Instruct", device="cuda", micro_batch_size=64, generate_batch_size=512,
                      max_new_tokens=1024, run_dir=str(run_dir), eval_people=())  # fmt: skip
    with pytest.raises(ValueError, match=r"TrainConfig\.micro_batch_size.*T4.*fit"):
        trainer.train(cfg)
    assert not run_dir.exists()
    fitted = plan.fit_to_device(replace(cfg, micro_batch_size=None, generate_batch_size=None), torch.device("cuda"))
    assert plan.estimate(fitted, plan.model_config(cfg.model), "t4").peak <= plan.GPUS["t4"].usable
    assert plan.fit_to_device(cfg, torch.device("cpu")) is cfg  # a CPU is not planned for


def test_docs_gpu_quotes_the_planner_as_it_is_now():
    """docs/gpu.md's tables are what `lopti-lab plan --defaults` and `--matrix` print today."""
    from lopti_lab.cli import main
    from lopti_lab.notebook import gpu_defaults_markdown

    page = (Path(__file__).resolve().parents[1] / "docs" / "gpu.md").read_text()
    assert gpu_defaults_markdown() in page
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["plan", "--matrix"]) == 0
    assert out.getvalue().rstrip() in page
