"""The lab model: its tokenizer on the real K&K text, its warm-start data, pretraining, and loading it offline."""

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from kk_fixtures import reference_records

from lopti_lab.kk import build_prompt, generate_puzzle, instruct_prompt, load_split, score_response
from lopti_lab.lab.evaluate import audit_greedy, audit_rollouts
from lopti_lab.lab.model import LabModelSpec, build_model
from lopti_lab.lab.pretrain import PretrainConfig, collate, encode_example, lr_at, pretrain
from lopti_lab.lab.tokenizer import TAG_TOKENS, build_tokenizer, lab_response
from lopti_lab.lab.trace import HARD_TRACE, RL_TRACE, TraceStyle, prompt_style
from lopti_lab.lab.trace import RL_PROMPT_STYLE as LAB_PROMPT_STYLE
from lopti_lab.models import load_policy
from lopti_lab.paths import lab_model_dir
from lopti_lab.rollout import sample


def load_lab_model(path):
    """(model, tokenizer) of a lab model folder, the standard way."""
    return load_policy(str(path), lora=None, device="cpu")


BUNDLED = lab_model_dir()
needs_bundle = pytest.mark.skipif(not (BUNDLED / "config.json").is_file(), reason="lab model not built yet")


@pytest.fixture(scope="module")
def lab_tokenizer():
    if (BUNDLED / "tokenizer.json").is_file():
        return load_lab_model(BUNDLED)[1]
    return build_tokenizer(n_puzzles=300)


def test_tokenizer_round_trips_every_reference_quiz(reference_kk, lab_tokenizer):
    unk = lab_tokenizer.unk_token_id
    for r in reference_records():
        ids = lab_tokenizer(r["quiz"], add_special_tokens=False)["input_ids"]
        assert unk is None or unk not in ids
        assert lab_tokenizer.decode(ids) == r["quiz"]
        full = instruct_prompt(generate_puzzle(3, r["index"])) + " ".join(r["cot_repeat_steps"])
        assert lab_tokenizer.decode(lab_tokenizer(full, add_special_tokens=False)["input_ids"]) == full


def test_tags_are_single_tokens_that_survive_decoding(lab_tokenizer):
    for tag in TAG_TOKENS:
        ids = lab_tokenizer(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1
        assert lab_tokenizer.decode(ids, skip_special_tokens=True) == tag
    assert lab_tokenizer.decode([lab_tokenizer.eos_token_id], skip_special_tokens=True) == ""
    p = generate_puzzle(3, 0)
    text = lab_response(p)
    decoded = lab_tokenizer.decode(
        lab_tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"], skip_special_tokens=True
    )
    assert decoded == text and score_response(decoded, p).total == 3


def test_chat_template_gives_the_lab_prompt(lab_tokenizer):
    from lopti_lab.kk.reward import bare_quiz, numbered_quiz

    p = generate_puzzle(2, 3)
    prompt = build_prompt(p, "chat_quiz", lab_tokenizer)
    assert prompt == f"<|im_start|>user\n{p.quiz}<|im_end|>\n<|im_start|>assistant\n<think>"
    quiz = bare_quiz(numbered_quiz(p, first=True))  # what the bundled model reads
    assert build_prompt(p, LAB_PROMPT_STYLE, lab_tokenizer) == prompt.replace(p.quiz, quiz)
    with_system = build_prompt(p, "chat", lab_tokenizer)
    assert with_system.startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_a_numbered_trace_trains_on_the_numbered_quiz(lab_tokenizer):
    """A coded trace with ``numbered_quiz`` is paired with the prompt whose names carry their numbers (with
    ``bare_quiz``, without the sentences every quiz shares); every other trace style with the plain quiz."""
    from lopti_lab.kk.reward import bare_quiz, numbered_quiz

    p = generate_puzzle(3, 4)
    numbered = TraceStyle(coded=True, numbered_quiz=True)
    assert [prompt_style(s) for s in (None, TraceStyle(coded=True), numbered)] == ["chat_quiz"] * 2 + [
        "chat_quiz_numbered"
    ]
    full, n_prompt = encode_example(lab_tokenizer, p, random.Random(0), numbered)
    prompt = lab_tokenizer.decode(full[:n_prompt])
    assert prompt == f"<|im_start|>user\n{numbered_quiz(p)}<|im_end|>\n<|im_start|>assistant\n<think>"
    assert numbered_quiz(p) != p.quiz
    bare = TraceStyle(coded=True, numbered_quiz=True, bare_quiz=True)
    assert prompt_style(bare) == "chat_quiz_numbered_bare"
    full, n_prompt = encode_example(lab_tokenizer, p, random.Random(0), bare)
    prompt = lab_tokenizer.decode(full[:n_prompt])
    assert prompt == f"<|im_start|>user\n{bare_quiz(numbered_quiz(p))}<|im_end|>\n<|im_start|>assistant\n<think>"
    assert n_prompt < len(lab_tokenizer(build_prompt(p, "chat_quiz_numbered", lab_tokenizer))["input_ids"]) - 25


def test_examples_put_the_loss_on_the_response_only(lab_tokenizer):
    puzzles = [generate_puzzle(2, 0), generate_puzzle(4, 1)]
    examples = [encode_example(lab_tokenizer, p) for p in puzzles]
    _, mask, labels = collate(examples, lab_tokenizer.pad_token_id)
    for row, ((full, n_prompt), p) in enumerate(zip(examples, puzzles)):
        target = labels[row][labels[row] != -100].tolist()
        assert target == full[n_prompt:]
        assert target[-1] == lab_tokenizer.eos_token_id
        assert lab_tokenizer.decode(target, skip_special_tokens=True) == lab_response(p)
        assert mask[row].sum() == len(full)


def test_learning_rate_schedule():
    cfg = PretrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert lr_at(55, cfg) == pytest.approx(0.55)


@pytest.mark.parametrize(("field", "value"), [("steps", 0), ("batch_size", -1), ("lr", 0.0), ("people", ())])
def test_bad_pretrain_config_is_named(field, value):
    kwargs = {field: value}
    if field == "people":
        kwargs["people_weights"] = ()
    with pytest.raises(ValueError, match=field):
        PretrainConfig(**kwargs)


def test_pretrain_smoke_saves_a_loadable_model(tmp_path):
    spec = LabModelSpec(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    cfg = PretrainConfig(
        people=(2, 3),
        people_weights=(1.0, 1.0),
        curriculum_steps=1,
        steps=3,
        batch_size=4,
        eval_every=2,
        eval_size=2,
        spec=spec,
        warmup_steps=1,
        final_people=(2, 3),
        final_size=3,
        final_samples=2,
    )
    summary = pretrain(cfg, tmp_path / "lab", progress=False)
    assert summary["steps_done"] == 3 and len(summary["log"]) == 3
    assert "test/greedy/acc_2ppl" in summary["log"][1] and "test/sample/acc_3ppl" in summary["final_eval"]
    model, _ = load_lab_model(tmp_path / "lab")
    assert model.config.hidden_size == 32
    saved = json.loads((tmp_path / "lab" / "lab_model.json").read_text())
    assert saved["config"]["spec"]["hidden_size"] == 32
    first = build_model(build_tokenizer(n_puzzles=300), spec, seed=cfg.seed)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), first.state_dict().values()))


def test_pretrain_on_lab_traces_is_reproduced_by_the_cli_from_its_recorded_config(tmp_path):
    """`lopti-lab pretrain --config <a lab_model.json>` retrains the same model: same tokenizer, same weights."""
    from lopti_lab.cli import main

    spec = LabModelSpec(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    cfg = PretrainConfig(
        people=(2, 3), people_weights=(1.0, 2.0), curriculum_steps=0, steps=3, batch_size=4, eval_every=10,
        spec=spec, warmup_steps=1, final_people=(2,), final_size=2, final_samples=1, trace=RL_TRACE,
        length_buckets=2, max_new_tokens=16, threads=1,
    )  # fmt: skip
    pretrain(cfg, tmp_path / "a", progress=False)
    saved = json.loads((tmp_path / "a" / "lab_model.json").read_text())
    assert saved["config"]["trace"]["slip"] == RL_TRACE.slip
    assert main(["pretrain", "--config", str(tmp_path / "a" / "lab_model.json"), "--out", str(tmp_path / "b")]) == 0
    model_a, model_b = load_lab_model(tmp_path / "a")[0], load_lab_model(tmp_path / "b")[0]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    text = lab_response(generate_puzzle(3, 7), None, RL_TRACE)
    assert any(f" {verb} " in text for verb in RL_TRACE.say_verbs)  # a lab trace, not the compact one
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # the folder is a standard checkpoint: AutoTokenizer gives the tokenizer it was trained with (the very object
    # pretrain built encodes the same ids), and its config names the prompt it reads
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    built = build_tokenizer(seed=cfg.seed, style=RL_TRACE)
    prompt = build_prompt(generate_puzzle(2, 5), LAB_PROMPT_STYLE, tokenizer)
    assert built(prompt)["input_ids"] == tokenizer(prompt)["input_ids"]
    assert model_a.config.kk_prompt_style == LAB_PROMPT_STYLE
    assert (tmp_path / "a" / "README.md").read_text().startswith("---\nlicense: mit")  # the model card
    # the audit of its greedy traces: its accuracy is the reward's on the same greedy decode, and subsets nest
    audit = audit_greedy(model_a, tokenizer, RL_TRACE, people=2, size=3, max_new_tokens=24)
    puzzles = load_split("test", 2, limit=3)
    greedy = sample(model_a, tokenizer, [build_prompt(p, LAB_PROMPT_STYLE, tokenizer) for p in puzzles],
                    greedy=True, max_new_tokens=24)  # fmt: skip
    assert audit["traces"] == 3 and audit["clean"] <= audit["clean_transcription"] <= audit["parsed"] <= 3
    assert audit["accuracy_all"] == sum(score_response(t, p).total == 3 for t, p in zip(greedy.texts, puzzles)) / 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stepz": 3}))
    assert main(["pretrain", "--config", str(bad), "--out", str(tmp_path / "c")]) == 2  # a usage error, named
    assert not (tmp_path / "c").exists()


def test_missing_lab_model_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("LOPTI_LAB_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="lopti-lab pretrain"):
        load_policy("lab", lora=None)


@needs_bundle
def test_bundled_model_loads_offline_and_answers(tmp_path):
    code = (
        "from lopti_lab.models import load_policy\n"
        "from lopti_lab.kk import load_split, build_prompt, score_response\n"
        "from lopti_lab.rollout import sample\n"
        "model, tok = load_policy('lab', lora=None)\n"
        "ps = load_split('test', 2, limit=8)\n"
        "r = sample(model, tok, [build_prompt(p, model.config.kk_prompt_style, tok) for p in ps], greedy=True,"
        " max_new_tokens=320)\n"
        "print(sum(score_response(t, p).format_score > 0 for t, p in zip(r.texts, ps)))\n"
    )
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "empty_hf_home"),
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) >= 7, "the warm start writes well-formed answers"
    size = sum(f.stat().st_size for f in BUNDLED.iterdir())
    assert size < 30e6


@needs_bundle
def test_bundled_tokenizer_is_the_one_pretrain_builds():
    """The shipped tokenizer.json must encode exactly as build_tokenizer() does (what `lopti-lab pretrain` trains
    with), through the class load_policy gives back: a tokenizer class that re-splits digits or spaces would feed
    the warm-started model ids it never saw."""
    bundled = load_lab_model(BUNDLED)[1]
    rebuilt = build_tokenizer(style=PretrainConfig().trace)
    assert PretrainConfig().trace == RL_TRACE
    texts = []
    for seed in range(20):
        p = generate_puzzle(2 + seed % 4, seed=1000 + seed)
        texts += [build_prompt(p, LAB_PROMPT_STYLE, bundled), lab_response(p, None, RL_TRACE), lab_response(p)]
        texts += ["12 345 knights 0.5 <answer>"]
    for text in texts:
        ids = [tok(text, add_special_tokens=False)["input_ids"] for tok in (bundled, rebuilt)]
        assert ids[0] == ids[1], text
    assert len(bundled) == len(rebuilt)


def test_a_config_recorded_before_later_fields_is_read_as_it_was_trained(tmp_path):
    """`lopti-lab pretrain --config <lab_model.json>`: a record made before a field existed gets the value that field
    had then (the first lab model's record: compact traces, no length buckets, 256 new tokens, float32), a plain JSON
    of fields gets today's defaults for the rest, and an unreadable file is named."""
    from lopti_lab.lab.pretrain import FIELDS_BEFORE_RECORDED, config_fields

    first_model = {  # the config recorded in the first bundled lab model's lab_model.json
        "people": [2, 3, 4, 5], "people_weights": [1.0, 1.0, 1.0, 1.0], "curriculum_steps": 400, "steps": 2000,
        "max_minutes": 58.0, "batch_size": 32, "lr": 0.001, "warmup_steps": 50, "min_lr_ratio": 0.1,
        "weight_decay": 0.01, "grad_clip": 1.0, "seed": 0, "eval_every": 400, "eval_size": 40,
        "spec": {"hidden_size": 256, "intermediate_size": 640, "num_hidden_layers": 6, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 1024},
        "threads": None,
    }  # fmt: skip
    (tmp_path / "lab_model.json").write_text(json.dumps({"config": first_model, "steps_done": 2000}))
    config = PretrainConfig(**config_fields(tmp_path / "lab_model.json"))
    assert (config.trace, config.length_buckets, config.max_new_tokens, config.autocast) == (None, 1, 256, "float32")
    assert config.people == (2, 3, 4, 5) and config.batch_size == 32
    assert set(FIELDS_BEFORE_RECORDED) <= {f.name for f in dataclasses.fields(PretrainConfig)}
    (tmp_path / "fields.json").write_text(json.dumps({"steps": 5}))
    plain = PretrainConfig(**config_fields(tmp_path / "fields.json"))
    assert plain.steps == 5 and plain.autocast == PretrainConfig().autocast and plain.trace == PretrainConfig().trace
    with pytest.raises(ValueError, match=r"nothing\.json"):
        config_fields(tmp_path / "nothing.json")


def test_a_recorded_run_the_clock_stopped_is_reproduced_to_the_same_step(tmp_path):
    """A record whose run stopped before its ``steps`` (``max_minutes``) is read with ``stop_after`` at the step it
    reached, on the same schedule; the pretrain then stops there, and the learning rate of each step is unchanged."""
    from lopti_lab.lab.pretrain import config_fields

    recorded = dataclasses.asdict(PretrainConfig(steps=100))
    (tmp_path / "lab_model.json").write_text(json.dumps({"config": recorded, "steps_done": 37}))
    config = PretrainConfig(**config_fields(tmp_path / "lab_model.json"))
    assert (config.steps, config.stop_after) == (100, 37)
    assert [lr_at(s, config) for s in range(37)] == [lr_at(s, PretrainConfig(steps=100)) for s in range(37)]
    (tmp_path / "lab_model.json").write_text(json.dumps({"config": recorded, "steps_done": 100}))
    assert PretrainConfig(**config_fields(tmp_path / "lab_model.json")).stop_after is None
    spec = LabModelSpec(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    tiny = PretrainConfig(steps=5, stop_after=2, eval_every=10, spec=spec, final_people=(2,), final_size=1,
                          final_samples=1, max_new_tokens=8, threads=1)  # fmt: skip
    assert pretrain(tiny, tmp_path / "tiny", progress=False)["steps_done"] == 2


def test_start_from_carries_a_lab_model_over_to_another_vocabulary(tmp_path):
    """`lab.model.start_from` (the `init_from` of pretraining): every weight but the embedding is the folder's;
    each token's row is the folder's row of the same token string, a token the folder lacks starts at the mean row;
    on the folder's own vocabulary it is the folder's model itself; a model of another shape is refused."""
    from lopti_lab.lab.model import save_lab_model, start_from

    spec = LabModelSpec(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    old_tok = build_tokenizer(vocab_size=400, n_puzzles=200)
    old = build_model(old_tok, spec, seed=3)
    record = {"config": dataclasses.asdict(PretrainConfig(spec=spec)), "parameters": 1, "steps_done": 0, "minutes": 0}
    save_lab_model(old, old_tok, tmp_path / "old", record, prompt_style(RL_TRACE))

    same, share = start_from(tmp_path / "old", old_tok, spec)
    ids = torch.tensor([old_tok.encode("Aria says that Liam is a knave.")])
    assert share == 1.0
    torch.testing.assert_close(same(input_ids=ids).logits, old(input_ids=ids).logits, rtol=0, atol=0)

    new_tok = build_tokenizer(vocab_size=460, n_puzzles=200, seed=1)
    new, share = start_from(tmp_path / "old", new_tok, spec)
    old_vocab, new_vocab = old_tok.get_vocab(), new_tok.get_vocab()
    shared = sorted(set(old_vocab) & set(new_vocab))
    assert 0 < len(shared) < len(new_vocab) and share == pytest.approx(len(shared) / len(new_vocab))
    old_rows, new_rows = old.get_input_embeddings().weight, new.get_input_embeddings().weight
    for token in shared:
        assert torch.equal(new_rows[new_vocab[token]], old_rows[old_vocab[token]]), token
    lacking = next(t for t in new_vocab if t not in old_vocab)
    torch.testing.assert_close(new_rows[new_vocab[lacking]], old_rows.mean(0))
    assert new.lm_head.weight.data_ptr() == new_rows.data_ptr()  # the output layer stays tied to the embedding
    old_state = old.state_dict()
    for name, weight in new.state_dict().items():
        if "embed_tokens" not in name and name != "lm_head.weight":
            assert torch.equal(weight, old_state[name]), name

    with pytest.raises(ValueError, match="not a lab model of this shape"):
        start_from(tmp_path / "old", new_tok, dataclasses.replace(spec, num_hidden_layers=2))


def test_autocast_auto_trains_in_bf16_only_on_a_cpu_with_bf16_instructions(tmp_path):
    """Autocast "auto" picks bfloat16 where /proc/cpuinfo lists avx512_bf16 or amx_bf16 (a flag, not a prefix of
    one), else float32; explicit choices stand; the saved record names the precision that ran, so a replay trains the
    same way."""
    from lopti_lab.lab.pretrain import native_bf16, training_precision

    flags = {
        "avx2 avx512f avx512_bf16 fma": True,
        "amx_bf16 amx_tile avx2": True,
        "avx2 fma avx512f avx512bw": False,
        "avx512_bf16x": False,
    }
    for line, native in flags.items():
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {line}\n")
        assert native_bf16(info) is native, line
        assert training_precision("auto", info) == ("bfloat16" if native else "float32")
        assert training_precision("float32", info) == "float32" and training_precision("bfloat16", info) == "bfloat16"
    assert native_bf16(tmp_path / "missing") is False
    assert PretrainConfig().autocast == "auto"
    spec = LabModelSpec(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    cfg = PretrainConfig(steps=1, batch_size=2, eval_every=10, spec=spec, warmup_steps=1, final_people=(2,),
                         final_size=1, final_samples=1, max_new_tokens=8, threads=1)  # fmt: skip
    saved = pretrain(cfg, tmp_path / "lab", progress=False)["config"]["autocast"]
    assert saved == training_precision("auto")


@needs_bundle
def test_the_hard_lab_model_misreads_or_if_and_iff_as_and_where_the_demos_model_does_not():
    """The two bundled warm starts on the same 2-person test puzzles, their greedy traces read back: `lab-hard`
    writes the 'and' value at nearly every 'or' / 'if' / 'iff' claim true while the 'and' of its sides is false
    (its training traces did 60% of the time, so greedy takes it always), the demo's model at none; sampled at
    T = 1.0, `lab-hard` misreads about as often as it was taught."""
    hard, hard_tokenizer = load_policy("lab-hard", lora=None)
    lab, lab_tokenizer = load_policy("lab", lora=None)
    greedy_hard = audit_rollouts(hard, hard_tokenizer, HARD_TRACE, people=2, size=20, max_new_tokens=400)
    greedy_lab = audit_rollouts(lab, lab_tokenizer, RL_TRACE, people=2, size=20, max_new_tokens=400)
    assert greedy_hard["as_and_chances"] >= 8 and greedy_lab["as_and_chances"] >= 8
    assert greedy_hard["conflations"] >= 0.8 * greedy_hard["as_and_chances"]
    assert greedy_lab["conflations"] == 0
    assert greedy_hard["accuracy_all"] < greedy_lab["accuracy_all"]
    sampled = audit_rollouts(hard, hard_tokenizer, HARD_TRACE, people=2, size=20, max_new_tokens=400, samples=4)
    assert sampled["traces"] == 80
    rate, n = sampled["conflations"] / sampled["as_and_chances"], sampled["as_and_chances"]
    assert abs(rate - 0.6) < 4 * (0.6 * 0.4 / n) ** 0.5 + 0.05, (sampled["conflations"], n)
