"""tools/new_notebook.py: a new lecture or lab starts from the course's template, and a new lab grades at once."""

import shutil
import sys

import nbformat
import pytest
from nbgrader.api import Gradebook
from perflab.grading.course import REPO, NbgraderCourse

sys.path.insert(0, str(REPO / "tools"))
import new_notebook  # noqa: E402  (tools/ is not a package: it is put on the path above)


def _course_folder(tmp_path):
    (tmp_path / "lectures").mkdir()
    shutil.copy(REPO / "lectures" / "01_gpu_basics.ipynb", tmp_path / "lectures")
    shutil.copy(REPO / "nbgrader_config.py", tmp_path)
    return tmp_path


def test_a_new_lecture_has_the_setup_cell_and_the_five_sections(tmp_path, capsys):
    repo = _course_folder(tmp_path)
    assert new_notebook.main(["lecture", "09_sharding", "Sharded data parallel"], repo=repo) == 0
    notebook = nbformat.read(repo / "lectures" / "09_sharding.ipynb", as_version=4)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    assert code[0] == new_notebook.setup_cell_source() and "perflab.pick_device()" in code[0]
    headings = " ".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    for part in ("# 09 · Sharded data parallel", "Objectives", "idea", "Measure", "Exercise", "Takeaways"):
        assert part in headings
    assert new_notebook.main(["lecture", "09_sharding", "again"], repo=repo) == 1, "never overwrites"
    assert "exists" in capsys.readouterr().err


@pytest.mark.slow
def test_a_new_lab_grades_both_ways(tmp_path):
    repo = _course_folder(tmp_path)
    assert new_notebook.main(["lab", "lab12_demo", "A demonstration"], repo=repo) == 0
    course = NbgraderCourse(repo)
    release = course.release("lab12_demo")
    course.submit("solved", "lab12_demo", files_from=repo / "solutions" / "lab12_demo")
    course.submit("untouched", "lab12_demo", files_from=release)
    course.run("autograde", "lab12_demo", "--force")
    with Gradebook(f"sqlite:///{repo / 'gradebook.db'}") as gradebook:
        solved = gradebook.find_submission("lab12_demo", "solved")
        untouched = gradebook.find_submission("lab12_demo", "untouched")
        assert solved.code_score == solved.max_code_score == 1 and solved.max_written_score == 1
        assert untouched.code_score == 0
