"""pyproject.toml, environment.yml and binder/ must install the same packages at the same pins."""

import re
import shutil
import sys

import tomllib
import yaml
from packaging.requirements import Requirement
from perflab.grading.course import REPO
from perflab.torch_features import DEFAULT

sys.path.insert(0, str(REPO / "tools"))
import environment_files  # noqa: E402  (tools/ is not a package: it is put on the path above)


def _normalized(requirement: str) -> str:
    name, rest = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", requirement).groups()
    return re.sub(r"[-_.]+", "-", name).lower() + rest.replace(" ", "")


def _pyproject_requirements() -> set[str]:
    """pyproject's requirements, torch and torchvision at the default install's pins, which must lie in its range."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {name: Requirement(line) for name, line in environment_files.default_pins().items()}
    requirements = []
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.name in pins:
            (pinned,) = pins[requirement.name].specifier
            assert requirement.specifier.contains(pinned.version), f"{pinned} is outside pyproject's {requirement}"
            line = str(pins[requirement.name])
        requirements.append(line)
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return {_normalized(r) for r in requirements}


def _conda_pip_requirements(path) -> tuple[set[str], list]:
    environment = yaml.safe_load(path.read_text())
    conda_packages = [d for d in environment["dependencies"] if isinstance(d, str)]
    pip_sections = [d["pip"] for d in environment["dependencies"] if isinstance(d, dict)]
    assert len(pip_sections) == 1, f"{path.name}: expected one pip section"
    requirements = {_normalized(r) for r in pip_sections[0] if not r.startswith(("-", "--"))}
    return requirements, conda_packages


def test_environment_yml_matches_pyproject():
    requirements, conda_packages = _conda_pip_requirements(REPO / "environment.yml")
    assert requirements == _pyproject_requirements()
    assert "pip" in conda_packages and any(p.startswith("python=") for p in conda_packages)
    assert "-e ." in yaml.safe_load((REPO / "environment.yml").read_text())["dependencies"][-1]["pip"]


def test_binder_environment_matches_pyproject_with_cpu_torch():
    requirements, _ = _conda_pip_requirements(REPO / "binder" / "environment.yml")
    assert requirements == _pyproject_requirements()
    pip_lines = yaml.safe_load((REPO / "binder" / "environment.yml").read_text())["dependencies"][-1]["pip"]
    assert any(line.startswith("--extra-index-url") and line.rstrip("/").endswith("/whl/cpu") for line in pip_lines)


def test_binder_post_build_installs_perflab_and_hides_instructor_pages():
    post_build = REPO / "binder" / "postBuild"
    script = post_build.read_text()
    assert post_build.stat().st_mode & 0o111, "postBuild must be executable"
    assert "pip install --no-deps -e ." in script
    assert "disable --level=sys_prefix @jupyter/nbgrader:formgrader" in script
    assert "nbgrader.server_extensions.formgrader" in script


def test_the_environment_files_are_what_the_script_writes_from_pyproject():
    assert environment_files.stale_files() == [], "run python tools/environment_files.py"


def test_the_script_finds_a_stale_file_and_rewrites_it(tmp_path):
    for name in (
        "pyproject.toml",
        "Makefile",
        f"constraints/torch-{DEFAULT}.txt",
        "environment.yml",
        "binder/environment.yml",
    ):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"numpy>=1.26"', '"numpy>=2.1"'))
    assert environment_files.stale_files(tmp_path) == ["environment.yml", "binder/environment.yml"]
    text = environment_files.environment_file("environment.yml", pyproject)
    assert "      - numpy>=2.1\n" in text and yaml.safe_load(text)["dependencies"][-1]["pip"][-1] == "-e ."


def test_the_version_has_one_source():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "perflab.__version__"}
