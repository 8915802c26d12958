import pytest

# labs/ holds generated student notebooks that raise NotImplementedError by design, and
# nbgrader's working folders hold copies: none of them is a test.
collect_ignore = ["labs", "submitted", "autograded", "feedback", ".venv"]
# Deprecated module names: importing one for its doctests would only warn that it was renamed.
collect_ignore += ["lib/perflab/checkpoint.py", "lib/perflab/profile.py"]
# Conftest files are loaded as such; collected again as doctest modules, two files named conftest collide.
collect_ignore += ["lib/conftest.py", "tests/conftest.py"]


def pytest_collection_modifyitems(items):
    # A notebook run under nbval is never part of the fast tier.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    # Keep each phase's report on the test item, so a fixture can tell whether the test failed
    # (the browser test takes a screenshot then).
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="module")
def private_data_cache(tmp_path_factory):
    """Generate the course data of one test module into a fresh folder, not the learner's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PERFLAB_DATA", str(tmp_path_factory.mktemp("data")))
        yield
