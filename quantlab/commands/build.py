"""Build the TensorRT engine of a calibration folder, and write the trtexec commands that
reproduce it.

DIR is a folder written by `quantlab calibrate` (model.onnx, model.int8.onnx, and
calibration.cache if it was run with --trt-version). Always writes DIR/trtexec.txt:
the trtexec command lines for TensorRT 8.6 - 10.x (explicit: model.int8.onnx with
--int8), 10.x and 11.x (strongly typed, from model.int8.onnx) and, where the folder
has a cache, for TensorRT <= 10.x (implicit INT8 from model.onnx and the calibration
cache, with the plan's fp32/fp16 layers pinned by --layerPrecisions,
--layerOutputTypes and --precisionConstraints=obey; the plan is DIR/plan.json unless
--plan names one). Where TensorRT is installed (an NVIDIA GPU and quantlab[tensorrt])
it also builds DIR/model.plan -- from model.int8.onnx, strongly typed on TensorRT >=
10 and explicit before, or as --mode says -- and writes the engine's layer
information to DIR/layers.json, listing the plan's nodes whose engine layers run in
another precision. An implicit build reads a scratch copy of calibration.cache, so
TensorRT never rewrites the folder's cache.

examples:
  quantlab build runs/cnn
  quantlab build runs/det --plan runs/det/plan.json --max-batch 8 --mode implicit
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from quantlab.commands.options import positive_int

HELP = "build the TensorRT engine of a calibration folder; write its trtexec commands"
ENGINE_FILE = "model.plan"
TRTEXEC_FILE = "trtexec.txt"
LAYERS_FILE = "layers.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab build`."""
    parser.add_argument("folder", metavar="DIR", help="a folder written by quantlab calibrate")
    parser.add_argument(
        "--mode", choices=("auto", "strongly_typed", "explicit", "implicit"), default="auto",
        help="strongly_typed: from model.int8.onnx (TensorRT >= 9; the only mode of 11); "
        "explicit: model.int8.onnx weakly typed with INT8 on (TensorRT 8.6 - 10); implicit: "
        "INT8 from model.onnx + calibration.cache (TensorRT <= 10); auto: strongly_typed on "
        "TensorRT >= 10, explicit before (default)")
    parser.add_argument("--plan", metavar="FILE",
                        help="plan.json (quantlab plan) or a JSON {node: precision}: its "
                        "fp32/fp16 nodes are pinned in implicit builds and checked in the engine "
                        "(default: DIR/plan.json if there is one)")
    parser.add_argument("--max-batch", type=positive_int, metavar="N",
                        help="largest batch of a dynamic sample axis (default: the batch a "
                             "`quantlab plan` folder was planned with, its trtexec.txt's; "
                             "else 1)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing model.plan or a trtexec.txt of other commands")


def run(args: argparse.Namespace) -> int:
    """Write trtexec.txt, then build the engine where TensorRT is installed."""
    from quantlab import cache, graph, trtexec
    from quantlab.backends import tensorrt as trt_backend
    from quantlab.errors import BackendUnavailableError, ConfigError, ModelError, OutputExistsError
    from quantlab.experiment import write_text
    from quantlab.planner.folder import planned_batch, read_plan

    folder = Path(args.folder)
    for name in ("model.onnx", "model.int8.onnx"):
        if not (folder / name).is_file():
            raise ModelError(f"{folder / name} does not exist; build takes a folder written by "
                             "quantlab calibrate.")
    planned = planned_batch(folder)
    max_batch = args.max_batch or planned or 1
    # The planner (`quantlab plan`) leaves plan.json in its folder: used unless --plan says.
    plan_path = args.plan or (folder / "plan.json" if (folder / "plan.json").is_file() else None)
    if plan_path is None and planned is not None:
        raise ConfigError(f"{folder} was written by quantlab plan but has no plan.json: "
                          "without it the plan's FP16/FP32 pins would be dropped from the "
                          "implicit build. Plan again, or pass --plan FILE.")
    plan = read_plan(plan_path) if plan_path else {}
    model = graph.load_model(folder / "model.onnx")
    int8_model = graph.load_model(folder / "model.int8.onnx")  # damaged: fails here, not in TRT
    unknown = sorted(set(plan) - {node.name for node in model.graph.node})
    if unknown:
        raise ConfigError(f"the plan names {len(unknown)} node(s) that {folder / 'model.onnx'} "
                          f"does not have: {unknown[:5]}; plan this folder's model.")
    pins = trt_backend.implicit_pins(model, plan)
    profile = trt_backend.input_profile(model, max_batch, dynamic_only=True)
    header = scales = cache_name = None
    if (folder / "calibration.cache").is_file():
        header, scales = cache.read_calibration_cache(folder / "calibration.cache")
        cache_name = ("calibration.cache" if header.algorithm == "EntropyCalibration2"
                      else cache.TRTEXEC_CACHE)
    # The comment names the header of the cache trtexec reads (cache_name): EntropyCalibration2
    # either way, relabelled for cache.TRTEXEC_CACHE, as plan writes it.
    trtexec_header = header and header._replace(algorithm="EntropyCalibration2")
    text = trtexec.trtexec_text(pins, profile, cache_name, trtexec_header and str(trtexec_header),
                                trt_backend.explicit_build_pins(int8_model))
    # trtexec.txt is derived from the folder and the plan: rewriting it unchanged is no loss,
    # replacing different lines needs --force like every other result.
    target = folder / TRTEXEC_FILE
    if target.exists() and target.read_text(encoding="utf-8") != text and not args.force:
        raise OutputExistsError(f"{target} holds other commands than the ones for this "
                                f"folder's plan at --max-batch {max_batch} (another plan, or "
                                "another --max-batch); pass --force to replace it.")
    engine_path = folder / ENGINE_FILE
    try:
        version = trt_backend.installed_version()
    except BackendUnavailableError as exc:
        version, missing = None, exc
    if version is not None and engine_path.exists() and not args.force:
        raise OutputExistsError(f"{engine_path} exists; pass --force to build it again.")
    if cache_name == cache.TRTEXEC_CACHE:
        cache.write_calibration_cache(folder / cache_name, scales, "EntropyCalibration2",
                                      trt_version=header.trt_version)
    write_text(target, text)
    print(f"wrote {target}")
    if version is None:
        print(f"quantlab build: engine not built: {missing}", file=sys.stderr)
        return 0
    mode = trt_backend.default_mode(version) if args.mode == "auto" else args.mode
    trt_backend.check_mode(mode, version)
    if mode == "implicit" and header is None:
        raise ConfigError(
            f"{folder} has no calibration.cache, which an implicit INT8 build needs: calibrate "
            f"again with --trt-version {'.'.join(map(str, version))} (the installed TensorRT), "
            "or build from model.int8.onnx (--mode strongly_typed or explicit).")
    source = folder / ("model.onnx" if mode == "implicit" else "model.int8.onnx")
    if mode == "implicit":
        engine = build_implicit(folder, model, plan, header.algorithm, version, max_batch)
    else:
        engine = trt_backend.build_engine(source, mode, max_batch=max_batch)
    from quantlab.experiment import atomic_write
    from quantlab.trt_layers import engine_layers, opaque_nodes, precision_mismatches

    atomic_write(engine_path, lambda tmp: Path(tmp).write_bytes(engine))
    info = trt_backend.layer_information(engine)
    write_text(folder / LAYERS_FILE, info)
    print(f"wrote {engine_path} ({mode}, TensorRT {'.'.join(map(str, version))}) and "
          f"{folder / LAYERS_FILE}")
    layers = engine_layers(info, graph.load_model(source))
    for mismatch in precision_mismatches(layers, plan):
        where = f"layer '{mismatch.layer}'" if mismatch.layer else "no engine layer"
        print(f"  plan {mismatch.planned} != engine {mismatch.engine}: node '{mismatch.node}' "
              f"({where})")
    hidden = opaque_nodes(layers, plan)
    if hidden:
        print(f"  {len(hidden)} planned node(s) run inside Myelin regions, whose precision the "
              f"engine inspector does not report: {hidden[:5]}")
    return 0


def build_implicit(folder: Path, model, plan: dict[str, str], algorithm: str,
                   version: tuple[int, ...], max_batch: int) -> bytes:
    """The implicit INT8 engine of `folder`'s model.onnx from a scratch copy of its
    calibration.cache (whether TensorRT rewrites a cache it accepted is unsettled: the
    folder's file is never handed to it)."""
    import shutil
    import tempfile
    import warnings

    from quantlab import graph
    from quantlab.backends import tensorrt as trt_backend
    from quantlab.backends.trt_calibrator import CalibrationFeeder, make_calibrator

    if any(node.op_type == "Gemm" for node in model.graph.node):
        warnings.warn(
            f"TensorRT {'.'.join(map(str, version))} may want ranges for tensors its ONNX "
            "parser makes inside a Gemm (the weight constant and the MatMul output, unnamed), "
            "which quantlab's cache cannot name; whether the Gemm then leaves INT8 is unsettled "
            "(`quantlab doctor` checks it). The engine's layer precisions below show it.",
            stacklevel=2)
    with tempfile.TemporaryDirectory(prefix="quantlab-build-") as scratch:
        copy = Path(scratch) / "calibration.cache"
        shutil.copyfile(folder / "calibration.cache", copy)
        feeder = CalibrationFeeder(None, copy, graph.input_specs(model), batch=max_batch,
                                   algorithm=algorithm, trt_version=".".join(map(str, version)))
        engine = trt_backend.build_engine(folder / "model.onnx", "implicit",
                                          calibrator=make_calibrator(feeder),
                                          layer_precisions=plan, max_batch=max_batch)
    if feeder.cache_writes:
        print(f"  TensorRT wrote back the calibration cache it read ({feeder.cache_writes} "
              f"time(s)); {folder / 'calibration.cache'} is unchanged.")
    return engine
