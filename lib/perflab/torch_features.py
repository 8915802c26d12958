"""Which torch has what: the one home for every API the course uses beyond the oldest torch it supports.

    >>> from perflab import torch_features
    >>> torch_features.SUPPORTED                    # read from perflab's installed requirements
    '>=2.11,<2.16'
    >>> torch_features.has("profiler_input_dtypes") in (True, False)
    True
    >>> torch_features.require("checkpoint_respects_saved_tensors_hooks")   # doctest: +SKIP
    needs torch >= 2.14 (checkpoint(..., respect_saved_tensors_hooks=True)); your torch is 2.11.0: ...
    False
    >>> torch_features.features()                   # doctest: +SKIP
    feature                                  since  here  where the course uses it  without it
    ...

A feature is found by looking for the API itself (a parameter in a signature, an attribute,
an operator that runs), never by comparing version strings: a nightly, a vendor's build or a
backport has what it has. Course code takes the newer path where the feature exists and the
older one where it does not; where only a newer torch can do a thing, a cell calls
:func:`require`, which prints one line saying what it needs and which torch the learner has,
and the lecture goes on.

Used in: lectures 05, 09 and lab 09; by perflab.doctor, perflab.sharding and perflab.triton_interpreter.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from perflab.render import Table

__all__ = ["DEFAULT", "FEATURES", "SUPPORTED", "TESTED", "Feature", "features", "has", "in_supported_range", "require"]

# The releases the suite runs on, each with its torchvision in constraints/torch-X.Y.Z.txt: the range's oldest end
# (make test-compat) and its newest, the default install's (make setup, make test). tests/test_torch_features.py
# checks them against the constraints files, the Makefile and pyproject.toml.
DEFAULT = "2.15.0"
TESTED = ("2.11.0", DEFAULT)


def _supported() -> str:
    """The torch requirement perflab was installed with (pyproject.toml's dependencies)."""
    try:
        requirements = importlib.metadata.requires("perflab") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        requirements = []
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == "torch" and not requirement.marker:
            # lowest bound first, as people write a range: ">=2.11,<2.15"
            return ",".join(sorted(map(str, requirement.specifier), key=lambda spec: not spec.startswith(">")))
    return ""


SUPPORTED = _supported()


def in_supported_range(version: str | None = None) -> bool:
    """Whether torch ``version`` (this one by default) lies in the range the course supports.

    >>> in_supported_range("2.11.0"), in_supported_range("2.10.0"), in_supported_range("2.14.1+cu130")
    (True, False, True)
    """
    release = Version(version or torch.__version__).base_version  # a local tag (+cu130) or a nightly's suffix
    return Requirement(f"torch{SUPPORTED}").specifier.contains(release, prereleases=True)


@dataclass(frozen=True)
class Feature:
    """One API newer than the oldest supported torch: how to find it, and what the course does without it."""

    name: str
    api: str  # as a learner would call it
    since: str  # the first torch release that has it
    used_in: str  # the cells that use it
    without: str  # what those cells do on a torch that lacks it
    detect: Callable[[], bool]

    @property
    def available(self) -> bool:
        return _detected(self.name)

    def message(self) -> str:
        """The one line a cell prints where this torch lacks the feature."""
        return f"needs torch >= {self.since} ({self.api}); your torch is {torch.__version__}: {self.without}."


def _has_parameter(function: Callable, parameter: str) -> bool:
    return parameter in inspect.signature(function).parameters


def _checkpoint_has_respect_hooks() -> bool:
    from torch.utils.checkpoint import checkpoint

    return _has_parameter(checkpoint, "respect_saved_tensors_hooks")


def _checkpoint_policy_sees_op_output() -> bool:
    from torch.utils.checkpoint import SelectiveCheckpointContext

    return _has_parameter(SelectiveCheckpointContext.__init__, "op_output")


def _profiler_records_input_dtypes() -> bool:
    from torch.autograd.profiler_util import FunctionEvent

    return _has_parameter(FunctionEvent.__init__, "input_dtypes")


def _c10d_has_single_collectives() -> bool:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    return all(hasattr(api, name) for api in (dist, funcol) for name in ("all_gather_single", "reduce_scatter_single"))


def _interpreter_loops_to_runtime_bounds() -> bool:
    from perflab.triton_interpreter import interpreter_loops_to_runtime_bounds

    return interpreter_loops_to_runtime_bounds()


FEATURES: tuple[Feature, ...] = (
    Feature(
        "checkpoint_respects_saved_tensors_hooks",
        "checkpoint(..., respect_saved_tensors_hooks=True)",
        "2.14",
        "lecture 05: what selective checkpointing keeps, counted by perflab.memory.saved_tensors "
        "(its trade-off table, the torch.compile budget table, exercise 2's check)",
        "what selective checkpointing keeps is counted as what each forward pass leaves held "
        "(measure_tradeoff(kept=\"held\"), peak_memory's held_bytes), which sees the policy's outputs too",
        _checkpoint_has_respect_hooks,
    ),
    Feature(
        "checkpoint_policy_sees_op_output",
        "ctx.op_output in a selective checkpointing policy, called after the operation ran",
        "2.12",
        "lecture 05: the operators a selective checkpointing policy kept or recomputed, and the bytes it kept",
        "the cell shows the measured memory and time without the policy's own record of operators and bytes",
        _checkpoint_policy_sees_op_output,
    ),
    Feature(
        "profiler_input_dtypes",
        "torch.profiler's FunctionEvent.input_dtypes",
        "2.12",
        "lectures 07, 09, 11: the bytes of each collective (perflab.sharding.profile_collectives)",
        "profile_collectives reads the same dtypes off the profiler's Kineto events: the same bytes",
        _profiler_records_input_dtypes,
    ),
    Feature(
        "interpreter_runtime_loop_bounds",
        "triton 3.7's interpreter: a loop to a kernel's runtime argument, range(0, n, BLOCK), under NumPy >= 2.4",
        "2.12",
        "lecture 10 and lab 10 (and its grader): every kernel that loops over a row or a sequence, without a GPU",
        "perflab.triton_interpreter.patch_interpreter gives the interpreter triton 3.7's fix, and the kernels run as written",
        _interpreter_loops_to_runtime_bounds,
    ),
    Feature(
        "c10d_single_collectives",
        "torch.distributed.all_gather_single and reduce_scatter_single (and the functional collectives')",
        "2.13",
        "lecture 09's collectives counted one by one, lab 09's ZeRO-1 solution",
        "they call the same collectives by their older names, all_gather_into_tensor and reduce_scatter_tensor",
        _c10d_has_single_collectives,
    ),
)
_BY_NAME = {feature.name: feature for feature in FEATURES}


@functools.cache
def _detected(name: str) -> bool:
    try:
        return bool(_BY_NAME[name].detect())
    except (ImportError, AttributeError, RuntimeError, NotImplementedError):
        return False


def has(name: str) -> bool:
    """Whether this torch has the feature ``name`` (a name in :data:`FEATURES`)."""
    if name not in _BY_NAME:
        raise KeyError(f"no feature {name!r}; the course's features: {', '.join(_BY_NAME)}")
    return _detected(name)


def require(name: str) -> bool:
    """True where this torch has ``name``; otherwise print the one line saying what is needed, and return False."""
    if has(name):
        return True
    print(_BY_NAME[name].message())
    return False


@dataclass(frozen=True)
class FeatureReport:
    """Every feature beyond the oldest supported torch, and whether this torch has it."""

    rows: tuple[tuple[Feature, bool], ...]

    def _table(self) -> Table:
        in_range = "in" if in_supported_range() else "OUTSIDE"
        caption = f"torch {torch.__version__}: {in_range} the supported range {SUPPORTED} (tested: {', '.join(TESTED)})"
        return Table(
            ("feature", "since", "here", "where the course uses it", "without it"),
            [(f.api, f.since, "yes" if here else "no", f.used_in, "" if here else f.without) for f, here in self.rows],
            caption=caption,
        )

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def features() -> FeatureReport:
    """A table of :data:`FEATURES` on this torch: what it has, and what the course does without the rest."""
    return FeatureReport(tuple((feature, feature.available) for feature in FEATURES))
