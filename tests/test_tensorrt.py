"""TensorRT backend: what runs without TensorRT is tested here for real; engine builds and runs
need the `tensorrt` package and an NVIDIA GPU and skip without them (never faked)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from quantlab import cache
from quantlab.backends import tensorrt as trt_backend
from quantlab.backends.tensorrt import (
    TensorRTBackend,
    build_engine,
    check_debug_tensors,
    check_mode,
    default_mode,
    input_profile,
    layer_precisions_for,
    make_engine_backend,
    parse_version,
    require_tensorrt,
)
from quantlab.backends.trt_calibrator import CalibrationFeeder, make_calibrator
from quantlab.data import open_data
from quantlab.errors import BackendUnavailableError, ConfigError, DataError
from quantlab.graph import TensorSpec

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
no_tensorrt = pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
NEEDS_TENSORRT = "needs the tensorrt package and an NVIDIA GPU (not installable on CI)"


def small_model(batch: int | str = "N", extra_dynamic: bool = False) -> onnx.ModelProto:
    """x[batch, 3, H, 4] -> Relu -> y: a graph built by hand, enough for specs and profiles."""
    height = "H" if extra_dynamic else 2
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, height, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3, height, 4])
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    return model


# --- without TensorRT: every entry point says what to install -------------------------------

def test_polygraphy_imports_without_tensorrt():
    # Polygraphy imports TensorRT lazily: its TensorRT loaders, runner and calibrator import
    # here, and importing them does not import tensorrt.
    code = ("import sys; import polygraphy.backend.trt as t; "
            "t.NetworkFromOnnxPath, t.CreateConfig, t.EngineBytesFromNetwork, t.TrtRunner, "
            "t.Calibrator, t.MarkDebug, t.SetLayerPrecisions; import polygraphy.cuda; "
            "assert 'tensorrt' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@no_tensorrt
def test_every_entry_point_names_what_to_install(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(small_model(), path)
    feeder = CalibrationFeeder(None, tmp_path / "c.cache", [])
    entry_points = [
        require_tensorrt,
        trt_backend.installed_version,
        lambda: TensorRTBackend(path),
        lambda: TensorRTBackend(engine=tmp_path / "model.plan"),
        lambda: build_engine(path),
        lambda: make_engine_backend("tensorrt", path),
        lambda: make_engine_backend("tensorrt", tmp_path / "model.plan"),
        lambda: make_calibrator(feeder),
    ]
    for call in entry_points:
        with pytest.raises(BackendUnavailableError, match=r"install quantlab\[tensorrt\] on a "
                                                          r"machine with an NVIDIA GPU"):
            call()


def test_make_engine_backend_onnxruntime_runs(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(small_model(), path)
    backend = make_engine_backend("onnxruntime", path)
    x = np.linspace(-1, 1, 2 * 3 * 2 * 4, dtype=np.float32).reshape(2, 3, 2, 4)
    np.testing.assert_array_equal(backend.run({"x": x})["y"], np.maximum(x, 0))
    assert backend.name == "engine_int8"
    with pytest.raises(ConfigError, match="neither 'onnxruntime' nor 'tensorrt'"):
        make_engine_backend("tflite", path)


# --- version ranges ---------------------------------------------------------------------------

def test_parse_version():
    assert parse_version("10.3.0.26") == (10, 3, 0)
    assert parse_version("8.6.1") == (8, 6, 1)
    assert parse_version("11.1") == (11, 1, 0)
    with pytest.raises(ConfigError, match="not a dotted version"):
        parse_version("ten")


def test_build_modes_per_version():
    assert default_mode((8, 6, 1)) == "implicit"
    assert default_mode((10, 0, 0)) == default_mode((11, 1, 0)) == "strongly_typed"
    check_mode("implicit", (8, 6, 1))
    check_mode("implicit", (10, 16, 0))
    check_mode("strongly_typed", (9, 0, 0))
    with pytest.raises(ConfigError, match="removed in TensorRT 11.0"):
        check_mode("implicit", (11, 0, 0))
    with pytest.raises(ConfigError, match="no strongly typed networks"):
        check_mode("strongly_typed", (8, 6, 1))
    with pytest.raises(ConfigError, match="neither"):
        check_mode("weak", (10, 0, 0))


def test_debug_tensors_per_version():
    check_debug_tensors(None, (8, 6, 1))
    check_debug_tensors(["a"], (10, 0, 0))
    check_debug_tensors("unfused", (10, 12, 0))
    with pytest.raises(ConfigError, match="added in 10.12"):
        check_debug_tensors("unfused", (10, 11, 0))
    with pytest.raises(ConfigError, match="arrived in 10.0"):
        check_debug_tensors(["a"], (8, 6, 1))


def test_layer_precisions_checked():
    assert layer_precisions_for({"conv": "FP16", "fc": "int8"}, (10, 3, 0)) == {
        "conv": "fp16", "fc": "int8"}
    with pytest.raises(ConfigError, match="layer precisions are fp32, fp16, int8"):
        layer_precisions_for({"conv": "bf16"}, (10, 3, 0))
    with pytest.raises(ConfigError, match="removed in TensorRT 11.0"):
        layer_precisions_for({"conv": "fp32"}, (11, 0, 0))


def test_input_profile():
    assert input_profile(small_model(), max_batch=8) == {
        "x": ((1, 3, 2, 4), (8, 3, 2, 4), (8, 3, 2, 4))}
    assert input_profile(small_model(batch=1), max_batch=8) == {
        "x": ((1, 3, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4))}
    with pytest.raises(ConfigError, match="dynamic dimensions"):
        input_profile(small_model(extra_dynamic=True), max_batch=4)
    shapes = {"x": [(1, 3, 8, 4), (2, 3, 16, 4), (4, 3, 32, 4)]}
    assert input_profile(small_model(extra_dynamic=True), 4, shapes)["x"][2] == (4, 3, 32, 4)


# --- the calibrator's callbacks, driven directly ------------------------------------------------

SPECS = [TensorSpec("x", (None, 3, 2, 4), np.dtype(np.float32))]


def calibration_source(num_samples: int, batch_size: int, dtype=np.float32):
    data = np.arange(num_samples * 24, dtype=dtype).reshape(num_samples, 3, 2, 4)
    return data, open_data(data, SPECS, batch_size=batch_size)


def test_feeder_hands_every_full_batch_then_none(tmp_path):
    data, source = calibration_source(10, 4)
    feeder = CalibrationFeeder(source, tmp_path / "c.cache", SPECS, batch=4)
    assert feeder.get_batch_size() == 1
    first, second = feeder.get_batch(["x"]), feeder.get_batch(["x"])
    np.testing.assert_array_equal(first[0], data[:4])
    np.testing.assert_array_equal(second[0], data[4:8])
    # The short last batch (2 samples) is not at the calibration shape: skipped, counted.
    assert feeder.get_batch(["x"]) is None
    assert (feeder.used_batches, feeder.skipped_samples) == (2, 2)
    feeder.reset()
    np.testing.assert_array_equal(feeder.get_batch(["x"])[0], data[:4])


def test_feeder_allocates_in_the_order_of_names(tmp_path):
    specs = [TensorSpec("a", (None, 2), np.dtype(np.float32)),
             TensorSpec("ids", (None, 2), np.dtype(np.int64))]
    arrays = {"a": np.ones((3, 2), np.float64), "ids": np.arange(6).reshape(3, 2)}
    source = open_data(arrays, specs, batch_size=3)
    calls = []

    def allocate(name, array):
        calls.append((name, array.dtype, array.flags["C_CONTIGUOUS"]))
        return 1000 + len(calls)

    feeder = CalibrationFeeder(source, tmp_path / "c.cache", specs, batch=3, allocate=allocate)
    assert feeder.get_batch(["ids", "a"]) == [1001, 1002]
    # TensorRT calibrates from float32 inputs; integer inputs keep the model's type.
    assert calls == [("ids", np.dtype(np.int64), True), ("a", np.dtype(np.float32), True)]


def test_feeder_without_batches_reads_the_cache_only(tmp_path):
    feeder = CalibrationFeeder(None, tmp_path / "c.cache", SPECS)
    assert feeder.get_batch(["x"]) is None
    assert feeder.read_calibration_cache() is None


def test_cache_callbacks_round_trip(tmp_path):
    path = tmp_path / "calibration.cache"
    feeder = CalibrationFeeder(None, path, SPECS, algorithm="EntropyCalibration2",
                               trt_version="8.6.1")
    written = b"TRT-8601-EntropyCalibration2\nx: 3c010a14\ny: 3d0b7086\n"
    feeder.write_calibration_cache(memoryview(written))
    assert path.read_bytes() == written
    assert feeder.read_calibration_cache() == written
    assert feeder.check_cache() == {"x": cache.hex_to_scale("3c010a14"),
                                    "y": cache.hex_to_scale("3d0b7086")}
    with pytest.raises(DataError, match="not '<tensor name>: <8 hex digits>'"):
        feeder.write_calibration_cache(b"TRT-8601-EntropyCalibration2\nx 3c010a14\n")
    assert path.read_bytes() == written


def test_check_cache_refuses_what_tensorrt_would_ignore(tmp_path):
    path = tmp_path / "calibration.cache"
    cache.write_calibration_cache(path, {"x": 0.01}, "MinMaxCalibration", trt_version="8.6.1")
    with pytest.raises(ConfigError, match="Pass algorithm=.MinMaxCalibration."):
        CalibrationFeeder(None, path, SPECS, algorithm="EntropyCalibration2").check_cache()
    with pytest.raises(ConfigError, match="--trt-version 10.3.0"):
        CalibrationFeeder(None, path, SPECS, algorithm="MinMaxCalibration",
                          trt_version="10.3.0").check_cache()
    assert CalibrationFeeder(None, path, SPECS, algorithm="MinMaxCalibration",
                             trt_version="8.6.1").check_cache()["x"] == np.float32(0.01)
    with pytest.raises(ConfigError, match="quantlab can drive"):
        CalibrationFeeder(None, path, SPECS, algorithm="LegacyCalibration")


# --- with TensorRT (skipped where it is missing: CI and every machine this project runs on) ----

@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A calibration folder of the zoo's digits-cnn (entropy: its cache drives TensorRT's
    IInt8EntropyCalibrator2 as written)."""
    pytest.importorskip("tensorrt", reason=NEEDS_TENSORRT)
    from quantlab import pipeline

    folder = tmp_path_factory.mktemp("digits") / "run"
    pipeline.run_calibration("digits-cnn", "calibration_data/digits/calibration.npy", folder,
                             method="entropy", progress=False,
                             trt_version=".".join(map(str, trt_backend.installed_version())))
    return folder


def test_strongly_typed_engine_matches_onnxruntime_int8(digits_run):
    version = trt_backend.installed_version()
    if version < (10, 12):
        pytest.skip("unfused debug tensors need TensorRT >= 10.12")
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend

    model = digits_run / "model.int8.onnx"
    reference = OnnxRuntimeBackend(model)
    batch = {reference.inputs[0].name: np.load("calibration_data/digits/calibration.npy")[:1]}
    engine = make_engine_backend("tensorrt", model, debug_tensors="unfused")
    name = reference.outputs[0]
    got, want = engine.run(batch)[name], reference.run(batch)[name]
    assert np.argmax(got) == np.argmax(want)


def test_implicit_engine_from_the_calibration_cache(digits_run):
    version = trt_backend.installed_version()
    if version >= (11, 0):
        pytest.skip("implicit INT8 was removed in TensorRT 11.0")
    from quantlab import graph

    specs = graph.input_specs(graph.load_model(digits_run / "model.onnx"))
    feeder = CalibrationFeeder(None, digits_run / "calibration.cache", specs,
                               algorithm="EntropyCalibration2",
                               trt_version=".".join(map(str, version)))
    engine = build_engine(digits_run / "model.onnx", mode="implicit",
                          calibrator=make_calibrator(feeder))
    assert engine and feeder.used_batches == 0


# --- a calibration cache TensorRT <= 10 can use whole ------------------------------------------

def test_ranges_listed_are_float_inputs_and_node_outputs():
    from quantlab import trt_ranges

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Shape", ["r"], ["s"], name="shape"),  # int64: no range
             helper.make_node("Reshape", ["r", "s"], ["y"], name="reshape")]
    model = onnx.shape_inference.infer_shapes(helper.make_model(
        helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]))
    assert trt_ranges.tensors_needing_ranges(model) == ["x", "r", "y"]
    assert trt_ranges.missing_ranges(model, {"x": 0.1, "r": 0.0}) == ["r", "y"]


@pytest.mark.parametrize("name", [
    "digits-cnn", "digits-vit", pytest.param("shapes-det", marks=pytest.mark.slow)])
def test_zoo_cache_has_every_range_tensorrt_needs(name, tmp_path):
    # calibration.cache must hold a range for every float network tensor (layer outputs
    # included) and model.int8.onnx must be the Q/DQ model of the Q/DQ inputs' statistics.
    from quantlab import calibrate, collect, pipeline, qdq, trt_ranges, zoo

    data = zoo.get(name).calibration_set()[:16]
    result = pipeline.run_calibration(name, data, tmp_path / "run", batch_size=8,
                                      progress=False)
    _, scales = cache.read_calibration_cache(tmp_path / "run" / "calibration.cache")
    model = result.model
    assert trt_ranges.missing_ranges(model, scales) == []
    placed = qdq.activation_tensors_to_calibrate(model)
    assert len(trt_ranges.tensors_needing_ranges(model)) > len(placed)
    only_qdq = calibrate.calibrate(collect.collect(model, result.data, placed, progress=False),
                                   result.scales.method, **result.scales.params)
    expected = qdq.quantize_model(model, only_qdq.amax)
    assert expected.SerializeToString() == result.qdq_model.SerializeToString()
