"""The ``perflab`` command: ``python -m perflab doctor``, ``... grade``, ``... bench capstone|mfu|grader|grading``, ``... data``, ``... record`` or ``... site``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from perflab.capstone import BENCHMARK_ROUNDS

    parser = argparse.ArgumentParser(prog="python -m perflab", description=__doc__.split(":")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_parser = commands.add_parser(
        "doctor", help="measure what this machine can do and print a table to paste into a question"
    )
    doctor_parser.add_argument("--device", help="device to check (default: cuda, then mps, then cpu)")
    grade_parser = commands.add_parser(
        "grade",
        help="autograde every submission of a lab in parallel on Dask, merged into the course's gradebook",
        description="Run from the course's folder, after `nbgrader collect` (or with submitted/ filled as it fills it).",
    )
    grade_parser.add_argument("lab", help="the lab to grade, e.g. lab01_timing")
    grade_parser.add_argument("--students", nargs="+", metavar="STUDENT", help="only these students (default: all)")
    where = grade_parser.add_mutually_exclusive_group()
    where.add_argument(
        "--workers", type=int, default=2, help="worker processes of a Dask cluster on this machine (default 2)"
    )
    where.add_argument("--scheduler", metavar="tcp://HOST:PORT", help="an existing Dask cluster's scheduler")
    grade_parser.add_argument("--force", action="store_true", help="grade again what was graded before")
    grade_parser.add_argument(
        "--cell-timeout", type=int, metavar="S", help="seconds a cell may run (default: the course's Execute.timeout)"
    )
    grade_parser.add_argument(
        "--timeout", type=float, default=3600, metavar="S", help="seconds one grading may take (default 3600)"
    )
    grade_parser.add_argument(
        "--attempts", type=int, default=3, help="gradings of a submission whose measurement stays inconclusive"
    )
    grade_parser.add_argument("--course", type=Path, default=Path.cwd(), help="the course's folder (default: here)")
    bench_parser = commands.add_parser("bench", help="run one of the course's benchmarks and print its figures")
    bench_parser.add_argument(
        "name",
        choices=["capstone", "mfu", "grader", "grading"],
        help="capstone: naive baseline vs reference optimized pipeline vs compute ceiling; "
        "mfu: the course GPT's training MFU (low-precision autocast, torch.compile, SDPA) against two peaks; "
        "grader: the capstone grader's verdicts, quiet and beside CPU hogs; "
        "grading: a class graded serially vs on Dask",
    )
    bench_parser.add_argument(
        "--rounds",
        type=int,
        default=BENCHMARK_ROUNDS,
        help=f"capstone: interleaved one-epoch rounds (default {BENCHMARK_ROUNDS})",
    )
    bench_parser.add_argument(
        "--gradings", type=int, default=5, help="grader: gradings of each submission per condition (default 5)"
    )
    bench_parser.add_argument(
        "--hogs", type=int, default=2, help="grader: busy processes beside the grader (default 2)"
    )
    bench_parser.add_argument(
        "--autograde",
        type=int,
        default=0,
        metavar="N",
        help="grader: instead, N whole `nbgrader autograde` runs of lab 12's reference solution",
    )
    bench_parser.add_argument("--submissions", type=int, default=24, help="grading: submissions handed in (default 24)")
    bench_parser.add_argument("--workers", type=int, default=2, help="grading: Dask workers (default 2)")
    bench_parser.add_argument("--lab", default="lab01_timing", help="grading: an unmeasured lab (default lab01_timing)")
    bench_parser.add_argument("--device", help="device to run on (default: cuda, then mps, then cpu)")
    bench_parser.add_argument(
        "--json", type=Path, metavar="PATH", help="capstone, mfu: also write the figures to PATH as JSON"
    )
    commands.add_parser(
        "data", help="generate the course's datasets and their decode-once caches now, not at first use"
    )
    record_parser = commands.add_parser(
        "record",
        help="run a lecture top to bottom and save it, with where it ran, as results/<chapter>/<device>.ipynb",
    )
    record_parser.add_argument("chapter", nargs="+", help="a lecture by number (01), topic (gpu_basics) or 'all'")
    record_parser.add_argument("--results", type=Path, help="the folder to save into (default: the course's results/)")
    site_parser = commands.add_parser(
        "site", help="build the course's website: every lecture run (when changed), with its outputs"
    )
    site_parser.add_argument("--out", type=Path, help="the build folder (default: build/site)")
    # The capstone grader's isolated child process: a submission as JSON on stdin.
    commands.add_parser("grade-capstone")
    args = parser.parse_args(argv)

    if args.command == "grade":
        from perflab.grading.whole_class import grade_class

        try:
            result = grade_class(
                args.course,
                args.lab,
                students=args.students,
                workers=args.workers,
                scheduler=args.scheduler,
                force=args.force,
                cell_timeout_s=args.cell_timeout,
                timeout_s=args.timeout,
                attempts=args.attempts,
            )
        except KeyboardInterrupt:
            print("interrupted: what was merged stays graded; run the same command again to grade the rest")
            return 130
        print(result)
        return 0 if result.complete else 1
    if args.command == "doctor":
        from perflab.doctor import doctor

        print(doctor(args.device))
    elif args.command == "bench" and args.name == "grading":
        from perflab.grading.bench import grading_benchmark

        print(grading_benchmark(args.submissions, args.workers, args.lab))
    elif args.command == "bench" and args.name == "grader":
        from perflab.grading.bench import autograde_benchmark, noise_benchmark

        if args.autograde:
            autograde_benchmark(args.autograde)
        else:
            noise_benchmark(args.gradings, args.hogs)
    elif args.command == "bench" and args.name == "mfu":
        from perflab.training_mfu import measure_training_mfu

        result = measure_training_mfu(args.device)
        if args.json:
            args.json.write_text(result.to_json())
        print(result)
    elif args.command == "bench":
        from perflab.capstone import benchmark_capstone

        result = benchmark_capstone(rounds=args.rounds, device=args.device)
        if args.json:
            args.json.write_text(result.to_json())
        print(result)
    elif args.command == "data":
        from perflab.data import char_corpus, make_image_folder
        from perflab.pipeline import CachedImages

        images = make_image_folder()
        for split in (images.train, images.val):
            CachedImages(split)
        print(images)
        print(char_corpus())
    elif args.command == "record":
        from perflab.record import RESULTS, chapter_path, chapters, record

        names = chapters() if "all" in args.chapter else args.chapter
        try:
            for name in names:
                chapter_path(name)  # every name checked before the first lecture runs
        except ValueError as error:
            parser.exit(2, f"python -m perflab record: {error}\n")
        for name in names:
            print(f"recorded {record(name, results=args.results or RESULTS)}")
    elif args.command == "site":
        from perflab.site import BUILD, build_site

        site = build_site(args.out or BUILD)
        print(f"built {site}\nopen {site.index.resolve().as_uri()}")
    elif args.command == "grade-capstone":
        from perflab.capstone import grade_from_stdin

        grade_from_stdin()
    return 0


if __name__ == "__main__":
    sys.exit(main())
