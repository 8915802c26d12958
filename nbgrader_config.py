"""nbgrader configuration for the perflab course.

Instructors run nbgrader from this folder: sources (with solutions and hidden tests) live in
solutions/<lab>/, and `nbgrader generate_assignment <lab> --force` writes the student
version to labs/<lab>/.
"""

import glob
from pathlib import Path

c = get_config()  # noqa: F821 - injected by traitlets when it loads this file

c.CourseDirectory.course_id = "perflab"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "labs"

# nbgrader's exchange (release_assignment, fetch, submit, collect) in the course's own folder, for a course on one
# machine: formgrader looks for the exchange when it handles a request (an autograde among them), and where it does not
# exist (nbgrader's default, /usr/local/share/nbgrader/exchange) logs a critical "Unwritable directory". On a
# JupyterHub whose learners share an exchange, give its path here instead.
_exchange = Path(__file__).resolve().parent / "exchange"
_exchange.mkdir(exist_ok=True)
c.Exchange.root = str(_exchange)

# Labs train small models and the capstone re-measures a speedup: a cell may run for minutes.
c.Execute.timeout = 600

# A release holds the notebook and the files under the lab's data/ folder, nothing else:
# helper scripts, reference outputs or notes beside a source notebook could leak a solution.
# nbgrader copies every file that its ignore list does not name, by file name, so the list
# names every other file that the sources hold.
_source_root = Path(__file__).resolve().parent / "solutions"
_undeclared, _declared = set(), set()
for _path in _source_root.glob("*/**/*"):
    if _path.is_file():
        _in_data = _path.relative_to(_source_root).parts[1] == "data"
        if _in_data:
            _declared.add(_path.name)
        elif _path.suffix != ".ipynb":
            _undeclared.add(_path.name)
if _undeclared & _declared:
    raise ValueError(
        f"rename these files: a data file shares its name with an undeclared one: {_undeclared & _declared}"
    )
c.CourseDirectory.ignore = [
    ".ipynb_checkpoints",
    "*.pyc",
    "__pycache__",
    "feedback",
    *(glob.escape(name) for name in sorted(_undeclared)),
]

# Autograde runs each submission's kernel in a bubblewrap sandbox and, before the scores are saved,
# re-measures every measured cell outside the kernel (perflab.grading; the README's threat model).
from perflab.grading.nbgrader import AUTOGRADE_PREPROCESSORS  # noqa: E402 - after the settings above

c.Autograde.autograde_preprocessors = AUTOGRADE_PREPROCESSORS
