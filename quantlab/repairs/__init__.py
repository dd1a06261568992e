"""Repairs that change weights, not precisions: equalization, bias correction, SmoothQuant.

The repairs step of the planner (docs/planner.md): each repair rewrites a
model so that INT8 loses less, at no runtime cost (SmoothQuant's inserted Mul
excepted), and competes with pins in the planner. Every function works on
``onnx.ModelProto`` (the normalized FP32 model, or the Q/DQ model
:func:`quantlab.qdq.quantize_model` built from it) and plain data, and returns
the repaired copy with a :class:`RepairReport` saying what changed and what was
left alone and why. docs/repairs.md gives the formulas, their sources and the
measured effect on the zoo models.

Costs, in forward passes per calibration sample:

- :func:`cross_layer_equalization`: none (weights only).
- :func:`bias_correction`: one pass of the FP32 graph with the local graph attached, the
  errors summed in it (``mode="local"``),
  or one FP32 pass and `rounds` Q/DQ passes (``mode="global"``); :func:`bias_shifts`
  measures as the local mode does and :func:`shift_biases` applies its shifts to any
  plan's INT8 ops.
- :func:`smooth_quant`: one FP32 pass for the per-channel ranges (none when given).

Passes stream: batches run in slices whose exposed tensors fit `run_bytes`, and
each run is folded into per-channel sums or maxima and dropped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quantlab import graph
from quantlab.collect import CHANNEL_BINS, RUN_BYTES, ChannelFold, ChannelStats
from quantlab.data import batch_length, sample_axes, slice_batch
from quantlab.errors import ConfigError, DataError, ModelError
from quantlab.graph import Graph
from quantlab.metadata import attribute
from quantlab.qdq import FreshNames, weight_axis

_ONNX_DOMAINS = ("", "ai.onnx")
# Ops f with f(x / s) == f(x) / s per channel for every s > 0 (positive homogeneity,
# DFQ section 4.1), acting on each channel alone: a per-channel scale passes through
# them. Clip (ReLU6) does not (its bounds are scalars), nor HardSwish, Sigmoid, etc.
HOMOGENEOUS_OPS = frozenset({"Relu", "LeakyRelu", "MaxPool", "Identity"})
# Scale factors are kept in [1 / LIMIT, LIMIT]: beyond that a channel is dead in one
# layer (range ~0) and equalizing it would only amplify float rounding.
SCALE_LIMIT = 1e5


@dataclass
class RepairReport:
    """What one repair did: the places it changed, the candidates it skipped, its cost.

    `applied` and `skipped` hold one plain dict per place (tensor and node names,
    figures before/after, the reason for a skip); `passes` is the number of forward
    passes per calibration sample the repair ran (FP32 and Q/DQ together);
    `summary` holds repair-wide figures (sweeps, rounds, samples).
    """

    repair: str
    applied: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    passes: int = 0
    summary: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        return asdict(self)


# ------------------------------------------------------------------ shared helpers


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _initializer_uses(model: onnx.ModelProto) -> dict[str, int]:
    uses: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    return uses


class _Weights:
    """Float initializers of a model copy, read as float64 arrays and written back once."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.stored = {init.name: init for init in model.graph.initializer}
        self.uses = _initializer_uses(model)
        self.fresh = FreshNames(model)
        self.values: dict[str, np.ndarray] = {}

    def float_initializer(self, name: str) -> bool:
        return name in self.stored and self.stored[name].data_type == onnx.TensorProto.FLOAT

    def get(self, name: str) -> np.ndarray:
        if name not in self.values:
            value = numpy_helper.to_array(self.stored[name]).astype(np.float64)
            if not np.isfinite(value).all():
                raise ModelError(
                    f"initializer '{name}' holds NaN or Inf; a repair cannot rescale it. Fix "
                    "the weights of the exported model (re-export from a finite checkpoint).")
            self.values[name] = value
        return self.values[name]

    def own(self, node: onnx.NodeProto, index: int) -> str:
        """The name of input `index` of `node`, first copied if another node reads it too."""
        name = node.input[index]
        if self.uses.get(name, 0) > 1:
            copy = self.fresh(f"{name}_repaired")
            self.values[copy] = self.get(name).copy()
            self.stored[copy] = self._append(copy)
            self.uses[name] -= 1
            self.uses[copy] = 1
            node.input[index] = copy
            name = copy
        return name

    def add(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.values[name] = np.asarray(value, np.float64)
        self.stored[name] = self._append(name)
        self.uses[name] = 1
        return name

    def _append(self, name: str) -> onnx.TensorProto:
        # A repeated protobuf field stores a copy of what is appended: return the stored one.
        self.model.graph.initializer.add(name=name, data_type=onnx.TensorProto.FLOAT)
        return self.model.graph.initializer[-1]

    def write(self) -> None:
        for name, value in self.values.items():
            self.stored[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))


def _runs(batches: Iterable[Mapping[str, np.ndarray]], index: Graph, tensors: Sequence[str] | None,
          run_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    """The samples of `batches` in runs whose exposed `tensors` (None: all) fit `run_bytes`
    (one sample at least).

    A model with a fixed batch size runs its batches whole.
    """
    axes = sample_axes(index.inputs)
    fixed = graph.fixed_batch_size(index.model)
    run_size = None
    count = 0
    for batch in batches:
        count += 1
        if fixed:
            yield dict(batch)
            continue
        size = batch_length(batch, axes)
        if run_size is None:
            one = slice_batch(batch, axes, 0, 1)
            run_size = index.samples_within({name: np.shape(value) for name, value in one.items()},
                                            run_bytes, tensors)
        for start in range(0, size, run_size):
            yield slice_batch(batch, axes, start, min(size, start + run_size))
    if not count:
        raise DataError("the calibration data holds no batches; a repair that measures needs "
                        "at least one sample.")


def _channel_reduce(value: np.ndarray, axis: int, name: str, how: str) -> np.ndarray:
    """Per-channel float64 sum (how="sum") or max |x| (how="amax") of `value` along `axis`."""
    value = np.asarray(value)
    moved = np.moveaxis(value, axis, -1).reshape(-1, value.shape[axis])
    if how == "sum":
        result = moved.sum(axis=0, dtype=np.float64)
    else:
        result = np.abs(moved).max(axis=0, initial=0.0).astype(np.float64)
    if not np.isfinite(result).all():
        raise DataError(f"tensor '{name}' holds NaN or Inf on the calibration data; fix the "
                        "data or the layer producing it before repairing the model.")
    return result


# ------------------------------------------------------------ cross-layer equalization


@dataclass
class _Pair:
    first: onnx.NodeProto
    second: onnx.NodeProto
    through: list[str]


def _weight_in_axis(node: onnx.NodeProto) -> int:
    """Input-channel axis of a Conv / Gemm / MatMul weight."""
    if node.op_type == "Conv":
        return 1
    if node.op_type == "Gemm":
        return 1 if attribute(node, "transB", 0) else 0
    return 0


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


# --------------------------------------------------------------------- bias correction


@dataclass
class _Target:
    node: str
    output: str
    axis: int  # channel axis of the output
    channels: int
    bias: str  # float initializer holding the bias (made when the op had none)
    gain: float  # Gemm's beta: the bias enters the output as gain * C
    added: bool
    measured: str  # the op's own output in the Q/DQ model given (what "local" compares)


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


def _correction_targets(result: onnx.ModelProto, weights: _Weights, reference: Graph,
                        only: Iterable[str] | None = None) -> tuple[list[_Target], list[dict]]:
    """INT8 linear ops of a Q/DQ model whose bias can take a correction (biases made if absent).

    With `only`, the ops of those names alone.
    """
    only = None if only is None else set(only)
    producers = graph.producers(result)
    consumers = graph.consumers(result)
    known = set(reference.order) | set(reference.outputs)
    targets, skipped = [], []
    inserted: dict[str, onnx.NodeProto] = {}
    for node in result.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or \
                node.domain not in _ONNX_DOMAINS or len(node.input) < 2 or \
                (only is not None and node.name not in only):
            continue
        dequantize = producers.get(node.input[1])
        if dequantize is None or dequantize.op_type != "DequantizeLinear" or \
                dequantize.input[0] not in weights.stored:
            continue  # not INT8 in this model: no quantization error of its own
        measured = node.output[0]
        found = _output_channels(node, list(weights.stored[dequantize.input[0]].dims))
        channels, axis = found if found is not None else (0, 0)
        bias_add = _bias_add(node, consumers, weights, channels) if found else None
        output = bias_add[0].output[0] if bias_add else node.output[0]
        if found is None or output not in known or reference.dtype(output) != np.float32:
            skipped.append({"node": node.name, "reason": f"output '{output}' is not a float32 "
                            "tensor of the FP32 model with a known channel axis"})
            continue
        gain = float(attribute(node, "beta", 1.0)) if node.op_type == "Gemm" else 1.0
        if gain == 0.0:
            skipped.append({"node": node.name, "reason": "Gemm with beta = 0 ignores its bias"})
            continue
        has_bias = bias_add is not None or (
            node.op_type != "MatMul" and len(node.input) > 2 and bool(node.input[2]))
        if bias_add is not None:
            bias = weights.own(*bias_add)
        elif has_bias:
            if not weights.float_initializer(node.input[2]) or \
                    weights.get(node.input[2]).size not in (1, channels) or \
                    (node.op_type != "Gemm" and weights.get(node.input[2]).size != channels):
                skipped.append({"node": node.name, "reason": f"bias '{node.input[2]}' is not a "
                                f"float32 constant of {channels} channels"})
                continue
            bias = weights.own(node, 2)
            # Gemm's C may be a scalar or [1, N]: spelled out per channel, it broadcasts the same.
            weights.values[bias] = np.broadcast_to(weights.get(bias).reshape(-1),
                                                   (channels,)).copy()
        else:
            bias = weights.add(f"{node.name}_bias", np.zeros(channels))
            if node.op_type == "MatMul":
                # y = MatMul(x, W) + b, the Add writing the MatMul's old output name.
                plain = weights.fresh(f"{output}_without_bias")
                node.output[0] = plain
                inserted[node.name] = helper.make_node(
                    "Add", [plain, bias], [output], name=weights.fresh(f"{node.name}_bias_add"))
            elif len(node.input) > 2:
                node.input[2] = bias
            else:
                node.input.append(bias)
        targets.append(_Target(node.name, output, axis, channels, bias, gain, not has_bias,
                               measured))
    if inserted:
        nodes = []
        for node in result.graph.node:
            nodes.append(node)
            if node.name in inserted:
                nodes.append(inserted[node.name])
        del result.graph.node[:]
        result.graph.node.extend(nodes)
    return targets, skipped


def _bias_add(node: onnx.NodeProto, consumers: Mapping[str, list[onnx.NodeProto]],
              weights: _Weights, channels: int) -> tuple[onnx.NodeProto, int] | None:
    """(Add, input index) of the bias a MatMul's only reader adds ([channels] constant), or None.

    torch exports a Linear on 3-D inputs as MatMul followed by such an Add.
    """
    readers = consumers.get(node.output[0], [])
    if node.op_type != "MatMul" or len(readers) != 1 or readers[0].op_type != "Add" or \
            len(readers[0].input) != 2:
        return None
    add = readers[0]
    for index, name in enumerate(add.input):
        if add.input[1 - index] == node.output[0] and weights.float_initializer(name) and \
                weights.get(name).shape == (channels,):
            return add, index
    return None


def _reiterable(batches: Iterable, uses: int) -> None:
    if uses > 1 and iter(batches) is batches:
        raise ConfigError("the calibration batches are a one-shot iterator, but this repair "
                          f"reads them {uses} times; pass a BatchSource (quantlab.data.open_data) "
                          "or a list of batches.")


BIAS_CORRECTION_MODES = ("local", "global")


def bias_correction(fp32_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                    batches: Iterable[Mapping[str, np.ndarray]], mode: str = "local",
                    rounds: int = 2, run_bytes: int = RUN_BYTES,
                    ) -> tuple[onnx.ModelProto, RepairReport]:
    """Empirical bias correction (DFQ section 4.2; AIMET's empirical variant) of a Q/DQ model.

    For every INT8 linear op of `qdq_model` (weight read through DequantizeLinear)
    the mean over `batches` of (quantized output - FP32 output) per output
    channel is subtracted from its bias; a Conv/Gemm without bias gets one, a
    MatMul an Add after it (the output keeps its name), a MatMul already followed
    by a bias Add has that Add's constant corrected.

    ``mode="local"`` (default, one pass): each op runs quantized on the FP32
    inputs (:func:`quantlab.sensitivity.local_error_model`), so its error is its
    own and all ops are corrected at once without counting an upstream error
    twice (NNCF's FastBiasCorrection measures the same way). Cost per sample:
    one FP32 pass and one pass of the local graph (each INT8 op once).

    ``mode="global"``: errors are measured on the whole Q/DQ model, as AIMET
    does, so what reaches an op from quantized upstream layers (Relu
    rectification included) is corrected too. AIMET corrects layer after layer
    (one pass per layer); here all ops are corrected together in `rounds`
    rounds, each re-measuring the corrected model (Jacobi iteration towards the
    sequential solution; exact after as many rounds as the longest chain of
    ops, and it can overshoot before: measured on the zoo in docs/repairs.md).
    Cost per sample: one FP32 pass and `rounds` Q/DQ passes.

    Memory: runs sized to `run_bytes`, folded into per-channel sums. `batches` is
    read once ("local") or `rounds` times (a BatchSource or a list). Returns the
    corrected copy and the report (per op: max |mean error| per round, largest
    correction).
    """
    corrected, report, _, _ = _bias_correction(fp32_model, qdq_model, batches, mode, rounds,
                                               run_bytes)
    return corrected, report


def bias_shifts(fp32_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                batches: Iterable[Mapping[str, np.ndarray]], run_bytes: int = RUN_BYTES,
                ) -> tuple[dict[str, np.ndarray], RepairReport]:
    """Local bias correction's output shift per channel of every INT8 linear op of `qdq_model`.

    Measured as :func:`bias_correction` ``mode="local"`` measures (each op quantized
    on FP32 inputs), so an op's shift is its own error's and holds whatever
    precision the other ops run in: the planner measures it once on the all-INT8
    model and applies it to the INT8 ops of any plan (:func:`shift_biases`).
    Returns node -> shift (added to the op's output, -mean error) and the report.
    """
    _, report, shifts, _ = _bias_correction(fp32_model, qdq_model, batches, "local", 1,
                                            run_bytes)
    return shifts, report


def bias_shift_folds(fp32_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                     parts: Sequence[Iterable[Mapping[str, np.ndarray]]],
                     run_bytes: int = RUN_BYTES,
                     ) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray], RepairReport]:
    """:func:`bias_shifts` measured on each of `parts` (disjoint shares of the data), and the
    shifts of all of them together with its report, as :func:`bias_correction` gives them.

    Local bias correction's shift is a per-channel mean, so the shifts of the whole data
    are the parts' means weighted by the elements each counted: one local pass over the
    data in all, where measuring the parts and then the whole took two.
    """
    measured = [_bias_correction(fp32_model, qdq_model, part, "local", 1, run_bytes)
                for part in parts]
    counts = [m[3] for m in measured]
    pooled = {node: sum(m[2][node] * c[node] for m, c in zip(measured, counts, strict=True))
                    / max(sum(c[node] for c in counts), 1.0) for node in measured[0][2]}
    report = measured[0][1]
    for entry in report.applied:
        largest = float(np.abs(pooled[entry["node"]]).max())
        entry.update({"mean_error_max_per_round": [largest], "correction_max": largest})
    return [m[2] for m in measured], pooled, report


def shift_biases(fp32_model: onnx.ModelProto | Graph, qdq_model: onnx.ModelProto,
                 shifts: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `qdq_model` whose INT8 linear ops in `shifts` have their output shifted by it.

    The shift (node -> per output channel, :func:`bias_shifts`) goes into the op's
    bias (made when absent; a Gemm's divided by its beta). Ops that are not INT8 in
    `qdq_model` keep their bias: the shift corrects INT8's error only.
    """
    result = _copy(qdq_model)
    weights = _Weights(result)
    targets, _ = _correction_targets(result, weights, Graph.of(fp32_model), only=shifts)
    for t in targets:
        weights.values[t.bias] = weights.get(t.bias) + shifts[t.node] / t.gain
    weights.write()
    return result


def _bias_correction(fp32_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                     batches: Iterable[Mapping[str, np.ndarray]], mode: str, rounds: int,
                     run_bytes: int) -> tuple[onnx.ModelProto, RepairReport,
                                              dict[str, np.ndarray], dict[str, float]]:
    """bias_correction, also returning each op's total output shift (node -> per channel)
    and, local mode, the elements per channel its mean error was taken over."""
    if mode not in BIAS_CORRECTION_MODES:
        raise ConfigError(f"mode '{mode}' is not one of {', '.join(BIAS_CORRECTION_MODES)}.")
    if not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds must be a whole number >= 1, got {rounds!r}.")
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend

    rounds = rounds if mode == "global" else 1
    _reiterable(batches, rounds)
    result = _copy(qdq_model)
    weights = _Weights(result)
    reference = Graph(fp32_model)
    targets, skipped = _correction_targets(result, weights, reference)
    report = RepairReport("bias_correction", skipped=skipped)
    local = None
    if mode == "local" and targets:
        from quantlab.sensitivity import local_error_model

        # The bias enters before the activation: compare at the op's own output.
        local = local_error_model(Graph(qdq_model), reference, fuse_activations=False)
        cut = {tensor: name for name, tensor in local.outputs.items()
               if local.precisions.get(name) == "int8"}
        for t in [t for t in targets if t.measured not in cut]:
            report.skipped.append({"node": t.node, "reason": "its INT8 inputs could not be cut "
                                   "out for a local measurement"})
        targets = [t for t in targets if t.measured in cut]
    if not targets:
        return _copy(qdq_model), report, {}, {}
    weights.write()
    errors: dict[str, list[float]] = {t.node: [] for t in targets}
    corrections = {t.node: np.zeros(t.channels) for t in targets}

    def apply(mean_errors: Mapping[str, np.ndarray]) -> None:
        for t in targets:
            error = mean_errors[t.node]
            errors[t.node].append(float(np.abs(error).max()))
            corrections[t.node] -= error
            weights.values[t.bias] = weights.get(t.bias) - error / t.gain
        weights.write()

    counts: dict[str, float] = {}
    if local is not None:
        mean_errors, counts = _local_mean_errors(reference, local, cut, targets, batches,
                                                 run_bytes)
        apply(mean_errors)
    else:
        fp32 = OnnxRuntimeBackend(fp32_model, name="fp32")
        names = [t.output for t in targets]
        fp32_sums = {t.node: np.zeros(t.channels) for t in targets}
        counts = dict.fromkeys(fp32_sums, 0)
        for round_index in range(rounds):
            quantized = OnnxRuntimeBackend(result, name="int8")
            sums = {t.node: np.zeros(t.channels) for t in targets}
            for run in _runs(batches, reference, names, run_bytes):
                if round_index == 0:
                    reference_values = fp32.run(run, names)
                    for t in targets:
                        fp32_sums[t.node] += _channel_reduce(reference_values[t.output], t.axis,
                                                             t.output, "sum")
                        counts[t.node] += reference_values[t.output].size // t.channels
                    reference_values = None
                values = quantized.run(run, names)
                for t in targets:
                    sums[t.node] += _channel_reduce(values[t.output], t.axis, t.output, "sum")
                del values
            apply({t.node: (sums[t.node] - fp32_sums[t.node]) / max(counts[t.node], 1)
                   for t in targets})
    for t in targets:
        report.applied.append({
            "node": t.node, "tensor": t.output, "channels": t.channels, "bias_added": t.added,
            "mean_error_max_per_round": errors[t.node],
            "correction_max": float(np.abs(corrections[t.node]).max()),
        })
    report.passes = 2 if local is not None else 1 + rounds
    report.summary.update({"mode": mode, "rounds": rounds})
    return result, report, corrections, counts


def _local_mean_errors(reference: Graph, local, cut: Mapping[str, str],
                       targets: Sequence[_Target], batches: Iterable[Mapping[str, np.ndarray]],
                       run_bytes: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Each target's mean error per output channel, its op quantized on FP32 inputs, and
    the elements per channel the mean is over: one
    pass of the FP32 model with the local copies attached and the errors summed in it
    (:func:`quantlab.sensitivity.error_channel_sums`), so only per-channel sums leave ONNX
    Runtime (returning every op's FP32 inputs and local outputs of one 640 px sample held
    about 1.9 GB more); runs of as many samples as all their tensors fit `run_bytes`."""
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.sensitivity import error_channel_sums

    model, sums = error_channel_sums(reference, local.model,
                                     {cut[t.measured]: (t.measured, t.axis) for t in targets})
    backend = OnnxRuntimeBackend(model, name="bias shifts", memory_pattern=False)
    totals = dict.fromkeys(backend.outputs, 0.0)
    for run in _runs(batches, reference, None, run_bytes):
        for name, value in backend.run(run).items():
            totals[name] = totals[name] + np.asarray(value, np.float64)
    counts = {t.node: float(totals[sums[cut[t.measured]][1]]) / t.channels for t in targets}
    return {t.node: totals[sums[cut[t.measured]][0]] / max(counts[t.node], 1.0)
            for t in targets}, counts


# ------------------------------------------------------------------------ SmoothQuant

# SmoothQuant applies where the largest channel max of the activation is at least this
# many times its median channel max (the paper's motivating outliers are ~100x).
DEFAULT_MIN_SPREAD = 4.0


def channel_amax(model: onnx.ModelProto, batches: Iterable[Mapping[str, np.ndarray]],
                 tensors: Sequence[str], run_bytes: int = RUN_BYTES) -> dict[str, np.ndarray]:
    """Max |x| per channel (last axis) of each of `tensors` over all samples: one FP32 pass.

    Streams: each run's tensors are reduced to per-channel maxima and dropped.
    """
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend

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


def _median_spread(amax: np.ndarray) -> float:
    """Largest channel max over the median channel max (inf when the median is 0)."""
    median = float(np.median(amax))
    return float(amax.max()) / median if median > 0 else float("inf")


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
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in result.graph.node:
        if _smoothable(node, weights, index):
            groups.setdefault(node.input[0], []).append(node)
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
        w_max = np.max([np.abs(r).max(axis=(1, 3)).reshape(-1) for r in ranges], axis=0)
        live = (act > 0) & (w_max > 0)
        factor = np.ones(channels)
        factor[live] = act[live] ** alpha / w_max[live] ** (1.0 - alpha)
        factor = np.clip(factor, 1 / SCALE_LIMIT, SCALE_LIMIT)
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


# -------------------------------------------------------- depthwise-input equalization

# Per-channel range of a depthwise input: the percentile of |x| that the default
# calibrator takes per tensor, here per channel, from a histogram of this many bins.
DW_PERCENTILE = 99.99
# A depthwise input is equalized when the predicted noise at the depthwise output drops
# by at least this much (a smaller gain is within the calibrator's own run-to-run spread).
DEFAULT_MIN_GAIN_DB = 1.0
# The exponents a 1x1-conv input's division s = (r / max r)**alpha is chosen from.
MIGRATION_ALPHAS = (0.25, 0.5, 0.75, 1.0)


def depthwise_convs(index: Graph, weights: _Weights | None = None
                    ) -> dict[str, list[onnx.NodeProto]]:
    """Activation tensor -> the depthwise Conv ops reading it (group == input channels > 1,
    constant float weights): the inputs whose channels a per-tensor scale serves worst."""
    return _conv_readers(index, weights or _Weights(index.model),
                         lambda group, dims: group > 1 and dims[1] == 1)


def pointwise_convs(index: Graph, weights: _Weights | None = None
                    ) -> dict[str, list[onnx.NodeProto]]:
    """Activation tensor -> the 1x1 Conv ops (group 1, constant float weights) reading it."""
    return _conv_readers(index, weights or _Weights(index.model),
                         lambda group, dims: group == 1 and list(dims[2:]) == [1, 1])


def _conv_readers(index: Graph, weights: _Weights, kind: Callable[[int, list[int]], bool]
                  ) -> dict[str, list[onnx.NodeProto]]:
    """Activation tensor -> the Conv ops with constant float weights of `kind` (group,
    weight dims) reading it."""
    found: dict[str, list[onnx.NodeProto]] = {}
    for node in index.model.graph.node:
        if node.op_type != "Conv" or node.domain not in _ONNX_DOMAINS or \
                len(node.input) < 2 or node.input[0] in index.constants or \
                not weights.float_initializer(node.input[1]):
            continue
        if kind(int(attribute(node, "group", 1)), list(weights.stored[node.input[1]].dims)):
            found.setdefault(node.input[0], []).append(node)
    return found


def channel_ranges(model: onnx.ModelProto, batches: Iterable[Mapping[str, np.ndarray]],
                   tensors: Sequence[str], percentile: float = DW_PERCENTILE,
                   run_bytes: int = RUN_BYTES) -> dict[str, np.ndarray]:
    """The `percentile` of |x| per channel (axis 1) of each of `tensors`: one FP32 pass.

    Each channel streams into a histogram on collect's power-of-two grid (exact under
    range growth), so memory is channels x 1024 counts per tensor, whatever the data.
    """
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend

    index = Graph(model)
    names = list(dict.fromkeys(tensors))
    backend = OnnxRuntimeBackend(model, name="fp32")
    fold = ChannelFold(names)
    # Tensors are scanned in parallel (the compiled scan releases the GIL), one thread each.
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        for run in _runs(batches, index, names, run_bytes):
            values = backend.run(run, names)
            folded = pool.map(fold.update, names, [values[name] for name in names])
            for name, finite in zip(names, folded, strict=True):
                if not finite:
                    raise DataError(
                        f"tensor '{name}' holds NaN or Inf on the calibration data; fix the "
                        "data or the layer producing it before equalizing.")
            del values
    return channel_percentiles(fold.stats, percentile)


def channel_percentiles(stats: Mapping[str, ChannelStats], percentile: float = DW_PERCENTILE
                        ) -> dict[str, np.ndarray]:
    """{tensor: the `percentile` of |x| per channel} of per-channel statistics (one pass of
    :func:`channel_ranges`, or ``quantlab.collect.Statistics.channels``)."""
    return {name: channels.percentiles(percentile, CHANNEL_BINS)
            for name, channels in stats.items()}


def equalization_inputs(model: onnx.ModelProto, pointwise: bool = False) -> list[str]:
    """The tensors :func:`depthwise_equalization` reads the per-channel ranges of: the inputs
    of depthwise convs and, with `pointwise`, of 1x1 convs."""
    index, weights = Graph(model), _Weights(model)
    return list({**depthwise_convs(index, weights),
                 **(pointwise_convs(index, weights) if pointwise else {})})


def depthwise_equalization(model: onnx.ModelProto,
                           data: Iterable[Mapping[str, np.ndarray]] | Mapping[str, np.ndarray],
                           min_gain_db: float = DEFAULT_MIN_GAIN_DB, pointwise: bool = False,
                           ) -> tuple[onnx.ModelProto, RepairReport]:
    """Per-channel equalization of depthwise-conv inputs, folded into weights (FP32 unchanged).

    A depthwise conv never mixes channels, so a per-tensor activation scale is set by
    its widest channel and crushes the others (and the BatchNorm folded after it scales
    their noise back up). Channel c of the input X is divided by ``s_c = r_c / max(r)``
    (``r_c``: its 99.99th percentile of |x|, :func:`channel_ranges`) and the depthwise
    weights of channel c are multiplied by s_c, which per-channel weight scales absorb
    exactly. The division goes into X's producer where it can: a Div or Mul by a
    constant (the Div(6) of a decomposed HardSwish), through ReLU/LeakyReLU/MaxPool
    into a Conv's output channels; otherwise a Mul by 1/s is inserted before the
    depthwise conv (TensorRT is expected to fuse it into the producer's pointwise
    epilogue; unverified, see docs/tensorrt.md). Tensors whose values change are
    renamed ``<name>_equalized``. Applied where the predicted noise at the depthwise
    output, ``sum_c r_max**2 |W_c|**2`` before against ``sum_c r_c**2 |W_c|**2`` after,
    drops by at least `min_gain_db`.

    With `pointwise`, inputs read by 1x1 convs are treated too, with the depthwise
    readers of the same tensor: a 1x1 conv mixes channels, so its per-output-channel
    weight scales cannot absorb ``s`` exactly and the division trades activation noise
    for weight noise, as SmoothQuant does for MatMul. ``s_c = (r_c / max(r))**alpha``
    with alpha from :data:`MIGRATION_ALPHAS` minimizing the readers' predicted output
    noise (:func:`_migration`); only where the producer absorbs the division (no Mul
    is inserted for them: a pointwise-only input without such a producer is skipped).

    `data`: calibration batches (one FP32 pass) or ``{tensor: per-channel range}``.
    Returns the equalized copy and the report (every input, applied or skipped with the
    reason).
    """
    result = _copy(model)
    weights = _Weights(result)
    index = Graph(result)
    groups = depthwise_convs(index, weights)
    mixing = pointwise_convs(index, weights) if pointwise else {}
    report = RepairReport("depthwise_equalization")
    if not groups and not mixing:
        return result, report
    ranges, report.passes = _channel_figures(
        data, lambda: channel_ranges(model, data, list({**groups, **mixing})))
    outputs = set(index.outputs)
    renamed: dict[str, str] = {}
    muls: dict[str, onnx.NodeProto] = {}
    for tensor in {**groups, **mixing}:
        depthwise = groups.get(tensor, [])
        nodes = depthwise + mixing.get(tensor, [])
        names = [n.name for n in nodes]
        r = ranges.get(tensor)
        if r is None or not np.isfinite(r).all():
            report.skipped.append({"tensor": tensor, "readers": names,
                                   "reason": "no finite per-channel ranges"})
            continue
        if r.max() <= 0:
            report.skipped.append({"tensor": tensor, "readers": names,
                                   "reason": "the tensor is zero on the calibration data"})
            continue
        readers = {id(n) for n in index.consumers.get(tensor, [])}
        sole = tensor not in outputs and readers == {id(n) for n in nodes}
        entry = {"tensor": tensor, "readers": names, "spread": _median_spread(r)}
        path = None
        if len(nodes) > len(depthwise):  # 1x1 readers: only where the producer takes 1/s
            alpha, factor, gain = _migration(r, nodes, weights)
            if gain >= min_gain_db and sole:
                path = _absorb(index, weights, tensor, factor)
            if path is not None:
                entry["alpha"] = alpha
            elif not depthwise:
                report.skipped.append({**entry, "gain_db": round(float(gain), 2), "reason": (
                    f"predicted gain {gain:.2f} dB < {min_gain_db} dB" if gain < min_gain_db
                    else "read by 1x1 convs only and no producer takes the division "
                         "(a Mul is inserted for depthwise readers alone)")})
                continue
            else:  # the depthwise readers alone, as without `pointwise`
                nodes, names = depthwise, [n.name for n in depthwise]
                entry["readers"], sole = names, False
        if path is None:
            factor = np.where(r > 0, r / r.max(), 1.0).clip(1 / SCALE_LIMIT, 1.0)
            energy = np.sum([_channel_energy(n, weights.get(n.input[1]), r.size)
                             for n in nodes], axis=0)
            gain = _gain_db(float(np.sum(r.max() ** 2 * energy)), float(np.sum(r ** 2 * energy)))
            if gain < min_gain_db:
                report.skipped.append({**entry, "gain_db": round(float(gain), 2),
                                       "reason": f"predicted gain {gain:.2f} dB < "
                                                 f"{min_gain_db} dB"})
                continue
            path = _absorb(index, weights, tensor, factor) if sole else None
        entry["gain_db"] = round(float(gain), 2)
        if path is None:
            rank = len(index.shapes.get(tensor) or (0, 0, 0, 0))
            entry["equalized_tensor"], entry["folded_into"] = _insert_mul(
                weights, muls, tensor, nodes, (1.0 / factor).reshape(1, -1, *([1] * (rank - 2))),
                "equalized", "Equalize")
        else:
            absorber, changed = path
            for name in changed:
                renamed[name] = weights.fresh(f"{name}_equalized")
            entry["folded_into"] = absorber
            entry["equalized_tensor"] = renamed[tensor]
        for node in nodes:
            name = weights.own(node, 1)
            weights.values[name] = _scale_in(node, weights.get(name), factor)
        entry["spread"] = [entry["spread"], _median_spread(r / factor)]
        report.applied.append(entry)
    for node in result.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = renamed.get(name, name)
    _place_muls(result, muls)
    weights.write()
    report.summary = {"depthwise_inputs": len(groups), "equalized": len(report.applied)}
    if pointwise:
        report.summary["pointwise_inputs"] = len(set(mixing) - set(groups))
    return result, report


def _gain_db(before: float, after: float) -> float:
    return 10 * np.log10(before / after) if after > 0 else 0.0


def _migration(r: np.ndarray, nodes: list[onnx.NodeProto], weights: _Weights
               ) -> tuple[float, np.ndarray, float]:
    """(alpha, factor s, predicted gain in dB) for an input of channel ranges `r` read by
    `nodes` (1x1 convs, maybe depthwise convs too), dividing channel c by
    ``s_c = (r_c / max r)**alpha``.

    Each reader's predicted output noise is that of uniform quantizers: the input's
    per-tensor step ``max(r / s)`` through the rescaled weights W' (``max(r/s)**2
    sum W'**2``), plus each output channel's weight step ``q_o = max |W'_o|`` through the
    rescaled inputs (``q_o**2 k sum_c (r_c / s_c)**2``, k the kernel size). The weight
    term takes each channel's range for its scale, an upper bound of its root mean
    square, so the model leans to a smaller alpha than the best measured: on the layout
    detector this conservative choice scored better (agreement mAP 94.6 / 97.6 on two
    page seeds) than the one with each channel's RMS (95.7 / 94.4; benchmarks/README.md).
    alpha = 0 is the model as it is.
    """
    base = np.where(r > 0, r / r.max(), 1.0).clip(1 / SCALE_LIMIT, 1.0)

    def noise(factor: np.ndarray) -> float:
        x = r / factor
        total = 0.0
        for node in nodes:
            grouped = _in_groups(node, weights.get(node.input[1]), r.size)
            w = grouped * factor.reshape(grouped.shape[0], 1, grouped.shape[2], 1)
            steps = np.abs(w).max(axis=(2, 3))  # per output channel: [groups, outputs]
            inputs = (x.reshape(grouped.shape[0], 1, grouped.shape[2]) ** 2).sum(axis=2)
            total += x.max() ** 2 * float((w ** 2).sum()) + \
                float((steps ** 2 * inputs).sum()) * grouped.shape[3]
        return total

    after, alpha = min((noise(base ** a), a) for a in MIGRATION_ALPHAS)
    return alpha, base ** alpha, _gain_db(noise(np.ones_like(base)), after)


def _channel_energy(node: onnx.NodeProto, weight: np.ndarray, channels: int) -> np.ndarray:
    """Sum of squared weights reading each input channel (the gain of its noise)."""
    grouped = _in_groups(node, weight, channels)
    return (grouped ** 2).sum(axis=(1, 3)).reshape(-1)


def _absorb(index: Graph, weights: _Weights, tensor: str, factor: np.ndarray
            ) -> tuple[str, list[str]] | None:
    """Divide channel c of `tensor` by factor[c] inside the ops producing it.

    Returns the absorbing node's description and the tensors whose values changed
    (from the absorber's output to `tensor`), or None when no producer can take it:
    every tensor on the way must be read by the next op alone.
    """
    changed = [tensor]
    while True:
        producer = index.producers.get(tensor)
        if producer is None or producer.domain not in _ONNX_DOMAINS:
            return None
        op = producer.op_type
        if op in ("Div", "Mul") and len(producer.input) == 2 and \
                weights.float_initializer(producer.input[1]) and \
                producer.input[0] not in index.constants:
            constant = weights.get(producer.input[1])
            shape = index.shapes.get(tensor)
            if shape is None or constant.size not in (1, factor.size) or \
                    (constant.size > 1 and constant.reshape(-1).size != factor.size):
                return None
            per_channel = factor.reshape(-1, *([1] * (len(shape) - 2)))
            name = weights.own(producer, 1)
            base = np.broadcast_to(constant.reshape(-1, *([1] * (len(shape) - 2))),
                                   per_channel.shape)
            weights.values[name] = base * per_channel if op == "Div" else base / per_channel
            return f"{op} '{producer.name}'", changed
        if op == "Conv" and weights.float_initializer(producer.input[1]) and \
                int(attribute(producer, "group", 1)) == 1 and \
                weights.get(producer.input[1]).shape[0] == factor.size:
            name = weights.own(producer, 1)
            weights.values[name] = _scale_out(producer, weights.get(name), 1.0 / factor)
            if len(producer.input) > 2 and producer.input[2]:
                bias = weights.own(producer, 2)
                weights.values[bias] = weights.get(bias) / factor
            return f"Conv '{producer.name}'", changed
        upstream = producer.input[0] if producer.input else ""
        if op not in HOMOGENEOUS_OPS or not upstream or upstream in index.outputs or \
                len(index.consumers.get(upstream, [])) != 1:
            return None
        tensor = upstream
        changed.append(tensor)
