"""models.py: name checks, loading a saved tiny Qwen2 with and without LoRA, "lab" (the bundled folder), the prompt
style a model's config names, the reference policy."""

import pytest
import torch

from lopti_lab.models import (
    DEFAULT_LORA_TARGETS,
    LoraSpec,
    Reference,
    check_model_name,
    load_policy,
    model_path,
    prompt_style_of,
    resolve_dtype,
    trainable_state_dict,
)


def test_check_model_name(tmp_path):
    assert check_model_name("lab") == check_model_name("lab-hard") == "lab"
    assert check_model_name(str(tmp_path)) == "local"
    assert check_model_name("Qwen/Qwen2.5-3B-Instruct") == "hub"
    for bad in (str(tmp_path / "missing"), "./missing", "a/b/c", ""):
        with pytest.raises(ValueError, match="model"):
            check_model_name(bad)
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(ValueError, match="file"):
        check_model_name(str(tmp_path / "file.bin"))


def test_load_policy_with_lora_trains_only_the_adapter(model_dir):
    model, tok = load_policy(str(model_dir), lora=LoraSpec(r=4, alpha=8), device="cpu")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    wrapped = {n.split(".")[-4] for n in trainable}  # ...q_proj.lora_A.default.weight -> q_proj
    assert wrapped == set(DEFAULT_LORA_TARGETS)  # attention and MLP projections
    assert tok.padding_side == "left" and tok.pad_token is not None
    assert not model.training  # dropout off until the trainer's update
    assert next(model.parameters()).dtype == torch.float32  # "auto" on CPU
    assert set(trainable_state_dict(model)) == set(trainable)


def test_load_policy_full_finetune(model_dir):
    model, _ = load_policy(str(model_dir), lora=None, device="cpu", gradient_checkpointing=True)
    assert all(p.requires_grad for p in model.parameters())
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    model.train()
    ids = torch.randint(0, 100, (2, 6))
    model(input_ids=ids, use_cache=False).logits.sum().backward()  # checkpointed backward runs
    assert model.model.embed_tokens.weight.grad is not None


def test_load_policy_bfloat16(model_dir):
    model, _ = load_policy(str(model_dir), lora=LoraSpec(r=2), dtype="bfloat16", device="cpu")
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    lora = [p for p in model.parameters() if p.requires_grad]
    assert base.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in lora)  # adapter kept in fp32
    assert resolve_dtype("auto", "cpu") == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8")


def test_load_policy_lab_is_the_standard_loader_on_the_bundled_folder():
    """ "lab" names the bundled folder: load_policy gives exactly what AutoTokenizer / AutoModelForCausalLM give."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lopti_lab.paths import lab_model_dir

    model, tokenizer = load_policy("lab", lora=None, device="cpu")
    assert model_path("lab") == str(lab_model_dir())
    auto_tok = AutoTokenizer.from_pretrained(lab_model_dir())
    assert type(tokenizer) is type(auto_tok) and tokenizer.get_vocab() == auto_tok.get_vocab()
    auto = AutoModelForCausalLM.from_pretrained(lab_model_dir())
    for (name, a), (_, b) in zip(model.state_dict().items(), auto.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert prompt_style_of("lab") == model.config.kk_prompt_style  # the prompt it was trained on, in its config


def test_load_policy_lab_without_the_bundled_folder_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("LOPTI_LAB_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="lopti-lab pretrain"):
        load_policy("lab", lora=None, device="cpu")


def test_prompt_style_of_reads_a_folders_config(model_dir, tmp_path):
    assert prompt_style_of(str(model_dir)) is None  # a model that names none (Qwen, the tiny test model)
    assert prompt_style_of("Qwen/Qwen2.5-0.5B-Instruct") is None  # a hub id: nothing read, nothing downloaded
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        prompt_style_of(str(bad))


def test_missing_path_fails_before_loading(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_policy(str(tmp_path / "nope"))


def test_reference_is_the_adapter_disabled_model(model_dir):
    model, _ = load_policy(str(model_dir), lora=LoraSpec(r=4), device="cpu")
    base, _ = load_policy(str(model_dir), lora=None, device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # make the adapter matter
    ids = torch.randint(0, 100, (2, 5))
    ref = Reference(model)
    assert ref.copy is None  # no second copy of the weights with LoRA
    with torch.no_grad(), ref() as ref_model:
        ref_logits = ref_model(input_ids=ids).logits
    with torch.no_grad():
        policy_logits = model(input_ids=ids).logits
        base_logits = base(input_ids=ids).logits
    torch.testing.assert_close(ref_logits, base_logits)
    assert not torch.allclose(policy_logits, base_logits)


def test_reference_of_full_finetune_is_a_frozen_copy(model_dir):
    model, _ = load_policy(str(model_dir), lora=None, device="cpu")
    ref = Reference(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    with ref() as ref_model:
        assert ref_model is not model
        assert not any(p.requires_grad for p in ref_model.parameters())
        assert not torch.equal(ref_model.model.embed_tokens.weight, model.model.embed_tokens.weight)
