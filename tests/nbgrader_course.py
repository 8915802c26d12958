"""A throwaway nbgrader course built from this repository, for the grading tests.

course = NbgraderCourse.copy_of_repo(tmp_path)
course.release_all()                  # every lab, in one nbgrader process
mine = course.copy_to(other_tmp_path)  # sources, releases and gradebook: a test's own course
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
from perflab.grading.sandbox import SANDBOX_ENV_VAR, bwrap_works

REPO = Path(__file__).resolve().parents[1]
LAB_NAMES = sorted(path.name for path in (REPO / "solutions").iterdir() if path.is_dir())


class NbgraderCourse:
    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def copy_of_repo(cls, parent: Path) -> NbgraderCourse:
        root = parent / "course"
        root.mkdir()
        shutil.copy(REPO / "nbgrader_config.py", root)
        shutil.copytree(
            REPO / "solutions", root / "solutions", ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__")
        )
        return cls(root)

    def run(self, *args: str, timeout: float = 900) -> str:
        """Run ``nbgrader ARGS`` here; raise with nbgrader's own output when it fails."""
        bin_dir = Path(sys.executable).parent
        # nbgrader starts `alembic` (and kernels start `python`) from PATH: use this environment's.
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        if not bwrap_works():  # the tests that need the sandbox skip, saying so; the rest grade without it
            env[SANDBOX_ENV_VAR] = "0"
        completed = subprocess.run(
            [str(bin_dir / "nbgrader"), *args],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        output = completed.stdout + completed.stderr
        if completed.returncode != 0:
            raise AssertionError(f"`nbgrader {' '.join(args)}` failed ({completed.returncode}):\n{output[-6000:]}")
        return output

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
