"""Check every TensorRT path quantlab builds, on this machine, and write a report to attach to
a bug report.

For each zoo model (--zoo, default digits-cnn and digits-vit) it calibrates a folder
under OUT, builds the engine of every path the installed TensorRT has -- strongly
typed from model.int8.onnx (TensorRT >= 9), explicit Q/DQ with INT8 on and implicit
INT8 from calibration.cache through quantlab's calibrator, through trtexec (where it
is on PATH) and with a plan's layers pinned (TensorRT <= 10) -- and compares each
engine with ONNX Runtime's INT8 model layer by layer and end to end. It then answers
what TensorRT's sources leave open: the Gemm-internal ranges of the implicit cache,
whether TensorRT rewrites a cache it read, which ConvTranspose weight axis TensorRT
runs right, and the cache header TensorRT writes. Writes OUT/doctor.json and
OUT/doctor.md; exits 1 when a path fails or disagrees with ONNX Runtime, and where
TensorRT is not installed (saying what to install).

examples:
  quantlab doctor
  quantlab doctor --out doctor-10.3 --zoo digits-cnn --zoo shapes-det
"""

from __future__ import annotations

import argparse

from quantlab.commands.options import positive_int

HELP = "self-check every TensorRT path on this machine; write a report for bug reports"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab doctor`."""
    parser.add_argument("--out", default="doctor", metavar="DIR",
                        help="folder for the calibrations, engines and reports "
                             "(default: %(default)s)")
    parser.add_argument("--zoo", action="append", metavar="NAME",
                        help="zoo model to check (repeatable; default: digits-cnn and "
                             "digits-vit)")
    parser.add_argument("--max-samples", type=positive_int, default=64, metavar="N",
                        help="evaluation samples per comparison (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run the self-check; 0 when every path agrees with ONNX Runtime."""
    from quantlab.doctor import DEFAULT_MODELS, format_report, run_doctor

    report = run_doctor(args.out, args.zoo or DEFAULT_MODELS, args.max_samples)
    print(format_report(report), end="")
    print(f"wrote {args.out}/doctor.json and {args.out}/doctor.md")
    return 0 if report["ok"] else 1
