"""Regression gate for CI: check a model against a stored baseline folder.

MODEL_OR_DIR is a calibrate, sweep or plan folder (its model.onnx and
model.int8.onnx; a sweep's best configuration), or a model (.onnx file or zoo
name), which is then calibrated as the baseline was (its calibration.json: method,
parameters, preprocessing, frozen inputs) on the baseline's calibration data or
--data. The baseline (--baseline DIR, a calibrate, sweep or plan folder) and the
candidate are both evaluated now, on the same --eval data, with their real INT8
models in ONNX Runtime (integer kernels), each against its own FP32 model.

The check fails, exit status 1 with one paragraph saying why, when the candidate's
INT8 metric is lower than the baseline's by more than --max-drop (default 0: any
drop; the same model on the same data gives the same figure), when its output SQNR
is under --min-sqnr, or, for two plan folders, when its INT8 share of MACs is lower
than the baseline's.

examples:
  quantlab check runs/today --baseline runs/baseline --eval eval.npy --max-drop 0.5
  quantlab check model.onnx --baseline runs/baseline --eval images/ --metric agreement \\
      --max-drop 0.01 --min-sqnr 25
"""

from __future__ import annotations

import argparse

from quantlab.commands.options import (
    DATA_HELP,
    add_data_arguments,
    add_metric_argument,
    finite_float,
    nonnegative_float,
    positive_int,
)

HELP = "regression gate: fail when INT8 accuracy falls below a stored baseline's"
EPILOG = DATA_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab check`."""
    parser.add_argument("candidate", metavar="MODEL_OR_DIR",
                        help="calibrate / sweep / plan folder, or a model (.onnx or zoo name)")
    parser.add_argument("--baseline", required=True, metavar="DIR",
                        help="the stored calibrate, sweep or plan folder to hold the line of")
    parser.add_argument("--eval", required=True, metavar="EVAL",
                        help="evaluation data (same formats as --data; 'zoo': the zoo model's "
                             "held-out split, when MODEL_OR_DIR is a zoo name)")
    add_metric_argument(parser, "sqnr", "with --eval zoo",
                        "what baseline and candidate are scored by, against FP32: ")
    parser.add_argument("--max-drop", type=nonnegative_float, default=0.0, metavar="X",
                        help="largest allowed drop of the INT8 metric from the baseline's, in "
                             "its own units (default: %(default)s)")
    parser.add_argument("--min-sqnr", type=finite_float, metavar="DB",
                        help="lowest allowed output SQNR of the candidate's INT8 model vs its "
                             "FP32 model, in dB, as `plan --min-sqnr` measures it "
                             "(docs/metrics.md)")
    parser.add_argument("--resamples", type=positive_int, default=200, metavar="B",
                        help="paired bootstrap resamples of the reported intervals "
                             "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_data_arguments(parser, required=False,
                       data_help="calibration data for a MODEL candidate (default: the "
                                 "baseline's recorded calibration data; 'zoo': a zoo model's "
                                 "calibration split)")


def run(args: argparse.Namespace) -> int:
    """Evaluate baseline and candidate (quantlab.api.check_model); 0 when the candidate holds
    the line, else 1."""
    from quantlab.api import CheckOptions, check_model
    from quantlab.commands.options import check_metric, data_options

    check_metric(args.metric, args.eval == "zoo",
                 "pass --eval zoo with a zoo model name as MODEL_OR_DIR")
    outcome = check_model(args.candidate, args.baseline, args.eval,
                          CheckOptions(metric=args.metric, max_drop=args.max_drop,
                                       min_sqnr=args.min_sqnr, resamples=args.resamples),
                          data=args.data, data_options=data_options(args),
                          progress=not args.no_progress)
    print(outcome.verdict())
    return 0 if outcome.passed else 1
