"""The ``perflab`` command: ``python -m perflab doctor`` (also installed as ``perflab doctor``)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perflab", description=__doc__.split(":")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_parser = commands.add_parser("doctor", help="measure what this machine can do and print a table to paste into a question")
    doctor_parser.add_argument("--device", help="device to check (default: cuda, then mps, then cpu)")
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from perflab.doctor import doctor

        print(doctor(args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
