"""Command line: a thin layer over the Python API, one module per command in ``commands/``."""

from __future__ import annotations

import argparse
import errno
import importlib
import signal
import sys
import threading
import warnings

from quantlab import __version__
from quantlab.errors import QuantlabError

# Command name -> module in quantlab.commands exposing `HELP`, `add_arguments(parser)`, `run(args)`.
COMMANDS = {
    "demo": "demo",
    "calibrate": "calibrate",
    "validate": "validate",
    "zoo": "zoo",
    "plan": "plan",
    "build": "build",
    "doctor": "doctor",
    "sweep": "sweep",
    "check": "check",
    "report": "report",
    "compare": "compare",
}

DESCRIPTION = """\
quantlab: INT8 quantization and accuracy validation for TensorRT deployments.

Typical flow:
  quantlab demo                                    # every zoo model, end to end, with a report
  quantlab calibrate MODEL --data DATA --out DIR   # scales, Q/DQ model, TensorRT cache
  quantlab validate --onnx M.onnx --engine M.int8.onnx --data DATA --out DIR
Run `quantlab COMMAND --help` for the options of each command.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every available command."""
    parser = argparse.ArgumentParser(
        prog="quantlab",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"quantlab {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"quantlab.commands.{module_name}")
        sub = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `quantlab` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    warnings.showwarning = lambda message, *_args, **_kwargs: print(
        f"quantlab {args.command}: warning: {message}", file=sys.stderr
    )
    main_thread = threading.current_thread() is threading.main_thread()  # signals need it
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return int(args.run(args) or 0)
    except QuantlabError as exc:
        print(f"quantlab {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"quantlab {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"quantlab {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except OSError as exc:
        # Disk full, read-only, not a folder: errors of the machine, not bugs; the output
        # folder is left as it was (experiment.output_folder).
        print(f"quantlab {args.command}: error: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM (a CI timeout, `kill`): unwinds like Ctrl-C, so no partial output is left."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


# errno values that mean the path could not be written (others: it could not be read).
_WRITE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EROFS", "ENOSPC", "EDQUOT", "EFBIG", "EACCES", "EPERM",
                                      "ENOTDIR", "EISDIR", "EEXIST", "ENOTEMPTY", "EXDEV")
    if hasattr(errno, name)
)


def describe_os_error(exc: OSError) -> str:
    """One line for `exc`: ``cannot write PATH: reason`` (``cannot read`` for read errors)."""
    reason = exc.strerror or str(exc)
    if exc.filename is None:
        return f"cannot write the output: {reason}"
    verb = "write" if exc.errno in _WRITE_ERRNOS else "read"
    return f"cannot {verb} {exc.filename}: {reason}"


if __name__ == "__main__":
    sys.exit(main())
