# Three commands for a fresh machine:  make lab    (set up, then open the course)
#                                      make check  (set up, then lint and the fast tests: under 3 minutes)
#                                      make test   (set up, then run the whole test suite: under 20 minutes)
#                                      make site   (set up, then build the course's website into build/site/html)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# nbgrader runs `alembic` and `jupyter` from PATH: the virtualenv's bin must come first.
export PATH := $(abspath $(BIN)):$(PATH)
# jupyter refuses to start as root unless told it may (containers, Binder-like machines).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup lab check test site labs doctor clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[course,site,test]'
	touch $@

lab: setup
	$(BIN)/jupyter lab $(ROOT_FLAG)

# The fast tier: lint, format, unit tests and doctests; no notebook runs, no grading round trip.
check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -m "not slow"

test: setup
	$(BIN)/python -m pytest

# The course as a website in build/site/html: runs the lectures whose content changed since the last build.
site: setup
	$(BIN)/python -m perflab site

# Regenerate every student version in labs/ from its source in solutions/.
labs: setup
	$(BIN)/nbgrader generate_assignment "*" --force

doctor: setup
	$(BIN)/python -m perflab doctor

clean:
	rm -rf $(VENV) gradebook.db submitted autograded feedback build
