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
    >>> answers["final_config"]["TrainConfig"]["batch_size"] = 10**6
    >>> train_config(answers["final_config"])                     # and stay within what the grader runs
    Traceback (most recent call last):
    ...
    perflab.grading.answers.AnswerError: batch_size=1000000 is over the grader's bound of 4096

Nothing is unpickled and no object travels: a configuration is the JSON of its fields, and each
field must have exactly its declared type (``True`` is not a batch size, ``"64"`` is not 64).
Whatever the kernel printed is only ever data: a kernel that prints another configuration hands
in that configuration, measured like any other.

The grader runs what it reads, outside any sandbox, so what it reads is bounded: the line's
size before it is parsed, its nesting and the digits of its integers as it is, and the fields of a
configuration that decide how many processes, how much memory and how long a run takes
(``FIELD_RANGES``, also what :func:`perflab.capstone.refusal` tells the learner). Whatever an
answer holds, reading it either succeeds or raises :class:`AnswerError`, that learner's failure.

Used in: lab 12.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
import types
import typing

if typing.TYPE_CHECKING:
    from perflab.train import TrainConfig

__all__ = [
    "AnswerError",
    "FIELD_RANGES",
    "HAND_IN_MARKER",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_LINE_BYTES",
    "MAX_NAME_CHARS",
    "boolean",
    "hand_in",
    "handed_in",
    "out_of_range",
    "train_config",
]

HAND_IN_MARKER = "perflab-hand-in: "
MAX_LINE_BYTES = 64 * 1024  # a hand-in is a few configurations: about 500 bytes each
MAX_DEPTH = 8  # a hand-in nests 3 levels: answers, a configuration, its fields
MAX_INT_DIGITS = 20  # any int64; Python's own limit (4,300 digits) depends on how the grader was started
# The fields of a TrainConfig that decide the grading host's processes, memory and time, and the
# range the grader runs (lowest, highest): a DataLoader refuses prefetch_factor 0 only once it starts.
FIELD_RANGES = {
    "num_workers": (0, 16),
    "prefetch_factor": (1, 16),
    "batch_size": (1, 4096),
    "accumulation_steps": (1, 64),
    "log_every": (1, 100_000),
}
MAX_NAME_CHARS = 200

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80


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
    if not isinstance(outputs, list):
        raise AnswerError(f"the cell's outputs are not a list but {type(outputs).__name__}")
    lines = [
        line[len(HAND_IN_MARKER) :]
        for output in outputs
        if isinstance(output, dict) and output.get("output_type") == "stream" and output.get("name") == "stdout"
        if isinstance(output.get("text"), str)
        for line in output["text"].splitlines()
        if line.startswith(HAND_IN_MARKER)
    ]
    if not lines:
        raise AnswerError("no answer reached the grader: the cell did not run to its end (see the errors above it)")
    if len(lines) > 1:
        raise AnswerError("the cell handed in more than one answer")
    size = len(lines[0].encode("utf-8", "surrogatepass"))  # a lone surrogate is JSON's to refuse, not a crash here
    if size > MAX_LINE_BYTES:
        raise AnswerError(f"the answer is {size:,} bytes long, over the grader's bound of {MAX_LINE_BYTES:,} bytes")
    try:
        answers = json.loads(lines[0], parse_int=_bounded_int, parse_constant=_not_a_number)
    except AnswerError:
        raise
    except RecursionError:
        raise AnswerError(f"the answer is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as error:
        raise AnswerError(f"the answer is not valid JSON: {error}") from None
    if not isinstance(answers, dict):
        raise AnswerError("the answer is not a set of named values")
    if _depth(answers) > MAX_DEPTH:
        raise AnswerError(f"the answer is nested deeper than {MAX_DEPTH} levels")
    return answers


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise AnswerError(f"an integer of {digits:,} digits is over the grader's bound of {MAX_INT_DIGITS} digits")
    return int(text)


def _not_a_number(name: str):
    raise AnswerError(f"{name} is not a number")


def _depth(answers: dict) -> int:
    """How many containers deep ``answers`` nests, walked without recursion."""
    deepest, pending = 0, [(answers, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def _shown(value) -> str:
    """``value`` in a message: its repr cut short, whatever its size or depth."""
    try:
        return _SHORT.repr(value)
    except ValueError:  # an int past Python's limit on digits to print
        return f"<{type(value).__name__} too large to print>"


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the largest float
        return False


def _check(name: str, value, annotation) -> None:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        if value not in args or type(value) is not type(next(a for a in args if a == value)):
            raise AnswerError(f"{name} must be one of {', '.join(map(repr, args))}, not {_shown(value)}")
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
        raise AnswerError(errors[0] if len(errors) == 1 else f"{name}: {_shown(value)} is none of the allowed types")
    elif annotation is bool:
        if type(value) is not bool:
            raise AnswerError(f"{name} must be True or False, not {_shown(value)}")
    elif annotation is int:
        if type(value) is not int:
            raise AnswerError(f"{name} must be an int, not {_shown(value)}")
    elif annotation is float:
        if type(value) not in (int, float) or not _finite(value):
            raise AnswerError(f"{name} must be a finite number, not {_shown(value)}")
    elif annotation is str:
        if type(value) is not str:
            raise AnswerError(f"{name} must be a string, not {_shown(value)}")
    else:
        raise AnswerError(f"{name}: no rule for values of type {annotation!r}")


def out_of_range(config: TrainConfig) -> str | None:
    """Why ``config`` is outside what the grader runs, the bound in words; None when it is within.

    The grader (:func:`train_config`) and the learner's own check (:func:`perflab.capstone.refusal`)
    both ask here, so the learner sees the grader's refusal before handing in.
    """
    for name, (lowest, highest) in FIELD_RANGES.items():
        value = getattr(config, name)
        if value is None:  # prefetch_factor's default: the DataLoader's own
            continue
        if value > highest:
            return f"{name}={_shown(value)} is over the grader's bound of {highest}"
        if value < lowest:
            return f"{name}={_shown(value)} is under the grader's bound of {lowest}"
    if len(config.name) > MAX_NAME_CHARS:
        return f"name is {len(config.name):,} characters long, over the grader's bound of {MAX_NAME_CHARS}"
    return None


def train_config(data) -> TrainConfig:
    """A :class:`~perflab.train.TrainConfig` from handed-in data: every field of its declared type and in range."""
    from perflab.train import TrainConfig

    if not isinstance(data, dict) or set(data) != {"TrainConfig"} or not isinstance(data["TrainConfig"], dict):
        raise AnswerError(f"not a TrainConfig: {_shown(data)}")
    fields = data["TrainConfig"]
    declared = {field.name for field in dataclasses.fields(TrainConfig)}
    if set(fields) != declared:
        extra, missing = sorted(set(fields) - declared, key=_shown), sorted(declared - set(fields))
        raise AnswerError(f"a TrainConfig with other fields (unknown: {_shown(extra)}, missing: {missing})")
    hints = typing.get_type_hints(TrainConfig)
    for name, value in fields.items():
        _check(name, value, hints[name])
    try:
        config = TrainConfig(
            **{name: float(value) if hints[name] is float else value for name, value in fields.items()}
        )
    except ValueError as error:
        raise AnswerError(str(error)) from None
    if problem := out_of_range(config):
        raise AnswerError(problem)
    return config


def boolean(data, name: str) -> bool:
    if type(data) is not bool:
        raise AnswerError(f"{name} must be True or False, not {_shown(data)}")
    return data
