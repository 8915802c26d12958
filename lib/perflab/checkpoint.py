"""Deprecated: renamed :mod:`perflab.training_state`, so this name no longer suggests activation checkpointing.

Kept for one release, so notebooks that import the old path still run.
"""

import warnings

from perflab.training_state import load_training_state, save_training_state

__all__ = ["load_training_state", "save_training_state"]

warnings.warn(
    "perflab.checkpoint was renamed perflab.training_state; the old name goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
