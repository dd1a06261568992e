"""Plan a mixed-precision model: the most INT8 MACs whose accuracy stays inside a budget.

MODEL is an .onnx file or a zoo model name. Statistics come from --data: a
calibration folder written by `quantlab calibrate` (its stats.npz is reused and
its data re-read with the recorded preprocessing) or calibration data (collected
here). The planner seeds the plan with rules (TensorRT kernel limits, heads and
decode arithmetic, depthwise weight spread, outlier ranges, FP16 range), weighs
the --repairs asked for (the least noisy all-INT8 model is planned) and bias
correction of the INT8 ops (unless --no-bias-correction), measures
every unit's share of the output noise: its local INT8 and FP16 error in one
pass, then (when all-INT8 misses the budget) each unit alone in INT8 on a few of
the hardest calibration samples (run from a cut of the graph before the unit, fed
the tensors there) and a few randomized trials on all of them (each plan its own
Q/DQ model), checks that noise model on plans of the front
(a unit whose error a gate or softmax amplifies is found by halving and measured
alone), solves the INT8-share-vs-noise front (FP16 where the budget left holds it,
else FP32), and certifies the chosen plan on --eval with the real INT8 model
(integer kernels) and a paired bootstrap interval: a first plan aimed at the
budget, then one aimed where the spread measured near the budget still lets a plan
certify. When no plan with INT8 certifies, all-FP16 is evaluated (with
--high-precision fp16), then the FP32 model. Plans that do not depend on each
other (each unit alone, the plans of a check) run side by side, up to 4 ONNX
Runtime sessions at once on equal shares of the machine's cores.

Writes into --out: plan.json (every unit: precision, reason codes, evidence,
predicted contribution; the repairs weighed), model.onnx (FP32, normalized, repaired
when plan.json says so), model.int8.onnx (the plan's Q/DQ model, FP16 units as Cast
pairs, strongly typed for TensorRT 11), trtexec.txt (quantlab.engine.trtexec: TensorRT
10/11 strongly typed from model.int8.onnx), summary.json (certificate, evaluation
ledger, predicted front, seconds per step, the noise model's checks), report.html
(the front, the evaluations, a waterfall of the noise each pin removes, the
decisions). With --trt-version (TensorRT 8.x-10.x)
also calibration.cache without the pinned units' tensors (relabelled
EntropyCalibration2 copy calibration.trtexec.cache for trtexec when the method is
not entropy) and the implicit INT8 trtexec line with the plan's pins.

The trials and evaluations are checkpointed in --out as they finish:
run the same command again after an interruption and it resumes (statistics are
collected again unless --data is a calibration folder).

examples:
  quantlab plan digits-cnn --data calibration_data/digits/calibration.npy \\
      --eval zoo --min-sqnr 30 --out runs/cnn-plan
  quantlab plan shapes-det --data zoo --eval zoo --metric map --max-drop 0.01 \\
      --out runs/det-plan
  quantlab plan model.onnx --data runs/calib --eval images/ --metric mymetrics:f1 \\
      --max-drop 0.01 --out runs/plan
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

HELP = "choose INT8/FP16/FP32 per layer under an accuracy budget, certified on held-out data"
EPILOG = DATA_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab plan`."""
    from quantlab import choices
    from quantlab.choices import DEFAULT_METHOD, DEFAULT_PLAN_CALIBRATORS, DEFAULTS_FROM, METHODS

    parser.add_argument("model", metavar="MODEL", help=".onnx file or zoo model name")
    parser.add_argument("--eval", required=True, metavar="EVAL",
                        help="held-out data the plan is certified on (same formats as --data; "
                             "'zoo': a zoo model's held-out split, with its task metric)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    add_metric_argument(parser, "sqnr", "with --eval zoo",
                        "what the budget is on (certified with a paired bootstrap): ")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--max-drop", type=nonnegative_float, metavar="X",
                        help="largest allowed drop of the metric from FP32, in its own units")
    budget.add_argument("--min-sqnr", type=finite_float, metavar="DB",
                        help="lowest allowed output SQNR in dB (metric sqnr): -10 log10 of the "
                             "mean over float outputs of sum (int8 - fp32)^2 / sum fp32^2, each "
                             "sum over every element of every --eval sample (pooled); with one "
                             "output, the output SQNR `quantlab validate` reports "
                             "(docs/metrics.md)")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=METHODS,
                        help="calibrator of the tensors no unit quantizes (TensorRT <= 10 "
                             "cache ranges) and the starting scales (default: %(default)s, "
                             f"from {DEFAULTS_FROM}: calibrate's)")
    parser.add_argument("--calibrators", nargs="+", default=list(DEFAULT_PLAN_CALIBRATORS),
                        choices=METHODS, metavar="METHOD",
                        help="methods each unit chooses its input scales from, by local INT8 "
                             "error (a repair tried before pins; default: all of "
                             f"{', '.join(METHODS)}; give --method alone to keep one)")
    parser.add_argument("--repairs", nargs="*", default=list(choices.DEFAULT_PLAN_REPAIRS),
                        choices=choices.REPAIRS, metavar="REPAIR",
                        help="repairs weighed before pins: dw-equalize (per-channel "
                             "equalization of depthwise-conv inputs), pw-equalize (that and "
                             "1x1-conv inputs, as calibrate does), cle "
                             "(cross-layer equalization, data-free), smoothquant (activation "
                             "outliers into weights); each costs one calibration pass and one "
                             "pass on a batch; the one whose all-INT8 model is least noisy is "
                             f"planned (default: {' '.join(choices.DEFAULT_PLAN_REPAIRS)}, "
                             f"from {DEFAULTS_FROM}; calibrate applies "
                             f"{choices.DEFAULT_EQUALIZATION}, quieter in all-INT8 but of "
                             "smaller certified plans on a detector, as choices.py records; "
                             "none: --repairs with no name)")
    parser.add_argument("--no-bias-correction", dest="bias_correction", action="store_false",
                        help="do not weigh bias correction (by default each INT8 op's mean "
                             "output error is measured in one pass over the calibration data "
                             "and subtracted from its bias in the INT8 units of every plan, "
                             "when that lowers the all-INT8 noise on the hardest samples; it "
                             "lives in model.int8.onnx, not in model.onnx and the implicit "
                             "INT8 build from it)")
    parser.add_argument("--high-precision", default="fp16", choices=("fp16", "fp32"),
                        help="what non-INT8 units run in where the rules allow FP16 "
                             "(default: %(default)s)")
    parser.add_argument("--trials", type=positive_int, default=24, metavar="K",
                        help="randomized plans run on the hardest samples to fit each unit's "
                             "share of the output noise (default: %(default)s; where all-INT8's "
                             "evaluation puts the budget far below their noise, they stop "
                             "after a quarter once the fit predicts them, docs/planner.md); "
                             "up to 8 more "
                             "then check plans of the predicted front and refit, and about "
                             "2 log2(units) more localize a unit the fit under-predicts")
    parser.add_argument("--hard-samples", type=positive_int, default=64, metavar="N",
                        help="hardest calibration samples the passes run on (default: "
                             "%(default)s); with a label-free metric, an all-INT8 plan that "
                             "fails beyond doubt on the calibration samples (all of them for "
                             "sqnr, else a random draw of N) is not evaluated on --eval")
    parser.add_argument("--resamples", type=positive_int, default=200, metavar="B",
                        help="paired bootstrap resamples of the certificate (default: "
                             "%(default)s)")
    parser.add_argument("--trt-version", metavar="X.Y.Z",
                        help="also write calibration.cache (without the pinned units' tensors) "
                             "and the implicit trtexec line for this TensorRT's implicit INT8 "
                             "(8.x-10.x, the version that reads it); collects every float "
                             "tensor. Not needed for TensorRT 10/11 builds from "
                             "model.int8.onnx")
    parser.add_argument("--force", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_data_arguments(parser, data_help="calibration folder (stats.npz reused), calibration "
                                         "data (image folder, COCO .json, .npy or .npz), or "
                                         "'zoo' (a zoo model's calibration split)")


def plan_options(args: argparse.Namespace):
    """The quantlab.api.PlanOptions the options give."""
    from quantlab.api import PlanOptions
    from quantlab.planner.flow import PlanSettings

    return PlanOptions(
        PlanSettings(metric=args.metric, max_drop=args.max_drop, min_sqnr=args.min_sqnr,
                     trials=args.trials, hard_count=args.hard_samples,
                     high_precision=args.high_precision, resamples=args.resamples,
                     bias_correction=args.bias_correction),
        method=args.method, calibrators=tuple(args.calibrators), repairs=tuple(args.repairs),
        trt_version=args.trt_version)


def run(args: argparse.Namespace) -> int:
    """Plan, certify and write the plan's folder (quantlab.api.plan_model)."""
    from quantlab.api import plan_model
    from quantlab.commands.options import check_metric, data_options

    check_metric(args.metric, args.eval == "zoo",
                 "with a zoo model, pass --eval zoo (its held-out split)", args.model)
    outcome = plan_model(args.model, args.data, args.eval, plan_options(args), args.out,
                         data_options=data_options(args), force=args.force,
                         progress=not args.no_progress)
    for line in outcome.lines(notes=not args.no_progress):  # summary.json keeps the notes
        print(line)
    return 0 if outcome.certificate.certified else 1
