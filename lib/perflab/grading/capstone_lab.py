"""Lab 12's measured cells, decided from the configurations the notebook handed in, on the course's workload.

    >>> from dataclasses import asdict
    >>> import torch
    >>> from perflab.grading.capstone_lab import grade_capstone_lab
    >>> from perflab.train import NAIVE
    >>> handed = {"test_regrade": {"final_config": {"TrainConfig": asdict(NAIVE)}}, "test_data": {}}
    >>> verdicts = grade_capstone_lab(handed, device=torch.device("cpu"))   # what each graded cell handed in
    >>> verdicts["test_regrade"]          # decided before anything is timed
    Verdict(fail: not measured; final_config is the naive baseline's own configuration: 1.00x, nothing to measure)
    >>> verdicts["test_data"]
    Verdict(fail: not measured; data_config was not handed in)

Answers that need a measurement are timed on the course's workload, in interleaved one-epoch
rounds and full runs for accuracy: minutes, during ``nbgrader autograde``.

Every configuration is timed in the same interleaved one-epoch rounds, so that each ratio below
is a per-round ratio of neighbours; accuracy comes from full runs, only for configurations whose
speed already passed. Nothing of the learner's notebook runs here: only its answers, as data.

Used by perflab.grading.session.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from perflab.bench import Comparison
from perflab.capstone import (
    ACCURACY_TOLERANCE,
    COURSE_WORKLOAD,
    MIN_SPEEDUP,
    TRIAL_ROUNDS,
    baseline_accuracy,
    measure_speeds,
    refusal,
    speedup_of,
)
from perflab.grading.answers import AnswerError, boolean, train_config
from perflab.grading.verdict import Verdict, noise_problems
from perflab.memory import saved_tensors
from perflab.train import NAIVE, TrainConfig, build_model, train

__all__ = ["AMP_MARGIN", "AMP_STEPS", "BATCH_SPEEDUP", "DATA_SPEEDUP", "HANDED_IN", "MAY_CHANGE", "grade_capstone_lab"]

# Part 2: decode once, no per-step syncs, same batch. The course's data_config measured 2.11x the baseline on a 2-core
# EPYC (90% CI 2.01x-2.35x), but 1.42x (1.36x-1.48x) with two thirds of one core's time for both threads (.ci/slowed's
# cgroup), probably because the decoding, on one thread, slows less there than the two-thread convolutions; and there,
# beside other gradings, 90% CI 1.26x-1.43x: inconclusive against a bar of 1.3x (torch 2.15.0, 2026-11-30). A
# configuration that changes nothing is refused before anything is timed (1.00x).
DATA_SPEEDUP = 1.2
BATCH_SPEEDUP = 1.2  # part 3: a larger batch over part 2's pipeline
AMP_STEPS = 12  # part 4 compares a few steps: a low-precision epoch takes minutes on a CPU without bf16 units
# Part 4: a difference within 25% either way is not worth a decision: an interval wholly inside it passes either
# answer, one across the bound the answer faces is inconclusive. The learner's kernel and the grader measure in
# different processes, and processes differ by more than one's interval says: on a 2-core EPYC with AVX512-BF16 (torch
# 2.14.1, 2026-11-28), 12 processes measured bf16 over float32 at medians of 0.96x-1.18x, one at [0.87x, 0.99x] and
# another at [1.16x, 1.25x]. With a 10% margin, an honest KEEP_AMP = False failed in CI.
AMP_MARGIN = 0.25
# What each graded cell hands in.
HANDED_IN = {
    "test_data": ("data_config",),
    "test_batch": ("batch_config", "data_config"),
    "test_amp": ("amp_config", "batch_config", "KEEP_AMP"),
    "test_ckpt": ("ckpt_config", "batch_config"),
    "test_regrade": ("final_config",),
}
# The fields a part's configuration may change of batch_config (its name aside): a part measures
# its one change, so a slower amp_config with KEEP_AMP = False cannot pass by other changes.
MAY_CHANGE = {"amp_config": ("amp_dtype",), "ckpt_config": ("checkpoint_blocks", "batch_size")}


def _key(config: TrainConfig) -> tuple:
    return tuple(value for name, value in asdict(config).items() if name != "name")


def _changed(config: TrainConfig, other: TrainConfig, allowed: tuple[str, ...] = ()) -> list[str]:
    """The fields, besides ``name`` and ``allowed``, in which ``config`` and ``other`` differ."""
    return [
        name
        for name, value in asdict(config).items()
        if name not in ("name", *allowed) and value != getattr(other, name)
    ]


def _configs(answers: dict, names: tuple[str, ...]) -> dict[str, TrainConfig]:
    configs = {}
    for name in names:
        if name not in answers:
            raise AnswerError(f"{name} was not handed in")
        if name.endswith("_config"):
            try:
                configs[name] = train_config(answers[name])
            except AnswerError as error:
                raise AnswerError(f"{name}: {error}") from None
            if refusal(configs[name]):
                raise AnswerError(f"{name}: {refusal(configs[name])}")
    return configs


def _one_change(configs: dict[str, TrainConfig]) -> None:
    """A part's configuration changes of batch_config only what that part measures."""
    for name, allowed in MAY_CHANGE.items():
        if name in configs and (changed := _changed(configs[name], configs["batch_config"], allowed)):
            raise AnswerError(
                f"{name} may differ from batch_config only in {' and '.join(allowed)}, "
                f"but it also changes {', '.join(changed)}"
            )


def _disagreements(configs: dict[str, dict[str, TrainConfig]]) -> dict[str, str]:
    """Why each cell is refused that hands in a configuration another cell hands in differently."""
    refusals: dict[str, str] = {}
    for name in dict.fromkeys(name for names in HANDED_IN.values() for name in names):
        holders = [cell for cell in HANDED_IN if name in configs.get(cell, {})]
        differences = [
            f"{holders[0]} and {cell} differ in {', '.join(changed)}"
            for cell in holders[1:]
            if (changed := _changed(configs[cell][name], configs[holders[0]][name]))
        ]
        if differences:
            reason = f"{name} must be one configuration in every cell that hands it in: {'; '.join(differences)}"
            refusals.update({cell: reason for cell in holders if cell not in refusals})
    return refusals


def _static_failures(cell: str, configs: dict[str, TrainConfig], answers: dict) -> list[str]:
    """What the configurations themselves get wrong, before anything is measured."""
    for name in ("data_config", "final_config"):
        if cell in ("test_data", "test_regrade") and name in configs and _key(configs[name]) == _key(NAIVE):
            return [f"{name} is the naive baseline's own configuration: 1.00x, nothing to measure"]
    if cell == "test_batch" and _key(configs["batch_config"]) == _key(configs["data_config"]):
        return ["batch_config is data_config: nothing changed"]
    if cell == "test_data" and configs["data_config"].batch_size != NAIVE.batch_size:
        return [f"data_config must keep the baseline's batch of {NAIVE.batch_size}: one change at a time"]
    if cell == "test_batch" and configs["batch_config"].batch_size < 64:
        return ["batch_config needs at least 64 samples per step"]
    if cell == "test_amp":
        boolean(answers["KEEP_AMP"], "KEEP_AMP")
        if configs["amp_config"].amp_dtype not in ("bfloat16", "float16"):
            return ["amp_config must use a low-precision dtype"]
    if cell == "test_ckpt":
        ckpt, batch = configs["ckpt_config"], configs["batch_config"]
        if not ckpt.checkpoint_blocks:
            return ["ckpt_config must turn checkpointing on"]
        if ckpt.batch_size < 2 * batch.batch_size:
            return [f"ckpt_config's batch {ckpt.batch_size} is not twice batch_config's {batch.batch_size}"]
    return []


def _verdict_for(error: Exception) -> Verdict:
    """The refusal of an answer found wrong, or "not scored" when grading the cell failed some other way."""
    if isinstance(error, AnswerError):
        return Verdict.refused(str(error))
    return Verdict.grading_failed(f"{type(error).__name__}: {error}")


def _safely(grade: Callable[..., Verdict], *args) -> Verdict:
    try:
        return grade(*args)
    except Exception as error:  # this cell's grading alone failed: the other cells keep their verdicts
        return _verdict_for(error)


def _checked(handed: dict[str, dict]) -> tuple[dict[str, Verdict], dict[str, dict[str, TrainConfig]]]:
    """Each cell's configurations, and a verdict for each cell refused before anything is measured."""
    verdicts: dict[str, Verdict] = {}
    configs: dict[str, dict[str, TrainConfig]] = {}
    for cell, answers in handed.items():
        try:
            if isinstance(answers, AnswerError):
                raise answers
            configs[cell] = _configs(answers, HANDED_IN[cell])
        except Exception as error:  # one cell's answers, right or wrong, never decide another cell's verdict
            verdicts[cell] = _verdict_for(error)
    # Against one another first: a cell refused for its own change still tells what it was handed.
    verdicts.update({cell: Verdict.refused(reason) for cell, reason in _disagreements(configs).items()})
    for cell in [cell for cell in configs if cell not in verdicts]:
        try:
            _one_change(configs[cell])
            if failures := _static_failures(cell, configs[cell], handed[cell]):
                verdicts[cell] = Verdict("fail", "not measured", tuple(failures))
        except Exception as error:
            verdicts[cell] = _verdict_for(error)
    return verdicts, configs


def _activation_megabytes(config: TrainConfig, device: torch.device) -> float:
    model = build_model(config, COURSE_WORKLOAD, device)
    images = torch.randn(config.batch_size, 3, 32, 32, device=device)
    with saved_tensors() as saved:
        loss = model(images).sum()  # noqa: F841 - kept alive to the end of the block, as its graph is
    return saved.bytes / 1e6


def _ratio_text(comparison, what: str) -> str:
    low, high = comparison.interval
    return f"{what}: {comparison.speedup:.2f}x median ({comparison.confidence:.0%} CI {low:.2f}x-{high:.2f}x)"


def grade_capstone_lab(
    handed: dict[str, dict],
    *,
    device: torch.device,
    log=print,
    cache_dir: str | None = None,
    rounds: int = TRIAL_ROUNDS,
) -> dict[str, Verdict]:
    """One verdict per graded cell of lab 12, from ``handed[cell]``: the answers that cell handed in.

    Every answer is checked, alone and against the other cells' answers, before anything is
    measured. A cell whose grading fails for any other reason is "not scored"; the other cells
    keep their verdicts.
    """
    verdicts, configs = _checked(handed)
    measured_cells = [cell for cell in configs if cell not in verdicts]
    timed_cells = [cell for cell in ("test_data", "test_batch", "test_regrade") if cell in measured_cells]
    if timed_cells:
        try:
            verdicts.update(
                _grade_timed(timed_cells, configs, device=device, log=log, cache_dir=cache_dir, rounds=rounds)
            )
        except Exception as error:  # their configurations share the rounds that failed: so does the failure
            verdicts.update(dict.fromkeys(timed_cells, _verdict_for(error)))
    if "test_amp" in measured_cells:
        keep_amp = handed["test_amp"]["KEEP_AMP"]
        verdicts["test_amp"] = _safely(_grade_amp, configs["test_amp"], keep_amp, device, log, rounds)
    if "test_ckpt" in measured_cells:
        verdicts["test_ckpt"] = _safely(_grade_ckpt, configs["test_ckpt"], device)
    return verdicts


def _grade_timed(timed_cells: list[str], configs: dict, *, device, log, cache_dir, rounds: int) -> dict[str, Verdict]:
    """Parts 2, 3 and 7: one set of interleaved epoch rounds over every configuration that needs a time.

    A cell whose first measurement leaves its verdict open is measured once more with twice the rounds, with only
    the configurations of the cells still open: a cell already decided keeps its first measurement.
    """
    threshold = {"test_data": DATA_SPEEDUP, "test_batch": BATCH_SPEEDUP, "test_regrade": MIN_SPEEDUP}

    def sides_of(cell: str) -> tuple[TrainConfig, TrainConfig, str]:
        """The baseline and the candidate of the cell's ratio, and the candidate's name."""
        if cell == "test_batch":
            return configs[cell]["data_config"], configs[cell]["batch_config"], "batch_config"
        name = "data_config" if cell == "test_data" else "final_config"
        return NAIVE, configs[cell][name], name

    # cell -> (its comparison, why that leaves its verdict open, the trials of every configuration timed with it)
    timings: dict[str, tuple[Comparison, list[str], dict]] = {}
    for attempt_rounds in (rounds, 2 * rounds):
        open_cells = [cell for cell in timed_cells if cell not in timings or timings[cell][1]]
        if not open_cells:
            break
        timed = []
        for cell in open_cells:
            timed += [config for config in sides_of(cell)[:2] if _key(config) not in map(_key, timed)]
        log(f"timing {len(timed)} configurations in {attempt_rounds} interleaved one-epoch rounds")
        trials, load = measure_speeds(timed, rounds=attempt_rounds, device=device, log=log)
        side = {_key(config): results for config, results in zip(timed, trials)}
        for cell in open_cells:
            baseline, candidate, name = sides_of(cell)
            comparison = speedup_of(side[_key(baseline)], side[_key(candidate)], name)
            timings[cell] = (comparison, noise_problems(comparison, load, threshold[cell]), side)
    accuracies: dict[tuple, float] = {}

    def decide(cell: str) -> Verdict:
        comparison, problems, side = timings[cell]
        if cell == "test_data":
            candidate = side[_key(configs[cell]["data_config"])]
            waits = [
                statistics.median(r.phase_shares["data_wait"] for r in results)
                for results in (side[_key(NAIVE)], candidate)
            ]
            failures = (
                [f"data_config is {comparison.speedup:.2f}x the baseline; at least {DATA_SPEEDUP}x expected"]
                if comparison.speedup < DATA_SPEEDUP
                else []
            )
            if waits[1] >= waits[0] / 2:
                failures.append(
                    f"waiting for data takes {waits[1]:.0%} of its time, the baseline's {waits[0]:.0%}: "
                    "it should at least halve"
                )
            measured = (
                _ratio_text(comparison, "data_config over the naive baseline")
                + f"; waiting for data {waits[0]:.0%} -> {waits[1]:.0%} of the training time"
            )
        elif cell == "test_batch":
            failures = (
                [f"batch_config is {comparison.speedup:.2f}x data_config; at least {BATCH_SPEEDUP}x expected"]
                if comparison.speedup < BATCH_SPEEDUP
                else []
            )
            measured = _ratio_text(comparison, "batch_config over data_config")
        else:
            failures = (
                [f"its median speedup is {comparison.speedup:.2f}x, under the {MIN_SPEEDUP}x required"]
                if comparison.speedup < MIN_SPEEDUP
                else []
            )
            measured = _ratio_text(
                comparison, "final_config over the naive baseline"
            ) + " ({:,.0f} -> {:,.0f} samples/s)".format(
                *(
                    statistics.median(r.samples_per_s for r in side[_key(c)])
                    for c in (NAIVE, configs[cell]["final_config"])
                )
            )
        if cell in ("test_batch", "test_regrade") and not failures and not problems:
            config = configs[cell]["batch_config" if cell == "test_batch" else "final_config"]
            if _key(config) not in accuracies:  # a final_config that is batch_config trains once
                accuracies[_key(config)] = train(config, COURSE_WORKLOAD, device=device, progress=False).val_accuracy
            accuracy, base = accuracies[_key(config)], baseline_accuracy(device, cache_dir)
            measured += f"; validation accuracy {accuracy:.1%}, the baseline's {base:.1%}"
            if accuracy < base - ACCURACY_TOLERANCE:
                failures.append(f"its accuracy is more than {ACCURACY_TOLERANCE:.0%} points under the baseline's")
        return Verdict.decide(measured, failures, problems)

    return {cell: _safely(decide, cell) for cell in timed_cells}


def _grade_ckpt(configs: dict[str, TrainConfig], device: torch.device) -> Verdict:
    ckpt, batch = (_activation_megabytes(configs[name], device) for name in ("ckpt_config", "batch_config"))
    measured = f"kept for backward: {ckpt:.1f} MB checkpointed, {batch:.1f} MB for batch_config"
    return Verdict.decide(measured, [] if ckpt < batch else ["the checkpointed, doubled batch keeps more"])


def _grade_amp(configs: dict[str, TrainConfig], keep_amp: bool, device, log, rounds: int) -> Verdict:
    amp, batch = configs["amp_config"], configs["batch_config"]
    for attempt_rounds in (rounds, 2 * rounds):
        log(f"timing amp_config against batch_config: {attempt_rounds} interleaved rounds of {AMP_STEPS} steps")
        (float32, low_precision), load = measure_speeds(
            [replace(batch, name="float32"), amp], rounds=attempt_rounds, device=device, log=log, max_steps=AMP_STEPS
        )
        comparison = speedup_of(float32, low_precision, amp.amp_dtype)
        # Only a clear difference decides against the answer: inside the margin either answer counts. KEEP_AMP = False
        # is wrong only above the margin, True only below it: that side's bound is what the interval must not straddle.
        problems = noise_problems(comparison, load, 1 - AMP_MARGIN if keep_amp else 1 + AMP_MARGIN)
        if not problems:
            break
    low, high = comparison.interval
    faster, slower = low > 1 + AMP_MARGIN, high < 1 - AMP_MARGIN
    failures = (
        ["it was measured faster: keep it"]
        if faster and not keep_amp
        else ["it was measured slower: leave it out"]
        if slower and keep_amp
        else []
    )
    return Verdict.decide(
        _ratio_text(comparison, f"{amp.amp_dtype} autocast over float32") + f"; KEEP_AMP = {keep_amp}",
        failures,
        problems,
    )
