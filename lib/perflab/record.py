"""Lectures run top to bottom, kept with where they ran: ``python -m perflab record`` and the website's pages.

    >>> from perflab.record import chapter_path, device_slug
    >>> chapter_path("01").name, chapter_path("gpu_basics").name
    ('01_gpu_basics.ipynb', '01_gpu_basics.ipynb')
    >>> from perflab.render import Environment
    >>> device_slug(Environment("cuda:0", "NVIDIA H100 80GB HBM3", "2.14.1", 16, "3.11.7", "2026-11-24", "40eb828"))
    'cuda-nvidia-h100-80gb-hbm3'

``record("01")`` executes ``lectures/01_gpu_basics.ipynb`` in a fresh kernel, the code a learner
runs, and writes the executed notebook to ``results/01_gpu_basics/<device>.ipynb`` with an
:class:`Execution` in its metadata: the machine, torch, the date, the commit, the seconds it took.
Nothing in it is typed by hand. The website (:mod:`perflab.site`) shows every recording beside
the outputs of the machine that builds it.

Used in: lecture 10 (triton), and by perflab.site and perflab.__main__: ``python -m perflab record``.
"""

from __future__ import annotations

import datetime
import hashlib
import html
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat

from perflab.device import pick_device
from perflab.grading.course import REPO
from perflab.native_logs import without_noise
from perflab.render import Environment

__all__ = [
    "LECTURES",
    "RESULTS",
    "Execution",
    "chapter_path",
    "chapters",
    "device_slug",
    "drop_log_noise",
    "execute",
    "execution_of",
    "explain_expected_failures",
    "record",
    "recordings",
    "source_sha256",
    "stamp",
]

LECTURES = REPO / "lectures"
RESULTS = REPO / "results"
METADATA_KEY = "perflab_execution"  # where an executed notebook keeps its Execution
CELL_TIMEOUT_S = 600


@dataclass(frozen=True)
class Execution:
    """One run of a lecture, top to bottom in a fresh kernel: on what, when, from which source, how long."""

    chapter: str
    environment: Environment
    source_sha256: str  # of the lecture's .ipynb file as it was run
    executed_at: str  # ISO 8601, UTC, to the second
    seconds: float

    def to_dict(self) -> dict:
        return {**asdict(self), "environment": self.environment.to_dict()}

    @classmethod
    def from_dict(cls, fields: dict) -> Execution:
        return cls(**{**fields, "environment": Environment.from_dict(fields["environment"])})

    def __str__(self) -> str:
        return f"{self.chapter}, run in {self.seconds:.0f} s at {self.executed_at} on {self.environment}"

    def __repr__(self) -> str:
        return f"Execution({self})"

    def _repr_html_(self) -> str:
        return f"<p><b>{html.escape(self.chapter)}</b>: {html.escape(str(self)[len(self.chapter) + 2 :])}</p>"


def chapters(lectures: Path = LECTURES) -> list[str]:
    """The lectures' names, in course order: ``['01_gpu_basics', '02_profiling', ...]``."""
    return sorted(path.stem for path in lectures.glob("[0-9][0-9]_*.ipynb"))


def chapter_path(chapter: str, lectures: Path = LECTURES) -> Path:
    """The lecture a chapter names, by number (``"01"``), by topic (``"gpu_basics"``) or in full."""
    matches = [name for name in chapters(lectures) if chapter in (name, name[:2], name[3:])]
    if len(matches) != 1:
        raise ValueError(f"no lecture is named {chapter!r}: choose one of {', '.join(chapters(lectures))} or 'all'")
    return lectures / f"{matches[0]}.ipynb"


def source_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def device_slug(environment: Environment) -> str:
    """A file name for the device an execution ran on: its type and its model."""
    kind = environment.device.split(":")[0]
    return re.sub(r"[^a-z0-9]+", "-", f"{kind} {environment.device_name}".lower()).strip("-")


def execution_of(notebook: nbformat.NotebookNode) -> Execution | None:
    """The Execution an executed notebook carries, or None for one that was never run by this module."""
    fields = notebook.metadata.get(METADATA_KEY)
    return Execution.from_dict(fields) if fields else None


def stamp(notebook: nbformat.NotebookNode, path: Path, environment: Environment, seconds: float) -> None:
    """Keep in ``notebook`` that it is the lecture at ``path``, run just now on ``environment`` in ``seconds``."""
    execution = Execution(
        chapter=path.stem,
        environment=environment,
        source_sha256=source_sha256(path),
        executed_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(seconds, 1),
    )
    notebook.metadata[METADATA_KEY] = execution.to_dict()


def drop_log_noise(notebook: nbformat.NotebookNode) -> int:
    """Remove torch's uninformative log lines (:data:`perflab.native_logs.NOISE`) from ``notebook``'s stderr outputs.

    In place; an output left empty is dropped. Every other line stays. Returns how many lines went.
    """
    removed = 0
    for cell in notebook.cells:
        kept = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                text = output["text"] if isinstance(output["text"], str) else "".join(output["text"])
                cleaned = without_noise(text)
                removed += text.count("\n") - cleaned.count("\n")
                if not cleaned.strip():
                    continue
                output["text"] = cleaned
            kept.append(output)
        if "outputs" in cell:
            cell["outputs"] = kept
    return removed


EXPECTED_FAILURE_TAG = "raises-exception"  # nbval's tag: the exercises' checks, which fail until the exercise is done


def explain_expected_failures(notebook: nbformat.NotebookNode) -> int:
    """Turn the error of each cell tagged ``raises-exception`` into a line saying why it failed, in place.

    A recording runs a lecture as learners get it, exercises unsolved, so each exercise's check raises; stored as an
    error, a reader takes it for a broken lecture. The line keeps the exception's own type and message. Returns how
    many errors it explained.

        >>> notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("assert 0", metadata={
        ...     "tags": ["check", "raises-exception"]})])
        >>> notebook.cells[0].outputs = [nbformat.v4.new_output("error", ename="AssertionError", evalue="not yet",
        ...                                                      traceback=[])]
        >>> explain_expected_failures(notebook), notebook.cells[0].outputs[0].text
        (1, 'This check fails until the exercise above is solved: AssertionError: not yet\\n')
    """
    explained = 0
    for cell in notebook.cells:
        if EXPECTED_FAILURE_TAG not in cell.get("metadata", {}).get("tags", []):
            continue
        for index, output in enumerate(cell.get("outputs", [])):
            if output.get("output_type") == "error":
                line = f"This check fails until the exercise above is solved: {output['ename']}: {output['evalue']}\n"
                cell["outputs"][index] = nbformat.v4.new_output("stream", name="stdout", text=line)
                explained += 1
    return explained


def execute(path: Path, *, progress: bool = True) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` top to bottom in a fresh kernel, in its own folder, and stamp it.

    A cell that raises fails the run (:class:`nbclient.exceptions.CellExecutionError`), except the
    cells tagged ``raises-exception``: the exercises' checks, which fail until the exercise is done.
    """
    from nbclient import NotebookClient
    from tqdm.auto import tqdm

    notebook = nbformat.read(path, as_version=4)
    code_cells = sum(cell.cell_type == "code" for cell in notebook.cells)
    environment = Environment.capture(pick_device())  # the device each lecture's setup cell picks
    with tqdm(total=code_cells, desc=path.stem, unit="cell", disable=not progress) as bar:
        client = NotebookClient(
            notebook,
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
            store_widget_state=False,  # the widgets' fallback text is what a static page can show
            on_cell_executed=lambda **_: bar.update(1),
        )
        start = time.perf_counter()
        client.execute()
    stamp(notebook, path, environment, time.perf_counter() - start)
    drop_log_noise(notebook)  # the kernel's own filter drops them too; a kernel started elsewhere may not
    explain_expected_failures(notebook)
    return notebook


def record(chapter: str, *, lectures: Path = LECTURES, results: Path = RESULTS, progress: bool = True) -> Path:
    """Execute one lecture and save it as ``results/<chapter>/<device>.ipynb``; the file's path."""
    notebook = execute(chapter_path(chapter, lectures), progress=progress)
    execution = execution_of(notebook)
    destination = results / execution.chapter / f"{device_slug(execution.environment)}.ipynb"
    destination.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, destination)
    return destination


def recordings(chapter: str, results: Path = RESULTS) -> list[tuple[Path, Execution]]:
    """Every recording of a chapter under ``results``, with its Execution, by device."""
    found = []
    for path in sorted((results / chapter).glob("*.ipynb")):
        execution = execution_of(nbformat.read(path, as_version=4))
        if execution is None:
            raise ValueError(f"{path} is not a recording: it has no {METADATA_KEY!r} metadata")
        found.append((path, execution))
    return found
