"""Tests for quantlab.evaluation.sensitivity: the local-error graph, INT8 and FP16 side by side in
one pass."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from onnx import TensorProto, helper, numpy_helper

from quantlab import graph
from quantlab.calibration import qdq
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.evaluation.sensitivity import local_error_model


def conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, pad: int = 0) -> np.ndarray:
    """Reference NCHW convolution (stride 1, group 1) in float64."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    windows = sliding_window_view(x, w.shape[2:], axis=(2, 3))  # n c h w kh kw
    y = np.einsum("nchwij,ocij->nohw", windows, w.astype(np.float64))
    return y if b is None else y + b.astype(np.float64)[None, :, None, None]


def int8(values: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """Symmetric INT8 fake quantization in float64: round half to even, saturate at -128..127."""
    scale = (np.asarray(amax, np.float32) / np.float32(127.0)).astype(np.float64)
    return np.clip(np.round(values.astype(np.float64) / scale), -128, 127) * scale


def fp16(values: np.ndarray) -> np.ndarray:
    return np.asarray(values).astype(np.float16).astype(np.float64)


def sqnr_db(test: np.ndarray, reference: np.ndarray) -> float:
    return float(10 * np.log10((reference ** 2).sum() / ((test - reference) ** 2).sum()))


@pytest.fixture(scope="module")
def two_convs():
    """x -> conv1 (3x3, bias) -> c -> conv2 (1x1) -> y: conv2 reads conv1's output directly."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 4, 3, 3)).astype(np.float32) / 6
    b1 = rng.standard_normal(8).astype(np.float32)
    w2 = rng.standard_normal((5, 8, 1, 1)).astype(np.float32) / 3
    model = graph.normalize(helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["c", "w2"], ["y"], name="conv2")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in {"w1": w1, "b1": b1, "w2": w2}.items()]),
        opset_imports=[helper.make_opsetid("", 17)]))
    x = (rng.standard_normal((3, 4, 6, 6)) * 3).astype(np.float32)
    c = OnnxRuntimeBackend(model).run({"x": x}, ["c"])["c"]
    amax = {"x": float(np.abs(x).max()), "c": float(np.abs(c).max()) * 0.7}  # c saturates
    return model, x, c, amax, {"w1": w1, "b1": b1, "w2": w2}


def test_int8_and_fp16_local_errors_in_one_pass_match_numpy(two_convs):
    model, x, c, amax, w = two_convs
    nodes = [n.name for n in model.graph.node]
    as_int8 = qdq.quantize_model(model, amax)
    as_fp16 = qdq.quantize_model(model, amax, dict.fromkeys(nodes, "fp16"))
    local = local_error_model([graph.Graph(as_int8), graph.Graph(as_fp16)], graph.Graph(model))
    assert sorted(local.precisions.values()) == ["fp16", "fp16", "int8", "int8"]
    fp32 = {"x": x, "c": c}
    values = OnnxRuntimeBackend(local.model, check_inputs=False).run(
        {name: fp32[name] for name in local.feeds})
    got = {(local.outputs[k], local.precisions[k]): v for k, v in values.items()}

    def channel_amax(weight):
        return np.abs(weight).reshape(len(weight), -1).max(axis=1)[:, None, None, None]

    want = {
        ("c", "int8"): conv2d(int8(x, amax["x"]), int8(w["w1"], channel_amax(w["w1"])),
                              w["b1"], pad=1),
        ("y", "int8"): conv2d(int8(c, amax["c"]), int8(w["w2"], channel_amax(w["w2"]))),
        # FP16: inputs, weights and bias rounded to float16, exact products, output rounded.
        ("c", "fp16"): fp16(conv2d(fp16(x), fp16(w["w1"]), fp16(w["b1"]), pad=1)),
        # conv2 reads conv1's float16 output: the FP32 run's c rounded to float16.
        ("y", "fp16"): fp16(conv2d(fp16(c), fp16(w["w2"]))),
    }
    reference = {"c": conv2d(x, w["w1"], w["b1"], pad=1), "y": conv2d(c, w["w2"])}
    for key, expected in want.items():
        scale = np.abs(expected).max()
        # float32 accumulation against float64: a float16 rounding may flip by one ulp.
        tolerance = 2.0 ** -10 * np.abs(expected) + 1e-6 * scale if key[1] == "fp16" \
            else 1e-5 * scale
        assert np.all(np.abs(got[key] - expected) <= tolerance), key
        assert sqnr_db(got[key], reference[key[0]]) == pytest.approx(
            sqnr_db(expected, reference[key[0]]), abs=0.05), key
    # c's saturating scale makes conv2's INT8 error far larger than its FP16 error.
    assert sqnr_db(got[("y", "int8")], reference["y"]) + 30 < sqnr_db(got[("y", "fp16")],
                                                                      reference["y"])
    assert local.quantized_inputs == {"c": ["x"], "y": ["c"]}


def test_single_qdq_graph_with_fp16_units_cuts_both(two_convs):
    model, x, c, amax, _ = two_convs
    mixed = qdq.quantize_model(model, amax, {"conv1": "fp16", "conv2": "int8"})
    local = local_error_model(graph.Graph(mixed), graph.Graph(model))
    assert {local.outputs[k]: p for k, p in local.precisions.items()} == {"c": "fp16",
                                                                          "y": "int8"}



@pytest.fixture(scope="module")
def hardswish_conv():
    """x -> conv (3x3, bias) -> c -> decomposed HardSwish (c * clip(c + 3, 0, 6) / 6, a
    per-channel Div as depthwise equalization leaves it) -> h -> conv2 -> y."""
    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((6, 4, 3, 3)).astype(np.float32) / 4
    b1 = rng.standard_normal(6).astype(np.float32)
    w2 = rng.standard_normal((3, 6, 1, 1)).astype(np.float32) / 3
    div = rng.uniform(3, 9, (6, 1, 1)).astype(np.float32)
    values = {"w1": w1, "b1": b1, "w2": w2, "three": np.float32(3), "zero": np.float32(0),
              "six": np.float32(6), "div": div}
    model = graph.normalize(helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
         helper.make_node("Add", ["c", "three"], ["a"], name="add"),
         helper.make_node("Clip", ["a", "zero", "six"], ["k"], name="clip"),
         helper.make_node("Mul", ["c", "k"], ["m"], name="mul"),
         helper.make_node("Div", ["m", "div"], ["h"], name="div"),
         helper.make_node("Conv", ["h", "w2"], ["y"], name="conv2")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in values.items()]),
        opset_imports=[helper.make_opsetid("", 17)]))
    x = (rng.standard_normal((3, 4, 6, 6)) * 2).astype(np.float32)
    h = OnnxRuntimeBackend(model).run({"x": x}, ["h"])["h"]
    amax = {"x": float(np.abs(x).max()), "h": float(np.abs(h).max())}
    return model, x, h, amax, values


def hardswish(c: np.ndarray, div: np.ndarray) -> np.ndarray:
    return c * np.clip(c + 3, 0, 6) / div.astype(np.float64)


def channel_amax(weight: np.ndarray) -> np.ndarray:
    return np.abs(weight).reshape(len(weight), -1).max(axis=1)[:, None, None, None]


def test_linear_op_is_compared_after_its_fused_activation(hardswish_conv):
    model, x, h, amax, v = hardswish_conv
    local = local_error_model(graph.Graph(qdq.quantize_model(model, amax)), graph.Graph(model))
    # conv1 is compared at the HardSwish output; the activation's nodes are not cut out.
    assert sorted(local.outputs.values()) == ["h", "y"]
    assert {local.nodes[k] for k, t in local.outputs.items() if t == "h"} == {"conv1"}
    values = OnnxRuntimeBackend(local.model, check_inputs=False).run(
        {name: {"x": x, "h": h}[name] for name in local.feeds})
    got = {local.outputs[k]: value for k, value in values.items()}
    want = hardswish(conv2d(int8(x, amax["x"]), int8(v["w1"], channel_amax(v["w1"])), v["b1"],
                            pad=1), v["div"])
    assert np.abs(got["h"] - want).max() <= 1e-5 * np.abs(want).max()
    # Without the fusion (bias correction's measurement) conv1 is compared at c.
    plain = local_error_model(graph.Graph(qdq.quantize_model(model, amax)), graph.Graph(model),
                              fuse_activations=False)
    assert sorted(plain.outputs.values()) == ["c", "y"]


def test_weights_only_cuts_each_linear_op_on_fp32_inputs(hardswish_conv):
    model, x, h, amax, v = hardswish_conv
    as_int8 = graph.Graph(qdq.quantize_model(model, amax))
    local = local_error_model([as_int8, as_int8], graph.Graph(model), labels=["a", "b"],
                              weights_only=True)
    assert sorted(local.labels.values()) == ["a", "a", "b", "b"]
    assert "h" in local.feeds and not any(n.op_type == "QuantizeLinear"
                                          for n in local.model.graph.node)
    values = OnnxRuntimeBackend(local.model, check_inputs=False).run(
        {name: {"x": x, "h": h}[name] for name in local.feeds})
    for name, value in values.items():
        if local.outputs[name] == "h":  # INT8 weights, FP32 input, then the activation
            want = hardswish(conv2d(x, int8(v["w1"], channel_amax(v["w1"])), v["b1"], pad=1),
                             v["div"])
        else:
            want = conv2d(h, int8(v["w2"], channel_amax(v["w2"])))
        assert np.abs(value - want).max() <= 1e-5 * np.abs(want).max(), name
