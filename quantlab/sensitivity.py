"""Per-node error of quantization: each quantized node run alone on FP32 inputs.

:func:`local_error_model` cuts every compute node of a Q/DQ graph out with the
Q/DQ pairs (and weight DequantizeLinear) in front of it and puts all of them
side by side in one ONNX graph that reads tensors of the FP32 run. One batched
pass of that graph gives, per node, the error its own quantization adds — the
``local`` mode of validation, and the measurement the precision planner builds on.
Nodes the Q/DQ graph runs in FP16 (float16 inputs through ``Cast``, float16
initializers, as :func:`quantlab.qdq.quantize_model` writes them) are cut out
too; given several Q/DQ graphs of one FP32 model (the all-INT8 and the all-FP16
plan), each node appears once per precision, so one pass measures both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import onnx
from onnx import helper

from quantlab.errors import ModelError
from quantlab.graph import Graph
from quantlab.qdq import PASS_THROUGH_OPS

# Suffix of the copies of a node's sub-graph in the local-error graph.
LOCAL_SUFFIX = "::local::"
_FLOAT, _FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


@dataclass
class LocalErrorModel:
    """One ONNX graph holding, side by side, each quantized compute node with its input Q/DQ.

    ``model`` reads FP32 tensors (``feeds``, float activations and the computed
    non-float side inputs such as a Reshape's shape) and writes ``outputs``:
    local output name -> the FP32 tensor it is compared with; ``precisions``:
    local output name -> the precision its node ran in ("int8" or "fp16").
    ``quantized_inputs`` lists, per compared tensor, the FP32 tensors whose
    quantization (or rounding to float16) the node sees, from the first Q/DQ
    graph that computes it.
    """

    model: onnx.ModelProto
    feeds: list[str]
    outputs: dict[str, str]
    quantized_inputs: dict[str, list[str]] = field(default_factory=dict)
    precisions: dict[str, str] = field(default_factory=dict)


class _Chain(NamedTuple):
    """How a node input is made from FP32 feeds."""

    nodes: list[onnx.NodeProto]  # the nodes to copy (or, for a float16 twin, to add)
    fed: list[str]  # FP32 tensors they read
    sources: list[str]  # FP32 tensors quantized or rounded on the way
    precision: str | None  # "int8" through Q/DQ, "fp16" through a float16 rounding


_PLAIN = _Chain([], [], [], None)


def local_error_model(qdq: Graph | Sequence[Graph], reference: Graph) -> LocalErrorModel:
    """Cut every quantized compute node of `qdq` out with its Q/DQ inputs.

    A node is quantized when one of its inputs comes from a DequantizeLinear,
    directly or through ops that commute with quantization (MaxPool, Reshape, ...),
    or reads float16 (a Cast to float16 or another FP16 node's output): such a
    node runs in float32 on its float16-rounded inputs and its output is rounded
    to float16, the arithmetic of TensorRT's FP16 kernels (float32 accumulation)
    and of ONNX Runtime running a Cast-wrapped float16 node on CPU. Its other
    non-constant inputs, the inputs of its Quantize nodes and Casts and the
    computed side inputs of the pass-through ops (a Reshape's shape made by Shape
    -> Gather -> Concat) are fed from the FP32 run of `reference` under the same
    names. `qdq` may be several Q/DQ graphs of `reference`: their nodes go side by
    side, once per (node, precision).
    """
    graphs = [qdq] if isinstance(qdq, Graph) else list(qdq)
    known = set(reference.order)
    reference_nodes = {node.name: node for node in reference.model.graph.node}
    combined: list[onnx.NodeProto] = []
    initializers: dict[str, onnx.TensorProto] = {}
    feeds: dict[str, None] = {}
    seen: set[tuple[str, str]] = set()
    result = LocalErrorModel(onnx.ModelProto(), [], {})
    for index in graphs:
        stored = {init.name: init for init in index.model.graph.initializer}
        chain = _chains(index, known, reference_nodes)
        for node in index.model.graph.node:
            if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant", "Cast") or \
                    node.op_type in PASS_THROUGH_OPS or node.name not in reference_nodes:
                continue
            inputs = [i for i in node.input if i]
            parts = [chain(i) for i in inputs]
            precisions = {p.precision for p in parts if p is not None} - {None}
            if any(p is None for p in parts) or len(precisions) != 1:
                continue
            precision = precisions.pop()
            compared = {out: ref for out, ref in zip(node.output,
                                                     reference_nodes[node.name].output,
                                                     strict=False)
                        if ref in known and ref in reference.floats}
            needed = list(dict.fromkeys(t for p in parts for t in p.fed))
            if not compared or any(t not in known for t in needed) or \
                    (node.name, precision) in seen:
                continue
            seen.add((node.name, precision))
            suffix = f"{LOCAL_SUFFIX}{precision}::{node.name}"
            copied = list({id(n): n for p in parts for n in p.nodes}.values())
            renamed = {out: out + suffix for n in copied for out in n.output}
            renamed.update({out: out + suffix for out in node.output})
            for sub in [*copied, node]:
                for name in sub.input:
                    if name not in stored:
                        continue
                    if name in initializers and initializers[name] != stored[name]:
                        # Same name, other content in an earlier Q/DQ graph: keep both.
                        renamed[name] = name + suffix
                    initializers[renamed.get(name, name)] = _named(stored[name],
                                                                   renamed.get(name, name))
                combined.append(_renamed_copy(sub, suffix, renamed))
            if precision == "fp16":
                half = {renamed.get(i, i) for i, p in zip(inputs, parts, strict=True)
                        if p.precision == "fp16" or
                        (i in stored and stored[i].data_type == _FLOAT16)}
                combined += _in_float32(combined.pop(), half)
            feeds.update(dict.fromkeys(needed))
            for out, ref in compared.items():
                result.outputs[renamed[out]] = ref
                result.precisions[renamed[out]] = precision
                result.quantized_inputs.setdefault(
                    ref, sorted({t for p in parts for t in p.sources}))
    if not result.outputs:
        raise ModelError(
            "the INT8 model has no compute node reading a QuantizeLinear/DequantizeLinear pair "
            "(or a float16 Cast) on a tensor of the FP32 model; local mode needs a Q/DQ model "
            "made from the FP32 model passed as reference (same tensor names). Use --mode "
            "global otherwise."
        )
    first = graphs[0].model
    result.model = helper.make_model(
        helper.make_graph(
            combined, "local_errors",
            [_feed_value(reference, f) for f in feeds],
            [helper.make_tensor_value_info(name, _FLOAT, None) for name in result.outputs],
            list(initializers.values()),
        ),
        opset_imports=first.opset_import,
    )
    result.model.ir_version = first.ir_version
    result.feeds = list(feeds)
    return result


def _chains(qdq: Graph, known: set[str], reference_nodes: dict):
    """``chain(tensor)``: how a node input of `qdq` is made from FP32 feeds (None: it cannot)."""

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
            return _PLAIN
        if node.op_type == "Constant":
            return _Chain([node], [], [], None)
        if node.op_type == "DequantizeLinear":
            source = node.input[0]
            sides = side_inputs(node)
            if sides is None:
                return None
            if source in qdq.constants:
                return _Chain([*sides[0], node], sides[1], [], None)
            quantize = qdq.producers.get(source)
            quantize_sides = side_inputs(quantize) if quantize is not None else None
            if quantize is None or quantize.op_type != "QuantizeLinear" or quantize_sides is None:
                return None
            fed = quantize.input[0]
            return _Chain([*quantize_sides[0], *sides[0], quantize, node],
                          [fed, *quantize_sides[1], *sides[1]], [fed], "int8")
        if node.op_type == "Cast" and _cast_to(node) == _FLOAT16 and node.input[0] in known:
            return _Chain([node], [node.input[0]], [node.input[0]], "fp16")
        if node.op_type in PASS_THROUGH_OPS:
            upstream = chain(node.input[0])
            sides = side_inputs(node)
            if upstream is not None and upstream.sources and sides is not None:
                return _Chain([*upstream.nodes, *sides[0], node], [*upstream.fed, *sides[1]],
                              upstream.sources, upstream.precision)
        twin = reference_nodes.get(node.name)
        if tensor not in known and twin is not None:
            # Another FP16 node's float16 output (the only outputs quantize_model renames):
            # the FP32 run's tensor, rounded to float16.
            fp32 = twin.output[list(node.output).index(tensor)]
            return _Chain([helper.make_node("Cast", [fp32], [tensor], name=f"{tensor}_Cast_fp16",
                                            to=_FLOAT16)], [fp32], [fp32], "fp16")
        return _Chain([], [tensor], [], None)

    return chain


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _renamed_copy(node: onnx.NodeProto, suffix: str, renamed: dict[str, str]) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = node.name + suffix
    del copy.input[:], copy.output[:]
    copy.input.extend(renamed.get(i, i) for i in node.input)
    copy.output.extend(renamed[o] for o in node.output)
    return copy


def _named(init: onnx.TensorProto, name: str) -> onnx.TensorProto:
    if init.name == name:
        return init
    copy = onnx.TensorProto()
    copy.CopyFrom(init)
    copy.name = name
    return copy


def _in_float32(node: onnx.NodeProto, half: set[str]) -> list[onnx.NodeProto]:
    """An FP16 node computing in float32: its float16 inputs `half` widened, its outputs
    rounded to float16 and widened back (float32 accumulation, as TensorRT's FP16 kernels)."""
    nodes = []
    for index, name in enumerate(node.input):
        if name in half:
            wide = f"{name}::fp32::{node.name}"
            nodes.append(helper.make_node("Cast", [name], [wide], name=wide, to=_FLOAT))
            node.input[index] = wide
    outputs = list(node.output)
    node.output[:] = [f"{o}::accumulated" for o in outputs]
    nodes.append(node)
    for out in outputs:
        nodes += [helper.make_node("Cast", [f"{out}::accumulated"], [f"{out}::fp16"],
                                   name=f"{out}::fp16", to=_FLOAT16),
                  helper.make_node("Cast", [f"{out}::fp16"], [out], name=f"{out}::rounded",
                                   to=_FLOAT)]
    return nodes


def _feed_value(reference: Graph, name: str) -> onnx.ValueInfoProto:
    """The input declaration of a feed: its type and rank, every dimension symbolic."""
    value = reference.values.get(name)
    if value is None:
        return helper.make_tensor_value_info(name, _FLOAT, None)
    shape = reference.shapes.get(name)
    dims = None if shape is None else [f"{name}_d{i}" for i in range(len(shape))]
    return helper.make_tensor_value_info(name, value.type.tensor_type.elem_type, dims)
