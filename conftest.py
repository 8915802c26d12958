import os
import signal
from pathlib import Path

import pytest

# labs/ holds generated student notebooks that raise NotImplementedError by design, and
# nbgrader's working folders hold copies: none of them is a test.
collect_ignore = ["labs", "submitted", "autograded", "feedback", ".venv"]
# Deprecated module names: importing one for its doctests would only warn that it was renamed.
collect_ignore += ["lib/perflab/checkpoint.py", "lib/perflab/profile.py"]
# Conftest files are loaded as such; collected again as doctest modules, two files named conftest collide.
collect_ignore += ["lib/conftest.py", "tests/conftest.py"]

# A lecture exercise is three cells: the learner's (tag "exercise"), a check the learner runs (tags "check" and
# nbval's "raises-exception"), and a collapsed solution (tag "solution") that passes the same check.
EXERCISE_CHECK_TAG = "check"


def _deprecations_are_errors() -> str:
    """PYTHONWARNINGS for the notebooks' kernels: a deprecated torch name used by a notebook (``__main__``) or by
    perflab fails the cell. Python matches a -W module exactly, so every perflab module is named."""
    lib = Path(__file__).parent / "lib"
    modules = ["__main__"] + sorted(
        ".".join(path.relative_to(lib).with_suffix("").parts).removesuffix(".__init__")
        for path in (lib / "perflab").rglob("*.py")
    )
    return ",".join(
        f"error::{category}:{module}" for module in modules for category in ("DeprecationWarning", "FutureWarning")
    )


def pytest_configure(config):
    # A suite started in the background by a non-interactive shell (nohup, `make test &`) inherits SIGINT ignored,
    # and so would every process it starts: the tests that interrupt a grading or a kernel need it delivered.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Inherited by every kernel nbval starts; tests that start their own kernels (labs, browser) inherit it too.
    os.environ["PYTHONWARNINGS"] = _deprecations_are_errors()


def pytest_collection_modifyitems(items):
    # A notebook run under nbval is never part of the fast tier.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


def _check_that_cannot_fail(item) -> str | None:
    """Why an exercise's check cell proves nothing: it passed on the exercise as handed out, before any answer."""
    cell = getattr(item, "cell", None)
    if cell is None or EXERCISE_CHECK_TAG not in cell.get("metadata", {}).get("tags", []):
        return None
    if any(output.get("output_type") == "error" for output in item.test_outputs or []):
        return None
    return (
        f"{item.name}: this exercise check passed before the exercise was done; a check must fail on the "
        f"exercise as handed out (and pass on its solution)"
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.passed and (problem := _check_that_cannot_fail(item)):
        report.outcome, report.longrepr = "failed", problem
    # Keep each phase's report on the test item, so a fixture can tell whether the test failed
    # (the browser test takes a screenshot then).
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="module")
def private_data_cache(tmp_path_factory):
    """Generate the course data of one test module into a fresh folder, not the learner's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PERFLAB_DATA", str(tmp_path_factory.mktemp("data")))
        yield
