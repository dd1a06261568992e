"""SmoothQuant (Xiao et al. 2023): activation outliers of MatMul/Gemm inputs moved into the
weights; one FP32 pass for the per-channel maxima."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from quantlab.calibration.collect import RUN_BYTES
from quantlab.calibration.repairs.base import (
    _ONNX_DOMAINS,
    SCALE_LIMIT,
    RepairReport,
    _channel_reduce,
    _copy,
    _runs,
    _Weights,
)
from quantlab.calibration.repairs.scaling import (
    _channel_figures,
    _in_groups,
    _insert_mul,
    _median_spread,
    _output_channels,
    _place_muls,
    _scale_in,
    _scale_out,
)
from quantlab.data import BatchSource
from quantlab.errors import ConfigError
from quantlab.graph import Graph
from quantlab.metadata import attribute

# SmoothQuant applies where the largest channel max of the activation is at least this
# many times its median channel max (the paper's motivating outliers are ~100x).
DEFAULT_MIN_SPREAD = 4.0


def channel_amax(model: onnx.ModelProto, batches: Iterable[Mapping[str, np.ndarray]],
                 tensors: Sequence[str], run_bytes: int = RUN_BYTES) -> dict[str, np.ndarray]:
    """Max |x| per channel (last axis) of each of `tensors` over all samples: one FP32 pass.

    Streams: each run's tensors are reduced to per-channel maxima and dropped.
    """
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    index = Graph(model)
    names = list(dict.fromkeys(tensors))
    unknown = [name for name in names if name not in index.position and name not in index.outputs]
    if unknown:
        raise ConfigError(f"tensor(s) {unknown[:5]} are not computed by the model.")
    backend = OnnxRuntimeBackend(model, name="fp32")
    result: dict[str, np.ndarray] = {}
    for run in _runs(batches, index, names, run_bytes):
        values = backend.run(run, names)
        for name in names:
            amax = _channel_reduce(values[name], -1, name, "amax")
            result[name] = np.maximum(result[name], amax) if name in result else amax
        del values
    return result


def _smoothable(node: onnx.NodeProto, weights: _Weights, index: Graph) -> bool:
    if node.domain not in _ONNX_DOMAINS or node.op_type not in ("MatMul", "Gemm"):
        return False
    if node.input[0] in index.constants or not weights.float_initializer(node.input[1]):
        return False
    if len(weights.stored[node.input[1]].dims) != 2:
        return False
    return node.op_type == "MatMul" or not attribute(node, "transA", 0)


def smooth_quant(model: onnx.ModelProto,
                 data: Iterable[Mapping[str, np.ndarray]] | Mapping[str, np.ndarray],
                 alpha: float = 0.5, min_spread: float = DEFAULT_MIN_SPREAD,
                 insert_mul: bool = True, run_bytes: int = RUN_BYTES,
                 ) -> tuple[onnx.ModelProto, RepairReport]:
    """SmoothQuant (Xiao et al. 2023): move activation outliers of MatMul/Gemm inputs into weights.

    For each activation X read by MatMul/Gemm ops with constant 2-D weights, with
    per-input-channel maxima ``a_j`` whose largest is at least `min_spread` times
    their median, ``s_j = a_j**alpha / w_j**(1 - alpha)`` (``w_j``: max |W| of input
    channel j over all those ops) divides channel j of X and multiplies the
    weights' row j, so the FP32 function is unchanged and X's per-tensor range
    shrinks. The division is folded into X's producer when X feeds only those
    ops: a LayerNormalization's scale and bias, or a MatMul/Gemm (with its bias
    Add) with constant weights; otherwise a Mul by 1/s is inserted before them
    (`insert_mul`), one FP32 elementwise op. `data` is either the calibration
    batches (one FP32 pass, :func:`channel_amax`) or ``{tensor: per-channel max}``
    already measured (no pass). Returns the smoothed copy and the report (per
    tensor: readers, where 1/s went, spread and amax before/after).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha must be in [0, 1], got {alpha}.")
    if not min_spread >= 1.0:
        raise ConfigError(f"min_spread must be >= 1, got {min_spread}.")
    result = _copy(model)
    weights = _Weights(result)
    index = Graph(result)
    groups = _smoothable_inputs(index, weights)
    report = RepairReport("smooth_quant")
    if not groups:
        return result, report
    stats, report.passes = _channel_figures(
        data, lambda: channel_amax(model, data, list(groups), run_bytes))
    outputs = set(index.outputs)
    muls: dict[str, onnx.NodeProto] = {}
    for tensor, nodes in groups.items():
        names = [n.name for n in nodes]
        act = stats.get(tensor)
        if act is None or not np.isfinite(act).all():
            report.skipped.append({"tensor": tensor, "readers": names,
                                   "reason": "no finite per-channel statistics"})
            continue
        channels = act.size
        ranges = [_in_groups(n, weights.get(n.input[1]), channels) for n in nodes]
        if any(r is None for r in ranges):
            report.skipped.append({"tensor": tensor, "readers": names,
                                   "reason": f"{channels} channels do not match the weights"})
            continue
        spread = _median_spread(act)
        if spread < min_spread:
            report.skipped.append({"tensor": tensor, "readers": names, "spread": spread,
                                   "reason": f"channel maxima spread {spread:.2f} < {min_spread}"})
            continue
        factor, w_max = _smoothing_factor(act, ranges, alpha)
        sole = tensor not in outputs and {id(n) for n in index.consumers.get(tensor, [])} == \
            {id(n) for n in nodes}
        folded = _fold_into_producer(index, weights, tensor, factor) if sole else None
        if folded is None:
            if not insert_mul:
                report.skipped.append({"tensor": tensor, "readers": names, "spread": spread,
                                       "reason": "the producer cannot absorb 1/s and insert_mul "
                                                 "is off"})
                continue
            _, folded = _insert_mul(weights, muls, tensor, nodes, 1.0 / factor, "smoothed",
                                    "SmoothQuant")
        w_before = float(w_max.max())
        for node in nodes:
            name = weights.own(node, 1)
            weights.values[name] = _scale_in(node, weights.get(name), factor)
        w_after = max(float(np.abs(weights.get(n.input[1])).max()) for n in nodes)
        report.applied.append({
            "tensor": tensor, "readers": names, "folded_into": folded,
            "spread": [spread, _median_spread(act / factor)],
            "amax": [float(act.max()), float((act / factor).max())],
            "weight_amax": [w_before, w_after],
        })
    _place_muls(result, muls)
    weights.write()
    return result, report


def _smoothable_inputs(index: Graph, weights: _Weights) -> dict[str, list[onnx.NodeProto]]:
    """Activation tensor -> the MatMul/Gemm ops with constant 2-D weights reading it."""
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in index.model.graph.node:
        if _smoothable(node, weights, index):
            groups.setdefault(node.input[0], []).append(node)
    return groups


def _smoothing_factor(act: np.ndarray, ranges: list[np.ndarray], alpha: float
                      ) -> tuple[np.ndarray, np.ndarray]:
    """SmoothQuant's s_j = a_j**alpha / w_j**(1 - alpha) (eq. 4; 1 for a dead channel, within
    SCALE_LIMIT) and w_j, the readers' max |W| of input channel j."""
    w_max = np.max([np.abs(r).max(axis=(1, 3)).reshape(-1) for r in ranges], axis=0)
    live = (act > 0) & (w_max > 0)
    factor = np.ones(act.size)
    factor[live] = act[live] ** alpha / w_max[live] ** (1.0 - alpha)
    return np.clip(factor, 1 / SCALE_LIMIT, SCALE_LIMIT), w_max


def _fold_into_producer(index: Graph, weights: _Weights, tensor: str,
                        factor: np.ndarray) -> str | None:
    """Divide channel j of `tensor` by factor[j] inside its producer; its name, None if it can't.

    Exact for a LayerNormalization over the last axis (scale and bias are per
    channel) and for a MatMul/Gemm with constant weights, directly or through its
    bias Add (a Linear exported as MatMul + Add).
    """
    producer = index.producers.get(tensor)
    if producer is None or producer.domain not in _ONNX_DOMAINS:
        return None
    channels = factor.size
    if producer.op_type == "LayerNormalization":
        rank = len(index.shapes.get(producer.input[0], ()))
        axis = int(attribute(producer, "axis", -1))
        params = [i for i in (1, 2) if i < len(producer.input) and producer.input[i]]
        if axis not in (-1, rank - 1) or any(
                not weights.float_initializer(producer.input[i]) or
                weights.get(producer.input[i]).shape != (channels,) for i in params):
            return None
        for i in params:
            name = weights.own(producer, i)
            weights.values[name] = weights.get(name) / factor
        return producer.name
    linear, bias_add = producer, None
    if producer.op_type == "Add":
        inputs = list(producer.input)
        constant = [i for i, name in enumerate(inputs) if weights.float_initializer(name)]
        if len(inputs) != 2 or len(constant) != 1 or \
                weights.get(inputs[constant[0]]).shape != (channels,):
            return None
        linear = index.producers.get(inputs[1 - constant[0]])
        if linear is None or len(index.consumers.get(linear.output[0], [])) != 1:
            return None
        bias_add = (producer, constant[0])
    if linear.op_type not in ("MatMul", "Gemm") or not _smoothable(linear, weights, index) or \
            _output_channels(linear, weights.get(linear.input[1]).shape) != (channels, -1):
        return None
    if linear.op_type == "Gemm" and len(linear.input) > 2 and linear.input[2] and \
            (not weights.float_initializer(linear.input[2]) or
             weights.get(linear.input[2]).size not in (1, channels)):
        return None
    name = weights.own(linear, 1)
    weights.values[name] = _scale_out(linear, weights.get(name), 1.0 / factor)
    if linear.op_type == "Gemm" and len(linear.input) > 2 and linear.input[2]:
        bias = weights.own(linear, 2)
        weights.values[bias] = weights.get(bias) / factor
    if bias_add is not None:
        bias = weights.own(bias_add[0], bias_add[1])
        weights.values[bias] = weights.get(bias) / factor
    return linear.name if bias_add is None else f"{linear.name} + {bias_add[0].name}"


@dataclass(frozen=True)
class SmoothQuant:
    """The ``smoothquant`` repair (:class:`~quantlab.calibration.repairs.base.Repair`): one FP32
    pass for the MatMul/Gemm inputs' per-channel maxima."""

    name: str = "smoothquant"
    needs_data: bool = True
    renames: bool = False

    def channel_inputs(self, model: onnx.ModelProto) -> list[str]:
        """None from the statistics pass: SmoothQuant measures its own maxima (last axis)."""
        return []

    def apply(self, model: onnx.ModelProto, source: BatchSource | None,
              channel_ranges: Mapping[str, np.ndarray]) -> tuple[onnx.ModelProto, RepairReport]:
        """:func:`smooth_quant` of `model` on `source`."""
        return smooth_quant(model, source)
