"""The install a new user gets: the wheel carries the bundled data, and a fresh virtual environment holding only that
wheel (and what it depends on) loads the lab model offline and runs a QUICK notebook, installed by the notebook's own
Colab cell.

Colab itself cannot be reached from here, so the test stands in for it in the one way the notebooks look at it: a
``google.colab`` package (``output.enable_custom_widget_manager`` records its call) imported at interpreter start,
the uploaded wheel in the kernel's working folder, and a kernel whose environment has only torch (Colab preinstalls
it; here the pinned CPU build that scripts/setup.sh installs), ipykernel and nbclient. The notebook's first cell then
installs the wheel with ``%pip`` exactly as on Colab. Pip's cache makes the reinstall cheap after the first run.
"""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "04_grpo_lora_training.ipynb"
MAX_WHEEL_MB = 40  # today 35 MB, mostly the two lab models' weights (18 MB each, which do not compress)

COLAB_STUB = {
    "google/colab/__init__.py": "from . import output\n",
    "google/colab/output.py": "calls = []\n\n\ndef enable_custom_widget_manager():\n    calls.append('widgets')\n",
    "sitecustomize.py": "import google.colab  # Colab's kernel has it imported before the first cell runs\n",
}

# runs inside the fresh environment: the notebook's kernel is that environment's python
RUNNER = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True).execute()
nbformat.write(nb, sys.argv[1])
"""

CHECK_CELL = """import json, sys, lopti_lab, google.colab.output
from lopti_lab.paths import data_dir
print(json.dumps({"python": sys.executable, "package": lopti_lab.__file__, "data": str(data_dir()),
                  "colab": google.colab.output.calls}))"""


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{command[:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)])
    (path,) = out.glob("lopti_lab-*.whl")
    return path


def test_the_wheel_carries_the_bundled_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {n.removeprefix("lopti_lab/_data/") for n in names if n.startswith("lopti_lab/_data/")}
    expected = {
        str(p.relative_to(ROOT / "data"))
        for p in (ROOT / "data").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert data == expected, sorted(data ^ expected)
    assert {"lab_model/config.json", "lab_model/model.safetensors", "kk/test/people3_num100.jsonl"} <= data
    assert {"lab_model_hard/config.json", "lab_model_hard/model.safetensors"} <= data
    assert wheel.stat().st_size < MAX_WHEEL_MB * 1e6, f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB"


@pytest.mark.slow
def test_a_fresh_environment_installs_the_wheel_from_the_colab_cell_and_runs_a_quick_notebook(wheel, tmp_path):
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "LOPTI_LAB"))}
    env["PIP_NO_COMPILE"] = "1"  # no .pyc for the thousands of files installed: a third of pip's time here
    run([sys.executable, "-m", "venv", str(venv)], env=env)
    run([python, "-m", "pip", "install", "--quiet", os.environ.get("TORCH_SPEC", "torch==2.13.0")], env=env)
    run([python, "-m", "pip", "install", "--quiet", "ipykernel", "nbclient"], env=env)

    stub = tmp_path / "colab_stub"
    for name, text in COLAB_STUB.items():
        (stub / name).parent.mkdir(parents=True, exist_ok=True)
        (stub / name).write_text(text)
    content = tmp_path / "content"  # Colab's working folder, where an uploaded file lands
    content.mkdir()
    (content / wheel.name).write_bytes(wheel.read_bytes())
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    first.source = re.sub(r"^QUICK = False", "QUICK = True", first.source, flags=re.M)
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_CELL))
    path = content / NOTEBOOK.name
    nbformat.write(nb, path)

    env.update(
        PYTHONPATH=str(stub), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", JUPYTER_DATA_DIR=str(tmp_path / "jupyter")
    )
    run([python, "-c", RUNNER, str(path)], cwd=content, env=env, timeout=900)

    nb = nbformat.read(path, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, "\n".join("\n".join(e["traceback"])[-2000:] for e in errors)
    seen = json.loads(nb.cells[-1].outputs[-1]["text"])
    assert Path(seen["python"]).parent == python.parent, seen  # the kernel ran in the fresh environment
    assert Path(seen["package"]).resolve().is_relative_to(venv.resolve() / "lib"), seen  # the wheel, not this checkout
    assert Path(seen["data"]).resolve() == Path(seen["package"]).resolve().parent / "_data"
    assert seen["colab"] == ["widgets"]
    code = [c for c in nb.cells if c.cell_type == "code"]
    status = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert re.search(r"done after step 2", status), status[-2000:]  # the QUICK cell trained the lab model
