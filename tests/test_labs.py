"""The nbgrader pipeline: labs/ is what the sources release, and every lab grades both ways."""

from __future__ import annotations

import csv
import filecmp
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import perflab
import pytest
from attacks import ATTACKS, FAILS, MEASURES_NOTHING, NEEDS_SANDBOX, build_attack, leak_probe_outputs
from nbgrader.api import Gradebook
from perflab.cpu_quota import usable_cores
from perflab.grading import DECIDED_OUTSIDE, MEASURED_CELLS
from perflab.grading.course import LAB_NAMES, REPO, NbgraderCourse
from perflab.grading.machine_lock import THREAD_CAPS
from perflab.grading.sandbox import bwrap_works
from perflab.grading.whole_class import _course_directory, _merge
from perflab.grading.working_copy import Graded, autograde_fields, read_folder

REGENERATE = "nbgrader generate_assignment {lab} --force   (or: make labs)"


def _notebook_content(path):
    notebook = nbformat.read(path, as_version=4)
    return [(cell.cell_type, cell.source, json.dumps(cell.metadata, sort_keys=True)) for cell in notebook.cells]


def test_there_are_labs():
    assert "lab01_timing" in LAB_NAMES


@pytest.mark.slow
@pytest.mark.parametrize("lab", LAB_NAMES)
def test_released_lab_matches_its_source(released_course, lab):
    fresh = released_course.root / "labs" / lab
    committed = REPO / "labs" / lab
    assert committed.is_dir(), f"labs/{lab} is missing: run {REGENERATE.format(lab=lab)}"
    fresh_files = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    committed_files = sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
    assert committed_files == fresh_files, (
        f"labs/{lab} holds other files than a release: run {REGENERATE.format(lab=lab)}"
    )
    for relative in fresh_files:
        if relative.suffix == ".ipynb":
            same = _notebook_content(fresh / relative) == _notebook_content(committed / relative)
        else:
            same = filecmp.cmp(fresh / relative, committed / relative, shallow=False)
        assert same, f"labs/{lab}/{relative} is stale: run {REGENERATE.format(lab=lab)}"


@pytest.mark.parametrize("lab", LAB_NAMES)
def test_release_holds_only_notebooks_and_declared_data(lab):
    for path in (REPO / "labs" / lab).rglob("*"):
        if path.is_file():
            relative = path.relative_to(REPO / "labs" / lab)
            assert path.suffix == ".ipynb" or relative.parts[0] == "data", (
                f"labs/{lab}/{relative} is neither a notebook nor declared data"
            )


@pytest.mark.slow
def test_helper_files_beside_a_source_never_reach_the_release(released_course, tmp_path):
    course = released_course.copy_to(tmp_path)
    source = course.root / "solutions" / "lab01_timing"
    (source / "reference_answers.py").write_text("ANSWER = 42\n")
    (source / "data").mkdir()
    (source / "data" / "measurements.csv").write_text("size,seconds\n1,0.5\n")
    release = course.release("lab01_timing")
    assert not (release / "reference_answers.py").exists()
    assert (release / "data" / "measurements.csv").read_text() == "size,seconds\n1,0.5\n"


def _errors(course: NbgraderCourse, lab: str) -> list[str]:
    """Each error the autograded reference solution shows, as "cell id: ExceptionName: message"."""
    return [
        f"{cell.metadata.get('nbgrader', {}).get('grade_id', '?')}: {output.ename}: {output.evalue}"
        for path in sorted((course.root / "autograded" / "solved" / lab).glob("*.ipynb"))
        for cell in nbformat.read(path, as_version=4).cells
        for output in cell.get("outputs", [])
        if output.output_type == "error"
    ]


def _measured_outputs(course: NbgraderCourse, student: str, lab: str) -> dict[str, str]:
    """Each measured cell's output in the autograded notebook, as text."""
    notebook = nbformat.read(course.root / "autograded" / student / lab / f"{lab}.ipynb", as_version=4)
    return {
        cell.metadata["nbgrader"]["grade_id"]: "\n".join(
            output.get("text", "") or "\n".join(output.get("traceback", [])) for output in cell.outputs
        )
        for cell in notebook.cells
        if cell.metadata.get("nbgrader", {}).get("grade_id") in DECIDED_OUTSIDE.get(lab, ())
    }


def _source_digests() -> dict[str, str]:
    """perflab's installed source and the environment's sitecustomize.py, to see that grading changed neither."""
    paths = sorted(Path(perflab.__file__).parent.rglob("*.py")) + [
        Path(sysconfig.get_paths()["purelib"]) / "sitecustomize.py"
    ]
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent" for path in paths}


def _attacks(lab: str, config) -> list[str]:
    """The attacks on ``lab`` this run hands in: none under ``--no-attacks`` (the compatibility tier's round trips)."""
    if config.getoption("no_attacks"):
        return []
    return [name for name in ATTACKS.get(lab, {}) if bwrap_works() or name not in NEEDS_SANDBOX]


_NOT_DECIDED = ("GraderInconclusive", "GraderError")  # what perflab grade grades again: noise, a grader that failed
_REGRADES = 3
_TIMESTAMPED_LOG = ["--Application.log_datefmt=%s", "--Application.log_format=%(asctime)s %(message)s"]


def _not_decided(course: NbgraderCourse) -> list[tuple[str, str]]:
    """The (lab, student) pairs whose autograded notebook shows an inconclusive measurement or a failed grading."""
    return sorted(
        (path.parent.name, path.parent.parent.name)
        for path in (course.root / "autograded").glob("*/*/*.ipynb")
        if any(name in path.read_text() for name in _NOT_DECIDED)
    )


def _grading_seconds(log: str) -> dict[tuple[str, str], float]:
    """Seconds each (lab, student) took in one nbgrader autograde run, from its timestamped log lines."""
    starts = [
        (int(match.group(1)), match.group(3), match.group(2))
        for match in re.finditer(r"^(\d+) Converting notebook .*/submitted/([^/]+)/([^/]+)/", log, re.M)
    ]
    if not starts:
        return {}
    ends = [start for start, *_ in starts[1:]] + [int(re.findall(r"^(\d+) ", log, re.M)[-1])]
    return {(lab, student): end - start for (start, lab, student), end in zip(starts, ends)}


# Seconds the gradings took here (build/grading-times.tsv, the round trip alone on a quiet machine, 2026-11-30): an
# unmeasured lab's submissions together, and each submission of a measured lab on its own. What is not listed counts
# as a long unmeasured lab or as an attack on a measured lab (most of them, at 10-60 s).
_GRADING_SECONDS = {
    "lab01_timing": 49,
    "lab04_amp": 36,
    "lab05_memory": 46,
    "lab07_ddp": 48,
    "lab08_attention": 35,
    "lab09_sharding": 132,
    "lab10_flash_triton": 141,
    "lab11_megatron": 78,
    ("lab02_profiling", "solved"): 43,
    ("lab02_profiling", "attack_patched_instruments"): 54,
    ("lab03_data_loading", "solved"): 45,
    ("lab03_data_loading", "attack_replayed_epochs"): 56,
    ("lab06_compile", "solved"): 74,
    ("lab06_compile", "attack_eager_with_hogs"): 49,
    ("lab06_compile", "attack_no_update"): 49,
    ("lab12_capstone", "solved"): 180,
    ("lab12_capstone", "attack_workload_reassigned"): 62,
    ("lab12_capstone", "attack_too_slow"): 40,
}


def _grading_seconds_expected(unit) -> int:
    return _GRADING_SECONDS.get(unit, 60 if isinstance(unit, str) else 20)


def _grading_bound(units) -> int:
    """Seconds an `nbgrader autograde` of ``units`` may take before the test stops it: room for a machine three
    times slower than the one the expected times were taken on, sharing its cores with the other tests. Each grading
    has its own limits (SandboxedExecute, TrustedMeasurement); this one only keeps a stuck command from holding CI."""
    return 600 + 4 * sum(_grading_seconds_expected(unit) for unit in units)


def _two_halves(work: list) -> tuple[set, set]:
    """``work``, labs graded whole and (lab, student) submissions, in two sets of about equal grading time: the
    longest first, each to the set that takes less so far."""
    halves, totals = (set(), set()), [0, 0]
    for unit in sorted(work, key=lambda unit: (-_grading_seconds_expected(unit), str(unit))):
        shorter = totals.index(min(totals))
        halves[shorter].add(unit)
        totals[shorter] += _grading_seconds_expected(unit)
    return halves


def _measuring_nothing(config) -> set[tuple[str, str]]:
    """The (lab, student) submissions of MEASURES_NOTHING handed in here."""
    handed_in = {lab: {"untouched", *(f"attack_{name}" for name in _attacks(lab, config))} for lab in MEASURES_NOTHING}
    return {
        (lab, student)
        for lab, students in MEASURES_NOTHING.items()
        for student in students
        if student in handed_in[lab]
    }


def _keep_only(course: NbgraderCourse, graded_here) -> None:
    """Remove every submission of ``course`` but those for which ``graded_here(lab, student)``."""
    for handed_in in sorted((course.root / "submitted").glob("*/*")):
        if not graded_here(handed_in.name, handed_in.parent.name):
            shutil.rmtree(handed_in)


def _autograde_all(course: NbgraderCourse, env: dict[str, str], timeout: int) -> dict[tuple[str, str], float]:
    """Every submission ``course`` holds, one `nbgrader autograde <lab>` per lab (about 4 s each to start), with ``env``
    added to their environment, all within ``timeout`` seconds; the seconds each submission took. A lab at a time, the
    trusted grader of its first notebook grades the next ones (perflab.grading.trusted_process), where
    `autograde "*"` would hand them over a student at a time. A command stopped at the bound leaves the seconds of what
    was graded (the last one's until it was stopped) in build/grading-times-stopped-<folder>.tsv, to show where the time
    went."""
    deadline, seconds, failed = time.monotonic() + timeout, {}, []
    for lab in sorted({path.name for path in (course.root / "submitted").glob("*/*")}):
        try:
            remaining = max(1, int(deadline - time.monotonic()))
            seconds.update(
                _grading_seconds(course.run("autograde", lab, "--force", *_TIMESTAMPED_LOG, timeout=remaining, env=env))
            )
        except AssertionError as error:  # nbgrader failed on this lab: grade the others, then say so
            failed.append(str(error)[-2000:])
        except subprocess.TimeoutExpired as stopped:
            log = stopped.stderr.decode(errors="replace") if isinstance(stopped.stderr, bytes) else stopped.stderr or ""
            seconds.update(_grading_seconds(log))
            lines = ["lab\tstudent\tseconds"] + [
                f"{lab}\t{student}\t{took:.0f}" for (lab, student), took in seconds.items()
            ]
            (REPO / "build").mkdir(exist_ok=True)
            (REPO / "build" / f"grading-times-stopped-{course.root.parent.name}.tsv").write_text(
                "\n".join(lines) + "\n"
            )
            raise
    assert not failed, "\n".join(failed)
    return seconds


def _a_half_s_threads() -> dict[str, str]:
    """The thread caps of one half's gradings, which run beside the other half's: half the cores (a quota's, where one
    serves fewer), or this process's caps where they are lower (an xdist worker's share, conftest.py). Uncapped, two
    kernels training at once each wait on the threads the other's took: run without xdist on a 2-core Xeon, the
    cells of lab 12's reference kernel took 181, 387 and 315 s that take 38, 19 and 10 s alone. A measurement is not
    capped: it has the machine alone, on every core (TrustedMeasurement)."""
    share = max(1, usable_cores() // 2)
    return {name: str(min(share, int(os.environ.get(name) or share))) for name in THREAD_CAPS}


def _merge_gradings(source: NbgraderCourse, course: NbgraderCourse, lab: str) -> None:
    """Every submission of ``lab`` autograded in ``source`` (a copy of ``course``), written into ``course``."""
    coursedir = _course_directory(course.root)
    for handed_in in sorted((source.root / "submitted").glob(f"*/{lab}")):
        student = handed_in.parent.name
        autograded = source.root / "autograded" / student / lab
        fields = autograde_fields(f"sqlite:///{source.root / 'gradebook.db'}", lab, student)
        status = "graded" if autograded.is_dir() else "failed"
        _merge(coursedir, lab, Graded(student, status, files=read_folder(autograded), gradebook=fields))


def _labs_to_grade(session) -> list[str]:
    """The labs whose round trip this run selected (``-k lab05``, the compatibility tier's marker), or every lab when
    another test that reads the graded course was selected too."""
    readers = [item for item in session.items if "graded_course" in getattr(item, "fixturenames", ())]
    if any(item.originalname != "test_grading_round_trip" for item in readers):
        return list(LAB_NAMES)
    selected = {item.callspec.params["lab"] for item in readers}
    return [lab for lab in LAB_NAMES if lab in selected]


@pytest.fixture(scope="module")
def graded_course(released_course, tmp_path_factory, request, machine):
    """Every lab's solution, untouched release and attacks handed in, then graded as an instructor would:
    `nbgrader autograde`, each submission whose measurement was inconclusive or whose grading failed graded
    again (as `perflab grade` does, up to 3 times), then `generate_feedback` (of the solutions and the leak
    attack) and `export`.

    The submissions are graded two at a time, as `perflab grade` on two workers would: each half in a copy of the
    course, merged back as its merge does (two autogrades on one gradebook would wait on each other). The machine is
    lent to the gradings: each kernel shares it with the other tests, and each trusted measurement has it alone."""
    folder = tmp_path_factory.mktemp("graded")
    course = released_course.copy_to(folder)
    labs = _labs_to_grade(request.session)
    for lab in labs:
        course.submit("solved", lab, files_from=course.root / "solutions" / lab)
        course.submit("untouched", lab, files_from=course.root / "labs" / lab)
        for name in _attacks(lab, request.config):
            course.submit_notebook(f"attack_{name}", lab, *build_attack(lab, name))
    halves = [course.copy_to(tmp_path_factory.mktemp(f"graded-half{number}")) for number in (1, 2)]
    # One cache of what the trusted grader measured once (the baseline's accuracy, verdicts), as `perflab grade`'s
    # workers share the course's (perflab.grading.working_copy): the halves are two workers of one class.
    (course.root / ".perflab-grading").mkdir(exist_ok=True)
    for half in halves:
        (half.root / ".perflab-grading").symlink_to(course.root / ".perflab-grading")
    handed_in = [(path.parent.name, path.name) for path in (course.root / "submitted").glob("*/*")]
    work = [lab for lab in labs if lab not in MEASURED_CELLS]
    work += sorted((lab, student) for student, lab in handed_in if lab in MEASURED_CELLS)
    split = _two_halves(work)
    for half, graded_there in zip(halves, split):
        _keep_only(half, lambda lab, student, there=graded_there: lab in there or (lab, student) in there)
    _keep_only(course, lambda lab, student: False)
    before = _source_digests()
    gradebook_mode = (course.root / "gradebook.db").stat().st_mode
    seconds = {}
    with machine.lent(), ThreadPoolExecutor(max_workers=2) as pool:
        bounds = [_grading_bound(graded_there) for graded_there in split]
        environment = {**_a_half_s_threads(), **machine.environment()}
        for graded_there in pool.map(lambda half, bound: _autograde_all(half, environment, bound), halves, bounds):
            seconds.update(graded_there)
    for half in halves:
        for lab in sorted({path.name for path in (half.root / "submitted").glob("*/*")}):
            _merge_gradings(half, course, lab)
    for _ in range(_REGRADES - 1):
        for lab, student in _not_decided(course):
            graded_in = next(half for half in halves if (half.root / "submitted" / student / lab).is_dir())
            with machine.alone():
                bound = _grading_bound([(lab, student) if lab in MEASURED_CELLS else lab])
                log = graded_in.run("autograde", lab, "--student", student, "--force", *_TIMESTAMPED_LOG, timeout=bound)
            seconds.update(_grading_seconds(log))
            _merge_gradings(graded_in, course, lab)
    # Feedback for the reference solutions and the leak only: the tests read no other, and each page costs an export.
    course.run("generate_feedback", "*", "--student", "solved", "--force")
    if "lab01_timing" in labs and "leak" in _attacks("lab01_timing", request.config):
        course.run("generate_feedback", "lab01_timing", "--student", "attack_leak", "--force", timeout=300)
    course.run("export", "--to", str(folder / "grades.csv"))
    _write_grading_times(course, seconds)
    return course, before, _source_digests(), folder / "grades.csv", gradebook_mode, halves


def _write_grading_times(course: NbgraderCourse, seconds: dict[tuple[str, str], float]) -> None:
    """What each submission scored and how long its (last) grading took, for the record: build/grading-times.tsv."""
    lines = ["lab\tstudent\tpoints\tmax\tseconds"]
    with Gradebook(f"sqlite:///{course.root / 'gradebook.db'}") as gradebook:
        for (lab, student), took in sorted(seconds.items()):
            submission = gradebook.find_submission(lab, student)
            lines.append(f"{lab}\t{student}\t{submission.score:g}\t{submission.max_score:g}\t{took:.0f}")
    (REPO / "build").mkdir(exist_ok=True)
    (REPO / "build" / "grading-times.tsv").write_text("\n".join(lines) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("lab", LAB_NAMES)
def test_grading_round_trip(graded_course, lab, pytestconfig):
    """The solution, the untouched release and every attack, autograded, with feedback and an export."""
    course, digests_before, digests_after, grades_csv, *_ = graded_course
    attacks = _attacks(lab, pytestconfig)
    assert digests_after == digests_before, "grading a submission changed perflab's source or the environment"

    with Gradebook(f"sqlite:///{course.root / 'gradebook.db'}") as gradebook:
        solved = gradebook.find_submission(lab, "solved")
        untouched = gradebook.find_submission(lab, "untouched")
        assert solved.max_code_score > 0, "the lab has no autograded points"
        lost = [
            f"{grade.name} {grade.score:g}/{grade.max_score:g}"
            for notebook in solved.notebooks
            for grade in notebook.grades
            if grade.cell.cell_type == "code" and grade.score < grade.max_score
        ]
        assert not lost, f"the reference solution must get every autograded point; lost: {lost}\n{_errors(course, lab)}"
        assert untouched.code_score == 0, "an untouched release must get no autograded point"
        assert solved.max_written_score > 0, "the lab needs at least one manually graded answer"
        scores = {"solved": solved.score}
        graded = {
            name: {
                grade.name: (grade.score, grade.max_score)
                for notebook in gradebook.find_submission(lab, f"attack_{name}").notebooks
                for grade in notebook.grades
                if grade.cell.cell_type == "code"
            }
            for name in attacks
        }
    # A measured lab's attacks score nothing on its measured cells; a wrong answer nothing on the cells that must
    # catch it, and full marks elsewhere: it is wrong only where it says.
    failing = {name: FAILS.get(lab, {}).get(name, DECIDED_OUTSIDE.get(lab, ())) for name in attacks}
    scored = {name: {cell: graded[name][cell][0] for cell in failing[name]} for name in attacks}
    assert all(score == 0 for scores in scored.values() for score in scores.values()), (
        f"an attack scored points it must not: {scored}"
    )
    short = {
        name: {cell: score for cell, (score, most) in graded[name].items() if score < most}
        for name in FAILS.get(lab, {})
        if name in attacks
    }
    assert all(set(lost) == set(failing[name]) for name, lost in short.items()), (
        f"a wrong answer lost points on other cells than those that must catch it: {short}"
    )

    assert not _errors(course, lab), f"the autograded solution raised {_errors(course, lab)}"
    for notebook_path in (course.root / "autograded" / "solved" / lab).glob("*.ipynb"):
        feedback = course.root / "feedback" / "solved" / lab / notebook_path.with_suffix(".html").name
        assert feedback.is_file(), f"no feedback for {notebook_path.name}"
        if lab in DECIDED_OUTSIDE:
            assert "Re-measured by the course" in feedback.read_text(), "the feedback shows what the grader measured"
    for cell, text in _measured_outputs(course, "solved", lab).items():
        assert text.startswith("Re-measured by the course's grader, outside your notebook: PASS"), f"{cell}: {text}"
    for student in sorted(student for graded_lab, student in _measuring_nothing(pytestconfig) if graded_lab == lab):
        measured = {
            cell: text
            for cell, text in _measured_outputs(course, student, lab).items()
            if cell in MEASURED_CELLS[lab] and "not measured" not in text
        }
        assert not measured, f"{student}'s answers must be refused before anything is timed, but were: {measured}"
    if lab == "lab12_capstone" and attacks:
        too_slow = _measured_outputs(course, "attack_too_slow", lab)["test_regrade"]
        assert "FAIL" in too_slow and "under the 2.0x required" in too_slow, too_slow
        another_task = _measured_outputs(course, "attack_workload_reassigned", lab)["test_regrade"]
        assert "FAIL" in another_task and "accuracy" in another_task, another_task
        unbounded = {
            cell: text
            for cell, text in _measured_outputs(course, "attack_unbounded", lab).items()
            if cell in MEASURED_CELLS[lab]
        }
        assert "num_workers=4096 is over the grader's bound" in unbounded["test_amp"], unbounded
        assert "over the grader's bound of 65,536 bytes" in unbounded["test_batch"], unbounded
        assert "accumulation_steps=1000000 is over the grader's bound" in unbounded["test_regrade"], unbounded
        assert all("not measured" in text and len(text) < 5000 for text in unbounded.values()), unbounded
        inconsistent = _measured_outputs(course, "attack_inconsistent", lab)
        assert all("not measured" in inconsistent[cell] for cell in ("test_batch", "test_amp", "test_ckpt"))
    if lab == "lab02_profiling" and attacks:
        huge = _measured_outputs(course, "attack_huge_message", lab)["test_preprocess_speed"]
        assert "FAIL" in huge and "ValueError" in huge and len(huge) < 5000, huge[:300]

    # nbgrader exports a row per student of the course and assignment; a student who handed nothing in scores 0.
    with open(grades_csv) as grades:
        rows = {row["student_id"]: row for row in csv.DictReader(grades) if row["assignment"] == lab}
    assert {"solved", "untouched", *(f"attack_{name}" for name in attacks)} <= set(rows)
    assert float(rows["solved"]["score"]) == scores["solved"] > 0 and float(rows["untouched"]["score"]) == 0


@pytest.mark.slow
@pytest.mark.skipif(not bwrap_works(), reason="the sandbox needs bubblewrap (apt-get install bubblewrap)")
def test_no_answer_reads_the_course_or_leads_out_of_its_folder(graded_course, pytestconfig):
    """Lab 01's leak attack: its kernel finds nothing of the course, and nbgrader follows none of its links."""
    course, *_, gradebook_mode, halves = graded_course
    lab = "lab01_timing"
    if "leak" not in _attacks(lab, pytestconfig):
        pytest.skip("--no-attacks: no attack was handed in")
    folders = [course.root / kind / "attack_leak" / lab for kind in ("autograded", "feedback")]
    printed = leak_probe_outputs(folders[0] / f"{lab}.ipynb")
    assert "leak probe found: []" in printed, printed
    handed_back = {path: path.read_bytes() for folder in folders for path in folder.rglob("*") if path.is_file()}
    assert any(path.suffix == ".html" for path in handed_back), "no feedback was generated"
    secrets = [b"SQLite format 3", b"/submitted/", *(str(c.root / "gradebook.db").encode() for c in (course, *halves))]
    secrets += [f"solutions/{other}".encode() for other in LAB_NAMES if other != lab]
    for path, content in handed_back.items():
        found = [secret.decode() for secret in secrets if secret in content]
        assert not found, f"{path.relative_to(course.root)} holds {found}"
    for folder in folders:
        for root, folders_here, files in os.walk(folder):
            for name in folders_here + files:
                mode = os.lstat(os.path.join(root, name)).st_mode
                assert stat.S_ISDIR(mode) or stat.S_ISREG(mode), f"{root}/{name} is a link or special file"
    assert (course.root / "gradebook.db").stat().st_mode == gradebook_mode, "grading changed the gradebook's mode"


@pytest.mark.slow
def test_a_link_handed_in_beside_the_notebook_brings_nothing_of_the_course(released_course, tmp_path):
    """nbgrader copies a hand-in's files following its links: what a link to the gradebook became is removed."""
    course, lab = released_course.copy_to(tmp_path), "lab01_timing"
    course.submit("linker", lab, files_from=course.root / "labs" / lab)
    (course.root / "submitted" / "linker" / lab / "notes.db").symlink_to("../../../gradebook.db")
    course.run("autograde", lab, "--force")
    course.run("generate_feedback", lab, "--student", "linker", "--force")
    handed_back = [
        path
        for kind in ("autograded", "feedback")
        for path in (course.root / kind / "linker" / lab).rglob("*")
        if path.is_file() or path.is_symlink()
    ]
    assert any(path.suffix == ".html" for path in handed_back), "no feedback was generated"
    assert not [path for path in handed_back if path.name == "notes.db" or b"SQLite format 3" in path.read_bytes()]
