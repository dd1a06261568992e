"""Tests for quantlab.calibration.rounding: GPTQ's int8 weights against a slow Optimal Brain
Quantization reference, the input rows against the layers ONNX Runtime runs, and the
output error held out against nearest rounding, in float64."""

from __future__ import annotations

import json

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from onnx import helper

from quantlab import graph
from quantlab.calibration import calibrate, pipeline, qdq, rounding
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError
from tests.helpers import onnx_model, shared_weight_convs, zoo_held_out


def correlated_moments(columns: int, seed: int = 0) -> np.ndarray:
    """E[x x^T] of inputs that share a few directions (the case rounding exploits), float64."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4000, 3)) @ rng.standard_normal((3, columns)) \
        + 0.1 * rng.standard_normal((4000, columns))
    return x.T @ x / len(x)


def obq_reference(weight: np.ndarray, moments: np.ndarray, scale: np.ndarray,
                  free_last: bool) -> np.ndarray:
    """Optimal Brain Quantization as first written: per row, round column i, move every
    other weight by the OBS update -(w_i - q_i) H^-1[:, i] / H^-1[i, i], then remove i from
    H^-1 (its Schur complement); the same damping as rounding._gptq."""
    h = moments.astype(np.float64).copy()
    diagonal = np.arange(len(h))
    h[diagonal, diagonal] += rounding.DAMPING * h[diagonal, diagonal].mean() \
        + (h[diagonal, diagonal] == 0)
    result = []
    for row, s in zip(weight.astype(np.float64), scale, strict=True):
        w, inverse = row.copy(), np.linalg.inv(h)
        for i in range(len(w) - free_last):
            q = np.clip(np.round(w[i] / s), -127, 127) * s
            w -= (w[i] - q) / inverse[i, i] * inverse[:, i]
            w[i] = q
            inverse -= np.outer(inverse[:, i], inverse[i, :]) / inverse[i, i]
        result.append(w)
    return np.array(result)


@pytest.mark.parametrize("free_last", [False, True])
def test_gptq_equals_optimal_brain_quantization_column_by_column(free_last):
    rng = np.random.default_rng(1)
    moments = correlated_moments(12)
    weight = rng.standard_normal((5, 12))
    scale = np.abs(weight).max(axis=1) / 127 * 4  # coarse steps: every column's error counts
    got = rounding._gptq(weight, moments, scale, free_last)
    np.testing.assert_allclose(got, obq_reference(weight, moments, scale, free_last),
                               rtol=0, atol=1e-9)
    grid = got[:, :-1] if free_last else got
    steps = grid / scale[:, None]
    np.testing.assert_allclose(steps, np.rint(steps), rtol=0, atol=1e-9)  # on the grid
    assert np.abs(steps).max() <= 127
    # Each row's output error on the inputs it was fitted to is below nearest rounding's.
    nearest = np.clip(np.rint(weight / scale[:, None]), -127, 127) * scale[:, None]
    if free_last:
        nearest[:, -1] = weight[:, -1]
    error = [np.einsum("rk,kl,rl->r", weight - w, moments, weight - w) for w in (got, nearest)]
    assert np.all(error[0] < error[1])


def conv_layer(node: helper.NodeProto, weight: np.ndarray, bias: np.ndarray | None,
               shape: list) -> tuple[graph.Graph, rounding._Layer]:
    inputs = {"w": weight, **({"b": bias} if bias is not None else {})}
    model = graph.Graph(graph.normalize(onnx_model([node], [("x", shape)], ["y"], inputs)))
    layer = rounding._Layer(model.model.graph.node[0], weight.astype(np.float64), "w_q",
                            np.ones(1), None if bias is None else bias.astype(np.float64))
    return model, layer


CONVS = {
    "strided, padded, dilated": (dict(strides=[2, 1], pads=[1, 0, 2, 1], dilations=[1, 2]),
                                 (6, 4, 3, 3)),
    "depthwise": (dict(group=4, pads=[1, 1, 1, 1]), (4, 1, 3, 3)),
}


@pytest.mark.parametrize("case", list(CONVS))
def test_input_rows_times_the_weight_rows_are_the_conv_output(case, monkeypatch):
    """Every output position's row (its patch) times the weight's rows, plus the bias (their
    last column), is what ONNX Runtime's conv computes there."""
    monkeypatch.setattr(rounding, "POSITIONS", 10**6)  # every position, in order
    attrs, shape = CONVS[case]
    rng = np.random.default_rng(2)
    weight = rng.standard_normal(shape).astype(np.float32)
    bias = rng.standard_normal(shape[0]).astype(np.float32)
    model, layer = conv_layer(helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv",
                                               **attrs), weight, bias, ["N", 4, 9, 8])
    x = rng.standard_normal((2, 4, 9, 8)).astype(np.float32)
    want = OnnxRuntimeBackend(model.model).run({"x": x})["y"].astype(np.float64)
    rows = rounding._input_rows(layer, x, np.random.default_rng(0)).astype(np.float64)
    weights, biases = rounding._rows(layer)[:, :-1], rounding._rows(layer)[:, -1]
    if rounding._depthwise(layer):  # channel x position x taps
        got = np.einsum("cpk,ck->cp", rows, weights) + biases[:, None]
        got = got.reshape(4, 2, -1).transpose(1, 0, 2)
    else:  # position x patch
        got = (rows @ weights.T + biases).reshape(2, -1, shape[0]).transpose(0, 2, 1)
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5)


def test_matrix_and_transposed_conv_rows_times_the_weight_rows_are_their_output(monkeypatch):
    monkeypatch.setattr(rounding, "POSITIONS", 10**6)
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((5, 3, 2, 2)).astype(np.float32)  # [C_in, C_out, kh, kw]
    model, layer = conv_layer(helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up",
                                               strides=[2, 2]), weight, None, ["N", 5, 3, 4])
    x = rng.standard_normal((1, 5, 3, 4)).astype(np.float32)
    want = OnnxRuntimeBackend(model.model).run({"x": x})["y"][0].astype(np.float64)
    rows = rounding._input_rows(layer, x, np.random.default_rng(0)).astype(np.float64)
    taps = (rows @ rounding._rows(layer).T).reshape(3, 4, 3, 2, 2)  # i, j, c_out, ky, kx
    np.testing.assert_allclose(taps.transpose(2, 0, 3, 1, 4).reshape(3, 6, 8), want,
                               rtol=1e-5, atol=1e-5)
    matrix = rng.standard_normal((6, 3)).astype(np.float32)  # MatMul's B: [K, N]
    model = graph.Graph(graph.normalize(onnx_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [("x", ["N", 7, 6])],
        ["y"], {"w": matrix})))
    layer = rounding._Layer(model.model.graph.node[0], matrix.astype(np.float64), "w_q",
                            np.ones(1), None)
    x = rng.standard_normal((2, 7, 6)).astype(np.float32)
    rows = rounding._input_rows(layer, x, np.random.default_rng(0)).astype(np.float64)
    np.testing.assert_allclose(rows @ rounding._rows(layer).T, (x @ matrix).reshape(14, 3),
                               rtol=1e-5, atol=1e-5)


def correlated_conv(samples: int, seed: int):
    """A 3x3 conv (8 -> 6) with a bias whose inputs' channels share two sources, and
    `samples` samples of them."""
    mix = np.random.default_rng(0).standard_normal((2, 8))  # the same inputs' structure
    rng = np.random.default_rng(seed)
    sources = rng.standard_normal((samples, 2, 16, 16))
    x = (np.einsum("nshw,sc->nchw", sources, mix) + 0.05 * rng.standard_normal(
        (samples, 8, 16, 16)) + 0.3).astype(np.float32)
    return x


def test_rounding_lowers_the_layers_error_on_inputs_it_was_not_fitted_on():
    """Held out (fresh samples of the same inputs, float64): the rounded conv with its refitted
    bias against nearest rounding on the same scales."""
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((6, 8, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    model = graph.Graph(graph.normalize(onnx_model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1] * 4)],
        [("x", ["N", 8, 16, 16])], ["y"], {"w": weight, "b": bias})))
    nearest = qdq.quantize_model(model, {"x": 20.0})
    fitted = correlated_conv(8, seed=5)
    rounded, report = rounding.round_weights(model, nearest,
                                             ({"x": fitted[i:i + 1]} for i in range(8)))
    assert report.samples == 8 and report.tensors["w"]["rounded"]

    def conv(quantized) -> np.ndarray:
        values = graph.initializers(quantized)
        q, scale = values["w_quantized"], values["w_scale"]
        w = q.astype(np.float64) * scale.astype(np.float64)[:, None, None, None]
        conv_node = next(n for n in quantized.graph.node if n.op_type == "Conv")
        b = values[conv_node.input[2]].astype(np.float64)
        windows = sliding_window_view(np.pad(held.astype(np.float64),
                                             ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), (2, 3))
        return np.einsum("nchwij,ocij->nohw", windows, w) + b[None, :, None, None]

    held = correlated_conv(16, seed=6)
    windows = sliding_window_view(np.pad(held.astype(np.float64),
                                         ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), (2, 3))
    want = np.einsum("nchwij,ocij->nohw", windows, weight.astype(np.float64)) \
        + bias.astype(np.float64)[None, :, None, None]
    errors = [np.sum((conv(m) - want) ** 2) for m in (rounded, nearest)]
    assert errors[0] < 0.5 * errors[1]
    # Same scales, int8 values on the narrow range, only the values and the bias changed.
    before, after = graph.initializers(nearest), graph.initializers(rounded)
    assert np.array_equal(before["w_scale"], after["w_scale"])
    assert after["w_quantized"].dtype == np.int8 and np.abs(after["w_quantized"]).max() <= 127
    assert not np.array_equal(before["w_quantized"], after["w_quantized"])


def test_a_layer_read_at_too_few_positions_keeps_nearest_rounding():
    """A 1x1 conv after a global pooling reads one row per sample: 8 samples fit no H of 17
    columns (MIN_ROWS_PER_COLUMN), so its weights stay as nearest rounding made them."""
    rng = np.random.default_rng(7)
    model = graph.Graph(graph.normalize(onnx_model(
        [helper.make_node("GlobalAveragePool", ["x"], ["p"], name="pool"),
         helper.make_node("Conv", ["p", "w", "b"], ["y"], name="se")],
        [("x", ["N", 16, 6, 6])], ["y"],
        {"w": rng.standard_normal((4, 16, 1, 1)), "b": np.zeros(4)})))
    nearest = qdq.quantize_model(model, {"p": 3.0, "x": 3.0})
    x = rng.standard_normal((8, 16, 6, 6)).astype(np.float32)
    rounded, report = rounding.round_weights(model, nearest,
                                             ({"x": x[i:i + 1]} for i in range(8)))
    assert report.tensors["w"] == {"rounded": False, "rows": 8, "columns": 17}
    assert rounded.SerializeToString() == nearest.SerializeToString()


def test_gptq_rounding_holds_the_zoo_cnn_within_its_nearest_rounding_and_is_recorded(tmp_path):
    """calibrate --weight-rounding gptq on digits-cnn: held out (64 evaluation samples, float64)
    the rounded model is no worse than nearest rounding's beyond 0.2 dB (the 'same or better'
    margin of the calibration changes); calibration.json and the phases record it."""
    model, source, stats, score = zoo_held_out("digits-cnn", 64)
    amax = calibrate.calibrate(stats, "mse").amax
    nearest = qdq.quantize_model(model, amax)
    rounded, report = rounding.round_weights(model, nearest, pipeline.samples(
        model.model, source, pipeline.ROUNDING_SAMPLES))
    assert report.summary()["tensors_rounded"] > 0
    assert score(rounded) >= score(nearest) - 0.2
    result = pipeline.run_calibration(model.model, source, tmp_path / "run", progress=False,
                                      weight_rounding="gptq", bias_correction=False)
    record = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert record["weight_rounding"] == "gptq"
    assert record["weight_rounding_choice"]["summary"] == {
        "samples": pipeline.ROUNDING_SAMPLES, "tensors": len(report.tensors),
        "tensors_rounded": report.summary()["tensors_rounded"]}
    phase = next(p for p in result.phases if p["phase"] == "weight rounding")
    assert (phase["samples"], phase["model_runs"]) == (pipeline.ROUNDING_SAMPLES,) * 2


def test_an_unknown_weight_rounding_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="weight rounding 'adaround' is not one of "
                                          "nearest, gptq"):
        pipeline.run_calibration("digits-cnn", np.zeros((4, 1, 28, 28), np.float32),
                                 tmp_path / "run", weight_rounding="adaround", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_weight_two_convs_share_keeps_nearest_rounding_and_its_bias():
    """One rounding cannot fit two ops' inputs (reliability case G08: depthwise convs sharing
    a weight and a bias, reading inputs of opposite sign): the model is left as it is."""
    model, _ = shared_weight_convs(16, weights_as_inputs=False)
    model = graph.Graph(graph.normalize(model))
    nearest = qdq.quantize_model(model, dict.fromkeys(
        qdq.activation_tensors_to_calibrate(model), 3.0))
    x = np.random.default_rng(8).standard_normal((8, 16, 8, 8)).astype(np.float32)
    rounded, report = rounding.round_weights(model, nearest,
                                             ({"x": x[i:i + 1]} for i in range(8)))
    assert report.tensors == {} and report.samples == 0
    assert rounded.SerializeToString() == nearest.SerializeToString()
