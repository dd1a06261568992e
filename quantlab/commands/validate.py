"""Validate an INT8 model in three stages: PyTorch vs ONNX Runtime FP32 vs the INT8 engine.

Every stage runs over the evaluation data batch by batch; adjacent stages are
compared tensor by tensor (cosine, SQNR, relative L2, max |error|, fraction
outside tolerance) and scored end to end on the task when ground truth is known.

The engine stage is the Q/DQ model in ONNX Runtime, or with --engine-backend tensorrt
a TensorRT engine compared on every tensor it keeps (the layer table says how each
was obtained on the installed version; docs/tensorrt.md).
--mode local feeds each quantized layer the FP32 input, isolating its own error.
--metric scores the engine against FP32 end to end with the metrics `quantlab plan`
takes, with a paired bootstrap interval. Under --memory the graphs run in segments
(shape scalars are recomputed in each; a failing segment is told from failing data).

Writes into --out: layers_<A>_vs_<B>.csv per stage pair, summary.json, report.html
(titled with your model file; next steps computed from the results, also printed).

examples:
  quantlab validate --zoo digits-cnn --metric top1 --out runs/cnn-validate
  quantlab validate --from runs/cnn --data eval_images/ --out runs/cnn/validate
  quantlab validate --onnx model.onnx --engine model.int8.onnx --data eval.npy \\
      --torch mypkg.models:make_model --out runs/val --mode local
  quantlab validate --from runs/vit --data eval.npy --metric mymetrics:f1 --memory 4G \\
      --out runs/vit/validate
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantlab.commands.options import (
    DATA_HELP,
    add_data_arguments,
    add_memory_argument,
    add_metric_argument,
    finite_float,
    positive_int,
)

HELP = "compare torch, ONNX Runtime FP32 and the INT8 engine layer by layer and end to end"
# Worst layers of the INT8 pair printed on the console (the report lists more).
WORST_ON_CONSOLE = 5
EPILOG = DATA_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab validate`."""
    from quantlab.choices import DEFAULT_METHOD, DEFAULTS_FROM, METHODS, MODES

    parser.add_argument("--from", dest="from_dir", metavar="DIR",
                        help="a `quantlab calibrate` folder: its model.onnx and model.int8.onnx, "
                             "and the preprocessing it recorded (options given here override)")
    parser.add_argument("--onnx", metavar="MODEL.onnx", help="FP32 ONNX model (reference)")
    parser.add_argument("--engine", metavar="MODEL.int8.onnx",
                        help="Q/DQ INT8 ONNX model made from --onnx (the engine stage); with "
                             "--engine-backend tensorrt also a prebuilt model.plan")
    parser.add_argument("--engine-backend", choices=("onnxruntime", "tensorrt"),
                        default="onnxruntime",
                        help="run the engine stage in ONNX Runtime (default) or as a TensorRT "
                             "engine (needs quantlab[tensorrt] and an NVIDIA GPU)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--torch", metavar="MODULE:FACTORY",
                        help="python module and a function returning the torch.nn.Module that "
                             "was exported to --onnx (adds the torch stage)")
    source.add_argument("--zoo", metavar="NAME", help="a zoo model: torch stage, task metrics, "
                        "and --onnx/--engine made here when not given")
    parser.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                        help="with --zoo and no --engine: calibration method of the INT8 model "
                             f"made here, as calibrate makes it (default: %(default)s, from "
                             f"{DEFAULTS_FROM})")
    parser.add_argument("--mode", choices=MODES, default="global",
                        help="global: stages end to end; local: each INT8 layer fed the FP32 "
                             "input (default: %(default)s)")
    parser.add_argument("--threshold-db", type=finite_float, default=30.0, metavar="DB",
                        help="SQNR below which a tensor counts as diverged (default: %(default)s)")
    add_metric_argument(parser, None, "with --zoo and its evaluation split",
                        "score the engine against FP32 end to end with a paired bootstrap "
                        "interval, as `quantlab plan` does: ")
    parser.add_argument("--resamples", type=positive_int, default=200, metavar="B",
                        help="paired bootstrap resamples of --metric (default: %(default)s)")
    add_memory_argument(parser, "the comparison (half of it for the tensors compared at once)")
    parser.add_argument("--force", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_data_arguments(parser, required=False,
                       data_help="evaluation data: image folder, COCO .json, .npy or .npz (see "
                                 "'data' below); with --zoo, default and 'zoo' mean the zoo "
                                 "model's held-out evaluation split")


def load_factory(spec: str):
    """Call ``package.module:function`` and return the torch module it builds."""
    from quantlab.errors import ConfigError
    from quantlab.user_code import import_module

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"--torch '{spec}' is not of the form module:factory (e.g. "
            "mypkg.models:make_resnet); the factory is called with no arguments.")
    try:
        module = import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"--torch '{spec}': python module '{module_name}' cannot be imported ({exc}). "
            "Check the spelling and that it is in the current directory or on PYTHONPATH."
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(
            f"--torch '{spec}': module '{module_name}' has no callable '{attribute}'; name a "
            "function (or class) that builds the torch.nn.Module with its trained weights.")
    try:
        module = factory()
    except Exception as exc:  # the user's code: any exception means "no module"
        raise ConfigError(
            f"--torch '{spec}': the factory raised {type(exc).__name__}: {exc}. Fix the "
            "factory so it builds the module (with its weights) when called with no arguments."
        ) from None
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ConfigError(
            f"--torch '{spec}' returned {type(module).__name__}, not a torch.nn.Module; the "
            "factory must return the module that was exported to --onnx, with its weights.")
    return module


def run(args: argparse.Namespace) -> int:
    """Run `quantlab validate` (quantlab.api.validate_model) and print its results."""
    from quantlab.api import ValidateOptions, validate_model
    from quantlab.calibration import pipeline
    from quantlab.commands.options import check_metric, data_options
    from quantlab.errors import ConfigError
    from quantlab.evaluation.validate import Task, check_threshold

    # Every option is checked before any long work (export, calibration, validation).
    check_threshold(args.threshold_db, 10.0)
    if args.metric is not None:
        check_metric(args.metric, bool(args.zoo) and args.data in (None, "zoo"),
                     "pass --zoo NAME without --data: its evaluation split has the labels",
                     args.zoo)
    if args.engine_backend == "tensorrt":
        from quantlab.engine.backends.tensorrt import require_tensorrt

        require_tensorrt()
    torch_module, task, data, entry = None, None, args.data, None
    onnx_path, engine_path = args.onnx, args.engine
    if args.from_dir:
        onnx_path, engine_path = _calibration_folder(Path(args.from_dir), args)
    calibrate_here = bool(args.zoo) and onnx_path is None and engine_path is None
    if args.zoo:
        from quantlab import zoo

        entry = zoo.get(args.zoo)
        torch_module = entry.build()
        if calibrate_here:
            onnx_path = pipeline.export_zoo_model(entry.name)
        if data in (None, "zoo"):
            eval_set = entry.eval_set(args.max_samples)
            task = Task.from_zoo(entry, eval_set)
            data = {entry.input_name: eval_set.inputs}
    elif args.torch:
        torch_module = load_factory(args.torch)
    if onnx_path is None or (engine_path is None and not calibrate_here):
        raise ConfigError(
            "pass both --onnx (FP32) and --engine (Q/DQ INT8) models, or --zoo NAME alone to "
            "export and quantize a zoo model here.")
    if data is None:
        raise ConfigError("pass --data (evaluation samples), or --zoo NAME for its eval split.")
    options = ValidateOptions(mode=args.mode, threshold_db=args.threshold_db, metric=args.metric,
                              resamples=args.resamples, memory=args.memory,
                              engine_backend=args.engine_backend, method=args.method)
    result = validate_model(
        onnx_path, None if calibrate_here else engine_path, data, options, args.out,
        data_options=data_options(args), torch_module=torch_module, task=task,
        calibrate_on=entry.calibration_set() if calibrate_here else None,
        from_folder=args.from_dir, model_file=args.zoo if calibrate_here else None,
        force=args.force, progress=not args.no_progress)
    _print_result(result)
    return 0


def _print_result(result) -> None:
    """Task metrics, warnings, end-to-end outputs, first divergences and the worst layers."""
    import sys

    from quantlab.experiments.report.validation import (
        metric_line,
        outputs_frame,
        pair_label,
        worst_tensors,
    )

    for stage, values in result.metrics.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items() if isinstance(v, float))
        print(f"{stage:12s} {shown}")
    if result.record.metric:
        print(metric_line(result.record.metric))
    for pair in result.pairs:
        for warning in pair.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    for row in outputs_frame(result.pairs).itertuples(index=False):
        print(f"output {row.output} {row.pair}: {row.sqnr_db:.1f} dB SQNR, cosine "
              f"{row.cosine:.4f}")
    for pair in result.pairs:
        if pair.output_sqnr_db is not None and len(pair.outputs) > 1:
            print(f"outputs together {pair_label(pair)}: {pair.output_sqnr_db:.1f} dB SQNR (the "
                  "figure plan --min-sqnr bounds, docs/metrics.md)")
    for pair in result.pairs:
        divergence = pair.divergence
        where = (f"{divergence.tensor} ({divergence.op_type} {divergence.node}, "
                 f"{divergence.sqnr_db:.1f} dB)" if divergence else
                 f"none of {len(pair.table)} compared tensor(s)")
        print(f"first divergence {pair.reference} vs {pair.test}: {where}")
    engine_pair = result.pairs[-1]
    worst = worst_tensors(engine_pair.table, result.exported).head(WORST_ON_CONSOLE)
    if len(worst):
        print(f"worst layers, {pair_label(engine_pair)}:")
        for row in worst.itertuples(index=False):
            print(f"  {row.sqnr_db:6.1f} dB  {row.tensor} ({row.op_type} {row.node})")
    for step in result.record.next_steps:
        print(f"next: {step}")
    print(f"report: {result.report}")


def _calibration_folder(folder: Path, args) -> tuple[Path, Path]:
    """FP32 and INT8 models of a calibration folder (--onnx, --engine override them)."""
    from quantlab.errors import ConfigError

    if not (folder / "calibration.json").is_file():
        raise ConfigError(
            f"--from {folder}: no calibration.json there; point --from at the --out folder of "
            "a finished `quantlab calibrate` run.")
    onnx_path = Path(args.onnx) if args.onnx else folder / "model.onnx"
    engine_path = Path(args.engine) if args.engine else folder / "model.int8.onnx"
    return onnx_path, engine_path
