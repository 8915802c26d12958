"""The course's recorded runs (results/): the reference CPU's recording of each lecture is of the lecture as it is."""

from perflab.record import RESULTS, chapter_path, chapters, recordings, source_sha256

# The machine whose recordings are kept current with every change of a lecture (CONTRIBUTING.md, "Record results").
# A GPU's recordings may lag behind: the website says so on their pages.
REFERENCE_CPU = "cpu-amd-epyc"


def _recorded_from_current_source(chapter: str) -> bool:
    current = source_sha256(chapter_path(chapter))
    return any(
        path.stem == REFERENCE_CPU and execution.source_sha256 == current
        for path, execution in recordings(chapter, RESULTS)
    )


def test_the_reference_cpu_recording_of_every_lecture_is_of_its_current_source():
    stale = [chapter for chapter in chapters() if not _recorded_from_current_source(chapter)]
    assert not stale, (
        f"{', '.join(stale)} changed since {REFERENCE_CPU} recorded them, or it never did: on that machine, "
        f"`python -m perflab record {' '.join(chapter[:2] for chapter in stale)}`"
    )
