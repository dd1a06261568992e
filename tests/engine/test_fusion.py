"""Tests for quantlab.engine.fusion: the activation TensorRT fuses into a linear op's layer."""

from __future__ import annotations

import numpy as np
from onnx import helper

from quantlab import graph
from quantlab.engine.fusion import decomposed_ops, fused_activation
from tests.helpers import onnx_model

W = np.ones((4, 4, 1, 1))


def _chain(nodes, outputs, initializers=None, inputs=(("x", ["N", 4, 5, 5]),)):
    g = graph.Graph(graph.normalize(onnx_model(nodes, list(inputs), outputs,
                                               {"w": W, **(initializers or {})})))
    conv = next(n for n in g.model.graph.node if n.name == "conv")
    return [n.name for n in fused_activation(g, conv)]


def conv(output="c"):
    return helper.make_node("Conv", ["x", "w"], [output], name="conv")


def test_relu_and_relu6_fuse():
    assert _chain([conv(), helper.make_node("Relu", ["c"], ["r"], name="relu")], ["r"]) == [
        "relu"]
    clip = helper.make_node("Clip", ["c", "lo", "hi"], ["r"], name="relu6")
    assert _chain([conv(), clip], ["r"], {"lo": 0.0, "hi": 6.0}) == ["relu6"]


def test_decomposed_hardswish_fuses_whole_up_to_the_next_layer():
    # Paddle's export: x * clip(x + 3, 0, 6) / 6, read by the next conv.
    nodes = [conv(),
             helper.make_node("Add", ["c", "three"], ["a"], name="add"),
             helper.make_node("Clip", ["a", "zero", "six"], ["k"], name="clip"),
             helper.make_node("Mul", ["c", "k"], ["m"], name="mul"),
             helper.make_node("Div", ["m", "six"], ["h"], name="div"),
             helper.make_node("Conv", ["h", "w"], ["y"], name="next")]
    assert _chain(nodes, ["y"], {"three": 3.0, "zero": 0.0, "six": 6.0}) == [
        "add", "clip", "mul", "div"]


def test_gate_and_residual_end_the_chain():
    # SE gate: sigmoid(conv) * features; the Mul reads another computed tensor.
    gate = [conv(), helper.make_node("Sigmoid", ["c"], ["s"], name="sigmoid"),
            helper.make_node("Mul", ["s", "x"], ["y"], name="gate")]
    assert _chain(gate, ["y"]) == ["sigmoid"]
    residual = [conv(), helper.make_node("Add", ["c", "x"], ["y"], name="residual")]
    assert _chain(residual, ["y"]) == []


def test_no_fusion_where_a_tensor_inside_is_read_elsewhere():
    # The conv's own output is also a graph output: the engine writes it, so no single layer.
    nodes = [conv(), helper.make_node("Relu", ["c"], ["r"], name="relu")]
    assert _chain(nodes, ["r", "c"]) == []
    # The Relu output feeds the next layer and a LeakyRelu: the Relu still ends the layer,
    # the LeakyRelu reads it from memory.
    branch = [conv(), helper.make_node("Relu", ["c"], ["r"], name="relu"),
              helper.make_node("Conv", ["r", "w"], ["y"], name="next"),
              helper.make_node("LeakyRelu", ["r"], ["z"], name="leaky")]
    assert _chain(branch, ["y", "z"]) == ["relu"]


def test_decomposed_layernorm_and_gelu_are_found_whole():
    from helpers import decomposed_block

    g = graph.Graph(decomposed_block())
    found = decomposed_ops(g)
    ops = {op.output: op for op in found.values()}
    assert sorted((op.label, op.nodes[0].split("/")[1]) for op in ops.values()) == [
        ("GELU", "mlp"), ("LayerNorm", "norm1"), ("LayerNorm", "norm2")]
    for op in ops.values():
        types = [n.op_type for n in g.model.graph.node if n.name in op.nodes]
        expected = (["Div", "Erf", "Add", "Mul", "Mul"] if op.label == "GELU" else
                    ["ReduceMean", "Sub", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul",
                     "Add"])
        assert types == expected
        # every tensor inside maps to the op; what it writes is read by a MatMul or an Add
        assert all(found[n.output[0]] is op for n in g.model.graph.node if n.name in op.nodes)
        assert {r.op_type for r in g.consumers[op.output]} <= {"MatMul", "Add"}


def test_a_written_out_softmax_is_one_op_and_a_pooling_mean_is_none():
    softmax = [helper.make_node("ReduceMax", ["x"], ["m"], axes=[-1]),
               helper.make_node("Sub", ["x", "m"], ["d"]), helper.make_node("Exp", ["d"], ["e"]),
               helper.make_node("ReduceSum", ["e", "axes"], ["s"]),
               helper.make_node("Div", ["e", "s"], ["p"]),
               helper.make_node("ReduceMean", ["x"], ["pooled"], axes=[-1])]
    model = graph.normalize(onnx_model(softmax, [("x", ["N", 6])], ["p", "pooled"],
                                       {"axes": np.array([-1])}))
    found = decomposed_ops(graph.Graph(model))
    assert {t: op.label for t, op in found.items()} == dict.fromkeys("mdesp", "Softmax")
    assert found["p"].output == "p"
