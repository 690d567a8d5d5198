"""The ``ferro`` command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ferro._version import __version__
from ferro.errors import DistributedError
from ferro.tools import doctor

__all__ = ["DELEGATED", "main"]


def _demo(args: argparse.Namespace) -> int:
    from ferro.tools.demo import launch

    return launch(size_mb=args.size_mb, round_trips=args.round_trips, exchanges=args.exchanges)


def _ckpt_inspect(args: argparse.Namespace) -> int:
    from ferro.checkpoint.tools import format_inspection, inspect

    print(format_inspection(inspect(args.path)))
    return 0


def _ckpt_consolidate(args: argparse.Namespace) -> int:
    from ferro.checkpoint.tools import consolidate

    print(f"wrote {consolidate(args.path, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``ferro`` command."""
    parser = argparse.ArgumentParser(prog="ferro", description="ferro: distributed training with a compiled core.")
    parser.add_argument("--version", action="version", version=f"ferro {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run", help="start a job's ranks on this node (torchrun-style); see `ferro run --help`",
                        add_help=False)
    commands.add_parser("bench", help="benchmark collectives, nccl-tests style; see `ferro bench --help`",
                        add_help=False)
    demo = commands.add_parser(
        "demo", help="run two ranks over TCP on this host: a small-message round trip and a bulk exchange")
    demo.add_argument("--size-mb", type=int, default=64, help="bytes exchanged each way, in MiB (default 64)")
    demo.add_argument("--round-trips", type=int, default=2000, help="round trips timed (default 2000)")
    demo.add_argument("--exchanges", type=int, default=5, help="bulk exchanges timed (default 5)")
    demo.set_defaults(handler=_demo)
    ckpt = commands.add_parser("ckpt", help="look into a checkpoint, or turn it into one safetensors file")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt_commands.add_parser("inspect", help="list a checkpoint's tensors, shapes, dtypes, sizes and files")
    inspect.add_argument("path", help="the checkpoint directory")
    inspect.set_defaults(handler=_ckpt_inspect)
    consolidate = ckpt_commands.add_parser(
        "consolidate", help="write every tensor, whole, into one safetensors file other tools load")
    consolidate.add_argument("path", help="the checkpoint directory")
    consolidate.add_argument("--out", required=True, help="the safetensors file to write")
    consolidate.set_defaults(handler=_ckpt_consolidate)
    doctor.add_parser(commands)
    return parser


#: Subcommands with parsers of their own: everything after the name is theirs (the reference pages read them too).
DELEGATED = {"run": "ferro.tools.run", "bench": "ferro.tools.bench.cli"}


def main(argv: list[str] | None = None) -> int:
    """Run the ``ferro`` command line and return its exit status."""
    try:
        return _dispatch(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:  # `ferro ckpt inspect ... | head`: the reader has what it wanted; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush of stdout cannot raise again
        return 128 + signal.SIGPIPE  # what a process killed by SIGPIPE reports, as `head`'s writers do


def _dispatch(arguments: list[str]) -> int:
    if arguments and arguments[0] in DELEGATED:
        import importlib

        return int(importlib.import_module(DELEGATED[arguments[0]]).main(arguments[1:]))
    args = build_parser().parse_args(arguments)
    try:
        return int(args.handler(args))
    except DistributedError as exc:  # a user's mistake or a damaged file: the message says which, no traceback
        print(f"ferro {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
