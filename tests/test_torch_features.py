"""The supported torch range has one statement in each place that states it, and features are found, not assumed."""

import re
import subprocess
import sys

import pytest
import tomllib
import torch
from packaging.requirements import Requirement
from perflab import torch_features
from perflab.doctor import feature_checks
from perflab.grading.course import REPO
from perflab.torch_features import DEFAULT, FEATURES, SUPPORTED, TESTED


def _makefile_variable(name: str) -> str:
    return re.search(rf"^{name} := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)


def test_each_tested_torch_has_a_constraints_file_pinning_it_with_its_torchvision():
    files = {path.name.removeprefix("torch-").removesuffix(".txt"): path for path in (REPO / "constraints").glob("*")}
    assert set(files) == set(TESTED)
    for version, path in files.items():
        pins = {Requirement(line).name: Requirement(line) for line in path.read_text().splitlines() if "==" in line}
        assert set(pins) == {"torch", "torchvision"}, path
        assert str(pins["torch"].specifier) == f"=={version}"


def test_the_makefile_the_range_and_the_tested_releases_agree():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (declared,) = [Requirement(line) for line in dependencies if Requirement(line).name == "torch"]
    assert SUPPORTED and Requirement(f"torch{SUPPORTED}").specifier == declared.specifier
    assert all(declared.specifier.contains(version) for version in TESTED)
    assert _makefile_variable("DEFAULT_TORCH") == DEFAULT and _makefile_variable("OLDEST_TORCH") == TESTED[0]
    assert TESTED == tuple(sorted(TESTED, key=lambda version: tuple(map(int, version.split(".")))))
    ci = (REPO / ".ci" / "run").read_text()
    assert all(f" make test-compat TORCH={version}\n" in ci for version in TESTED if version != DEFAULT)
    lowest = min(spec.version for spec in declared.specifier if spec.operator == ">=")
    assert TESTED[0].startswith(lowest + "."), "the suite must run on the oldest torch the course declares"
    major, below = map(int, min(spec.version for spec in declared.specifier if spec.operator == "<").split("."))
    assert TESTED[-1].startswith(f"{major}.{below - 1}."), "the suite must run on the newest torch the course declares"


def test_the_range_is_checked_on_release_numbers():
    assert torch_features.in_supported_range(TESTED[0]) and torch_features.in_supported_range(f"{TESTED[-1]}+cu132")
    assert not torch_features.in_supported_range("2.10.0") and not torch_features.in_supported_range("3.0.0")


def test_every_feature_is_detected_without_raising_and_says_what_it_needs():
    for feature in FEATURES:
        assert isinstance(feature.available, bool)
        assert re.fullmatch(r"2\.\d+", feature.since) and feature.used_in and feature.without
        message = feature.message()
        assert message.startswith(f"needs torch >= {feature.since} (") and torch.__version__ in message
        assert "\n" not in message


def test_a_feature_this_torch_lacks_prints_one_line_and_returns_false(monkeypatch, capsys):
    name = FEATURES[0].name
    monkeypatch.setattr(torch_features, "_detected", lambda _: False)
    assert torch_features.require(name) is False
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and printed.startswith("needs torch >= ")
    monkeypatch.setattr(torch_features, "_detected", lambda _: True)
    assert torch_features.require(name) is True and capsys.readouterr().out == ""


def test_an_unknown_feature_is_an_error_naming_the_known_ones():
    with pytest.raises(KeyError, match=FEATURES[0].name):
        torch_features.has("time_travel")


def test_the_doctor_names_each_missing_feature_and_its_cells(monkeypatch):
    monkeypatch.setattr(torch_features, "_detected", lambda _: False)
    rows = [(check.name, check.result) for check in feature_checks()]
    assert rows == [(f"from torch {f.since}", f"{f.api}: {f.used_in}; here {f.without}") for f in FEATURES]
    assert str(torch_features.features()).count(" no ") >= len(FEATURES)
    monkeypatch.setattr(torch_features, "_detected", lambda _: True)
    assert [check.result for check in feature_checks()] == [f"all {len(FEATURES)} the course uses are here"]


def test_importing_perflab_on_a_torch_outside_the_range_says_so():
    def imported_on(version: str) -> str:
        script = f"import torch; torch.__version__ = {version!r}; import perflab"
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stderr

    too_old = imported_on("2.10.0")
    assert "perflab supports torch >=" in too_old and "this is torch 2.10.0" in too_old
    assert "perflab supports torch" not in imported_on(TESTED[0])


def test_the_readme_lists_every_feature_and_the_range():
    readme = (REPO / "README.md").read_text()
    for feature in FEATURES:
        assert f"| {feature.api} | {feature.since} | {feature.used_in} | {feature.without} |" in readme, feature.name
    lowest, highest = re.fullmatch(r">=(\S+),<(\S+)", SUPPORTED).groups()
    assert f"**torch >= {lowest}, < {highest}**" in readme
