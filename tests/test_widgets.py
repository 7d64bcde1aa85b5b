"""The notebook panels, driven without a browser: set controls, press buttons, read configs, outputs and run folders."""

import json
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from tiny import fake_score

from lopti_lab import evaluate, notebook, runs, theory, trainer, widgets
from lopti_lab.train_config import TrainConfig


def shows_png(output) -> bool:
    return len(output.outputs) == 1 and len(output.outputs[0]["data"].get("image/png", "")) > 1000


@pytest.fixture()
def base(model_dir, monkeypatch):
    monkeypatch.setattr(evaluate, "score_response", fake_score)
    return TrainConfig(
        model=str(model_dir),
        lora_r=4,
        lora_alpha=8,
        prompt_style="base",
        train_people=(3,),
        train_limit=8,
        eval_people=(),
        prompts_per_step=2,
        group_size=4,
        minibatch_size=8,
        max_new_tokens=8,
        lr=1e-3,
        steps=2,
        save_every=0,
        probe_every=1,
        progress=False,
    )


def test_setup_picks_the_lab_model_on_cpu():
    from lopti_lab.lab.trace import prompt_style
    from lopti_lab.paths import lab_model_dir

    env = notebook.setup(quick=True)
    assert (env.model, env.lora_r, env.device) == ("lab", None, "cpu")
    trace = json.loads((lab_model_dir() / "lab_model.json").read_text())["config"]["trace"]
    from lopti_lab.lab.pretrain import PretrainConfig

    assert env.prompt_style == prompt_style(PretrainConfig(trace=trace).trace)  # the prompt the bundled model learned
    assert notebook.setup(model="Qwen/Qwen2.5-0.5B-Instruct").lora_r == 16
    assert "lab" in env._repr_markdown_()


def test_softmax_explorer_follows_the_temperature():
    panel = widgets.SoftmaxExplorer(logits=[3.0, 1.0, 0.0, -1.0])
    cold = panel.frame()
    panel.temperature.value = 0.2
    hot = panel.frame()
    assert shows_png(panel.output), "a refresh replaces the figure instead of stacking a second one"
    assert hot["prob"].iloc[0] > cold["prob"].iloc[0] and hot["grad_norm"].iloc[0] < cold["grad_norm"].iloc[0]
    z = torch.tensor([3.0, 1.0, 0.0, -1.0], dtype=torch.float64) / 0.2
    expected = theory.logit_grad_norm(z.expand(4, 4), torch.arange(4)).numpy()
    np.testing.assert_allclose(hot["grad_norm"], expected, rtol=1e-12)
    assert ((hot["lower"] <= hot["grad_norm"] + 1e-12) & (hot["grad_norm"] <= hot["upper"] + 1e-12)).all()


def test_toy_panel_runs_the_chosen_methods():
    panel = widgets.ToyPanel(steps=3)
    panel.methods["GRPO+Lopti"].value = False
    panel.alpha.value = 0.6
    result = panel.run()
    assert list(result.steps["method"].unique()) == ["GRPO", "GRPO+AR", "GRPO+AR+Lopti"]
    assert [m.ar_alpha for m in panel.chosen()] == [None, 0.6, 0.6]
    assert shows_png(panel.output)
    for box in panel.methods.values():
        box.value = False
    assert panel.run() is None and "at least one" in panel.output.outputs[0]["data"]["text/plain"]


def test_train_panel_toggles_build_the_right_config(base, tmp_path):
    panel = widgets.TrainPanel(base=base, run_root=tmp_path)
    cfg = panel.config()
    assert (cfg.ar_alpha, cfg.lopti_eta, cfg.method) == (None, None, "GRPO")
    panel.ar.value, panel.alpha.value = True, 0.25
    assert panel.config().ar_alpha == 0.25 and panel.config().method == "GRPO+AR"
    assert panel.eta.disabled and not panel.alpha.disabled
    panel.lopti.value, panel.eta.value, panel.order.value = True, 0.4, "high_first"
    cfg = panel.config()
    assert (cfg.lopti_eta, cfg.lopti_order, cfg.method) == (0.4, "high_first", "GRPO+AR+Lopti(high-first)")
    panel.ar.value = False
    assert panel.config().ar_alpha is None
    panel.group_size.value, panel.prompts.value = 3, 5
    cfg = panel.config()
    assert cfg.batch_size == 15 and 15 % cfg.minibatch_size == 0
    panel.name.value = "mine"
    assert panel.config().run_dir == str(tmp_path / "mine")
    assert panel.config().optimizer == "adamw"
    demo_like = widgets.TrainPanel(base=replace(base, adam_eps=1e-3), run_root=tmp_path)  # the demo's AdamW epsilon
    demo_like.optimizer.value = "sgd"  # the paper's Fig. 1 / Fig. 3 optimizer: AdamW's settings are put back
    cfg = demo_like.config()
    assert (cfg.optimizer, cfg.adam_eps, cfg.betas) == ("sgd", 1e-8, (0.9, 0.999))


def test_train_panel_method_picker_sets_every_registered_method(base, tmp_path):
    from lopti_lab.methods import METHODS

    panel = widgets.TrainPanel(base=base, run_root=tmp_path)
    for label, method in METHODS.items():
        panel.method.value = label
        cfg = panel.config()
        assert cfg.method == label, label
        assert all(getattr(cfg, key) == value for key, value in method.overrides().items()), label
    panel.method.value = "GRPO+CISPO"
    panel.ar.value, panel.forking.value, panel.rho.value = True, True, 0.3
    cfg = panel.config()
    assert (cfg.loss, cfg.ar_alpha, cfg.forking_rho, cfg.method) == ("cispo", 0.3, 0.3, "GRPO+AR+Forking+CISPO")
    panel.method.value = "GRPO+Clip-Cov"
    panel.lopti.value = True  # Clip-Cov's random drop has no meaning inside Lopti's two stages: refused by name
    assert panel.run(block=True) is None
    assert "bad setting" in panel.status.value and "loss" in panel.status.value
    assert not list(tmp_path.iterdir())


def test_train_panel_run_writes_a_run_folder_and_plots(base, tmp_path):
    panel = widgets.TrainPanel(base=base, run_root=tmp_path)
    panel.lopti.value = True
    panel.name.value = "lopti"
    result = panel.run(block=True)
    assert result is not None and not result.stopped and panel.error is None
    assert [m["step"] for m in runs.load_metrics(tmp_path / "lopti")] == [1, 2]
    assert runs.latest_checkpoint(tmp_path / "lopti") is not None
    assert panel.progress.value == 2 and "done" in panel.status.value
    assert shows_png(panel.output)
    assert not panel.run_button.disabled and panel.stop_button.disabled


def test_stop_ends_the_run_after_the_current_step(base, tmp_path):
    panel = widgets.TrainPanel(base=base, run_root=tmp_path)
    panel.steps.value, panel.name.value = 200, "stopped"
    thread = panel.run(block=False)
    deadline = time.time() + 120
    while not panel.history and time.time() < deadline:
        time.sleep(0.05)
    assert panel.history, "the first step did not finish in time"
    panel.stop_button.click()
    result = panel.wait(timeout=120)
    assert not thread.is_alive()
    assert result.stopped and 1 <= len(result.history) < 200
    records = runs.load_metrics(tmp_path / "stopped")
    assert [r["step"] for r in records] == [m["step"] for m in result.history], "every finished step is on disk"
    assert runs.latest_checkpoint(tmp_path / "stopped").name == f"step_{records[-1]['step']}"
    assert "stopped" in panel.status.value


def test_bad_setting_is_reported_not_run(base, tmp_path):
    panel = widgets.TrainPanel(base=base, run_root=tmp_path)
    panel.model.value = str(tmp_path / "missing" / "model")
    assert panel.run(block=True) is None
    assert "bad setting" in panel.status.value and "model" in panel.status.value
    assert not list(tmp_path.iterdir())


def test_compare_panel_reads_run_folders(base, tmp_path):
    from dataclasses import replace

    for name, extra in (("grpo", {}), ("ar", {"ar_alpha": 0.3})):
        trainer.train(replace(base, run_dir=str(tmp_path / name), **extra))
    panel = widgets.ComparePanel(root=tmp_path)
    assert sorted(panel.runs.options) == sorted(str(tmp_path / n) for n in ("ar", "grpo"))
    assert "reward/mean" in panel.metrics.options and "grad/share_bin0" in panel.metrics.options
    # picked at first: the training batch's reward and accuracy, and the test accuracy where a run evaluated
    assert widgets.COMPARED[2:] == ("eval/sample/acc_all", "eval/greedy/acc_all")
    assert list(panel.metrics.value) == list(widgets.COMPARED)  # these runs evaluated once, at their end
    long = panel.show()
    assert set(long["method"]) == {"GRPO", "GRPO+AR"}
    assert len(panel.output.outputs) == 2  # learning curves and the gradient shares (no evaluation in these runs)
    panel.runs.value = ()
    assert panel.show() is None


def test_the_training_panel_on_a_cpu_runs_the_demos_grpo_with_an_evaluation_halfway():
    """Notebook 04's Run on the lab model: the demo's GRPO settings (so its curves match the demo's), with test
    evaluations at the middle and the end of the run instead of the end only."""
    from dataclasses import replace
    from pathlib import Path

    from lopti_lab.studies.config import DemoConfig

    env = notebook.setup(quick=False, device="cpu")
    config = notebook.training_defaults(env)
    demo = DemoConfig().train_config("GRPO", 0, Path("runs") / "unnamed")
    assert replace(config, eval_every=demo.eval_every) == demo
    assert config.eval_every == 5 and config.steps == 10 and config.prompt_style == env.prompt_style


def test_the_training_panel_picks_the_hard_lab_regime_and_back(tmp_path):
    """Notebook 04's regime picker: "hard lab" makes the panel's run the hard lab study's GRPO run (every setting,
    shown or not), the switches still free on top of it; "demo lab" puts the demo's settings back."""
    from lopti_lab.studies.config import HardLabConfig

    env = notebook.setup(quick=False, device="cpu")
    regimes = notebook.lab_regimes(env)
    assert list(regimes) == ["demo lab", "hard lab"] and notebook.lab_regimes(notebook.setup(model="Qwen/x")) == {}
    panel = widgets.TrainPanel(base=regimes["demo lab"], env=env, regimes=regimes, run_root=tmp_path)
    assert panel.regime in panel.settings  # locked while a run trains, like every setting
    panel.regime.value = "hard lab"
    study_run = HardLabConfig().train_config("GRPO", 0, tmp_path / "unnamed")
    cfg = panel.config()
    assert replace(cfg, run_dir=None) == replace(study_run, run_dir=None, progress=False)
    assert panel.progress.max == study_run.steps and panel.model.value == "lab-hard"
    panel.ar.value = True
    cfg = panel.config()
    assert (cfg.method, cfg.model, cfg.eval_people) == ("GRPO+AR", "lab-hard", study_run.eval_people)
    panel.regime.value = "demo lab"
    cfg = panel.config()
    assert (cfg.model, cfg.method, cfg.steps) == ("lab", "GRPO", regimes["demo lab"].steps)
    assert replace(cfg, run_dir=None) == replace(regimes["demo lab"], run_dir=None, progress=False)


def test_a_failed_run_shows_its_error_and_gives_the_memory_back(base, tmp_path, monkeypatch):
    """A run that fails (here: at its first step, as a CUDA out-of-memory would) leaves the error on the page and
    nothing that holds its model: the exception's frames are cleared, then gc and CUDA's cache release (faked: no GPU
    here) run, so a second Run can load a model on the same GPU."""
    import gc
    import weakref

    held = {}

    def failing_train(config, callbacks=(), resume=False):
        model = torch.nn.Linear(4, 4)  # what the real train holds in its frame when a step fails
        held["model"] = weakref.ref(model)
        raise RuntimeError("CUDA out of memory (faked)")

    calls = []
    monkeypatch.setattr(widgets, "train", failing_train)
    collect = gc.collect
    monkeypatch.setattr(widgets.gc, "collect", lambda: calls.append("gc") or collect())
    panel = widgets.TrainPanel(base=base, run_root=tmp_path)
    monkeypatch.setattr(widgets.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(widgets.torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    panel.run(block=False)
    panel.wait(timeout=60)
    assert "error" in panel.status.value and "CUDA out of memory (faked)" in panel.status.value
    assert isinstance(panel.error, RuntimeError) and panel.result is None
    assert calls == ["gc", "empty_cache"]
    assert held["model"]() is None, "the failed run's model is still referenced"
    assert not panel.run_button.disabled and panel.stop_button.disabled  # ready for another Run


def test_typing_a_hub_model_into_a_lab_panel_takes_the_instruct_prompt(tmp_path, model_dir):
    """The lab model's quiz prompt was made for it: a hub id typed into the model box gets "instruct"; a lab folder
    that names another quiz style gets that one; the base's own explicit hub style stays with any model."""
    lab = notebook.training_defaults(notebook.setup(quick=True, device="cpu"))
    panel = widgets.TrainPanel(base=lab, run_root=tmp_path)
    assert panel.config().prompt_style == lab.prompt_style != "instruct"
    panel.model.value = "Qwen/Qwen2.5-1.5B-Instruct"
    assert panel.config().prompt_style == "instruct"
    other = tmp_path / "other_lab"
    other.mkdir()
    for file in model_dir.iterdir():
        (other / file.name).write_bytes(file.read_bytes())
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "kk_prompt_style": "chat_quiz_numbered"}))
    panel.model.value = str(other)
    assert panel.config().prompt_style == "chat_quiz_numbered"
    based = widgets.TrainPanel(base=replace(lab, model=str(model_dir), prompt_style="base"), run_root=tmp_path)
    based.model.value = "Qwen/Qwen2.5-1.5B-Instruct"
    assert based.config().prompt_style == "base"


def test_gpu_defaults_come_from_the_planner_and_a_typed_model_is_resized():
    """On a GPU (a T4 planned for, no GPU needed) setup picks the first Qwen2.5 that fits with at least two rows a
    micro-batch, in float16, and the panel re-sizes the batches of a model typed in (re-resolving its prompt style)."""
    from lopti_lab import plan

    env = notebook.setup(quick=False, device="cpu", gpu="t4")
    model, cfg, note = notebook.gpu_defaults(plan.GPUS["t4"])
    assert env.model == model == notebook.GPU_MODELS[0] and "float16 with loss scaling" in note
    assert plan.estimate(cfg, plan.model_config(model), "t4").peak <= plan.GPUS["t4"].usable
    assert cfg.micro_batch_size >= notebook.MIN_MICRO_BATCH and cfg.probe_every == 10
    bigger = replace(cfg, micro_batch_size=cfg.micro_batch_size * 2)
    with pytest.raises(ValueError, match="micro_batch_size"):  # the planner's choice is the largest that fits
        plan.check_fits(bigger, plan.model_config(model), "t4")
    panel = widgets.TrainPanel(env=env)
    assert panel.config().micro_batch_size == cfg.micro_batch_size
    panel.model.value = "Qwen/Qwen2.5-0.5B-Instruct"
    small = panel.config()
    assert small.micro_batch_size > cfg.micro_batch_size and small.prompt_style == "instruct"
    h100 = notebook.gpu_defaults(plan.GPUS["h100"])
    assert h100[0] == "Qwen/Qwen2.5-3B-Instruct" and "bfloat16" in h100[2]


def test_after_a_run_each_slider_follows_its_switch_again(base, tmp_path, monkeypatch):
    """While a run trains every setting is locked; when it ends they unlock, but a slider whose switch is off (here:
    all but Lopti's) stays greyed out as it was before the run, and ticking its switch still enables it."""
    sliders = ("alpha", "eta", "order", "rho", "ent_alpha")
    panel = widgets.TrainPanel(base=base, run_root=tmp_path)
    panel.lopti.value = True
    before = {name: getattr(panel, name).disabled for name in sliders}
    assert before == {"alpha": True, "eta": False, "order": False, "rho": True, "ent_alpha": True}
    locked = []

    def quick_train(config, callbacks=(), resume=False):
        locked.extend(control.disabled for control in panel.settings)
        return trainer.TrainResult(config.run_dir, model=None, tokenizer=None, config=config, history=[{"step": 2}])

    monkeypatch.setattr(widgets, "train", quick_train)
    assert panel.run(block=True) is not None and "done" in panel.status.value
    assert locked and all(locked)
    assert {name: getattr(panel, name).disabled for name in sliders} == before
    assert not panel.model.disabled and not panel.forking.disabled and not panel.method.disabled
    panel.forking.value = True
    assert not panel.rho.disabled


def test_the_panel_shows_a_configs_own_switch_values(base, tmp_path):
    """A base or a regime whose switch values differ from the presets' (AR at alpha 0, rho 0.35, ...) is what the
    panel's config gives back, not a preset's default."""
    exact = replace(base, ar_alpha=0.0, entropy_adv_alpha=0.8)
    shown = widgets.TrainPanel(base=exact, run_root=tmp_path).config()
    assert replace(shown, run_dir=None) == replace(exact, run_dir=None, progress=False)
    regime = replace(base, ar_alpha=0.25, forking_rho=0.35)  # "GRPO+AR+Forking" at its own settings
    panel = widgets.TrainPanel(base=base, run_root=tmp_path, regimes={"mine": regime})
    panel.regime.value = "mine"
    assert panel.method.value == "GRPO+AR+Forking"
    assert replace(panel.config(), run_dir=None) == replace(regime, run_dir=None, progress=False)
