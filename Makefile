# Three commands for a fresh machine:  make lab    (set up, then open the course)
#                                      make check  (set up, then lint and the fast tests: under 3 minutes)
#                                      make test   (set up, then run the whole test suite: 22-40 minutes, README)
#                                      make site   (set up, then build the course's website into build/site/html)
#                                      make test-compat TORCH=2.11.0  (the compatibility tier on another torch)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The supported range is pyproject.toml's; each tested torch has its torchvision in constraints/torch-X.Y.Z.txt.
# `make setup` installs the default pair; `make test-compat` the range's oldest end unless TORCH= says another.
# PIP_CONSTRAINT, not -c: the pair replaces any constraint pip's configuration sets (a machine's cap on torch).
DEFAULT_TORCH := 2.15.0
OLDEST_TORCH := 2.11.0
COMPAT_TORCH := $(if $(filter undefined,$(origin TORCH)),$(OLDEST_TORCH),$(TORCH))
TORCH ?= $(DEFAULT_TORCH)
CONSTRAINTS := constraints/torch-$(TORCH).txt
# nbgrader runs `alembic` and `jupyter` from PATH: the virtualenv's bin must come first.
export PATH := $(abspath $(BIN)):$(PATH)
# pytest on every core (pytest-xdist): each module, the lectures with the website, and the grading round trip are a
# unit of work for one worker, longest first; a measurement takes the machine alone (conftest.py, Machine).
PARALLEL := -n auto --no-loadscope-reorder
# jupyter refuses to start as root unless told it may (containers, Binder-like machines).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup lab check test test-compat setup-compat compat-tier site labs doctor clean

setup: $(VENV)/.installed-torch$(TORCH)

$(VENV)/.installed-torch$(TORCH): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=$(CONSTRAINTS) $(BIN)/python -m pip install --quiet -e '.[course,site,test]'
	rm -f $(VENV)/.installed-torch*
	touch $@

$(CONSTRAINTS):
	@echo "no $@: each tested torch has its file there, naming the torchvision built for it; have: $$(ls constraints)" >&2
	@exit 2

lab: setup
	$(BIN)/jupyter lab $(ROOT_FLAG)

# The fast tier: lint, format, unit tests and doctests; no notebook runs, no grading round trip.
check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PARALLEL) -m "not slow"

test: setup
	$(BIN)/python -m pytest $(PARALLEL)

# The compatibility tier, in a virtualenv of its own (.venv-torchX.Y.Z): the fast tests, every lecture under nbval and
# two labs' grading round trips (the `compat` marker, conftest.py) on another torch of the supported range. The round
# trips grade the solution and the untouched release: the attacks on the sandbox are make test's.
test-compat:
	$(MAKE) --no-print-directory compat-tier TORCH=$(COMPAT_TORCH) VENV=.venv-torch$(COMPAT_TORCH)

# That virtualenv alone, set up (.ci/run sets up every virtualenv at once, before any test).
setup-compat:
	$(MAKE) --no-print-directory setup TORCH=$(COMPAT_TORCH) VENV=.venv-torch$(COMPAT_TORCH)

compat-tier: setup
	$(BIN)/python -m pytest $(PARALLEL) -m "not slow or compat" --no-attacks

# The course as a website in build/site/html: runs the lectures whose content changed since the last build.
site: setup
	$(BIN)/python -m perflab site

# Regenerate every student version in labs/ from its source in solutions/.
labs: setup
	$(BIN)/nbgrader generate_assignment "*" --force

doctor: setup
	$(BIN)/python -m perflab doctor

clean:
	rm -rf $(VENV) .venv-torch* gradebook.db submitted autograded feedback build
