"""BatchNormalization folded into the Conv, ConvTranspose or Gemm before it.

TensorRT fuses an inference BatchNormalization into the Convolution that feeds it
(its fusion catalog's Convolution+Scale; for Gemm+BN this is assumed, and it does not
matter: TensorRT is given the folded graph), and so does ONNX Runtime's graph
optimizer; exporters such as Paddle's keep the BN as a node. With per-channel weight
scales the fold is exact: round(W*g/(s*g)) = round(W/s). A ConvTranspose's weights are
per-tensor (trt-review F6), so folding the BN gain first costs precision on channels of
small gain: an accuracy note, not a difference from the engine (trt-review-r2 N18).
quantlab folds at import (:func:`quantlab.graph.normalize`) so that statistics, local
errors, Q/DQ weights and comparisons all see the layer TensorRT computes: a depthwise
conv's quantization noise is measured after the BN that scales it, not before.

The folded node keeps its name and takes the BN's output tensor; the model's metadata
records, per fold, the BN's node name, its torch module scope (for the torch stage) and
the Conv output tensor that no longer exists. A BN that cannot be folded stays a node,
recorded with the reason (:func:`kept_batchnorms`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from quantlab import metadata
from quantlab.errors import ModelError
from quantlab.metadata import attribute

# Model metadata keys: the folds made, and the BatchNormalizations kept with the reason.
FOLDED_KEY = "quantlab.folded_batchnorm"
KEPT_KEY = "quantlab.kept_batchnorm"
FOLDABLE_OPS = ("Conv", "ConvTranspose", "Gemm")
_ONNX_DOMAINS = ("", "ai.onnx")


def folded_batchnorms(model: onnx.ModelProto) -> list[dict]:
    """The folds :func:`fold_batchnorms` made: ``node`` (the linear op, which now computes the
    BN's output ``tensor``), ``batchnorm`` (the BN node's name), ``scope`` (its torch module
    path, or None) and ``replaced`` (the linear op's former output, gone from the graph)."""
    return metadata.read(model, FOLDED_KEY, [])


def kept_batchnorms(model: onnx.ModelProto) -> dict[str, str]:
    """BatchNormalization node name -> why it was not folded."""
    return metadata.read(model, KEPT_KEY, {})


def _check_variance(bn: onnx.NodeProto, inits: dict) -> None:
    """ModelError when the BatchNormalization `bn` divides by sqrt(var + epsilon) = 0 in some
    channel: the model itself makes Inf there, whatever the data."""
    if len(bn.input) < 5 or bn.input[4] not in inits:
        return
    var = numpy_helper.to_array(inits[bn.input[4]]).astype(np.float64)
    zero = np.flatnonzero(var + float(attribute(bn, "epsilon", 1e-5)) <= 0)
    if zero.size:
        raise ModelError(
            f"BatchNormalization '{bn.name}' has running variance + epsilon <= 0 in channel(s) "
            f"{zero[:5].tolist()}: it divides by zero there, so the model itself makes Inf. Fix "
            "the model's running variance or its epsilon (PyTorch's default is 1e-5).")


def fold_batchnorms(model: onnx.ModelProto, module_path=None) -> onnx.ModelProto:
    """Fold every inference BatchNormalization into the Conv/ConvTranspose/Gemm feeding it.

    The model must have its weights as initializers and named nodes. Folding is exact in
    real arithmetic: ``W' = W * g``, ``b' = (b - mean) * g + beta`` with
    ``g = scale / sqrt(var + epsilon)`` per output channel (computed in float64).
    `module_path(node)` gives a node's torch module scope (recorded for the torch stage).
    Returns `model` itself when there is no BatchNormalization, else a folded copy (the
    BatchNormalizations' parameters stay as unread initializers; :func:`quantlab.graph.normalize`
    drops them).
    """
    if not any(n.op_type == "BatchNormalization" for n in model.graph.node):
        return model
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    graph = model_copy.graph
    inits = {init.name: init for init in graph.initializer}
    uses: dict[str, int] = {}
    producers: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
        for name in node.output:
            producers[name] = node
    outputs = {o.name for o in graph.output}
    folded, kept = folded_batchnorms(model), kept_batchnorms(model)
    removed: set[str] = set()
    taken = set(inits) | {name for n in graph.node for name in n.output}
    for bn in graph.node:
        if bn.op_type != "BatchNormalization" or bn.domain not in _ONNX_DOMAINS:
            continue
        _check_variance(bn, inits)
        linear = producers.get(bn.input[0])
        reason = _unfoldable(bn, linear, inits, uses, outputs)
        if reason is not None:
            kept[bn.name] = reason
            continue
        scale, beta, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64)
                                  for n in bn.input[1:5])
        gain = scale / np.sqrt(var + float(attribute(bn, "epsilon", 1e-5)))
        weight_index = 1
        weight = numpy_helper.to_array(inits[linear.input[weight_index]]).astype(np.float64)
        bias_index = 2
        bias = (numpy_helper.to_array(inits[linear.input[bias_index]]).astype(np.float64)
                if len(linear.input) > bias_index and linear.input[bias_index] else None)
        weight, bias = _folded(linear, weight, bias, gain, beta, mean)
        _set_input(linear, weight_index, weight, inits, uses, taken, graph)
        _set_input(linear, bias_index, bias, inits, uses, taken, graph)
        if linear.op_type == "Gemm":
            for field in linear.attribute:
                if field.name in ("alpha", "beta"):
                    field.f = 1.0
        folded.append({"node": linear.name, "batchnorm": bn.name, "tensor": bn.output[0],
                       "replaced": linear.output[0],
                       "scope": module_path(bn) if module_path else None})
        linear.output[0] = bn.output[0]
        removed.add(bn.name)
    kept_nodes = [n for n in graph.node if n.name not in removed]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    metadata.write(model_copy, FOLDED_KEY, folded)
    metadata.write(model_copy, KEPT_KEY, kept)
    return model_copy


def _unfoldable(bn: onnx.NodeProto, linear: onnx.NodeProto | None, inits, uses,
                outputs) -> str | None:
    """Why `bn` cannot be folded into `linear` (None: it can)."""
    if len([o for o in bn.output if o]) != 1 or attribute(bn, "training_mode", 0):
        return "it runs in training mode (it computes batch statistics)"
    if any(name not in inits or inits[name].data_type != onnx.TensorProto.FLOAT
           for name in bn.input[1:5]):
        return "its scale, bias, mean and variance are not float32 constants"
    if linear is None or linear.op_type not in FOLDABLE_OPS or \
            linear.domain not in _ONNX_DOMAINS:
        what = "a graph input" if linear is None else f"{linear.op_type} '{linear.name}'"
        return (f"its input comes from {what}, not from a Conv, ConvTranspose or Gemm; "
                "TensorRT runs it as a separate scale layer")
    if uses.get(linear.output[0], 0) != 1 or linear.output[0] in outputs:
        return (f"the output of {linear.op_type} '{linear.name}' is also read elsewhere, so "
                "it must stay unscaled")
    names = [linear.input[1]] + ([linear.input[2]] if len(linear.input) > 2 and
                                 linear.input[2] else [])
    if any(name not in inits or inits[name].data_type != onnx.TensorProto.FLOAT
           for name in names):
        return f"the weights of {linear.op_type} '{linear.name}' are not float32 constants"
    channels = numpy_helper.to_array(inits[bn.input[1]]).size
    weight = inits[linear.input[1]]
    if linear.op_type == "Gemm":
        n_axis = 0 if attribute(linear, "transB", 0) else 1
        if len(weight.dims) != 2 or weight.dims[n_axis] != channels or \
                attribute(linear, "transA", 0) not in (0, 1):
            return f"Gemm '{linear.name}' has no output axis of {channels} channels"
        if len(names) > 1 and int(np.prod(inits[names[1]].dims)) not in (1, channels):
            return f"the bias of Gemm '{linear.name}' is not per output channel"
    elif _out_channels(linear, list(weight.dims)) != channels:
        return f"{linear.op_type} '{linear.name}' does not have {channels} output channels"
    return None


def _out_channels(node: onnx.NodeProto, dims: list[int]) -> int:
    if node.op_type == "ConvTranspose":
        return dims[1] * int(attribute(node, "group", 1))
    return dims[0]


def _folded(linear: onnx.NodeProto, weight: np.ndarray, bias: np.ndarray | None,
            gain: np.ndarray, beta: np.ndarray, mean: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """The weight scaled by `gain` on its output-channel axis and the BN-shifted bias."""
    channels = gain.size
    if linear.op_type == "Conv":
        weight = weight * gain.reshape((-1,) + (1,) * (weight.ndim - 1))
    elif linear.op_type == "ConvTranspose":
        # Weight [C_in, C_out / group, k...]: output channel g * C_out/group + j is column j
        # of group g's rows.
        group = int(attribute(linear, "group", 1))
        grouped = weight.reshape((group, -1, channels // group) + weight.shape[2:])
        weight = (grouped * gain.reshape((group, 1, channels // group) +
                                         (1,) * (weight.ndim - 2))).reshape(weight.shape)
    else:  # Gemm: Y = alpha * A @ B(^T) + beta * C
        n_axis = 0 if attribute(linear, "transB", 0) else 1
        weight = weight * float(attribute(linear, "alpha", 1.0)) * \
            (gain[:, None] if n_axis == 0 else gain[None, :])
        if bias is not None:
            bias = np.broadcast_to(bias.reshape(-1) * float(attribute(linear, "beta", 1.0)),
                                   (channels,))
    base = np.zeros(channels) if bias is None else bias.reshape(-1)
    return weight, (base - mean) * gain + beta


def _set_input(node: onnx.NodeProto, index: int, value: np.ndarray, inits, uses, taken,
               graph: onnx.GraphProto) -> None:
    """Give `node` input `index` the float32 `value`: in place when it alone reads the
    initializer, else under a fresh name (a weight shared with another node stays)."""
    array = value.astype(np.float32)
    current = node.input[index] if len(node.input) > index else ""
    if current and uses.get(current, 0) == 1:
        inits[current].CopyFrom(numpy_helper.from_array(array, current))
        return
    base = current or f"{node.name}_bias"
    name = f"{base}_bnfolded" if current else base
    suffix = 1
    while name in taken:
        name, suffix = f"{base}_bnfolded_{suffix}", suffix + 1
    taken.add(name)
    graph.initializer.append(numpy_helper.from_array(array, name))
    if current:
        uses[current] -= 1
    while len(node.input) <= index:
        node.input.append("")
    node.input[index] = name
    uses[name] = 1
