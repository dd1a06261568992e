"""The calibration flow as one call: collect -> calibrate -> Q/DQ model + cache, into a folder.

This is what ``quantlab calibrate`` and ``quantlab demo`` run, and what a
notebook calls directly::

    from quantlab import pipeline
    result = pipeline.run_calibration("model.onnx", "calibration_data/digits/calibration.npy",
                                      out="reports/my-run", method="entropy")
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import onnx

from quantlab import cache, calibrate, collect, graph, qdq
from quantlab.data import BatchSource, Preprocess, open_data
from quantlab.experiment import existing_results, prepare_output, write_json

# Files a calibration run writes; a folder holding any of them is refused unless forced.
CALIBRATION_FILES = (
    "model.onnx",
    "model.int8.onnx",
    "scales.json",
    "calibration.cache",
    "stats.npz",
    "calibration.json",
)
# TensorRT names the algorithm in the cache header; max/percentile/mse caches are
# written with the min-max header because TensorRT has no calibrator of those names.
CACHE_ALGORITHM = {
    "entropy": "EntropyCalibration2",
    "max": "MinMaxCalibration",
    "percentile": "MinMaxCalibration",
    "mse": "MinMaxCalibration",
}


@dataclass
class CalibrationResult:
    """Everything a calibration produced; `folder` is where it was written (None until then)."""

    model: onnx.ModelProto
    qdq_model: onnx.ModelProto
    stats: collect.Statistics
    scales: calibrate.Scales
    data: BatchSource
    folder: Path | None = None


def resolve_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """An ONNX model from a path, a zoo model name, or a ModelProto (normalized)."""
    if isinstance(model, onnx.ModelProto):
        return graph.normalize(model)
    if Path(model).exists():
        return graph.load_model(model)
    # Only a name that is not a file may be a zoo model (importing the zoo imports torch).
    from quantlab import zoo

    if str(model) in zoo.names():
        return export_zoo_model(str(model))
    return graph.load_model(model)


def export_zoo_model(name: str, path: str | os.PathLike | None = None) -> onnx.ModelProto:
    """Export a zoo model to ONNX; the file is kept at `path` if one is given."""
    from quantlab import zoo

    entry = zoo.get(name)
    sample = entry.calibration_set()[:2]
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(path) if path else Path(scratch) / f"{name}.onnx"
        return graph.export_torch(entry.build(), sample, target, output_names=entry.output_names)


def run_calibration(
    model: str | os.PathLike | onnx.ModelProto,
    data: str | os.PathLike | BatchSource | object,
    out: str | os.PathLike,
    method: str = "entropy",
    method_params: Mapping[str, float] | None = None,
    batch_size: int = 32,
    max_samples: int | None = None,
    preprocess: Preprocess | None = None,
    force: bool = False,
    progress: bool = True,
    trt_version: str = cache.DEFAULT_TRT_VERSION,
) -> CalibrationResult:
    """Calibrate `model` on `data` and write the experiment folder `out`.

    Writes ``model.onnx`` (normalized FP32), ``stats.npz``, ``scales.json``,
    ``calibration.cache`` (TensorRT format), ``model.int8.onnx`` (Q/DQ) and
    ``calibration.json`` (what was run). Nothing is written if collection fails.
    `trt_version` goes into the cache header; TensorRT ignores a cache whose
    version is not its own.
    """
    method_params = dict(method_params or {})
    calibrate.check_method(method, method_params)
    model = resolve_model(model)
    inputs = graph.input_specs(model)
    source = (
        data
        if isinstance(data, BatchSource)
        else open_data(data, inputs, batch_size, max_samples, preprocess)
    )
    # Refuse an occupied folder before the long work, create it only after it succeeded:
    # a failed run leaves no partial output.
    existing_results(out, force=force, produces=CALIBRATION_FILES)
    stats = collect.collect(model, source, qdq.activation_tensors_to_calibrate(model),
                            progress=progress)
    scales = calibrate.calibrate(stats, method, **method_params)
    result = CalibrationResult(model, qdq.quantize_model(model, scales.amax), stats, scales, source)
    write_results(result, out, force=force, trt_version=trt_version)
    return result


def write_results(
    result: CalibrationResult,
    out: str | os.PathLike,
    force: bool = False,
    trt_version: str = cache.DEFAULT_TRT_VERSION,
) -> Path:
    """Write a calibration's files into `out` (refused if it holds results, unless `force`)."""
    folder = prepare_output(out, force=force, produces=CALIBRATION_FILES)
    scales = result.scales
    graph.save_model(result.model, folder / "model.onnx")
    result.stats.save(folder / "stats.npz")
    scales.save(folder / "scales.json")
    cache.write_calibration_cache(
        folder / "calibration.cache",
        scales.scale,
        algorithm=CACHE_ALGORITHM[scales.method],
        trt_version=trt_version,
    )
    graph.save_model(result.qdq_model, folder / "model.int8.onnx")
    write_json(
        folder / "calibration.json",
        {
            "data": result.data.description,
            "num_samples": result.data.num_samples,
            "batch_size": result.data.batch_size,
            "method": scales.method,
            "params": scales.params,
            "tensors": len(scales.amax),
        },
    )
    result.folder = folder
    return folder
