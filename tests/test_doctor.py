"""quantlab doctor: what runs without TensorRT is tested here (the path list per version, the
answers to the four open questions from recorded values, the ConvTranspose variants in ONNX
Runtime, the report); the self-check itself needs TensorRT and says so."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from onnx import helper

from quantlab import doctor
from quantlab.backends.onnxruntime import OnnxRuntimeBackend

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_doctor_without_tensorrt_says_what_to_install(tmp_path, capsys):
    from quantlab.cli import main

    assert main(["doctor", "--out", str(tmp_path / "doctor")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("quantlab doctor: error: the TensorRT backend needs the `tensorrt`")
    assert "install quantlab[tensorrt]" in err and "https://pypi.nvidia.com" in err
    assert not (tmp_path / "doctor").exists()


def test_help_lists_doctor_without_importing_tensorrt_or_polygraphy():
    code = ("import sys; from quantlab.cli import build_parser; "
            "text = build_parser().format_help(); assert 'doctor' in text; "
            "assert not {'tensorrt', 'polygraphy', 'torch'} & set(sys.modules), sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("version, trtexec, paths", [
    ((8, 6, 1), True, ["explicit", "implicit_calibrator", "implicit_trtexec", "implicit_pins"]),
    ((10, 3, 0), False, ["strongly_typed", "explicit", "implicit_calibrator", "implicit_pins"]),
    ((10, 16, 0), True, ["strongly_typed", "explicit", "implicit_calibrator",
                         "implicit_trtexec", "implicit_pins"]),
    ((11, 1, 0), True, ["strongly_typed"]),
])
def test_paths_checked_per_version(version, trtexec, paths):
    assert doctor.supported_paths(version, trtexec) == paths


def test_gemm_ranges_answer():
    needed = ["x", "/fc/Gemm_output_0"]
    trt = {"x": 0.1, "/fc/Gemm_output_0": 0.2, "(Unnamed Layer* 8) [Constant]_output": 0.01}
    answer = doctor.gemm_ranges_answer(trt, needed, {"/fc/Gemm": ["int8", "fp32"]})
    assert answer["tensorrt_only_ranges"] == ["(Unnamed Layer* 8) [Constant]_output"]
    assert answer["gemm_out_of_int8"] == {"/fc/Gemm": ["int8", "fp32"]}
    assert answer["answer"].startswith("1 Gemm node(s) leave INT8")
    assert doctor.gemm_ranges_answer(trt, needed, {"/fc/Gemm": ["int8"]})["answer"] == (
        "every Gemm runs INT8 from quantlab's cache")


def test_cache_answers():
    assert doctor.cache_rewrite_answer(1, 0)["answer"] == (
        "TensorRT does not write back a cache it read")
    assert doctor.cache_rewrite_answer(1, 1)["answer"].startswith("TensorRT wrote back")
    assert doctor.cache_rewrite_answer(0, 1)["answer"] == "TensorRT did not read the cache"
    same = doctor.cache_header_answer("TRT-100300-EntropyCalibration2", (10, 3, 0))
    assert same["answer"] == "same header"
    other = doctor.cache_header_answer("TRT-10300-EntropyCalibration2", (10, 3, 0))
    assert other["answer"] == "differs: TensorRT writes TRT-10300, quantlab TRT-100300"


def test_conv_transpose_variants_run_in_onnxruntime():
    # Question 3's models: the same ConvTranspose with per-tensor, axis-0 and axis-1 weight
    # scales; each is a valid Q/DQ model and computes (nearly) the same function.
    models = doctor.conv_transpose_models()
    x = {"x": np.random.default_rng(1).uniform(-3, 3, (1, 4, 8, 8)).astype(np.float32)}
    outputs = {}
    for name, model in models.items():
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"
              and any(n.output[0] == m.input[1] for m in model.graph.node
                      if m.op_type == "ConvTranspose")]
        assert len(dq) == 1
        axis = next((helper.get_attribute_value(a) for a in dq[0].attribute if a.name == "axis"),
                    None)
        assert axis == {"per_tensor": None, "axis0": 0, "axis1": 1}[name]
        outputs[name] = OnnxRuntimeBackend(model).run(x)["y"]
    assert outputs["per_tensor"].shape == (1, 3, 16, 16)
    scale = np.abs(outputs["axis1"]).max()
    for name in ("per_tensor", "axis0"):
        assert np.abs(outputs[name] - outputs["axis1"]).max() < 0.1 * scale
    answer = doctor.conv_transpose_answer({"per_tensor": 45.0, "axis0": 44.0,
                                           "axis1": "build failed: ..."})
    assert answer["agree"] == ["per_tensor", "axis0"]


def test_report_markdown():
    report = {"quantlab": "0.1", "tensorrt": "10.3.0", "polygraphy": "0.49.26", "gpu": "L4",
              "trtexec": None, "ok": False,
              "paths": [{"model": "digits-cnn", "path": "strongly_typed", "status": "ok",
                         "worst_output_sqnr_db": 41.5, "obtained": {"debug_marked": 7,
                                                             "graph_output": 1},
                         "not_exposed": ["a", "b"]},
                        {"model": "digits-cnn", "path": "explicit", "status": "failed",
                         "detail": "ModelError: no"}],
              "questions": {"gemm_ranges": {"digits-cnn": {"answer": "no Gemm in this model"}},
                            "cache_header": {"answer": "same header"}}}
    text = doctor.format_report(report)
    assert "| digits-cnn | strongly_typed | ok | 41.5 | debug_marked 7, graph_output 1 | 2 |" \
        in text
    assert "| digits-cnn | explicit | failed |  |  | 0 | ModelError: no |" in text
    assert "- **gemm_ranges** (digits-cnn): no Gemm in this model" in text
    assert "- **cache_header**: same header" in text
    assert "trtexec not on PATH" in text


def test_comparison_against_onnxruntime_int8_runs_through_validate(tmp_path):
    # The doctor's comparison (ONNX Runtime's INT8 model as the reference stage, layer table and
    # end to end) on a second ONNX Runtime session of the same model, named for what it is: the
    # plumbing the TensorRT engines go through, which must find no difference here.
    from quantlab import graph, pipeline, zoo

    folder = tmp_path / "digits-cnn"
    pipeline.run_calibration("digits-cnn", zoo.get("digits-cnn").calibration_set()[:64], folder,
                             progress=False)
    same = OnnxRuntimeBackend(graph.load_model(folder / "model.int8.onnx"), name="onnxruntime")
    row = doctor._compare("digits-cnn", folder, same, "onnxruntime", 16)
    assert row["worst_output_sqnr_db"] == np.inf and row["first_divergence"] is None
    assert row["metrics"]["onnxruntime_int8"] == row["metrics"]["onnxruntime"]
    assert (folder / "doctor-onnxruntime" / "report.html").is_file()
