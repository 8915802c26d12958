"""Graded cells decided outside the learner's kernel, on what the learner's code returns as data.

    grade_checked_lab("lab01_timing", cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_time_it': Verdict(pass: ...), ...}: one sandboxed child runs the lab's cells (seconds), so shown, not run

A lab's check module, ``perflab.grading.checks.<lab>``, is the one place its graded cells are
decided. It names the cells a child runs, in the notebook's order (``CELLS``: the course's own
and, of those, the learner's ``ANSWERS``), and one :class:`Check` per graded cell:

- ``probe(namespace, seed)`` calls the lab's functions in a namespace on the course's inputs,
  drawn from ``seed``, and returns plain data (:mod:`perflab.grading.plain_data`). It runs twice:
  in a sandboxed child, on the learner's answers, and here, on the course's reference solution.
- ``decide(got, want, seed)`` runs here, on the two results as :func:`plain_data.decode` rebuilt
  them, and returns every reason the answer fails (empty: it passes). What it cannot read of the
  learner's result fails the check; when the course's side failed it raises :class:`GraderFault`,
  and the cell's grading failed (graded again, never scored).

The seed is drawn here, per grading, and reaches the child only with the request. Every
comparison runs in this process, with the course's code, on data: whatever the learner's cells
replace in their own process (``torch.allclose``, a check helper, ``__eq__``) never takes part.
What the child reports is what the learner's code computed, or what the learner's code made it
report: a check holds only where a right result needs the right work on inputs nobody knew
before the request. A learner's cell that raises fails the checks that need it, not the others,
and a kernel that died in the notebook loses nothing here: the child runs the cells again.

    >>> check = Check("the sum of two numbers", probe=lambda ns, seed: ns["add"](seed, 1),
    ...               decide=lambda got, want, seed: differences(got, want, what="add(seed, 1)"))
    >>> check.decide(5, 5, 4), check.decide(6, 5, 4)
    ([], ['add(seed, 1): 6, expected 5'])

Used by perflab.grading.session, for the labs that have a check module.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from perflab.grading.child import AnswerProcess, ChildError, ChildLost
from perflab.grading.code_labs import grader_seeds, run_cells
from perflab.grading.plain_data import NotPlainData, decode, encode
from perflab.grading.verdict import Verdict

__all__ = [
    "Check",
    "GraderFault",
    "as_python",
    "check_module",
    "child_probe",
    "differences",
    "grade_checked_lab",
    "raised",
]

PROBE_TIMEOUT_S = 300  # a watchdog far above any probe's seconds: a probe that takes this long hangs
MAX_FAILURES = 4


@dataclass(frozen=True)
class Check:
    """One graded cell's check: what it checks (shown in the feedback), its probe and its decision."""

    description: str
    probe: Callable[[dict, int], object]
    decide: Callable[[object, object, int], list[str]]
    needs: tuple[str, ...] = field(default=())  # the answer cells whose failure fails this check at once
    # What ``decide`` compares with, computed here from the reference's namespace; by default the probe's result on it.
    # A lab whose probe is costly (a torchrun job) may compute it more cheaply (in one process).
    expected: Callable[[dict, int], object] | None = None

    def want(self, reference: dict, seed: int):
        return (self.expected or self.probe)(reference, seed)


class GraderFault(Exception):
    """Raised by a check's decision when the course's side failed (the reference could not be measured): the grading
    failed, not the answer."""


def check_module(lab: str):
    """The lab's check module, or None when the lab has none (labs 10 and 11: graders of their own)."""
    from perflab.grading.checks import CHECK_MODULES  # its modules import this one

    return CHECK_MODULES.get(lab)


def raised(call: Callable[[], object]) -> str | None:
    """The name of the exception ``call()`` raised, or None if it returned.

    >>> raised(lambda: int("x")), raised(lambda: int("1"))
    ('ValueError', None)
    """
    try:
        call()
    except Exception as error:  # noqa: BLE001 - which exception is the answer
        return type(error).__name__
    return None


def differences(got, want, *, what: str = "the result", atol: float = 0.0, rtol: float = 0.0) -> list[str]:
    """Where plain data ``got`` differs from ``want``: the same structure, the same types, numbers and tensors
    within ``atol + rtol * |want|`` (tensors of the same dtype and shape), the rest equal.

    >>> import torch
    >>> differences({"loss": torch.tensor([1.0, 2.0])}, {"loss": torch.tensor([1.0, 2.5])}, atol=0.1)
    ["the result['loss']: differs by up to 0.5 (at index 1; tolerance 0.1 + 0 x |expected|)"]
    >>> differences([1, "a"], [1, "b"], what="answers")
    ["answers[1]: 'a', expected 'b'"]
    """
    if type(want) is not type(got) and not (type(want) in (int, float) and type(got) in (int, float)):
        return [f"{what}: a {type(got).__name__}, expected a {type(want).__name__}"]
    if isinstance(want, dict):
        if set(got) != set(want):
            return [f"{what}: the keys {sorted(got)}, expected {sorted(want)}"]
        return [
            problem
            for key in want
            for problem in differences(got[key], want[key], what=f"{what}[{key!r}]", atol=atol, rtol=rtol)
        ]
    if isinstance(want, list):
        if len(got) != len(want):
            return [f"{what}: {len(got)} items, expected {len(want)}"]
        return [
            problem
            for index, (g, w) in enumerate(zip(got, want))
            for problem in differences(g, w, what=f"{what}[{index}]", atol=atol, rtol=rtol)
        ]
    if isinstance(want, torch.Tensor):
        return _tensor_differences(got, want, what, atol, rtol)
    if type(want) in (int, float) and not type(want) is type(got) is int:
        if math.isnan(want) and math.isnan(got):
            return []
        if math.isclose(got, want, rel_tol=rtol, abs_tol=atol):
            return []
    elif got == want:
        return []
    return [f"{what}: {got!r:.200}, expected {want!r:.200}"]


def _tensor_differences(got: torch.Tensor, want: torch.Tensor, what: str, atol: float, rtol: float) -> list[str]:
    if got.dtype != want.dtype or got.shape != want.shape:
        return [f"{what}: a {got.dtype} tensor of shape {list(got.shape)}, expected {want.dtype} {list(want.shape)}"]
    if got.is_floating_point():
        got64, want64 = got.double(), want.double()
        gap = (got64 - want64).abs().nan_to_num(nan=math.inf)
        gap[(got64 == want64) | (got64.isnan() & want64.isnan())] = 0  # equal infinities and NaNs where expected
        bad = gap > atol + rtol * want64.abs()
        if bad.any():
            worst = int(gap.reshape(-1).argmax())
            return [
                f"{what}: differs by up to {gap.max().item():.3g} (at index {worst}; tolerance {atol:g} + "
                f"{rtol:g} x |expected|)"
            ]
        return []
    if not torch.equal(got, want):
        return [f"{what}: {int((got != want).sum())} of {want.numel()} elements differ"]
    return []


def child_probe(namespace: dict, payload: bytes, *, lab: str, check: str, seed: int) -> tuple[object, bytes]:
    """The child's side: run the check's probe on the learner's namespace, and hand back its result as plain data."""
    return encode(check_module(lab).CHECKS[check].probe(namespace, seed))


def _reference(module, cells: dict) -> dict:
    """The namespace of the course's cells, run here, its reference solution included; what they print is dropped:
    nobody reads it."""
    with contextlib.redirect_stdout(io.StringIO()):
        return run_cells({name: as_python(cells["course"][name]) for name in module.CELLS}, list(module.CELLS))


def as_python(cell: str) -> str:
    r"""A cell as plain Python: a ``%%writefile`` cell writes its body to the file it names, as IPython would.

    >>> print(as_python('%%writefile {work / "zero1.py"}\nimport torch'))
    __import__("pathlib").Path(f'{work / "zero1.py"}').write_text('import torch\n')
    """
    first, _, body = cell.partition("\n")
    if not first.startswith("%%writefile "):
        return cell
    target = first.removeprefix("%%writefile ").strip()
    return f'__import__("pathlib").Path(f{target!r}).write_text({body.rstrip() + chr(10)!r})'


def _learner_cells(module, cells: dict) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """What the child runs (the course's cells and the learner's answers, in order), and the answers missing."""
    missing = {
        name: "the answer cell is missing from the notebook" for name in module.ANSWERS if name not in cells["learner"]
    }
    run = [
        (name, as_python(cells["learner" if name in module.ANSWERS else "course"][name]))
        for name in module.CELLS
        if name not in missing
    ]
    return run, missing


def _verdict(check: Check, failures: list[str]) -> Verdict:
    return Verdict.decide(check.description, failures[:MAX_FAILURES])


def grade_checked_lab(lab: str, cells: dict, log=lambda line: None) -> dict[str, Verdict]:
    """Every graded cell of ``lab``'s check module (see the module's docstring)."""
    module = check_module(lab)
    run, failed = _learner_cells(module, cells)
    try:
        child = AnswerProcess(run, handlers=__name__, keep_going=True)
    except ChildLost as error:
        return dict.fromkeys(module.CHECKS, Verdict.grading_failed(str(error)))
    except ChildError as error:  # the answers ended their process while it ran them
        return {name: Verdict.refused(f"your cells, run by the grader: {error}") for name in module.CHECKS}
    failed.update(child.failed_cells)
    # The reference runs only when a check can use it: an untouched release fails every check on its raising cells.
    runnable = any(not set(check.needs) & set(failed) for check in module.CHECKS.values())
    try:
        reference = _reference(module, cells) if runnable else {}
    except BaseException:
        child.close()
        raise
    verdicts = {}
    try:
        for name, check in module.CHECKS.items():
            log(f"{lab}: {name}")
            broken = [f"your cell {cell}: {failed[cell]}" for cell in check.needs if cell in failed]
            if broken:
                verdicts[name] = Verdict.refused("; ".join(broken))
                continue
            seed = grader_seeds.randrange(2**31)
            try:
                header, payload, _ = child.call("probe", lab=lab, check=name, seed=seed, timeout_s=PROBE_TIMEOUT_S)
                got = decode(header, payload)
            except ChildLost as error:
                verdicts[name] = Verdict.grading_failed(str(error))
                continue
            except (ChildError, NotPlainData) as error:
                verdicts[name] = _verdict(check, [f"your code, run by the grader: {error}"])
                continue
            want = decode(*encode(check.want(reference, seed)))
            # What the decision cannot read fails the check: a result of another form than the course's (an empty list,
            # a missing key, a tensor torch refuses with a RuntimeError). The course's own side raises GraderFault.
            try:
                verdicts[name] = _verdict(check, check.decide(got, want, seed))
            except GraderFault as fault:
                verdicts[name] = Verdict.grading_failed(f"{check.description}: {fault}")
            except Exception as error:  # noqa: BLE001
                log(f"{lab}: {name}: the decision raised {type(error).__name__}: {error}")
                failures = [f"the grader could not read your code's result: {type(error).__name__}: {error}"]
                verdicts[name] = _verdict(check, failures)
    finally:
        child.close()
    return verdicts
