"""The notebooks in a real browser: JupyterLab on 127.0.0.1, headless Chromium, QUICK copies of the five notebooks.

Each test is a person's session: open a notebook, Run All, look at what the page shows, press the panels' buttons
and wait for the visible change. The nbclient tests (test_notebooks.py) prove the cells run; these prove that the
widgets reach the page: a missing widget manager, a comm error or a plot the training thread never delivers would
pass there and fail here. Screenshots of every panel land in reports/ui/.

Chromium is the system's (Debian's ``chromium`` package, installed by .ci/run). Without it these tests fail with a
message saying how to get it: a silent skip would let CI pass without ever opening a browser. On a machine where a
browser cannot be had, ``LOPTI_LAB_SKIP_BROWSER=1`` skips them, and the skip shows in the test summary.
"""

import json
import os
import re
from pathlib import Path

import pytest
from jupyter_browser import JupyterLab, NotebookPage, chromium, find_chromium, quick_copy

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {p.stem[:2]: p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
SHOTS = ROOT / "reports" / "ui"
WAIT_MS = 180_000  # the longest a visible change may take (a training step of the lab model on a busy 2-core CPU)

# Console lines that are JupyterLab's own noise, not ours. Each entry names what it is; keep the list short.
ALLOWED_CONSOLE = ()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    path = find_chromium()
    if path is None:
        if os.environ.get("LOPTI_LAB_SKIP_BROWSER") == "1":
            pytest.skip("LOPTI_LAB_SKIP_BROWSER=1: the browser tests are skipped")
        pytest.fail(
            "no Chromium found: install it (Debian/Ubuntu: apt-get install chromium fonts-dejavu-core), point "
            "LOPTI_LAB_CHROMIUM at the binary, or set LOPTI_LAB_SKIP_BROWSER=1 to skip the browser tests"
        )
    with chromium(path, tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving a fresh folder of QUICK copies of the notebooks (run folders land in its runs/)."""
    root = tmp_path_factory.mktemp("lab")
    for path in NOTEBOOKS.values():
        quick_copy(path, root)
    with JupyterLab(root) as server:
        yield server


def open_and_run(browser, lab, number: str) -> NotebookPage:
    page = NotebookPage.open(browser, lab, NOTEBOOKS[number].name)
    page.run_all()
    assert not page.problems(), page.problems()
    return page


def shoot(locator, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    locator.screenshot(path=path)
    return path


def plot_of(panel):
    """The figure the panel's Output widget shows (the first, for panels that show several)."""
    return panel.locator(".widget-output img").first


def changes(locator, before: str) -> None:
    """Wait until the image shows something other than ``before``."""
    from playwright.sync_api import expect

    expect(locator).not_to_have_attribute("src", before, timeout=WAIT_MS)


def finish(page: NotebookPage, lab: JupyterLab) -> None:
    assert not page.errors(ALLOWED_CONSOLE), page.errors(ALLOWED_CONSOLE)
    page.page.close()
    lab.shutdown_kernels()


def test_01_panels_redraw_when_their_controls_move(browser, lab):
    page = open_and_run(browser, lab, "01")
    softmax, toy = page.panel("temperature"), page.panel("AR alpha")
    shoot(softmax, "01_softmax_explorer")
    shoot(toy, "01_toy_panel")

    plot = plot_of(softmax)
    before = plot.get_attribute("src")
    softmax.get_by_role("slider").focus()
    page.page.keyboard.press("ArrowRight")  # one step hotter
    changes(plot, before)

    plot = plot_of(toy)
    before = plot.get_attribute("src")
    toy.get_by_label("GRPO+Lopti", exact=True).uncheck()
    toy.get_by_role("button", name="Run").click()
    changes(plot, before)
    finish(page, lab)


@pytest.mark.parametrize("number", ["02", "03"])
def test_notebook_renders_without_errors(browser, lab, number):
    page = open_and_run(browser, lab, number)
    figures = page.outputs("image/png")
    assert figures.count() >= 1
    shoot(figures.first, f"{NOTEBOOKS[number].stem[:2]}_first_figure")
    finish(page, lab)


def test_04_train_from_the_page_then_compare_in_05(browser, lab):
    page = open_and_run(browser, lab, "04")
    train = page.panel("Advantage Reweighting")
    plot = plot_of(train)
    before = plot.get_attribute("src")  # the QUICK cell's own two-step GRPO run

    from playwright.sync_api import expect

    # the regime picker: the hard lab sets the panel's model (and every other setting), the demo lab puts it back
    regime, model = train.get_by_label("regime"), train.get_by_label("model", exact=True)
    regime.select_option("hard lab")
    expect(model).to_have_value("lab-hard", timeout=WAIT_MS)
    regime.select_option("demo lab")
    expect(model).to_have_value("lab", timeout=WAIT_MS)

    train.get_by_label("Advantage Reweighting").check()
    steps = train.get_by_role("spinbutton", name="steps")
    steps.fill("200")
    steps.press("Enter")
    train.get_by_placeholder("run name").fill("browser-ar")
    train.get_by_placeholder("run name").press("Enter")
    views = page.widget_views().count()
    train.get_by_role("button", name="Run").click()

    status = train.locator(".widget-html")
    expect(status).to_contain_text("training GRPO+AR into runs/browser-ar", timeout=WAIT_MS)
    changes(plot, before)  # step 1 drawn by the training thread
    first_step = plot.get_attribute("src")
    changes(plot, first_step)  # and redrawn after step 2: the plot follows the run
    shoot(train, "04_train_panel_running")

    train.get_by_role("button", name="Stop").click()
    expect(status).to_contain_text(re.compile(r"stopped after step \d+: runs/browser-ar"), timeout=WAIT_MS)
    expect(train.get_by_role("button", name="Run")).to_be_enabled()
    expect(train.get_by_role("button", name="Stop")).to_be_disabled()
    shoot(train, "04_train_panel_stopped")
    assert page.widget_views().count() == views, "the training thread displayed something into a cell"
    last = int(re.search(r"stopped after step (\d+)", status.inner_text()).group(1))
    run = lab.root / "runs" / "browser-ar"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run / "config.json").read_text())["ar_alpha"] is not None
    assert [r["step"] for r in records] == list(range(1, last + 1)) and 2 <= last < 200
    finish(page, lab)

    page = open_and_run(browser, lab, "05")
    compare = page.panel("Rescan")
    picker = compare.get_by_role("listbox").first
    listed = picker.locator("option").all_inner_texts()
    assert "runs/browser-ar" in listed and len(listed) == 2, listed  # the QUICK cell's GRPO run and ours
    plot = plot_of(compare)
    before = plot.get_attribute("src")
    picker.select_option("runs/browser-ar")
    compare.get_by_role("button", name="Compare").click()
    changes(plot, before)
    shoot(compare, "05_compare_panel")
    finish(page, lab)


BUILT_PANELS = {"01": ("AR alpha", "ui_01_toy_panel"), "04": ("Advantage Reweighting", "ui_04_train_panel"),
                "05": ("Rescan", "ui_05_compare_panel")}  # fmt: skip


def test_committed_panels_show_their_full_runs_before_anything_runs(browser, tmp_path_factory):
    """A reader who opens a committed notebook in JupyterLab sees each panel as its full build left it (the widget
    state stored with the outputs: the toy's 40 steps, the demo run of 04, the demo's four runs in 05) before running
    a cell, once the notebook is trusted (an untrusted one shows the build's static copies below each panel instead).
    Their screenshots (reports/ui/ui_*.png) are the README's (docs/ui_*.png): panels of full runs, not of the
    QUICK runs the tests above make."""
    import subprocess
    import sys

    from playwright.sync_api import expect

    root = tmp_path_factory.mktemp("built")
    for number in BUILT_PANELS:
        (root / NOTEBOOKS[number].name).write_bytes(NOTEBOOKS[number].read_bytes())
        # JupyterLab renders a stored panel only in a trusted notebook (untrusted, it shows the panel's text/plain)
        subprocess.run([sys.executable, "-m", "jupyter", "trust", str(root / NOTEBOOKS[number].name)], check=True)
    with JupyterLab(root) as server:
        for number, (label, name) in BUILT_PANELS.items():
            page = NotebookPage.open(browser, server, NOTEBOOKS[number].name)
            page.page.set_viewport_size({"width": 1400, "height": 2400})  # the whole panel on the screen
            # a stored view carries a "disconnected" mark on every control until its cell runs: not shot for the README
            page.page.add_style_tag(content=".jupyter-widgets-disconnected::before { display: none !important; }")
            panel = page.widget_views().filter(has_text=label)
            expect(panel.locator(".widget-output img").first).to_be_visible(timeout=WAIT_MS)
            # stored views have no kernel model behind them until the cell runs again: disconnected, as expected
            problems = [p for p in page.problems() if not p.endswith("disconnected widget views")]
            assert panel.count() == 1 and not problems, problems
            shoot(panel, name)
            finish(page, server)


def test_screenshots_are_small_enough_to_commit():
    """docs/ carries a few of reports/ui's screenshots for the README; they stay small."""
    docs = sorted((ROOT / "docs").glob("ui_*.png"))
    assert docs, "docs/ui_*.png: the README's notebook screenshots"
    assert all(p.stat().st_size < 200_000 for p in docs), [(p.name, p.stat().st_size) for p in docs]
    assert all(f"docs/{p.name}" in (ROOT / "README.md").read_text() for p in docs)


def held_locks(root: Path) -> int:
    """How many run folders under ``root`` a live process is writing now (their writer lock is held)."""
    import fcntl
    import os

    held = 0
    for lock in root.glob("*/lock"):
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            held += 1
        finally:
            os.close(fd)
    return held


LOCK_STATE = """panel => {
  const stop = [...panel.querySelectorAll("button")].find(b => b.textContent.trim() === "Stop");
  const ar = [...panel.querySelectorAll(".widget-checkbox")].find(c => c.textContent.includes("Advantage Reweighting"));
  const run = [...panel.querySelectorAll("button")].find(b => b.textContent.trim() === "Run");
  return {run: run.disabled, stop: stop.disabled, ar: ar.querySelector("input").disabled,
          name: panel.querySelector("input[placeholder^='run name']").disabled};
}"""


@pytest.mark.slow
def test_04_panel_under_a_restless_hand(browser, lab):
    """A seeded sequence of 120 or more random events on notebook 04's panel (Run, Stop, double clicks, switches,
    sliders, the optimizer, run names that repeat so that some runs resume), during runs and between them, as fast
    as a hand. At the end: no page, console or kernel error; never two runs writing at once; every run folder it made
    passes check_resume and loads as notebook 05 reads it; the status line tells the truth about the last run. A
    control that cannot change mid-run is disabled while the run trains."""
    import random

    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect

    from lopti_lab import runs
    from lopti_lab.resume import check_resume

    page = open_and_run(browser, lab, "04")
    page.page.set_default_timeout(5000)  # a click waits at most 5 s for its control to be enabled
    train = page.panel("Advantage Reweighting")
    status = train.locator(".widget-html")
    run_button, stop_button = train.get_by_role("button", name="Run"), train.get_by_role("button", name="Stop")
    name_box = train.get_by_placeholder("run name")
    rng = random.Random(20261203)
    names = ["hand-a", "hand-b", "hand-c"]

    def set_name():
        name_box.fill(rng.choice(names))
        name_box.press("Enter")

    def nudge_slider(label):
        def move():
            slider = train.get_by_role("slider").filter(has=page.page.locator(f"[aria-label='{label}']"))
            target = slider if slider.count() else train.get_by_role("slider").nth(rng.randrange(2))
            target.first.focus()
            page.page.keyboard.press(rng.choice(["ArrowRight", "ArrowLeft"]))

        return move

    actions = {
        "run": lambda: run_button.click(),
        "double run": lambda: run_button.dblclick(),
        "stop": lambda: stop_button.click(),
        "stop then run": lambda: (stop_button.click(), run_button.click()),
        "AR": lambda: train.get_by_label("Advantage Reweighting").click(),
        "Lopti": lambda: train.get_by_label("Lopti", exact=True).click(),
        "slider": nudge_slider("alpha"),
        "optimizer": lambda: train.get_by_role("button", name=rng.choice(["adamw", "sgd"])).click(),
        "name": set_name,
    }
    set_name()
    tried, skipped, max_held = 0, 0, 0
    events = 0
    # 120 events at least, then on until 30 of them acted on enabled controls (under load the runs take longer, so
    # more events fall on locked controls), at most 360
    while events < 120 or (tried < 30 and events < 360):
        events += 1
        kind = rng.choice(list(actions))
        controls = {"run": run_button, "double run": run_button, "stop": stop_button, "stop then run": stop_button}
        control = controls.get(kind)
        seen = train.evaluate(LOCK_STATE)  # one snapshot of the page: the run may end between two separate reads
        running = not seen["stop"]
        if running:  # mid-run, every setting is locked: a person cannot move it
            assert seen["ar"] and seen["name"], seen
        if (control is not None and control.is_disabled()) or (kind not in controls and running):
            skipped += 1  # a disabled control: nothing to click
        else:
            try:
                actions[kind]()
                tried += 1
            except PlaywrightTimeout as err:  # the control was disabled between the look and the click
                now = train.evaluate(LOCK_STATE)  # (a click before it had started a run the kernel had not shown yet)
                if "not enabled" not in str(err) and not (now["run"] or now["ar"] or not now["stop"]):
                    raise
                skipped += 1
        max_held = max(max_held, held_locks(lab.root / "runs"))
        page.page.wait_for_timeout(rng.choice([50, 200, 600]))
    if stop_button.is_enabled():
        stop_button.click()
    expect(run_button).to_be_enabled(timeout=WAIT_MS)
    assert max_held <= 1, "two runs wrote at once"
    assert tried >= 30, (tried, skipped)  # the loop went on to 360 events and still found few enabled controls
    assert not page.problems(), page.problems()
    assert not page.errors(ALLOWED_CONSOLE), page.errors(ALLOWED_CONSOLE)
    made = [d for d in (lab.root / "runs").iterdir() if d.name in names and (d / runs.CONFIG).is_file()]
    assert made, "the hand started no run"
    steps = {d.name: len(runs.load_metrics(d)) for d in made}
    print(f"restless hand, seed 20261203: {tried} events acted, {skipped} on disabled controls, runs {steps}")
    for run_dir in made:
        check_resume(run_dir)  # the folder of every run it started can be continued
        records = runs.load_run(run_dir)  # and loads as notebook 05 reads it
        assert list(records["step"]) == list(range(1, len(records) + 1))
    text = status.inner_text()
    last = re.search(r"(done|stopped) after step (\d+): runs/(hand-[abc])", text)
    error = re.search(r"error|bad setting|already", text)
    assert last or error, text
    if last:  # the status names the last run and its step, which its folder holds
        assert len(runs.load_metrics(lab.root / "runs" / last.group(3))) == int(last.group(2)), text
    finish(page, lab)
