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
pairs, strongly typed for TensorRT 11), trtexec.txt (quantlab.trtexec: TensorRT
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
import contextlib
from typing import NamedTuple

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
# summary.json's "generator": `quantlab build` reads the plan's batch from such a folder.
GENERATOR = "quantlab plan"
# The checkpoint of a running plan, left in --out when it is interrupted.
PROGRESS_FILE = ".plan-progress.json"
# quantlab.repairs applied to the FP32 model and weighed by the planner (bias correction, which
# changes the INT8 ops alone, is weighed on its own: --no-bias-correction).
REPAIRS = ("dw-equalize", "pw-equalize", "cle", "smoothquant")
DEFAULT_REPAIRS = ["dw-equalize"]
# Where a plan that scored inside the budget but could not be certified is written, beside
# the certified one (its plan.json and model.int8.onnx; model.onnx is the folder's).
UNCERTIFIED = "uncertified"
PLAN_FILES = ("plan.json", "model.onnx", "model.int8.onnx", "calibration.cache",
              "calibration.trtexec.cache", "trtexec.txt", "summary.json", "report.html",
              UNCERTIFIED)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab plan`."""
    from quantlab.choices import DEFAULT_METHOD, DEFAULTS_FROM, METHODS

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
    parser.add_argument("--calibrators", nargs="+", default=list(METHODS), choices=METHODS,
                        metavar="METHOD",
                        help="methods each unit chooses its input scales from, by local INT8 "
                             "error (a repair tried before pins; default: all of "
                             f"{', '.join(METHODS)}; give --method alone to keep one)")
    parser.add_argument("--repairs", nargs="*", default=DEFAULT_REPAIRS, choices=REPAIRS,
                        metavar="REPAIR",
                        help="repairs weighed before pins: dw-equalize (per-channel "
                             "equalization of depthwise-conv inputs), pw-equalize (that and "
                             "1x1-conv inputs, as calibrate does), cle "
                             "(cross-layer equalization, data-free), smoothquant (activation "
                             "outliers into weights); each costs one calibration pass and one "
                             "pass on a batch; the one whose all-INT8 model is least noisy is "
                             "planned (default: %(default)s; none: --repairs with no name)")
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


def _recorded(args) -> dict | None:
    """``calibration.json`` of --data when it is a calibration folder (with ``stats.npz``),
    read and checked by :func:`quantlab.commands.options.read_calibration_record`."""
    from pathlib import Path

    from quantlab.commands.options import read_calibration_record

    folder = Path(args.data)
    if (folder / "stats.npz").is_file() and (folder / "calibration.json").is_file():
        return read_calibration_record(folder)
    return None


def _equalized_by_calibrate(args) -> list:
    """The inputs `quantlab calibrate` equalized in the --data folder's model.onnx (its
    calibration.json), or [] when --data is no calibration folder."""
    recorded = _recorded(args)
    repairs = (recorded or {}).get("repairs") or {}
    return (repairs.get("depthwise_equalization") or {}).get("applied") or []


def _check_overrides(args, recorded, preprocess) -> None:
    """Refuse preprocessing options that contradict the calibration folder whose statistics
    are reused: stats.npz holds tensors of images read the recorded way, while the
    calibration and evaluation images would be read the new way."""
    from pathlib import Path

    from quantlab.commands.options import PREPROCESS_OPTIONS
    from quantlab.errors import ConfigError

    data = Path(recorded["data"])
    if recorded["preprocess"] is None or not (data.is_dir() or data.suffix.lower() == ".json"):
        return  # arrays (.npy, .npz) are not preprocessed
    before, after = recorded["preprocess"].to_dict(), preprocess.to_dict()
    changed = [f"{PREPROCESS_OPTIONS[k]} {after[k]} (recorded: {before[k]})"
               for k in before if before[k] != after[k]]
    if changed:
        raise ConfigError(
            f"{', '.join(changed)} contradicts the preprocessing {args.data}/stats.npz was "
            f"collected with ({args.data}/calibration.json): its statistics would not match "
            "the images read now. Drop the option to plan with the recorded preprocessing, or "
            f"pass the calibration data itself ({data}) with --data to collect statistics "
            "with the new one.")


def _calibration(args, model, recorded, preprocess):
    """(calibration BatchSource, Statistics or None) from --data (`recorded`: its
    calibration.json when it is a calibration folder)."""
    from pathlib import Path

    from quantlab import collect, graph
    from quantlab.data import data_files, files_stamp, open_data
    from quantlab.errors import DataError

    inputs = graph.input_specs(model)
    if args.data == "zoo":
        from quantlab import zoo

        return open_data(zoo.get(args.model).calibration_set(), inputs, args.batch_size,
                         args.max_samples), None
    if recorded is not None:
        if not Path(recorded["data"]).exists():
            raise DataError(f"{args.data}/calibration.json names data {recorded['data']}, which "
                            "no longer exists; pass the calibration data itself with --data.")
        if recorded["data_stamp"] not in (None, files_stamp(data_files(recorded["data"]))):
            raise DataError(
                f"{recorded['data']} changed since `quantlab calibrate` collected "
                f"{args.data}/stats.npz from it (a file's size or modification time differs, or "
                "files were added or removed), so those statistics no longer describe it. "
                "Calibrate again, or pass the data itself with --data to collect them here.")
        source = open_data(recorded["data"], inputs, args.batch_size, args.max_samples,
                           preprocess)
        unchanged = " (unchanged since)" if recorded["data_stamp"] else ""
        # Shared with sweep: each command's lines start with its own name.
        print(f"{getattr(args, 'command', None) or 'plan'}: reusing {args.data}/stats.npz, "
              f"collected from {recorded['data']}"
              f"{unchanged} with its recorded preprocessing.")
        return source, collect.Statistics.load(Path(args.data) / "stats.npz")
    return open_data(args.data, inputs, args.batch_size, args.max_samples, preprocess), None


def _check_eval_shapes(model, evaluation, args) -> None:
    """Refuse evaluation data whose dynamic dimensions (image size, audio length) differ
    from the calibration data's: the plan would be certified on shapes that trtexec.txt's
    TensorRT profile (the calibration data's, graph.record_data_shapes) does not build."""
    import numpy as np

    from quantlab import graph
    from quantlab.errors import DataError

    recorded = graph.data_shapes(model)
    if not recorded:
        return
    batch = next(iter(evaluation))
    for name, shape in recorded.items():
        fed = [None if d is None else int(e) for d, e in zip(shape, np.shape(batch[name]),
                                                             strict=True)]
        if fed != shape:
            raise DataError(
                f"--eval {args.eval} feeds input '{name}' samples of shape {fed} (None: the "
                f"sample axis), but the calibration data {shape}: trtexec.txt's TensorRT "
                "profile takes the calibration data's shape, so the plan would be certified "
                "on shapes the engine is not built for. Pass evaluation data of the "
                "calibration data's shape (--resize H W for images).")


def _prepared(args, recorded):
    """The normalized model, fed as the calibration data say: the 0-d arrays of an ``.npz``
    (``sr``) frozen as `quantlab calibrate` freezes them, or a calibration folder's
    (`recorded`) frozen inputs and sample axes; --input and --batch-axis on top. Refused
    when --eval holds another value for a frozen input (the model would silently run on
    this one)."""
    from pathlib import Path

    import numpy as np

    from quantlab import graph
    from quantlab.commands.options import input_options
    from quantlab.data import scalar_arrays
    from quantlab.errors import ConfigError, DataError
    from quantlab.pipeline import prepare_model

    options, data, source = input_options(args), args.data, args.model
    if recorded is not None:
        data = None
        # The folder's statistics belong to its model.onnx (repaired as calibration.json says).
        source = Path(args.data) / "model.onnx"
        for key, field, option in (("constants", "frozen_inputs", "--input"),
                                   ("batch_axes", "sample_axes", "--batch-axis")):
            for name, value in options[key].items():  # stats.npz was collected the recorded way
                if name in recorded[field] and not np.array_equal(value, recorded[field][name]):
                    raise ConfigError(
                        f"{option} {name}={value} contradicts {args.data}/calibration.json "
                        f"({name}={recorded[field][name]}), with which its stats.npz was "
                        "collected. Drop the option, or pass the calibration data itself with "
                        "--data to collect statistics here.")
            options[key] = {**recorded[field], **options[key]}
    model = prepare_model(source, None if data == "zoo" else data, **options)
    if recorded is not None:
        check_same_model(model, args.model, f"--data {args.data}")
    frozen = graph.frozen_inputs(model)
    for name, value in scalar_arrays(args.eval).items():
        if name in frozen and not np.array_equal(value, frozen[name]):
            raise DataError(f"{args.eval} holds {name}={value.tolist()}, but the model is "
                            f"calibrated with input '{name}' frozen to {frozen[name]}; plan on "
                            f"evaluation data of the same {name}.")
    return model


def check_same_model(model, given: str, where: str) -> None:
    """ConfigError unless `model` (a folder's model.onnx) was made from the model `given`
    (file or zoo name), compared by content digest (pipeline.model_digest)."""
    from quantlab import graph
    from quantlab.errors import ConfigError
    from quantlab.pipeline import model_digest

    if graph.source_digest(model) != model_digest(given):
        raise ConfigError(
            f"{where} holds another model than {given}: it was made from "
            f"{graph.source_model(model) or 'a model of unknown origin'} (content digest "
            f"{graph.source_digest(model) or 'not recorded'}, {given}'s is "
            f"{model_digest(given)}). Pass that folder's model, or calibration data of {given}.")


def _needed_tensors(model, implicit: bool) -> list[str]:
    """Tensors the planner needs statistics of: the Q/DQ inputs, the linear ops' float outputs
    (the FP16 range rule reads them) and, for a calibration cache (`implicit`), every float
    tensor TensorRT <= 10's implicit INT8 needs a range for."""
    from quantlab import qdq, trt_ranges

    index = qdq.indexed(model)
    wanted = set(trt_ranges.tensors_to_calibrate(index) if implicit
                 else qdq.activation_tensors_to_calibrate(index))
    wanted.update(out for node in index.model.graph.node if node.op_type in qdq.LINEAR_OPS
                  for out in node.output if out in index.floats)
    return [name for name in index.order if name in wanted]


def _statistics(model, source, stats, args, repaired: bool = False, channels=()):
    """Statistics of every tensor :func:`_needed_tensors` lists: `stats` (reused from a
    calibration folder, or None) completed by one collection pass over the ones it lacks,
    which also keeps per-channel statistics of the `channels` it collects (an
    equalization's inputs). For a `repaired` copy, `stats` are the model's own: a repair
    renames every tensor whose values it changes, so the tensors of the same name keep
    their statistics and only the renamed ones are collected."""
    from quantlab import collect

    needed = _needed_tensors(model, args.trt_version is not None)
    if repaired:
        stats = collect.Statistics({name: stats.tensors[name] for name in needed
                                    if name in stats.tensors}, stats.num_samples,
                                   stats.num_bins)
    missing = [name for name in needed if stats is None or name not in stats.tensors]
    if not missing:
        return stats
    if stats is not None and not repaired:
        print(f"plan: {args.data}'s statistics lack {len(missing)} tensor(s) the planner reads "
              "(linear-op outputs for the FP16 range rule, or the cache's ranges); collecting "
              "them in one pass over its data.")
    extra = collect.collect(model, source, missing, progress=not args.no_progress,
                            channels=[name for name in channels if name in missing],
                            **({"num_bins": stats.num_bins} if stats is not None else {}))
    if stats is None:
        return extra
    if repaired:  # in the order a collection of the whole model gives
        return collect.Statistics({name: (extra.tensors[name] if name in extra.tensors else
                                          stats.tensors[name]) for name in needed},
                                  stats.num_samples, stats.num_bins)
    return collect.Statistics({**stats.tensors, **extra.tensors}, stats.num_samples,
                              stats.num_bins, extra.channels)


class _Calibration(NamedTuple):
    """What :func:`_calibrated` makes of statistics."""

    scales: object  # a quantlab.calibrate.CalibrationResult of --method
    ranges: dict[str, float]  # max |x|
    p9999: dict[str, float]  # 99.99th percentile
    candidates: dict[str, dict[str, float]]  # --calibrators' method -> amax


def _calibrated(stats, args, known: _Calibration | None = None) -> _Calibration:
    """The calibration of statistics. With `known` (that of statistics sharing tensors with
    these: the model before a repair), the tensors it has keep its figures; only the others
    are calibrated."""
    from quantlab import calibrate, collect

    fresh = stats if known is None else collect.Statistics(
        {name: tensor for name, tensor in stats.tensors.items() if name not in known.ranges},
        stats.num_samples, stats.num_bins)
    scales = calibrate.calibrate(fresh, args.method)
    ranges = {name: tensor.amax for name, tensor in stats.tensors.items()}
    p9999 = calibrate.calibrate(fresh, "percentile").amax
    candidates = {m: scales.amax if m == args.method else calibrate.calibrate(fresh, m).amax
                  for m in dict.fromkeys(args.calibrators)}
    if known is not None:
        def merged(own: dict, theirs: dict) -> dict:
            return {name: own[name] if name in own else theirs[name] for name in stats.tensors}

        scales.amax = merged(scales.amax, known.scales.amax)
        p9999 = merged(p9999, known.p9999)
        candidates = {m: merged(amax, known.candidates[m]) for m, amax in candidates.items()}
    return _Calibration(scales, ranges, p9999, candidates)


def run(args: argparse.Namespace) -> int:
    """Plan, certify and write the plan's folder."""
    from pathlib import Path

    from quantlab import cache, graph, plan, qdq
    from quantlab.backends import tensorrt as trt_backend
    from quantlab.commands.options import check_metric, open_evaluation, preprocess_from_args
    from quantlab.data import checked_digest
    from quantlab.errors import DataError
    from quantlab.experiment import check_output
    from quantlab.pipeline import quantized_inputs

    # Every option, the budget and the metric are checked before any data is read.
    check_output(args.out, force=args.force, produces=PLAN_FILES)
    if args.trt_version is not None:
        cache.implicit_int8_version(args.trt_version)
    check_metric(args.metric, args.eval == "zoo",
                 "with a zoo model, pass --eval zoo (its held-out split)", args.model)
    plan.check_budget(args.metric, args.max_drop, args.min_sqnr)
    recorded = _recorded(args)
    # Calibration and evaluation images are read alike: a calibration folder's recorded
    # preprocessing, any option given overriding it (refused where stats.npz is reused).
    preprocess = preprocess_from_args(args, recorded and recorded["preprocess"])
    if recorded is not None:
        _check_overrides(args, recorded, preprocess)
    model = _prepared(args, recorded)
    quantized_inputs(model, "plan. If an input decides a branch holding them, freeze it with "
                     "--input NAME=VALUE")
    source, stats = _calibration(args, model, recorded, preprocess)
    graph.record_data_shapes(model, source)
    # Fails before the work; trtexec takes shapes of the dynamic inputs only.
    profile = trt_backend.input_profile(model, args.batch_size, dynamic_only=True)
    if stats is not None:
        missing = sorted(set(qdq.activation_tensors_to_calibrate(model)) - set(stats.tensors))
        if missing:
            raise DataError(f"the statistics of {args.data} lack tensors {missing[:5]} the Q/DQ "
                            "model quantizes; they were collected on another model. Calibrate "
                            "this model, or pass its calibration data with --data.")
    # The evaluation data are opened (and checked) before any long work.
    evaluation, task = open_evaluation(args, model, preprocess)
    _check_eval_shapes(model, evaluation, args)
    # One pass over each: NaN/Inf refused, and the content identifies the run (checkpoint).
    digests = (checked_digest(source, "--data"),
               checked_digest(evaluation, "--eval"))
    out = Path(args.out)
    existed = {path for path in (out, *out.parents) if path.exists()}
    had_checkpoint = (out / PROGRESS_FILE).exists()
    try:
        return _plan(args, model, source, stats, evaluation, task, profile, preprocess, digests)
    except Exception:
        # A failure, not an interruption (Ctrl-C, SIGTERM keep the checkpoint to resume
        # from): the folder is left as it was.
        if not had_checkpoint:
            (out / PROGRESS_FILE).unlink(missing_ok=True)
        for folder in (out, *out.parents):
            if folder not in existed:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


def _plan(args, model, source, stats, evaluation, task, profile, preprocess, digests) -> int:
    """The long work of :func:`run` once everything is checked: statistics, the plan, the
    folder. `digests` (calibration, evaluation) identify the data's content."""
    import time
    from functools import partial
    from pathlib import Path

    from quantlab import cache, graph, plan, repairs, trtexec
    from quantlab.backends import tensorrt as trt_backend
    from quantlab.commands.build import TRTEXEC_CACHE
    from quantlab.commands.options import resume_fingerprint
    from quantlab.experiment import output_folder, recorded_path, write_json, write_text
    from quantlab.pipeline import CACHE_ALGORITHM
    from quantlab.progress import progress_bar
    from quantlab.report import write_report
    from quantlab.report.plan import next_steps, plan_section

    if ":" in args.metric:  # the user's metric fails now, not after the statistics pass
        plan.check_metric_on_model(model, source, args.metric)
    started = time.perf_counter()
    equalizations = [name for name in args.repairs if name in ("dw-equalize", "pw-equalize")]
    stats = _statistics(model, source, stats, args, channels=repairs.equalization_inputs(
        model, pointwise="pw-equalize" in equalizations) if equalizations else ())
    # The equalizations' per-channel ranges; their statistics (8 KB a channel) let go of
    # before the planner's peak.
    kept_ranges = repairs.channel_percentiles(stats.channels)
    stats.channels.clear()
    calibration = _calibrated(stats, args)
    scales, ranges, p9999, candidates = calibration
    phases = {"statistics": time.perf_counter() - started}
    started = time.perf_counter()
    repaired = {}
    for name in args.repairs:
        renames = name in equalizations
        if renames:
            # The statistics pass kept its inputs' channel ranges (else: a pass of its own).
            inputs = repairs.equalization_inputs(model, pointwise=name == "pw-equalize")
            changed, report = repairs.depthwise_equalization(
                model, {n: kept_ranges[n] for n in inputs}
                if all(n in kept_ranges for n in inputs) else source,
                pointwise=name == "pw-equalize")
            changed = graph.normalize(changed) if report.applied else changed
        else:
            changed, report = (repairs.cross_layer_equalization(model) if name == "cle"
                               else repairs.smooth_quant(model, source))
        if not report.applied:
            done = _equalized_by_calibrate(args) if renames else []
            print(f"repair {name}: " + (
                f"already applied: {args.data} is a calibration folder whose model.onnx "
                f"`quantlab calibrate` equalized ({len(done)} inputs); not weighed again."
                if done else f"nothing to change in this model ({len(report.skipped)} "
                "candidates skipped); not weighed."))
            continue
        # Equalization renames every tensor whose values it changes: the others keep their
        # statistics and calibration (cle rescales tensors in place: all collected again).
        changed_stats = _statistics(changed, source, stats if renames else None, args,
                                    repaired=renames)
        changed_scales, changed_ranges, changed_p9999, changed_candidates = _calibrated(
            changed_stats, args, calibration if renames else None)
        repaired[name] = plan.CalibratedModel(
            changed, changed_scales.amax, changed_ranges, changed_p9999,
            changed_candidates if len(changed_candidates) > 1 else None, report.to_dict())
    phases["repairs"] = time.perf_counter() - started
    progress = None if args.no_progress else partial(progress_bar, leave=False)
    # Trials and evaluations are checkpointed in --out: an interrupted run resumes from there,
    # only when the model, the data's content, the preprocessing, the options and the metric's
    # code are the same.
    out = Path(args.out)
    checkpoint = plan.Checkpoint(out / PROGRESS_FILE, resume_fingerprint(
        args, model, *digests, source.num_samples, evaluation.num_samples, preprocess.to_dict(),
        args.batch_size, args.metric, args.max_drop, args.min_sqnr, args.trials,
        args.hard_samples, args.high_precision, args.resamples, sorted(scales.amax.items()),
        sorted(candidates), sorted(repaired), args.bias_correction))
    if checkpoint.trials or checkpoint.evaluations:
        print(f"plan: resuming from {checkpoint.path}: {len(checkpoint.trials)} "
              f"trial(s) and {len(checkpoint.evaluations)} evaluation(s) of an interrupted run "
              "of the same model, data (same content), preprocessing, options and metric code "
              "are reused.")
    elif checkpoint.ignored:
        print(f"plan: {checkpoint.path} is from a run of another model, data or options "
              "(or unreadable); starting over.")
    settings = plan.PlanSettings(
        metric=args.metric, max_drop=args.max_drop, min_sqnr=args.min_sqnr, trials=args.trials,
        hard_count=args.hard_samples, high_precision=args.high_precision,
        resamples=args.resamples, bias_correction=args.bias_correction)
    result = plan.make_plan(
        plan.CalibratedModel(model, scales.amax, ranges, p9999,
                             candidates if len(candidates) > 1 else None),
        source, evaluation, settings, task=task, checkpoint=checkpoint, repairs=repaired,
        progress=progress)
    result.phases = {**phases, **result.phases}
    certificate = result.certificate
    pinned = plan.pinned_tensors(result.plan, graph.Graph(result.model))
    with output_folder(args.out, force=args.force, produces=PLAN_FILES) as folder:
        result.plan.save(folder / "plan.json")
        graph.save_model(result.model, folder / "model.onnx")  # repaired when plan.json says
        graph.save_model(result.qdq_model, folder / "model.int8.onnx")
        uncertified = None
        if result.uncertified is not None:
            kept_plan, kept_model, kept_eval = result.uncertified
            (folder / UNCERTIFIED).mkdir()
            kept_plan.save(folder / UNCERTIFIED / "plan.json")
            graph.save_model(kept_model, folder / UNCERTIFIED / "model.int8.onnx")
            uncertified = {"folder": UNCERTIFIED, "certified": False,
                           "int8_mac_share": kept_eval.int8_mac_share,
                           "value": kept_eval.certificate.value,
                           "limit": kept_eval.certificate.limit,
                           "margin_interval": list(kept_eval.certificate.interval),
                           "samples": kept_eval.certificate.samples,
                           "needed_samples": (kept_eval.certificate.needed_samples or
                                              kept_eval.certificate.samples_to_certify())}
        cache_name = header = None
        if args.trt_version is not None:
            kept = {name: amax / 127.0 for name, amax in result.amax.items()
                    if name not in pinned}
            cache.write_calibration_cache(folder / "calibration.cache", kept,
                                          algorithm=CACHE_ALGORITHM[scales.method],
                                          trt_version=args.trt_version)
            cache_name = "calibration.cache"
            if CACHE_ALGORITHM[scales.method] != "EntropyCalibration2":
                cache_name = TRTEXEC_CACHE
                cache.write_calibration_cache(folder / cache_name, kept, "EntropyCalibration2",
                                              trt_version=args.trt_version)
            header, _ = cache.read_calibration_cache(folder / cache_name)
        write_text(folder / "trtexec.txt", trtexec.trtexec_text(
            trt_backend.implicit_pins(result.model, result.plan.node_precisions()), profile,
            cache_name, header and str(header), trt_backend.explicit_build_pins(result.qdq_model)))
        # Titled with the user's model, not a calibration folder's normalized copy of it.
        model_file = graph.source_model(model) or args.model
        steps = next_steps(result, args.out, UNCERTIFIED)
        write_report(folder / "report.html", f"Plan of {Path(model_file).name}",
                     [plan_section(result, steps)], subtitle=model_file)
        write_json(folder / "summary.json", {
            "model": model_file,
            "metric": args.metric,
            "budget": {"max_drop": args.max_drop, "min_sqnr": args.min_sqnr},
            "int8_mac_share": result.plan.int8_mac_share(),
            "certificate": certificate.__dict__,
            # "all-FP16" or "FP32" when no plan with INT8 certified and this is the fallback.
            "fallback": result.fallback,
            # Tensors quantized with every unit out of INT8 (none: every drop is the units').
            "quantized_outside_units": result.outside_units,
            "evaluations": [{"int8_mac_share": e.int8_mac_share, "predicted": e.predicted,
                             "value": e.certificate.value, "certified": e.certificate.certified,
                             "interval": e.certificate.interval, "seconds": e.seconds,
                             "model_run": e.model_run, "screened": e.screened,
                             "note": e.note}
                            for e in result.evaluations],
            "front": [{"int8_mac_share": p.int8_mac_share, "predicted": p.predicted}
                      for p in result.front],
            "trials": len(result.sensitivity.nsr),
            # Seconds per step of the planning flow (docs/planner.md).
            "phases": result.phases,
            # A trial's median seconds against a warm FP32 pass over the same samples.
            "trial_cost": result.trial_cost,
            # The noise model checked: plans measured against its prediction (front checks,
            # localization) and every evaluated plan's prediction on the hardest samples.
            "noise_model": {"disagreement_factor": plan.DISAGREEMENT,
                            "largest_disagreement": result.largest_disagreement(),
                            # Plans the search chose, found noisier than predicted on the
                            # hardest samples before their evaluation: refitted, chosen again.
                            "refits": result.refits,
                            "checks": result.sensitivity.checks,
                            "evaluated": result.noise_checks},
            "hard_samples": result.hard_samples,
            "calibration": {"data": recorded_path(source.description), "method": scales.method,
                            "calibrators": list(candidates)},
            "eval": {"data": recorded_path(evaluation.description),
                     "num_samples": evaluation.num_samples},
            # `quantlab build DIR` reads these: trtexec.txt's profile is for this batch.
            "generator": GENERATOR, "max_batch": args.batch_size,
            "repairs": result.plan.repairs,
            # The certified plan is this folder's; a better one that could not be certified
            # on this evaluation set is in uncertified/ (null: none).
            "uncertified": uncertified,
            "next_steps": steps,
        })
    (out / PROGRESS_FILE).unlink(missing_ok=True)
    for number, evaluation in enumerate(result.evaluations, 1):
        if evaluation.note and not args.no_progress:  # summary.json keeps them either way
            print(f"plan: evaluation {number}: {evaluation.note}")
    verdict = "certified" if certificate.certified else "NOT certified"
    if result.fallback is not None:
        verdict += f" (the fallback, {result.fallback}: no plan with INT8 certified)"
    runs = result.model_runs
    print(f"plan: {result.plan.int8_mac_share():.1%} of linear-op MACs in INT8; {args.metric} "
          f"{certificate.value:.4g} (FP32 {certificate.reference:.4g}, limit "
          f"{certificate.limit:.4g}) {verdict} at {certificate.confidence:.0%} on "
          f"{certificate.samples} samples after {runs} evaluation{'' if runs == 1 else 's'} of a "
          f"model; wrote {args.out}/")
    if certificate.too_small:
        print(certificate.too_small_message())
    if result.uncertified is not None:
        share, evaluation_kept = result.uncertified[0].int8_mac_share(), result.uncertified[2]
        print(f"plan: a plan with {share:.1%} of MACs in INT8 scored "
              f"{evaluation_kept.certificate.value:.4g} (limit "
              f"{evaluation_kept.certificate.limit:.4g}) but could not be certified on "
              f"{evaluation_kept.certificate.samples} samples; written to "
              f"{args.out}/{UNCERTIFIED}/ (plan.json, model.int8.onnx) beside the certified one.")
    for step in steps:
        print(f"next: {step}")
    return 0 if certificate.certified else 1
