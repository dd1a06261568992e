"""The layer TensorRT runs for a linear op: the op, its folded BatchNorm and bias, and the
pointwise activation TensorRT fuses into its epilogue.

BatchNorm is folded at import (:mod:`quantlab.calibration.folding`). After the op, TensorRT fuses
the activation: "Convolution and ReLU / Clip / GELU Activation" fusions of its developer guide
(Types of Fusions), and from 8.x PointWise fusion of a chain of elementwise layers into the
producer, which engine inspectors show as ``Conv + PWN(Add, Clip, Mul, Div)`` for a
decomposed HardSwish or ``Conv + PWN(Sigmoid, Mul)`` for SiLU (docs/tensorrt.md). Only the
chain's last tensor exists in the engine (quantized there by the next layer's Q), so a
layer's local error is measured there (:func:`quantlab.evaluation.sensitivity.local_error_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from quantlab.graph import Graph

# Elementwise ops a fused chain may hold. Every input of a chain node is the linear op's
# output, an earlier chain tensor or a constant (a Clip's bounds, HardSwish's 3 and 6, a
# PRelu slope, a per-channel Div that depthwise equalization folded in); an Add or Mul of
# another computed tensor (a residual, an SE gate) ends the chain.
POINTWISE_OPS = frozenset({
    "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
    "Elu", "Selu", "Softplus", "Gelu", "Erf", "Add", "Sub", "Mul", "Div", "Pow",
})
_ONNX_DOMAINS = ("", "ai.onnx")


def fused_activation(g: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The pointwise nodes after linear op `node` that TensorRT fuses into its layer, in graph
    order; the last one's output is the fused layer's output. The longest run of them whose
    tensors nothing else reads but the last one's (the engine writes only that tensor); empty
    when even the first is read elsewhere, or the op's own output is."""
    inside = {node.output[0]}
    found: list[onnx.NodeProto] = []
    taken: set[str] = set()
    grown = True
    while grown:
        grown = False
        for tensor in list(inside):
            for reader in g.consumers.get(tensor, []):
                if reader.name not in taken and _fusible(reader, inside, g):
                    found.append(reader)
                    taken.add(reader.name)
                    inside.update(reader.output)
                    grown = True
    order = {n.name: i for i, n in enumerate(g.model.graph.node)}
    found.sort(key=lambda n: order[n.name])
    for length in range(len(found), 0, -1):
        chain = found[:length]
        names = {n.name for n in chain}
        tensors = [node.output[0], *(t for n in chain for t in n.output)]
        exits = [t for t in tensors if t in g.outputs or
                 any(r.name not in names for r in g.consumers.get(t, []))]
        if exits == [chain[-1].output[0]]:
            return chain
    return []


def _fusible(node: onnx.NodeProto, inside: set[str], g: Graph) -> bool:
    """A pointwise op with one output whose every input is a chain tensor or a constant, at
    least one of them a chain tensor."""
    inputs = [name for name in node.input if name]
    return (node.op_type in POINTWISE_OPS and node.domain in _ONNX_DOMAINS
            and len(node.output) == 1
            and all(name in inside or name in g.constants for name in inputs)
            and any(name in inside for name in inputs))


# Ops an exporter decomposes LayerNorm, GELU and Softmax into (opset < 17 LayerNorm, Paddle
# exports, the erf form of GELU, a softmax written out); a decomposition starts at a seed.
DECOMPOSED_OPS = frozenset({
    "ReduceMean", "ReduceSum", "ReduceMax", "Sub", "Pow", "Sqrt", "Reciprocal", "Div", "Mul",
    "Add", "Erf", "Exp", "Cast",
})
_SEEDS = ("ReduceMean", "ReduceMax", "Erf", "Exp")
# A decomposition is at most this many nodes (LayerNorm written out is 9).
_MOST_NODES = 16


@dataclass(frozen=True)
class DecomposedOp:
    """One op the exporter wrote as several nodes: the name a user knows it by, its nodes in
    graph order and the tensor it writes (the one later ops read)."""

    label: str
    nodes: tuple[str, ...]
    output: str


def decomposed_ops(g: Graph) -> dict[str, DecomposedOp]:
    """Every tensor inside a decomposed LayerNorm / RMSNorm, GELU or Softmax -> that op.

    A decomposition is the region grown from a seed node (a mean, a max, Erf, Exp) through
    :data:`DECOMPOSED_OPS` whose every input is its entry tensor, a constant or its own, until
    one tensor alone leaves it; a trailing scale and shift by constants (LayerNorm's gamma
    and beta, GELU's 0.5) belong to it, and so does a division of the entry by a constant
    before the seed (GELU's x / sqrt 2)."""
    found: dict[str, DecomposedOp] = {}
    for node in g.model.graph.node:
        if node.op_type not in _SEEDS or node.output[0] in found:
            continue
        grown = _region(g, node)
        if grown is None:
            continue
        region, output = grown
        ops = {n.op_type for n in region}
        label = ("GELU" if "Erf" in ops else "Softmax" if "Exp" in ops
                 else ("LayerNorm" if "Sub" in ops else "RMSNorm")
                 if ops & {"Sqrt", "Reciprocal", "Pow"} and "ReduceMean" in ops else None)
        if label is None:
            continue
        op = DecomposedOp(label, tuple(n.name for n in region), output)
        found.update({n.output[0]: op for n in region})
    return found


def _region(g: Graph, seed: onnx.NodeProto) -> tuple[list[onnx.NodeProto], str] | None:
    """The nodes of the decomposition grown from `seed` in graph order and the tensor it
    writes, or None when what
    grows is not one op: fewer than 3 nodes, more than :data:`_MOST_NODES`, or more than one
    tensor leaving it."""
    entry = next((t for t in seed.input if t and not _constant(g, t)), None)
    if entry is None:
        return None
    region = [seed]
    before = g.producers.get(entry)
    if (before is not None and before.op_type in ("Div", "Mul") and len(g.consumers[entry]) == 1
            and all(_constant(g, t) for t in before.input[1:])):
        region.insert(0, before)
        entry = before.input[0]
    produced = {n.output[0] for n in region}
    names = {n.name for n in region}
    readers = [r for t in produced for r in g.consumers.get(t, [])]
    while readers and len(region) <= _MOST_NODES:
        reader = readers.pop(0)
        if reader.name in names or reader.op_type not in DECOMPOSED_OPS or not all(
                t == entry or t in produced or _constant(g, t) for t in reader.input if t):
            continue
        region.append(reader)
        names.add(reader.name)
        produced.add(reader.output[0])
        readers += g.consumers.get(reader.output[0], [])
    leaving = [t for t in produced
               if t in g.outputs or any(r.name not in names for r in g.consumers.get(t, []))]
    if len(leaving) != 1 or not 3 <= len(region) <= _MOST_NODES:
        return None
    order = {n.name: i for i, n in enumerate(g.model.graph.node)}
    return sorted(region, key=lambda n: order[n.name]), leaving[0]


def _constant(g: Graph, tensor: str) -> bool:
    """A constant, or an Identity of one (the TorchScript exporter writes equal parameters,
    a second LayerNorm's gamma of ones, once and the others as Identity nodes)."""
    producer = g.producers.get(tensor)
    return tensor in g.constants or (producer is not None and producer.op_type == "Identity"
                                     and producer.input[0] in g.constants)
