"""The one-GPU hot path's settings, proven on a CPU: the attention kernel a TrainConfig names reaches the model and an
old run folder without it still resumes; activation checkpointing goes through transformers' current names (no
deprecation warning from our calls); a lab model's quiz style does not follow a config to a hub model."""

import json
import warnings
from dataclasses import replace

import pytest
import torch
from tiny import fake_score

from lopti_lab import evaluate as evaluation
from lopti_lab import runs, trainer
from lopti_lab.models import LoraSpec, load_policy
from lopti_lab.train_config import LAB_PROMPT_STYLES, TrainConfig
from lopti_lab.trainer import train

HUB = "Qwen/Qwen2.5-1.5B-Instruct"  # a hub id: validated by name, never downloaded here


@pytest.fixture()
def config(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluation, "score_response", fake_score)
    return TrainConfig(
        model=str(model_dir),
        lora_r=4,
        lora_alpha=8,
        prompt_style="base",
        train_people=(3,),
        train_limit=4,
        eval_people=(),
        prompts_per_step=2,
        group_size=2,
        minibatch_size=4,
        max_new_tokens=6,
        steps=1,
        save_every=0,
        run_dir=str(tmp_path / "run"),
        progress=False,
    )


@pytest.mark.parametrize("lora", [None, LoraSpec(r=2, alpha=4)], ids=["full", "lora"])
def test_checkpointed_load_forward_and_backward_raise_no_deprecation_warning(model_dir, lora):
    """transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable (the old name warns
    that v6 removes it); peft's own read of the old property is silenced inside load_policy."""
    with warnings.catch_warnings():  # "`gradient_checkpointing...` is deprecated" (FutureWarning) is an error here
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("error", message=r".*checkpointing", category=category)
        model, _ = load_policy(str(model_dir), lora=lora, device="cpu", gradient_checkpointing=True)
        base = model.get_base_model() if lora is not None else model
        assert base.is_activation_checkpointing
        model.train()
        ids = torch.randint(0, 100, (2, 6))
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_attention_kernel_reaches_the_model(model_dir, config, monkeypatch):
    model, _ = load_policy(str(model_dir), lora=None, device="cpu", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    model, _ = load_policy(str(model_dir), lora=None, device="cpu")
    assert model.config._attn_implementation == "sdpa"  # the default, named

    seen = {}

    def no_loading(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop before the model loads")

    monkeypatch.setattr(trainer, "load_policy", no_loading)
    with pytest.raises(RuntimeError, match="stop before"):
        train(replace(config, attn_implementation="eager"))
    assert seen["attn_implementation"] == "eager"


def test_a_run_folder_without_the_kernel_field_resumes_and_may_change_it(config):
    """config.json written before the field existed: the missing field takes its default ("sdpa", what transformers
    5 loaded by default), and a resume may name another kernel (the same math, other rounding)."""
    train(config)
    folder = runs.RunFolder(config.run_dir)
    saved = runs.load_config(config.run_dir)
    del saved["attn_implementation"]
    folder.write_config(saved)
    assert TrainConfig.from_dict(saved).attn_implementation == "sdpa"
    result = train(replace(config, steps=2, attn_implementation="eager"), resume=True)
    assert [m["step"] for m in result.history] == [1, 2]
    assert json.loads((folder.path / runs.CONFIG).read_text())["steps"] == 2


def test_a_lab_config_moved_to_a_hub_model_takes_the_instruct_prompt():
    lab = TrainConfig()  # the bundled lab model: its config.json names its quiz style
    assert lab.prompt_style in LAB_PROMPT_STYLES
    hub = replace(lab, model=HUB)
    assert hub.prompt_style == "instruct"  # the quiz styles were made for the lab model only
    with pytest.raises(ValueError, match=r"TrainConfig\.prompt_style"):  # back: a lab model takes its own style only
        replace(hub, model="lab")
    assert replace(hub, model="lab", prompt_style=None).prompt_style == lab.prompt_style
    for style in ("instruct", "base", "chat"):  # a hub style is a choice: kept
        assert replace(lab, model=HUB, prompt_style=style).prompt_style == style
    assert TrainConfig(model=HUB, prompt_style="chat_quiz").prompt_style == "instruct"


def test_a_lab_model_refuses_another_style_even_another_lab_models(model_dir, tmp_path):
    """A lab model names the one prompt it was trained on: a different quiz style (carried over from another lab
    model's config, or chosen) is refused by name, with the fix in the message, not silently swapped."""
    folder = tmp_path / "other_lab"
    folder.mkdir()
    for file in model_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "kk_prompt_style": "chat_quiz_numbered"}))
    lab = TrainConfig()
    with pytest.raises(ValueError, match=r"TrainConfig.prompt_style must be 'chat_quiz_numbered'.*None"):
        replace(lab, model=str(folder))
    assert replace(lab, model=str(folder), prompt_style=None).prompt_style == "chat_quiz_numbered"


def test_the_trl_config_asks_for_activation_checkpointing_by_its_current_name():
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from lopti_lab.integrations.trl import LoptiGRPOConfig

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*checkpointing", category=FutureWarning)
        args = LoptiGRPOConfig(output_dir="unused", use_cpu=True, bf16=False)
        assert args.activation_checkpointing and args.gradient_checkpointing  # TRL's default: on
        off = LoptiGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, activation_checkpointing=False)
        assert not off.activation_checkpointing and not off.gradient_checkpointing
    with pytest.warns(FutureWarning, match="gradient_checkpointing"):  # the old name still works, as TRL's users say it
        old = LoptiGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, gradient_checkpointing=False)
    assert not old.activation_checkpointing
