"""Write environment.yml and binder/environment.yml from pyproject.toml, or check that they match it.

    $ python tools/environment_files.py          # rewrite both files after changing pyproject.toml
    $ python tools/environment_files.py --check  # exit 1 and name the stale file (tests/test_environment_files.py)

pyproject.toml is the one list of packages and pins; conda users and Binder get the same list,
installed by pip inside a conda environment (conda-forge's own torch builds lag PyPI's).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
PYTHON = "3.11"

_HEADERS = {
    "environment.yml": """\
# conda env create -f environment.yml && conda activate perflab
# Generated from pyproject.toml by tools/environment_files.py: edit pyproject.toml, then run it.
# The Python packages are installed by pip, torch at the default install's pins (constraints/).
# For a CUDA machine this gives PyPI's CUDA build of torch.
""",
    "binder/environment.yml": """\
# Binder (repo2docker) builds this environment, then runs binder/postBuild.
# Generated from pyproject.toml by tools/environment_files.py: edit pyproject.toml, then run it.
# Binder has no GPU: torch comes from PyTorch's CPU-only index, a far smaller download than
# PyPI's CUDA build. binder/postBuild installs perflab itself.
""",
}
_EXTRA_PIP_LINES = {
    "environment.yml": ([], ["-e ."]),
    "binder/environment.yml": (["--extra-index-url https://download.pytorch.org/whl/cpu"], []),
}


def default_pins(repo: Path = REPO) -> dict[str, str]:
    """The default install's pinned pair, {"torch": "torch==X", ...}: the constraints file the Makefile names."""
    default = re.search(r"^DEFAULT_TORCH := (\S+)$", (repo / "Makefile").read_text(), re.M).group(1)
    lines = (repo / "constraints" / f"torch-{default}.txt").read_text().splitlines()
    return {line.split("==")[0]: line for line in lines if "==" in line and not line.startswith("#")}


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The project's dependencies, then each optional group's, in pyproject's order; torch and torchvision at the
    default install's pins rather than the supported range."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = default_pins(pyproject.parent)
    listed = [pins.get(re.split(r"[<>=!~ ]", r)[0], r) for r in project["dependencies"]]
    for group in project["optional-dependencies"].values():
        listed += [r for r in group if r not in listed]
    return listed


def environment_file(name: str, pyproject: Path = REPO / "pyproject.toml") -> str:
    """The text ``name`` (a key of ``_HEADERS``) should have."""
    before, after = _EXTRA_PIP_LINES[name]
    pip_lines = "".join(f"      - {line}\n" for line in [*before, *requirements(pyproject), *after])
    return (
        f"{_HEADERS[name]}name: perflab\nchannels:\n  - conda-forge\ndependencies:\n"
        f"  - python={PYTHON}\n  - pip\n  - pip:\n{pip_lines}"
    )


def stale_files(repo: Path = REPO) -> list[str]:
    """The environment files whose text differs from what pyproject.toml gives."""
    return [name for name in _HEADERS if (repo / name).read_text() != environment_file(name, repo / "pyproject.toml")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is stale")
    check = parser.parse_args(argv).check
    stale = stale_files()
    for name in stale:
        if check:
            print(f"{name} does not match pyproject.toml: run python tools/environment_files.py", file=sys.stderr)
        else:
            (REPO / name).write_text(environment_file(name))
            print(f"wrote {name}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
