import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
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


# The variables that cap a process's threads (OpenMP's, MKL's, OpenBLAS's): perflab.grading.machine_lock.THREAD_CAPS,
# written again because importing perflab loads torch, and pytest_configure reads them in xdist's controller too, which
# runs no test and need not load it; so is perflab.cpu_quota.FITTED_VARIABLE in pytest_configure.
_THREAD_CAPS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _cap_threads_to_a_share(workers: int) -> None:
    """Give this xdist worker, and every process it starts, its share of the cores in threads: two workers on two
    cores each running torch on two threads leave every parallel region waiting for a descheduled thread (lecture 03's
    data loading measured 6-8x slower beside two busy processes, not 2x). The cores are those a CPU quota serves,
    where one limits the machine (perflab.cpu_quota: .ci/slowed's cgroup)."""
    from perflab.cpu_quota import usable_cores

    cores = usable_cores()
    share = max(1, cores // workers)
    if share >= cores:
        return
    os.environ.update({name: str(share) for name in _THREAD_CAPS})
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(share)
    _THREADS_CAPPED.update(share=share, cores=cores)


_THREADS_CAPPED: dict[str, int] = {}


@contextlib.contextmanager
def _every_core():
    """Within the block, this process and what it starts run on every core (as many as a CPU quota serves): a
    measurement has the machine alone."""
    if not _THREADS_CAPPED:
        yield
        return
    from perflab.cpu_quota import affinity_cores

    every = _THREADS_CAPPED["cores"]
    for name in _THREAD_CAPS:
        os.environ.pop(name, None)
    if every < affinity_cores():  # a CPU quota serves fewer cores than the processes started here would see
        os.environ.update({name: str(every) for name in _THREAD_CAPS})
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(every)
    try:
        yield
    finally:
        os.environ.update({name: str(_THREADS_CAPPED["share"]) for name in _THREAD_CAPS})
        if torch is not None:
            torch.set_num_threads(_THREADS_CAPPED["share"])


class Machine:
    """This machine, shared by the tests of every pytest run on it (xdist's workers, two suites started at once)
    and taken alone by a measurement, which another test's load would make inconclusive.

    A test holds the lock shared while it runs (:class:`perflab.grading.machine_lock.MachineLock`); ``with
    machine.alone():`` waits until the tests running now end, and new ones wait for it; ``with machine.lent():``
    hands the machine to the gradings a test starts with ``machine.environment()``, which take it themselves. A
    pytest started by a test takes no lock: the test that started it holds one."""

    def __init__(self, path: Path):
        from perflab.grading.machine_lock import MachineLock  # loads torch: only in a process that runs tests

        self._lock = MachineLock(path)
        self.shared, self.lent, self.environment = self._lock.shared, self._lock.lent, self._lock.environment

    @contextlib.contextmanager
    def alone(self):
        with self._lock.alone(), _every_core():
            yield


class _NoMachineLock:
    """What a pytest started by a test uses: the test that started it holds the machine."""

    shared = alone = lent = staticmethod(contextlib.nullcontext)

    @staticmethod
    def environment() -> dict[str, str]:
        return {}


# Who takes the machine lock: a pytest started by hand or by make, or the workers of one; not a pytest a test starts.
_MACHINE_HELD = "PERFLAB_MACHINE_HELD"


def _machine(config) -> Machine | _NoMachineLock:
    held = os.environ.get(_MACHINE_HELD)
    if hasattr(config, "workerinput"):  # an xdist worker
        takes = held == "by-workers"
    elif held:
        takes = False
    elif config.getoption("dist", "no") != "no":  # xdist's controller: its workers run the tests
        os.environ[_MACHINE_HELD] = "by-workers"
        return _NoMachineLock()
    else:
        takes = True
    if not takes:
        return _NoMachineLock()
    os.environ[_MACHINE_HELD] = "by-a-test"
    return Machine(Path(tempfile.gettempdir()) / "perflab-machine.lock")


@pytest.fixture(scope="session")
def machine(request) -> Machine | _NoMachineLock:
    """``with machine.alone():`` around a measurement inside a test: see :class:`Machine`."""
    return request.config._perflab_machine


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with item.config._perflab_machine.shared():
        return (yield)


def pytest_addoption(parser):
    parser.addoption(
        "--no-attacks",
        action="store_true",
        help="grading round trips hand in each lab's solution and untouched release only (the compatibility tier)",
    )


def pytest_configure(config):
    # Caps set before pytest started stay; not the count perflab's import fitted to a CPU quota (perflab.cpu_quota).
    fitted = os.environ.get("PERFLAB_THREADS_FITTED")  # perflab.cpu_quota.FITTED_VARIABLE
    config._perflab_threads_preset = [
        name
        for name in _THREAD_CAPS
        if name in os.environ and not (name == "OMP_NUM_THREADS" and os.environ[name] == fitted)
    ]
    if hasattr(config, "workerinput") and not config._perflab_threads_preset:  # caps set before pytest started stay
        _cap_threads_to_a_share(config.workerinput["workercount"])
    config._perflab_machine = _machine(config)
    # A suite started in the background by a non-interactive shell (nohup, `make test &`) inherits SIGINT ignored,
    # and so would every process it starts: the tests that interrupt a grading or a kernel need it delivered.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Inherited by every kernel nbval starts; tests that start their own kernels (labs, browser) inherit it too.
    os.environ["PYTHONWARNINGS"] = _deprecations_are_errors()
    _stop_notebook_kernels_as_jupyterlab_does()


def _stop_notebook_kernels_as_jupyterlab_does() -> None:
    """nbval kills a notebook's kernel once its cells have run (``shutdown_kernel(now=True)``), so the kernel's
    ``atexit`` handlers never run, and the scratch folders the lectures remove with them (lecture 09's checkpoints
    alone take 300 MB) stayed in the temporary folder, one set per run. JupyterLab asks a kernel to shut down, and so
    does this: it is killed only if it has not exited within the kernel manager's ``shutdown_wait_time``."""
    from nbval.kernel import RunningKernel

    def stop(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)
        del self.km

    RunningKernel.stop = stop


# The round trips the compatibility tier runs again on the supported range's other ends (make test-compat): one
# lab measured outside the kernel (torch.compile's speedup) and one graded in it (activation checkpointing).
COMPAT_ROUND_TRIPS = ("lab05_memory", "lab06_compile")


# The work xdist hands out whole, longest first (--no-loadscope-reorder keeps the order): the grading round trip (a
# module fixture grades every lab), the lectures, then each other module. When the website's test runs, every lecture
# and it are one unit, as it reuses the lectures as this process ran them; otherwise (the compatibility tier) each
# lecture is a unit of its own, and the workers share them. Longest first, because a worker that has run out of work
# waits for the other: handed out in file order, test_whole_class.py (over two minutes) ran alone at the end of
# make test while the other core idled. The seconds are what each unit's slowest tests took in make test on a
# 2-core EPYC (pytest --durations, 2026-11-29); a unit not listed counts as short, and a stale figure costs only time.
_UNIT_SECONDS = {
    "tests/test_labs.py": 850,
    "lectures": 470,
    "tests/test_whole_class.py": 134,
    "lectures/11_tensor_pipeline_parallel.ipynb": 76,
    "tests/test_browser.py": 90,
    "lectures/10_triton.ipynb": 51,
    "lectures/09_sharding.ipynb": 50,
    "tests/test_grading.py": 47,
    "lectures/07_ddp.ipynb": 44,
    "lectures/03_data_loading.ipynb": 35,
    "lectures/05_memory_checkpointing.ipynb": 32,
    "tests/test_distributed.py": 26,
    "tests/test_child_integrity.py": 24,
    "lectures/06_compile.ipynb": 22,
    "lectures/02_profiling.ipynb": 19,
    "lectures/08_flash_attention.ipynb": 18,
    "lectures/04_mixed_precision.ipynb": 17,
    "tests/test_new_notebook.py": 15,
    "tests/test_triton_lab.py": 14,
    "tests/test_megatron_lab.py": 12,
    "tests/test_doctor.py": 12,
    "tests/test_capstone.py": 12,
    "tests/test_triton_runtime.py": 11,
}
_SITE_TEST = "tests/test_site.py"


def _xdist_group(nodeid: str, lectures_together: bool = True) -> str:
    path = nodeid.split("::")[0]
    if path.startswith("lectures/") or path == _SITE_TEST:
        return "lectures" if lectures_together else path
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            # Called once the collection is complete: whether it holds the website's test is known.
            if not hasattr(self, "_site_tested"):
                self._site_tested = any(other.startswith(_SITE_TEST) for other in self.collection)
            return _xdist_group(nodeid, lectures_together=self._site_tested)

    return GroupScheduling(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items):
    """Mark the slow and the compatibility tiers' tests before -m deselects by those marks; order what is left."""
    for item in items:
        # A notebook run under nbval is never part of the fast tier; every lecture is part of the compatibility tier.
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
            if item.path.parent.name == "lectures":
                item.add_marker(pytest.mark.compat)
        callspec = getattr(item, "callspec", None)
        if (
            getattr(item, "originalname", "") == "test_grading_round_trip"
            and callspec.params["lab"] in COMPAT_ROUND_TRIPS
        ):
            item.add_marker(pytest.mark.compat)
    yield  # the other implementations, -m's deselection among them

    # The website's test comes after the lectures: it reuses them as nbval ran them (see _keep_executed_lecture).
    # The site decides how lectures are grouped here as the scheduler does: one unit with it, one each without it.
    site_tested = any(item.nodeid.startswith(_SITE_TEST) for item in items)

    def rank(item):
        group = _xdist_group(item.nodeid, lectures_together=site_tested)
        return (-_UNIT_SECONDS.get(group, 0), item.path.name == "test_site.py")

    items.sort(key=rank)


def _executed_lectures_folder(config) -> Path:
    if not hasattr(config, "_perflab_executed"):
        config._perflab_executed = Path(tempfile.mkdtemp(prefix="perflab-executed-"))
    return config._perflab_executed


def pytest_unconfigure(config):
    if hasattr(config, "_perflab_executed"):
        shutil.rmtree(config._perflab_executed, ignore_errors=True)


@pytest.fixture(scope="session")
def executed_lectures(request) -> Path:
    """The lectures this run executed under nbval, every cell passed, stamped and cached for the website."""
    return _executed_lectures_folder(request.config)


def _keep_executed_lecture(item, report) -> None:
    """Collect a lecture's outputs cell by cell as nbval runs it; once every cell passed, cache the notebook."""
    if item.path.parent.name != "lectures" or not hasattr(item, "test_outputs"):
        return
    runs = item.config.__dict__.setdefault("_perflab_lecture_runs", {})
    if item.path not in runs:
        code_cells = sum(cell.cell_type == "code" for cell in item.parent.nb.cells)
        runs[item.path] = {"start": time.perf_counter(), "passed": 0, "code_cells": code_cells}
    run = runs[item.path]
    if report.when != "call":
        return
    item.cell.outputs, item.cell.execution_count = item.test_outputs or [], item.cell_num + 1
    run["passed"] += report.passed
    if item.cell_num == run["code_cells"] - 1 and run["passed"] == run["code_cells"]:
        from perflab.device import pick_device
        from perflab.record import stamp
        from perflab.render import Environment
        from perflab.site import cache_executed

        stamp(item.parent.nb, item.path, Environment.capture(pick_device()), time.perf_counter() - run["start"])
        cache_executed(item.parent.nb, _executed_lectures_folder(item.config))


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
    _keep_executed_lecture(item, report)
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
