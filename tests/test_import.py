"""Import normalization and input feeding, on constructed models that look like real exports.

Each model here reproduces one trait of a real export (Paddle's Constant-node
weights, torch's fixed batch 1, opset 11, silero-vad's state with its samples on
axis 1, an int64 scalar deciding an `If`, token ids, external data, custom ops)
and is checked against ONNX Runtime running the original, untouched file.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantlab import graph
from quantlab.calibration import pipeline, qdq
from quantlab.cli import main
from quantlab.data import open_data
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError, DataError, ModelError

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
B = RNG.standard_normal(4).astype(np.float32)


def conv_model(batch=None, opset=17, constant_weights=False) -> onnx.ModelProto:
    """Conv(3->4) + Relu + GlobalAveragePool on [batch, 3, 8, 8]."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["y"], name="pool"),
    ]
    weights = [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b")]
    if constant_weights:
        nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in weights] + nodes
        weights = []
    model = helper.make_model(
        helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", 1, [batch, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", 1, [batch, 4, 1, 1])], weights),
        opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 6 if opset < 13 else 8
    onnx.checker.check_model(model)
    return model


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)


def samples(count: int) -> np.ndarray:
    return RNG.standard_normal((count, 3, 8, 8)).astype(np.float32)


def test_constant_node_weights_become_initializers_and_calibrate_like_initializers(tmp_path):
    x = samples(6)
    plain = pipeline.run_calibration(conv_model(), x, tmp_path / "plain", progress=False)
    paddle = pipeline.run_calibration(conv_model(constant_weights=True), x, tmp_path / "const",
                                      progress=False)
    assert {i.name for i in paddle.model.graph.initializer} >= {"w", "b"}
    assert not [n for n in paddle.model.graph.node if n.op_type == "Constant"]
    assert paddle.scales.amax == plain.scales.amax
    # The weight is quantized per channel behind a DequantizeLinear, as for initializers.
    dq = [n for n in paddle.qdq_model.graph.node if n.op_type == "DequantizeLinear"]
    assert any(n.output[0].startswith("w_") for n in dq)
    np.testing.assert_array_equal(run_ort(paddle.qdq_model, {"x": x})[0],
                                  run_ort(plain.qdq_model, {"x": x})[0])


def test_opset_11_is_upgraded_without_changing_outputs():
    old = conv_model(opset=11)
    new = graph.normalize(old)
    assert graph.opset_version(new) == graph.MIN_OPSET and new.ir_version >= 8
    x = samples(2)
    np.testing.assert_array_equal(run_ort(old, {"x": x})[0], run_ort(new, {"x": x})[0])


def test_declared_output_shape_that_does_not_run_is_replaced_by_the_inferred_one():
    model = conv_model()
    dims = model.graph.output[0].type.tensor_type.shape.dim
    dims[1].dim_value, dims[2].dim_value = 7, 5  # the exporter's claim; the Conv makes 4 x 1
    assert graph.output_specs(graph.normalize(model))[0].shape == (None, 4, 1, 1)


def test_fixed_batch_one_runs_one_sample_at_a_time_and_dynamic_batch_uses_the_batch_size(
        tmp_path):
    x = samples(5)
    fixed = graph.normalize(conv_model(batch=1))
    assert graph.input_specs(fixed)[0].batch_size == 1
    source = open_data(x, graph.input_specs(fixed), batch_size=32)
    assert [len(b["x"]) for b in source] == [1] * 5
    dynamic = open_data(x, graph.input_specs(graph.normalize(conv_model())), batch_size=2)
    assert [len(b["x"]) for b in dynamic] == [2, 2, 1]
    one = pipeline.run_calibration(conv_model(batch=1), x, tmp_path / "fixed", progress=False)
    many = pipeline.run_calibration(conv_model(), x, tmp_path / "dynamic", progress=False)
    assert one.scales.amax == many.scales.amax


def test_paddle_minus_one_dims_are_dynamic_and_batches_run(tmp_path):
    """Paddle declares unknown sizes as -1 (PP-OCRv3's detector: ``x`` [-1, 3, ?, ?]):
    normalized, they are symbolic, so the batch is dynamic (not a fixed batch of -1) and
    calibration runs in batches whose INT8 model ONNX Runtime runs like the plain one."""
    model = conv_model(constant_weights=True)
    for value in (model.graph.input[0], model.graph.output[0]):
        dims = value.type.tensor_type.shape.dim
        for axis in (0, 2, 3) if value is model.graph.input[0] else (0,):
            dims[axis].dim_value = -1
    normalized = graph.normalize(model)
    assert graph.input_specs(normalized)[0].shape == (None, 3, None, None)
    assert graph.output_specs(normalized)[0].shape[0] is None
    assert graph.fixed_batch_size(normalized) is None
    x = samples(5)
    source = open_data(x, graph.input_specs(normalized), batch_size=2)
    assert [len(b["x"]) for b in source] == [2, 2, 1]
    paddle = pipeline.run_calibration(model, x, tmp_path / "paddle", progress=False)
    plain = pipeline.run_calibration(conv_model(), x, tmp_path / "plain", progress=False)
    assert paddle.scales.amax == plain.scales.amax
    np.testing.assert_array_equal(run_ort(paddle.qdq_model, {"x": x})[0],
                                  run_ort(plain.qdq_model, {"x": x})[0])


def test_fixed_batch_model_fed_a_larger_batch_gets_a_clear_error():
    backend = OnnxRuntimeBackend(graph.normalize(conv_model(batch=1)))
    with pytest.raises(DataError, match="exactly 1 per run"):
        backend.run({"x": samples(3)})


def test_external_data_model_loads_with_its_folder_and_large_outputs_use_external_data(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    onnx.save(conv_model(), source / "m.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.onnx.data", size_threshold=0)
    model = graph.load_model(source / "m.onnx")
    np.testing.assert_array_equal(numpy_helper.to_array(
        next(i for i in model.graph.initializer if i.name == "w")), W)
    out = tmp_path / "out" / "big.onnx"
    out.parent.mkdir()
    graph.save_model(model, out, external_data_bytes=100)  # as if it were past 2 GB
    assert (out.parent / "big.onnx.data").is_file()
    assert onnx.load(out, load_external_data=False).ByteSize() < 1000
    reloaded = graph.load_model(out)
    x = samples(2)
    np.testing.assert_array_equal(run_ort(reloaded, {"x": x})[0], run_ort(model, {"x": x})[0])


def custom_op_model() -> onnx.ModelProto:
    model = conv_model()
    node = helper.make_node("FancyRelu", ["r"], ["f"], domain="com.example", name="fancy")
    model.graph.node.insert(2, node)
    model.graph.node[3].input[0] = "f"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


def test_custom_domain_op_is_left_in_float_with_a_warning_and_ort_names_it(tmp_path):
    with pytest.warns(UserWarning, match=r"custom op domain.*fancy \(com\.example:FancyRelu\)"):
        model = pipeline.prepare_model(custom_op_model())
    # The Conv before it is still quantized: the op only stays float itself.
    assert qdq.activation_tensors_to_calibrate(model) == ["x"]
    with pytest.raises(ModelError, match=r"com\.example:FancyRelu.*node 'fancy'.*custom-op"):
        OnnxRuntimeBackend(model).run({"x": samples(1)})


def vad_like_model() -> onnx.ModelProto:
    """Silero-vad's interface: input [N, T], state [2, N, 4] (samples on axis 1), int64 `sr`.

    The network (a MatMul on the input, plus the state summed over its layers) sits
    in the then-branch of an `If` on sr == 16000; the else-branch returns zeros.
    """
    weight = numpy_helper.from_array(
        np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32), "wm")
    then = helper.make_graph(
        [helper.make_node("MatMul", ["input", "wm"], ["m"]),
         helper.make_node("ReduceSum", ["state", "axes0"], ["s"], keepdims=0),
         helper.make_node("Add", ["m", "s"], ["then_out"])],
        "then", [], [helper.make_tensor_value_info("then_out", 1, None)])
    other = helper.make_graph(
        [helper.make_node("Mul", ["m0", "zero"], ["else_out"])], "else", [],
        [helper.make_tensor_value_info("else_out", 1, None)])
    nodes = [
        helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
        helper.make_node("MatMul", ["input", "wm"], ["m0"]),
        helper.make_node("If", ["is16k"], ["out"], then_branch=then, else_branch=other),
    ]
    inits = [weight, numpy_helper.from_array(np.array(16000, np.int64), "sr16k"),
             numpy_helper.from_array(np.array([0], np.int64), "axes0"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    model = helper.make_model(helper.make_graph(
        nodes, "vad",
        [helper.make_tensor_value_info("input", 1, [None, 6]),
         helper.make_tensor_value_info("state", 1, [2, None, 4]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("out", 1, [None, 4])], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def test_state_input_has_its_samples_on_axis_1():
    specs = {s.name: s for s in graph.input_specs(graph.normalize(vad_like_model()))}
    assert (specs["input"].batch_axis, specs["state"].batch_axis, specs["sr"].batch_axis) == \
        (0, 1, None)


def vad_data(count: int) -> dict[str, np.ndarray]:
    return {"input": RNG.standard_normal((count, 6)).astype(np.float32),
            "state": RNG.standard_normal((2, count, 4)).astype(np.float32),
            "sr": np.array(16000, np.int64)}


def test_constant_sr_inlines_the_if_and_its_matmul_is_quantized(tmp_path):
    data = vad_data(5)
    with pytest.warns(UserWarning, match=r"control-flow.*1 linear ops.*--input NAME=VALUE"):
        unfrozen = pipeline.prepare_model(vad_like_model())
    assert qdq.activation_tensors_to_calibrate(unfrozen) == ["input"]  # the outer MatMul only
    result = pipeline.run_calibration(vad_like_model(), data, tmp_path / "run", progress=False)
    frozen = result.model
    assert not graph.control_flow_nodes(frozen)
    assert graph.frozen_inputs(frozen) == {"sr": 16000}
    expected = run_ort(vad_like_model(), data)[0]
    got = run_ort(frozen, {k: v for k, v in data.items() if k != "sr"})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    record = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert record["frozen_inputs"] == {"sr": 16000}
    assert record["sample_axes"] == {"input": 0, "state": 1}


def test_state_batches_are_sliced_on_axis_1(tmp_path):
    data = vad_data(5)
    model = graph.freeze_inputs(graph.normalize(vad_like_model()), {"sr": 16000})
    source = open_data({k: v for k, v in data.items() if k != "sr"}, graph.input_specs(model),
                       batch_size=2)
    batches = list(source)
    assert [b["state"].shape for b in batches] == [(2, 2, 4), (2, 2, 4), (2, 1, 4)]
    np.testing.assert_array_equal(np.concatenate([b["state"] for b in batches], axis=1),
                                  data["state"])


def test_cli_feeds_state_and_constant_from_options(tmp_path):
    model_path = tmp_path / "vad.onnx"
    onnx.save(vad_like_model(), model_path)
    data = vad_data(4)
    # The state laid out [N, 2, 4] (samples first) with --batch-axis saying so... is not the
    # model's layout: it is refused with the expected shape named, not run.
    np.savez(tmp_path / "wrong.npz", input=data["input"], state=data["state"].transpose(1, 0, 2))
    assert main(["calibrate", str(model_path), "--data", str(tmp_path / "wrong.npz"),
                 "--input", "sr=16000", "--out", str(tmp_path / "bad"), "--no-progress"]) == 1
    assert not (tmp_path / "bad").exists()
    np.savez(tmp_path / "d.npz", input=data["input"], state=data["state"])
    assert main(["calibrate", str(model_path), "--data", str(tmp_path / "d.npz"),
                 "--input", "sr=16000", "--out", str(tmp_path / "ok"), "--no-progress"]) == 0
    written = graph.load_model(tmp_path / "ok" / "model.int8.onnx")
    assert {s.name: s.batch_axis for s in graph.input_specs(written)} == {"input": 0, "state": 1}


def test_freezing_checks_name_shape_and_integer_value():
    model = graph.normalize(vad_like_model())
    with pytest.raises(ConfigError, match="no input 'rate'.*'sr'"):
        graph.freeze_inputs(model, {"rate": 16000})
    with pytest.raises(ConfigError, match="shape \\(2,\\).*shape \\(\\)"):
        graph.freeze_inputs(model, {"sr": [16000, 8000]})
    with pytest.raises(ConfigError, match="int64.*not an integer"):
        graph.freeze_inputs(model, {"sr": 16000.5})
    frozen = graph.freeze_inputs(model, {"sr": 16000})
    assert graph.freeze_inputs(frozen, {"sr": 16000}) is frozen  # idempotent
    with pytest.raises(ConfigError, match="frozen to 16000"):
        graph.freeze_inputs(frozen, {"sr": 8000})


def token_model() -> onnx.ModelProto:
    """Embedding lookup on int64 token ids, masked by a bool mask, then a MatMul."""
    rng = np.random.default_rng(2)
    table = numpy_helper.from_array(rng.standard_normal((50, 8)).astype(np.float32), "table")
    weight = numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "proj")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"]),
        helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "axis2"], ["mask3"]),
        helper.make_node("Mul", ["emb", "mask3"], ["masked"]),
        helper.make_node("MatMul", ["masked", "proj"], ["logits"]),
    ]
    model = helper.make_model(helper.make_graph(
        nodes, "tokens",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, 5]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, [None, 5])],
        [helper.make_tensor_value_info("logits", 1, [None, 5, 3])],
        [table, weight, numpy_helper.from_array(np.array([2], np.int64), "axis2")]),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def test_int64_and_bool_inputs_pass_unchanged(tmp_path):
    # Ids above 2**24 would lose their value through float32; 49 is enough to check the type.
    ids = RNG.integers(0, 50, (6, 5)).astype(np.int64)
    mask = RNG.integers(0, 2, (6, 5)).astype(bool)
    np.savez(tmp_path / "t.npz", ids=ids, mask=mask)
    model = graph.normalize(token_model())
    (batch,) = list(open_data(tmp_path / "t.npz", graph.input_specs(model), batch_size=8))
    assert batch["ids"].dtype == np.int64 and batch["mask"].dtype == bool
    np.testing.assert_array_equal(batch["ids"], ids)
    result = pipeline.run_calibration(token_model(), tmp_path / "t.npz", tmp_path / "run",
                                      progress=False)
    assert qdq.activation_tensors_to_calibrate(result.model) == ["masked"]
    expected = run_ort(token_model(), {"ids": ids, "mask": mask})[0]
    # quantlab's session keeps int8 Q/DQ as int8 (as TensorRT runs it): a default session on
    # an AVX2 CPU without VNNI rewrites it to u8s8 kernels that saturate (~12 dB here).
    got = OnnxRuntimeBackend(result.qdq_model).run({"ids": ids, "mask": mask})["logits"]
    # int8 on one MatMul input with per-channel weights: well above 25 dB on Gaussian data
    # (about 40 dB measured).
    noise = np.sum((got.astype(np.float64) - expected) ** 2)
    assert 10 * np.log10(np.sum(expected.astype(np.float64) ** 2) / noise) > 25


def test_float_data_for_int_input_and_int_data_for_float_input_are_refused(tmp_path):
    specs = graph.input_specs(graph.normalize(token_model()))
    np.savez(tmp_path / "f.npz", ids=np.zeros((2, 5), np.float32), mask=np.zeros((2, 5), bool))
    with pytest.raises(DataError, match="input 'ids' is int64 but the data is float32"):
        open_data(tmp_path / "f.npz", specs)
    np.save(tmp_path / "raw.npy", np.zeros((2, 3, 8, 8), np.int64))
    with pytest.raises(DataError, match=r"raw\.npy.*'x' is float32 but the data is int64.*"
                                        "normalize"):
        open_data(tmp_path / "raw.npy", graph.input_specs(graph.normalize(conv_model())))


def test_batch_axis_option_sets_a_layout_detection_cannot_see(tmp_path):
    # A time-major sequence memory [T, N, 4] has two dynamic axes, so nothing tells which
    # holds the samples: axis 0 is assumed, and the counts disagree (3 steps vs 6 samples).
    # --batch-axis memory=1 says so and is recorded in the written model.
    nodes = [helper.make_node("ReduceSum", ["memory", "axis0"], ["summed"], keepdims=0),
             helper.make_node("Add", ["hidden", "summed"], ["added"]),
             helper.make_node("MatMul", ["added", "w"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("hidden", 1, ["N", 4]),
                     helper.make_tensor_value_info("memory", 1, ["T", "N", 4])],
        [helper.make_tensor_value_info("y", 1, ["N", 4])],
        [numpy_helper.from_array(np.array([0], np.int64), "axis0"),
         numpy_helper.from_array(RNG.standard_normal((4, 4)).astype(np.float32), "w")]),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", hidden=RNG.standard_normal((6, 4)).astype(np.float32),
             memory=RNG.standard_normal((3, 6, 4)).astype(np.float32))
    args = ["calibrate", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"),
            "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "no")]) == 1
    assert main([*args, "--batch-axis", "memory=1", "--out", str(tmp_path / "ok")]) == 0
    written = graph.load_model(tmp_path / "ok" / "model.onnx")
    assert {s.name: s.batch_axis for s in graph.input_specs(written)} == {"hidden": 0, "memory": 1}
    with pytest.raises(ConfigError, match="input 'mem'.*'hidden', 'memory'"):
        graph.set_batch_axes(graph.normalize(model), {"mem": 1})
    with pytest.raises(ConfigError, match="rank 3.*0..2"):
        graph.set_batch_axes(graph.normalize(model), {"memory": 3})
