"""Validate an INT8 model in three stages: PyTorch vs ONNX Runtime FP32 vs the INT8 engine.

Every stage runs over the evaluation data batch by batch; adjacent stages are
compared tensor by tensor (cosine, SQNR, relative L2, max |error|, fraction
outside tolerance) and scored end to end on the task when ground truth is known.

The engine stage is the Q/DQ model in ONNX Runtime (TensorRT is not installed).
--mode local feeds each quantized layer the FP32 input, isolating its own error.

Writes into --out: layers_<A>_vs_<B>.csv per stage pair, summary.json, report.html.

examples:
  quantlab validate --zoo digits-cnn --out runs/cnn-validate
  quantlab validate --from runs/cnn --data eval_images/ --out runs/cnn/validate
  quantlab validate --onnx model.onnx --engine model.int8.onnx --data eval.npy \\
      --torch mypkg.models:make_model --out runs/val --mode local
"""

from __future__ import annotations

import argparse
import importlib
import warnings
from pathlib import Path

from quantlab.commands.options import DATA_HELP, add_data_arguments

HELP = "compare torch, ONNX Runtime FP32 and the INT8 engine layer by layer and end to end"
EPILOG = DATA_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab validate`."""
    from quantlab.calibrate import DEFAULT_METHOD, METHODS
    from quantlab.validate import MODES

    parser.add_argument("--from", dest="from_dir", metavar="DIR",
                        help="a `quantlab calibrate` folder: its model.onnx and model.int8.onnx, "
                             "and the preprocessing it recorded (options given here override)")
    parser.add_argument("--onnx", metavar="MODEL.onnx", help="FP32 ONNX model (reference)")
    parser.add_argument("--engine", metavar="MODEL.int8.onnx",
                        help="Q/DQ INT8 ONNX model made from --onnx (the engine stage)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--torch", metavar="MODULE:FACTORY",
                        help="python module and a function returning the torch.nn.Module that "
                             "was exported to --onnx (adds the torch stage)")
    source.add_argument("--zoo", metavar="NAME", help="a zoo model: torch stage, task metrics, "
                        "and --onnx/--engine made here when not given")
    parser.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                        help="with --zoo and no --engine: calibration method of the INT8 model "
                             "made here (default: %(default)s)")
    parser.add_argument("--mode", choices=MODES, default="global",
                        help="global: stages end to end; local: each INT8 layer fed the FP32 "
                             "input (default: %(default)s)")
    parser.add_argument("--threshold-db", type=float, default=30.0, metavar="DB",
                        help="SQNR below which a tensor counts as diverged (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_data_arguments(parser, required=False,
                       data_help="evaluation data: image folder, COCO .json, .npy or .npz (see "
                                 "'data' below); with --zoo, default and 'zoo' mean the zoo "
                                 "model's held-out evaluation split")


def load_factory(spec: str):
    """Call ``package.module:function`` and return the torch module it builds."""
    from quantlab.errors import ConfigError

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"--torch '{spec}' is not of the form module:factory (e.g. "
            "mypkg.models:make_resnet); the factory is called with no arguments.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"--torch '{spec}': python module '{module_name}' cannot be imported ({exc}). "
            "Check the spelling and that its folder is on PYTHONPATH.") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(
            f"--torch '{spec}': module '{module_name}' has no callable '{attribute}'; name a "
            "function (or class) that builds the torch.nn.Module with its trained weights.")
    return factory()


def run(args: argparse.Namespace) -> int:
    """Run `quantlab validate`."""
    from quantlab import graph, pipeline
    from quantlab.commands.options import input_options, preprocess_from_args
    from quantlab.data import open_data
    from quantlab.errors import ConfigError
    from quantlab.validate import Task, validate

    torch_module, task, data = None, None, args.data
    onnx_path, engine_path = args.onnx, args.engine
    recorded = None
    if args.from_dir:
        onnx_path, engine_path, recorded = _calibration_folder(Path(args.from_dir), args)
    if args.zoo:
        from quantlab import zoo

        entry = zoo.get(args.zoo)
        torch_module = entry.build()
        if onnx_path is None and engine_path is None:
            onnx_path, engine_path = _zoo_models(entry, Path(args.out), args)
        if data in (None, "zoo"):
            eval_set = entry.eval_set(args.max_samples)
            task = Task.from_zoo(entry, eval_set)
            data = {entry.input_name: eval_set.inputs}
    elif args.torch:
        torch_module = load_factory(args.torch)
    if onnx_path is None or engine_path is None:
        raise ConfigError(
            "pass both --onnx (FP32) and --engine (Q/DQ INT8) models, or --zoo NAME alone to "
            "export and quantize a zoo model here.")
    if data is None:
        raise ConfigError("pass --data (evaluation samples), or --zoo NAME for its eval split.")
    model = pipeline.prepare_model(onnx_path, data, **input_options(args))
    with warnings.catch_warnings():  # the INT8 model's float-only parts are the FP32 one's
        warnings.simplefilter("ignore")
        engine = pipeline.prepare_model(engine_path, data, **input_options(args))
    source = open_data(data, graph.input_specs(model), args.batch_size, args.max_samples,
                       preprocess_from_args(args, recorded))
    result = validate(model, engine, source, args.out, torch_module=torch_module, task=task,
                      mode=args.mode, threshold_db=args.threshold_db, force=args.force,
                      progress=not args.no_progress,
                      title=f"Validation of {args.zoo or Path(onnx_path).name}")
    for stage, values in result.metrics.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items() if isinstance(v, float))
        print(f"{stage:12s} {shown}")
    for (reference, test), divergence in result.divergences.items():
        where = (f"{divergence.tensor} ({divergence.op_type} {divergence.node}, "
                 f"{divergence.sqnr_db:.1f} dB)" if divergence else "none")
        print(f"first divergence {reference} vs {test}: {where}")
    print(f"report: {result.report}")
    return 0


def _calibration_folder(folder: Path, args) -> tuple[Path, Path, dict | None]:
    """FP32 and INT8 models of a calibration folder, and the preprocessing it recorded."""
    from quantlab.errors import ConfigError
    from quantlab.experiment import read_json

    record_path = folder / "calibration.json"
    if not record_path.is_file():
        raise ConfigError(
            f"--from {folder}: no calibration.json there; point --from at the --out folder of "
            "a finished `quantlab calibrate` run.")
    record = read_json(record_path)
    onnx_path = Path(args.onnx) if args.onnx else folder / "model.onnx"
    engine_path = Path(args.engine) if args.engine else folder / "model.int8.onnx"
    return onnx_path, engine_path, record.get("preprocess")


def _zoo_models(entry, out: Path, args) -> tuple[Path, Path]:
    """Export and calibrate a zoo model into ``out/calibration`` (FP32 and Q/DQ files)."""
    from quantlab import pipeline

    result = pipeline.run_calibration(entry.name, entry.calibration_set(), out / "calibration",
                                      method=args.method, batch_size=args.batch_size,
                                      force=args.force, progress=not args.no_progress)
    return result.folder / "model.onnx", result.folder / "model.int8.onnx"
