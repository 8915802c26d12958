"""Answers handed over as data: printed by a hidden test cell, read and strictly checked by the grader.

    >>> import contextlib, io
    >>> from dataclasses import replace
    >>> from perflab.grading.answers import hand_in, handed_in, train_config
    >>> from perflab.train import OPTIMIZED
    >>> final_config = replace(OPTIMIZED, name="final")
    >>> hand_in(final_config=final_config, KEEP_AMP=False)        # in a hidden test cell
    perflab-hand-in: {"final_config": {"TrainConfig": {"name": "final", ...}}, "KEEP_AMP": false}
    >>> with contextlib.redirect_stdout(io.StringIO()) as printed:
    ...     hand_in(final_config=final_config, KEEP_AMP=False)
    >>> outputs = [{"output_type": "stream", "name": "stdout", "text": printed.getvalue()}]   # the cell's outputs
    >>> answers = handed_in(outputs)                              # in the grader, outside the kernel
    >>> train_config(answers["final_config"]) == final_config, answers["KEEP_AMP"]
    (True, False)
    >>> answers["final_config"]["TrainConfig"]["batch_size"] = True
    >>> train_config(answers["final_config"])                     # every field must have its declared type
    Traceback (most recent call last):
    ...
    perflab.grading.answers.AnswerError: batch_size must be an int, not True

Nothing is unpickled and no object travels: a configuration is the JSON of its fields, and each
field must have exactly its declared type (``True`` is not a batch size, ``"64"`` is not 64).
Whatever the kernel printed is only ever data: a kernel that prints another configuration hands
in that configuration, measured like any other.

Used in: lab 10.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing

if typing.TYPE_CHECKING:
    from perflab.train import TrainConfig

__all__ = ["AnswerError", "HAND_IN_MARKER", "boolean", "hand_in", "handed_in", "train_config"]

HAND_IN_MARKER = "perflab-hand-in: "


class AnswerError(ValueError):
    """An answer that is missing or not the data it should be; the message is shown to the learner."""


def hand_in(**answers) -> None:
    """Print ``answers`` for the grader, as one line of JSON (configurations as their fields)."""
    from perflab.train import TrainConfig

    def as_data(name, value):
        if isinstance(value, TrainConfig):
            return {"TrainConfig": dataclasses.asdict(value)}
        if value is None or type(value) in (bool, int, float, str):
            return value
        raise TypeError(f"{name} must be a TrainConfig, a number, a bool or a string, not {type(value).__name__}")

    print(HAND_IN_MARKER + json.dumps({name: as_data(name, value) for name, value in answers.items()}))


def handed_in(outputs: list) -> dict:
    """The answers a cell's outputs hold: exactly one hand-in line, on standard output."""
    lines = [
        line[len(HAND_IN_MARKER) :]
        for output in outputs
        if output.get("output_type") == "stream" and output.get("name") == "stdout"
        for line in str(output.get("text", "")).splitlines()
        if line.startswith(HAND_IN_MARKER)
    ]
    if not lines:
        raise AnswerError("no answer reached the grader: the cell did not run to its end (see the errors above it)")
    if len(lines) > 1:
        raise AnswerError("the cell handed in more than one answer")
    try:
        answers = json.loads(lines[0], parse_constant=lambda name: _raise(f"{name} is not a number"))
    except ValueError as error:
        raise AnswerError(f"the answer is not valid JSON: {error}") from None
    if not isinstance(answers, dict):
        raise AnswerError("the answer is not a set of named values")
    return answers


def _raise(message: str):
    raise AnswerError(message)


def _check(name: str, value, annotation) -> None:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        if value not in args or type(value) is not type(next(a for a in args if a == value)):
            raise AnswerError(f"{name} must be one of {', '.join(map(repr, args))}, not {value!r}")
    elif origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _check(name, value, option)
            except AnswerError as error:
                errors.append(str(error))
        raise AnswerError(errors[0] if len(errors) == 1 else f"{name}: {value!r} is none of the allowed types")
    elif annotation is bool:
        if type(value) is not bool:
            raise AnswerError(f"{name} must be True or False, not {value!r}")
    elif annotation is int:
        if type(value) is not int:
            raise AnswerError(f"{name} must be an int, not {value!r}")
    elif annotation is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise AnswerError(f"{name} must be a finite number, not {value!r}")
    elif annotation is str:
        if type(value) is not str:
            raise AnswerError(f"{name} must be a string, not {value!r}")
    else:
        raise AnswerError(f"{name}: no rule for values of type {annotation!r}")


def train_config(data) -> TrainConfig:
    """A :class:`~perflab.train.TrainConfig` from handed-in data, every field checked against its declared type."""
    from perflab.train import TrainConfig

    if not isinstance(data, dict) or set(data) != {"TrainConfig"} or not isinstance(data["TrainConfig"], dict):
        raise AnswerError(f"not a TrainConfig: {str(data)[:200]}")
    fields = data["TrainConfig"]
    declared = {field.name for field in dataclasses.fields(TrainConfig)}
    if set(fields) != declared:
        extra, missing = sorted(set(fields) - declared), sorted(declared - set(fields))
        raise AnswerError(f"a TrainConfig with other fields (unknown: {extra}, missing: {missing})")
    hints = typing.get_type_hints(TrainConfig)
    for name, value in fields.items():
        _check(name, value, hints[name])
    try:
        return TrainConfig(**{name: float(value) if hints[name] is float else value for name, value in fields.items()})
    except ValueError as error:
        raise AnswerError(str(error)) from None


def boolean(data, name: str) -> bool:
    if type(data) is not bool:
        raise AnswerError(f"{name} must be True or False, not {data!r}")
    return data
