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
import math

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
# Kinds of run a gate compares (they hold an FP32 and an INT8 model).
CHECKED_KINDS = ("calibrate", "sweep", "plan")


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
    """Evaluate baseline and candidate; 0 when the candidate holds the line, else 1."""
    from functools import partial
    from pathlib import Path

    from quantlab.commands.options import check_metric, preprocess_from_args
    from quantlab.errors import ConfigError, DataError
    from quantlab.plan import Plan
    from quantlab.progress import progress_bar
    from quantlab.runs import load_run

    check_metric(args.metric, args.eval == "zoo",
                 "pass --eval zoo with a zoo model name as MODEL_OR_DIR")
    baseline = load_run(args.baseline)
    if baseline.kind not in CHECKED_KINDS:
        raise ConfigError(f"--baseline {args.baseline} is a {baseline.kind} run; a baseline is "
                          f"a folder of {', '.join(CHECKED_KINDS)} (it holds the INT8 model).")
    base_folder = _model_folder(baseline)
    recorded = _recorded(base_folder)
    preprocess = preprocess_from_args(args, recorded and recorded.get("preprocess"))
    progress = None if args.no_progress else partial(progress_bar, leave=False)
    candidate_is_folder = Path(args.candidate).is_dir()
    if candidate_is_folder:
        candidate = load_run(args.candidate)
        if candidate.kind not in CHECKED_KINDS:
            raise ConfigError(f"{args.candidate} is a {candidate.kind} run; check a folder of "
                              f"{', '.join(CHECKED_KINDS)}, or a model.")
        models = _folder_models(_model_folder(candidate))
    else:
        if baseline.kind == "plan":
            raise ConfigError(
                f"--baseline {args.baseline} is a plan: plan the new model first (quantlab plan "
                f"{args.candidate} ... --out DIR) and check DIR against it, so the INT8 shares "
                "of both plans are compared.")
        candidate = None
        models = _calibrated(args, recorded, preprocess)
    _check_like_with_like(args, baseline, base_folder, models[0])
    task = _task(args)
    scores = {}
    for name, (fp32, int8) in (("baseline", _folder_models(base_folder)), ("candidate", models)):
        scores[name] = _score(fp32, int8, args, preprocess, task, progress)
        cert, sqnr = scores[name]
        where = args.baseline if name == "baseline" else args.candidate
        print(f"check: {name} {where}: INT8 {args.metric} {cert.value:.4g} (FP32 "
              f"{cert.reference:.4g}; {2 * cert.confidence - 1:.0%} interval "
              f"[{cert.interval[0] + cert.limit:.4g}, {cert.interval[1] + cert.limit:.4g}]), "
              f"output SQNR {sqnr:.1f} dB, {cert.samples} samples")
    base, cand = scores["baseline"][0], scores["candidate"][0]
    if math.isnan(base.value):
        raise DataError(f"the baseline {args.baseline} scores INT8 {args.metric} NaN on "
                        f"{args.eval}: its INT8 model outputs NaN or Inf, and a NaN baseline "
                        "lets any candidate pass. Make the baseline again.")
    failures = []
    if math.isnan(cand.value):
        failures.append(f"its INT8 {args.metric} is NaN: its INT8 model outputs NaN or Inf")
    # Equal scores are no drop, also +inf vs +inf (an exact SQNR), whose difference is NaN.
    drop = 0.0 if base.value == cand.value else base.value - cand.value
    if drop > args.max_drop:
        failures.append(f"its INT8 {args.metric} is {cand.value:.4g} against the baseline's "
                        f"{base.value:.4g}, a drop of {drop:.4g}, more than --max-drop "
                        f"{args.max_drop:g}")
    sqnr = scores["candidate"][1]
    if args.min_sqnr is not None and not sqnr >= args.min_sqnr:
        failures.append(f"its INT8 output SQNR is {sqnr:.1f} dB, under --min-sqnr "
                        f"{args.min_sqnr:g} dB")
    if baseline.kind == "plan" and candidate is not None and candidate.kind == "plan":
        shares = [Plan.load(run.path / "plan.json").int8_mac_share()
                  for run in (baseline, candidate)]
        print(f"check: INT8 share of MACs {shares[0]:.2%} (baseline) -> {shares[1]:.2%}")
        if shares[1] < shares[0] - 1e-12:
            failures.append(f"its plan keeps {shares[1]:.2%} of the MACs in INT8, less than the "
                            f"baseline plan's {shares[0]:.2%}")
    if failures:
        compare = (f"`quantlab compare {args.baseline} {args.candidate}` (settings, scales) "
                   "and " if candidate_is_folder else "")
        print(f"check: FAILED: {args.candidate} falls behind the baseline {args.baseline} on "
              f"{args.eval} ({cand.samples} samples): {'; and '.join(failures)}. Both were "
              "evaluated now on the same data with their real INT8 models (ONNX Runtime integer "
              f"kernels). Inspect the change with {compare}`quantlab validate --from` (the "
              "layer that diverges first), or update the baseline if the change is intended.")
        return 1
    print(f"check: passed: {args.candidate} holds the line of {args.baseline} (INT8 "
          f"{args.metric} {cand.value:.4g} vs {base.value:.4g}, allowed drop {args.max_drop:g}).")
    return 0


def _check_like_with_like(args, baseline, base_folder, candidate_fp32) -> None:
    """ConfigError unless baseline and candidate hold the same model and the baseline, when it
    records a metric (plan, sweep), was made with --metric. The same model: the same content
    (digest of the FP32 model each was made from), or the same network with other weights (a
    retrained or rebuilt model, what the CI recipe checks), which is said."""
    import json

    from quantlab import graph
    from quantlab.errors import ConfigError

    base_fp32 = graph.load_model(base_folder / "model.onnx")
    digests = graph.source_digest(base_fp32), graph.source_digest(candidate_fp32)
    same_network = graph.architecture_digest(base_fp32) == graph.architecture_digest(
        candidate_fp32)
    if same_network and digests[0] != digests[1]:
        print(f"check: {args.candidate} is the network of the baseline with other weights "
              f"(content digest {digests[1]}, the baseline's {digests[0]}).")
    elif not same_network:
        raise ConfigError(
            f"--baseline {args.baseline} and {args.candidate} hold different models: "
            f"{graph.source_model(base_fp32)} (content digest {digests[0]}) and "
            f"{graph.source_model(candidate_fp32)} (content digest {digests[1]}), whose ops or "
            "shapes differ; check compares a new calibration, plan or build of the baseline's "
            "network (its weights may differ). Make a baseline of this model first.")
    record = {"plan": "summary.json", "sweep": "sweep.json"}.get(baseline.kind)
    recorded = record and json.loads((baseline.path / record).read_text()).get("metric")
    if recorded and recorded != args.metric:
        raise ConfigError(f"--baseline {args.baseline} was made with --metric {recorded}; "
                          f"check it with --metric {recorded}, not {args.metric}.")


def _model_folder(run):
    """The folder holding a run's model.onnx and model.int8.onnx (a sweep's: best/)."""
    return run.path / "best" if run.kind == "sweep" else run.path


def _recorded(folder) -> dict | None:
    """The folder's calibration.json, read and checked (a plan folder has none)."""
    from quantlab.experiment import read_calibration_record

    return read_calibration_record(folder) if (folder / "calibration.json").is_file() else None


def _folder_models(folder):
    """(FP32 model, INT8 model) of an experiment folder."""
    from quantlab import graph

    return graph.load_model(folder / "model.onnx"), graph.load_model(folder / "model.int8.onnx")


def _calibrated(args, recorded, preprocess):
    """(FP32 model, INT8 model) of a model candidate, calibrated as the baseline recorded."""
    from pathlib import Path

    from quantlab import collect, graph, pipeline
    from quantlab.commands.options import input_options
    from quantlab.data import open_data
    from quantlab.errors import ConfigError

    # The baseline's data and sample count, unless --data (and --max-samples) say otherwise.
    data, limit = (args.data, args.max_samples) if args.data else (recorded["data"],
                                                                   recorded["num_samples"])
    if data == "zoo":
        from quantlab import zoo

        data = zoo.get(args.candidate).calibration_set()
    elif not Path(data).exists():
        raise ConfigError(f"the baseline's calibration data {data} cannot be read here; pass "
                          "the calibration data of the new model with --data.")
    options = input_options(args)
    options["constants"] = {**recorded.get("frozen_inputs", {}), **options["constants"]}
    options["batch_axes"] = {**recorded.get("sample_axes", {}), **options["batch_axes"]}
    model = pipeline.prepare_model(args.candidate, data, **options)
    source = open_data(data, graph.input_specs(model), args.batch_size, limit, preprocess)
    stats = collect.collect(model, source, pipeline.quantized_inputs(model, "check"),
                            progress=not args.no_progress)
    method = recorded["method"]
    result = pipeline.calibrate_from_stats(
        model, stats, source, method, {} if method == pipeline.AUTO else recorded["params"],
        weight_criterion=recorded.get("weight_amax") or "max",
        bias_correction="bias_correction" in (recorded.get("repairs") or {}))
    return result.model, result.qdq_model


def _task(args):
    """(zoo task, its evaluation inputs) of --eval zoo (MODEL_OR_DIR must then be a zoo
    name), else (None, None)."""
    from quantlab.errors import ConfigError
    from quantlab.zoo_names import ZOO_NAMES

    if args.eval != "zoo":
        return None, None
    if args.candidate not in ZOO_NAMES:
        names = ", ".join(ZOO_NAMES)
        raise ConfigError(f"--eval zoo needs a zoo model name as MODEL_OR_DIR ({names}), not "
                          f"{args.candidate}; pass evaluation data instead.")
    from quantlab import zoo
    from quantlab.tasks import Task

    entry = zoo.get(args.candidate)
    eval_set = entry.eval_set(args.max_samples)
    return Task.from_zoo(entry, eval_set), eval_set.inputs


def _score(fp32, int8, args, preprocess, task, progress):
    """(certificate of the INT8 metric against FP32, INT8 output SQNR in dB) on --eval;
    `task` is :func:`_task`'s."""
    import numpy as np

    from quantlab import graph
    from quantlab.data import checked_digest, open_data
    from quantlab.scoring import Certificate, output_sqnr
    from quantlab.sweep import Evaluator

    task, zoo_inputs = task
    if task is not None:
        evaluation = open_data(zoo_inputs, graph.input_specs(fp32), args.batch_size)
    else:
        evaluation = open_data(args.eval, graph.input_specs(fp32), args.batch_size,
                               args.max_samples, preprocess)
    checked_digest(evaluation, "--eval")
    evaluator = Evaluator(fp32, evaluation, args.metric, task, args.resamples, progress)
    outputs = evaluator.outputs(int8, "INT8 evaluation")
    if not all(np.isfinite(v).all() for batch in outputs for v in batch.values()
               if np.issubdtype(v.dtype, np.floating)):
        # The scorer refuses NaN outputs; for the gate they are a score of NaN: a failed
        # candidate, or a baseline to make again (run's verdicts).
        fp32_value = evaluator.reference.score(np.arange(evaluation.num_samples))
        nan = math.nan
        return Certificate(args.metric, fp32_value, nan, nan, (nan, nan), 0.95,
                           evaluation.num_samples, False, False, None), nan
    certificate = evaluator.against_fp32(outputs)
    sqnr = certificate.value if args.metric == "sqnr" else output_sqnr(outputs,
                                                                       evaluator.references)
    return certificate, sqnr
