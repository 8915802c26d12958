"""Start a lecture or a lab from the course's template: the shared setup cell, then the sections every one has.

    $ python tools/new_notebook.py lecture 10_tensor_parallel "Tensor parallelism"
    wrote lectures/10_tensor_parallel.ipynb
    $ python tools/new_notebook.py lab lab11_tensor_parallel "Split a layer over two ranks"
    wrote solutions/lab11_tensor_parallel/lab11_tensor_parallel.ipynb

A lecture gets objectives, idea, measure, exercise and takeaways; a lab gets nbgrader's cells
(read-only setup, an answer cell with its solution, an autograded test with hidden tests, an
answer graded by hand), so that the round trip in tests/test_labs.py grades it at once. The
setup cell is copied from lectures/01_gpu_basics.ipynb: tests/test_setup_cells.py keeps every
notebook's the same.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

REPO = Path(__file__).resolve().parent.parent
_SETUP_SOURCE = REPO / "lectures" / "01_gpu_basics.ipynb"


def setup_cell_source() -> str:
    """The setup cell every notebook starts with."""
    notebook = nbformat.read(_SETUP_SOURCE, as_version=4)
    return next(cell.source for cell in notebook.cells if cell.cell_type == "code")


def _nbgrader(cell, grade_id: str, *, locked=False, solution=False, points: int | None = None):
    cell.metadata["nbgrader"] = {
        "grade": points is not None, "grade_id": grade_id, "locked": locked, "schema_version": 3,
        "solution": solution, "task": False, **({"points": points} if points is not None else {}),
    }  # fmt: skip
    return cell


def lecture(name: str, title: str) -> nbformat.NotebookNode:
    number = name.split("_", 1)[0]
    sections = [
        f"# {number} · {title}\n\n**Objectives.** After this notebook you can\n\n- ...\n\n"
        "**How this notebook runs.** Every number in it is measured when you run it, on your machine; "
        "say here what differs on a GPU.",
        "## 1 · The idea\n\nThe technique's own code goes inline, in the cells below.",
        "## 2 · Measure it\n\nInstruments are one-line `perflab` calls: `perflab.compare(baseline, candidate)`.",
        "## 3 · Exercise\n\n...",
        "## 4 · Takeaways\n\n- ...",
    ]
    cells = [new_markdown_cell(sections[0]), new_code_cell(setup_cell_source())]
    cells += [new_markdown_cell(text) for text in sections[1:]]
    return new_notebook(cells=cells, metadata=_KERNEL)


def lab(name: str, title: str) -> nbformat.NotebookNode:
    number = name.removeprefix("lab").split("_", 1)[0]
    cells = [
        _nbgrader(
            new_markdown_cell(f"# Lab {number} — {title}\n\nWhat the learner builds, and why."), "intro", locked=True
        ),
        _nbgrader(new_code_cell(setup_cell_source()), "colab_setup", locked=True),
        _nbgrader(new_code_cell("import torch\n\ntorch.manual_seed(0)"), "setup", locked=True),
        _nbgrader(new_markdown_cell("## Part 1 — ... (1 point)\n\nWrite `answer(x)`: ..."), "part1", locked=True),
        _nbgrader(
            new_code_cell("def answer(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"),
            "answer",
            solution=True,
        ),
        _nbgrader(
            new_code_cell(
                "assert answer(1) == 2\n### BEGIN HIDDEN TESTS\nassert answer(21) == 42\n### END HIDDEN TESTS"
            ),
            "test_answer",
            locked=True,
            points=1,
        ),
        _nbgrader(new_markdown_cell("## Part 2 — Explain (1 point, graded by hand)\n\n..."), "part2", locked=True),
        _nbgrader(new_markdown_cell("YOUR ANSWER HERE"), "explain", solution=True, points=1),
    ]
    return new_notebook(cells=cells, metadata=_KERNEL)


_KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}


def main(argv: list[str] | None = None, repo: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("lecture", "lab"))
    parser.add_argument("name", help="NN_topic for a lecture, labNN_topic for a lab")
    parser.add_argument("title")
    args = parser.parse_args(argv)
    if args.kind == "lecture":
        path, notebook = repo / "lectures" / f"{args.name}.ipynb", lecture(args.name, args.title)
    else:
        path, notebook = repo / "solutions" / args.name / f"{args.name}.ipynb", lab(args.name, args.title)
    if path.exists():
        print(f"{path.relative_to(repo)} exists: not overwritten", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)
    print(f"wrote {path.relative_to(repo)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
