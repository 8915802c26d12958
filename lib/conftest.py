"""Fixtures for the doctests of lib/perflab: what they write goes to pytest's temporary folder.

Never the learner's data cache, never the repository, never loose in the system's temporary folder.
"""

import contextlib
import tempfile

import matplotlib.pyplot as plt
import pytest


@pytest.fixture(scope="session")
def _doctest_folder(tmp_path_factory):
    """One folder for the whole run: a tiny dataset that several examples use is generated once."""
    folder = tmp_path_factory.mktemp("doctests")
    (folder / "tmp").mkdir()
    return folder


# The examples whose result is a timing: each takes the machine alone (conftest.py, Machine), as the other tests' load
# would fall on whichever phase of it was running.
MEASURING_EXAMPLES = {"perflab.planted"}


@pytest.fixture(autouse=True)
def _measuring_examples_have_the_machine_alone(request, machine):
    with machine.alone() if request.node.name in MEASURING_EXAMPLES else contextlib.nullcontext():
        yield


@pytest.fixture(autouse=True)
def _doctest_folders(_doctest_folder, monkeypatch):
    """``$PERFLAB_DATA`` and ``tempfile``'s folder point into it while each example runs, and only then."""
    monkeypatch.setenv("PERFLAB_DATA", str(_doctest_folder / "data"))
    monkeypatch.setattr(tempfile, "tempdir", str(_doctest_folder / "tmp"))
    yield
    plt.close("all")  # the figures an example drew: pyplot keeps every one open until told
