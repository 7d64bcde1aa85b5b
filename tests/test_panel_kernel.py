"""Notebook 04's training panel in a real Jupyter kernel (nbclient): the kernel's interrupt stops a panel run after
its current step, with a checkpoint; after a kernel restart, the panel's Run with the same run name continues the
run from its folder."""

import json
import time

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.util import run_sync

from lopti_lab import runs
from lopti_lab.resume import check_resume

PANEL = """
from lopti_lab.train_config import TrainConfig
from lopti_lab.widgets import TrainPanel
base = TrainConfig(model={model!r}, lora_r=4, lora_alpha=8, prompt_style="base", train_people=(3,), train_limit=8,
                   eval_people=(), prompts_per_step=2, group_size=4, minibatch_size=8, max_new_tokens=8, lr=1e-3,
                   steps={steps}, save_every=1, progress=False)
panel = TrainPanel(base=base, run_root={root!r})
panel.name.value = "kernel-run"
"""


def cell(client: NotebookClient, source: str):
    """Run one code cell in the client's kernel; its outputs."""
    node = nbformat.v4.new_code_cell(source)
    client.nb.cells.append(node)
    client.execute_cell(node, len(client.nb.cells) - 1)
    return node.outputs


def text(outputs) -> str:
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")


def wait_for_steps(folder, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (folder / runs.METRICS).is_file() and len(runs.load_metrics(folder)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{folder}: fewer than {n} steps after {timeout} s")


@pytest.mark.slow
def test_kernel_interrupt_stops_the_panel_run_and_a_restarted_kernel_continues_it(model_dir, tmp_path):
    root = tmp_path / "runs"
    folder = root / "kernel-run"
    client = NotebookClient(nbformat.v4.new_notebook(), kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    with client.setup_kernel():
        cell(client, PANEL.format(model=str(model_dir), root=str(root), steps=500))
        cell(client, "thread = panel.run()")  # a live kernel: trains in a thread, the cell returns at once
        wait_for_steps(folder, 2)
        run_sync(client.km.interrupt_kernel)()  # Kernel > Interrupt, while no cell runs
        out = text(cell(client, "r = panel.wait(120); print(r.stopped, len(r.history), panel.status.value)"))
        stopped, steps, status = out.split(" ", 2)
        assert stopped == "True" and 2 <= int(steps) < 500, out
        assert f"stopped after step {steps}" in status
        assert runs.latest_checkpoint(folder).name == f"step_{steps}"  # stopped with a checkpoint of its last step
        assert text(cell(client, "print(panel.run_button.disabled, panel.model.disabled)")).split() == ["False"] * 2

        # again, and this time the kernel restarts mid-run (as Kernel > Restart does: the process is gone)
        cell(client, "thread = panel.run()")
        wait_for_steps(folder, int(steps) + 1)
        run_sync(client.km.restart_kernel)(now=True)
        run_sync(client.kc.wait_for_ready)(timeout=120)
        point = check_resume(folder)  # the folder the dead kernel left can be continued
        done = point.step
        cell(client, PANEL.format(model=str(model_dir), root=str(root), steps=done + 2))
        out = text(cell(client, "r = panel.run(block=True); print(len(r.history), panel.status.value)"))
    assert out.startswith(f"{done + 2} done after step {done + 2}: "), out
    records = runs.load_metrics(folder)
    assert [r["step"] for r in records] == list(range(1, done + 3))
    assert json.loads((folder / runs.CONFIG).read_text())["steps"] == done + 2
    print(
        f"kernel interrupt: stopped after step {steps} with its checkpoint; restart mid-run left a folder resumable"
        f" at step {done}; Run with the same name continued to {done + 2}, {len(records)} records in order"
    )
