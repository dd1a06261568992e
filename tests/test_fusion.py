"""Tests for quantlab.fusion: the activation TensorRT fuses into a linear op's layer."""

from __future__ import annotations

import numpy as np
from onnx import helper

from quantlab import graph
from quantlab.fusion import fused_activation
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
