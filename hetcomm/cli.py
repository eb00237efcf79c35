"""The `hetcomm` command."""

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:
        # The reader went away (`hetcomm plan --list-devices | head`): what it wanted was
        # printed. Point stdout at /dev/null so that Python's flush at exit stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="hetcomm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, built back ends, kernels per op, devices (JSON)")
    commands.add_parser("demo", help="one simulated weighted gradient reduction, checked and timed",
                        add_help=False)
    commands.add_parser("train", help="train a GPT or Llama-style model across devices of different speeds "
                                      "(default: a simulated cluster of 4 CPU workers)", add_help=False)
    commands.add_parser("report", help="PNG plots of a run directory", add_help=False)
    commands.add_parser("plan", help="predict the split, precision, memory fit and speed of a mixed GPU cluster",
                        add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from hetcomm.demo import main as demo
        return demo(rest)
    if args.command == "train":
        from hetcomm.train.launch import main as train
        return train(rest)
    if args.command == "plan":
        from hetcomm.plan.cli import main as plan
        return plan(rest)
    if args.command == "report":
        from hetcomm.train.report import main as report
        return report(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "info":
        from hetcomm.info import info
        json.dump(info(), sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
