"""The interactive path: the notebooks run live in JupyterLab, driven through a real browser.

`make lab` is how a reader opens the notebooks; this test does what that reader does. It
starts JupyterLab (from requirements-lab.txt, in the same .venv) on a free localhost port,
opens chapters in headless Chromium (Debian's chromium, driven by Playwright), runs every
cell with the kernel behind the page, and checks what matters live: chapter 3's
``bucket_cap_mb`` slider redraws its figure when moved; chapter 1's `spawn` demos give their
checked output; the kernel's interrupt button stops every rank of a running demo at once; and
no process survives the kernel's shutdown. Screenshots go to _build/screenshots/lab_*.png.

JupyterLab is started by `make lab` itself, which serves a working copy of the notebooks (here
in a temporary directory): a test runs a chapter, saves it as autosave would, and checks that
`git status` shows nothing new, i.e. a reader's run never dirties the repository.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
JUPYTER = Path(sys.executable).parent / "jupyter"
TOKEN = "refimpl-browser-test"
# Settings a reader would not need, but a test does: no autosave, no news pop-up over the
# page, and every cell kept in the DOM (JupyterLab 4 otherwise only renders the visible ones).
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}
VISIBLE = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook on screen, not a hidden tab
CH1 = "01_processes_ranks_collectives.ipynb"
CH3 = "03_buckets_and_hooks.ipynb"
# A demo that runs for a minute unless interrupted: rank 1 arrives 60 s late at a barrier.
LONG_DEMO = (
    "from refimpl.demos.sync import straggler_worker\n"
    "spawn(straggler_worker, 2, 1, 60.0, 90.0, timeout_s=120)"
)

KERNEL_JS = "window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel"
# Every code cell has run (an execution count) and the kernel is idle; or a cell failed.
RUN_STATE_JS = f"""() => {{
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = {KERNEL_JS};
  const cells = panel.content.model.cells;
  for (let i = 0; i < cells.length; i++) {{
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    for (const out of cell.outputs.toJSON()) {{
      if (out.output_type === 'error') return `error, cell ${{i}}: ${{out.ename}} ${{out.evalue}}`;
    }}
    if (cell.sharedModel.getSource().trim() && cell.executionCount == null) return '';
  }}
  return kernel && kernel.status === 'idle' ? 'done' : '';
}}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process on the machine (from /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left to collect


def _kernel_pid(kernel_id: str) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "ipykernel" in cmdline and f"kernel-{kernel_id}.json" in cmdline:
                return int(entry.name)
    raise AssertionError(f"no process found for kernel {kernel_id}")


def _git_status() -> list[str]:
    done = subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def repo_status() -> list[str]:
    """`git status --porcelain` before JupyterLab starts (empty on CI's clean clone)."""
    status = _git_status()
    if os.environ.get("CI"):
        assert status == [], f"the repository is dirty before the browser test: {status}"
    return status


@pytest.fixture(scope="module")
def lab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working copy `make lab` serves (LAB_DIR), in a temporary directory."""
    return tmp_path_factory.mktemp("lab")


@pytest.fixture(scope="module")
def lab(lab_dir: Path, repo_status: list[str]) -> Iterator[str]:
    """JupyterLab started by `make lab`, exactly the reader's command, on a free port."""
    if not JUPYTER.exists():
        pytest.fail("JupyterLab missing: `make browser-test` installs it", pytrace=False)
    root = lab_dir
    settings = root / ".settings"
    for name, values in SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    port = _free_port()
    extra = [
        f"--IdentityProvider.token={TOKEN}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={root / '.workspaces'}",  # no tabs restored from a past run
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    server = subprocess.Popen(
        [
            "make",
            "--no-print-directory",
            "lab",
            f"VENV={Path(sys.executable).parents[1]}",
            f"LAB_DIR={root}",
            f"LAB_PORT={port}",
            f"LAB_ARGS={' '.join(extra)}",
        ],
        cwd=ROOT,
        stdout=open(root / "lab.log", "wb"),  # noqa: SIM115 (closed with the process)
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the teardown kills all of it
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                log = (root / "lab.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"JupyterLab did not start:\n{log}", pytrace=False)
            time.sleep(0.3)
    yield url
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} missing: apt-get install -y chromium", pytrace=False)
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


def _open(browser: Any, lab: str, notebook: str) -> Any:
    """Open ``notebook`` in JupyterLab and wait for its kernel to be ready; return the page."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{lab}/lab/tree/notebooks/{notebook}?reset&token={TOKEN}")  # no restored tabs
    page.wait_for_selector(VISIBLE, timeout=60_000)
    page.wait_for_function(
        f"() => window.jupyterapp?.shell.currentWidget?.sessionContext && "
        f"{KERNEL_JS}?.status === 'idle'",
        timeout=60_000,
    )
    return page


def _run_all(page: Any, timeout_s: float = 240) -> None:
    """Clear every output, run every cell as a reader's "Run All" does, and wait for the end."""
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    handle = page.wait_for_function(RUN_STATE_JS, timeout=timeout_s * 1000, polling=250)
    state = handle.json_value()
    assert state == "done", state


def _cell_text(page: Any, needle: str) -> str:
    """The text outputs of the code cell whose source contains ``needle``."""
    text: str = page.evaluate(
        """(needle) => {
          const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
          for (let i = 0; i < cells.length; i++) {
            const cell = cells.get(i);
            if (cell.type === 'code' && cell.sharedModel.getSource().includes(needle)) {
              return cell.outputs.toJSON().map(o => {
                if (o.text !== undefined) return [].concat(o.text).join('');
                if (o.output_type === 'error') return o.ename + ': ' + o.evalue;
                return '';
              }).join('');
            }
          }
          return null;
        }""",
        needle,
    )
    assert text is not None, f"no cell contains {needle!r}"
    return text


# A MyST role as raw text: {term}`bucket`, {py:func}`...`, {numref}`...`.
RAW_ROLE = re.compile(r"\{[a-z][\w:-]*\}`")
# What the rendered markdown cells show (a rendered cell hides its source editor).
MARKDOWN_TEXT_JS = f"""() => Array.from(document.querySelectorAll('{VISIBLE} .jp-MarkdownCell'))
  .map(cell => cell.innerText)"""


def _committed_text(notebook: str, needle: str) -> str:
    nb = nbformat.read(ROOT / "notebooks" / notebook, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and needle in c.source)
    return "".join(o.get("text", "") for o in cell.outputs)


@pytest.mark.timeout(300)
def test_chapter3_slider_redraws_the_bucket_figure_live(browser: Any, lab: str) -> None:
    page = _open(browser, lab, CH3)
    _run_all(page)
    slider = page.locator(f"{VISIBLE} .widget-slider", has_text="bucket_cap_mb").first
    slider.scroll_into_view_if_needed()
    # The picture on show: the widget may hold several (one per slider value) and show one.
    picture = page.locator(f"{VISIBLE} .widget-image:visible").first
    readout = slider.locator(".widget-readout")
    before_value, before_png = readout.inner_text(), picture.screenshot()

    handle = slider.locator(".noUi-handle")
    box = handle.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] - 150, box["y"] + box["height"] / 2, steps=10)
    page.mouse.up()

    page.wait_for_function(
        "([el, old]) => el.textContent.trim() !== old",
        arg=[readout.element_handle(), before_value],
        timeout=20_000,
    )
    # Either the kernel redraws the PNG and sends it back over the widget comm, or the
    # browser shows the picture drawn in advance for the new value: wait for it.
    deadline = time.monotonic() + 30
    while picture.screenshot() == before_png:
        assert time.monotonic() < deadline, "the figure did not change after moving the slider"
        time.sleep(0.5)
    assert float(readout.inner_text()) < float(before_value)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "lab_ch3_slider.png"))
    page.close()


@pytest.mark.timeout(300)
def test_chapter1_runs_live_interrupt_stops_every_rank_and_shutdown_leaves_no_process(
    browser: Any, lab: str, lab_dir: Path, repo_status: list[str]
) -> None:
    page = _open(browser, lab, CH1)
    _run_all(page)
    needle = "spawn(C.rank_info, 4)"
    assert _cell_text(page, needle) == _committed_text(CH1, needle)
    assert "NotSpawnableError" in _cell_text(page, "spawn(my_worker, 2)")

    # Save, as autosave would: the run's outputs go to make lab's copy, never into the repo.
    copy = lab_dir / "notebooks" / CH1
    saved_before = copy.stat().st_mtime_ns
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    deadline = time.monotonic() + 30
    while copy.stat().st_mtime_ns == saved_before:
        assert time.monotonic() < deadline, f"JupyterLab did not save {copy}"
        time.sleep(0.2)
    assert _git_status() == repo_status, (
        f"running and saving chapter 1 under make lab changed the repository: "
        f"{sorted(set(_git_status()) - set(repo_status))}"
    )

    kernel = _kernel_pid(page.evaluate(f"() => {KERNEL_JS}.id"))
    before = _descendants(kernel)  # the launcher's fork server, kept between spawns

    # A long demo, started from a new cell at the end, then the toolbar's interrupt button.
    # Typed as a reader would: select the last cell, B (new cell below), Enter, type, Shift+Enter.
    page.locator(f"{VISIBLE} .jp-Cell").last.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.type(LONG_DEMO)
    page.keyboard.press("Shift+Enter")
    deadline = time.monotonic() + 60
    while len(ranks := _descendants(kernel) - before) < 2:
        assert time.monotonic() < deadline, (
            f"the demo's ranks never started: kernel {kernel}, processes under it "
            f"{sorted(_descendants(kernel))}, before {sorted(before)}, the cell shows "
            f"{_cell_text(page, 'straggler_worker')!r}"
        )
        time.sleep(0.2)
    time.sleep(2.0)  # both ranks are inside the demo now: rank 0 waits, rank 1 sleeps
    ranks = _descendants(kernel) - before
    page.locator(f"{VISIBLE} jp-button[data-command='notebook:interrupt-kernel']").click()
    clicked = time.monotonic()
    page.wait_for_function(RUN_STATE_JS, timeout=30_000, polling=250)  # the cell's error ends it
    while any(_alive(p) for p in ranks):
        assert time.monotonic() - clicked < 15, f"ranks alive after interrupt: {ranks}"
        time.sleep(0.1)
    stopped_s = time.monotonic() - clicked
    assert "KeyboardInterrupt" in _cell_text(page, "straggler_worker")
    print(f"interrupt: {len(ranks)} processes of the running demo gone {stopped_s:.1f} s after")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "lab_ch1_interrupted.png"))

    everything = _descendants(kernel) | {kernel}
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
    accept = page.locator(".jp-Dialog .jp-mod-accept")
    if accept.count():
        accept.first.click()
    deadline = time.monotonic() + 20
    while left := [p for p in everything if _alive(p)]:
        assert time.monotonic() < deadline, f"processes left after kernel shutdown: {left}"
        time.sleep(0.2)
    page.close()


@pytest.mark.timeout(300)
def test_markdown_renders_myst_roles_and_collapses_the_answers(browser: Any, lab: str) -> None:
    """JupyterLab shows the chapters as the HTML book does (jupyterlab-myst, from
    requirements-lab.txt): roles render as their text, not as `{term}`bucket`` source, and an
    exercise's answers sit in a closed block under the questions, opened by a click. Nothing is
    fetched from outside the machine for it."""
    nb = nbformat.read(ROOT / "notebooks" / CH3, as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    roles = set(RAW_ROLE.findall(source))  # {term}`, {py:func}`, ...
    assert len(roles) > 3, f"chapter 3 has too few kinds of MyST role to check: {roles}"
    assert "```{admonition} Answers\n:class: dropdown" in source
    answer = "Any cap at or below the smallest parameter"  # the first line of its first answer

    page = _open(browser, lab, CH3)
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(lab) else outside.append(r.url))
    page.wait_for_function(  # every markdown cell rendered, the answers' text among them
        f"""(answer) => {{
          const cells = Array.from(document.querySelectorAll('{VISIBLE} .jp-MarkdownCell'));
          return cells.length > 0 && cells.every(c => c.classList.contains('jp-mod-rendered'))
            && cells.some(c => c.textContent.includes(answer));
        }}""",
        arg=answer,
        timeout=60_000,
    )
    shown = page.evaluate(MARKDOWN_TEXT_JS)
    assert any("Every parameter its own bucket" in t for t in shown), "no rendered markdown"
    # Unrendered, a role shows as its name in braces before the code span: "{term}bucket".
    raw = [role[:-1] for text in shown for role in roles if role[:-1] in text]
    assert not raw, f"{len(raw)} MyST roles show as raw text in JupyterLab, e.g. {raw[:5]}"

    text = page.locator(f"{VISIBLE} .jp-MarkdownCell").get_by_text(answer)
    assert not text.is_visible(), "the exercises' answers show in full under the questions"
    summary = page.locator(f"{VISIBLE} .jp-MarkdownCell details summary", has_text="Answers")
    summary.first.scroll_into_view_if_needed()
    summary.first.click()
    text.wait_for(state="visible", timeout=10_000)  # collapsed, not missing: a click opens it
    assert not outside, f"JupyterLab fetched from outside the machine: {outside[:5]}"
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "lab_ch3_answers_open.png"))
    page.close()
