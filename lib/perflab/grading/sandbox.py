"""Learner code runs in a default-deny sandbox; the grader's own processes start from a pristine copy of perflab.

    >>> import sys
    >>> from perflab.grading.sandbox import sandbox_command, trusted_python
    >>> sandbox_command(["python", "-c", "print(1)"], workdir="/course/autograded/ada/lab02_profiling")
    ['prlimit', '--nofile=4096', ..., 'bwrap', ..., '--ro-bind', '/usr', '/usr', ..., '--bind', '/course/autograded/ada/lab02_profiling', ...]
    >>> command = trusted_python("perflab.grading.session")   # python -I -S, perflab from the pristine copy
    >>> command[:4] == [sys.executable, "-I", "-S", "-c"], "perflab-pristine-" in command[-1]
    (True, True)

A sandboxed process (Debian's ``bubblewrap``) starts from an empty root and is granted, read-only,
only what running Python needs: the operating system's runtime (``/usr`` and its links, a few
files of ``/etc``, ``/sys``), the interpreter's and the virtualenv's folders, a pristine copy of
perflab in the place perflab is imported from, and the course's data cache; read-write, only its
working folder, a private ``/tmp`` and ``$HOME`` of bounded size. Nothing else exists inside: not
the course folder (wherever the virtualenv lives, inside it or not), its sources with solutions and
hidden tests, the gradebook, other learners' submissions, ``.perflab-grading``, the instructor's
home or other users' files. So an answer cell can read no solution, write nothing that outlives it
but its own folder, and, with no network and its own process tree that ends when it does, leave
no process behind to slow down the next measurement. Resource limits (``prlimit``) bound its
open files, file size, processes and, without a GPU, address space.

The trusted grading process runs ``python -I -S`` (no current folder or ``PYTHON*`` variables on
the path, no ``site``: no ``.pth`` file or ``sitecustomize.py`` runs) with perflab imported from a
copy taken when grading started, so that nothing written during grading reaches it.

Used by perflab.grading.child, perflab.grading.nbgrader and perflab.grading.bench.
"""

from __future__ import annotations

import atexit
import functools
import getpass
import glob
import os
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import psutil

import perflab

__all__ = [
    "RESOURCE_LIMITS",
    "SANDBOX_ENV_VAR",
    "bwrap_works",
    "granted_paths",
    "pristine_perflab",
    "require_sandbox",
    "sandbox_command",
    "trusted_python",
]

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
# The operating system's runtime: on a merged-/usr system the others are links into /usr, and stay links.
_SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys")
# Of /etc, what the dynamic linker, name lookups, time zones, fonts and Debian's alternatives need; no user database
# or hosts file: generated ones name only the sandbox's user and the loopback.
_SYSTEM_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/alternatives",
    "/etc/fonts",
    "/etc/mime.types",
)
_GENERATED_ETC = ("passwd", "group", "hosts")
_TMP_BYTES = 4 << 30  # the private /tmp and $HOME live in memory: bounded
# Per process: open files, bytes in one file, processes of the user (threads count), and, without a GPU (CUDA
# reserves terabytes of address space it never touches), the address space: the machine's memory.
RESOURCE_LIMITS = {
    "nofile": 4096,
    "fsize": 4 << 30,
    "nproc": max(4096, 64 * (os.cpu_count() or 1)),
    "as": psutil.virtual_memory().total,
}
# Set to 0 only on a machine without bubblewrap, knowing that learner code then runs with the instructor's rights.
SANDBOX_ENV_VAR = "PERFLAB_GRADING_SANDBOX"


def _sandbox_wanted() -> bool:
    return os.environ.get(SANDBOX_ENV_VAR, "1") != "0"


@functools.cache
def bwrap_works() -> bool:
    """Whether bubblewrap and prlimit are installed and a sandbox can be built here (some containers forbid it)."""
    if shutil.which("bwrap") is None or shutil.which("prlimit") is None:
        return False
    probe = subprocess.run(
        ["bwrap", "--ro-bind", "/usr", "/usr", *_links(), "--unshare-net", "--unshare-pid", "true"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def require_sandbox() -> bool:
    """True when learner code must be sandboxed; raise, saying how to fix it, when it must but cannot be."""
    if not _sandbox_wanted():
        return False
    if not bwrap_works():
        raise RuntimeError(
            "perflab grades each submission in a bubblewrap sandbox, and bwrap or prlimit is missing or cannot "
            "create namespaces here: install them (Debian/Ubuntu: apt-get install bubblewrap util-linux), or set "
            f"{SANDBOX_ENV_VAR}=0 to grade without a sandbox (answer cells then run with your rights)"
        )
    return True


def _links() -> list[str]:
    """The system folders that are links (/bin -> usr/bin): recreated as links inside, not bound."""
    return [
        arg
        for folder in _SYSTEM_FOLDERS
        if os.path.islink(folder)
        for arg in ("--symlink", os.readlink(folder), folder)
    ]


def granted_paths() -> list[str]:
    """Every host path a sandboxed process may read: the system's runtime, the interpreter, the data cache.

    perflab's own folder is not among them: a pristine copy is bound in its place.
    """
    from perflab.data.images import data_root

    python = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        *sysconfig.get_paths().values(),  # stdlib, site-packages, headers (Inductor compiles against them)
        # The virtualenv, which a `python -S` (the trusted grader) knows only by its executable and its path.
        os.path.dirname(os.path.dirname(os.path.abspath(sys.executable))),
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
        *(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages", "lib-dynload")),
    }
    paths = [
        *(folder for folder in _SYSTEM_FOLDERS if not os.path.islink(folder)),
        *_SYSTEM_FILES,
        *sorted(python),
        *sorted({os.path.realpath(path) for path in python}),
        str(data_root()),
    ]
    return list(dict.fromkeys(p for p in paths if os.path.exists(p)))


@functools.cache
def _generated_etc() -> str:
    """The files of /etc that name this user and machine and nothing else: passwd and group (getpass and Inductor ask
    for a user), and hosts (torchrun's rendezvous resolves localhost and this machine's name, on the loopback)."""
    folder = tempfile.mkdtemp(prefix="perflab-sandbox-etc-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    uid, gid = os.getuid(), os.getgid()
    name = _user_name()
    Path(folder, "passwd").write_text(f"{name}:x:{uid}:{gid}::/tmp/home:/bin/sh\n")
    Path(folder, "group").write_text(f"{name}:x:{gid}:\n")
    Path(folder, "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n::1 localhost\n")
    return folder


def _user_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "learner"


def sandbox_command(
    argv: list[str],
    *,
    workdir: str,
    readable: list[str] = (),
    writable: list[str] = (),
    env: dict[str, str] | None = None,
    read_only_proc: bool = False,
) -> list[str]:
    """``argv`` in bubblewrap, starting from an empty root: see the module's docstring for what it is granted.

    ``read_only_proc``: ``/proc`` mounted read-only, so that the process cannot write its own ``/proc`` files
    (``clear_refs``, which resets the peak memory the grader reads from outside).
    """
    from perflab.data.images import DATA_ENV_VAR, data_root

    # The private /tmp first: what is bound below may live under the host's /tmp (the pristine copy, a virtualenv).
    command = ["bwrap", *_links(), "--dev", "/dev", "--proc", "/proc", "--size", str(_TMP_BYTES), "--tmpfs", "/tmp"]
    command += ["--remount-ro", "/proc"] if read_only_proc else []
    command += ["--dir", "/tmp/home"]
    for path in granted_paths():
        command += ["--ro-bind", path, path]
    for name in _GENERATED_ETC:
        command += ["--ro-bind", os.path.join(_generated_etc(), name), f"/etc/{name}"]
    # The pristine copy where perflab is imported from (an editable install's lib/ or site-packages), and at its own
    # path, which the trusted grader's children import from.
    imported_from = str(Path(perflab.__file__).resolve().parent)
    command += ["--ro-bind", os.path.join(pristine_perflab(), "perflab"), imported_from]
    for path in readable:
        command += ["--ro-bind", os.path.abspath(path), os.path.abspath(path)]
    for path in [workdir, *writable]:
        command += ["--bind", os.path.abspath(path), os.path.abspath(path)]
    # GPUs stay usable: their device files are bound in, nothing else of the host's /dev.
    gpus = sorted(glob.glob("/dev/nvidia*")) + sorted(glob.glob("/dev/dri"))
    for device in gpus:
        command += ["--dev-bind", device, device]
    # None of the instructor's environment (tokens, paths) but what running the course needs.
    environment = {name: value for name, value in os.environ.items() if name in _KEPT_ENVIRONMENT}
    user = {"USER": _user_name(), "LOGNAME": _user_name()}
    environment.update({"HOME": "/tmp/home", "TMPDIR": "/tmp", **user, DATA_ENV_VAR: str(data_root()), **(env or {})})
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
    limits = {name: value for name, value in RESOURCE_LIMITS.items() if not (name == "as" and gpus)}
    return ["prlimit", *(f"--{name}={value}" for name, value in limits.items()), *command, *argv]


_PRISTINE_PREFIX = "perflab-pristine-"


@functools.cache
def pristine_perflab() -> str:
    """A read-only copy of the perflab package as it is now, in a fresh folder; returns the folder to import from."""
    imported_from = Path(perflab.__file__).parents[1]
    if imported_from.name.startswith(_PRISTINE_PREFIX):  # the trusted grader itself runs from one: no second copy
        return str(imported_from)
    folder = tempfile.mkdtemp(prefix=_PRISTINE_PREFIX)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the graders it serves end before this process
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
