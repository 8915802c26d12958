"""Learner code runs in a sandbox; the grader's own processes start from a pristine copy of perflab.

    >>> import sys
    >>> from perflab.grading.sandbox import sandbox_command, trusted_python
    >>> sandbox_command(["python", "-c", "print(1)"], workdir="/course/autograded/ada/lab02_profiling",
    ...                 hidden=["/course"])                    # bubblewrap around any command
    ['bwrap', '--ro-bind', '/', '/', ..., '--tmpfs', '/course', ..., '--unshare-net', ..., 'python', '-c', 'print(1)']
    >>> command = trusted_python("perflab.grading.session")   # python -I -S, perflab from the pristine copy
    >>> command[:4] == [sys.executable, "-I", "-S", "-c"], "perflab-pristine-" in command[-1]
    (True, True)

A sandboxed process (Debian's ``bubblewrap``) sees the whole file system read-only, with the
course folder hidden (the sources with their solutions and hidden tests, the gradebook, other
learners' submissions) except the paths it needs to run (the virtualenv and perflab's source when
they live there); it gets a private ``/tmp`` and ``$HOME`` (so no IPython startup file or
``sitecustomize.py`` of the instructor's runs, and none it writes survives), no network, and its
own process tree, which ends when it does. It may write only its working folder. So an answer
cell cannot rewrite ``lib/perflab``, the virtualenv or ``nbgrader_config.py``, and cannot leave a
process behind to slow down the next measurement.

The trusted grading process runs ``python -I -S`` (no current folder or ``PYTHON*`` variables on
the path, no ``site``: no ``.pth`` file or ``sitecustomize.py`` runs) with perflab imported from a
copy taken when grading started, so that nothing written during grading reaches it.

Used by perflab.grading.child, perflab.grading.nbgrader and perflab.grading.bench.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import perflab

__all__ = ["SANDBOX_ENV_VAR", "bwrap_works", "pristine_perflab", "require_sandbox", "sandbox_command", "trusted_python"]

# What a sandboxed process keeps of the environment; ipykernel's JPY_PARENT_PID is left out on purpose: the
# launcher's pid is another number inside the sandbox, and the kernel would take it for gone and exit.
_KEPT_ENVIRONMENT = {
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "PERFLAB_DEVICE",
    "CUDA_VISIBLE_DEVICES",
    "NBGRADER_EXECUTION",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYDEVD_DISABLE_FILE_VALIDATION",
    "PYTHONWARNINGS",  # the test suite turns deprecated names used by a lab's code into errors
}
# Set to 0 only on a machine without bubblewrap, knowing that learner code then runs with the instructor's rights.
SANDBOX_ENV_VAR = "PERFLAB_GRADING_SANDBOX"


def _sandbox_wanted() -> bool:
    return os.environ.get(SANDBOX_ENV_VAR, "1") != "0"


@functools.cache
def bwrap_works() -> bool:
    """Whether bubblewrap is installed and can build a sandbox here (some containers forbid namespaces)."""
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(
        ["bwrap", "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid", "true"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def require_sandbox() -> bool:
    """True when learner code must be sandboxed; raise, saying how to fix it, when it must but cannot be."""
    if not _sandbox_wanted():
        return False
    if not bwrap_works():
        raise RuntimeError(
            "perflab grades each submission in a bubblewrap sandbox, and bwrap is missing or cannot create "
            "namespaces here: install it (Debian/Ubuntu: apt-get install bubblewrap), or set "
            f"{SANDBOX_ENV_VAR}=0 to grade without a sandbox (answer cells then run with your rights)"
        )
    return True


def _runtime_paths() -> list[str]:
    """The folders a Python process of this environment reads: its prefix, the standard library, perflab."""
    # The interpreter's own folder too (a virtualenv's, which `python -S` does not report as its prefix), and sys.path.
    paths = {
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.dirname(os.path.abspath(sys.executable))),
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        str(Path(perflab.__file__).resolve().parents[1]),
        *(p for p in sys.path if p),
    }
    return sorted(p for p in paths if os.path.exists(p))


def sandbox_command(
    argv: list[str],
    *,
    workdir: str,
    hidden: list[str] = (),
    readable: list[str] = (),
    writable: list[str] = (),
    env: dict[str, str] | None = None,
) -> list[str]:
    """``argv`` wrapped in bubblewrap: read-only everywhere, ``hidden`` folders emptied, ``workdir`` writable."""
    from perflab.data.images import DATA_ENV_VAR, data_root

    command = [
        "bwrap",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--dir",
        "/tmp/home",
    ]
    for path in hidden:
        command += ["--tmpfs", os.path.abspath(path)]
    # Re-expose, read-only, what a hidden folder holds that the process needs (the course's .venv and lib/).
    for path in [*_runtime_paths(), str(data_root()), *readable]:
        if os.path.exists(path) and any(_inside(path, h) for h in [*hidden, "/tmp"]):
            command += ["--ro-bind", path, path]
    for path in [workdir, *writable]:
        command += ["--bind", os.path.abspath(path), os.path.abspath(path)]
    # GPUs stay usable: their device files are bound in, nothing else of the host's /dev.
    for device in sorted(glob.glob("/dev/nvidia*")) + sorted(glob.glob("/dev/dri")):
        command += ["--dev-bind", device, device]
    # None of the instructor's environment (tokens, paths) but what running the course needs.
    environment = {name: value for name, value in os.environ.items() if name in _KEPT_ENVIRONMENT}
    environment.update({"HOME": "/tmp/home", DATA_ENV_VAR: str(data_root()), **(env or {})})
    command += ["--clearenv"]
    for name, value in environment.items():
        command += ["--setenv", name, value]
    command += [
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--die-with-parent",
        "--cap-drop",
        "ALL",
        "--chdir",
        os.path.abspath(workdir),
    ]
    return command + list(argv)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


_PRISTINE_PREFIX = "perflab-pristine-"


@functools.cache
def pristine_perflab() -> str:
    """A read-only copy of the perflab package as it is now, in a fresh folder; returns the folder to import from."""
    imported_from = Path(perflab.__file__).parents[1]
    if imported_from.name.startswith(_PRISTINE_PREFIX):  # the trusted grader itself runs from one: no second copy
        return str(imported_from)
    folder = tempfile.mkdtemp(prefix=_PRISTINE_PREFIX)
    shutil.copytree(
        Path(perflab.__file__).parent, Path(folder) / "perflab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    for root, _, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(root, name), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    return folder


def trusted_python(module: str) -> list[str]:
    """Run ``module`` in a fresh ``python -I -S`` with perflab from :func:`pristine_perflab`.

    ``-S`` skips ``site``, so no ``.pth`` file or ``sitecustomize.py`` in the virtualenv runs; the
    path is set explicitly: the pristine copy first, then the standard library and site-packages.
    """
    # The standard library and the environment's packages; not the current folder, not perflab's source folder.
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = [
        pristine_perflab(),
        *dict.fromkeys(
            p
            for p in sys.path
            if p == stdlib or os.path.basename(p) in ("lib-dynload", "site-packages", "dist-packages")
        ),
    ]
    bootstrap = (
        f"import sys; sys.path[:] = {paths!r}; sys.dont_write_bytecode = True; "
        f"import runpy; runpy.run_module({module!r}, run_name='__main__')"
    )
    return [sys.executable, "-I", "-S", "-c", bootstrap]
