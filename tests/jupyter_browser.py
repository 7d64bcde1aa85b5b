"""A JupyterLab server and a headless Chromium for the browser tests, driven like a person would drive them.

    with JupyterLab(root) as lab, chromium() as browser:
        page = NotebookPage.open(browser, lab, "01_x.ipynb")
        page.run_all()
        page.assert_widgets_rendered()

The server listens on 127.0.0.1 with a random token and keeps its settings, workspaces and runtime files under
``root/.jupyter`` so that nothing from the user's own Jupyter setup leaks in. Chromium is the system's (Debian's
``chromium`` package in CI), started by Playwright through ``executable_path``: no browser is ever downloaded.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import nbformat

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # without these Chromium keeps calling home, which on a closed network only floods the log with failures
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# JupyterLab settings for a quiet, deterministic page: no news or update checks (they need the internet), and every
# cell kept in the DOM (windowing off), so what the test reads is what the notebook holds.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,
    },
}

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# The text an ipywidgets view shows instead of itself when something went wrong (jupyterlab_widgets' manager), and
# the start of a widget's text repr, which JupyterLab shows when no widget manager is there to render the view.
WIDGET_FAILURES = ("Loading widget...", "Error displaying widget")
WIDGET_REPR = re.compile(r"^(VBox|HBox|Box|Output|Button|Checkbox|\w+Slider|\w+Text|Dropdown|SelectMultiple|HTML)\(")


def find_chromium() -> str | None:
    """The Chromium binary: $LOPTI_LAB_CHROMIUM, else chromium / chromium-browser on PATH."""
    explicit = os.environ.get("LOPTI_LAB_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def quick_copy(source: Path, folder: Path) -> Path:
    """Copy a notebook into ``folder`` with its first code cell's ``QUICK = False`` turned to ``QUICK = True``."""
    nb = nbformat.read(source, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    first.source, n = re.subn(r"^QUICK = False", "QUICK = True", first.source, flags=re.M)
    assert n == 1, f"{source.name}: the first code cell must set QUICK = False"
    target = folder / source.name
    nbformat.write(nb, target)
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """``jupyter lab`` serving ``root`` on 127.0.0.1 (a context manager; the server and its kernels end on exit)."""

    def __init__(self, root: Path, startup_timeout: float = 120):
        self.root, self.startup_timeout = Path(root), startup_timeout
        self.token, self.port = secrets.token_hex(16), _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / ".jupyter" / "server.log"
        self._process: subprocess.Popen | None = None

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}?token={self.token}"

    def _environment(self) -> dict[str, str]:
        home = self.root / ".jupyter"
        settings = home / "lab-settings"
        for name, values in LAB_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ)
        env.update(
            JUPYTER_CONFIG_DIR=str(home / "config"),
            JUPYTER_RUNTIME_DIR=str(home / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
            OMP_NUM_THREADS="1",  # kernels inherit it: one thread each, like every other subprocess of the suite
            MKL_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",  # nothing but package registries is reachable here; fail fast instead of retrying
        )
        return env

    def api(self, method: str, path: str) -> object:
        request = urllib.request.Request(self.url(path), method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        for kernel in self.api("GET", "api/kernels"):
            self.api("DELETE", f"api/kernels/{kernel['id']}")

    def __enter__(self) -> JupyterLab:
        env = self._environment()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.allow_root=True",  # CI runs as root
            "--LabApp.news_url=",
            "--LabApp.extension_manager=readonly",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
        log = self.log_path.open("w")
        self._process = subprocess.Popen(command, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                self.api("GET", "api/status")
                return self
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"JupyterLab did not start; its log:\n{self.log()}") from None
                time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        try:
            if self._process.poll() is None:
                self.shutdown_kernels()
        except OSError:
            pass  # the server is already going; terminate below ends it either way
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@contextmanager
def chromium(executable: str, profile: Path):
    """A headless Chromium (Playwright over the given binary, a fresh profile folder)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context
        finally:
            context.close()


# the kernel's status in JupyterLab's status bar once it can run code, e.g. "Python 3 (ipykernel) | Idle"
KERNEL_READY = re.compile(r"^(?!No Kernel).+ \| Idle$")
PROMPTS_JS = "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim())"
# done: no cell queued or running, and at least one ran (right after the click, before the queue shows, none has)
RUN_ALL_DONE_JS = (
    f"() => {{ const p = ({PROMPTS_JS})(); return p.length && !p.includes('[*]:') && p.some(x => x != '[ ]:'); }}"
)


class NotebookPage:
    """One notebook open in JupyterLab, with what a person does to it (run all, find a panel, look for problems)
    and what the page logged to its console."""

    def __init__(self, page, name: str):
        self.page, self.name = page, name
        self.console: list[str] = []
        page.on("console", lambda m: m.type in ("error", "warning") and self.console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda err: self.console.append(f"pageerror: {err}"))

    @classmethod
    def open(cls, context, lab: JupyterLab, name: str, timeout_s: float = 120) -> NotebookPage:
        """Open ``name`` in a new tab and wait until its kernel is ready."""
        self = cls(context.new_page(), name)
        # a workspace of its own: JupyterLab would otherwise reopen (and start kernels for) earlier tests' notebooks
        self.page.goto(lab.url(f"lab/workspaces/{Path(name).stem}/tree/{name}"))
        status = self.page.locator(".jp-StatusBar-TextItem").filter(has_text=KERNEL_READY)
        status.wait_for(timeout=timeout_s * 1000)
        assert self.page.locator(".jp-NotebookPanel").count() == 1, "one notebook open, the one asked for"
        return self

    def run_all(self, timeout_s: float = 300) -> list[str]:
        """Run > Run All Cells, then wait until no cell is queued or running; every code cell must have run."""
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        # queued cells show [*]; run-all marks them all at once, and a failing cell un-queues the rest (back to [ ])
        self.page.wait_for_function(RUN_ALL_DONE_JS, timeout=timeout_s * 1000, polling=500)
        prompts = self.page.evaluate(PROMPTS_JS)
        not_run = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", p)]
        assert not not_run, f"{self.name}: cells {not_run} did not run ({prompts}); errors: {self.tracebacks()}"
        return prompts

    def outputs(self, mime: str):
        return self.page.locator(f'.jp-OutputArea-output[data-mime-type="{mime}"]')

    def tracebacks(self) -> list[str]:
        """The error outputs (a traceback, or an exception's one-line message) the cells show."""
        texts = self.outputs("application/vnd.jupyter.stderr").all_inner_texts()
        return [t for t in texts if "Traceback" in t or re.search(r"^\w*(Error|Exception)\b.*:", t, re.M)]

    def problems(self) -> list[str]:
        """Everything a person would see as broken: a widget that did not render (its placeholder, an error
        message or its text repr in place of the view), a disconnected widget, a traceback."""
        found = []
        widget_text = self.page.locator(".jupyter-widgets").filter(has_text=re.compile("|".join(WIDGET_FAILURES)))
        found += [f"widget shows {t!r}" for t in widget_text.all_inner_texts() if t.strip() in WIDGET_FAILURES]
        found += [
            f"a widget's text repr: {t[:80]!r}"
            for t in self.outputs("text/plain").all_inner_texts()
            if WIDGET_REPR.match(t.strip())
        ]
        disconnected = self.page.locator(".jupyter-widgets-disconnected").count()
        if disconnected:
            found.append(f"{disconnected} disconnected widget views")
        found += [f"traceback: {t[:300]}" for t in self.tracebacks()]
        return found

    def widget_views(self):
        """The widget views the cells displayed (each top-level panel, progress bar, ...)."""
        return self.page.locator(".jp-OutputArea-output > .jupyter-widgets")

    def panel(self, text: str):
        """The displayed widget panel that shows ``text`` (a control's label or a button's name)."""
        panel = self.widget_views().filter(has_text=text)
        assert panel.count() == 1, f"{self.name}: {panel.count()} panels show {text!r}"
        return panel

    def errors(self, allowed: tuple[re.Pattern, ...] = ()) -> list[str]:
        """Console errors and warnings, and uncaught page errors, except those matching ``allowed``."""
        return [m for m in self.console if not any(p.search(m) for p in allowed)]
