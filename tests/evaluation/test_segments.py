"""segments.py: a graph cut into segments computes what the whole graph computes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quantlab import graph
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.evaluation import segments


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


def test_shape_scalars_never_cross_a_cut(tmp_path):
    """TinyViT's position interpolation: 0-d shape scalars (Shape -> Gather -> Div -> Cast)
    feed a Resize of a weight and Reshapes in several places. Cut into a segment per tensor,
    no segment reads a value without a sample axis other than a Shape output, handed over
    with its rank, and the segments compute what the whole graph computes."""
    from helpers import export_tiny_vit

    export_tiny_vit(tmp_path / "vit.onnx")
    model = graph.load_model(tmp_path / "vit.onnx")
    index = graph.Graph(model)
    free = segments.sample_free(index)
    scalars = {t for t in free if index.shapes.get(t) == () and t in index.position}
    assert {index.producers[t].op_type for t in scalars} >= {"Gather", "Div", "Cast"}
    wanted = [t for t in index.order if t in index.floats and t not in index.input_names]
    plan = segments.plan_segments(index, [[t] for t in wanted])
    crossing = {name for s in plan for name in s.inputs if name != "pixels"}
    assert crossing & free  # the Shape outputs of activations (e.g. of the patch embedding)
    assert {index.producers[t].op_type for t in crossing & free} == {"Shape"}
    # A scalar read in several segments is computed in each of them.
    computed_in = [sum(any(t in n.output for n in s.model.graph.node) for s in plan)
                   for t in scalars]
    assert max(computed_in) > 1
    x = np.random.default_rng(0).standard_normal((3, 3, 12, 16)).astype(np.float32)
    whole = OnnxRuntimeBackend(model).run({"pixels": x}, wanted)
    live = {"pixels": x}
    for segment in [s for s in plan if s.outputs]:
        backend = OnnxRuntimeBackend(segment.model, check_inputs=False)
        live.update(backend.run({name: live[name] for name in segment.inputs}))
    for name in wanted:
        np.testing.assert_allclose(live[name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_zero_d_value_is_fed_with_its_rank():
    """A 0-d tensor handed to a model keeps rank 0 (np.ascontiguousarray made it (1,))."""
    nodes = [helper.make_node("Unsqueeze", ["s", "axes"], ["v"]),
             helper.make_node("Concat", ["v", "one"], ["y"], axis=0)]
    body = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("s", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [2])],
        [numpy_helper.from_array(np.array([0], np.int64), "axes"),
         numpy_helper.from_array(np.array([1], np.int64), "one")])
    model = helper.make_model(body, opset_imports=[helper.make_opsetid("", 17)])
    backend = OnnxRuntimeBackend(model, check_inputs=False)
    np.testing.assert_array_equal(backend.run({"s": np.array(7, np.int64)})["y"], [7, 1])
