"""Sweep calibrators, their parameters and calibration-set sizes; judge whether the data suffice.

MODEL is an .onnx file or a zoo model name. Statistics are collected in ONE pass
over the largest calibration size, with a snapshot at every size (statistics are
mergeable, so the snapshot at n equals a collection over the first n samples);
every configuration (--methods x --percentiles x --calib-sizes) takes its scales
from its snapshot, and its INT8 Q/DQ model is evaluated on --eval in ONNX Runtime
(integer kernels) with the metric's paired bootstrap interval against FP32.
--data may be a calibration folder: its stats.npz serves the size equal to its
sample count and its data are re-read with the recorded preprocessing.

Data sufficiency, one sentence each: whether the calibration set is large enough
for the best configuration's method (every amax moves by less than --tolerance
from n/2 to n samples, or which tensors still move), and whether the evaluation
set tells the two best configurations apart (paired bootstrap of their difference).

The model is the one `quantlab calibrate` quantizes by default: depthwise-conv
inputs equalized first (from the largest calibration size's samples; one more FP32
pass), unless --no-equalize; a calibration folder's model.onnx is taken as it is.
The configurations differ in their activation scales alone: every one (and best/)
takes weight amax max |w| and no bias correction, as `quantlab calibrate --method M
--weight-amax max --no-bias-correction` does; calibrate's default weight choice and
bias correction then add to the chosen calibrator (a few passes each, not swept).

Statistics do not depend on the batch size (histograms of every element, merged
exactly), so the batch size is not swept.

Writes into --out: sweep.json (every configuration: metric, interval, delta vs FP32;
the sufficiency verdicts), amax_movement.csv (every tensor's amax at n/2 and n per
setting), report.html (metric vs method with intervals, metric vs calibration size,
the scales that have not converged) and best/ (a calibration folder of the best
configuration: `quantlab validate --from`, `plan --data` and `check --baseline`
read it). An interrupted sweep resumes from --out (snapshots and finished
configurations are checkpointed there) when the model, the data's content (hashed),
the preprocessing and the options are the same; otherwise it starts over. A sweep
estimated to take over an hour is refused unless --allow-long is given.

examples:
  quantlab sweep digits-cnn --data zoo --eval zoo --metric top1 --out runs/cnn-sweep
  quantlab sweep model.onnx --data runs/calib --eval images/ --calib-sizes 32 64 128 \\
      --methods entropy percentile --out runs/sweep
"""

from __future__ import annotations

import argparse

from quantlab.commands.options import (
    DATA_HELP,
    Number,
    add_data_arguments,
    add_metric_argument,
    open_share,
    percentile,
    positive_int,
)

HELP = "sweep calibrators x parameters x calibration sizes in one pass; data sufficiency"
EPILOG = DATA_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab sweep`."""
    from quantlab.choices import DEFAULT_EQUALIZATION, DEFAULTS_FROM, METHODS

    parser.add_argument("model", metavar="MODEL", help=".onnx file or zoo model name")
    parser.add_argument("--eval", required=True, metavar="EVAL",
                        help="held-out data every configuration is evaluated on (same formats "
                             "as --data; 'zoo': a zoo model's held-out split)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    add_metric_argument(parser, "sqnr", "with --eval zoo",
                        "what every configuration is scored by, against FP32: ")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), metavar="METHOD",
                        help=f"calibrators (default: all of {', '.join(METHODS)})")
    # Defaults of quantlab.experiments.sweep, filled in by quantlab.api.sweep_model (the parser does
    # not import NumPy).
    parser.add_argument("--percentiles", nargs="+", type=percentile, metavar="P",
                        help="percentiles of the percentile calibrator (default: 99.9 99.99 "
                             "99.999)")
    parser.add_argument("--calib-sizes", nargs="+", type=Number(int, 2), metavar="N",
                        help="calibration-set sizes, nested prefixes of --data (default: 16, 32, "
                             "64, ... and all the data)")
    parser.add_argument("--tolerance", type=open_share, metavar="SHARE",
                        help="an amax moving by less than this share from n/2 to n samples has "
                             "converged (default: 0.02)")
    parser.add_argument("--resamples", type=positive_int, default=200, metavar="B",
                        help="paired bootstrap resamples (default: %(default)s)")
    parser.add_argument("--no-equalize", action="store_true",
                        help="do not equalize conv inputs first (by default the model is "
                             "equalized as `quantlab calibrate` does, "
                             f"{DEFAULT_EQUALIZATION} from {DEFAULTS_FROM}, on the largest "
                             "calibration size's samples; one more FP32 pass)")
    parser.add_argument("--allow-long", action="store_true",
                        help="run a sweep estimated to take over an hour")
    parser.add_argument("--force", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_data_arguments(parser, data_help="calibration folder (stats.npz reused), calibration "
                                         "data (image folder, COCO .json, .npy or .npz), or "
                                         "'zoo' (a zoo model's calibration split)")


def sweep_options(args: argparse.Namespace):
    """The quantlab.api.SweepOptions the options give."""
    from quantlab.api import SweepOptions

    return SweepOptions(
        metric=args.metric, methods=tuple(args.methods),
        percentiles=tuple(args.percentiles) if args.percentiles else None,
        calib_sizes=tuple(args.calib_sizes) if args.calib_sizes else None,
        tolerance=args.tolerance, resamples=args.resamples, equalize=not args.no_equalize)


def run(args: argparse.Namespace) -> int:
    """Run the sweep and write its folder (quantlab.api.sweep_model)."""
    from quantlab.api import sweep_model
    from quantlab.commands.options import check_metric, data_options

    check_metric(args.metric, args.eval == "zoo",
                 "with a zoo model, pass --eval zoo (its held-out split)", args.model)
    outcome = sweep_model(args.model, args.data, args.eval, sweep_options(args), args.out,
                          data_options=data_options(args), force=args.force,
                          progress=not args.no_progress, allow_long=args.allow_long)
    for line in outcome.lines():
        print(line)
    return 0
