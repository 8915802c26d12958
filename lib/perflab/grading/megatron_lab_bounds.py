"""What lab 11's ranks may send and hold: the formulas behind the grader's bounds, and behind the lab's own checks,
which take them through :mod:`perflab.grading.megatron_lab`, so that both say the same.

    >>> ring_all_reduce_bytes(payload=1000, world=4)     # (each rank, all ranks): each sends 2 (N-1)/N of it
    (1500, 6000)
    >>> sent_failures(Readings(None, (262_400, 9_000_000)), each=262_144, world=2, what="one forward", fewest=True)
    ["in one forward, ranks [1] wrote more than one all-reduce's 262,144 bytes"]

Used in: lab 11.
"""

from __future__ import annotations

from perflab.grading.rank_group import Readings

__all__ = ["SENT_BOUNDS", "SENT_SLACK", "TRAFFIC", "memory_limit", "ring_all_reduce_bytes", "sent_failures"]

# (tokens, hidden, ffn) of the MLP whose traffic (and, on 2 ranks, memory) is read from outside: one all-reduce of
# its tokens x hidden float32 output is 256 KiB, and a whole hidden x ffn weight, 16 MiB, stands out in a rank's peak.
TRAFFIC = {2: (64, 1024, 4096), 4: (64, 1024, 512)}
# Bytes sent over the formula's: never fewer, and TCP's headers and acknowledgements add 1% to 7% on the loopback, a
# rank's prints a little to what it wrote; one all-reduce too many doubles them.
SENT_BOUNDS = (0.95, 1.25)
SENT_SLACK = 64 << 10


def ring_all_reduce_bytes(payload: int, world: int) -> tuple[int, int]:
    """Bytes one rank, and all ranks together, send in a ring all-reduce of ``payload`` bytes: a reduce-scatter and an
    all-gather, each rank sending (N-1)/N of the payload in each. The ring is gloo's algorithm when none is asked for
    (``gloo/allreduce.cc`` in github.com/pytorch/gloo), and torch's gloo process group asks for none."""
    each = 2 * (world - 1) * payload // world
    return each, each * world


def memory_limit(hidden: int, ffn: int, world: int) -> tuple[int, int]:
    """(the bytes of one rank's blocks of both layers of an MLP and their gradients, the most its peak may grow by
    from before the answer's module runs to after one forward and backward of the MLP): the blocks, their gradients
    and 3/4 of one whole weight for the activations, the process group and the allocator, less than the whole
    weights kept for the backward would need.

    >>> [round(n / 2**20, 1) for n in memory_limit(1024, 4096, world=2)]     # MiB
    [32.0, 44.0]
    """
    blocks = 2 * (2 * hidden * ffn // world + ffn // world + hidden) * 4
    return blocks, blocks + 3 * hidden * ffn * 4 // 4


def sent_failures(readings: Readings, each: int, world: int, what: str, *, fewest: bool) -> list[str]:
    """What ``readings`` show outside SENT_BOUNDS of ``each`` bytes sent by each of ``world`` ranks (``each * world``
    through the loopback, when it was read), in ``what``; below them too when ``fewest``."""
    low, high = SENT_BOUNDS
    low = low if fewest else 0
    expected = "one all-reduce's" if fewest else "their all-reduces'"
    found = []
    together = each * world
    # The loopback carries every rank's bytes: SENT_SLACK a rank, as on each rank's writes.
    if (
        readings.loopback is not None
        and not low * together <= readings.loopback <= high * together + SENT_SLACK * world
    ):
        found.append(f"{world} ranks sent {readings.loopback:,} bytes in {what}, not {expected} {together:,}")
    written = readings.written[:world]
    short = [rank for rank, count in enumerate(written) if count < low * each]
    if short:
        found.append(f"in {what}, ranks {short} wrote less than {expected} {each:,} bytes")
    over = [rank for rank, count in enumerate(written) if count > high * each + SENT_SLACK]
    if over:
        found.append(f"in {what}, ranks {over} wrote more than {expected} {each:,} bytes")
    return found
