"""Units of decision: linear ops with the Q/DQ pairs on their inputs, merged with every unit
that must share one of those pairs or their scale; their MACs; what a written model runs.

qdq's placement keys each activation pair by the tensor it sits on, so linear ops
reading one tensor, and a residual Add reading it as its skip input, share a pair
and are decided together; pairs joined by a Concat share a scale (TensorRT moves
the Concat output's Q onto its inputs) and are decided together too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from quantlab.calibration import qdq
from quantlab.errors import ModelError
from quantlab.graph import Graph, concrete_types


@dataclass
class Unit:
    """One decision: linear ops and residual Adds whose Q/DQ pairs go on or off together."""

    name: str
    linear: list[str]
    nodes: list[str]
    tensors: list[str]
    weights: list[str]
    macs: int = 0


def find_units(g: Graph, input_shapes: Mapping[str, Sequence[int]] | None = None,
               measure: Callable[[list[str]], Mapping[str, Sequence[int]]] | None = None
               ) -> list[Unit]:
    """The units of a normalized model, in topological order, with MACs per sample batch.

    `input_shapes` (the real shapes of a calibration batch) fixes dimensions the
    model leaves symbolic; MACs are counted for inputs of those shapes. Where ONNX
    shape inference still leaves a linear op's shapes unknown (silero-vad's STFT
    conv after a computed Pad), `measure` (tensor names -> their shapes in a run
    on inputs of `input_shapes`) gives them.
    """
    placement = qdq.place(g.model)
    nodes = {node.name: node for node in g.model.graph.node}
    parent = {name: name for name in nodes}

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def union(first: str, second: str) -> None:
        parent[find(first)] = find(second)

    tensors_of: dict[str, list[str]] = {}
    skip_index: dict[str, int] = {}
    decided: set[str] = set()
    for tensor, edges in placement.readers.items():
        owners = _owners(edges, nodes, g)
        if not all(nodes[o].op_type in qdq.LINEAR_OPS or nodes[o].op_type == "Add"
                   for o in owners):
            continue  # the pair between a linear op and its Relu: a fusion aid, exact either way
        skip_index.update((o, i) for o, i in owners.items() if nodes[o].op_type == "Add")
        decided.update(owners)
        first, *others = owners
        for owner in others:
            union(first, owner)
        tensors_of.setdefault(first, []).append(tensor)
    owner_of = {t: owner for owner, tensors in tensors_of.items() for t in tensors}
    for group in scale_groups(g, placement):
        # Pairs joined by a Concat share one scale (see scale_groups): one decision.
        first, *others = [owner_of[t] for t in group if t in owner_of]
        for owner in others:
            union(first, owner)
    weights_of: dict[str, list[str]] = {}
    for (node_name, _), (weight, _) in placement.weights.items():
        weights_of.setdefault(node_name, []).append(weight)
        decided.add(node_name)

    for add, index in skip_index.items():
        if not any(nodes[n].op_type in qdq.LINEAR_OPS for n in decided if find(n) == find(add)):
            # Only residual Adds: TensorRT fuses such an Add into the conv producing its other
            # input, and its skip pair exists for that fusion, so it joins that conv's unit.
            backbone = _backbone(nodes[add].input[1 - index], g)
            if backbone is not None and backbone.name in decided:
                union(add, backbone.name)
    order = {node.name: i for i, node in enumerate(g.model.graph.node)}
    groups: dict[str, list[str]] = {}
    for name in sorted(decided, key=order.__getitem__):
        groups.setdefault(find(name), []).append(name)

    shapes = _shapes(g, input_shapes)
    unknown = [t for names in groups.values() for n in names
               if nodes[n].op_type in qdq.LINEAR_OPS for t in _mac_tensors(nodes[n])
               if shapes.get(t) is None or None in shapes[t]]
    if unknown and measure is not None:
        shapes.update({t: tuple(s) for t, s in measure(list(dict.fromkeys(unknown))).items()})
    units = []
    for names in groups.values():
        linear = [n for n in names if nodes[n].op_type in qdq.LINEAR_OPS]
        tensors = sorted({t for n in names for t in tensors_of.get(n, [])},
                         key=lambda t: g.position.get(t, -1))
        weights = list(dict.fromkeys(w for n in names for w in weights_of.get(n, [])))
        macs = sum(linear_macs(nodes[n], shapes) for n in linear)
        units.append(Unit((linear or names)[0], linear, names, tensors, weights, macs))
    units.sort(key=lambda u: order[u.nodes[0]])
    return units


def scale_groups(g: Graph, placement: qdq.Placement | None = None) -> list[list[str]]:
    """Pair tensors that must share one scale: those joined by a Concat, and its output's.

    TensorRT moves Q/DQ through commuting ops, Concat among them (docs/tensorrt.md,
    "Q/DQ rules TensorRT expects"): the pair on a Concat's output moves onto each
    of its inputs, so an input that carries its own pair for another reader gets a
    second quantization at another scale unless the two scales are equal, and the
    Concat cannot be a plain copy of INT8 inputs (NVIDIA/TensorRT#4366, #3861;
    NNCF unifies Concat scales for the same reason, openvinotoolkit/nncf#646).
    Members are found through pass-through ops (a pair moved back across a Reshape)
    and nested Concats. Groups of two or more pair tensors, in topological order.
    """
    placement = placement or qdq.place(g.model)
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        parent.setdefault(name, name)
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def paired(tensor: str) -> str:
        """The tensor carrying the pair `tensor` is quantized with, across pass-through ops."""
        while tensor not in placement.readers and \
                (producer := g.producers.get(tensor)) is not None and \
                producer.op_type in qdq.PASS_THROUGH_OPS:
            tensor = producer.input[0]
        return tensor

    for node in g.model.graph.node:
        if node.op_type == "Concat":
            members = [paired(t) for t in [node.output[0], *node.input] if t in g.floats]
            for member in members[1:]:
                parent[find(member)] = find(members[0])
    groups: dict[str, list[str]] = {}
    for tensor in sorted(parent, key=lambda t: g.position.get(t, -1)):
        if tensor in placement.readers:
            groups.setdefault(find(tensor), []).append(tensor)
    return [group for group in groups.values() if len(group) > 1]


def share_scales(g: Graph, amax: Mapping[str, float]) -> dict[str, float]:
    """`amax` with every scale group (:func:`scale_groups`) at its widest member's amax.

    The widest range, so no member clips more than its own calibration allowed.
    """
    placement = qdq.place(g.model)
    shared = dict(amax)
    for group in scale_groups(g, placement):
        sources = {placement.source[t] for t in group} & set(amax)
        if sources:
            widest = max(amax[t] for t in sources)
            shared.update(dict.fromkeys(sources, widest))
    return shared


def _owners(edges, nodes, g: Graph) -> dict[str, int]:
    """Nodes deciding a pair (-> input index): its readers, followed forward through the
    pass-through ops the pair moved backward across."""
    owners, stack, seen = {}, list(edges), set()
    while stack:
        name, index = stack.pop()
        if (name, index) in seen:
            continue
        seen.add((name, index))
        node = nodes[name]
        if node.op_type in qdq.PASS_THROUGH_OPS and index == 0:
            stack.extend((c.name, i) for c in g.consumers.get(node.output[0], [])
                         for i, x in enumerate(c.input) if x == node.output[0])
        else:
            owners[name] = index
    return dict(sorted(owners.items()))


def _backbone(tensor: str, g: Graph) -> onnx.NodeProto | None:
    """The linear op producing `tensor`, directly or through a BatchNormalization."""
    producer = g.producers.get(tensor)
    if producer is not None and producer.op_type == "BatchNormalization":
        producer = g.producers.get(producer.input[0])
    return producer if producer is not None and producer.op_type in qdq.LINEAR_OPS else None


def _shapes(g: Graph, input_shapes) -> dict[str, tuple]:
    """Shapes of every tensor and initializer; symbolic dims fixed by `input_shapes`."""
    shapes = dict(g.shapes)
    inferred = concrete_types(g.model, input_shapes) if input_shapes else None
    for name, tensor_type in (inferred or {}).items():
        if tensor_type.HasField("shape"):
            shapes[name] = tuple(d.dim_value if d.HasField("dim_value") else None
                                 for d in tensor_type.shape.dim)
    shapes.update({init.name: tuple(init.dims) for init in g.model.graph.initializer})
    return shapes


def _mac_tensors(node: onnx.NodeProto) -> tuple[str, str]:
    """The two tensors whose shapes give a linear op's MACs (see :func:`linear_macs`)."""
    data, weight, out = node.input[0], node.input[1], node.output[0]
    return {"Conv": (out, weight), "ConvTranspose": (data, weight)}.get(node.op_type,
                                                                         (out, data))


def linear_macs(node: onnx.NodeProto, shapes: Mapping[str, tuple]) -> int:
    """Multiply-accumulates of one Conv / ConvTranspose / Gemm / MatMul from its shapes."""
    data, weight, out = (shapes.get(node.input[0]), shapes.get(node.input[1]),
                         shapes.get(node.output[0]))
    if any(shapes.get(t) is None or None in shapes[t] for t in _mac_tensors(node)):
        raise ModelError(
            f"the shapes around node '{node.name}' ({node.op_type}) are not all known, so its "
            "MACs cannot be counted; pass the shapes of a real batch (the planner takes them "
            "from the calibration data)."
        )
    if node.op_type == "Conv":
        return int(np.prod(out, dtype=np.int64) * np.prod(weight[1:], dtype=np.int64))
    if node.op_type == "ConvTranspose":
        return int(np.prod(data, dtype=np.int64) * np.prod(weight[1:], dtype=np.int64))
    if node.op_type == "Gemm":
        trans_a = next((a.i for a in node.attribute if a.name == "transA"), 0)
        return int(np.prod(out, dtype=np.int64) * data[0 if trans_a else 1])
    return int(np.prod(out, dtype=np.int64) * data[-1])


def read_back(qdq_model: onnx.ModelProto, units: Sequence[Unit]) -> dict[str, str]:
    """Each unit's precision as the written model runs it, read from the graph alone.

    INT8 when every linear op of the unit reads its data and weight through
    DequantizeLinear (directly or across pass-through ops), FP16 when they read
    float16 values, FP32 otherwise; make_plan checks the model it returns so.
    """
    g = Graph(onnx.shape_inference.infer_shapes(qdq_model))
    nodes = {node.name: node for node in qdq_model.graph.node}
    half = {init.name for init in qdq_model.graph.initializer
            if init.data_type == onnx.TensorProto.FLOAT16}

    def dequantized(tensor: str) -> bool:
        producer = g.producers.get(tensor)
        while producer is not None and producer.op_type in qdq.PASS_THROUGH_OPS:
            producer = g.producers.get(producer.input[0])  # the pair moved across it
        return producer is not None and producer.op_type == "DequantizeLinear"

    def precision(name: str) -> str:
        data = nodes[name].input[:2]
        if all(dequantized(i) for i in data):
            return "int8"
        if all(i in half or g.dtype(i) == np.float16 for i in data):
            return "fp16"
        return "fp32"

    result = {}
    for unit in units:
        found = {precision(n) for n in unit.linear}
        if found:
            result[unit.name] = found.pop() if len(found) == 1 else "mixed"
    return result
