"""Fixtures shared by the test modules."""

import pytest
from perflab.grading.course import NbgraderCourse


@pytest.fixture(scope="session")
def released_course(tmp_path_factory) -> NbgraderCourse:
    """A course made from this repository with every lab released, once per test session.

    Tests read it, or copy it (``released_course.copy_to(tmp_path)``) to grade in: releasing
    costs an nbgrader start each time, and every test would otherwise release again.
    """
    course = NbgraderCourse.copy_of_repo(tmp_path_factory.mktemp("released"))
    course.release_all()
    return course
