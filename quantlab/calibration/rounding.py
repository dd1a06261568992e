"""INT8 weights rounded for the layer's output on calibration data, not each to its nearest step.

Rounding every weight to its nearest int8 step minimizes the weights' own error, but a
layer's output error is that error times its input: ``e = (W - Q) x``. Over the data
its power is ``trace((W - Q) H (W - Q)^T)`` with ``H = E[x x^T]``, the input's second
moments. GPTQ (Frantar et al., 2022, after Optimal Brain Quantization) rounds one input
column at a time and spreads that column's rounding error over the columns not yet
rounded, in the proportions that cancel it best given ``H``: the same scales, the same
int8 grid, a lower output error. TensorRT reads the result as any other int8 weight.

The bias is the last column, of an input that is always 1, and is not rounded: it takes
what is left of the weights' mean error (bias correction of the weights' part).

Per layer only the columns' second moments are needed: each INT8 layer's FP32 input on a
few calibration samples, at a bounded number of output positions per sample
(POSITIONS). A layer whose samples give fewer than MIN_ROWS_PER_COLUMN positions per
column (the squeeze-excitation convs after a global pooling: one position per sample)
keeps nearest rounding: its ``H`` would be fitted to those few samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from quantlab import graph
from quantlab.calibration import qdq
from quantlab.calibration.repairs.base import _copy, _Weights
from quantlab.graph import Graph
from quantlab.metadata import attribute

# Input rows (output positions) read per sample and layer: 8 samples of a 640 px detector
# give 16,384 rows, 19 per column for its widest layer (a 3x3 conv of 96 channels).
POSITIONS = 2048
# A layer rounded by GPTQ needs this many rows per column of H: the few rows of a conv after
# a global pooling (one per sample) would fit H to those samples alone.
MIN_ROWS_PER_COLUMN = 16
# H's diagonal raised by this share of its mean before inversion (GPTQ's own default).
DAMPING = 0.01
_QMAX = 127


@dataclass
class _Layer:
    node: onnx.NodeProto  # the FP32 model's linear op
    weight: np.ndarray  # its FP32 weight
    quantized: str  # the Q/DQ model's int8 initializer
    scale: np.ndarray  # per row of `_rows(weight)` (a per-tensor scale repeated)
    bias: np.ndarray | None  # per row, where the rounding refits it
    nearest: np.ndarray | None = None  # the int8 values nearest rounding gave it
    moments: np.ndarray | float = 0.0  # H summed (one per channel: a depthwise conv)
    count: int = 0  # rows of x summed into it


@dataclass
class Rounding:
    """What the rounding did: per weight, the output error's power per input row with
    nearest and with the chosen rounding, on the samples whose moments it used."""

    samples: int = 0
    tensors: dict[str, dict] = field(default_factory=dict)

    def summary(self) -> dict:
        rounded = [t for t in self.tensors.values() if t["rounded"]]
        return {"samples": self.samples, "tensors": len(self.tensors),
                "tensors_rounded": len(rounded)}


def round_weights(index: Graph, quantized: onnx.ModelProto,
                  batches: Iterable[Mapping[str, np.ndarray]],
                  seed: int = 0) -> tuple[onnx.ModelProto, Rounding]:
    """`quantized` with its INT8 weights rounded by GPTQ (and their biases refitted) on the
    inputs `index` (the FP32 model it was made from) computes from `batches`; the weights'
    scales are kept."""
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    layers = _layers(index, quantized)
    result = Rounding()
    if not layers:
        return quantized, result
    backend = OnnxRuntimeBackend(index.model, name="weight rounding inputs",
                                 memory_pattern=False)
    wanted = sorted({layer.node.input[0] for layer in layers.values()})
    rng = np.random.default_rng(seed)
    for batch in batches:
        values = backend.run(batch, wanted)
        for layer in layers.values():
            _accumulate(layer, _input_rows(layer, values[layer.node.input[0]], rng))
        result.samples += 1
    weights, biases = {}, {}
    for name, layer in layers.items():
        columns = layer.moments.shape[-1] if layer.count else 0
        if layer.count < MIN_ROWS_PER_COLUMN * columns or not layer.count:
            result.tensors[name] = {"rounded": False, "rows": layer.count, "columns": columns}
            continue
        moments = layer.moments / layer.count
        target = _rows(layer)
        nearest = _with_bias(layer, _rows_of(layer, layer.nearest.astype(np.float64))
                             * layer.scale[:, None])
        chosen = _gptq(target, moments, layer.scale, layer.bias is not None)
        before, after = _error(target, nearest, moments), _error(target, chosen, moments)
        keep = after < before
        if keep:
            grid = chosen[:, :-1] if layer.bias is not None else chosen
            weights[layer.quantized] = _from_rows(layer, np.rint(
                grid / np.reshape(layer.scale, (-1, 1)))).astype(np.int8)
            if layer.bias is not None:
                biases[layer.node.name] = chosen[:, -1]
        result.tensors[name] = {"rounded": bool(keep), "rows": layer.count, "columns": columns,
                                "error_ratio": after / before if before else 1.0}
    return _written(quantized, weights, biases), result


def _layers(index: Graph, quantized: onnx.ModelProto) -> dict[str, _Layer]:
    """The FP32 model's INT8 linear ops whose rounding this module handles, by weight."""
    producers = graph.producers(quantized)
    q_nodes = {n.name: n for n in quantized.graph.node}
    values = graph.initializers(index.model)
    q_values = graph.initializers(quantized)
    # A weight or bias that two ops read (shared) keeps its nearest rounding / its value:
    # one rounding cannot fit both ops' inputs.
    readers = graph.consumers(quantized)
    layers = {}
    for node in index.model.graph.node:
        if qdq.LINEAR_OPS.get(node.op_type) != 1 or len(node.input) < 2:
            continue
        weight = values.get(node.input[1])
        q_node = q_nodes.get(node.name)
        if weight is None or q_node is None or q_node.input[1] not in producers:
            continue
        dq = producers[q_node.input[1]]
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in q_values:
            continue
        if len(index.consumers[node.input[1]]) > 1 or len(readers[dq.output[0]]) > 1 \
                or not _handled(node, weight):
            continue
        scale = q_values[dq.input[1]].astype(np.float64).reshape(-1)
        layer = _Layer(node, weight.astype(np.float64), dq.input[0], scale, None,
                       q_values[dq.input[0]])
        rows = _rows(layer).shape[0]
        if scale.size not in (1, rows):
            continue  # a per-channel axis that is not the rows this module forms
        layer.scale = np.broadcast_to(scale, (rows,)).copy()
        named = q_node.input[2] if len(q_node.input) > 2 else ""
        if node.op_type == "Conv" and (not named or (named in q_values
                                                      and len(readers[named]) == 1)):
            # The bias refitted as the last column (a conv without one gets one).
            layer.bias = (np.broadcast_to(q_values[named].astype(np.float64).reshape(-1),
                                          (rows,)).copy() if named else np.zeros(rows))
        layers[node.input[1]] = layer
    return layers


def _handled(node: onnx.NodeProto, weight: np.ndarray) -> bool:
    if node.op_type == "Conv":
        group = attribute(node, "group", 1)
        return weight.ndim == 4 and (group == 1 or (weight.shape[1] == 1
                                                   and weight.shape[0] == group))
    if node.op_type == "ConvTranspose":
        return weight.ndim == 4 and attribute(node, "group", 1) == 1
    if node.op_type == "Gemm":
        return weight.ndim == 2 and not attribute(node, "transA", 0)
    return weight.ndim == 2  # MatMul


def _depthwise(layer: _Layer) -> bool:
    return layer.node.op_type == "Conv" and attribute(layer.node, "group", 1) > 1


def _rows(layer: _Layer) -> np.ndarray:
    """The weight as output rows x input columns (in the order of _input_rows), the bias
    the last column where the rounding refits it."""
    return _with_bias(layer, _rows_of(layer, layer.weight))


def _with_bias(layer: _Layer, rows: np.ndarray) -> np.ndarray:
    """`rows` with the layer's bias as the last column where the rounding refits it."""
    if layer.bias is None:
        return rows
    return np.concatenate([rows, layer.bias[:, None]], axis=1)


def _rows_of(layer: _Layer, weight: np.ndarray) -> np.ndarray:
    op = layer.node.op_type
    if op == "Conv":
        return weight.reshape(weight.shape[0], -1)
    if op == "ConvTranspose":  # [C_in, C_out, kh, kw]: every tap is a 1x1 map of C_in
        return np.moveaxis(weight, 0, -1).reshape(-1, weight.shape[0])
    if op == "Gemm" and attribute(layer.node, "transB", 0):
        return weight
    return weight.T


def _from_rows(layer: _Layer, rows: np.ndarray) -> np.ndarray:
    shape = layer.weight.shape
    op = layer.node.op_type
    if op == "Conv":
        return rows.reshape(shape)
    if op == "ConvTranspose":
        return np.moveaxis(rows.reshape(*shape[1:], shape[0]), -1, 0)
    if op == "Gemm" and attribute(layer.node, "transB", 0):
        return rows
    return rows.T


def _input_rows(layer: _Layer, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Up to POSITIONS of the layer's input vectors (rows, float32), one per output position:
    the patches a conv reads, a ConvTranspose's input pixels, a matrix's input rows. A
    depthwise conv's are [channel, row, tap]."""
    op = layer.node.op_type
    if op in ("Gemm", "MatMul"):
        rows = x.reshape(-1, x.shape[-1])
        return rows[_pick(len(rows), rng)].astype(np.float32, copy=False)
    if op == "ConvTranspose":
        rows = np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])
        return rows[_pick(len(rows), rng)].astype(np.float32, copy=False)
    kernel = layer.weight.shape[2:]
    strides = attribute(layer.node, "strides", [1, 1])
    dilations = attribute(layer.node, "dilations", [1, 1])
    pads = attribute(layer.node, "pads", [0, 0, 0, 0])
    padded = np.pad(x.astype(np.float32, copy=False),
                    ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    windows = np.lib.stride_tricks.sliding_window_view(padded, span, axis=(2, 3))
    windows = windows[:, :, ::strides[0], ::strides[1], ::dilations[0], ::dilations[1]]
    n, c, oh, ow = windows.shape[:4]
    picked = _pick(n * oh * ow, rng)
    sample, position = np.divmod(picked, oh * ow)
    flat = windows[sample, :, position // ow, position % ow].reshape(len(picked), c, -1)
    if _depthwise(layer):
        return np.moveaxis(flat, 1, 0)  # c, rows, taps
    return flat.reshape(len(picked), -1)


def _pick(count: int, rng: np.random.Generator) -> np.ndarray:
    if count <= POSITIONS:
        return np.arange(count)
    return np.sort(rng.choice(count, POSITIONS, replace=False))


def _accumulate(layer: _Layer, rows: np.ndarray) -> None:
    """Add `rows`' second moments to the layer's H; where the bias is refitted, H's last row
    and column are those of the input 1 beside them: the rows' sums and their count."""
    depthwise = rows.ndim == 3  # per channel
    count = rows.shape[-2]
    moments = (np.matmul(rows.transpose(0, 2, 1), rows) if depthwise else rows.T @ rows
               ).astype(np.float64)
    if layer.bias is not None:
        sums = rows.sum(axis=-2, dtype=np.float64)[..., None]  # (channels,) columns x 1
        corner = np.full((*sums.shape[:-2], 1, 1), float(count))
        moments = np.concatenate([np.concatenate([moments, sums], axis=-1),
                                  np.concatenate([np.swapaxes(sums, -1, -2), corner],
                                                 axis=-1)], axis=-2)
    layer.moments = layer.moments + moments
    layer.count += count


def _gptq(weight: np.ndarray, moments: np.ndarray, scale: np.ndarray, free_last: bool
          ) -> np.ndarray:
    """`weight` (rows x columns) on the int8 grid `scale` (per row), each column rounded in
    turn and its error spread over the columns after it; the last column not rounded where
    `free_last` (a bias). `moments` is H (columns x columns), or one H per row (a depthwise
    conv). Returns the rounded weight (in float, its values on the grid)."""
    weight = weight.copy()
    columns = weight.shape[1]
    hessian = moments.copy() if moments.ndim == 3 else moments[None].copy()
    diagonal = np.arange(columns)
    dead = hessian[:, diagonal, diagonal] == 0
    hessian[:, diagonal, diagonal] += (
        DAMPING * hessian[:, diagonal, diagonal].mean(axis=1, keepdims=True) + dead)
    # The upper Cholesky factor of H^-1: row i holds the weights that spread column i's error.
    factor = np.linalg.cholesky(np.linalg.inv(hessian)).transpose(0, 2, 1)
    for i in range(columns - free_last):
        rounded = np.clip(np.rint(weight[:, i] / scale), -_QMAX, _QMAX) * scale
        spread = factor[:, i, i + 1:] / factor[:, i, i:i + 1]  # 1 or rows x the rest
        weight[:, i + 1:] -= (weight[:, i] - rounded)[:, None] * spread
        weight[:, i] = rounded
    return weight


def _error(target: np.ndarray, values: np.ndarray, moments: np.ndarray) -> float:
    """The output error's power per input row of second moments `moments` of `values`
    against `target` (rows x columns)."""
    difference = target - values
    if moments.ndim == 3:
        return float(np.einsum("ck,ckl,cl->", difference, moments, difference))
    return float(np.einsum("rk,kl,rl->", difference, moments, difference))


def _written(model: onnx.ModelProto, weights: Mapping[str, np.ndarray],
             biases: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """`model` with the int8 `weights` (by initializer) and the `biases` (by node) replaced;
    a node without a bias gets one."""
    if not weights and not biases:
        return model
    result = _copy(model)
    for initializer in result.graph.initializer:
        if initializer.name in weights:
            initializer.CopyFrom(numpy_helper.from_array(weights[initializer.name],
                                                         initializer.name))
    floats = _Weights(result)
    for node in result.graph.node:
        if node.name not in biases:
            continue
        if len(node.input) > 2 and node.input[2]:
            floats.values[node.input[2]] = biases[node.name]
        elif len(node.input) > 2:
            node.input[2] = floats.add(f"{node.name}_bias", biases[node.name])
        else:
            node.input.append(floats.add(f"{node.name}_bias", biases[node.name]))
    floats.write()
    return result
