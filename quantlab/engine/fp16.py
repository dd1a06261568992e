"""FP16 as TensorRT runs it, in ONNX Runtime: float16 tensors, float32 arithmetic.

A plan's FP16 unit is written for TensorRT as float16 tensors around the node
(Cast(float16) -> node -> Cast(float32), float16 weights:
:func:`quantlab.calibration.qdq.quantize_model`), which a strongly typed TensorRT network builds
into an FP16 layer. ONNX Runtime's CPU provider has no float16 kernel for most ops: it wraps such a
node in casts of its own and then removes them with the model's Cast pair as lossless, so the node
runs in float32 without rounding anything ([1000.3, 70000] through an FP16 Relu stays
[1000.3, 70000] at every graph optimization level). :func:`emulated` rewrites every
node that reads float16 into a float32 node between explicit casts, which ONNX
Runtime keeps: its float16 inputs and weights widened (exact), its float16 outputs
rounded to float16 (round to nearest even, overflow to inf). That is the arithmetic
of TensorRT's FP16 kernels (float16 I/O, float32 accumulation), on any provider.
What it leaves out against a real FP16 layer: docs/qdq.md, "FP16 units".
"""

from __future__ import annotations

import onnx
from onnx import helper, shape_inference

from quantlab import graph
from quantlab.calibration.qdq import Converted
from quantlab.errors import ModelError

_FLOAT, _FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
_ONNX_DOMAINS = ("", "ai.onnx")


def emulated(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every node that reads float16 computing in float32 on the widened
    values, its float16 outputs rounded to float16 under their own names; `model`
    itself (not a copy) when nothing reads float16.

    Casts, nodes of other domains and control flow (whose bodies' types are their own)
    are left as they are; so are nodes that only write float16 (ConstantOfShape).
    """
    half = float16_tensors(model)
    if not half:
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    g = result.graph
    wide = Converted(result, _FLOAT, "::fp32", "::widen")
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        if node.op_type == "Cast" or node.domain not in _ONNX_DOMAINS or \
                graph.subgraphs(node) or not any(name in half for name in node.input):
            nodes.append(node)
            continue
        node.input[:] = [wide(name, nodes) if name in half else name for name in node.input]
        rounded = []
        for index, name in enumerate(node.output):
            if name in half:
                node.output[index] = wide.fresh(f"{name}::unrounded")
                rounded.append(helper.make_node("Cast", [node.output[index]], [name],
                                                name=wide.fresh(f"{name}::round"), to=_FLOAT16))
        nodes += [node, *rounded]
    del g.node[:]
    g.node.extend(nodes)
    graph.drop_unused_initializers(result)  # float16 weights now read as float32 copies
    return result


def float16_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of the float16 tensors of `model`'s main graph (empty when it has none).

    Types are inferred on a copy without weights (initializers declared as inputs):
    quantize_model's float16 tensors carry no declared type, and a copy with weights
    would cost the model's size on every ONNX Runtime session.
    """
    g = model.graph
    if not any(init.data_type == _FLOAT16 for init in g.initializer) and not any(
            node.op_type == "Cast" and _cast_to(node) == _FLOAT16 for node in g.node) and \
            not any(_elem_type(v) == _FLOAT16 for v in [*g.input, *g.value_info, *g.output]):
        return set()
    declared = {v.name for v in g.input}
    light = helper.make_model(
        helper.make_graph(
            g.node, g.name,
            [*g.input, *(helper.make_tensor_value_info(i.name, i.data_type, i.dims)
                         for i in g.initializer if i.name not in declared)],
            g.output, value_info=g.value_info),
        opset_imports=model.opset_import, ir_version=model.ir_version)
    try:
        light = shape_inference.infer_shapes(light, strict_mode=False)
    except Exception as exc:  # onnx raises InferenceError for inconsistent graphs
        raise ModelError(f"ONNX type inference failed on a model with float16 parts: {exc}. "
                         "Check that the model loads in ONNX Runtime as it is.") from None
    values = [*light.graph.input, *light.graph.value_info, *light.graph.output]
    return {v.name for v in values if _elem_type(v) == _FLOAT16}


def _elem_type(value: onnx.ValueInfoProto) -> int:
    return value.type.tensor_type.elem_type


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)
