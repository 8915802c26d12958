"""Every notebook starts with the same setup cell, which works here, on Binder and on Colab."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import nbformat
import perflab
import pytest
from perflab.grading.course import REPO

REPOSITORY = "https://github.com/perflab/perflab"
NOTEBOOKS = sorted([*REPO.glob("lectures/*.ipynb"), *REPO.glob("solutions/*/*.ipynb"), *REPO.glob("labs/*/*.ipynb")])


def _setup_cell(path) -> str:
    notebook = nbformat.read(path, as_version=4)
    return next(cell.source for cell in notebook.cells if cell.cell_type == "code")


def test_every_notebook_starts_with_the_same_setup_cell():
    assert NOTEBOOKS, "no notebooks found"
    cells = {path.relative_to(REPO): _setup_cell(path) for path in NOTEBOOKS}
    reference = cells[next(iter(cells))]
    assert "pip" in reference and REPOSITORY in reference
    assert {path for path, cell in cells.items() if cell != reference} == set()


def _run_setup(monkeypatch, *, installed: bool, colab: bool) -> tuple[list, list, dict]:
    """Execute the setup cell with pip, the perflab lookup and Colab replaced by recorders."""
    pip_calls, widget_managers = [], []
    monkeypatch.setattr(subprocess, "run", lambda args, **kwargs: pip_calls.append(args))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "perflab" and not installed else real_find_spec(name, *a),
    )
    if colab:
        output = types.SimpleNamespace(enable_custom_widget_manager=lambda: widget_managers.append(True))
        colab_module = types.ModuleType("google.colab")
        colab_module.output = output
        monkeypatch.setitem(sys.modules, "google.colab", colab_module)
    namespace: dict = {}
    exec(_setup_cell(NOTEBOOKS[0]), namespace)
    return pip_calls, widget_managers, namespace


def test_setup_installs_nothing_where_perflab_is_importable(monkeypatch):
    pip_calls, widget_managers, namespace = _run_setup(monkeypatch, installed=True, colab=False)
    assert pip_calls == [] and widget_managers == []
    assert namespace["device"] == perflab.pick_device()


def test_setup_on_colab_installs_perflab_without_touching_torch_and_enables_widgets(monkeypatch):
    pip_calls, widget_managers, _ = _run_setup(monkeypatch, installed=False, colab=True)
    assert len(pip_calls) == 1
    command = pip_calls[0]
    assert command[:4] == [sys.executable, "-m", "pip", "install"]
    assert "--no-deps" in command and f"git+{REPOSITORY}" in command
    assert widget_managers == [True]


def test_setup_picks_the_gpu_when_there_is_one(monkeypatch):
    monkeypatch.delenv("PERFLAB_DEVICE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    _, _, namespace = _run_setup(monkeypatch, installed=True, colab=False)
    assert namespace["device"].type == "cuda"


@pytest.mark.parametrize(
    "badge",
    [
        "https://mybinder.org/v2/gh/perflab/perflab/main?urlpath=lab",
        "https://colab.research.google.com/github/perflab/perflab/blob/main/lectures/01_gpu_basics.ipynb",
    ],
)
def test_readme_has_the_launch_badges(badge):
    assert badge in (REPO / "README.md").read_text()


TRITON_CHAPTER = [path for path in NOTEBOOKS if path.name.startswith(("10_triton", "lab10_flash_triton"))]


@pytest.mark.parametrize("path", TRITON_CHAPTER, ids=lambda path: str(path.relative_to(REPO)))
def test_the_triton_chapter_says_where_to_run_it_where_triton_is_missing(monkeypatch, path):
    """torch brings Triton on Linux only: on a Mac the chapter's second cell stops with where to run it instead."""
    assert len(TRITON_CHAPTER) == 3, "lecture 10, lab 10's source and its release"
    notebook = nbformat.read(path, as_version=4)
    second = [cell.source for cell in notebook.cells if cell.cell_type == "code"][1]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    with pytest.raises(RuntimeError, match="Linux only: run it on Linux, in WSL, on Binder or on Colab"):
        exec(second, {"device": perflab.pick_device()})
