"""Loading, normalizing and exporting ONNX graphs, and the errors for bad model files."""

import numpy as np
import onnx
import pytest
import torch
from helpers import depthwise_conv, onnx_model
from onnx import TensorProto, helper, numpy_helper

from quantlab import graph
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ModelError


def test_missing_model_file_names_it(tmp_path):
    with pytest.raises(ModelError, match="nope.onnx does not exist"):
        graph.load_model(tmp_path / "nope.onnx")


def test_non_onnx_file_is_rejected(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file, not a protobuf\n" * 20)
    with pytest.raises(ModelError, match="notes.onnx"):
        graph.load_model(path)


def test_truncated_model_is_rejected(tiny_model, tmp_path):
    _, path, _ = tiny_model
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelError, match="broken.onnx"):
        graph.load_model(broken)


def test_export_matches_torch_and_is_normalized(tiny_model):
    model, path, module = tiny_model
    assert graph.opset_version(model) >= graph.MIN_OPSET
    names = [node.name for node in model.graph.node]
    assert len(set(names)) == len(names) and all(names)
    x = np.random.default_rng(3).standard_normal((4, 3, 16, 16)).astype(np.float32)
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (onnx_out,) = session.run(None, {"input": x})
    with torch.no_grad():
        torch_out = module(torch.from_numpy(x)).numpy()
    # float32 kernels differ in summation order only: a few ulps of the logits' magnitude.
    np.testing.assert_allclose(onnx_out, torch_out, rtol=1e-4, atol=1e-5)
    assert graph.input_specs(model)[0].shape[1:] == (3, 16, 16)
    assert graph.input_specs(model)[0].shape[0] is None  # dynamic batch


def test_normalize_upgrades_old_opset_and_names_nodes():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["z"])]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])],
    )
    old = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    model = graph.normalize(old)
    assert graph.opset_version(model) == graph.MIN_OPSET
    assert [n.name for n in model.graph.node] == ["Relu_0", "Relu_1"]
    assert {v.name for v in model.graph.value_info} == {"y"}  # inferred intermediate shape


def test_normalize_takes_initializers_listed_as_inputs_for_weights():
    # An IR 3 export lists every initializer as a graph input; here the Conv weight is a
    # Constant node as well. Normalized, the initializers are weights apart from the inputs
    # (ONNX Runtime treats listed ones as inputs a caller may override: reliability case G08),
    # and the opset converter no longer stops at "Input w is undefined".
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((4, 1, 3, 3)), rng.standard_normal(4)
    model = onnx_model(
        [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(
            w.astype(np.float32), "w")),
         helper.make_node("Conv", ["x", "w", "b"], ["y"], group=4, pads=[1] * 4)],
        [("x", [1, 4, 5, 5])], ["y"], {"b": b})
    model.graph.input.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [4]))
    model.ir_version = 3
    model.opset_import[0].version = 11
    normalized = graph.normalize(model)
    assert [v.name for v in normalized.graph.input] == ["x"]
    assert normalized.ir_version >= 4 and graph.opset_version(normalized) == graph.MIN_OPSET
    assert {init.name for init in normalized.graph.initializer} == {"w", "b"}
    x = rng.standard_normal((1, 4, 5, 5)).astype(np.float32)
    y = OnnxRuntimeBackend(normalized).run({"x": x})["y"]
    np.testing.assert_allclose(y, depthwise_conv(x, w, b, 1), rtol=1e-5, atol=1e-5)


def test_topological_tensors_and_module_paths(tiny_model):
    model, _, _ = tiny_model
    order = graph.topological_tensors(model)
    assert order[0] == "input" and order[-1] == "logits"
    producers = graph.producers(model)
    position = {name: i for i, name in enumerate(order)}
    for name in order[1:]:
        for source in producers[name].input:
            if source in position:
                assert position[source] < position[name]
    modules = {graph.node_module_path(n) for n in model.graph.node if n.op_type in ("Conv", "Gemm")}
    assert {"bn1", "conv2", "fc"} <= modules  # BN folded into conv1 carries the BN's scope


def test_save_model_is_loadable(tiny_model, tmp_path):
    model, _, _ = tiny_model
    path = graph.save_model(model, tmp_path / "copy.onnx")
    assert onnx.load(str(path)).graph.node[0].name == model.graph.node[0].name


def test_normalize_drops_the_initializers_nothing_reads_and_keeps_the_others():
    branch = helper.make_graph([helper.make_node("Add", ["x", "inner"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Add", ["x", "read"], ["y"], name="add"),
             helper.make_node("If", ["cond"], ["z"], name="if", then_branch=branch,
                              else_branch=branch)]
    model = onnx_model(nodes, [("x", [2])], ["y", "z", "out"],
                       {name: np.ones(2) for name in ("read", "inner", "out", "unread")})
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    kept = {init.name for init in graph.normalize(model).graph.initializer}
    # Read by a node, inside a branch, by an If, a graph output: all stay.
    assert kept == {"read", "inner", "cond", "out"}
