"""Repairs: cross-layer equalization, bias correction and SmoothQuant against closed forms and
float64 references."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import onnx_model
from onnx import TensorProto, helper, numpy_helper

from quantlab import graph
from quantlab.calibration import qdq, repairs
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError, ModelError

RNG = np.random.default_rng(0)


def make_model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    """A normalized opset-17 model from (name, shape) inputs/outputs and numpy initializers."""
    return graph.normalize(onnx_model(nodes, inputs, outputs, initializers))


def weights_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return graph.initializers(model)


def conv64(x, w, b, pad=0, group=1):
    """Reference float64 2-D convolution (stride 1) by explicit patch sums."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, c, h, wd = x.shape
    co, cpg, kh, kw = w.shape
    oh, ow = h - kh + 1, wd - kw + 1
    out = np.zeros((n, co, oh, ow))
    opg = co // group
    for o in range(co):
        k = o // opg
        patch = x[:, k * cpg:(k + 1) * cpg]
        for i in range(kh):
            for j in range(kw):
                out[:, o] += np.einsum("nchw,c->nhw", patch[:, :, i:i + oh, j:j + ow],
                                       w[o, :, i, j].astype(np.float64))
        out[:, o] += b[o]
    return out


def relu(x):
    return np.maximum(x, 0.0)


# ---------------------------------------------------------------- cross-layer equalization


def two_conv_model(w1, b1, w2, b2, between="Relu"):
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1")]
    if between:
        nodes.append(helper.make_node(between, ["c1"], ["a1"], name="act1"))
    nodes.append(helper.make_node("Conv", ["a1" if between else "c1", "w2", "b2"], ["y"],
                                  name="conv2"))
    return make_model(nodes, [("x", [2, w1.shape[1], 5, 5])], ["y"],
                      {"w1": w1, "b1": b1, "w2": w2, "b2": b2})


def test_cle_two_layers_matches_the_closed_form():
    w1 = RNG.standard_normal((4, 3, 1, 1)) * np.array([0.1, 1.0, 5.0, 20.0])[:, None, None, None]
    w2 = RNG.standard_normal((5, 4, 1, 1)) * np.array([3.0, 0.2, 1.0, 0.05])[None, :, None, None]
    b1 = RNG.standard_normal(4)
    w1, w2, b1 = (a.astype(np.float32) for a in (w1, w2, b1))
    model = two_conv_model(w1, b1, w2, np.zeros(5, np.float32))
    equalized, report = repairs.cross_layer_equalization(model)
    after = weights_of(equalized)
    # DFQ eq. (5)-(7): s = sqrt(r1 * r2) / r2 with r1 = max|W1| per output channel and
    # r2 = max|W2| per input channel; W1 / s, b1 / s, W2 * s. Tolerance: float32 storage.
    r1 = np.abs(w1.astype(np.float64)).max(axis=(1, 2, 3))
    r2 = np.abs(w2.astype(np.float64)).max(axis=(0, 2, 3))
    s = np.sqrt(r1 * r2) / r2
    np.testing.assert_allclose(after["w1"], w1 / s[:, None, None, None], rtol=2e-6)
    np.testing.assert_allclose(after["b1"], b1 / s, rtol=2e-6)
    np.testing.assert_allclose(after["w2"], w2 * s[None, :, None, None], rtol=2e-6)
    np.testing.assert_allclose(np.abs(after["w1"]).max(axis=(1, 2, 3)), np.sqrt(r1 * r2),
                               rtol=2e-6)
    np.testing.assert_allclose(np.abs(after["w2"]).max(axis=(0, 2, 3)), np.sqrt(r1 * r2),
                               rtol=2e-6)
    (entry,) = report.applied
    assert (entry["first"], entry["second"], entry["through"]) == ("conv1", "conv2", ["act1"])
    assert entry["first_range_spread"][1] == pytest.approx(entry["second_range_spread"][1])
    assert report.passes == 0


def depthwise_chain():
    """conv (3->8) -> Relu -> depthwise 3x3 -> Relu -> conv (8->6, group 2): two CLE pairs."""
    scale = np.exp(RNG.uniform(-3, 3, 8))
    w1 = RNG.standard_normal((8, 3, 3, 3)) * scale[:, None, None, None]
    w2 = RNG.standard_normal((8, 1, 3, 3)) / scale[:, None, None, None]
    w3 = RNG.standard_normal((6, 4, 1, 1))
    b1, b2, b3 = RNG.standard_normal(8), RNG.standard_normal(8), RNG.standard_normal(6)
    arrays = {k: v.astype(np.float32) for k, v in
              dict(w1=w1, b1=b1, w2=w2, b2=b2, w3=w3, b3=b3).items()}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["a1"], name="relu1"),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], name="dw", group=8,
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["a2"], name="relu2"),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["y"], name="conv3", group=2),
    ]
    return make_model(nodes, [("x", [4, 3, 6, 6])], ["y"], arrays), arrays


def chain64(x, a):
    h = relu(conv64(x, a["w1"], a["b1"], pad=1))
    h = relu(conv64(h, a["w2"], a["b2"], pad=1, group=8))
    return conv64(h, a["w3"], a["b3"], group=2)


def test_cle_depthwise_chain_keeps_the_function_and_equalizes():
    model, arrays = depthwise_chain()
    equalized, report = repairs.cross_layer_equalization(model)
    assert [(e["first"], e["second"]) for e in report.applied] == [("conv1", "dw"), ("dw", "conv3")]
    x = RNG.standard_normal((4, 3, 6, 6)).astype(np.float32)
    truth = chain64(x, arrays)
    # Same function: both the original and the equalized model (in ONNX Runtime, float32)
    # are within float32 rounding of the float64 reference of the ORIGINAL weights:
    # relative max error 1e-5 (float32 eps 1.2e-7 times sums of ~100 terms, with margin).
    for candidate in (model, equalized):
        y = OnnxRuntimeBackend(candidate).run({"x": x})["y"]
        assert np.abs(y - truth).max() <= 1e-5 * np.abs(truth).max()
    # Equalized ranges: for conv1 -> dw -> conv3 the fixed point of DFQ's iteration gives
    # every layer the range cbrt(r1 * r2 * r3) on each channel (the product is invariant).
    after = weights_of(equalized)
    r1 = np.abs(arrays["w1"].astype(np.float64)).max(axis=(1, 2, 3))
    r2 = np.abs(arrays["w2"].astype(np.float64)).max(axis=(1, 2, 3))
    r3 = np.abs(arrays["w3"].astype(np.float64)).reshape(2, 3, 4).max(axis=1).reshape(-1)
    target = np.cbrt(r1 * r2 * r3)
    np.testing.assert_allclose(np.abs(after["w1"]).max(axis=(1, 2, 3)), target, rtol=1e-3)
    np.testing.assert_allclose(np.abs(after["w2"]).max(axis=(1, 2, 3)), target, rtol=1e-3)
    np.testing.assert_allclose(
        np.abs(after["w3"]).reshape(2, 3, 4).max(axis=1).reshape(-1), target, rtol=1e-3)


def test_cle_skips_relu6_and_sigmoid_and_reports_why():
    w1 = RNG.standard_normal((4, 3, 1, 1)).astype(np.float32)
    w2 = RNG.standard_normal((5, 4, 1, 1)).astype(np.float32)
    b1, b2 = np.zeros(4, np.float32), np.zeros(5, np.float32)
    for between in ("Sigmoid", "HardSwish"):
        model = two_conv_model(w1, b1, w2, b2, between=between)
        equalized, report = repairs.cross_layer_equalization(model)
        assert report.applied == []
        assert between in report.skipped[0]["reason"]
        assert weights_of(equalized)["w1"].tobytes() == w1.tobytes()


def test_cle_without_pattern_is_an_empty_report_and_nonfinite_weights_an_error():
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [("x", [1, 3])],
                       ["y"], {})
    same, report = repairs.cross_layer_equalization(model)
    assert report.applied == [] and report.skipped == []
    assert same.SerializeToString() == model.SerializeToString()
    w1 = RNG.standard_normal((4, 3, 1, 1)).astype(np.float32)
    w1[2, 0, 0, 0] = np.nan
    bad = two_conv_model(w1, np.zeros(4, np.float32),
                         RNG.standard_normal((5, 4, 1, 1)).astype(np.float32),
                         np.zeros(5, np.float32))
    with pytest.raises(ModelError, match="'w1' holds NaN"):
        repairs.cross_layer_equalization(bad)


@pytest.fixture(scope="module")
def shapes_det():
    from quantlab import zoo
    from quantlab.calibration import pipeline

    entry = zoo.get("shapes-det")
    return graph.normalize(pipeline.export_zoo_model("shapes-det")), entry


def test_cle_on_shapes_det_keeps_the_function(shapes_det):
    import torch

    model, entry = shapes_det
    equalized, report = repairs.cross_layer_equalization(model)
    # Pointwise conv -> Relu -> depthwise conv pairs; depthwise -> ReLU6 -> pointwise is not one.
    assert len(report.applied) >= 10
    assert any("Clip" in s["reason"] for s in report.skipped)
    x = entry.eval_set(8).inputs.astype(np.float32)
    with torch.no_grad():
        truth = entry.build().double()(torch.from_numpy(x).double())
    names = list(entry.output_names)
    truth = dict(zip(names, (t.numpy() for t in truth), strict=True))
    original = OnnxRuntimeBackend(model).run({"input": x})
    result = OnnxRuntimeBackend(equalized).run({"input": x})
    for name in names:
        # Float32 rounding of 41 layers: the equalized model's error against the float64
        # torch reference stays within 4x the original FP32 model's own error (and far
        # below INT8's, ~1e-2 relative).
        own = np.abs(original[name] - truth[name]).max()
        new = np.abs(result[name] - truth[name]).max()
        assert new <= 4 * own + 1e-6 * np.abs(truth[name]).max(), (name, own, new)


# --------------------------------------------------------------------- bias correction


def gemm_model(w, b, trans_b=1, with_bias=True):
    inputs = ["x", "w", "b"] if with_bias else ["x", "w"]
    arrays = {"w": w, "b": b} if with_bias else {"w": w}
    return make_model([helper.make_node("Gemm", inputs, ["y"], name="fc", transB=trans_b)],
                      [("x", [None, w.shape[1]])], ["y"], arrays)


def grid_inputs(count, k, amax):
    """Inputs on the INT8 grid of `amax` (Q/DQ reproduces them exactly), with non-zero mean."""
    levels = RNG.integers(-60, 127, size=(count, k))
    return (levels * np.float32(amax / 127)).astype(np.float32)


def dequantized(w, axis=0):
    """Per-channel symmetric int8 weight as TensorRT/ONNX QuantizeLinear rounds it."""
    scale = np.abs(w).max(axis=1 - axis, keepdims=True) / np.float32(127)
    return np.clip(np.rint(w / scale), -128, 127) * scale


@pytest.mark.parametrize("mode", ["local", "global"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_correction_matches_the_known_shift(mode, with_bias):
    w = RNG.standard_normal((6, 10)).astype(np.float32)
    b = RNG.standard_normal(6).astype(np.float32)
    model = gemm_model(w, b, with_bias=with_bias)
    x = grid_inputs(64, 10, 4.0)
    quantized = qdq.quantize_model(model, {"x": 4.0}, weight_criterion="max")
    corrected, report = repairs.bias_correction(model, quantized, [{"x": x[:40]}, {"x": x[40:]}],
                                                mode=mode)
    # Inputs pass Q/DQ unchanged, so the mean output error is exactly (W_q - W) E[x] (DFQ
    # eq. 9): the correction must be that, up to float32 rounding of the sums (1e-5).
    shift = (dequantized(w).astype(np.float64) - w) @ x.astype(np.float64).mean(axis=0)
    (entry,) = report.applied
    assert entry["bias_added"] is not with_bias
    bias_name = next(n.input[2] for n in corrected.graph.node if n.op_type == "Gemm")
    expected = (b if with_bias else 0) - shift
    np.testing.assert_allclose(weights_of(corrected)[bias_name], expected, atol=1e-5)
    reference = OnnxRuntimeBackend(model).run({"x": x})["y"]
    before = OnnxRuntimeBackend(quantized).run({"x": x})["y"] - reference
    after = OnnxRuntimeBackend(corrected).run({"x": x})["y"] - reference
    np.testing.assert_allclose(before.mean(axis=0), shift, atol=1e-5)
    assert np.abs(after.mean(axis=0)).max() < 1e-5 < np.abs(before.mean(axis=0)).max()
    assert report.passes == (2 if mode == "local" else 3)


@pytest.mark.parametrize("mode", ["local", "global"])
def test_bias_correction_of_a_conv_matches_the_known_shift_per_output_channel(mode):
    """A conv's output channel is axis 1 of [N, C, H, W]: the shift is the float64 conv of
    the inputs (on the INT8 grid, so Q/DQ reproduces them) with W_q - W, averaged over N,
    H and W (conv64, explicit patch sums); up to float32 rounding of the sums (1e-5)."""
    rng = np.random.default_rng(11)  # its own draws: the module's RNG feeds the tests after
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv",
                                         pads=[1, 1, 1, 1])],
                       [("x", [None, 3, 6, 7])], ["y"], {"w": w, "b": b})
    x = (rng.integers(-60, 127, (24, 3, 6, 7)) * np.float32(4.0 / 127)).astype(np.float32)
    quantized = qdq.quantize_model(model, {"x": 4.0}, weight_criterion="max")
    corrected, _ = repairs.bias_correction(model, quantized, [{"x": x[:10]}, {"x": x[10:]}],
                                           mode=mode)
    w_q = dequantized(w.reshape(5, -1)).reshape(w.shape)
    shift = conv64(x, w_q.astype(np.float64) - w, np.zeros(5), pad=1).mean(axis=(0, 2, 3))
    bias_name = next(n.input[2] for n in corrected.graph.node if n.op_type == "Conv")
    np.testing.assert_allclose(weights_of(corrected)[bias_name], b - shift, atol=1e-5)


def test_bias_correction_shrinks_the_error_of_a_two_layer_net_and_matmul_gets_a_bias():
    w1 = RNG.standard_normal((12, 8)).astype(np.float32)
    w2 = (RNG.standard_normal((12, 5)) * 0.3).astype(np.float32)
    b1 = RNG.standard_normal(12).astype(np.float32)
    model = make_model([
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
    ], [("x", [None, 8])], ["y"], {"w1": w1, "b1": b1, "w2": w2})
    x = (RNG.standard_normal((256, 8)) + 0.5).astype(np.float32)
    reference = OnnxRuntimeBackend(model).run({"x": x}, ["h", "y"])
    r = np.maximum(reference["h"], 0)
    amax = {"x": float(np.abs(x).max()), "r": float(r.max())}
    quantized = qdq.quantize_model(model, amax)
    corrected, report = repairs.bias_correction(model, quantized, [{"x": x}])
    assert {e["node"] for e in report.applied} == {"fc1", "fc2"}
    assert any(n.op_type == "Add" for n in corrected.graph.node)  # the MatMul's new bias
    # The expected error per output channel (mean over the samples), measured in ONNX
    # Runtime: smaller after correction, at both layers.
    before = OnnxRuntimeBackend(quantized).run({"x": x}, ["h", "y"])
    after = OnnxRuntimeBackend(corrected).run({"x": x}, ["h", "y"])
    for name in ("h", "y"):
        was = np.abs((before[name] - reference[name]).mean(axis=0)).mean()
        now = np.abs((after[name] - reference[name]).mean(axis=0)).mean()
        assert now < 0.5 * was, (name, was, now)


def test_settled_bias_shifts_stop_once_their_sampling_noise_is_under_the_tolerance():
    """With a Settle, a part is read until its shifts' squared standard errors, summed over
    every op's channels, are under the tolerance of their squares (not before the minimum):
    the stop is checked against that ratio computed the slow way, from each sample's own
    bias_shifts in float64; the shifts are bias_shifts of the samples read; a tolerance no
    ratio reaches reads everything."""
    w1 = RNG.standard_normal((12, 8)).astype(np.float32)
    model = make_model([
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
    ], [("x", [None, 8])], ["y"], {"w1": w1, "b1": RNG.standard_normal(12).astype(np.float32),
                                   "w2": (RNG.standard_normal((12, 5)) * 0.3).astype(np.float32)})
    x = (RNG.standard_normal((40, 8)) + 0.5).astype(np.float32)
    quantized = qdq.quantize_model(model, {"x": float(np.abs(x).max()), "r": 3.0})
    samples = [{"x": x[i:i + 1]} for i in range(len(x))]
    each = [repairs.bias_shifts(model, quantized, [sample])[0] for sample in samples]

    def ratio(n: int) -> float:
        shifts = {node: np.array([s[node] for s in each[:n]], np.float64) for node in each[0]}
        return sum((v.var(axis=0, ddof=1) / n).sum() for v in shifts.values()) / \
            sum((v.mean(axis=0) ** 2).sum() for v in shifts.values())

    minimum, ratios = 6, {n: ratio(n) for n in range(2, len(x) + 1)}
    tolerance = ratios[24]
    expected = next(n for n in range(minimum, len(x) + 1) if ratios[n] <= tolerance)
    assert minimum < expected <= 24 and min(abs(r / tolerance - 1) for n, r in ratios.items()
                                            if n != 24 and r != tolerance) > 1e-6
    shifts, _, report, _ = repairs.bias_shift_folds(model, quantized, [samples],
                                                 settle=repairs.Settle(tolerance, minimum))
    assert report.summary["samples_read"] == [expected]
    read, _ = repairs.bias_shifts(model, quantized, samples[:expected])
    for node in read:
        np.testing.assert_allclose(shifts[0][node], read[node], rtol=1e-9, atol=0)
    _, _, everything, _ = repairs.bias_shift_folds(
        model, quantized, [samples], settle=repairs.Settle(min(ratios.values()) / 2, minimum))
    assert everything.summary["samples_read"] == [len(x)]


def test_kept_model_outputs_are_the_first_runs_that_fit_their_bytes():
    """The bias pass keeps FP32's outputs of its first runs for the folds, which take them
    as the outputs of the first samples: only a prefix of the runs, within the byte cap (a
    model of large outputs would otherwise hold them all)."""
    from quantlab.calibration.repairs.bias import FirstOutputs

    kept = FirstOutputs(limit=4, max_bytes=100)
    runs = [{"y": np.zeros(n, np.float32)} for n in (10, 10, 10, 1, 1)]  # 40 bytes each, then 4
    for run in runs:
        kept.offer(run)
    assert [run["y"] is given["y"] for run, given in zip(runs, kept.runs, strict=False)] == \
        [True, True]
    assert kept.limit == 2  # the 4-byte runs after the one that did not fit are not kept
    roomy = FirstOutputs(limit=2, max_bytes=1000)
    for run in runs:
        roomy.offer(run)
    assert len(roomy.runs) == 2


def test_bias_shift_folds_pool_into_the_whole_datas_shifts():
    """Each part's shifts are bias_shifts on that part, and the pooled ones bias_shifts on
    all of it (parts of unequal size: their means weighted by what each counted), up to
    the float32 rounding of the graph's sums (sensitivity._Attached.reduced: runs of other
    sizes round differently); the corrected model equals bias_correction's up to float32
    rounding."""
    w1 = RNG.standard_normal((12, 8)).astype(np.float32)
    w2 = (RNG.standard_normal((12, 5)) * 0.3).astype(np.float32)
    model = make_model([
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
    ], [("x", [None, 8])], ["y"], {"w1": w1, "b1": RNG.standard_normal(12).astype(np.float32),
                                   "w2": w2})
    x = (RNG.standard_normal((70, 8)) + 0.5).astype(np.float32)
    quantized = qdq.quantize_model(model, {"x": float(np.abs(x).max()), "r": 3.0})
    parts = [[{"x": x[:10]}, {"x": x[10:25]}], [{"x": x[25:]}]]
    shifts, pooled, report, _ = repairs.bias_shift_folds(model, quantized, parts)
    for part, found in zip(parts, shifts, strict=True):
        expected, _ = repairs.bias_shifts(model, quantized, part)
        assert found.keys() == expected.keys() == {"fc1", "fc2"}
        for node in expected:
            np.testing.assert_allclose(found[node], expected[node], rtol=1e-12, atol=0)
    whole, whole_report = repairs.bias_shifts(model, quantized, [{"x": x}])
    for node in whole:
        np.testing.assert_allclose(pooled[node], whole[node], rtol=1e-6, atol=1e-12)
        assert not np.allclose(shifts[0][node], whole[node])  # the weighting matters
    corrected, corrected_report = repairs.bias_correction(model, quantized, [{"x": x}])
    applied = repairs.shift_biases(model, quantized, pooled)
    for name, value in weights_of(corrected).items():
        np.testing.assert_allclose(weights_of(applied)[name], value, rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(report.applied, corrected_report.applied, strict=True):
        assert mine.keys() == theirs.keys() and mine["node"] == theirs["node"]
        np.testing.assert_allclose(mine["correction_max"], theirs["correction_max"], rtol=1e-6)
    assert report.passes == whole_report.passes == 2


def test_bias_correction_bad_input():
    w = RNG.standard_normal((6, 10)).astype(np.float32)
    model = gemm_model(w, np.zeros(6, np.float32))
    quantized = qdq.quantize_model(model, {"x": 4.0})
    once = iter([{"x": grid_inputs(4, 10, 4.0)}])
    with pytest.raises(ConfigError, match="one-shot iterator"):
        repairs.bias_correction(model, quantized, once, mode="global", rounds=2)
    with pytest.raises(ConfigError, match="mode"):
        repairs.bias_correction(model, quantized, [], mode="sequential")
    # No INT8 op (everything pinned to FP32): nothing to correct, the model comes back as is.
    pinned = qdq.quantize_model(model, {"x": 4.0}, {"fc": "fp32"})
    same, report = repairs.bias_correction(model, pinned, [{"x": grid_inputs(4, 10, 4.0)}])
    assert report.applied == [] and same.SerializeToString() == pinned.SerializeToString()


# ------------------------------------------------------------------------ SmoothQuant


def layer_norm64(x, gamma, beta, eps=1e-5):
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def attention_input_model():
    """LayerNorm with outlier channels feeding two MatMuls (as q and k projections do)."""
    k = 16
    gamma = np.ones(k)
    gamma[[3, 11]] = [40.0, 25.0]
    beta = RNG.standard_normal(k) * 0.1
    wq, wk = RNG.standard_normal((k, 8)) * 0.2, RNG.standard_normal((k, 8)) * 0.2
    arrays = {n: v.astype(np.float32) for n, v in
              dict(gamma=gamma, beta=beta, wq=wq, wk=wk).items()}
    model = make_model([
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], name="ln",
                         axis=-1),
        helper.make_node("MatMul", ["ln", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["ln", "wk"], ["k"], name="k_proj"),
    ], [("x", [None, 5, k])], ["q", "k"], arrays)
    return model, arrays


def test_smooth_quant_folds_into_layer_norm_and_shrinks_the_range():
    model, a = attention_input_model()
    x = RNG.standard_normal((32, 5, 16)).astype(np.float32)
    smoothed, report = repairs.smooth_quant(model, [{"x": x[:20]}, {"x": x[20:]}], alpha=0.5)
    (entry,) = report.applied
    assert entry["folded_into"] == "ln" and sorted(entry["readers"]) == ["k_proj", "q_proj"]
    assert not any(n.op_type == "Mul" for n in smoothed.graph.node)
    # Numpy reference of Xiao et al. eq. 4: s_j = max|X_j|^a / max|W_j|^(1-a), W_j row j of
    # [Wq Wk]; the smoothed activation X / s has per-tensor range max_j(max|X_j| / s_j).
    ln = layer_norm64(x, a["gamma"], a["beta"])
    act = np.abs(ln).reshape(-1, 16).max(axis=0)
    w = np.abs(np.concatenate([a["wq"], a["wk"]], axis=1)).max(axis=1)
    s = np.sqrt(act) / np.sqrt(w)
    expected = (act / s).max()
    exposed = OnnxRuntimeBackend(smoothed).run({"x": x}, ["ln", "q", "k"])
    # Tolerance 1e-4 relative: float32 LayerNorm in ORT against the float64 reference.
    assert np.abs(exposed["ln"]).max() == pytest.approx(expected, rel=1e-4)
    assert entry["amax"][1] == pytest.approx(expected, rel=1e-4)
    assert expected < 0.5 * act.max()
    # The function is unchanged: q and k equal the float64 reference of the original.
    for name, weight in (("q", a["wq"]), ("k", a["wk"])):
        truth = ln @ weight.astype(np.float64)
        assert np.abs(exposed[name] - truth).max() <= 1e-5 * np.abs(truth).max()


def test_smooth_quant_inserts_a_mul_when_the_producer_cannot_absorb_it():
    k = 8
    scale = np.ones(k, np.float32)
    scale[2] = 30.0
    w = (RNG.standard_normal((k, 4)) * 0.3).astype(np.float32)
    # x * scale is also a graph output, so nothing upstream may change: a Mul goes in.
    model = make_model([
        helper.make_node("Mul", ["x", "scale"], ["h"], name="spread"),
        helper.make_node("MatMul", ["h", "w"], ["y"], name="proj"),
    ], [("x", [None, k])], ["y", "h"], {"scale": scale, "w": w})
    x = RNG.standard_normal((64, k)).astype(np.float32)
    smoothed, report = repairs.smooth_quant(model, [{"x": x}])
    (entry,) = report.applied
    assert "inserted" in entry["folded_into"]
    truth = (x.astype(np.float64) * scale) @ w.astype(np.float64)
    out = OnnxRuntimeBackend(smoothed).run({"x": x})
    assert np.abs(out["y"] - truth).max() <= 1e-5 * np.abs(truth).max()
    np.testing.assert_array_equal(out["h"], x * scale)
    # Statistics given instead of data: no forward pass, same result.
    stats = {"h": np.abs(x * scale).max(axis=0)}
    again, given = repairs.smooth_quant(model, stats)
    assert given.passes == 0 and report.passes == 1
    assert given.applied[0]["amax"] == pytest.approx(entry["amax"])


def test_smooth_quant_skips_narrow_activations_and_rejects_bad_alpha():
    model, _ = attention_input_model()
    stats = {"ln": np.ones(16)}
    same, report = repairs.smooth_quant(model, stats)
    assert report.applied == [] and "spread" in report.skipped[0]["reason"]
    assert same.SerializeToString() == model.SerializeToString()
    with pytest.raises(ConfigError, match="alpha"):
        repairs.smooth_quant(model, stats, alpha=1.5)
    plain = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [("x", [1, 3])],
                       ["y"], {})
    assert repairs.smooth_quant(plain, stats)[1].applied == []


def test_smooth_quant_on_digits_vit_keeps_the_function():
    from quantlab import zoo
    from quantlab.calibration import pipeline

    entry = zoo.get("digits-vit")
    model = graph.normalize(pipeline.export_zoo_model("digits-vit"))
    x = entry.calibration_set()[:64].astype(np.float32)
    # min_spread=1 smooths every MatMul/Gemm input, folding and inserting alike.
    smoothed, report = repairs.smooth_quant(model, [{"input": x}], min_spread=1.0)
    kinds = {"inserted" in e["folded_into"] for e in report.applied}
    assert kinds == {True, False}
    assert all(e["amax"][1] <= e["amax"][0] * 1.0001 or e["spread"][1] < e["spread"][0]
               for e in report.applied)
    original = OnnxRuntimeBackend(model).run({"input": x})["logits"]
    result = OnnxRuntimeBackend(smoothed).run({"input": x})["logits"]
    # Float32 rounding through 3 transformer layers: 1e-4 of the logits' range.
    assert np.abs(result - original).max() <= 1e-4 * np.abs(original).max()


# ------------------------------------------------------- depthwise-input equalization

# Channel ranges 40x apart, the pattern of PicoDet's HardSwish outputs (layout-int8 study).
CHANNEL_GAINS = np.array([2.0, 0.05, 0.1, 1.0, 0.08, 0.5])


def hardswish_dw_model(extra_reader: bool = False, activation: str = "hardswish",
                       reader: str = "depthwise"):
    """Pointwise Conv -> HardSwish (decomposed, Paddle's form) or ReLU -> depthwise Conv ->
    BatchNorm (folded at import): per-channel input ranges set by CHANNEL_GAINS, and the
    BN scaling the small channels back up. With ``reader="pointwise"`` a 1x1 Conv to 8
    channels reads the HardSwish instead, its weights scaling each channel back up."""
    c = CHANNEL_GAINS.size
    w1 = RNG.standard_normal((c, 3, 1, 1)) * CHANNEL_GAINS[:, None, None, None]
    w2 = RNG.standard_normal((c, 1, 3, 3))
    second = helper.make_node("Conv", ["h", "w2"], ["d"], name="dw", group=c, pads=[1] * 4)
    if reader == "pointwise":
        w2 = RNG.standard_normal((8, c, 1, 1)) / CHANNEL_GAINS[None, :, None, None]
        second = helper.make_node("Conv", ["h", "w2"], ["d"], name="pw2")
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="pw")]
    if activation == "hardswish":
        nodes += [helper.make_node("Add", ["a", "three"], ["t"], name="add"),
                  helper.make_node("Clip", ["t", "zero", "six"], ["k"], name="clip"),
                  helper.make_node("Mul", ["a", "k"], ["m"], name="mul"),
                  helper.make_node("Div", ["m", "six"], ["h"], name="div")]
    else:
        nodes.append(helper.make_node("Relu", ["a"], ["h"], name="relu"))
    nodes += [second, helper.make_node("BatchNormalization", ["d", "g", "beta", "mean", "var"],
                                       ["y"], name="bn")]
    out = w2.shape[0]
    initializers = {"w1": w1, "b1": RNG.standard_normal(c) * CHANNEL_GAINS, "w2": w2,
                    "three": np.float32(3), "zero": np.float32(0), "six": np.float32(6),
                    "g": 1.0 / CHANNEL_GAINS if reader == "depthwise" else np.ones(out),
                    "beta": RNG.standard_normal(out), "mean": np.zeros(out), "var": np.ones(out)}
    outputs = ["y", "h"] if extra_reader else ["y"]
    return make_model(nodes, [("x", [None, 3, 8, 8])], outputs, initializers)


def float64_run(model, feeds):
    """`model` evaluated in float64 by ONNX's reference evaluator (weights widened)."""
    from onnx.reference import ReferenceEvaluator

    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    for init in wide.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64),
                                                  init.name))
    for value in [*wide.graph.input, *wide.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    del wide.graph.value_info[:]
    return dict(zip([o.name for o in wide.graph.output],
                    ReferenceEvaluator(wide).run(None, {k: v.astype(np.float64)
                                                        for k, v in feeds.items()}), strict=True))


def sqnr_db(reference, value):
    return 10 * np.log10(np.sum(reference ** 2) / np.sum((value - reference) ** 2))


def int8_sqnr(fp32_model, x, reference):
    """Output 'y' of `fp32_model` all-INT8 (percentile activations calibrated on `x`, weights
    per channel), in dB against `reference`."""
    from quantlab.calibration import calibrate, collect
    from quantlab.data import open_data

    source = open_data(x, graph.input_specs(fp32_model), 16)
    tensors = qdq.activation_tensors_to_calibrate(fp32_model)
    stats = collect.collect(fp32_model, source, tensors, progress=False)
    quantized = qdq.quantize_model(fp32_model, calibrate.calibrate(stats, "percentile").amax)
    return sqnr_db(reference, OnnxRuntimeBackend(quantized).run({"x": x})["y"])


@pytest.mark.parametrize("activation", ["hardswish", "relu"])
def test_depthwise_equalization_keeps_fp32_and_raises_int8_sqnr(activation):

    model = hardswish_dw_model(activation=activation)
    x = RNG.standard_normal((16, 3, 8, 8)).astype(np.float32)
    equalized, report = repairs.depthwise_equalization(model, [{"x": x}])
    (entry,) = report.applied
    # The division lands in the HardSwish's Div(6), or through the ReLU in the pointwise Conv.
    assert entry["folded_into"] == ("Div 'div'" if activation == "hardswish" else "Conv 'pw'")
    assert entry["equalized_tensor"] == "h_equalized" and report.passes == 1
    assert entry["spread"][1] < 1.5 < entry["spread"][0]
    # The FP32 function is unchanged: both models in float64, only the float32 storage of
    # the rescaled weights differs (relative 1e-7 per weight).
    before, after = float64_run(model, {"x": x})["y"], float64_run(equalized, {"x": x})["y"]
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-6 * np.abs(before).max())
    # Every tensor whose values change is renamed: `quantlab plan` reuses the statistics
    # of the tensors both models name. Those are the same FP32 values in both, to float32
    # rounding (the depthwise output comes from the rescaled weights: 1e-6 of its range).
    names = graph.Graph(model).floats
    shared = sorted(set(names) & set(graph.Graph(graph.normalize(equalized)).floats) - {"x"})
    assert "h" not in shared and "y" in shared
    ours, theirs = (OnnxRuntimeBackend(m).run({"x": x}, shared) for m in (model, equalized))
    for name in shared:
        np.testing.assert_allclose(theirs[name], ours[name], rtol=0,
                                   atol=1e-6 * np.abs(ours[name]).max(), err_msg=name)
    assert int8_sqnr(graph.normalize(equalized), x, before) > int8_sqnr(model, x, before) + 6.0


def test_channel_ranges_kept_by_the_statistics_pass_equal_a_pass_of_their_own():
    """`quantlab plan` keeps the equalization's per-channel ranges in its statistics pass
    (collect's `channels`) instead of a pass of its own. Reference: repairs.channel_ranges
    over the same data cut in other runs (batches of 5 against one of 16): the same ranges
    to the last bit (the power-of-two grid is exact under any split), so the same
    equalized model. A channel tensor collect is not asked for is refused with its name."""
    from quantlab.calibration import collect
    from quantlab.data import open_data
    from quantlab.errors import ConfigError

    model = hardswish_dw_model(reader="pointwise")
    x = RNG.standard_normal((16, 3, 8, 8)).astype(np.float32) * 3
    inputs = repairs.equalization_inputs(model, pointwise=True)
    assert inputs == ["x", "h"] and repairs.equalization_inputs(model) == []
    tensors = qdq.activation_tensors_to_calibrate(model)
    stats = collect.collect(model, open_data(x, graph.input_specs(model), 5), tensors,
                            progress=False, channels=inputs)
    kept = repairs.channel_percentiles(stats.channels)
    own = repairs.channel_ranges(model, [{"x": x}], inputs)
    assert {n: r.tolist() for n, r in kept.items()} == {n: r.tolist() for n, r in own.items()}
    assert len(set(own["h"].tolist())) == CHANNEL_GAINS.size  # every channel its own range
    from_stats, report = repairs.depthwise_equalization(model, kept, pointwise=True)
    from_pass, _ = repairs.depthwise_equalization(model, [{"x": x}], pointwise=True)
    assert report.passes == 0 and report.applied
    assert from_stats.SerializeToString() == from_pass.SerializeToString()
    with pytest.raises(ConfigError, match=r"channels \['nowhere'\] are not among"):
        collect.collect(model, open_data(x, graph.input_specs(model), 5), tensors,
                        progress=False, channels=["nowhere"])


def test_pointwise_equalization_keeps_fp32_picks_its_share_and_raises_int8_sqnr(monkeypatch):
    model = hardswish_dw_model(reader="pointwise")
    x = RNG.standard_normal((16, 3, 8, 8)).astype(np.float32)
    assert not repairs.depthwise_equalization(model, [{"x": x}])[1].applied  # depthwise only
    equalized, report = repairs.depthwise_equalization(model, [{"x": x}], pointwise=True)
    (entry,) = report.applied  # 'x' (3 channels of equal range) is skipped for its gain
    assert entry["readers"] == ["pw2"] and entry["folded_into"] == "Div 'div'"
    assert report.summary == {"depthwise_inputs": 0, "pointwise_inputs": 2, "equalized": 1}
    # FP32 unchanged in float64, to the float32 storage of the rescaled weights.
    before, after = float64_run(model, {"x": x})["y"], float64_run(equalized, {"x": x})["y"]
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-6 * np.abs(before).max())
    # The share of the division the noise model picks (alpha), each alpha applied alone: the
    # model takes each channel's range for its scale (an upper bound of its RMS), so it
    # overstates the weight noise the division adds and never picks more than the best
    # measured; what it picks is far above the model as it is.
    measured = {}
    for alpha in repairs.MIGRATION_ALPHAS:
        monkeypatch.setattr(repairs.equalize, "MIGRATION_ALPHAS", (alpha,))
        alone, _ = repairs.depthwise_equalization(model, [{"x": x}], min_gain_db=-np.inf,
                                                  pointwise=True)
        measured[alpha] = int8_sqnr(graph.normalize(alone), x, before)
    assert entry["alpha"] <= max(measured, key=measured.get)
    assert measured[entry["alpha"]] > int8_sqnr(model, x, before) + 10.0
    # Read by 1x1 convs only and by the graph output: no producer takes the division, and
    # no Mul is inserted for 1x1 readers (only depthwise readers are worth one).
    shared = hardswish_dw_model(extra_reader=True, reader="pointwise")
    unchanged, report = repairs.depthwise_equalization(shared, [{"x": x}], pointwise=True)
    assert not report.applied
    skipped = {s["tensor"]: s["reason"] for s in report.skipped}
    assert skipped["h"].startswith("read by 1x1 convs only and no producer takes the division")


def test_depthwise_equalization_inserts_a_mul_and_reports_what_it_skips():
    model = hardswish_dw_model(extra_reader=True)  # 'h' is a graph output too
    x = RNG.standard_normal((8, 3, 8, 8)).astype(np.float32)
    equalized, report = repairs.depthwise_equalization(model, [{"x": x}])
    (entry,) = report.applied
    assert entry["folded_into"].startswith("Mul ") and entry["folded_into"].endswith("(inserted)")
    got = float64_run(equalized, {"x": x})
    want = float64_run(model, {"x": x})
    np.testing.assert_array_equal(got["h"], want["h"])  # the other reader sees 'h' unchanged
    np.testing.assert_allclose(got["y"], want["y"], rtol=0, atol=1e-6 * np.abs(want["y"]).max())
    # Channels of equal range: nothing to gain, reported with the predicted figure.
    flat = {"h": np.ones(CHANNEL_GAINS.size)}
    unchanged, report = repairs.depthwise_equalization(model, flat)
    (skipped,) = report.skipped
    assert not report.applied and "predicted gain 0.00 dB" in skipped["reason"]
    assert skipped["readers"] == ["dw"] and report.passes == 0
    zero = {"h": np.zeros(CHANNEL_GAINS.size)}
    assert "zero" in repairs.depthwise_equalization(model, zero)[1].skipped[0]["reason"]


def test_cle_reports_every_linear_op_it_leaves_alone():
    # Pointwise Conv -> decomposed HardSwish -> depthwise Conv -> BN (folded): CLE cannot pass
    # the HardSwish (its input is read twice), and the last Conv feeds the graph output. Both
    # are listed with their reason: "skipped: 0" read as "no problem here" (layout study).
    model = hardswish_dw_model()
    _, report = repairs.cross_layer_equalization(model)
    assert not report.applied
    reasons = {entry["first"]: entry["reason"] for entry in report.skipped}
    assert set(reasons) == {"pw", "dw"}
    assert "2 readers (Add, Mul)" in reasons["pw"] and "graph output" in reasons["dw"]


# ------------------------------------------------------------- registry and keep rule


def test_registry_holds_the_command_lines_repairs_and_applies_each_as_its_function():
    """Reference: each repair's own function on the same model (and graph.normalize after an
    equalization that renamed tensors); with the ranges given, no pass is run."""
    from quantlab import choices

    assert tuple(repairs.REGISTRY) == choices.REPAIRS
    model = hardswish_dw_model(activation="relu")
    x = RNG.standard_normal((16, 3, 8, 8)).astype(np.float32)
    for name, pointwise in (("dw-equalize", False), ("pw-equalize", True)):
        repair = repairs.REGISTRY[name]
        inputs = repair.channel_inputs(model)
        assert inputs == repairs.equalization_inputs(model, pointwise) and repair.renames
        ranges = repairs.channel_ranges(model, [{"x": x}], inputs)
        direct, _ = repairs.depthwise_equalization(model, ranges, pointwise=pointwise)
        via, report = repair.apply(model, None, {**ranges, "unread": np.ones(3)})
        assert report.passes == 0 and report.applied
        assert via.SerializeToString() == graph.normalize(direct).SerializeToString()
        # Ranges missing an input: one pass over the data instead.
        assert repair.apply(model, [{"x": x}], {})[1].passes == 1
    w1 = RNG.standard_normal((4, 3, 1, 1)).astype(np.float32)
    w2 = RNG.standard_normal((5, 4, 1, 1)).astype(np.float32)
    convs = two_conv_model(w1, np.zeros(4, np.float32), w2, np.zeros(5, np.float32))
    cle = repairs.REGISTRY["cle"]
    assert not cle.needs_data and cle.channel_inputs(convs) == []
    assert cle.apply(convs, None, {})[0].SerializeToString() == \
        repairs.cross_layer_equalization(convs)[0].SerializeToString()
    smooth, feeds = attention_input_model()[0], [{"x": RNG.standard_normal((4, 5, 16))}]
    smooth_quant = repairs.REGISTRY["smoothquant"]
    assert smooth_quant.needs_data and not smooth_quant.renames
    assert smooth_quant.apply(smooth, feeds, {})[0].SerializeToString() == \
        repairs.smooth_quant(smooth, feeds)[0].SerializeToString()


def test_keep_rule_keeps_only_a_strictly_lower_noise_and_chooses_as_min_does():
    """Reference: Python's min over the options in order (the planner's choice before the
    rule was written once), on random noise with ties and NaN."""
    assert repairs.lowers_noise(1.0, 0.5) and not repairs.lowers_noise(1.0, 1.0)
    assert not repairs.lowers_noise(1.0, np.nan) and not repairs.lowers_noise(np.nan, 0.5)
    rng = np.random.default_rng(3)
    for _ in range(200):
        values = rng.integers(0, 4, 5).astype(float)
        values[rng.random(5) < 0.1] = np.nan
        noise = {name: float(v) for name, v in zip("nabcd", values, strict=True)}
        assert repairs.quietest(noise) == min(noise, key=noise.get)
