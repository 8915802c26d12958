"""The course's website: built from the lectures as this run executed them, read in a headless Chromium.

The suite runs this module last (conftest.py), so that the lectures nbval has just run are reused
instead of run again; run on its own, the build runs every lecture first (minutes).
"""

from __future__ import annotations

import html.parser
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from perflab.device import device_name, pick_device
from perflab.distributed import free_port
from perflab.grading.course import LAB_NAMES, REPO
from perflab.record import RESULTS, chapters, execution_of, record, recordings
from perflab.render import Environment
from perflab.site import build_site

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SOLUTION_REGIONS = re.compile(r"### BEGIN (SOLUTION|HIDDEN TESTS)(.*?)### END \1", re.S)


@pytest.fixture(scope="module")
def site(tmp_path_factory, executed_lectures):
    return build_site(tmp_path_factory.mktemp("site"), cache=executed_lectures, progress=False)


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on a loopback port, as a static host would serve it."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(site.index.parent)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield f"http://127.0.0.1:{port}"
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'"
    )
    if CHROMIUM is None:
        pytest.skip("no Chromium on PATH: apt-get install chromium (Debian/Ubuntu)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, served):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    yield page
    page.close()


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.targets = []

    def handle_starttag(self, tag, attrs):
        self.targets += [value for name, value in attrs if name in ("href", "src") and value]


class _Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.data = []

    def handle_data(self, data):
        self.data.append(data)


def _internal_targets(page: Path) -> list[str]:
    parser = _Links()
    parser.feed(page.read_text())
    return [target for target in parser.targets if not urlsplit(target).scheme and not target.startswith("#")]


def _plain(text: str) -> str:
    """Text as a page shows it, without Markdown's backticks and with MyST's curly apostrophes made straight."""
    return text.replace("`", "").replace("\u2019", "'")


def _title(path: Path) -> str:
    return _plain(nbformat.read(path, as_version=4).cells[0].source.splitlines()[0].lstrip("# "))


def test_the_build_ran_no_lecture_that_nbval_had_just_run(site, request):
    ran_under_nbval = {item.path.stem for item in request.session.items if item.path.parent.name == "lectures"}
    run_again = {execution.chapter for execution in site.executed} & ran_under_nbval
    assert not run_again, f"the site ran {sorted(run_again)} again instead of reusing nbval's run"
    assert site.lectures == len(chapters())


def test_every_internal_link_and_image_resolves(site):
    root = site.index.parent
    pages = sorted(path for path in root.rglob("*.html") if path.relative_to(root).parts[0] != "_static")
    assert len(pages) >= site.lectures + site.labs + site.recordings + 1
    broken = [
        f"{page.relative_to(root)} -> {target}"
        for page in pages
        for target in _internal_targets(page)
        if not (page.parent / unquote(urlsplit(target).path)).exists()
    ]
    assert not broken, broken


def test_the_landing_page_lists_every_lecture_and_lab(page, served):
    page.goto(f"{served}/index.html")
    links = [_plain(text) for text in page.locator("article a").all_inner_texts()]
    for path in [*sorted((REPO / "lectures").glob("[0-9]*.ipynb")), *sorted((REPO / "labs").glob("lab*/lab*.ipynb"))]:
        assert _title(path) in links, f"no link to {path.name} on the landing page"
    assert page.locator("article", has_text="make lab").count()


def test_a_lecture_page_shows_its_figures_tables_and_where_they_were_measured(page, served):
    page.goto(f"{served}/lectures/01_gpu_basics.html")
    box = page.locator(".admonition", has_text="Where these outputs were measured")
    assert device_name(pick_device()) in box.inner_text()
    figures = page.locator(".cell_output img")
    assert figures.count() >= 2
    figures.first.scroll_into_view_if_needed()
    assert page.evaluate("(img) => img.complete && img.naturalWidth > 100", figures.first.element_handle())
    assert page.locator(".cell_output table").count() >= 1, "no measured table rendered"


def _page_text(page: Path) -> str:
    parser = _Text()
    parser.feed(page.read_text())
    return _plain("".join(parser.data))


def _hidden_lines(lab: str) -> list[str]:
    """The distinctive lines of a lab's solutions and hidden tests: long, and nowhere in the student version."""
    student = "\n".join(cell.source for cell in nbformat.read(REPO / "labs" / lab / f"{lab}.ipynb", 4).cells)
    sources = (cell.source for cell in nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", 4).cells)
    lines = {
        line.strip()
        for source in sources
        for _, region in SOLUTION_REGIONS.findall(source)
        for line in region.splitlines()
    }
    given = " ".join(student.split())  # a hint in the text may wrap a line of the solution
    return sorted(line for line in lines if len(line) > 25 and " ".join(line.split()) not in given)


def test_a_lab_page_holds_the_questions_and_no_solution_or_hidden_test(site, page, served):
    for lab in LAB_NAMES:
        text = _page_text(site.index.parent / "labs" / lab / f"{lab}.html")
        hidden = _hidden_lines(lab)
        assert hidden, f"{lab}: no solution line to look for"
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, lab
        shown = [line for line in hidden if line in text]
        assert not shown, f"{lab}'s page shows solution or hidden-test lines: {shown[:3]}"
        assert _title(REPO / "labs" / lab / f"{lab}.ipynb") in text
    page.goto(f"{served}/labs/lab01_timing/lab01_timing.html")
    assert page.locator(".admonition", has_text="as learners receive it").count()
    assert page.locator("a[href*='mybinder.org']").count() and page.locator("a[href*='colab.research']").count()


def test_search_finds_a_lecture(page, served):
    page.goto(f"{served}/search.html?q=autocast")
    results = page.locator("#search-results a", has_text="Mixed precision")
    results.first.wait_for()


def test_record_saves_a_run_with_this_machines_provenance_and_the_site_shows_it(tmp_path):
    lectures, results = tmp_path / "lectures", tmp_path / "results"
    lectures.mkdir()
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# 01 · A lecture in one cell"),
            nbformat.v4.new_code_cell("import torch\nprint('sum', int(torch.arange(5).sum()))"),
        ]
    )
    nbformat.write(notebook, lectures / "01_tiny.ipynb")

    path = record("tiny", lectures=lectures, results=results, progress=False)

    here = Environment.capture(pick_device())
    execution = execution_of(nbformat.read(path, as_version=4))
    assert path.parent == results / "01_tiny" and path.suffix == ".ipynb"
    assert (execution.environment.device_name, execution.environment.torch, execution.environment.commit) == (
        here.device_name,
        here.torch,
        here.commit,
    )
    assert execution.environment.date == here.date and execution.seconds > 0
    assert "sum 10" in nbformat.read(path, as_version=4).cells[1].outputs[0].text
    assert recordings("01_tiny", results) == [(path, execution)]

    site = build_site(tmp_path / "site", lectures=lectures, labs=tmp_path / "no-labs", results=results, progress=False)
    assert site.recordings == 1 and len(site.executed) == 1
    shown = (site.index.parent / "results" / "01_tiny" / path.with_suffix(".html").name).read_text()
    assert "A recorded run" in shown and here.device_name in shown and "sum 10" in shown
    assert f"results/01_tiny/{path.stem}.html" in (site.index.parent / "results.html").read_text()

    again = build_site(tmp_path / "site", lectures=lectures, labs=tmp_path / "no-labs", results=results, progress=False)
    assert again.executed == (), "an unchanged lecture was run again"


def test_record_names_the_lectures_when_the_chapter_is_unknown():
    run = subprocess.run([sys.executable, "-m", "perflab", "record", "99"], capture_output=True, text=True)
    assert run.returncode == 2 and "no lecture is named '99'" in run.stderr and chapters()[0] in run.stderr


def test_the_course_ships_a_recording_of_every_lecture():
    for chapter in chapters():
        assert recordings(chapter, RESULTS), f"no recorded run of {chapter} under results/"
