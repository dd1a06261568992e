"""Per-node error of quantization: each quantized node run alone on FP32 inputs.

:func:`local_error_model` cuts every compute node of a Q/DQ graph out with the
Q/DQ pairs (and weight DequantizeLinear) in front of it and puts all of them
side by side in one ONNX graph that reads tensors of the FP32 run. One batched
pass of that graph gives, per node, the error its own quantization adds — the
``local`` mode of validation, and the measurement the precision planner builds on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import helper

from quantlab.errors import ModelError
from quantlab.graph import Graph
from quantlab.qdq import PASS_THROUGH_OPS

# Suffix of the copies of a node's sub-graph in the local-error graph.
LOCAL_SUFFIX = "::local::"


@dataclass
class LocalErrorModel:
    """One ONNX graph holding, side by side, each quantized compute node with its input Q/DQ.

    ``model`` reads FP32 tensors (``feeds``, float activations and the computed
    non-float side inputs such as a Reshape's shape) and writes ``outputs``:
    local output name -> the FP32 tensor it is compared with.
    ``quantized_inputs`` lists, per compared tensor, the FP32 tensors whose
    quantization the node sees.
    """

    model: onnx.ModelProto
    feeds: list[str]
    outputs: dict[str, str]
    quantized_inputs: dict[str, list[str]] = field(default_factory=dict)


# (nodes from the FP32 feeds to a tensor, the feeds, the quantized FP32 tensors)
_Chain = tuple[list[onnx.NodeProto], list[str], list[str]]


def local_error_model(qdq: Graph, reference: Graph) -> LocalErrorModel:
    """Cut every quantized compute node of `qdq` out with its Q/DQ inputs.

    A node is quantized when one of its inputs comes from a DequantizeLinear,
    directly or through ops that commute with quantization (MaxPool, Reshape, ...).
    Its other non-constant inputs, the inputs of its Quantize nodes and the
    computed side inputs of the pass-through ops (a Reshape's shape made by
    Shape -> Gather -> Concat) are fed from the FP32 run of `reference` under the
    same names.
    """
    known = set(reference.order)

    def side_inputs(node: onnx.NodeProto) -> tuple[list[onnx.NodeProto], list[str]] | None:
        """Constant producers to copy and tensors to feed for a node's non-data inputs."""
        nodes, fed = [], []
        for name in node.input[1:]:
            if not name or name in qdq.initializers:
                continue
            producer = qdq.producers.get(name)
            if producer is not None and producer.op_type == "Constant":
                nodes.append(producer)
            elif name in known:
                fed.append(name)
            else:
                return None
        return nodes, fed

    def chain(tensor: str) -> _Chain | None:
        node = qdq.producers.get(tensor)
        if tensor in qdq.initializers or node is None:
            return [], [], []
        if node.op_type == "Constant":
            return [node], [], []
        if node.op_type == "DequantizeLinear":
            source = node.input[0]
            sides = side_inputs(node)
            if sides is None:
                return None
            if source in qdq.constants:
                return [*sides[0], node], sides[1], []
            quantize = qdq.producers.get(source)
            quantize_sides = side_inputs(quantize) if quantize is not None else None
            if quantize is None or quantize.op_type != "QuantizeLinear" or quantize_sides is None:
                return None
            fed = quantize.input[0]
            return ([*quantize_sides[0], *sides[0], quantize, node],
                    [fed, *quantize_sides[1], *sides[1]], [fed])
        if node.op_type in PASS_THROUGH_OPS:
            upstream = chain(node.input[0])
            sides = side_inputs(node)
            if upstream is not None and upstream[2] and sides is not None:
                return ([*upstream[0], *sides[0], node], [*upstream[1], *sides[1]], upstream[2])
        return [], [tensor], []

    combined: list[onnx.NodeProto] = []
    feeds: dict[str, None] = {}
    outputs: dict[str, str] = {}
    quantized_inputs: dict[str, list[str]] = {}
    for node in qdq.model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant") or \
                node.op_type in PASS_THROUGH_OPS:
            continue
        parts = [chain(i) for i in node.input if i]
        if any(p is None for p in parts) or not any(p[2] for p in parts):
            continue
        needed = list(dict.fromkeys(t for p in parts for t in p[1]))
        compared = [o for o in node.output if o in known and o in reference.floats]
        if not compared or any(t not in known for t in needed):
            continue
        suffix = f"{LOCAL_SUFFIX}{node.name}"
        copied = list({id(n): n for p in parts for n in p[0]}.values())
        renamed = {out: out + suffix for n in copied for out in n.output}
        renamed.update({out: out + suffix for out in node.output})
        for sub in [*copied, node]:
            copy = onnx.NodeProto()
            copy.CopyFrom(sub)
            copy.name = sub.name + suffix
            del copy.input[:], copy.output[:]
            copy.input.extend(renamed.get(i, i) for i in sub.input)
            copy.output.extend(renamed[o] for o in sub.output)
            combined.append(copy)
        feeds.update(dict.fromkeys(needed))
        for out in compared:
            outputs[renamed[out]] = out
            quantized_inputs[out] = sorted({t for p in parts for t in p[2]})
    if not outputs:
        raise ModelError(
            "the INT8 model has no compute node reading a QuantizeLinear/DequantizeLinear pair "
            "on a tensor of the FP32 model; local mode needs a Q/DQ model made from the FP32 "
            "model passed as reference (same tensor names). Use --mode global otherwise."
        )
    used = {i for n in combined for i in n.input}
    model = helper.make_model(
        helper.make_graph(
            combined, "local_errors",
            [_feed_value(qdq, reference, f) for f in feeds],
            [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs],
            [init for init in qdq.model.graph.initializer if init.name in used],
        ),
        opset_imports=qdq.model.opset_import,
    )
    model.ir_version = qdq.model.ir_version
    return LocalErrorModel(model, list(feeds), outputs, quantized_inputs)


def _feed_value(qdq: Graph, reference: Graph, name: str) -> onnx.ValueInfoProto:
    """The input declaration of a feed: its type and rank, every dimension symbolic."""
    value = qdq.values.get(name) or reference.values.get(name)
    if value is None:
        return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
    shape = qdq.shapes.get(name, reference.shapes.get(name))
    dims = None if shape is None else [f"{name}_d{i}" for i in range(len(shape))]
    return helper.make_tensor_value_info(name, value.type.tensor_type.elem_type, dims)
