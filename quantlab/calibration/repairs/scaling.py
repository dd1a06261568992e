"""Per-channel scaling of weights and inserted Muls, shared by cle, SmoothQuant and equalization."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from quantlab.calibration.qdq import weight_axis
from quantlab.calibration.repairs.base import (
    _Weights,
)
from quantlab.metadata import attribute


def _weight_in_axis(node: onnx.NodeProto) -> int:
    """Input-channel axis of a Conv / Gemm / MatMul weight."""
    if node.op_type == "Conv":
        return 1
    if node.op_type == "Gemm":
        return 1 if attribute(node, "transB", 0) else 0
    return 0


def _out_view(node: onnx.NodeProto, weight: np.ndarray) -> np.ndarray:
    """`weight` as [output channels, -1] (a view order; reshape back with _from_out)."""
    axis = weight_axis(node, 1, weight.ndim)
    return np.moveaxis(weight, axis, 0).reshape(weight.shape[axis], -1)


def _scale_out(node: onnx.NodeProto, weight: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """`weight` with output channel c multiplied by factor[c]."""
    shape = [1] * weight.ndim
    shape[weight_axis(node, 1, weight.ndim)] = -1
    return weight * factor.reshape(shape)


def _in_groups(node: onnx.NodeProto, weight: np.ndarray, channels: int) -> np.ndarray | None:
    """`weight` as [groups, outputs per group, inputs per group, -1], None if it mismatches.

    Input channel c of a (grouped) Conv is read by group c // (C / g) at column
    c % (C / g); Gemm/MatMul weights are one group.
    """
    if node.op_type == "Conv":
        groups = int(attribute(node, "group", 1))
        per_group = weight.shape[1]
        if per_group * groups != channels or weight.shape[0] % groups:
            return None
        return weight.reshape(groups, weight.shape[0] // groups, per_group, -1)
    in_axis = _weight_in_axis(node)
    if weight.shape[in_axis] != channels:
        return None
    moved = np.moveaxis(weight, in_axis, 1)
    return moved.reshape(1, moved.shape[0], channels, 1)


def _scale_in(node: onnx.NodeProto, weight: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """`weight` with input channel c multiplied by factor[c]."""
    grouped = _in_groups(node, weight, factor.size)
    scaled = grouped * factor.reshape(grouped.shape[0], 1, grouped.shape[2], 1)
    if node.op_type == "Conv":
        return scaled.reshape(weight.shape)
    in_axis = _weight_in_axis(node)
    moved_shape = np.moveaxis(weight, in_axis, 1).shape
    return np.moveaxis(scaled.reshape(moved_shape), 1, in_axis)


def _in_ranges(node: onnx.NodeProto, weight: np.ndarray, channels: int) -> np.ndarray:
    grouped = _in_groups(node, weight, channels)
    return np.abs(grouped).max(axis=(1, 3)).reshape(-1)


def _output_channels(node: onnx.NodeProto, shape: Sequence[int]) -> tuple[int, int] | None:
    """(channels, channel axis of the output) of a linear op with weight `shape`, None if unsure."""
    if node.op_type == "Conv":
        return shape[0], 1
    if node.op_type == "ConvTranspose":
        return shape[1] * int(attribute(node, "group", 1)), 1
    if len(shape) != 2:
        return None
    if node.op_type == "Gemm":
        return (shape[0] if attribute(node, "transB", 0) else shape[1]), -1
    return shape[1], -1


def _median_spread(amax: np.ndarray) -> float:
    """Largest channel max over the median channel max (inf when the median is 0)."""
    median = float(np.median(amax))
    return float(amax.max()) / median if median > 0 else float("inf")


def _channel_figures(data, measure) -> tuple[dict[str, np.ndarray], int]:
    """Per-channel figures given as ``{tensor: 1-D array}`` (no pass), or measured on the
    batches `data` by `measure()` (one FP32 pass); with the number of passes."""
    if isinstance(data, Mapping) and all(np.ndim(v) == 1 for v in data.values()):
        return {name: np.asarray(value, np.float64) for name, value in data.items()}, 0
    return measure(), 1


def _insert_mul(weights: _Weights, muls: dict[str, onnx.NodeProto], tensor: str,
                nodes: Sequence[onnx.NodeProto], inverse: np.ndarray, suffix: str,
                label: str) -> tuple[str, str]:
    """A Mul of `tensor` by the constant `inverse` feeding `nodes` instead of `tensor` (placed
    before the first of them by :func:`_place_muls`); its output name and description."""
    scaled = weights.fresh(f"{tensor}_{suffix}")
    constant = weights.add(f"{tensor}_{suffix}_inverse", inverse)
    muls[nodes[0].name] = helper.make_node("Mul", [tensor, constant], [scaled],
                                           name=weights.fresh(f"{tensor}_{label}_Mul"))
    for node in nodes:
        node.input[0] = scaled
    return scaled, f"Mul '{muls[nodes[0].name].name}' (inserted)"


def _place_muls(model: onnx.ModelProto, muls: Mapping[str, onnx.NodeProto]) -> None:
    """Put each inserted Mul right before the node it was made for (topological order)."""
    if not muls:
        return
    nodes = []
    for node in model.graph.node:
        if node.name in muls:
            nodes.append(muls[node.name])
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
