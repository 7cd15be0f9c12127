"""The `autopar` command line. Each subcommand lives in its own module exposing
`add_parser(subparsers)`; heavy imports happen inside the handlers, so `--help` is instant."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from autopar import __version__
from autopar.atomic import check_output
from autopar.cli.train import modernize
from autopar.errors import AutoparError

# subcommands in the order `autopar --help` lists them; each lives in the module autopar.cli.<name>
# with dashes as underscores ("profile-cluster" -> autopar/cli/profile_cluster.py)
SUBCOMMANDS = ("search", "estimate", "memory", "explain", "export", "run", "train", "traces", "calibrate",
               "profile-cluster")


class OneLineParser(argparse.ArgumentParser):
    """A misused flag gets one line on stderr and exit code 2, as all bad input does (argparse prints the whole
    usage first); the line names where the usage is."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="autopar",
        description="Pick, explain and apply a parallel training plan for a PyTorch model.")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"autopar.cli.{name.replace('-', '_')}").add_parser(sub)
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _check_outputs(args) -> None:
    """Every file a command will write (-o, --trace) is checked before its work starts."""

    for attr, flag in (("output", "-o"), ("trace", "--trace")):
        value = getattr(args, attr, None)
        if isinstance(value, str):
            check_output(value, f"{flag}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # `autopar train --traces ...` and the like: the old form of a sub-command
        args = parser.parse_args(modernize(argv) if argv[:1] == ["train"] else argv)
        if threading.current_thread() is threading.main_thread():  # SIGTERM ends a command as Ctrl-C does
            signal.signal(signal.SIGTERM, _interrupt)
        _check_outputs(args)
        return args.func(args) or 0
    except AutoparError as e:
        print(f"autopar: error: {e}".replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
