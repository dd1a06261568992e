"""Run the zoo end to end: calibrate every model, validate and plan the one INT8 hurts.

For each model: export to ONNX, collect activation statistics once on its
calibration split (calibration_data/), compute scales with every calibration
method (entropy, max, percentile, mse), quantize to Q/DQ INT8 and evaluate
each in ONNX Runtime on the held-out split against FP32; the best method's
Q/DQ model, scales and statistics are written. shapes-det, which all-INT8
costs 11 points of mAP, is then validated layer by layer in local mode (its
first divergence and largest errors) and planned under a 1-point mAP budget
(`quantlab plan shapes-det --data zoo --eval zoo --metric map --max-drop 0.01`:
plan.json, the plan's Q/DQ model, trtexec.txt). The result is
reports/demo/report.html (self-contained; its first screen tells that story in
numbers) and reports/demo/summary.json.

examples:
  quantlab demo
  quantlab demo --models digits-cnn digits-vit --methods entropy max
  quantlab demo --out /tmp/demo --eval-limit 200
"""

from __future__ import annotations

import argparse

from quantlab.commands.options import positive_int

HELP = "calibrate the zoo, validate and plan shapes-det; write reports/demo/report.html"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab demo`."""
    from quantlab.choices import METHODS
    from quantlab.zoo_names import ZOO_NAMES

    parser.add_argument(
        "--out",
        default="reports/demo",
        help="output folder (default: %(default)s); the demo replaces its own earlier "
        "report.html, summary.json and model folders and nothing else; the same names in a "
        "folder of other results need --force",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=ZOO_NAMES,
        metavar="NAME",
        help=f"zoo models to run (default: all of {', '.join(ZOO_NAMES)})",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        metavar="METHOD",
        help=f"calibration methods to compare (default: all of {', '.join(METHODS)})",
    )
    parser.add_argument(
        "--eval-limit",
        type=positive_int,
        metavar="N",
        help="evaluate on the first N held-out samples only, and plan on the first N "
        "calibration and held-out samples (default: all)",
    )
    parser.add_argument(
        "--force", action="store_true",
        help="replace report.html, summary.json and model folders in --out that an earlier "
        "demo did not write (nothing else in --out is touched)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    """Run the demo and print where the report is."""
    from quantlab.demo import run_demo

    run_demo(
        args.out,
        args.models,
        args.methods,
        args.eval_limit,
        args.force,
        progress=not args.no_progress,
    )
    return 0
