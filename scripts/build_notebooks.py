"""Write notebooks/*.ipynb from the cell lists in notebooks/src/*.py (the notebooks' source of truth), executed.

    .venv/bin/python scripts/build_notebooks.py                # rebuild every notebook, run it in full (minutes)
    .venv/bin/python scripts/build_notebooks.py --only 02 04   # just these
    .venv/bin/python scripts/build_notebooks.py --check        # exit 1 if a committed notebook is stale or unexecuted

The committed notebooks carry the outputs of a full run (``QUICK = False``) on the CPU lab, so that a reader on a
repository browser or in Colab sees every figure before running anything. Each runs in a scratch folder (its run
folders and reports land there, not in the checkout), one kernel at a time, with the kernel's torch on
``--threads`` threads, offline (the hub is never asked) and with every progress bar off. ``--check`` compares the
cells' sources with notebooks/src, ignoring outputs, and requires every code cell to have run without an error.

A panel (an ipywidgets widget) shows only where a widget manager runs: on a repository browser or in a Colab preview
it is a line of text. So after each panel's output the build adds, as plain outputs, what the panel showed when the
cell ran (its figures and tables), and replaces the panel's text fallback by a line saying what it is. Each build
records its wall time and machine in notebooks/build_record.json (entries of notebooks not rebuilt are kept).

A source file is plain Python split into cells by ``# %%`` lines (``# %% [markdown]`` for a markdown cell whose
lines are comments), the "percent" format that Jupytext, VS Code and Spyder read. The tests execute QUICK copies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "notebooks" / "src"
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}
MAX_TOTAL_BYTES = 5_000_000
"""The five executed notebooks together stay under 5 MB (figures at the notebooks' own dpi)."""
RECORD = ROOT / "notebooks" / "build_record.json"
"""Per notebook, how its committed outputs were built: wall seconds, UTC date, threads, machine, torch version."""
QUIET_OFFLINE = {
    "TQDM_DISABLE": "1",  # tqdm's bars (the demo's worker pool) would stay frozen in the saved outputs
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bar
    "HF_HUB_OFFLINE": "1",  # the build reads only what is bundled: no hub lookup, no retries
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
"""The kernel's environment beyond its thread count: what a committed output must not carry (progress bars, hub
retries) is switched off at its source."""
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PANEL_NOTE = (
    "[an interactive panel: it works when the notebook runs; what it showed when the notebook was built follows]"
)


def parse_cells(text: str) -> list[tuple[str, str]]:
    """[("markdown" | "code", source)] from percent-format text."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines]
        source = "\n".join(lines).strip("\n")
        if source:
            out.append((kind, source))
    return out


def build(source: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNEL
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, text) in enumerate(parse_cells(source.read_text(encoding="utf-8"))):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = make(text)
        cell["id"] = f"{source.stem[:2]}-{i:02d}"  # stable ids keep diffs small
        nb.cells.append(cell)
    return nb


def execute(nb: nbformat.NotebookNode, threads: int, timeout: int) -> float:
    """Run every cell of ``nb`` in place, in a fresh kernel started in a scratch folder; returns the seconds taken."""
    from nbclient import NotebookClient

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **QUIET_OFFLINE}
    with tempfile.TemporaryDirectory(prefix="lopti_lab_nb_") as scratch:
        start = time.perf_counter()
        # the panels' widget state is stored with the outputs: JupyterLab shows them as they were left
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": scratch}},
                                store_widget_state=True)  # fmt: skip
        client.km = client.create_kernel_manager()
        client.start_new_kernel(env=env)
        try:
            client.start_new_kernel_client()
            client.execute(cleanup_kc=False)
        finally:
            client._cleanup_kernel()
    return time.perf_counter() - start


def _widget_models(nb: nbformat.NotebookNode) -> dict:
    """The stored widget state: {model id: {"model_name": ..., "state": {...}}} (empty if none was stored)."""
    return nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})


def panel_outputs(models: dict, model_id: str) -> list[dict]:
    """What the Output widgets inside the widget ``model_id`` show, in the panel's order, as plain display outputs
    (a figure keeps only its image; a table its HTML and text)."""
    model = models.get(model_id)
    if model is None:
        return []
    state = model.get("state", {})
    if model.get("model_name") == "OutputModel":
        shown = []
        for output in state.get("outputs", []):
            data = dict(output.get("data", {}))
            if "image/png" in data:
                data = {"image/png": data["image/png"]}
            if data:
                shown.append(nbformat.v4.new_output("display_data", data=data))
        return shown
    children = state.get("children", [])
    return [o for child in children for o in panel_outputs(models, child.removeprefix("IPY_MODEL_"))]


def add_static_panels(nb: nbformat.NotebookNode) -> int:
    """After each panel output, what its Output widgets showed, as plain outputs; the panel's text fallback (its
    repr, e.g. ``VBox(children=(...``) becomes ``PANEL_NOTE``. Returns how many outputs were added."""
    models = _widget_models(nb)
    added = 0
    for cell in nb.cells:
        outputs = []
        for output in cell.get("outputs", []):
            outputs.append(output)
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                continue
            shown = panel_outputs(models, view["model_id"])
            output["data"]["text/plain"] = PANEL_NOTE if shown else "[an interactive panel: run the notebook to use it]"
            outputs += shown
            added += len(shown)
        if "outputs" in cell:
            cell["outputs"] = outputs
    return added


def shrink_figures(nb: nbformat.NotebookNode, above: int = 60_000, colors: int = 128) -> None:
    """Store each figure larger than ``above`` base64 characters as a ``colors``-colour palette PNG, in place (in the
    cells' outputs and in the panels' stored state): line plots lose nothing a reader sees, and the notebook a third
    of its size."""
    import base64
    import io

    from PIL import Image

    widget_outputs = [o for m in _widget_models(nb).values() for o in m.get("state", {}).get("outputs", [])]
    for output in [*(o for cell in nb.cells for o in cell.get("outputs", [])), *widget_outputs]:
        data = output.get("data", {})
        if len(data.get("image/png", "")) > above:
            image = Image.open(io.BytesIO(base64.b64decode(data["image/png"]))).convert("RGB")
            buffer = io.BytesIO()
            image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(buffer, "PNG", optimize=True)
            data["image/png"] = base64.b64encode(buffer.getvalue()).decode()


def record_build(name: str, wall_s: float, threads: int, path: Path = RECORD) -> dict:
    """Write ``name``'s entry of the build record (the other notebooks' entries stay as they were); returns it."""
    record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    record[name] = {
        "wall_s": round(wall_s, 1),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": version("torch"),
        "quick": False,
        # the machine's 1-, 5- and 15-minute load averages as the build ends: a loaded machine inflates wall_s
        "load_at_end": [round(x, 1) for x in os.getloadavg()],
    }
    path.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n", encoding="utf-8")
    return record[name]


def stale_reasons(source: Path, target: Path) -> list[str]:
    """Why a committed notebook is not the executed build of its source (empty: it is)."""
    if not target.is_file():
        return ["missing"]
    committed = nbformat.read(target, as_version=4)
    built = build(source)
    if [(c.cell_type, c.source) for c in committed.cells] != [(c.cell_type, c.source) for c in built.cells]:
        return ["its cells differ from notebooks/src (rebuild it)"]
    reasons = []
    code = [c for c in committed.cells if c.cell_type == "code"]
    if any(c.execution_count is None for c in code):
        reasons.append("not executed (every code cell must have run)")
    if any(o.get("output_type") == "error" for c in code for o in c.outputs):
        reasons.append("a cell ended in an error")
    return reasons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    parser.add_argument("--only", nargs="+", default=None, metavar="NN", help="notebook numbers, e.g. 02 04")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each kernel (default 2)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one cell may take (default 3600)")
    args = parser.parse_args(argv)
    sources = [s for s in sorted(SOURCES.glob("*.py")) if args.only is None or s.stem[:2] in args.only]
    problems = []
    for source in sources:
        target = ROOT / "notebooks" / f"{source.stem}.ipynb"
        if args.check:
            problems += [f"{target.name}: {why}" for why in stale_reasons(source, target)]
            continue
        nb = build(source)
        elapsed = execute(nb, args.threads, args.timeout)
        add_static_panels(nb)
        shrink_figures(nb)
        target.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
        record_build(source.stem, elapsed, args.threads)
        print(f"wrote {target.relative_to(ROOT)}: executed in {elapsed:.0f} s, {target.stat().st_size / 1e6:.2f} MB")
    total = sum(p.stat().st_size for p in (ROOT / "notebooks").glob("*.ipynb"))
    if total > MAX_TOTAL_BYTES:
        problems.append(f"the notebooks take {total / 1e6:.1f} MB together, over {MAX_TOTAL_BYTES / 1e6:.0f} MB")
    if problems:
        print("notebooks out of date (run scripts/build_notebooks.py):\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
