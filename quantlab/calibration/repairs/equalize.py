"""Per-channel equalization of depthwise-conv inputs (and, with `pointwise`, 1x1-conv
inputs) from their channel ranges: one FP32 pass, none when the statistics pass kept them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnx

from quantlab import graph
from quantlab.calibration.collect import CHANNEL_BINS, RUN_BYTES, ChannelFold, ChannelStats
from quantlab.calibration.repairs.base import (
    _ONNX_DOMAINS,
    HOMOGENEOUS_OPS,
    SCALE_LIMIT,
    RepairReport,
    _copy,
    _runs,
    _Weights,
)
from quantlab.calibration.repairs.scaling import (
    _channel_figures,
    _in_groups,
    _insert_mul,
    _median_spread,
    _place_muls,
    _scale_in,
    _scale_out,
)
from quantlab.data import BatchSource
from quantlab.errors import DataError
from quantlab.graph import Graph
from quantlab.metadata import attribute

# Per-channel range of a depthwise input: the percentile of |x| that the default
# calibrator takes per tensor, here per channel, from a histogram of this many bins.
DW_PERCENTILE = 99.99
# A depthwise input is equalized when the predicted noise at the depthwise output drops
# by at least this much (a smaller gain is within the calibrator's own run-to-run spread).
# Not the keep rule of base.lowers_noise, on purpose: this is a prediction from channel
# ranges, per input and before any INT8 run, so it asks for a margin; the planner then
# keeps or drops the whole equalized model by the rule, on measured noise.
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
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

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
    :func:`channel_ranges`, or ``quantlab.calibration.collect.Statistics.channels``)."""
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
        unusable = _unusable_ranges(r)
        if unusable:
            report.skipped.append({"tensor": tensor, "readers": names, "reason": unusable})
            continue
        readers = {id(n) for n in index.consumers.get(tensor, [])}
        sole = tensor not in outputs and readers == {id(n) for n in nodes}
        entry = {"tensor": tensor, "readers": names, "spread": _median_spread(r)}
        chosen = _equalization_of(index, weights, tensor, depthwise, nodes, r, sole,
                                  min_gain_db, entry)
        if isinstance(chosen, str):
            report.skipped.append({**entry, "reason": chosen})
            continue
        nodes, factor, gain, path = chosen
        entry["gain_db"] = round(float(gain), 2)
        _divide(index, weights, tensor, nodes, factor, path, muls, renamed, entry)
        report.divided[entry["equalized_tensor"]] = (tensor, factor)
        entry["spread"] = [entry["spread"], _median_spread(r / factor)]
        report.applied.append(entry)
    for node in result.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
    _place_muls(result, muls)
    weights.write()
    report.summary = {"depthwise_inputs": len(groups), "equalized": len(report.applied)}
    if pointwise:
        report.summary["pointwise_inputs"] = len(set(mixing) - set(groups))
    return result, report


def _unusable_ranges(r: np.ndarray | None) -> str | None:
    """Why the channel ranges `r` cannot be equalized (None: they can)."""
    if r is None or not np.isfinite(r).all():
        return "no finite per-channel ranges"
    if r.max() <= 0:
        return "the tensor is zero on the calibration data"
    return None


def _equalization_of(index: Graph, weights: _Weights, tensor: str,
                     depthwise: list[onnx.NodeProto], nodes: list[onnx.NodeProto],
                     r: np.ndarray, sole: bool, min_gain_db: float, entry: dict
                     ) -> tuple[list[onnx.NodeProto], np.ndarray, float, tuple | None] | str:
    """How input `tensor` (channel ranges `r`, read by `nodes`) is equalized: the readers
    scaled, the factor s, the predicted gain and the producer that took the division with
    the tensors it changed (None: a Mul is inserted); or why not. `entry` gains the share
    (alpha), the depthwise readers alone, or a skipped input's gain."""
    if len(nodes) > len(depthwise):  # 1x1 readers: only where the producer takes 1/s
        alpha, factor, gain = _migration(r, nodes, weights)
        path = _absorb(index, weights, tensor, factor) if gain >= min_gain_db and sole else None
        if path is not None:
            entry["alpha"] = alpha
            return nodes, factor, gain, path
        if not depthwise:
            entry["gain_db"] = round(float(gain), 2)
            return (f"predicted gain {gain:.2f} dB < {min_gain_db} dB" if gain < min_gain_db
                    else "read by 1x1 convs only and no producer takes the division "
                         "(a Mul is inserted for depthwise readers alone)")
        # The depthwise readers alone, as without `pointwise`.
        nodes, sole = depthwise, False
        entry["readers"] = [n.name for n in depthwise]
    factor = np.where(r > 0, r / r.max(), 1.0).clip(1 / SCALE_LIMIT, 1.0)
    energy = np.sum([_channel_energy(n, weights.get(n.input[1]), r.size) for n in nodes], axis=0)
    gain = _gain_db(float(np.sum(r.max() ** 2 * energy)), float(np.sum(r ** 2 * energy)))
    if gain < min_gain_db:
        entry["gain_db"] = round(float(gain), 2)
        return f"predicted gain {gain:.2f} dB < {min_gain_db} dB"
    return nodes, factor, gain, (_absorb(index, weights, tensor, factor) if sole else None)


def _divide(index: Graph, weights: _Weights, tensor: str, nodes: list[onnx.NodeProto],
            factor: np.ndarray, path: tuple | None, muls: dict[str, onnx.NodeProto],
            renamed: dict[str, str], entry: dict) -> None:
    """Channel c of `tensor` divided by factor[c] (in its producer, `path`, whose changed
    tensors get new names in `renamed`; else by an inserted Mul) and the weights of its
    readers `nodes` multiplied by it; where, in `entry`."""
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


@dataclass(frozen=True)
class ConvInputEqualization:
    """The ``dw-equalize`` / ``pw-equalize`` repairs
    (:class:`~quantlab.calibration.repairs.base.Repair`): :func:`depthwise_equalization`, with
    `pointwise` 1x1-conv inputs too, normalized again."""

    name: str
    pointwise: bool
    needs_data: bool = True
    renames: bool = True

    def channel_inputs(self, model: onnx.ModelProto) -> list[str]:
        """:func:`equalization_inputs` of `model`."""
        return equalization_inputs(model, pointwise=self.pointwise)

    def apply(self, model: onnx.ModelProto, source: BatchSource | None,
              channel_ranges: Mapping[str, np.ndarray]) -> tuple[onnx.ModelProto, RepairReport]:
        """`model` equalized from `channel_ranges` where they hold every input (else one
        FP32 pass over `source`); shapes inferred again for the renamed tensors."""
        inputs = self.channel_inputs(model)
        changed, report = depthwise_equalization(
            model, {n: channel_ranges[n] for n in inputs}
            if all(n in channel_ranges for n in inputs) else source, pointwise=self.pointwise)
        return (graph.normalize(changed) if report.applied else changed), report
