"""The course as learners meet it: JupyterLab in a headless Chromium, driven by Playwright.

Needs the ``playwright`` package (the ``test`` extra) and a system Chromium (Debian:
``apt-get install chromium``; ``.ci/run`` installs it). Nothing is downloaded at run time:
Playwright drives the system browser. On failure a screenshot is saved and its path printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbgrader.api import Gradebook
from perflab.distributed import free_port
from perflab.grading.course import REPO

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on PATH: apt-get install chromium (Debian/Ubuntu)"
)

START_TIMEOUT_S = 90
CELL_TIMEOUT_MS = 180_000
RETRIES, RETRY_AFTER_MS = 3, 15_000


@contextlib.contextmanager
def _serving(root: Path, env: dict[str, str]) -> Iterator[str]:
    """JupyterLab on a loopback port serving ``root``, with no token: its URL. Its log is ``root/server.log``."""
    settings = root / ".settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # Every cell in the page, not only those in view: the test finds cells by their text.
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--allow-root",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            f"--ServerApp.root_dir={root}",
            f"--LabApp.user_settings_dir={root / '.settings'}",
            f"--LabApp.workspaces_dir={root / '.workspaces'}",
        ],
        cwd=root,
        env=dict(env, JUPYTER_RUNTIME_DIR=str(root / ".runtime")),
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "w"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start: {(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
    try:
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """JupyterLab serving a temporary copy of the lectures and labs, as a learner opens them."""
    root = tmp_path_factory.mktemp("course")
    for folder in ("lectures", "labs"):
        shutil.copytree(REPO / folder, root / folder)
    bin_dir = Path(sys.executable).parent
    with _serving(root, dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")) as url:
        yield url


@pytest.fixture
def page(jupyterlab, tmp_path, request):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        yield page
        outcome = getattr(request.node, "rep_call", None)  # set by conftest.py's report hook
        if outcome is not None and outcome.failed:
            shot = Path(os.environ.get("PERFLAB_SCREENSHOTS", tmp_path)) / f"{request.node.name}.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot of the failure: {shot}")
        browser.close()


def _open_notebook(page, url: str, path: str):
    page.goto(f"{url}/lab/tree/{path}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| Idle")).first.wait_for(
        timeout=START_TIMEOUT_S * 1000
    )


def _start(page, action, prompt):
    """Do ``action`` until the cell behind ``prompt`` leaves its "[ ]:" state.

    A request sent while the freshly opened notebook is still connecting its kernel can be
    dropped without a trace; a learner would press again, and so does this.
    """
    for _attempt in range(RETRIES):
        action()
        try:
            sync_api.expect(prompt).not_to_have_text(re.compile(r"\[ \]"), timeout=RETRY_AFTER_MS)
            return
        except AssertionError:
            continue
    raise AssertionError(f"the cell did not start after {RETRIES} tries")


def _run_cell(page, text: str):
    """Run the code cell whose source contains ``text``, as a learner would: click it, Shift+Enter."""
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text=text)).first
    prompt = cell.locator(".jp-InputPrompt")

    def shift_enter():
        cell.locator(".cm-content").click()
        sync_api.expect(cell).to_have_class(re.compile(r"\bjp-mod-active\b"))
        page.keyboard.press("Shift+Enter")

    _start(page, shift_enter, prompt)
    # "[*]:" while it runs, "[3]:" when it is done
    sync_api.expect(prompt).to_have_text(re.compile(r"\[\d+\]"), timeout=CELL_TIMEOUT_MS)
    return cell


@pytest.mark.slow
def test_lab01_runs_to_its_not_implemented_error_and_validates(jupyterlab, page):
    _open_notebook(page, jupyterlab, "labs/lab01_timing/lab01_timing.ipynb")

    def run_all():
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

    _start(page, run_all, page.locator(".jp-CodeCell .jp-InputPrompt").first)
    page.locator(".jp-OutputArea-output", has_text="NotImplementedError").first.wait_for(timeout=CELL_TIMEOUT_MS)

    page.locator(".jp-NotebookPanel-toolbar").get_by_text("Validate", exact=True).click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=CELL_TIMEOUT_MS)
    dialog.get_by_text("NotImplementedError").first.wait_for(timeout=CELL_TIMEOUT_MS)
    assert "Validation Results" in dialog.inner_text() or "failed" in dialog.inner_text().lower()


def _result_changes(page, explorer, interact) -> str:
    """Wait for the explorer's result, ``interact`` with it, and return the result once it changed."""
    result = explorer.locator(".widget-html-content").last  # the result sits below the controls
    page.wait_for_function(
        "element => element.innerText.trim() !== ''", arg=result.element_handle(), timeout=CELL_TIMEOUT_MS
    )
    before = result.inner_text()
    interact()
    page.wait_for_function(
        "([element, old]) => element.innerText !== old", arg=[result.element_handle(), before], timeout=CELL_TIMEOUT_MS
    )
    return result.inner_text()


@pytest.mark.slow
def test_lecture_explorers_react_to_their_controls(jupyterlab, page):
    _open_notebook(page, jupyterlab, "lectures/01_gpu_basics.ipynb")
    loading = _run_cell(page, "from perflab.widgets import")
    after = _result_changes(page, loading, lambda: loading.get_by_role("button", name="decoded once").click())
    assert re.search(r"^cached, batch 32, .* samples/s", after, re.MULTILINE)

    floats = _run_cell(page, "float_format_explorer(")

    def type_a_number_too_large_for_float16():
        field = floats.locator(".widget-text input")
        field.fill("70000")
        field.press("Enter")

    assert "inf" in _result_changes(page, floats, type_a_number_too_large_for_float16)

    memory = _run_cell(page, "training_memory_explorer()")

    def longer_sequences():
        memory.locator(".widget-slider", has_text="sequence length").locator(".noUi-handle").focus()
        page.keyboard.press("ArrowRight")

    assert "activations" in _result_changes(page, memory, longer_sequences)


@pytest.mark.slow
def test_formgrader_autogrades_with_no_critical_error(released_course, tmp_path, page):
    """An instructor's path: formgrader's autograde button, in JupyterLab served from a fresh course, grades the
    reference solution to full marks and the untouched release to 0, and the server logs no critical error."""
    course, lab = released_course.copy_to(tmp_path), "lab01_timing"
    course.submit("solved", lab, files_from=course.root / "solutions" / lab)
    course.submit("untouched", lab, files_from=course.root / "labs" / lab)
    with _serving(course.root, course.environment()) as url:
        page.goto(f"{url}/formgrader/manage_submissions/{lab}")
        for student in ("solved", "untouched"):
            page.locator("tr", has_text=student).locator(".autograde a").click()
            modal = page.locator("#success-modal")
            modal.get_by_text(f"Successfully autograded '{lab}' for student '{student}'").wait_for(
                timeout=CELL_TIMEOUT_MS
            )
            modal.get_by_role("button", name="Close").first.click()
            modal.wait_for(state="detached")
        log = (course.root / "server.log").read_text()  # before the server stops: it logs its stop as critical
    with Gradebook(f"sqlite:///{course.root / 'gradebook.db'}") as gradebook:
        solved, untouched = (gradebook.find_submission(lab, student) for student in ("solved", "untouched"))
        assert solved.code_score == solved.max_code_score > 0 and untouched.code_score == 0
    assert not re.search(r"^\[C ", log, re.MULTILINE), log[-3000:]  # jupyter's log lines start "[C" when critical
