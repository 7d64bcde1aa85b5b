"""examples/trl: what can be checked of the GPU configs without a GPU, and the trl extra's install story.

DeepSpeed and vLLM cannot run on this CPU machine: the accelerate configs are checked by accelerate's own loader
and launch validation (which builds the environment a real launch would export), the recipes by parsing them into
the script's dataclasses. Neither says that a GPU run works; docs/trl.md says what was run.
"""

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[trl]')")

from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from trl import ModelConfig, TrlParser

from lopti_lab.integrations.trl import LoptiGRPOConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "trl"
CONFIGS = {
    "single_gpu": ("NO", 1, None),
    "multi_gpu": ("MULTI_GPU", 4, None),
    "deepspeed_zero2": ("DEEPSPEED", 4, "2"),
    "deepspeed_zero3": ("DEEPSPEED", 4, "3"),
}


def train_kk():
    spec = importlib.util.spec_from_file_location("train_kk", EXAMPLES / "train_kk.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_kk"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(CONFIGS))
def test_accelerate_accepts_each_launch_config(name):
    path = EXAMPLES / "accelerate" / f"{name}.yaml"
    kind, processes, zero_stage = CONFIGS[name]
    config = load_config_from_file(str(path))
    assert config.distributed_type.value == kind and config.num_processes == processes
    args = launch_command_parser().parse_args(["--config_file", str(path), str(EXAMPLES / "train_kk.py")])
    args, defaults, _ = _validate_launch_command(args)
    assert args.num_processes == processes
    if zero_stage is not None:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
        assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == zero_stage
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    elif kind == "MULTI_GPU":
        assert args.multi_gpu and "ACCELERATE_MIXED_PRECISION" in prepare_multi_gpu_env(args)


@pytest.mark.parametrize("recipe", ["kk_qwen2.5_3b", "kk_qwen2.5_3b_vllm"])
def test_recipes_parse_into_the_papers_layout(recipe):
    """On 4 processes: 64 prompts x 8 = 512 responses per RL step, minibatches of 256, 4 optimizer steps per RL step
    with Lopti. (use_cpu only because bf16 needs a GPU here.)"""
    module = train_kk()
    parser = TrlParser((module.KKArguments, LoptiGRPOConfig, ModelConfig))
    recipe_file = EXAMPLES / "recipes" / f"{recipe}.yaml"
    data, args, model = parser.parse_args_and_config(["--config", str(recipe_file), "--use_cpu", "true"])
    processes = 4
    assert args.per_device_train_batch_size * processes * args.steps_per_generation == 64 * args.num_generations
    assert args.per_device_train_batch_size * processes * args.gradient_accumulation_steps == 256
    assert args.optimizer_steps_per_generation == 4 and args.max_steps == 4 * args.rl_steps
    assert args.save_steps % args.optimizer_steps_per_generation == 0
    assert (args.ar_alpha, args.lopti_eta, args.loss_type, args.temperature) == (0.3, 0.5, "dapo", 0.7)
    assert (args.epsilon, args.epsilon_high, args.delta, args.beta) == (0.2, 0.24, 10.0, 0.001)
    assert not args.use_bias_correction_kl and args.learning_rate == 1e-6 and args.weight_decay == 0.01
    assert model.model_name_or_path == "Qwen/Qwen2.5-3B-Instruct" and data.people == "3-7"
    assert args.use_vllm == recipe.endswith("vllm")
    if args.use_vllm:
        assert args.vllm_mode == "colocate" and not args.vllm_importance_sampling_correction


def test_example_script_rejects_bad_settings_before_loading_anything(capsys):
    module = train_kk()
    with pytest.raises(ValueError, match=r"LoptiGRPOConfig.lopti_eta must be a finite number > 0.0 and < 1.0"):
        module.main(
            ["--model_name_or_path", "lab", "--lopti_eta", "1.5", "--output_dir", "unused", "--use_cpu", "true"]
        )
    with pytest.raises(SystemExit):
        module.main(["--output_dir", "unused", "--use_cpu", "true"])
    assert "--model_name_or_path is required" in capsys.readouterr().err


def test_the_trl_extra_is_pinned_installed_by_setup_and_mirrored_in_environment_yml():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["trl"]
    trl_pin = next(r for r in extra if r.startswith("trl"))
    assert re.fullmatch(r"trl>=[\d.]+,<[\d.]+", trl_pin), trl_pin  # a tested range, upper bound included
    from lopti_lab.integrations.trl import TESTED_TRL

    assert trl_pin == f"trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}"
    env = (ROOT / "environment.yml").read_text()
    for requirement in extra:
        assert f"- {requirement}\n" in env, f"environment.yml should pin {requirement}"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    default_extras = re.search(r"EXTRAS:-([\w,]+)", setup).group(1).split(",")
    assert {"test", "trl"} <= set(default_extras)  # CI (setup.sh + pytest) installs and tests the trl extra


@pytest.mark.parametrize(
    ("native", "flags", "full", "lora"),
    [
        ("bfloat16", (True, False), "float32", "bfloat16"),  # compute capability >= 8.0: float32 master weights
        ("float16", (False, True), "float32", "float16"),  # a T4: the same, unless the base is frozen (LoRA)
        ("float32", (False, False), "float32", "float32"),  # a CPU
    ],
)
def test_the_one_gpu_command_trains_in_the_devices_precision(monkeypatch, native, flags, full, lora):
    """Without --dtype / --bf16 / --fp16 the script takes models.resolve_dtype("auto") of the device (faked here):
    the mixed-precision flags and the weights' dtype agree; a recipe's or the command line's own values win."""
    module = train_kk()
    monkeypatch.setattr(module, "resolve_dtype", lambda dtype, device: getattr(torch, native))

    def parse(*argv):
        parser = TrlParser((module.KKArguments, LoptiGRPOConfig, ModelConfig))
        parser.set_defaults(**module.precision_defaults())
        _, args, model_args = parser.parse_args_and_config(["--output_dir", "unused", *argv])
        return args, model_args

    # bf16 without a GPU is refused by TrainingArguments: its device check is faked too
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    args, model_args = parse()
    assert (args.bf16, args.fp16) == flags
    assert module.model_dtype(args, model_args) == full
    args, model_args = parse("--use_peft", "true")
    assert module.model_dtype(args, model_args) == lora
    args, model_args = parse("--bf16", "false", "--fp16", "false", "--dtype", "float32")
    assert (args.bf16, args.fp16, module.model_dtype(args, model_args)) == (False, False, "float32")


def probe_any_run():
    train_kk()  # probe_any_run imports train_kk as a sibling script
    spec = importlib.util.spec_from_file_location("probe_any_run", EXAMPLES / "probe_any_run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["probe_any_run"] = module
    spec.loader.exec_module(module)
    return module


def test_probe_any_run_rejects_bad_settings_before_loading_anything(capsys):
    module = probe_any_run()
    with pytest.raises(SystemExit):
        module.main(["--model_name_or_path", "lab", "--fig3_precision", "bf16", "--output_dir", "unused",
                     "--use_cpu", "true"])  # fmt: skip
    assert "--fig3_precision must be one of ('float32', 'float64')" in capsys.readouterr().err


def test_probe_any_run_draws_every_panel_from_logged_rows(tmp_path):
    """The PNG from two logged rows (a bin with no token is a gap, None in the log)."""
    module = probe_any_run()
    keys = [key.format(precision="float32") for key, _ in module.PANELS]
    rows = [{"step": s, **{f"{k}_bin{b}": (None if b == 1 else 0.1 * (b + s)) for k in keys for b in range(4)}}
            for s in (1, 2)]  # fmt: skip
    module.draw(rows, tmp_path / "credit.png", "float32")
    png = (tmp_path / "credit.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
