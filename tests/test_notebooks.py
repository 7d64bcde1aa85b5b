"""Every notebook runs top to bottom, headless, with QUICK = True on CPU; the committed files match their sources and
carry the outputs of a full CPU run (a reader sees every figure before running anything), five under 5 MB."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LAB = (ROOT / "data" / "lab_model" / "config.json").is_file()


def test_there_are_five_notebooks_built_from_their_sources():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"]
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_notebooks.py"), "--check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_executed_in_full_with_a_quick_flag(path):
    """Read before you run: every code cell of the committed notebook ran (QUICK = False), none in error, and the
    figures are there."""
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "committed unexecuted: run scripts/build_notebooks.py"
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert sum("image/png" in o.get("data", {}) for c in code for o in c["outputs"]) >= 1
    assert re.search(r"^QUICK = False", "".join(code[0]["source"]), re.M), "the first code cell sets QUICK"
    assert nb["cells"][0]["cell_type"] == "markdown"
    text = "".join("".join(o.get("text", "")) for c in code for o in c["outputs"])  # stream text: a list of lines
    paths = re.findall(r"/\S*/(?:data|lopti_lab)/\S*", text)
    assert not paths, f"an output names the folders of the machine that built it: {paths}"
    assert "Warning:" not in text, "a warning in the committed outputs: fix its cause"


PROGRESS = re.compile(r"\d+%\||it/s\]|step/s\]|Loading weights|\r")
"""What a progress bar leaves in a saved output (tqdm's "18%|#7  | 7/40 [00:00<?, ?step/s]", transformers' bar)."""
WIDGET_REPR = re.compile(r"^(VBox|HBox|Box|Tab|Accordion|Output|FloatProgress|IntProgress|Label|HTML)\(", re.M)
"""A widget's repr: what a page without a widget manager (a repository browser, a Colab preview) shows for a panel."""
VIEW = "application/vnd.jupyter.widget-view+json"


def _text(output: dict) -> str:
    """Everything an output shows as text: a stream's text and every text/* form of its data."""

    def joined(value):
        return "".join(value) if isinstance(value, list) else str(value)

    parts = [joined(output.get("text", ""))]
    parts += [joined(v) for k, v in output.get("data", {}).items() if k.startswith("text/")]
    return "".join(parts)


def _panel_images(models: dict, model_id: str) -> int:
    """How many figures the Output widgets inside the widget ``model_id`` hold (in the stored widget state)."""
    model = models.get(model_id, {})
    state = model.get("state", {})
    if model.get("model_name") == "OutputModel":
        return sum("image/png" in o.get("data", {}) for o in state.get("outputs", []))
    return sum(_panel_images(models, child.removeprefix("IPY_MODEL_")) for child in state.get("children", []))


def _stored_text(models: dict, model_id: str) -> str:
    """Every string in the stored state of ``model_id`` and the widgets inside it (a tqdm bar keeps its text there)."""
    state = models.get(model_id, {}).get("state", {})
    texts = [v for k, v in state.items() if isinstance(v, str) and k in ("value", "description")]
    return " ".join(texts + [_stored_text(models, c.removeprefix("IPY_MODEL_")) for c in state.get("children", [])])


def page_problems(nb: dict) -> list[str]:
    """What a reader of the saved notebook on a repository browser would miss or be puzzled by: a panel whose figures
    do not follow it as plain images, a widget's repr, a progress bar (in text or in a widget's stored state)."""
    models = nb.get("metadata", {}).get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    models = models.get("state", {})
    problems = []
    for number, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        outputs = cell["outputs"]
        for i, output in enumerate(outputs):
            where = f"code cell {number}, output {i}"
            if PROGRESS.search(_text(output)):
                problems.append(f"{where}: a progress bar")
            if WIDGET_REPR.search("".join(output.get("data", {}).get("text/plain", ""))):
                problems.append(f"{where}: a widget's repr, not a figure")
            view = output.get("data", {}).get(VIEW)
            if view is None:
                continue
            if PROGRESS.search(_stored_text(models, view["model_id"])):
                problems.append(f"{where}: a progress bar widget")
            after = []
            for later in outputs[i + 1 :]:
                if VIEW in later.get("data", {}):
                    break
                after.append(later)
            images = sum("image/png" in o.get("data", {}) for o in after)
            if images < _panel_images(models, view["model_id"]):
                problems.append(f"{where}: a panel's figure shows only in the widget, not as an image after it")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_figure_is_on_the_page_with_no_bar_or_widget_repr(path):
    """Read on a repository browser (no widget manager, no kernel): each panel's figures follow it as plain images,
    and no output is a frozen progress bar or a widget's repr."""
    assert page_problems(json.loads(path.read_text())) == []


def test_the_page_check_sees_a_hidden_figure_a_bar_and_a_widget_repr():
    """The check above can fail: a panel whose figure lives only in the widget state, a tqdm bar, a widget's repr."""
    models = {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_out", "IPY_MODEL_bar"]}},
        "out": {"model_name": "OutputModel", "state": {"outputs": [{"data": {"image/png": "iVBOR"}}]}},
        "bar": {"model_name": "HTMLModel", "state": {"value": " 18%|#7        | 7/40 [00:00<?, ?step/s]"}},
    }
    panel = {"output_type": "display_data", "data": {VIEW: {"model_id": "box"}, "text/plain": "VBox(children=(...))"}}
    nb = {"metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {"state": models}}},
          "cells": [{"cell_type": "code", "outputs": [panel]}]}  # fmt: skip
    found = page_problems(nb)
    assert [p.split(": ", 1)[1] for p in found] == [
        "a widget's repr, not a figure",
        "a progress bar widget",
        "a panel's figure shows only in the widget, not as an image after it",
    ]
    panel["data"]["text/plain"] = "[an interactive panel]"
    models["bar"]["state"]["value"] = "done"
    nb["cells"][0]["outputs"].append({"output_type": "display_data", "data": {"image/png": "iVBOR"}})
    assert page_problems(nb) == []


READOUTS = {"01": 3, "02": 5, "03": 1, "04": 1, "05": 4}
"""How many 'what we see' paragraphs, computed from its figures' numbers, each committed notebook shows at least."""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_key_figures_are_read_out_from_their_numbers(path):
    nb = json.loads(path.read_text())
    shown = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    readouts = [o for o in shown if "".join(o.get("data", {}).get("text/markdown", "")).startswith("**What we see.**")]
    assert len(readouts) >= READOUTS[path.stem[:2]]


def test_the_build_record_names_every_notebook_and_its_machine():
    record = json.loads((ROOT / "notebooks" / "build_record.json").read_text())
    assert sorted(record) == [p.stem for p in NOTEBOOKS]
    for entry in record.values():
        assert {"wall_s", "date", "threads", "cpu_count", "platform", "torch", "quick"} <= set(entry)
        assert entry["wall_s"] > 0 and entry["quick"] is False and re.fullmatch(r"\d{4}-\d\d-\d\d", entry["date"])


def test_the_five_notebooks_stay_small():
    assert sum(p.stat().st_size for p in NOTEBOOKS) < 5_000_000


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_headless_in_quick_mode(path, tmp_path):
    if path.stem[:2] in ("02", "04", "05") and not LAB:
        pytest.skip("needs the bundled lab model (lopti-lab pretrain)")
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    first.source = re.sub(r"^QUICK = False", "QUICK = True", first.source, flags=re.M)
    start = time.perf_counter()
    # run in a scratch folder so run folders and reports land there; the kernel imports lopti_lab from this checkout
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    elapsed = time.perf_counter() - start
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert images >= 1, "every notebook draws at least one figure"
    assert elapsed < 240, f"{path.name} took {elapsed:.0f} s in QUICK mode"
