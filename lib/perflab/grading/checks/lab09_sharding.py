"""Lab 09 (ZeRO-1 by hand), decided outside the learner's kernel: the learner's ZeRO1 trained under torchrun in the
sandboxed child, on data and weights drawn for each grading, against one process trained here.

    >>> from perflab.grading.checks.lab09_sharding import CHECKS, configurations
    >>> sorted(CHECKS)
    ['test_equivalence', 'test_sharded_state', 'test_uneven']
    >>> {name: (config["nproc"], config["optimizer"], config["seed"]) for name, config in configurations(3).items()}
    {'first': (2, 'adamw', 243), 'three_ranks': (3, 'sgd', 606), 'uneven': (2, 'sgd', 557)}
    >>> uneven = configurations(3)["uneven"]
    >>> parameters = (uneven["features"] + 3) * uneven["hidden"] + 2
    >>> parameters, parameters % 2   # never divides evenly between the two ranks
    (1073, 1)

Each configuration keeps the notebook's shape (ranks, optimizer, samples, steps) and draws from
the seed what an answer could be fitted to: the data's and the initial weights' seed, and for
``uneven`` its sizes too (an odd parameter count). The ranks run in the child, started with the
lab's own launcher (``perflab.distributed.launch``) inside the child's sandbox; they write their
weights and reports, which the probe hands back as data. The single-process reference runs here,
with the course's ``single_process_reference`` on the batches that ``DistributedSampler`` gives
each rank, computed here too: nothing the ranks report about what they trained on is trusted.

A torchrun job costs seconds, so a grading launches each configuration once: ``test_equivalence``
launches ``first`` and ``three_ranks`` (together) with its seed, and ``test_sharded_state`` reads
the sizes of those same runs, which do not depend on the seed (a configuration's sizes are fixed:
only its data and weights are drawn); it launches them itself only where no run is there.
``test_uneven`` launches ``uneven`` and decides both its weights and its sizes.

Used by perflab.grading.checks.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.data import DataLoader, DistributedSampler

from perflab.distributed import launch
from perflab.grading.checked import Check, differences

__all__ = ["ANSWERS", "CELLS", "CHECKS", "configurations", "rank_batches"]

CELLS = ("colab_setup", "setup", "problem", "zero1", "train_script", "machinery")
ANSWERS = ("zero1",)
# The notebook's configurations (CONFIGS in its machinery cell), but for what each grading draws.
SHAPES = {
    "first": dict(nproc=2, samples=256, features=16, hidden=64, epochs=2, batch_size=16, lr=0.01, optimizer="adamw"),
    "three_ranks": dict(
        nproc=3, samples=240, features=12, hidden=40, epochs=2, batch_size=10, lr=0.01, optimizer="sgd"
    ),
    "uneven": dict(nproc=2, samples=192, epochs=3, batch_size=8, lr=0.02, optimizer="sgd"),
}
TOLERANCE = 1e-4  # largest allowed |weight difference| to the single-process reference (the notebook's TOLERANCE)
LAUNCH_TIMEOUT_S = 120
SGD_HINT = "; SGD's step is proportional to the gradient: is yours the mean over the ranks?"
_RUNS = "_lab09_grader_runs"  # where the child keeps this grading's runs, in its namespace: {name: (seed, run)}


def configurations(seed: int) -> dict[str, dict]:
    """Each configuration of a grading: the notebook's shape, its data's and weights' seed drawn, and for ``uneven``
    an even number of features and an odd hidden width, so that its (features + 3) * hidden + 2 parameters are odd."""
    draw = random.Random(seed)
    configs = {name: {**shape, "seed": draw.randrange(1000)} for name, shape in SHAPES.items()}
    configs["uneven"].update(features=draw.choice((12, 14, 16, 18)), hidden=draw.randrange(41, 72, 2))
    return configs


def rank_batches(config: dict) -> list[list[list[int]]]:
    """The sample indices of each rank's batch at each step, as train_zero1.py's DistributedSampler deals them."""
    batches = []
    for rank in range(config["nproc"]):
        sampler = DistributedSampler(
            range(config["samples"]), num_replicas=config["nproc"], rank=rank, shuffle=True, seed=config["seed"]
        )
        steps = []
        for epoch in range(config["epochs"]):
            sampler.set_epoch(epoch)
            steps += [
                batch.tolist() for batch in DataLoader(range(config["samples"]), config["batch_size"], sampler=sampler)
            ]
        batches.append(steps)
    return batches


def _launch(namespace: dict, name: str, config: dict) -> dict:
    """Train ``config`` with the learner's ZeRO1 on its ranks (in the child); what the ranks saved, as data."""
    work = namespace["work"]
    out = work / "grader" / f"{name}-{config['seed']}"
    out.mkdir(parents=True, exist_ok=True)
    options = {key: value for key, value in config.items() if key != "nproc"}
    arguments = [f"--{option.replace('_', '-')}={value}" for option, value in options.items()]
    run = launch(work / "train_zero1.py", f"--out={out}", *arguments, nproc=config["nproc"], timeout_s=LAUNCH_TIMEOUT_S)
    if not run.ok:
        if run.root_cause and run.root_cause.error:
            return {"failed": run.status[:1500]}
        output = run.rank_outputs.get(run.root_cause.rank, "") if run.root_cause else run.console
        return {"failed": f"{run.status}\n" + "\n".join(output.strip().splitlines()[-8:])[-1500:]}
    reports = [json.loads((out / f"report_rank{rank}.json").read_text()) for rank in range(config["nproc"])]
    return {
        "steps": [report["steps"] for report in reports],
        "state_bytes": [int(report["state_bytes"]) for report in reports],
        "held_bytes": [int(report["held_bytes"]) for report in reports],
        "weights": [
            dict(torch.load(out / f"weights_rank{rank}.pt", map_location="cpu", weights_only=True))
            for rank in range(config["nproc"])
        ],
    }


def _runs(namespace: dict, names: tuple[str, ...], seed: int, *, any_seed: bool = False) -> dict[str, dict]:
    """The runs of ``names`` with the configurations of ``seed`` (``any_seed``: of whichever grading's seed launched
    them, for what does not depend on it), each launched once, those still missing together."""
    runs = namespace.setdefault(_RUNS, {})
    configs = configurations(seed)
    missing = [name for name in names if name not in runs or not (any_seed or runs[name][0] == seed)]
    with ThreadPoolExecutor(max_workers=max(1, len(missing))) as pool:
        launched = pool.map(lambda name: _launch(namespace, name, configs[name]), missing)
        runs.update((name, (seed, run)) for name, run in zip(missing, launched))
    return {name: runs[name][1] for name in names}


def _reference(reference: dict, config: dict) -> dict:
    """One process trained on each step's batches of all ranks together (the course's code), and the sizes that
    ZeRO-1 divides: the whole optimizer's state, and the parameters' bytes."""
    batches = rank_batches(config)
    weights, whole = reference["single_process_reference"](config, [{"steps": steps} for steps in batches])
    parameter_bytes = sum(weight.numel() * weight.element_size() for weight in weights.values())
    return {"steps": batches, "weights": dict(weights), "state_bytes": whole, "parameter_bytes": parameter_bytes}


def _equivalence_failures(name: str, config: dict, run: dict, want: dict) -> list[str]:
    failures = differences(run["steps"], want["steps"], what=f"{name}: each rank's batches")
    hint = SGD_HINT if config["optimizer"] == "sgd" else ""
    for rank, weights in enumerate(run["weights"]):
        found = differences(weights, want["weights"], what=f"{name}: rank {rank}'s weights", atol=TOLERANCE)
        failures += [f"{problem} against one process{hint}" for problem in found[:1]]
    return failures


def _state_failures(name: str, config: dict, run: dict, want: dict) -> list[str]:
    nproc, whole = config["nproc"], want["state_bytes"]
    shard = (2 * want["parameter_bytes"] + whole) / nproc  # 1/N of the parameters, of their gradients, of the state
    failures = []
    for rank, (share, kept) in enumerate(zip(run["state_bytes"], run["held_bytes"])):
        # A share may differ from 1/nproc by its padding and its step counter: a few bytes, well under 1%.
        if not abs(share - whole / nproc) <= 0.01 * whole:
            failures.append(
                f"{name}: the torch optimizers alive on rank {rank} hold {share} bytes of state, not about "
                f"1/{nproc} of {whole}"
            )
        if not kept <= 1.01 * shard:
            failures.append(
                f"{name}: rank {rank} holds {kept} bytes in tensors beyond the model and the data, more than its "
                f"shard's parameters, gradient and optimizer state ({shard:.0f}): clone the slices you keep, and "
                "keep step()'s buffers local"
            )
    if len(run["state_bytes"]) != nproc:
        failures.append(f"{name}: {len(run['state_bytes'])} ranks reported, expected {nproc}")
    return failures


def _decide(names: tuple[str, ...], *deciders):
    def decide(got: dict, want: dict, seed: int) -> list[str]:
        configs = configurations(seed)
        failures = []
        for name in names:
            try:
                if "failed" in got[name]:
                    failures.append(f"{name}: the job {got[name]['failed']}")
                    continue
                failures += [
                    failure for decide in deciders for failure in decide(name, configs[name], got[name], want[name])
                ]
            except (KeyError, TypeError, ValueError) as error:  # data the course's probe does not return
                failures.append(f"{name}: not the ranks' report that the course's code returns ({error!r:.200})")
        return failures

    return decide


TRAINED = ("first", "three_ranks")


def _trained_references(reference: dict, seed: int) -> dict:
    return {name: _reference(reference, configurations(seed)[name]) for name in TRAINED}


CHECKS = {
    "test_equivalence": Check(
        "ZeRO1 on 2 ranks (AdamW) and 3 (SGD), on data and weights drawn for this grading: every rank's weights "
        "against one process trained here on the same batches",
        lambda namespace, seed: _runs(namespace, TRAINED, seed),
        _decide(TRAINED, _equivalence_failures),
        needs=ANSWERS,
        expected=_trained_references,
    ),
    "test_sharded_state": Check(
        "the optimizer state of every torch optimizer alive on each rank, about 1/N of one over the whole model, "
        "and the tensors each rank holds beyond the model and the data, at most its shard's, on 2 and 3 ranks",
        lambda namespace, seed: _runs(namespace, TRAINED, seed, any_seed=True),
        _decide(TRAINED, _state_failures),
        needs=ANSWERS,
        expected=_trained_references,
    ),
    "test_uneven": Check(
        "ZeRO1 on 2 ranks (SGD) with an odd number of parameters drawn for this grading: every rank's weights against "
        "one process, and each rank's state and tensors",
        lambda namespace, seed: _runs(namespace, ("uneven",), seed),
        _decide(("uneven",), _equivalence_failures, _state_failures),
        needs=ANSWERS,
        expected=lambda reference, seed: {"uneven": _reference(reference, configurations(seed)["uneven"])},
    ),
}
