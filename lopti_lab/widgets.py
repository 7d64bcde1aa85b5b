"""ipywidgets panels over the theory toy, the trainer and the run folders.

Every panel is a plain class: build it, set its controls' ``.value``, call the method its button calls (``run()``,
``stop()``, ``refresh()``), and read what it built (``config()``, ``result``, the figures in ``output``). That is how
the tests drive them without a browser; in a notebook, display the panel (``panel.widget`` or just ``panel``).

    SoftmaxExplorer   the softmax gradient of every token of a small vocabulary, under a temperature slider
    ToyPanel          the theory toy (GRPO / AR / Lopti / AR+Lopti) with its knobs
    TrainPanel        GRPO on K&K with AR and Lopti switches and a picker of the token-level methods after the paper,
                      Run and Stop, live plots, a progress bar
    MechanismPanel    the paper's Fig. 3 under the optimizer a switch picks, and why (measured on a frozen batch)
    ComparePanel      pick run folders, compare learning curves and final accuracy

Plots are drawn by ``lopti_lab.plots`` into ``Output`` widgets with ``clear_output(wait=True)``, so a refresh replaces
the figure without flicker.
"""

from __future__ import annotations

import base64
import gc
import io
import signal
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import ipywidgets as W
import pandas as pd
import torch
from IPython.display import display

from lopti_lab import methods, plan, plots, runs
from lopti_lab.methods import LOSSES, METHOD_FIELDS, METHODS, PAPER, Method, method_label, run_name
from lopti_lab.models import prompt_style_of
from lopti_lab.notebook import Environment, setup, training_defaults
from lopti_lab.studies.mechanism import OPTIMIZER_SETTINGS, decomposition
from lopti_lab.theory import grad_norm_bounds, logit_grad_norm
from lopti_lab.toy import ToyConfig, simulate
from lopti_lab.train_config import OPTIMIZERS, TrainConfig
from lopti_lab.trainer import train

# Matplotlib is not thread-safe (figures share its font cache), and a TrainPanel draws from its training thread while
# other panels draw on the kernel's main thread: every panel renders its figures under this lock.
_RENDER_LOCK = threading.Lock()


def _show(output: W.Output, *objects) -> None:
    """Replace what ``output`` shows by one assignment of its ``outputs`` trait, from any thread.

    This is ipywidgets' recipe for output from a background thread (its Output widget guide, "Interacting with output
    widgets from background threads"): display the Output from the main thread (each panel's cell does), then never
    enter ``with output:`` from another thread, since its capture would also take whatever the main thread prints at
    the time, and IPython's ``display`` / ``clear_output`` go to the cell the main thread is running, not to the
    widget. Setting the trait is a state update of that one widget, sent as a comm message whichever thread sets it.
    In one assignment the old figure stays until the new one arrives, so a refresh does not flicker.
    """
    from IPython.core.formatters import format_display_data
    from matplotlib.figure import Figure

    bundles = []
    for obj in objects:
        if isinstance(obj, Figure):  # rendered here, so it shows the same with or without a notebook's inline backend
            buffer = io.BytesIO()
            with _RENDER_LOCK:
                obj.savefig(buffer, format="png", dpi=90)
            data, metadata = {"image/png": base64.b64encode(buffer.getvalue()).decode(), "text/plain": repr(obj)}, {}
        else:
            data, metadata = format_display_data(obj)
        bundles.append({"output_type": "display_data", "data": data, "metadata": metadata})
    output.outputs = tuple(bundles)


class _Panel:
    widget: W.Widget

    def _ipython_display_(self) -> None:
        display(self.widget)


# ---------------------------------------------------------------------------------------------------------------------
# theory


def softmax_table(logits: Sequence[float], temperature: float = 1.0) -> pd.DataFrame:
    """For each token y of a small vocabulary: its probability softmax(z / tau)_y, the norm ||e_y - pi|| of the
    gradient of log pi_y with respect to the logits, and the two bounds (docs/paper.md §1)."""
    z = torch.tensor(list(logits), dtype=torch.float64) / temperature
    V = len(z)
    p = z.softmax(-1)
    norms = logit_grad_norm(z.expand(V, V), torch.arange(V))
    lower, upper = grad_norm_bounds(p.numpy(), V)
    columns = {"token": [f"t{i}" for i in range(V)], "prob": p.numpy(), "grad_norm": norms.numpy()}
    return pd.DataFrame({**columns, "lower": lower, "upper": upper})


class SoftmaxExplorer(_Panel):
    """A temperature slider over fixed logits: how each token's probability and gradient norm move together."""

    def __init__(self, logits: Sequence[float] = (4.0, 2.5, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0)):
        self.logits = list(logits)
        self.temperature = W.FloatLogSlider(value=1.0, base=10, min=-1, max=1, step=0.05, description="temperature")
        self.output = W.Output()
        self.temperature.observe(lambda _: self.refresh(), names="value")
        self.widget = W.VBox([self.temperature, self.output])
        self.refresh()

    def frame(self) -> pd.DataFrame:
        return softmax_table(self.logits, self.temperature.value)

    def refresh(self) -> None:
        _show(self.output, plots.softmax_gradients(self.frame(), self.temperature.value))


class ToyPanel(_Panel):
    """The theory toy with switches for the four methods, AR's alpha, Lopti's eta, the optimizer and the steps."""

    def __init__(self, steps: int = 30, seed: int = 0):
        defaults = ToyConfig()
        self.methods = {name: W.Checkbox(value=True, description=name, indent=False) for name in PAPER}
        self.alpha = W.FloatSlider(value=methods.AR_ALPHA, min=0.0, max=1.0, step=0.05, description="AR alpha")
        self.eta = W.FloatSlider(value=methods.LOPTI_ETA, min=0.05, max=0.95, step=0.05, description="Lopti eta")
        self.optimizer = W.ToggleButtons(options=["adam", "sgd"], value=defaults.optimizer, description="optimizer")
        self.steps = W.IntSlider(value=steps, min=2, max=200, description="steps")
        self.seed = W.IntText(value=seed, description="seed")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.run_button.on_click(lambda _: self.run())
        self.output = W.Output()
        self.result = None
        self.widget = W.VBox(
            [
                W.HBox(list(self.methods.values())),
                W.HBox([self.alpha, self.eta]),
                W.HBox([self.optimizer, self.steps, self.seed, self.run_button]),
                self.output,
            ]
        )

    def chosen(self):
        """The methods ticked, at the sliders' alpha and eta."""
        alpha, eta = self.alpha.value, self.eta.value
        return [METHODS[name].with_settings(alpha, eta) for name, box in self.methods.items() if box.value]

    def config(self):
        return ToyConfig(steps=self.steps.value, optimizer=self.optimizer.value, seed=self.seed.value)

    def run(self):
        methods = self.chosen()
        if not methods:
            _show(self.output, "Pick at least one method.")
            return None
        self.result = simulate(self.config(), methods)
        _show(self.output, plots.toy_dynamics(self.result))
        return self.result


# ---------------------------------------------------------------------------------------------------------------------
# training


def _in_kernel() -> bool:
    """True inside a live Jupyter kernel (a button press must not block it, or Stop could never be clicked)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


_LIVE_STOPS: set[threading.Event] = set()
"""The stop events of the panel runs in progress: a kernel interrupt sets them all."""


def _on_sigint(signum, frame) -> None:
    """A kernel interrupt while panel runs train: each stops after its current step, with a checkpoint. (Outside a
    cell ipykernel ignores SIGINT; inside one it raises KeyboardInterrupt there as always.)"""
    for event in list(_LIVE_STOPS):
        event.set()


def _stop_on_kernel_interrupt(event: threading.Event) -> None:
    """Make the kernel's interrupt (SIGINT) reach ``event`` while its run trains. ipykernel ignores SIGINT between
    messages and puts back, after each one, the handler it found before it (``kernel.saved_sigint_handler``), so the
    handler is installed there too; it stays installed (only the main thread may change it), and does nothing once
    the runs are over."""
    _LIVE_STOPS.clear()  # events of runs that are over
    _LIVE_STOPS.add(event)
    if not _in_kernel() or threading.current_thread() is not threading.main_thread():
        return  # outside a kernel SIGINT keeps Python's own handler (Ctrl-C raises KeyboardInterrupt)
    from IPython import get_ipython

    kernel = get_ipython().kernel
    signal.signal(signal.SIGINT, _on_sigint)
    if hasattr(kernel, "saved_sigint_handler"):
        kernel.saved_sigint_handler = _on_sigint


@dataclass(frozen=True)
class _Switch:
    """One method switch of the TrainPanel: its checkbox, its slider, the field it sets (``methods.METHOD_FIELDS``:
    the slider's value while ticked, else None), the value it offers when first switched on, the controls it enables."""

    box: W.Checkbox
    slider: W.FloatSlider
    field: str
    default: float
    follows: tuple[W.Widget, ...] = ()

    def __post_init__(self):
        self.slider.value = self.default
        self.box.observe(lambda _: self.follow(), names="value")
        self.follow()

    def show(self, value: float | None) -> None:
        """Tick the box and set the slider for a value; untick it for None (the slider keeps its value)."""
        self.box.value = value is not None
        if value is not None:
            self.slider.value = value

    def follow(self) -> None:
        for control in (self.slider, *self.follows):
            control.disabled = not self.box.value


class TrainPanel(_Panel):
    """GRPO on K&K with AR and Lopti switches: Run trains in the background (a run folder under ``run_root``), the
    plots refresh after every step, Stop ends the run cleanly after the current step (its records and a checkpoint
    are kept, so it can resume).

    The training thread talks to the page only by setting widget traits (progress, status, buttons, and the plot
    through ``_show``), which ipywidgets syncs from any thread; it never prints or displays, since a thread's output
    lands in whichever cell the main thread is running. ``base`` holds every setting the panel does not show
    (lengths, clip range, evaluation, ...).
    """

    def __init__(
        self, base=None, env: Environment | None = None, run_root: str | Path = "runs", regimes: dict | None = None
    ):
        env = env or setup()
        base = base or training_defaults(env)
        self.base, self.run_root, self.regimes = base, Path(run_root), dict(regimes or {})
        self.gpu = env.gpu  # the GPU the planner sizes a typed model's batches for (None on a CPU)
        # the lab's regimes (notebook.lab_regimes): picking one sets every setting to its TrainConfig
        self.regime = W.Dropdown(options=list(self.regimes), value=None, description="regime")
        self.model = W.Text(value=base.model, description="model")
        self._method_controls(base)
        self.optimizer = W.ToggleButtons(options=list(OPTIMIZERS), value=base.optimizer, description="optimizer")
        self.method.observe(lambda change: self._pick(change["new"]), names="value")
        self.regime.observe(lambda change: self._use(change["new"]), names="value")
        self.steps = W.IntText(value=base.steps, description="steps")
        self.lr = W.FloatLogSlider(value=base.lr, base=10, min=-7, max=-2, description="lr", readout_format=".1e")
        self.group_size = W.IntSlider(value=base.group_size, min=2, max=16, description="group size")
        self.prompts = W.IntSlider(value=base.prompts_per_step, min=1, max=64, description="prompts/step")
        self.name = W.Text(value="", placeholder="run name (default: method-time)", description="run")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="warning", icon="stop", disabled=True)
        self.progress = W.IntProgress(value=0, min=0, max=base.steps, description="steps")
        self.status = W.HTML()
        self.output = W.Output()
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.history: list[dict] = []
        self.result = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.widget = W.VBox(
            [
                *([self.regime] if self.regimes else []),
                W.HBox([self.model, self.name]),
                W.HBox([self.ar, self.alpha]),
                W.HBox([self.lopti, self.eta, self.order]),
                W.HBox([self.method, self.loss]),
                W.HBox([self.forking, self.rho, self.entropy_adv, self.ent_alpha]),
                W.HBox([self.steps, self.lr]),
                self.optimizer,
                W.HBox([self.prompts, self.group_size]),
                W.HBox([self.run_button, self.stop_button, self.progress, self.status]),
                self.output,
            ]
        )

    def _method_controls(self, base: TrainConfig) -> None:
        """The controls of the method's fields (``methods.METHOD_FIELDS``) set from ``base``, and the preset picker."""
        self.ar = W.Checkbox(description="Advantage Reweighting", indent=False)
        self.alpha = W.FloatSlider(min=0.0, max=1.0, step=0.05, description="alpha")
        self.lopti = W.Checkbox(description="Lopti", indent=False)
        self.eta = W.FloatSlider(min=0.05, max=0.95, step=0.05, description="eta")
        self.order = W.Dropdown(options=["low_first", "high_first"], description="order")
        # the token-level methods after the paper (docs/methods.md); TrainConfig refuses the combinations not defined
        self.loss = W.Dropdown(options=list(LOSSES), description="loss")
        self.forking = W.Checkbox(description="forking tokens", indent=False)
        self.rho = W.FloatSlider(min=0.05, max=1.0, step=0.05, description="rho")
        self.entropy_adv = W.Checkbox(description="entropy advantage", indent=False)
        self.ent_alpha = W.FloatSlider(min=0.0, max=2.0, step=0.05, description="alpha")
        # every place that reads or sets a switch (config, presets, regimes, locking) goes through this table
        self.switches = (
            _Switch(self.ar, self.alpha, "ar_alpha", methods.AR_ALPHA),
            _Switch(self.lopti, self.eta, "lopti_eta", methods.LOPTI_ETA, follows=(self.order,)),
            _Switch(self.forking, self.rho, "forking_rho", methods.FORKING_RHO),
            _Switch(self.entropy_adv, self.ent_alpha, "entropy_adv_alpha", methods.ENTROPY_ADV_ALPHA),
        )
        self.choices = {"lopti_order": self.order, "loss": self.loss}  # the method's other fields
        self._show_method(base)
        label = method_label(base)
        self.method = W.Dropdown(options=list(METHODS), value=label if label in METHODS else None, description="preset")

    def config(self):
        """The TrainConfig the controls describe (validated: a bad value raises ValueError naming the field)."""
        values = {
            "model": self.model.value.strip(),
            **self._method_fields(),
            "optimizer": self.optimizer.value,
            "steps": self.steps.value,
            "lr": self.lr.value,
            "group_size": self.group_size.value,
            "prompts_per_step": self.prompts.value,
        }
        if values["optimizer"] == "sgd":  # AdamW's betas and epsilon have no meaning there
            defaults = TrainConfig(model=self.base.model)
            values |= {"betas": defaults.betas, "adam_eps": defaults.adam_eps}
        batch = values["group_size"] * values["prompts_per_step"]
        if self.base.minibatch_size > batch or batch % self.base.minibatch_size:
            values["minibatch_size"] = batch  # the panel's batch changed: one minibatch per stage
        if values["model"] != self.base.model and self.base.prompt_style == prompt_style_of(self.base.model):
            values["prompt_style"] = None  # the base's style was its model's own: the typed model's own replaces it
        name = self.name.value.strip() or run_name(method_label(values))
        config = replace(self.base, run_dir=str(self.run_root / name), progress=False, **values)
        if self.gpu is not None and config.model != self.base.model and config.lora_r is not None:
            # a typed model gets batch sizes that fit it (or a ValueError naming what to lower)
            sized = replace(config, micro_batch_size=None, generate_batch_size=None)
            config = plan.resolve_batch_sizes(sized, plan.model_config(config.model), self.gpu)
        return config

    def _use(self, regime: str | None) -> None:
        """Make a regime's TrainConfig the panel's base and set every control from it (model, switches, optimizer,
        steps, lr, batch shape); the settings the panel does not show (people, evaluation, lengths) come with it."""
        if regime is None:
            return
        self.base = config = self.regimes[regime]
        self.model.value, self.optimizer.value = config.model, config.optimizer
        label = method_label(config)
        self.method.value = label if label in METHODS else None  # first: its preset's values give way to the config's
        self._show_method(config)
        self.steps.value, self.lr.value = config.steps, config.lr
        self.group_size.value, self.prompts.value = config.group_size, config.prompts_per_step
        self.progress.max = config.steps

    def _pick(self, label: str | None) -> None:
        """Set the method's controls to a registered method (``methods.METHODS``); they stay free to change."""
        if label is not None:
            self._show_method(METHODS[label])

    def _method_fields(self) -> dict:
        """The method's fields (``methods.METHOD_FIELDS``) as the controls set them; a switch that is off gives None."""
        switches = {s.field: s.slider.value if s.box.value else None for s in self.switches}
        values = switches | {field: control.value for field, control in self.choices.items()}
        return {field: values[field] for field in METHOD_FIELDS}

    def _show_method(self, holder: TrainConfig | Method) -> None:
        """Set the method's controls to the fields of a TrainConfig or a ``methods.Method``."""
        for switch in self.switches:
            switch.show(getattr(holder, switch.field))
        for field, control in self.choices.items():
            control.value = getattr(holder, field)

    def _on_step(self, metrics: dict) -> bool:
        self.history.append(metrics)
        self.progress.value = int(metrics["step"])
        self.status.value = (
            f"step {int(metrics['step'])}: reward {metrics['reward/mean']:.2f}, accuracy {metrics['acc/all']:.2f}"
        )
        _show(self.output, plots.live_training(self.history))
        return self._stop.is_set()

    @property
    def settings(self) -> list[W.Widget]:
        """The controls that set a run's config: locked while it trains (its config cannot change mid-run)."""
        return [self.regime, self.model, self.name, self.method, *(w for s in self.switches for w in (s.box, s.slider)),
                *self.choices.values(), self.optimizer, self.steps, self.lr, self.prompts, self.group_size]  # fmt: skip

    def _lock_settings(self, locked: bool) -> None:
        for control in self.settings:
            control.disabled = locked
        if not locked:  # each slider follows its switch again
            for switch in self.switches:
                switch.follow()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, block: bool | None = None):
        """Start training, or continue it: a run name whose folder holds an unfinished run of the same settings
        resumes from its last checkpoint (after a Stop, a kernel interrupt or a kernel restart). In a live kernel it
        runs in a background thread (so Stop stays clickable) unless ``block=True``; elsewhere it blocks and returns
        the TrainResult. While it runs, the settings are locked and Run says it is busy."""
        if self.running:
            self.status.value = "already running: Stop it first (it ends after the current step)"
            return None
        try:
            config = self.config()
        except ValueError as err:
            self.status.value = f"<b>bad setting</b>: {err}"
            return None
        resume = runs.RunFolder(config.run_dir).exists()
        self.history, self.result, self.error = [], None, None
        self._stop.clear()
        self.progress.max, self.progress.value = config.steps, 0
        verb = "resuming" if resume else "training"
        self.status.value = f"{verb} {config.method} into {config.run_dir} ..."
        # in this order, so that the page never shows Stop enabled beside a setting that is not locked
        self.run_button.disabled = True
        self._lock_settings(locked=True)
        self.stop_button.disabled = False
        _stop_on_kernel_interrupt(self._stop)

        def work():
            message = "ended"
            try:
                self.result = train(config, callbacks=[self._on_step], resume=resume)
                last = self.result.history[-1]["step"] if self.result.history else 0
                stopped = self.result.stopped or last < config.steps
                message = f"{'stopped' if stopped else 'done'} after step {last}: {config.run_dir}"
            except Exception as err:  # shown in the panel and kept; the thread must not die silently
                self.error = err
                message = f"<b>error</b>: {type(err).__name__}: {err}"
                if not threaded:
                    raise
            finally:
                # Stop off before the last word, so that a late click cannot leave "stopping ..." over it
                self.stop_button.disabled = True
                self.status.value = message
                # a finished run keeps its TrainResult (the trained model); a failed one keeps only its error (a
                # blocking run's caller gets the exception whole, its frames intact for a debugger)
                _release(self.error if threaded else None)
                self._lock_settings(locked=False)
                self.run_button.disabled = False

        threaded = _in_kernel() if block is None else not block
        if threaded:
            self._thread = threading.Thread(target=work, daemon=True)
            self._thread.start()
            return self._thread
        work()
        return self.result

    def stop(self) -> None:
        """Ask the run to end after its current step (a click that reaches the kernel after the run ended, from a
        page that had not yet seen Stop disabled, does nothing)."""
        if self.stop_button.disabled:
            return
        self._stop.set()
        self.status.value = "stopping after this step ..."

    def wait(self, timeout: float | None = None):
        """Block until a background run ends; its TrainResult."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result


def _release(err: BaseException | None) -> None:
    """Give back the memory a finished or failed run held: an exception kept for the page would keep, through its
    traceback's frames, the model, optimizer and activations of every call it passed (and a NonFiniteError its
    TrainResult's model), so its frames' locals are cleared; then the cycles are collected and CUDA's cached blocks
    returned, so that the next Run (or another notebook) can load a model on the same GPU."""
    while err is not None:
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)  # the message and the line numbers stay
        if getattr(err, "result", None) is not None:
            err.result = None
        err = err.__cause__ or err.__context__
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------------
# the mechanism


class MechanismPanel(_Panel):
    """The paper's Fig. 3 under one optimizer setting at a time (a switch), from a mechanism study's table
    (``studies.mechanism.fig3_source``), and, measured live on a frozen batch, why that optimizer moves the top bin's
    tokens as it does (``studies.mechanism.decomposition``: the share of their move that comes from the other bins)."""

    def __init__(self, table: pd.DataFrame, model, batch, optimizer: str = "sgd"):
        self.table, self.model, self.batch = table, model, batch
        choices = [o for o in OPTIMIZER_SETTINGS if o in set(table["optimizer"])] or list(OPTIMIZER_SETTINGS)
        self.optimizer = W.ToggleButtons(options=choices, value=optimizer if optimizer in choices else choices[0],
                                         description="optimizer")  # fmt: skip
        self.output = W.Output()
        self.parts: pd.DataFrame | None = None
        self.optimizer.observe(lambda _: self.refresh(), names="value")
        self.widget = W.VBox([self.optimizer, self.output])
        self.refresh()

    def refresh(self) -> None:
        chosen = self.optimizer.value
        self.parts = decomposition(self.model, self.batch, [chosen])
        _show(self.output, plots.fig3(self.table[self.table["optimizer"] == chosen]), self.parts.round(3))


# ---------------------------------------------------------------------------------------------------------------------
# comparing runs


def find_runs(root: str | Path = "runs") -> list[Path]:
    """Run folders (holding config.json and metrics.jsonl) at most two levels below ``root``."""
    root = Path(root)
    found = [
        p.parent
        for pattern in ("*/config.json", "*/*/config.json", "*/*/*/config.json")
        for p in root.glob(pattern)
        if (p.parent / "metrics.jsonl").is_file()
    ]
    return sorted(set(found))


COMPARED = ("reward/mean", "acc/all", "eval/sample/acc_all", "eval/greedy/acc_all")  # the training batch's, the test's


class ComparePanel(_Panel):
    """Pick run folders and compare them: learning curves, final test accuracy by people count, gradient shares."""

    def __init__(self, root: str | Path = "runs", metrics: Sequence[str] = COMPARED):
        self.root, self.wanted = Path(root), tuple(metrics)
        self.runs = W.SelectMultiple(description="runs", rows=8, layout=W.Layout(width="60%"))
        self.metrics = W.SelectMultiple(options=list(metrics), value=list(metrics), description="metrics", rows=8)
        self.smooth = W.IntSlider(value=1, min=1, max=20, description="smoothing")
        self.refresh_button = W.Button(description="Rescan", icon="refresh")
        self.show_button = W.Button(description="Compare", button_style="primary", icon="chart-line")
        self.output = W.Output()
        self.refresh_button.on_click(lambda _: self.refresh())
        self.show_button.on_click(lambda _: self.show())
        self.long: pd.DataFrame | None = None
        self.widget = W.VBox(
            [
                W.HBox([self.runs, self.metrics]),
                W.HBox([self.smooth, self.refresh_button, self.show_button]),
                self.output,
            ]
        )
        self.refresh()

    def refresh(self) -> None:
        """Rescan the root folder for runs (all selected by default)."""
        found = [str(p) for p in find_runs(self.root)]
        self.runs.options = found
        self.runs.value = tuple(found)
        if self.long is None:
            known = set(self.metrics.options)
            for path in found[:20]:
                known |= {k for k in _metric_keys(path)}
            self.metrics.options = sorted(known)
            self.metrics.value = [m for m in self.wanted if m in known]

    def show(self):
        """Draw the comparison of the selected runs; returns the tidy table it drew from."""
        chosen = list(self.runs.value)
        if not chosen:
            _show(self.output, "No run selected (train one with the TrainPanel or `lopti-lab train`).")
            return None
        self.long = runs.compare(chosen)
        shown = [
            plots.learning_curves(self.long, list(self.metrics.value) or ["reward/mean"], smooth=self.smooth.value)
        ]
        table = final_accuracy(self.long)
        if not table.empty:
            shown.append(table)
        if self.long["metric"].str.startswith("grad/share_bin").any():
            shown.append(plots.gradient_share(self.long))
        _show(self.output, *shown)
        return self.long


def _metric_keys(run_dir: str | Path) -> set[str]:
    records = runs.load_metrics(run_dir)
    return {k for r in records[:3] for k, v in r.items() if isinstance(v, int | float) and k != "step"}


def final_accuracy(long: pd.DataFrame, mode: str = "sample") -> pd.DataFrame:
    """The last evaluation of each run, per people count and averaged: the paper's table layout, one row per run."""
    evals = long[long["metric"].str.match(rf"^eval/{mode}/acc_(\d+ppl|all)$")]
    if evals.empty:
        return pd.DataFrame()
    last = evals.sort_values("step").groupby(["run", "method", "metric"]).tail(1)
    table = last.pivot_table(index=["run", "method"], columns="metric", values="value")
    table.columns = [c.split("acc_")[-1].replace("all", "avg") for c in table.columns]
    ordered = sorted((c for c in table.columns if c != "avg"), key=lambda c: int(c.removesuffix("ppl")))
    return table[[*ordered, "avg"]].round(3)
