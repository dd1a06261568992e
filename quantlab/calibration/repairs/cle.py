"""Cross-layer equalization (Nagel et al. 2019, DFQ section 4.1): consecutive linear ops'
channel ranges equalized through homogeneous activations; weights only, no data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from quantlab.calibration.qdq import weight_axis
from quantlab.calibration.repairs.base import (
    _ONNX_DOMAINS,
    HOMOGENEOUS_OPS,
    SCALE_LIMIT,
    RepairReport,
    _copy,
    _Weights,
)
from quantlab.calibration.repairs.scaling import (
    _in_groups,
    _in_ranges,
    _out_view,
    _scale_in,
    _scale_out,
)
from quantlab.data import BatchSource
from quantlab.errors import ConfigError
from quantlab.graph import Graph
from quantlab.metadata import attribute


@dataclass
class _Pair:
    first: onnx.NodeProto
    second: onnx.NodeProto
    through: list[str]


def _equalizable(node: onnx.NodeProto, weights: _Weights) -> bool:
    if node.domain not in _ONNX_DOMAINS or len(node.input) < 2:
        return False
    if node.op_type == "Gemm":
        if attribute(node, "transA", 0):
            return False
    elif node.op_type not in ("Conv", "MatMul"):
        return False
    if not weights.float_initializer(node.input[1]):
        return False
    rank = len(weights.stored[node.input[1]].dims)
    if node.op_type == "MatMul" and rank != 2:
        return False
    return len(node.input) < 3 or not node.input[2] or weights.float_initializer(node.input[2])


def _family(node: onnx.NodeProto) -> str:
    # Conv's channels are axis 1 of its output, Gemm's and MatMul's the last axis.
    return "conv" if node.op_type == "Conv" else "matrix"


def _cle_pairs(index: Graph, weights: _Weights) -> tuple[list[_Pair], list[dict]]:
    """Linear op -> (homogeneous ops) -> linear op chains CLE can rescale, and the blocked ones."""
    outputs = set(index.outputs)
    pairs, skipped = [], []
    for node in index.model.graph.node:
        if not _equalizable(node, weights):
            continue
        tensor, through = node.output[0], []
        while True:
            readers = index.consumers.get(tensor, [])
            if tensor in outputs or len(readers) != 1:
                skipped.append({"first": node.name, "reason": (
                    f"its output '{tensor}' is a graph output" if tensor in outputs else
                    f"nothing reads '{tensor}'" if not readers else
                    f"'{tensor}' has {len(readers)} readers "
                    f"({', '.join(r.op_type for r in readers[:4])}); a pair needs one linear op "
                    "reading it alone (a decomposed HardSwish reads it twice: depthwise-input "
                    "equalization handles such chains)")})
                break
            reader = readers[0]
            if reader.op_type in HOMOGENEOUS_OPS and reader.domain in _ONNX_DOMAINS:
                through.append(reader.name)
                tensor = reader.output[0]
                continue
            if _equalizable(reader, weights) and reader.input[0] == tensor and \
                    _family(reader) == _family(node):
                pairs.append(_Pair(node, reader, through))
            elif reader.op_type in ("Conv", "Gemm", "MatMul"):
                skipped.append({"first": node.name, "second": reader.name,
                                "reason": "the second op is not a float Conv/Gemm/MatMul of the "
                                          "same channel layout with constant weights"})
            else:
                skipped.append({
                    "first": node.name,
                    "reason": f"{reader.op_type} '{reader.name}' reads its output and is not "
                              "positive-homogeneous per channel (f(x/s) != f(x)/s)" +
                              ("; Clip/ReLU6 would have to become Relu (AIMET does so, at an "
                               "accuracy cost)" if reader.op_type == "Clip" else "")})
            break
    return pairs, skipped


def _spread(ranges: np.ndarray) -> float:
    """max / min of the non-zero per-channel ranges (1.0 when all equal)."""
    live = ranges[ranges > 0]
    return float(live.max() / live.min()) if live.size else 1.0


def cross_layer_equalization(model: onnx.ModelProto, max_sweeps: int = 50,
                             tolerance: float = 1e-4) -> tuple[onnx.ModelProto, RepairReport]:
    """Equalize per-channel weight ranges of consecutive linear ops (DFQ, Nagel et al. 2019).

    For every Conv -> Conv (and Gemm/MatMul -> Gemm/MatMul) whose intermediate
    tensor reaches only the second op, directly or through positive-homogeneous
    per-channel ops (Relu, LeakyRelu, MaxPool, Identity), channel c of the first
    op's output is divided by ``s_c = sqrt(r1_c * r2_c) / r2_c`` (its weights and
    bias) and the second op's weights reading channel c are multiplied by s_c;
    r1 is the first op's max |w| per output channel, r2 the second's max |w| per
    input channel, grouped and depthwise convs included. Both then have range
    ``sqrt(r1 * r2)`` per channel and the FP32 function is unchanged. Chains are
    swept until no factor moves by more than `tolerance` (at most `max_sweeps`).
    Data-free: no forward pass. Returns the equalized copy and the report (one
    entry per pair with the range spreads before/after; skipped chains with why).
    Raises ModelError when a weight to rescale holds NaN or Inf.
    """
    if max_sweeps < 1 or not tolerance > 0:
        raise ConfigError(f"max_sweeps must be >= 1 and tolerance > 0, got {max_sweeps}, "
                          f"{tolerance}.")
    result = _copy(model)
    weights = _Weights(result)
    index = Graph(result)
    pairs, skipped = _cle_pairs(index, weights)
    report = RepairReport("cross_layer_equalization", skipped=skipped)
    usable = []
    for pair in pairs:
        first_w, second_w = weights.get(pair.first.input[1]), weights.get(pair.second.input[1])
        channels = first_w.shape[weight_axis(pair.first, 1, first_w.ndim)]
        if _in_groups(pair.second, second_w, channels) is None:
            report.skipped.append({"first": pair.first.name, "second": pair.second.name,
                                   "reason": f"{channels} output channels do not match the "
                                             "second op's input channels"})
            continue
        usable.append(pair)
    # Weights shared with another node are copied first, so rescaling touches only the pair.
    for pair in usable:
        for node in (pair.first, pair.second):
            for i in range(1, min(len(node.input), 3)):
                if node.input[i]:
                    weights.own(node, i)
    before = {id(p): _pair_ranges(p, weights) for p in usable}
    total = {id(p): np.ones(before[id(p)][0].size) for p in usable}
    sweeps = 0
    while usable and sweeps < max_sweeps:
        sweeps += 1
        largest = 0.0
        for pair in usable:
            r1, r2 = _pair_ranges(pair, weights)
            live = (r1 > 0) & (r2 > 0)
            factor = np.ones_like(r1)
            factor[live] = np.sqrt(r1[live] * r2[live]) / r2[live]
            factor = np.clip(factor, 1 / SCALE_LIMIT, SCALE_LIMIT)
            _apply_factor(pair, weights, factor)
            total[id(pair)] *= factor
            largest = max(largest, float(np.abs(np.log(factor)).max(initial=0.0)))
        if largest <= tolerance:
            break
    for pair in usable:
        r1, r2 = before[id(pair)]
        a1, a2 = _pair_ranges(pair, weights)
        report.applied.append({
            "first": pair.first.name, "second": pair.second.name, "through": pair.through,
            "channels": int(r1.size),
            "first_range_spread": [_spread(r1), _spread(a1)],
            "second_range_spread": [_spread(r2), _spread(a2)],
            "scale_min": float(total[id(pair)].min()), "scale_max": float(total[id(pair)].max()),
        })
    report.summary["sweeps"] = sweeps
    weights.write()
    return result, report


def _pair_ranges(pair: _Pair, weights: _Weights) -> tuple[np.ndarray, np.ndarray]:
    first_w = weights.get(pair.first.input[1])
    r1 = np.abs(_out_view(pair.first, first_w)).max(axis=1)
    r2 = _in_ranges(pair.second, weights.get(pair.second.input[1]), r1.size)
    return r1, r2


def _apply_factor(pair: _Pair, weights: _Weights, factor: np.ndarray) -> None:
    """Divide the first op's output channels by `factor`, multiply the second's inputs by it."""
    first_w = pair.first.input[1]
    weights.values[first_w] = _scale_out(pair.first, weights.get(first_w), 1 / factor)
    if len(pair.first.input) > 2 and pair.first.input[2]:
        bias = pair.first.input[2]
        # A Conv bias is [C]; Gemm's C broadcasts along its last axis (a scalar becomes [N]).
        weights.values[bias] = weights.get(bias) / factor
    second_w = pair.second.input[1]
    weights.values[second_w] = _scale_in(pair.second, weights.get(second_w), factor)


@dataclass(frozen=True)
class CrossLayerEqualization:
    """The ``cle`` repair (:class:`~quantlab.calibration.repairs.base.Repair`): weights only, no
    data."""

    name: str = "cle"
    needs_data: bool = False
    renames: bool = False

    def channel_inputs(self, model: onnx.ModelProto) -> list[str]:
        """None: cle reads weights alone."""
        return []

    def apply(self, model: onnx.ModelProto, source: BatchSource | None,
              channel_ranges: Mapping[str, np.ndarray]) -> tuple[onnx.ModelProto, RepairReport]:
        """:func:`cross_layer_equalization` of `model`."""
        return cross_layer_equalization(model)
