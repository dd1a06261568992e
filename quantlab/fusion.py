"""The layer TensorRT runs for a linear op: the op, its folded BatchNorm and bias, and the
pointwise activation TensorRT fuses into its epilogue.

BatchNorm is folded at import (:mod:`quantlab.folding`). After the op, TensorRT fuses the
activation: "Convolution and ReLU / Clip / GELU Activation" fusions of its developer guide
(Types of Fusions), and from 8.x PointWise fusion of a chain of elementwise layers into the
producer, which engine inspectors show as ``Conv + PWN(Add, Clip, Mul, Div)`` for a
decomposed HardSwish or ``Conv + PWN(Sigmoid, Mul)`` for SiLU (docs/tensorrt.md). Only the
chain's last tensor exists in the engine (quantized there by the next layer's Q), so a
layer's local error is measured there (:func:`quantlab.sensitivity.local_error_model`).
"""

from __future__ import annotations

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
