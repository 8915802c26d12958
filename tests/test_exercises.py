"""Every lecture has at least three exercises, each checked by asserts the learner runs, each solution collapsed.

An exercise is three consecutive code cells, which lecture notebooks mark with tags:

- ``exercise``: where the learner writes, handed out unfinished;
- ``check`` (and nbval's ``raises-exception``): defines ``check_<name>(...)`` with asserts and calls it on the
  learner's answer. Under nbval it must fail on the exercise as handed out (conftest.py fails a check that passes
  there), so a check that cannot fail is caught;
- ``solution``: collapsed (source and outputs hidden) until the learner opens it; it ends by passing the same
  ``check_<name>``, which nbval requires to succeed. Markdown cells tagged ``solution`` (a written explanation)
  may follow it, collapsed too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

LECTURES = sorted((Path(__file__).resolve().parents[1] / "lectures").glob("*.ipynb"))
MIN_EXERCISES = 3


def _tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def _hidden(cell) -> bool:
    jupyter = cell.get("metadata", {}).get("jupyter", {})
    return bool(jupyter.get("source_hidden")) and (cell.cell_type == "markdown" or bool(jupyter.get("outputs_hidden")))


def _check_functions(source: str) -> set[str]:
    return {
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")
    }


def _calls(source: str) -> set[str]:
    return {
        node.func.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def _exercises(notebook) -> list[tuple[int, list]]:
    """(index of the exercise cell, the cells from it up to the next exercise) for each exercise."""
    starts = [i for i, cell in enumerate(notebook.cells) if "exercise" in _tags(cell)]
    return [(start, notebook.cells[start:end]) for start, end in zip(starts, starts[1:] + [len(notebook.cells)])]


def _problems(index: int, cells: list) -> list[str]:
    exercise, *rest = cells
    where = f"exercise at cell {index}"
    if exercise.cell_type != "code":
        return [f"{where}: the cell tagged 'exercise' must be a code cell, where the learner writes"]
    if _hidden(exercise):
        return [f"{where}: the exercise itself is collapsed"]
    code = [cell for cell in rest if cell.cell_type == "code"]
    if len(code) < 2 or "check" not in _tags(code[0]) or "solution" not in _tags(code[1]):
        return [f"{where}: the next two code cells must be tagged 'check' and then 'solution'"]
    check, solution = code[0], code[1]
    problems = []
    if "raises-exception" not in _tags(check):
        problems.append(f"{where}: its check fails on the unfinished exercise, so tag it 'raises-exception' too")
    checks = _check_functions(check.source)
    if not checks:
        problems.append(f"{where}: its check cell defines no check_<name>(...) function")
    elif not any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(check.source))):
        problems.append(f"{where}: its check cell has no assert")
    elif not checks & _calls(check.source):
        problems.append(f"{where}: its check cell defines {sorted(checks)} but does not call it on the answer")
    elif not checks & _calls(solution.source):
        problems.append(f"{where}: its solution does not pass {sorted(checks)} (call it at the end)")
    shown = [cell for cell in rest if "solution" in _tags(cell) and not _hidden(cell)]
    if shown:
        problems.append(
            f"{where}: {len(shown)} cell(s) tagged 'solution' are not collapsed (source and outputs hidden)"
        )
    return problems


@pytest.mark.parametrize("path", LECTURES, ids=lambda path: path.stem)
def test_every_lecture_has_three_checked_exercises_with_collapsed_solutions(path):
    notebook = nbformat.read(path, as_version=4)
    exercises = _exercises(notebook)
    problems = [problem for index, cells in exercises for problem in _problems(index, cells)]
    assert not problems, "\n".join(problems)
    assert len(exercises) >= MIN_EXERCISES, (
        f"{path.name} has {len(exercises)} exercises; every lecture has at least {MIN_EXERCISES} "
        f"(cells tagged exercise, check, solution)"
    )


def test_a_solution_left_open_is_found():
    exercise = nbformat.v4.new_code_cell("def f():\n    ...", metadata={"tags": ["exercise"]})
    check = nbformat.v4.new_code_cell(
        "def check_f(f):\n    assert f() == 1\ncheck_f(f)", metadata={"tags": ["check", "raises-exception"]}
    )
    solution = nbformat.v4.new_code_cell("def f():\n    return 1\ncheck_f(f)", metadata={"tags": ["solution"]})
    assert any("not collapsed" in problem for problem in _problems(0, [exercise, check, solution]))
    solution.metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": True}
    assert _problems(0, [exercise, check, solution]) == []
    check.source = "def check_f(f):\n    return f() == 1\ncheck_f(f)"
    assert any("no assert" in problem for problem in _problems(0, [exercise, check, solution]))
