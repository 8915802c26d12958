"""Lab 07 (DDP), decided outside the learner's kernel: the learner's script run on 2 ranks, on settings drawn here.

    >>> from perflab.grading.checks.lab07_ddp import CHECKS, drawn_config
    >>> sorted(CHECKS)
    ['test_equivalence', 'test_no_sync', 'test_rank0', 'test_sampling']
    >>> drawn_config(seed=3)    # fresh settings for every grading, each unlike the script's defaults
    {'samples': 126, 'epochs': 4, 'batch_size': 7, 'accumulate': 3, 'lr': 0.0675, 'seed': 68}

The probe launches the learner's ``train_ddp.py`` on ``RANKS`` ranks with torchrun, in the sandboxed
child, as the notebook's ``train_with_torchrun`` does (the lab's own ``launch``), on settings drawn
from the seed, and hands back what the ranks left, as data: why the job failed, if it did, each
rank's record, rank 0's checkpoint, the ``.pt`` files written and each rank's ``epoch`` lines. One
launch serves the four checks, as the notebook's one run serves its four test cells: a launch costs
seconds of torchrun and ranks importing torch. So each side, the child and this process, draws the
settings from the first seed it is handed in a grading, kept in that grading's namespace; every
value differs from the script's defaults, so a script that ignores an argument fails.

No launch runs here: what a right script must produce follows from the settings.
``DistributedSampler`` (shuffled, the settings' seed) fixes the samples of each rank's micro-batches,
and the lab's own ``single_process_reference``, run here on them, gives the weights and each step's
loss. The same on the samples of a script that forgets ``set_epoch`` (epoch 0's every epoch), so that
this mistake costs the sampling's points and not the others: weights and logged losses are compared
with the reference on whichever of the two samplings the ranks recorded. Any other sampling fails
them too, since nothing here trains on it.

Used by perflab.grading.checks.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from perflab.grading.checked import Check, differences

__all__ = ["ANSWERS", "CELLS", "CHECKS", "drawn_config"]

CELLS = ("colab_setup", "setup", "problem", "train_script", "machinery")
ANSWERS = ("train_script",)
LAUNCH_TIMEOUT_S = 150  # above the script's own 60 s collective timeout, and torchrun's start, on a slow machine
LOSS_TOLERANCE = 2e-4  # a logged mean loss, printed to 4 decimals, against the reference's
_GRADING = "__lab07_grading__"  # in each side's namespace: this grading's seed, and what was found on its settings
_OTHER_SAMPLES = (
    "the optimizer steps did not train on the samples DistributedSampler gives (shuffled, seed=args.seed, set_epoch "
    "every epoch), accumulate micro-batches of batch_size on each rank a step"
)
_RESULTS = {"config", "failure", "records", "weights", "checkpoints", "epoch lines"}


def drawn_config(seed: int) -> dict:
    """The script's settings: every step ``accumulate`` micro-batches of ``batch_size`` on each of the 2 ranks; none
    equal to its default (512 samples, 2 epochs, batch size 16, accumulate 2, lr 0.1, seed 0)."""
    draw = random.Random(seed)
    batch_size, accumulate, steps_per_epoch = draw.randint(4, 12), draw.randint(3, 4), draw.randint(2, 3)
    return {
        "samples": 2 * batch_size * accumulate * steps_per_epoch,  # 2: the lab's RANKS
        "epochs": draw.randint(3, 4),
        "batch_size": batch_size,
        "accumulate": accumulate,
        "lr": round(draw.uniform(0.03, 0.09), 4),
        "seed": draw.randrange(1, 1000),
    }


def _once_per_grading(namespace: dict, seed: int, compute):
    """``compute(drawn_config(first seed))``, once in ``namespace``'s grading: what it returned, or raised, again."""
    grading = namespace.setdefault(_GRADING, {"seed": seed})
    if "found" not in grading:
        try:
            grading["found"] = compute(drawn_config(grading["seed"]))
        except Exception as error:  # noqa: BLE001 - the learner's script may fail in any way: every check says so
            grading["found"] = error
    if isinstance(grading["found"], Exception):
        raise grading["found"]
    return grading["found"]


def _probe_ranks(namespace: dict, seed: int) -> dict:
    """What the ranks of the learner's script left, run as the notebook's ``train_with_torchrun`` does: as the only
    rank of a world of one first, in this process (a script that raises, or saves no record, fails there, with no job
    started), then on ``RANKS`` ranks with torchrun."""
    return _once_per_grading(namespace, seed, lambda config: _launched(namespace, config))


def _launched(namespace: dict, config: dict) -> dict:
    ranks = namespace["RANKS"]
    out = Path(tempfile.mkdtemp(prefix="grader-", dir=namespace["work"]))
    arguments = [f"--{option.replace('_', '-')}={value}" for option, value in config.items()]
    namespace["run_as_one_rank"](namespace["script"], f"--out={out}", *arguments)
    if not (out / "record_rank0.json").is_file():
        failure = "run as the only rank of a world of one, it saved no record: recorder.save(args.out)"
        return dict.fromkeys(_RESULTS) | {"config": config, "failure": failure}
    out = Path(tempfile.mkdtemp(prefix="grader-", dir=namespace["work"]))
    run = namespace["launch"](namespace["script"], f"--out={out}", *arguments, nproc=ranks, timeout_s=LAUNCH_TIMEOUT_S)
    failed_rank = run.root_cause.rank if run.root_cause else None
    last_lines = run.rank_outputs.get(failed_rank, run.console).rstrip().splitlines()[-12:]
    failure = None if run.ok else "\n".join([f"{run!r}", *last_lines])
    records = [out / f"record_rank{rank}.json" for rank in range(ranks)]
    checkpoint = out / "final.pt"
    weights = torch.load(checkpoint, map_location="cpu", weights_only=True) if checkpoint.is_file() else None
    return {
        "config": config,
        "failure": failure,
        "records": [json.loads(record.read_text()) if record.is_file() else None for record in records],
        "weights": dict(weights) if isinstance(weights, dict) else None if weights is None else type(weights).__name__,
        "checkpoints": sorted(path.name for path in out.iterdir() if path.suffix == ".pt"),
        "epoch lines": [
            [line for line in run.rank_outputs.get(rank, "").splitlines() if line.startswith("epoch ")]
            for rank in range(ranks)
        ],
    }


def _sampler_records(namespace: dict, config: dict, *, set_epoch: bool) -> list[dict]:
    """The records a right script's ranks write on ``config`` (all-reduces left out), with ``set_epoch`` each epoch
    or without it."""
    ranks = namespace["RANKS"]
    dataset = namespace["Clusters"](config["samples"], seed=config["seed"])
    micro_batches_per_epoch = config["samples"] // (ranks * config["batch_size"])
    records = []
    for rank in range(ranks):
        sampler = DistributedSampler(dataset, num_replicas=ranks, rank=rank, shuffle=True, seed=config["seed"])
        micro_batches = []
        for epoch in range(config["epochs"]):
            sampler.set_epoch(epoch if set_epoch else 0)
            order = list(sampler)
            for micro in range(micro_batches_per_epoch):
                step = (epoch * micro_batches_per_epoch + micro) // config["accumulate"]
                indices = order[micro * config["batch_size"] : (micro + 1) * config["batch_size"]]
                micro_batches.append({"epoch": epoch, "step": step, "indices": indices})
        records.append(
            {"rank": rank, "steps": len(micro_batches) // config["accumulate"], "micro_batches": micro_batches}
        )
    return records


def _expected(reference: dict, seed: int) -> dict:
    """Here, in one process, on this grading's settings: each step's samples, and the single-process reference's
    weights and step losses; with ``set_epoch`` and without."""
    return _once_per_grading(reference, seed, lambda config: _reference_runs(reference, config))


def _reference_runs(reference: dict, config: dict) -> dict:
    samplings = {}
    for name, set_epoch in (("set_epoch", True), ("no set_epoch", False)):
        records = _sampler_records(reference, config, set_epoch=set_epoch)
        weights, losses = reference["single_process_reference"](config, records)
        samplings[name] = {"steps": _samples_per_step(records), "weights": dict(weights), "losses": losses}
    return {"config": config, "ranks": reference["RANKS"], "tolerance": reference["TOLERANCE"], **samplings}


def _samples_per_step(records: list[dict]) -> list[list[int]]:
    """Each optimizer step's samples on all ranks together, in order of index."""
    steps: dict[int, list[int]] = {}
    for record in records:
        for micro_batch in record["micro_batches"]:
            steps.setdefault(micro_batch["step"], []).extend(micro_batch["indices"])
    return [sorted(steps[step]) for step in sorted(steps)]


def _is_int(value) -> bool:
    return type(value) is int


def _strings(value) -> bool:
    return type(value) is list and all(type(item) is str for item in value)


def _well_formed_record(record, rank: int) -> bool:
    """Whether ``record`` is what rank ``rank``'s ``Recorder`` saves."""
    if type(record) is not dict or record.get("rank") != rank or not _is_int(record.get("steps")):
        return False
    micro_batches = record.get("micro_batches")
    return type(micro_batches) is list and all(
        type(micro_batch) is dict
        and all(_is_int(micro_batch.get(key)) for key in ("epoch", "step", "all_reduces"))
        and type(micro_batch.get("indices")) is list
        and all(map(_is_int, micro_batch["indices"]))
        for micro_batch in micro_batches
    )


def _malformed(got, want: dict) -> list[str]:
    """Why the job's results cannot be checked: the job failed, or what it left is not what the lab's code writes."""
    if type(got) is not dict or set(got) != _RESULTS:
        return ["the grader's run of your script reported nothing it could read"]
    if got["config"] != want["config"]:
        return [f"the grader's run of your script was not on this grading's settings, {want['config']}"]
    ranks = want["ranks"]
    if got["failure"] is not None:
        return [f"the grader's run of your script failed: {str(got['failure'])[-2000:]}"]
    records = got["records"]
    if type(records) is not list or len(records) != ranks or None in records:
        return ["every rank must save its record: recorder.save(args.out)"]
    broken = [rank for rank, record in enumerate(records) if not _well_formed_record(record, rank)]
    if broken:
        return [f"rank {broken[0]}'s record is not the one its Recorder saves"]
    lines = got["epoch lines"]
    if not (_strings(got["checkpoints"]) and type(lines) is list and len(lines) == ranks and all(map(_strings, lines))):
        return ["the grader's run of your script reported nothing it could read"]
    return []


def _sampling_of(got: dict, want: dict) -> str | None:
    """Which sampling the ranks recorded, with set_epoch or without; None when neither."""
    steps = _samples_per_step(got["records"])
    return next((name for name in ("set_epoch", "no set_epoch") if steps == want[name]["steps"]), None)


def _decide_equivalence(got: dict, want: dict) -> list[str]:
    weights, sampling = got["weights"], _sampling_of(got, want)
    if type(weights) is not dict:
        return [f"rank 0 must save model.module.state_dict() to args.out / 'final.pt': found {weights or 'no file'}"]
    if sampling is None:
        return [f"{_OTHER_SAMPLES}: nothing to compare their weights with"]
    if set(weights) != set(want[sampling]["weights"]):
        return [f"save model.module.state_dict(), whose names have no 'module.' prefix; got {sorted(weights)}"]
    return differences(weights, want[sampling]["weights"], what="DDP's weights", atol=want["tolerance"])


def _shares(records: list[dict], epoch: int) -> list[list[int]]:
    """Each rank's samples of ``epoch``, in the order it trained on them."""
    return [
        [i for batch in record["micro_batches"] if batch["epoch"] == epoch for i in batch["indices"]]
        for record in records
    ]


def _decide_sampling(got: dict, want: dict) -> list[str]:
    config, failures, previous = want["config"], [], None
    for epoch in range(config["epochs"]):
        shares = _shares(got["records"], epoch)
        for rank, share in enumerate(shares):
            if len(share) != len(set(share)):
                failures.append(f"epoch {epoch}: rank {rank} saw a sample twice")
            elif len(share) != config["samples"] // want["ranks"]:
                failures.append(f"epoch {epoch}: rank {rank} saw {len(share)} of the {config['samples']} samples")
        seen = [set(share) for share in shares]
        if sum(map(len, seen)) != len(set().union(*seen)):
            failures.append(f"epoch {epoch}: the ranks trained on the same samples")
        if set().union(*seen) != set(range(config["samples"])):
            failures.append(f"epoch {epoch}: samples were left out, or are not the dataset's")
        for rank, share in enumerate(shares if previous else ()):
            if share == previous[rank]:
                failures.append(f"rank {rank}: epoch {epoch} repeated the order of epoch {epoch - 1}")
            if set(share) == set(previous[rank]):
                failures.append(f"rank {rank}: epoch {epoch} trained on the same share as epoch {epoch - 1}: set_epoch")
        previous = shares
    return failures


def _decide_no_sync(got: dict, want: dict) -> list[str]:
    config, failures = want["config"], []
    steps = config["samples"] // (want["ranks"] * config["batch_size"] * config["accumulate"]) * config["epochs"]
    for record in got["records"]:
        rank, by_step = record["rank"], {}
        for micro_batch in record["micro_batches"]:
            by_step.setdefault(micro_batch["step"], []).append(micro_batch["all_reduces"])
        if record["steps"] != steps or sorted(by_step) != list(range(steps)):
            failures.append(
                f"rank {rank} made {record['steps']} optimizer steps, numbered {sorted(by_step)[:20]}: expected {steps}"
            )
        for step, counts in by_step.items():
            if len(counts) != config["accumulate"] or any(counts[:-1]) or counts[-1] < 1:
                failures.append(
                    f"rank {rank}, step {step}: all-reduces per micro-batch {counts}: accumulate micro-batches, none "
                    "but the last all-reducing (no_sync around the others' forward and backward)"
                )
    return failures


def _decide_rank0(got: dict, want: dict) -> list[str]:
    config, failures, sampling = want["config"], [], _sampling_of(got, want)
    if sampling is None:
        return [f"{_OTHER_SAMPLES}: no loss to compare the log with"]
    losses, logged = want[sampling]["losses"], got["epoch lines"][0]
    per_epoch = len(losses) // config["epochs"]
    if len(logged) != config["epochs"]:
        failures.append(f"rank 0 printed {len(logged)} epoch lines, expected {config['epochs']}")
    for epoch, line in enumerate(logged[: config["epochs"]]):
        expected = sum(losses[epoch * per_epoch : (epoch + 1) * per_epoch]) / per_epoch
        value = line.removeprefix(f"epoch {epoch}: loss ")
        try:
            number = float(value) if value != line else None
        except ValueError:
            number = None
        if number is None:
            failures.append(f"write the line as f'epoch {{epoch}}: loss {{mean_loss:.4f}}', got {line[:80]!r}")
        elif not abs(number - expected) < LOSS_TOLERANCE:
            failures.append(f"epoch {epoch}: logged {value}, but the mean over all ranks' samples is {expected:.4f}")
    failures += [
        f"rank {rank} printed epoch lines: log on rank 0 only"
        for rank, lines in enumerate(got["epoch lines"])
        if rank and lines
    ]
    if got["checkpoints"] != ["final.pt"]:
        failures.append(f"only rank 0 saves a checkpoint, final.pt: found {got['checkpoints']}")
    return failures


def _check(description: str, decide) -> Check:
    """A check of what the grading's one launch left: whether the job ran and left what the lab's code writes, then
    ``decide(got, want)``, each failure on the grading's settings."""

    def decided(got, want: dict, seed: int) -> list[str]:
        failures = _malformed(got, want) or decide(got, want)
        return [f"on {want['config']}: {failures[0]}", *failures[1:]] if failures else []

    return Check(description, _probe_ranks, decided, needs=ANSWERS, expected=_expected)


CHECKS = {
    "test_equivalence": _check(
        "your script on 2 ranks, on settings drawn for this grading: rank 0's final.pt against the lab's "
        "single-process reference on the samples DistributedSampler gives",
        _decide_equivalence,
    ),
    "test_sampling": _check(
        "the samples each rank recorded, on settings drawn for this grading: disjoint shares, the whole dataset each "
        "epoch, a new order and a new split every epoch",
        _decide_sampling,
    ),
    "test_no_sync": _check(
        "the optimizer steps and DDP's all-reduces per micro-batch each rank recorded, on settings drawn for this "
        "grading: none but on the last micro-batch of each step",
        _decide_no_sync,
    ),
    "test_rank0": _check(
        "rank 0's epoch lines against the reference's mean losses, no epoch line on other ranks, and final.pt the "
        "only checkpoint, on settings drawn for this grading",
        _decide_rank0,
    ),
}
