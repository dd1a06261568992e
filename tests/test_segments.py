"""segments.py: a graph cut into segments computes what the whole graph computes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quantlab import graph, segments
from quantlab.backends.onnxruntime import OnnxRuntimeBackend


def _model() -> onnx.ModelProto:
    """x -> Relu a -> Neg b -> Add(a, b) c; Cos(x) e, read only inside the If's branches."""
    then_branch = helper.make_graph(
        [helper.make_node("Mul", ["e", "c"], ["then_out"])], "then", [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, None)])
    else_branch = helper.make_graph(
        [helper.make_node("Sub", ["c", "e"], ["else_out"])], "else", [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Cos", ["x"], ["e"]),
             helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["c"]),
             helper.make_node("Sin", ["c"], ["d"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_branch,
                              else_branch=else_branch)]
    body = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("d", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.array(True), "cond")])
    return graph.normalize(helper.make_model(body, opset_imports=[helper.make_opsetid("", 17)]))


def test_segments_in_order_compute_the_whole_graph():
    model = _model()
    index = graph.Graph(model)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    whole = OnnxRuntimeBackend(model).run({"x": x}, ["b", "c", "d", "y"])
    # `e` is read only by the If's branches, from outside the If's inputs: its producer
    # must still run, in the If's segment, and `a` is handed on from segment 0.
    plan = segments.plan_segments(index, [["b"], ["c", "d"], ["y"]])
    assert [s.group for s in plan] == [["b"], ["c", "d"], ["y"]]
    assert any("e" in n.output for n in plan[2].model.graph.node)
    assert "a" in plan[0].outputs and plan[0].last_use["a"] == 1
    live = {"x": x}
    for segment in plan:
        backend = OnnxRuntimeBackend(segment.model, check_inputs=False)
        live.update(backend.run({name: live[name] for name in segment.inputs}))
        for name in segment.group:
            np.testing.assert_array_equal(live[name], whole[name])


def test_group_by_bytes_keeps_order_and_budget():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1}
    assert segments.group_by_bytes(list(sizes), sizes, 8) == [["a", "b"], ["c"], ["d"]]
