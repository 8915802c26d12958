"""The capstone's measurements: the course's benchmark, and the grader that re-measures a submission.

    >>> from perflab.capstone import COURSE_WORKLOAD, MIN_SPEEDUP, ceiling_of, measure_submission
    >>> from perflab.train import OPTIMIZED
    >>> COURSE_WORKLOAD.train_samples, COURSE_WORKLOAD.epochs, MIN_SPEEDUP   # what is trained, what passes
    (5000, 6, 2.0)
    >>> ceiling_of(OPTIMIZED).pipeline       # the same step on batches already in memory: the compute ceiling
    'memory'
    >>> measure_submission(ceiling_of(OPTIMIZED))   # not a way to train: refused before anything is timed
    CapstoneGrade(FAIL (pipeline='memory' steps on a few cached batches over and over: ...): not measured)

The benchmark and the grader each take minutes on a laptop, training the course's workload in
full, so they are shown here, not run::

    benchmark_capstone()   # baseline, reference optimized pipeline and compute ceiling, side by side
    grade(my_config)       # a learner's TrainConfig against the course's baseline, in a fresh process

Both time each configuration on one-epoch trials in alternating order after a warm-up epoch,
so that whatever drifts during the run (clock boost, a busy neighbour) hits every side alike,
and both take accuracy from full runs of the course's :class:`~perflab.train.Workload`.

Used in: lab 12.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

import perflab
from perflab.bench import Comparison, Timing, interleaved_rounds, median_ratio
from perflab.device import device_name, pick_device
from perflab.grading.answers import AnswerError, out_of_range, train_config
from perflab.grading.verdict import INCONCLUSIVE, LoadMeter, noise_problems
from perflab.render import Environment, Markup, Table
from perflab.train import NAIVE, TrainConfig, Workload, reference_for, train
from perflab.train_result import TrainResult

__all__ = [
    "ACCURACY_TOLERANCE",
    "BENCHMARK_ROUNDS",
    "CONFIDENCE",
    "COURSE_WORKLOAD",
    "CapstoneBenchmark",
    "CapstoneGrade",
    "MIN_SPEEDUP",
    "TRIAL_ROUNDS",
    "baseline_accuracy",
    "benchmark_capstone",
    "ceiling_of",
    "grade",
    "grade_from_stdin",
    "measure_speeds",
    "measure_submission",
    "refusal",
    "speedup_of",
]

COURSE_WORKLOAD = Workload()
MIN_SPEEDUP = 2.0
# Accuracy points a submission may lose against the baseline. Two runs of one configuration
# differ by up to about one point here (thread scheduling changes float sums); a larger batch
# that keeps its accuracy by a retuned learning rate ends within two points of the baseline.
ACCURACY_TOLERANCE = 0.03
TRIAL_ROUNDS = 5  # the grader's: five rounds keep one grading within two minutes on a 2-core CPU
# The benchmark has no such limit: on a machine whose speed drifts by half within a minute (a
# shared cloud VM), nine rounds make two runs agree far better than five.
BENCHMARK_ROUNDS = 9
CONFIDENCE = 0.9  # what 5 rounds allow: the median's order-statistic interval covers 94%


def ceiling_of(config: TrainConfig) -> TrainConfig:
    """The same model and step on batches already in memory: as fast as ``config`` can get."""
    return replace(config, name=f"{config.name} ceiling", pipeline="memory")


def _interleaved_trials(
    runs: list[tuple[TrainConfig, Workload]],
    *,
    rounds: int = TRIAL_ROUNDS,
    device: torch.device,
    log=None,
    progress: bool = False,
    max_steps: int | None = None,
) -> list[list[TrainResult]]:
    """One epoch (or ``max_steps``) of each run per round, the order reversed every other round, after a warm-up each.

    The progress bar moves between epochs, outside the timed steps, so it costs the trials nothing.
    """
    trials = [(config, replace(workload, epochs=1)) for config, workload in runs]
    bar = tqdm(total=len(trials) * (rounds + 1), desc="interleaved trials", unit="epoch", disable=not progress)

    def trial(config: TrainConfig, workload: Workload):
        def run(_round_index: int) -> TrainResult:  # the warm-up too: caches, allocator, compilation
            result = train(config, workload, device=device, progress=False, max_steps=max_steps)
            bar.update()
            return result

        return run

    def log_round(round_index: int, results: list[list[TrainResult]]) -> None:
        log(
            f"round {round_index + 1}/{rounds}: "
            + ", ".join(
                f"{config.name} {side[-1].samples_per_s:,.0f} samples/s" for (config, _), side in zip(runs, results)
            )
        )

    results = interleaved_rounds([trial(*pair) for pair in trials], rounds, after_round=log_round if log else None)
    bar.close()
    return results


def _per_sample_timing(label: str, results: list[TrainResult]) -> Timing:
    """Seconds per training sample of each trial, as a :class:`~perflab.bench.Timing`."""
    measured_on = results[0].environment
    return Timing(
        label=label,
        times=tuple(r.train_s / r.samples for r in results),
        device=measured_on.device,
        num_threads=measured_on.threads,
    )


def _median_samples_per_s(results: list[TrainResult]) -> float:
    return statistics.median(r.samples_per_s for r in results)


@dataclass(frozen=True)
class CapstoneBenchmark:
    """``python -m perflab bench capstone``: the course's baseline, its optimized pipeline and their ceiling."""

    names: tuple[str, ...]  # baseline, optimized, ceiling
    samples_per_s: tuple[tuple[float, ...], ...]  # per name, one per interleaved round
    accuracies: tuple[float | None, ...]  # from a full run; None for the ceiling, which repeats a few batches
    environment: Environment

    @property
    def speedup(self) -> Comparison:
        baseline, optimized = ([1 / s for s in side] for side in self.samples_per_s[:2])
        return Comparison(
            Timing(self.names[0], tuple(baseline)), Timing(self.names[1], tuple(optimized)), confidence=CONFIDENCE
        )

    @property
    def ceiling_share(self) -> float:
        """Median over rounds of optimized samples/s over ceiling samples/s in the same round."""
        return median_ratio(self.samples_per_s[1], self.samples_per_s[2])

    def _table(self) -> Table:
        """Median samples/s, and the median of per-round ratios to the baseline, as ``speedup`` takes it."""
        baseline = self.samples_per_s[0]
        rows = [
            (
                name,
                f"{statistics.median(side):,.0f}",
                f"{median_ratio(side, baseline):.2f}x",
                "-" if accuracy is None else f"{accuracy:.1%}",
            )
            for name, side, accuracy in zip(self.names, self.samples_per_s, self.accuracies)
        ]
        speedup = self.speedup
        low, high = speedup.interval
        caption = (
            f"optimized reaches {self.ceiling_share:.0%} of its compute ceiling\n"
            f"{len(baseline)} interleaved rounds of one epoch each on {self.environment}; "
            f"speedup {CONFIDENCE:.0%} CI {low:.2f}x-{high:.2f}x\n"
            f"speedup {speedup.speedup:.2f}x"
        )
        header = ("configuration", "samples/s", "vs baseline", "val accuracy")
        return Table(header, rows, caption=caption, numeric=(1, 2, 3))

    def __str__(self) -> str:
        return str(self._table())

    def __repr__(self) -> str:
        return f"CapstoneBenchmark(speedup {self.speedup.speedup:.2f}x, {self.ceiling_share:.0%} of ceiling)"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "speedup": self.speedup.speedup, "ceiling_share": self.ceiling_share})


def benchmark_capstone(
    *, rounds: int = BENCHMARK_ROUNDS, device: str | torch.device | None = None, progress: bool = True
) -> CapstoneBenchmark:
    """Full runs of the baseline and the device's reference pipeline (``reference_for``) for accuracy, then
    interleaved trials."""
    device = pick_device(device)
    reference = reference_for(device)
    configs = (NAIVE, reference, ceiling_of(reference))
    accuracies = []
    for config in configs[:2]:
        accuracies.append(train(config, COURSE_WORKLOAD, device=device, progress=progress).val_accuracy)
    trials = _interleaved_trials(
        [(config, COURSE_WORKLOAD) for config in configs], rounds=rounds, device=device, progress=progress
    )
    return CapstoneBenchmark(
        names=tuple(config.name for config in configs),
        samples_per_s=tuple(tuple(r.samples_per_s for r in side) for side in trials),
        accuracies=(*accuracies, None),
        environment=Environment.capture(device),
    )


@dataclass(frozen=True)
class CapstoneGrade:
    """What the grader measured of a submission: ``pass``, ``fail`` or ``inconclusive`` (too noisy to decide)."""

    status: str
    reasons: tuple[str, ...]  # every check that failed, in words; or why the measurement could not decide
    speedup: float | None
    interval: tuple[float, float] | None
    baseline_samples_per_s: float | None
    candidate_samples_per_s: float | None
    baseline_accuracy: float | None  # None when no full run was needed to fail the submission
    candidate_accuracy: float | None
    config: dict
    environment: Environment

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def _summary(self) -> str:
        parts = []
        if self.speedup is not None:
            low, high = self.interval
            parts.append(
                f"{self.speedup:.2f}x median speedup ({CONFIDENCE:.0%} CI {low:.2f}x-{high:.2f}x, "
                f"{self.baseline_samples_per_s:,.0f} -> {self.candidate_samples_per_s:,.0f} samples/s)"
            )
        if self.candidate_accuracy is not None:
            parts.append(f"accuracy {self.candidate_accuracy:.1%} vs baseline {self.baseline_accuracy:.1%}")
        return "; ".join(parts) or "not measured"

    def __repr__(self) -> str:
        verdict = "PASS" if self.passed else f"{self.status.upper()} (" + "; ".join(self.reasons) + ")"
        return f"CapstoneGrade({verdict}: {self._summary()})"

    def _repr_html_(self) -> str:
        colour = {"pass": "green", "fail": "darkred"}.get(self.status, "darkorange")
        verdict = Markup(self.status.upper(), f"<b style='color:{colour}'>{self.status.upper()}</b>")
        rows = [("verdict", verdict), ("measured", self._summary()), *(("why", reason) for reason in self.reasons)]
        return Table((), rows, caption=f"re-measured on {self.environment}")._repr_html_()


def refusal(config: TrainConfig) -> str | None:
    """Why ``config`` changes the task, or asks more of the grading host than the grader runs; None when neither.

    The bounds are the grader's own (:func:`perflab.grading.answers.out_of_range`), so that this
    check in the learner's kernel refuses exactly what the grader will refuse after hand-in.
    """
    if config.pipeline == "memory":
        return (
            "pipeline='memory' steps on a few cached batches over and over: it is the compute ceiling, "
            "not a training run over the course's data"
        )
    return out_of_range(config)


def measure_speeds(
    configs: list[TrainConfig], *, rounds: int, device: torch.device, log=None, max_steps: int | None = None
) -> tuple[list[list[TrainResult]], LoadMeter]:
    """Interleaved one-epoch trials of ``configs`` on the course's workload, and the load beside them."""
    with LoadMeter() as load:
        trials = _interleaved_trials(
            [(config, COURSE_WORKLOAD) for config in configs],
            rounds=rounds,
            device=device,
            log=log,
            max_steps=max_steps,
        )
    if log:
        log(f"other processes took {load.other_cores:.2f} cores while measuring")
    return trials, load


def speedup_of(baseline: list[TrainResult], candidate: list[TrainResult], label: str) -> Comparison:
    return Comparison(
        _per_sample_timing("baseline", baseline), _per_sample_timing(label, candidate), confidence=CONFIDENCE
    )


def baseline_accuracy(device: torch.device, cache_dir: str | None = None) -> float:
    """The naive baseline's validation accuracy from a full run, kept in ``cache_dir`` per machine and version."""
    key = hashlib.sha256(
        json.dumps(
            [
                asdict(NAIVE),
                asdict(COURSE_WORKLOAD),
                torch.__version__,
                device_name(device),
                torch.get_num_threads(),
                perflab.__version__,
            ]
        ).encode()
    ).hexdigest()[:16]
    path = Path(cache_dir, f"baseline-accuracy-{key}.json") if cache_dir else None
    if path and path.exists():
        return json.loads(path.read_text())["val_accuracy"]
    accuracy = train(NAIVE, COURSE_WORKLOAD, device=device, progress=False).val_accuracy
    if path:  # written whole, then renamed: a grading beside this one reads the whole file or none
        path.parent.mkdir(parents=True, exist_ok=True)
        written = path.with_suffix(f".{os.getpid()}.tmp")
        written.write_text(json.dumps({"val_accuracy": accuracy}))
        written.replace(path)
    return accuracy


def _refused(fields: dict, reason: str, device: torch.device) -> CapstoneGrade:
    """A fail decided before any measurement."""
    return CapstoneGrade(
        status="fail",
        reasons=(reason,),
        speedup=None,
        interval=None,
        baseline_samples_per_s=None,
        candidate_samples_per_s=None,
        baseline_accuracy=None,
        candidate_accuracy=None,
        config=fields,
        environment=Environment.capture(device),
    )


def measure_submission(
    config: TrainConfig,
    *,
    rounds: int = TRIAL_ROUNDS,
    device: str | torch.device | None = None,
    log=None,
    cache_dir: str | None = None,
) -> CapstoneGrade:
    """Grade ``config`` on the course's workload in this process: refusals, then speed, then accuracy.

    A measurement that leaves pass or fail open (its interval straddles ``MIN_SPEEDUP``, or other
    processes took CPU meanwhile: see :mod:`perflab.grading.verdict`) is repeated once with twice
    the rounds; if it still leaves it open the grade is ``inconclusive``, neither a pass nor a fail.
    """
    device = pick_device(device)
    if refusal(config):
        return _refused(asdict(config), refusal(config), device)
    for attempt_rounds in (rounds, 2 * rounds):
        (baseline, candidate), load = measure_speeds([NAIVE, config], rounds=attempt_rounds, device=device, log=log)
        comparison = speedup_of(baseline, candidate, config.name)
        problems = noise_problems(comparison, load, MIN_SPEEDUP)
        if not problems:
            break
        if log:
            log(
                f"too noisy to decide ({'; '.join(problems)})"
                + ("" if attempt_rounds > rounds else ": measuring again")
            )
    reasons = []
    if candidate[0].samples != baseline[0].samples:
        reasons.append(f"it trained on {candidate[0].samples} samples per epoch, the baseline on {baseline[0].samples}")
    if candidate[0].model_parameters != baseline[0].model_parameters:
        reasons.append(
            f"its model has {candidate[0].model_parameters:,} parameters, the course's {baseline[0].model_parameters:,}"
        )
    if comparison.speedup < MIN_SPEEDUP:
        reasons.append(f"its median speedup is {comparison.speedup:.2f}x, under the {MIN_SPEEDUP}x required")
    accuracies = (None, None)
    if not reasons and not problems:
        accuracies = (
            baseline_accuracy(device, cache_dir),
            train(config, COURSE_WORKLOAD, device=device, progress=False).val_accuracy,
        )
        if accuracies[1] < accuracies[0] - ACCURACY_TOLERANCE:
            reasons.append(
                f"its accuracy {accuracies[1]:.1%} is more than {ACCURACY_TOLERANCE:.0%} points "
                f"under the baseline's {accuracies[0]:.1%}"
            )
    status = "inconclusive" if problems else "fail" if reasons else "pass"
    return CapstoneGrade(
        status=status,
        reasons=tuple([INCONCLUSIVE, *problems] if problems else reasons),
        speedup=comparison.speedup,
        interval=comparison.interval,
        baseline_samples_per_s=_median_samples_per_s(baseline),
        candidate_samples_per_s=_median_samples_per_s(candidate),
        baseline_accuracy=accuracies[0],
        candidate_accuracy=accuracies[1],
        config=asdict(config),
        environment=Environment.capture(device),
    )


def grade(config: TrainConfig, *, timeout_s: float = 900) -> CapstoneGrade:
    """Re-measure ``config`` against the course's baseline, on the course's workload, in a fresh Python process.

    This is the learner's own check before handing in; what scores is the same measurement made
    by the course's grader during ``nbgrader autograde``, outside the notebook. The child runs
    with ``-I`` (no current folder on the path, no ``PYTHON*`` variables) and receives only the
    configuration's fields as JSON; its progress lines are relayed here as they come.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"grade() takes a TrainConfig, got {type(config).__name__}")
    child = subprocess.Popen(
        [sys.executable, "-I", "-m", "perflab", "grade-capstone"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child.stdin.write(json.dumps({"TrainConfig": asdict(config)}))
    child.stdin.close()
    other_output = []
    for line in child.stderr:  # progress, as the child measures
        if line.startswith("grader: "):
            print(line.rstrip(), flush=True)
        else:
            other_output.append(line)
    try:
        child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    output = child.stdout.read()
    if child.returncode != 0:
        raise RuntimeError(f"the grader's process failed (exit {child.returncode}):\n{''.join(other_output)[-3000:]}")
    fields = json.loads(output.strip().splitlines()[-1])
    fields["reasons"] = tuple(fields["reasons"])
    fields["interval"] = tuple(fields["interval"]) if fields["interval"] else None
    fields["environment"] = Environment.from_dict(fields["environment"])
    return CapstoneGrade(**fields)


def grade_from_stdin() -> None:
    """The child's side of :func:`grade`: a configuration as JSON on stdin, the grade as JSON on stdout."""
    answer = json.loads(sys.stdin.read())
    try:
        config = train_config(answer)
    except AnswerError as error:  # over a bound, say: refused here as the grader refuses it
        print(json.dumps(asdict(_refused(answer["TrainConfig"], str(error), pick_device()))))
        return
    grade = measure_submission(config, log=lambda line: print(f"grader: {line}", file=sys.stderr, flush=True))
    print(json.dumps(asdict(grade)))
