"""ipywidgets panels over the theory toy, the trainer and the run folders.

Every panel is a plain class: build it, set its controls' ``.value``, call the method its button calls (``run()``,
``stop()``, ``refresh()``), and read what it built (``config()``, ``result``, the figures in ``output``). That is how
the tests drive them without a browser; in a notebook, display the panel (``panel.widget`` or just ``panel``).

    SoftmaxExplorer   the softmax gradient of every token of a small vocabulary, under a temperature slider
    ToyPanel          the theory toy (GRPO / AR / Lopti / AR+Lopti) with its knobs
    TrainPanel        GRPO on K&K with AR and Lopti switches, Run and Stop, live plots, a progress bar
    ComparePanel      pick run folders, compare learning curves and final accuracy

Plots are drawn by ``lopti_lab.plots`` into ``Output`` widgets with ``clear_output(wait=True)``, so a refresh replaces
the figure without flicker.
"""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import ipywidgets as W
import pandas as pd
from IPython.display import display

from lopti_lab import plots

# ---------------------------------------------------------------------------------------------------------------------
# the notebooks' first cell


@dataclass(frozen=True)
class Environment:
    """What the first cell of every notebook decides: where we run and which policy we train."""

    in_colab: bool
    device: str
    """"cuda" or "cpu"."""
    model: str
    """A Qwen2.5 Instruct hub id on a GPU, "lab" (the bundled lab model) on a CPU."""
    lora_r: int | None
    """LoRA rank for hub models; None (full fine-tuning) for the tiny lab model."""
    prompt_style: str
    """"instruct" (the Logic-RL prompt) for Qwen, "chat_quiz" (the quiz alone) for the lab model."""
    quick: bool

    def _repr_markdown_(self) -> str:
        where = "Colab" if self.in_colab else "local"
        tuning = "full fine-tuning" if self.lora_r is None else f"LoRA r={self.lora_r}"
        return (
            f"**{where}, {self.device}**: policy `{self.model}` ({tuning}, prompt style `{self.prompt_style}`)"
            f"{', QUICK mode' if self.quick else ''}"
        )


def setup(quick: bool = False, model: str | None = None, device: str | None = None) -> Environment:
    """Detect Colab and a GPU and pick the policy: Qwen/Qwen2.5-1.5B-Instruct with LoRA on a GPU, the lab model on a
    CPU (and always in QUICK mode). Pass ``model`` to override (any hub id, local folder or "lab")."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if model is None:
        model = "Qwen/Qwen2.5-1.5B-Instruct" if device == "cuda" and not quick else "lab"
    lab = model == "lab"
    return Environment(
        in_colab="google.colab" in sys.modules,
        device=device,
        model=model,
        lora_r=None if lab else 16,
        prompt_style="chat_quiz" if lab else "instruct",
        quick=quick,
    )


def _show(output: W.Output, *objects) -> None:
    """Replace what ``output`` shows in one assignment: the old figure stays until the new one is rendered, so a
    refresh does not flicker (and the widget state is the same with or without a browser attached)."""
    from IPython.core.formatters import format_display_data
    from matplotlib.figure import Figure

    bundles = []
    for obj in objects:
        if isinstance(obj, Figure):  # rendered here, so it shows the same with or without a notebook's inline backend
            buffer = io.BytesIO()
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
    gradient of log pi_y with respect to the logits, and the two bounds (PAPER.md §2)."""
    import torch

    from lopti_lab.theory import grad_norm_bounds, logit_grad_norm

    z = torch.tensor(list(logits), dtype=torch.float64) / temperature
    V = len(z)
    p = z.softmax(-1)
    norms = logit_grad_norm(z.expand(V, V), torch.arange(V))
    lower, upper = grad_norm_bounds(p.numpy(), V)
    return pd.DataFrame(
        {
            "token": [f"t{i}" for i in range(V)],
            "prob": p.numpy(),
            "grad_norm": norms.numpy(),
            "lower": lower,
            "upper": upper,
        }
    )


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
        from lopti_lab.theory import ToyConfig

        defaults = ToyConfig()
        self.methods = {
            name: W.Checkbox(value=True, description=name, indent=False) for name in ("GRPO", "AR", "Lopti", "AR+Lopti")
        }
        self.alpha = W.FloatSlider(value=0.3, min=0.0, max=1.0, step=0.05, description="AR alpha")
        self.eta = W.FloatSlider(value=0.5, min=0.05, max=0.95, step=0.05, description="Lopti eta")
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
        from lopti_lab.theory import Method

        alpha, eta = self.alpha.value, self.eta.value
        every = {
            "GRPO": Method("GRPO"),
            "AR": Method("AR", alpha=alpha),
            "Lopti": Method("Lopti", eta=eta),
            "AR+Lopti": Method("AR+Lopti", alpha=alpha, eta=eta),
        }
        return [every[name] for name, box in self.methods.items() if box.value]

    def config(self):
        from lopti_lab.theory import ToyConfig

        return ToyConfig(steps=self.steps.value, optimizer=self.optimizer.value, seed=self.seed.value)

    def run(self):
        from lopti_lab.theory import simulate

        methods = self.chosen()
        if not methods:
            _show(self.output, "Pick at least one method.")
            return None
        self.result = simulate(self.config(), methods)
        _show(self.output, plots.toy_dynamics(self.result))
        return self.result
