"""Deprecated: renamed :mod:`perflab.profiling`, so this name no longer shadows ``torch.profiler.profile``.

Kept for one release, so notebooks that import the old path still run.
"""

import warnings

from perflab.profiling import ProfiledRun, Span, profile_training

__all__ = ["ProfiledRun", "Span", "profile_training"]

warnings.warn(
    "perflab.profile was renamed perflab.profiling; the old name goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
