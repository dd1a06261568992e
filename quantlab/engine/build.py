"""Build the TensorRT engine of an experiment folder (calibrate, sweep best/ or plan), and
write the trtexec commands that reproduce it (`quantlab build`).

trtexec.txt is always written; model.plan and layers.json where TensorRT is installed. An
implicit build reads a scratch copy of calibration.cache, so TensorRT never rewrites the
folder's cache.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import onnx

from quantlab import graph
from quantlab.engine import cache, trtexec
from quantlab.engine.backends import tensorrt as trt_backend
from quantlab.errors import BackendUnavailableError, ConfigError, ModelError, OutputExistsError
from quantlab.experiments.experiment import atomic_write, write_text
from quantlab.planner.folder import planned_batch, read_plan

ENGINE_FILE = "model.plan"
TRTEXEC_FILE = "trtexec.txt"
LAYERS_FILE = "layers.json"


def build_folder(folder: str | os.PathLike, plan: str | os.PathLike | None = None,
                 max_batch: int | None = None, mode: str = "auto",
                 force: bool = False) -> Path | None:
    """`quantlab build`: write `folder`'s trtexec.txt, then, where TensorRT is installed, build
    its engine in `mode` (auto: strongly typed on TensorRT >= 10, explicit before) and check
    it against the plan (`plan`, default the folder's plan.json). `max_batch` (default: the
    batch a plan folder was planned with, else 1) bounds a dynamic sample axis. Returns the
    engine's path, or None where TensorRT is not installed."""
    folder = Path(folder)
    for name in ("model.onnx", "model.int8.onnx"):
        if not (folder / name).is_file():
            raise ModelError(f"{folder / name} does not exist; build takes a folder written by "
                             "quantlab calibrate.")
    planned = planned_batch(folder)
    max_batch = max_batch or planned or 1
    # The planner (`quantlab plan`) leaves plan.json in its folder: used unless `plan` says.
    plan_path = plan or (folder / "plan.json" if (folder / "plan.json").is_file() else None)
    if plan_path is None and planned is not None:
        raise ConfigError(f"{folder} was written by quantlab plan but has no plan.json: "
                          "without it the plan's FP16/FP32 pins would be dropped from the "
                          "implicit build. Plan again, or pass --plan FILE.")
    precisions = read_plan(plan_path) if plan_path else {}
    model = graph.load_model(folder / "model.onnx")
    int8_model = graph.load_model(folder / "model.int8.onnx")  # damaged: fails here, not in TRT
    unknown = sorted(set(precisions) - {node.name for node in model.graph.node})
    if unknown:
        raise ConfigError(f"the plan names {len(unknown)} node(s) that {folder / 'model.onnx'} "
                          f"does not have: {unknown[:5]}; plan this folder's model.")
    header = scales = cache_name = None
    if (folder / "calibration.cache").is_file():
        header, scales = cache.read_calibration_cache(folder / "calibration.cache")
        cache_name = ("calibration.cache" if header.algorithm == "EntropyCalibration2"
                      else cache.TRTEXEC_CACHE)
    # The comment names the header of the cache trtexec reads (cache_name): EntropyCalibration2
    # either way, relabelled for cache.TRTEXEC_CACHE, as plan writes it.
    trtexec_header = header and header._replace(algorithm="EntropyCalibration2")
    text = trtexec.trtexec_text(
        trt_backend.implicit_pins(model, precisions),
        trt_backend.input_profile(model, max_batch, dynamic_only=True), cache_name,
        trtexec_header and str(trtexec_header), trt_backend.explicit_build_pins(int8_model))
    # trtexec.txt is derived from the folder and the plan: rewriting it unchanged is no loss,
    # replacing different lines needs `force` like every other result.
    target = folder / TRTEXEC_FILE
    if target.exists() and target.read_text(encoding="utf-8") != text and not force:
        raise OutputExistsError(f"{target} holds other commands than the ones for this "
                                f"folder's plan at --max-batch {max_batch} (another plan, or "
                                "another --max-batch); pass --force to replace it.")
    engine_path = folder / ENGINE_FILE
    try:
        version = trt_backend.installed_version()
    except BackendUnavailableError as exc:
        version, missing = None, exc
    if version is not None and engine_path.exists() and not force:
        raise OutputExistsError(f"{engine_path} exists; pass --force to build it again.")
    if cache_name == cache.TRTEXEC_CACHE:
        cache.write_calibration_cache(folder / cache_name, scales, "EntropyCalibration2",
                                      trt_version=header.trt_version)
    write_text(target, text)
    print(f"wrote {target}")
    if version is None:
        print(f"quantlab build: engine not built: {missing}", file=sys.stderr)
        return None
    _build_engine(folder, model, precisions, header, version, mode, max_batch)
    return engine_path


def _build_engine(folder: Path, model: onnx.ModelProto, precisions: dict[str, str], header,
                  version: tuple[int, ...], mode: str, max_batch: int) -> None:
    """Build model.plan in `mode` on the installed TensorRT `version`, write layers.json, and
    say where the engine's layers run in another precision than the plan's."""
    from quantlab.engine.trt_layers import engine_layers, opaque_nodes, precision_mismatches

    mode = trt_backend.default_mode(version) if mode == "auto" else mode
    trt_backend.check_mode(mode, version)
    if mode == "implicit" and header is None:
        raise ConfigError(
            f"{folder} has no calibration.cache, which an implicit INT8 build needs: calibrate "
            f"again with --trt-version {'.'.join(map(str, version))} (the installed TensorRT), "
            "or build from model.int8.onnx (--mode strongly_typed or explicit).")
    source = folder / ("model.onnx" if mode == "implicit" else "model.int8.onnx")
    if mode == "implicit":
        engine = build_implicit(folder, model, precisions, header.algorithm, version, max_batch)
    else:
        engine = trt_backend.build_engine(source, mode, max_batch=max_batch)
    engine_path = folder / ENGINE_FILE
    atomic_write(engine_path, lambda tmp: Path(tmp).write_bytes(engine))
    info = trt_backend.layer_information(engine)
    write_text(folder / LAYERS_FILE, info)
    print(f"wrote {engine_path} ({mode}, TensorRT {'.'.join(map(str, version))}) and "
          f"{folder / LAYERS_FILE}")
    layers = engine_layers(info, graph.load_model(source))
    for mismatch in precision_mismatches(layers, precisions):
        where = f"layer '{mismatch.layer}'" if mismatch.layer else "no engine layer"
        print(f"  plan {mismatch.planned} != engine {mismatch.engine}: node '{mismatch.node}' "
              f"({where})")
    hidden = opaque_nodes(layers, precisions)
    if hidden:
        print(f"  {len(hidden)} planned node(s) run inside Myelin regions, whose precision the "
              f"engine inspector does not report: {hidden[:5]}")


def build_implicit(folder: Path, model, plan: dict[str, str], algorithm: str,
                   version: tuple[int, ...], max_batch: int) -> bytes:
    """The implicit INT8 engine of `folder`'s model.onnx from a scratch copy of its
    calibration.cache (whether TensorRT rewrites a cache it accepted is unsettled: the
    folder's file is never handed to it)."""
    from quantlab.engine.backends.trt_calibrator import CalibrationFeeder, make_calibrator

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
