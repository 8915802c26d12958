"""The course as a website: every lecture with its executed outputs and where they were measured.

    >>> from perflab.site import build_site
    >>> site = build_site()        # doctest: +SKIP
    >>> site                       # doctest: +SKIP
    Site(build/site/html/index.html: 9 lectures (1 run now, 8 from the cache), 10 labs, 9 recordings; 52 s)

``make site`` (``python -m perflab site``) runs each lecture top to bottom on this machine
(:func:`perflab.record.execute`), keeps the executed notebook in a cache named by the lecture's
content, and stages the pages for Sphinx with MyST-NB and the book theme:

- ``lectures/NN_*.ipynb``: executed, with a box under the title that says where and when;
- ``labs/labNN_*/*.ipynb``: the student versions from ``labs/``, as handed out, not executed;
- ``results/<chapter>/<device>.ipynb``: each run recorded by ``python -m perflab record``.

Every page leaves out torch's uninformative log lines (:mod:`perflab.native_logs`); other stderr stays.

A rebuild after one edit runs only the edited lecture, and Sphinx re-renders only the pages whose
staged file changed.

Used by perflab.__main__ (``python -m perflab site``, ``make site``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from perflab.grading.course import REPO
from perflab.record import (
    LECTURES,
    RESULTS,
    Execution,
    chapters,
    drop_log_noise,
    execute,
    execution_of,
    recordings,
    source_sha256,
)

__all__ = ["BUILD", "Site", "build_site", "cache_executed"]

BUILD = REPO / "build" / "site"
SITE_FILES = REPO / "site"  # conf.py and the landing page's text
LABS = REPO / "labs"
CHAPTERS_MARKER = "<!-- chapters -->"


@dataclass(frozen=True)
class Site:
    """A built website: where its index is, what it holds, what this build had to run."""

    index: Path
    lectures: int
    labs: int
    recordings: int
    executed: tuple[Execution, ...]  # the lectures run by this build; the others came from the cache
    seconds: float

    def __str__(self) -> str:
        try:
            where = self.index.relative_to(Path.cwd())
        except ValueError:
            where = self.index
        run = len(self.executed)
        return (
            f"{where}: {_count(self.lectures, 'lecture')} ({run} run now, {self.lectures - run} from the cache), "
            f"{_count(self.labs, 'lab')}, {_count(self.recordings, 'recording')}; {self.seconds:.0f} s"
        )

    def __repr__(self) -> str:
        return f"Site({self})"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _cached(cache: Path, chapter: str, digest: str) -> Path:
    return cache / f"{chapter}-{digest[:16]}.ipynb"


def cache_executed(notebook: nbformat.NotebookNode, cache: Path) -> Path:
    """Keep an executed, stamped lecture in ``cache`` under its source's digest, replacing older runs."""
    execution = execution_of(notebook)
    path = _cached(cache, execution.chapter, execution.source_sha256)
    cache.mkdir(parents=True, exist_ok=True)
    for older in cache.glob(f"{execution.chapter}-*.ipynb"):
        older.unlink()
    partial = path.with_suffix(".partial")
    nbformat.write(notebook, partial)
    os.replace(partial, path)  # a build stopped halfway leaves no half-written notebook to reuse
    return path


def _executed_lecture(path: Path, cache: Path, progress: bool) -> tuple[nbformat.NotebookNode, bool]:
    """The lecture at ``path`` executed: from the cache when its content is unchanged; True when run now."""
    cached = _cached(cache, path.stem, source_sha256(path))
    if cached.is_file():
        return nbformat.read(cached, as_version=4), False
    notebook = execute(path, progress=progress)
    cache_executed(notebook, cache)
    return notebook, True


def _title(notebook: nbformat.NotebookNode) -> str:
    first = notebook.cells[0].source.splitlines()[0] if notebook.cells else ""
    return first.lstrip("#").strip() if first.startswith("# ") else "(untitled)"


def _with_box(notebook: nbformat.NotebookNode, title: str, lines: list[str]) -> nbformat.NotebookNode:
    """A copy of ``notebook``, without torch's log noise, with a note box right under its title cell."""
    box = nbformat.v4.new_markdown_cell("\n".join([f":::{{admonition}} {title}", ":class: note", "", *lines, ":::"]))
    copy = nbformat.from_dict(notebook)
    drop_log_noise(copy)  # recordings made before perflab.native_logs filtered them still carry them
    after_title = 1 if copy.cells and copy.cells[0].source.startswith("# ") else 0
    copy.cells.insert(after_title, box)
    for index, cell in enumerate(copy.cells):  # ids must be unique; the box's is random otherwise
        cell["id"] = f"cell-{index}"
    return copy


def _where(execution: Execution) -> str:
    return f"{execution.environment}; run at {execution.executed_at.replace('T', ' ')}"


def _lecture_page(notebook, runs: list[tuple[Path, Execution]]) -> nbformat.NotebookNode:
    execution = execution_of(notebook)
    lines = [
        f"Every output below comes from one run of this notebook, top to bottom, in {execution.seconds:.0f} s on the "
        f"machine that built this site: {_where(execution)}."
    ]
    if runs:
        links = [
            f"[{run.environment.device_name}, {run.executed_at[:10]}](../results/{run.chapter}/{path.name})"
            for path, run in runs
        ]
        lines += ["", "Recorded runs of this lecture: " + "; ".join(links) + "."]
    return _with_box(notebook, "Where these outputs were measured", lines)


def _recording_page(path: Path, execution: Execution, lectures: Path) -> nbformat.NotebookNode:
    lines = [
        f"Recorded by `python -m perflab record {execution.chapter[:2]}` in {execution.seconds:.0f} s on {_where(execution)}."
    ]
    current = lectures / f"{execution.chapter}.ipynb"
    if current.is_file() and source_sha256(current) != execution.source_sha256:
        lines += ["", "The lecture has changed since: its text and code may differ from the current version's."]
    return _with_box(nbformat.read(path, as_version=4), "A recorded run", lines)


def _lab_page(path: Path) -> nbformat.NotebookNode:
    lines = [
        "The lab as learners receive it (nbgrader's student version): the questions, without solutions or "
        "hidden tests, and not run here. Open it on Binder or Colab with the rocket button above, or with "
        "`make lab` in a clone of the course."
    ]
    return _with_box(nbformat.read(path, as_version=4), "A graded lab", lines)


def _chapters_table(lectures: dict[str, nbformat.NotebookNode], labs: dict[str, nbformat.NotebookNode]) -> str:
    rows = ["| # | lecture | lab |", "|---|---|---|"]
    numbers = sorted({name[:2] for name in lectures} | {name[3:5] for name in labs})
    for number in numbers:
        lecture = next(
            (f"[{_title(nb)}](lectures/{name}.ipynb)" for name, nb in lectures.items() if name[:2] == number), "—"
        )
        lab = next(
            (f"[{_title(nb)}](labs/{name}/{name}.ipynb)" for name, nb in labs.items() if name[3:5] == number), "—"
        )
        rows.append(f"| {number} | {lecture} | {lab} |")
    return "## The course\n\n" + "\n".join(rows)


def _results_page(runs: dict[str, list[tuple[Path, Execution]]]) -> str:
    rows = ["| lecture | device | torch | recorded | commit |", "|---|---|---|---|---|"]
    entries = []
    for chapter, chapter_runs in runs.items():
        for path, run in chapter_runs:
            env = run.environment
            rows.append(
                f"| [{chapter}](results/{chapter}/{path.name}) | {env.device} ({env.device_name}) | "
                f"{env.torch} | {run.executed_at[:10]} | `{env.commit}` |"
            )
            entries.append(f"results/{chapter}/{path.stem}")
    table = (
        "\n".join(rows)
        if entries
        else "No lecture has been recorded: `python -m perflab record all` records every one."
    )
    toctree = "\n".join(["```{toctree}", ":hidden:", "", *entries, "```"]) if entries else ""
    return (
        "# Recorded results\n\nEach lecture as run by `python -m perflab record <chapter>` on one machine, "
        "kept under `results/` with where and when it ran. Record a lecture on your GPU and send it in: "
        f"it appears here beside the others.\n\n{table}\n\n{toctree}\n"
    )


def _write_if_changed(path: Path, text: str) -> None:
    """Sphinx re-renders a page when its source is newer: leave unchanged pages untouched."""
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def build_site(
    out: Path = BUILD,
    *,
    cache: Path | None = None,
    lectures: Path = LECTURES,
    labs: Path = LABS,
    results: Path = RESULTS,
    progress: bool = True,
) -> Site:
    """Run what changed, stage every page under ``out/source`` and render the HTML into ``out/html``."""
    start = time.perf_counter()
    cache = cache or out / "executed"
    executed, lecture_notebooks = [], {}
    for chapter in chapters(lectures):
        notebook, ran = _executed_lecture(lectures / f"{chapter}.ipynb", cache, progress)
        lecture_notebooks[chapter] = notebook
        if ran:
            executed.append(execution_of(notebook))
    lab_paths = {path.parent.name: path for path in sorted(labs.glob("lab*/lab*.ipynb"))}
    runs = {chapter: recordings(chapter, results) for chapter in chapters(lectures)}

    source = out / "source"
    pages: dict[str, str] = {"conf.py": (SITE_FILES / "conf.py").read_text()}
    landing = (SITE_FILES / "index.md").read_text()
    lab_notebooks = {name: _lab_page(path) for name, path in lab_paths.items()}
    pages["index.md"] = landing.replace(CHAPTERS_MARKER, _chapters_table(lecture_notebooks, lab_notebooks))
    pages["results.md"] = _results_page(runs)
    for chapter, notebook in lecture_notebooks.items():
        pages[f"lectures/{chapter}.ipynb"] = nbformat.writes(_lecture_page(notebook, runs[chapter]))
    for name, notebook in lab_notebooks.items():
        pages[f"labs/{name}/{name}.ipynb"] = nbformat.writes(notebook)
    for chapter, chapter_runs in runs.items():
        for path, run in chapter_runs:
            pages[f"results/{chapter}/{path.name}"] = nbformat.writes(_recording_page(path, run, lectures))
    for relative, text in pages.items():
        _write_if_changed(source / relative, text)
    for stale in [path for path in source.rglob("*") if path.is_file() and str(path.relative_to(source)) not in pages]:
        stale.unlink()

    html = out / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-d", str(out / "doctrees"), str(source), str(html)],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        raise RuntimeError(f"Sphinx could not build the site (exit {build.returncode}):\n{build.stderr[-3000:]}")
    return Site(
        index=html / "index.html",
        lectures=len(lecture_notebooks),
        labs=len(lab_notebooks),
        recordings=sum(map(len, runs.values())),
        executed=tuple(executed),
        seconds=time.perf_counter() - start,
    )
