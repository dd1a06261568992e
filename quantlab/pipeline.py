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
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from quantlab import cache, calibrate, collect, folding, graph, qdq, trt_ranges
from quantlab.backends.onnxruntime import SESSION_CONFIG
from quantlab.data import (
    BatchSource,
    Preprocess,
    data_files,
    files_stamp,
    open_data,
    scalar_arrays,
)
from quantlab.errors import ConfigError, ModelError
from quantlab.experiment import check_output, output_folder, recorded_path, write_json
from quantlab.zoo_names import ZOO_NAMES

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
    preprocess: Preprocess | None = None
    # Repairs applied to the FP32 model before collection (name -> RepairReport.to_dict()).
    repairs: dict = field(default_factory=dict)
    # How the weights' per-channel amax was chosen (qdq.WEIGHT_CRITERIA).
    weight_criterion: str = "max"


def resolve_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """An ONNX model from a path, a zoo model name, or a ModelProto (normalized); a file's
    absolute path or the zoo name is recorded in it (:func:`graph.record_source`)."""
    if isinstance(model, onnx.ModelProto):
        return graph.normalize(model)
    if Path(model).exists():
        return graph.record_source(graph.load_model(model), str(Path(model).resolve()))
    # Only a name that is not a file may be a zoo model (importing the zoo imports torch).
    if str(model) in ZOO_NAMES:
        return graph.record_source(export_zoo_model(str(model)), str(model))
    return graph.load_model(model)


def prepare_model(
    model: str | os.PathLike | onnx.ModelProto,
    data: object = None,
    constants: Mapping[str, object] | None = None,
    batch_axes: Mapping[str, int | None] | None = None,
) -> onnx.ModelProto:
    """The normalized model, fed as the data and options say, with warnings for float-only parts.

    Inputs given a constant value (`constants`, or a 0-d array in the ``.npz`` /
    dict `data` for a model input) are frozen into the model and the control
    flow they decide is inlined (:func:`graph.freeze_inputs`); `batch_axes` is
    recorded in the model (:func:`graph.set_batch_axes`), so the written
    ``model.onnx`` carries both to every later command.
    """
    model = resolve_model(model)
    names = {spec.name for spec in graph.input_specs(model)}
    values = {k: v for k, v in scalar_arrays(data).items() if k in names}
    values.update(constants or {})
    model = graph.freeze_inputs(model, values)
    if batch_axes:
        graph.set_batch_axes(model, batch_axes)
    left = qdq.float_only_nodes(model)
    if left["control_flow"]:
        warnings.warn(
            f"{len(left['control_flow'])} control-flow node(s) hold linear ops that stay in "
            f"float, because quantlab does not quantize inside If/Loop/Scan bodies: "
            f"{left['control_flow'][:5]}. If an input decides the branch (a sample rate, a "
            "mode flag), freeze it with --input NAME=VALUE so the branch is inlined and "
            "quantized.", stacklevel=2)
    kept = folding.kept_batchnorms(model)
    if kept:
        name, reason = next(iter(kept.items()))
        warnings.warn(
            f"{len(kept)} BatchNormalization node(s) could not be folded into the layer before "
            f"them and stay separate layers (TensorRT runs such a BN as a scale layer, outside "
            f"the INT8 conv): '{name}': {reason}.", stacklevel=2)
    if left["custom_domain"]:
        after = untyped_linear_ops(model)
        also = (f"; so do {len(after)} linear op(s) after them, whose inputs have no type "
                f"ONNX shape inference can give (a custom op's output): {after[:5]}. Express "
                "the custom op in standard ONNX ops to quantize those"
                if after else "")
        warnings.warn(
            f"{len(left['custom_domain'])} node(s) of a custom op domain stay in float (their "
            f"math is unknown to quantlab): {left['custom_domain'][:5]}{also}.", stacklevel=2)
    return model


def untyped_linear_ops(model: onnx.ModelProto) -> list[str]:
    """Linear ops downstream of custom-domain nodes that stay in float because an input
    has no inferred float type (``"name (op)"``, in graph order)."""
    floats = graph.float_tensors(model) | {
        init.name for init in model.graph.initializer if init.data_type == onnx.TensorProto.FLOAT}
    consumers = graph.consumers(model)
    frontier = [out for node in model.graph.node if node.domain not in qdq._ONNX_DOMAINS
                for out in node.output]
    reached: set[str] = set()
    while frontier:
        for node in consumers.get(frontier.pop(), []):
            if node.name not in reached:
                reached.add(node.name)
                frontier.extend(node.output)
    return [f"{node.name} ({node.op_type})" for node in model.graph.node
            if node.name in reached and node.op_type in qdq.LINEAR_OPS
            and not all(name in floats for name in node.input[:2])]


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
    method: str = calibrate.DEFAULT_METHOD,
    method_params: Mapping[str, float] | None = None,
    batch_size: int = 32,
    max_samples: int | None = None,
    preprocess: Preprocess | None = None,
    force: bool = False,
    progress: bool = True,
    trt_version: str | None = None,
    constants: Mapping[str, object] | None = None,
    batch_axes: Mapping[str, int | None] | None = None,
    memory_budget: int | str | None = None,
    equalize: bool = True,
    weight_criterion: str = "max",
) -> CalibrationResult:
    """Calibrate `model` on `data` and write the experiment folder `out`.

    With `equalize` (default), depthwise-conv inputs whose channels differ in range are
    equalized first where the statistics predict a gain (:func:`repairs.depthwise_equalization`:
    one more FP32 pass over the data, FP32 function unchanged); ``calibration.json``
    records every depthwise input, treated or not, with the reason.

    `constants` freezes inputs shared by every sample (``{"sr": 16000}``; 0-d
    arrays of an ``.npz`` are taken the same way) and `batch_axes` sets the sample
    axis of inputs whose samples are not on axis 0 (see :func:`prepare_model`).

    Writes ``model.onnx`` (normalized FP32), ``stats.npz``, ``scales.json``,
    ``model.int8.onnx`` (Q/DQ: TensorRT 10/11 explicit quantization, ONNX Runtime) and
    ``calibration.json`` (what was run). Nothing is written if collection fails.

    With `trt_version` (8.x-10.x, the TensorRT that will read it) ``calibration.cache``
    for implicit INT8 is written too. That cache needs a range for every float tensor,
    so every float tensor is collected (ONNX Runtime loses its fusions around the
    exposed tensors; about twice the collection time of the Q/DQ inputs alone).
    """
    method_params = dict(method_params or {})
    calibrate.check_method(method, method_params)
    if weight_criterion not in qdq.WEIGHT_CRITERIA:
        raise ConfigError(f"weight criterion '{weight_criterion}' is not one of "
                          f"{', '.join(qdq.WEIGHT_CRITERIA)}.")
    model = prepare_model(model, data, constants, batch_axes)
    inputs = graph.input_specs(model)
    source = (
        data
        if isinstance(data, BatchSource)
        else open_data(data, inputs, batch_size, max_samples, preprocess)
    )
    graph.record_data_shapes(model, source)  # for TensorRT's profile (build)
    # Every check that could fail after the long work runs before it: an occupied, locked or
    # unwritable folder, the cache's version and tensor names. The folder is written all or
    # nothing (experiment.output_folder): a failed run leaves no partial output.
    check_output(out, force=force, produces=CALIBRATION_FILES)
    model, applied = equalized(model, source) if equalize else (model, {})
    index = graph.Graph(model)  # built once: every step below reads it
    if trt_version is None:
        tensors = quantized_inputs(index, "calibrate for its Q/DQ model. For TensorRT <= 10's "
                                   "implicit INT8, pass --trt-version to calibrate every float "
                                   "tensor into calibration.cache")
    else:
        cache.implicit_int8_version(trt_version)
        tensors = trt_ranges.tensors_to_calibrate(index)  # Q/DQ inputs + TensorRT <= 10 ranges
        check_cache_names(tensors)
    stats = collect.collect(index, source, tensors, progress=progress, memory_budget=memory_budget)
    result = calibrate_from_stats(index, stats, source, method, method_params,
                                  weight_criterion=weight_criterion)
    result.repairs = applied
    write_results(result, out, force=force, trt_version=trt_version)
    return result


def equalized(model: onnx.ModelProto, source: BatchSource) -> tuple[onnx.ModelProto, dict]:
    """`model` with its depthwise-conv inputs equalized where that helps
    (:func:`repairs.depthwise_equalization`, one FP32 pass over `source`), normalized again,
    and ``{repair name: report}`` for ``calibration.json`` (empty without depthwise convs)."""
    from quantlab import repairs

    model, report = repairs.depthwise_equalization(model, source)
    if report.applied:
        model = graph.normalize(model)  # shapes of the renamed tensors
    return model, ({report.repair: report.to_dict()} if report.applied or report.skipped
                   else {})


def quantized_inputs(model: onnx.ModelProto | graph.Graph, what: str) -> list[str]:
    """The activations the Q/DQ model quantizes; a ModelError when there are none, saying
    there is nothing to `what`."""
    tensors = qdq.activation_tensors_to_calibrate(model)
    if not tensors:
        model = model.model if isinstance(model, graph.Graph) else model
        raise ModelError(
            f"{_describe(model)} has no operator quantlab quantizes (Conv, ConvTranspose, "
            "Gemm, MatMul with float inputs, outside If/Loop bodies), so there is nothing to "
            f"{what}.")
    return tensors


def _describe(model: onnx.ModelProto) -> str:
    """The model as a message names it: its graph name."""
    return f"the model '{model.graph.name}'" if model.graph.name else "the model"


def calibrate_from_stats(
    model: onnx.ModelProto | graph.Graph,
    stats: collect.Statistics,
    source: BatchSource,
    method: str = calibrate.DEFAULT_METHOD,
    method_params: Mapping[str, float] | None = None,
    weight_criterion: str = "max",
) -> CalibrationResult:
    """Scales by `method` from statistics already collected, and the Q/DQ model they give
    (weight amax by `weight_criterion`, :func:`qdq.weight_amax`). The result's `preprocess`
    is the one `source` applied (None for arrays).

    `stats` must cover :func:`qdq.activation_tensors_to_calibrate` of the normalized
    `model` (and :func:`trt_ranges.tensors_to_calibrate` for a calibration cache); one
    collection serves every method (the demo compares them all).
    """
    scales = calibrate.calibrate(stats, method, **dict(method_params or {}))
    index = qdq.indexed(model)
    quantized = qdq.quantize_model(index, scales.amax, weight_criterion=weight_criterion)
    return CalibrationResult(index.model, quantized, stats, scales, source,
                             preprocess=source.preprocess, weight_criterion=weight_criterion)


def write_results(
    result: CalibrationResult,
    out: str | os.PathLike,
    force: bool = False,
    trt_version: str | None = None,
) -> Path:
    """Write a calibration's files into `out` (refused if it holds results, unless `force`).

    ``calibration.cache`` is written for TensorRT `trt_version` when given; the
    statistics must then hold a range for every tensor implicit INT8 needs.

    All or nothing: the files are written into a staging folder next to `out` and
    replace the old ones only once all are complete (:func:`experiment.output_folder`).
    """
    scales = result.scales
    if trt_version is not None:
        cache.implicit_int8_version(trt_version)
        missing = trt_ranges.missing_ranges(result.model, scales.scale)
        if missing:
            raise ConfigError(
                f"no calibration.cache for TensorRT {trt_version}: the statistics have no range "
                f"for {len(missing)} tensor(s) implicit INT8 needs ({missing[:3]}...); they hold "
                "the Q/DQ model's inputs only. Calibrate again with --trt-version (statistics "
                "of every float tensor)."
            )
    with output_folder(out, force=force, produces=CALIBRATION_FILES) as folder:
        graph.save_model(result.model, folder / "model.onnx")
        result.stats.save(folder / "stats.npz")
        scales.save(folder / "scales.json")
        if trt_version is not None:
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
                # The user's model file (absolute) or zoo name; model.onnx is its normalized copy.
                "model": graph.source_model(result.model),
                # Absolute: a later command (plan --data DIR) may run from anywhere.
                "data": recorded_path(result.data.description),
                # Size and mtime of its files: `plan --data DIR` reuses stats.npz only while
                # they are unchanged.
                "data_stamp": files_stamp(data_files(result.data.description)),
                "num_samples": result.data.num_samples,
                "batch_size": result.data.batch_size,
                "method": scales.method,
                "params": scales.params,
                "tensors": len(scales.amax),
                "trt_version": trt_version,
                # How the images were read, so `validate --from` reads them the same way; null
                # where none was applied (arrays are fed as they are).
                "preprocess": result.preprocess.to_dict() if result.preprocess else None,
                "frozen_inputs": graph.frozen_inputs(result.model),
                "sample_axes": {spec.name: spec.batch_axis
                                for spec in graph.input_specs(result.model)},
                # Run model.int8.onnx in ONNX Runtime with these session config entries
                # to get the numbers quantlab reports (see backends/onnxruntime.py).
                "onnxruntime_session_config": SESSION_CONFIG,
                # FP32-preserving rewrites of model.onnx before collection, with what each
                # treated and left alone (and why).
                "repairs": result.repairs,
                "weight_amax": result.weight_criterion,
            },
        )
    result.folder = Path(out)
    return result.folder


# Characters str.splitlines() breaks at: a cache line (and its reader) cannot hold them.
_LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


def check_cache_names(names: Iterable[str]) -> None:
    """ModelError unless every tensor name fits on one calibration cache line (cheap)."""
    for name in names:
        if not name or _LINE_BREAKS.intersection(name):
            raise ModelError(
                f"tensor name {name!r} cannot be written to a TensorRT calibration cache: a "
                "cache line holds one non-empty, single-line name. Rename the tensor in the "
                "model (its producer's output) and calibrate again."
            )
