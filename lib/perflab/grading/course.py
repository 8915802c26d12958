"""A throwaway nbgrader course built from this repository, for the grading tests and benchmarks.

    course = NbgraderCourse.copy_of_repo(tmp_path)
    course.release_all()                   # every lab, in one nbgrader process
    course.submit("ada", "lab01_timing", course.root / "solutions" / "lab01_timing")
    course.run("autograde", "lab01_timing")
    mine = course.copy_to(other_tmp_path)   # sources, releases and gradebook: a test's own course

It needs a clone of the repository (an editable install): the labs' sources live beside ``lib/``,
not in the installed package.

Used by perflab.grading.bench and the grading tests (tests/conftest.py, tests/test_labs.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from perflab.grading.sandbox import SANDBOX_ENV_VAR, bwrap_works
from perflab.grading.working_copy import nbgrader_environment

__all__ = ["LAB_NAMES", "REPO", "NbgraderCourse"]

REPO = Path(__file__).resolve().parents[3]
LAB_NAMES = sorted(path.name for path in (REPO / "solutions").iterdir() if path.is_dir())


class NbgraderCourse:
    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def copy_of_repo(cls, parent: Path, course: Path = REPO) -> NbgraderCourse:
        """A new course in ``parent/course`` with the configuration and sources of ``course`` (this repository)."""
        root = parent / "course"
        root.mkdir()
        shutil.copy(course / "nbgrader_config.py", root)
        shutil.copytree(
            course / "solutions", root / "solutions", ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__")
        )
        return cls(root)

    def run(self, *args: str, timeout: float = 900, as_module: bool = False, env: dict[str, str] | None = None) -> str:
        """Run ``nbgrader ARGS`` here (``python -m nbgrader ARGS`` if ``as_module``), with ``env`` added to its
        environment; raise with nbgrader's own output when it fails."""
        nbgrader = [sys.executable, "-m", "nbgrader"] if as_module else [str(Path(sys.executable).parent / "nbgrader")]
        completed = subprocess.run(
            [*nbgrader, *args],
            cwd=self.root,
            env={**self.environment(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        output = completed.stdout + completed.stderr
        if completed.returncode != 0:
            raise AssertionError(f"`nbgrader {' '.join(args)}` failed ({completed.returncode}):\n{output[-6000:]}")
        return output

    @staticmethod
    def environment() -> dict[str, str]:
        """What nbgrader runs with here: without bubblewrap the sandbox is off, and the tests that need it skip."""
        env = nbgrader_environment()
        if not bwrap_works():
            env[SANDBOX_ENV_VAR] = "0"
        return env

    def copy_to(self, parent: Path) -> NbgraderCourse:
        """This course as it stands (sources, releases, gradebook), copied to ``parent/course``."""
        return NbgraderCourse(Path(shutil.copytree(self.root, parent / "course")))

    def release(self, lab: str) -> Path:
        self.run("generate_assignment", lab, "--force")
        return self.root / "labs" / lab

    def release_all(self) -> None:
        """Release every lab: nbgrader matches the assignment "*" against every folder of solutions/."""
        self.run("generate_assignment", "*", "--force")

    def submit(self, student: str, lab: str, files_from: Path) -> None:
        """Hand in a copy of a lab folder as ``student``, as ``nbgrader collect`` would lay it out."""
        shutil.copytree(files_from, self.root / "submitted" / student / lab)

    def submit_notebook(self, student: str, lab: str, notebook: nbformat.NotebookNode, files: dict[str, str]) -> None:
        """Hand in ``notebook`` as the lab's notebook, and ``files`` (relative path -> text) beside it."""
        folder = self.root / "submitted" / student / lab
        folder.mkdir(parents=True)
        nbformat.write(notebook, folder / f"{lab}.ipynb")
        for relative, text in files.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_text(text)
