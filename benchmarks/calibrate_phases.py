"""`quantlab calibrate`'s defaults phase by phase, its held-out output SQNR, and ORT MinMax.

One configuration per process, so ``farm-bench --vs`` can pair them:

    python benchmarks/calibrate_phases.py quantlab MODEL CALIB.npy VAL.npy [--root TREE]
        [--weight-rounding gptq]
    python benchmarks/calibrate_phases.py ort MODEL CALIB.npy
    VENV/bin/python benchmarks/calibrate_phases.py modelopt MODEL CALIB.npy VAL.npy --keep DIR
    python benchmarks/calibrate_phases.py score DIR/fp32.onnx DIR/int8.onnx VAL.npy --metric M

``quantlab`` runs ``pipeline.run_calibration`` with the defaults of the tree `--root`
(default: this one; an older tree records no phases, and is timed as a whole) and prints
one JSON line: wall seconds, each phase's seconds / samples / model runs, and the output
SQNR (dB, float64, pooled over VAL's samples; the worst output) of its Q/DQ model against
the FP32 model it normalized. ``ort`` runs ``quantize_static`` MinMax configured as
benchmarks/default_method.py does (QDQ, symmetric int8, per-channel) and prints its wall;
``modelopt`` ModelOpt's ONNX PTQ with its default calibrator (high-precision FP32), its wall
and held-out SQNR.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """10 log10(|r|^2 / |t - r|^2), float64."""
    reference = reference.astype(np.float64)
    noise = float(np.sum((test.astype(np.float64) - reference) ** 2))
    return float(10 * np.log10(float(np.sum(reference ** 2)) / max(noise, 1e-300)))


def metric_function(spec: str):
    """The function ``module:function`` names (quantlab's one-function ``--metric`` form:
    lists of batches, candidate then FP32), importable from this tree's root."""
    import importlib

    module, function = spec.split(":")
    sys.path.insert(0, str(ROOT))
    return getattr(importlib.import_module(module), function)


def output_scores(references: list[list[np.ndarray]], outputs: list[list[np.ndarray]],
                  names: list[str], metric: str | None = None) -> tuple[float, float | None]:
    """The worst output's SQNR (dB, float64, pooled over the runs) of `outputs` against
    `references` (per run, the outputs `names` lists, in order), and with `metric`
    (``module:function``, :func:`metric_function`) its score, else None."""
    worst = min(sqnr_db(np.concatenate([run[k].ravel() for run in references]),
                        np.concatenate([run[k].ravel() for run in outputs]))
                for k in range(len(names)))
    if not metric:
        return worst, None
    batches = [[dict(zip(names, run, strict=True)) for run in runs]
               for runs in (outputs, references)]
    return worst, float(metric_function(metric)(*batches))


def held_out(fp32: bytes | str, int8: bytes | str, val: str, metric: str | None = None
             ) -> dict:
    """The worst output's SQNR (dB, float64, pooled over VAL's samples) of `int8` against
    `fp32` (serialized models or paths), run one sample at a time in ONNX Runtime, and with
    `metric` (``module:function``, quantlab's one-function ``--metric`` form: lists of
    batches, candidate then FP32) its score."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdqisint8allowed", "1")
    sessions = [ort.InferenceSession(m, options, providers=["CPUExecutionProvider"])
                for m in (fp32, int8)]
    name = sessions[0].get_inputs()[0].name
    names = [o.name for o in sessions[0].get_outputs()]
    runs = [[s.run(None, {name: sample[None]}) for s in sessions] for sample in np.load(val)]
    worst, score = output_scores([r for r, _ in runs], [t for _, t in runs], names, metric)
    found = {"sqnr_db": round(worst, 3)}
    if metric:
        found[metric] = round(score, 4)
    return found


def run_quantlab(model: str, calib: str, val: str, root: Path, metric: str | None = None,
                 keep: Path | None = None, weight_rounding: str | None = None) -> dict:
    """Calibrate with the tree's defaults (or `weight_rounding`); time it, read its phases,
    score it held out."""
    sys.path.insert(0, str(root))
    from quantlab.calibration import pipeline

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        options = {"weight_rounding": weight_rounding} if weight_rounding else {}
        result = pipeline.run_calibration(model, calib, Path(out) / "run", progress=False,
                                          **options)
        wall = time.perf_counter() - start
    scores = held_out(result.model.SerializeToString(), result.qdq_model.SerializeToString(),
                      val, metric)
    if keep:
        import onnx

        keep.mkdir(parents=True, exist_ok=True)
        onnx.save(result.model, str(keep / "fp32.onnx"))
        onnx.save(result.qdq_model, str(keep / "int8.onnx"))
    summary = result.repairs.get("bias_correction", {}).get("summary", {})
    return {"tree": str(root), "wall_s": round(wall, 1), **scores,
            "phases": getattr(result, "phases", None), "bias_kept": summary.get("kept"),
            "folds": summary.get("folds")}


def run_ort(model: str, calib: str) -> dict:
    """quantize_static MinMax on `model` (as default_method.py's child_ort), timed."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    data = np.load(calib)
    name = onnx.load(model).graph.input[0].name

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter(data)

        def get_next(self):
            sample = next(self.samples, None)
            return None if sample is None else {name: sample[None]}

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        quantize_static(model, str(Path(out) / "ort.int8.onnx"), Reader(),
                        quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax,
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
        return {"tool": "ort-MinMax", "wall_s": round(time.perf_counter() - start, 1)}


def run_modelopt(model: str, calib: str, val: str, keep: Path | None = None) -> dict:
    """ModelOpt's ONNX PTQ (int8, its default calibrator, high_precision_dtype fp32) on the
    CPU, as benchmarks/default_method.py's child_modelopt; timed, scored held out against
    the model given (SQNR only: a metric's imports need not be in ModelOpt's environment;
    `keep` saves the two models for ``score``). Run it with the interpreter of a virtual
    environment that holds nvidia-modelopt[onnx] (it pins its own onnx and onnxruntime)."""
    import modelopt
    from modelopt.onnx.quantization import quantize

    sys.path.insert(0, str(ROOT))
    from benchmarks.default_method import named_dynamic_dims

    with tempfile.TemporaryDirectory() as out:
        fp32 = named_dynamic_dims(Path(model), Path(out) / "fp32.onnx")
        os.chdir(out)  # ModelOpt leaves shape-inference files in the working folder
        start = time.perf_counter()
        quantize(str(fp32), quantize_mode="int8", calibration_data=np.load(calib),
                 calibration_eps=["cpu"], high_precision_dtype="fp32", log_level="WARNING",
                 output_path=str(Path(out) / "int8.onnx"))
        wall = time.perf_counter() - start
        scores = held_out(str(fp32), str(Path(out) / "int8.onnx"), val)
        if keep:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(fp32, keep / "fp32.onnx")
            shutil.copy(Path(out) / "int8.onnx", keep / "int8.onnx")
    return {"tool": f"modelopt-{modelopt.__version__}", "wall_s": round(wall, 1), **scores}


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run one configuration, print its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="tool", required=True)
    mine = sub.add_parser("quantlab")
    mine.add_argument("--root", type=Path, default=ROOT, help="the quantlab tree to measure")
    mine.add_argument("--metric", help="module:function scored held out beside the SQNR")
    mine.add_argument("--weight-rounding", help="calibrate's --weight-rounding (default: the "
                      "tree's)")
    theirs = sub.add_parser("ort")
    peer = sub.add_parser("modelopt")
    score = sub.add_parser("score", help="score kept models (FP32 = MODEL, INT8 = CALIB)")
    score.add_argument("--metric", help="module:function scored held out beside the SQNR")
    for tool in (mine, theirs, peer, score):
        tool.add_argument("model")
        tool.add_argument("calib")
        if tool is not theirs:
            tool.add_argument("val")
        if tool in (mine, peer):
            tool.add_argument("--keep", type=Path, help="save fp32.onnx and int8.onnx here")
    args = parser.parse_args(argv)
    if args.tool == "quantlab":
        found = run_quantlab(args.model, args.calib, args.val, args.root, args.metric,
                             args.keep, args.weight_rounding)
    elif args.tool == "modelopt":
        found = run_modelopt(args.model, args.calib, args.val, args.keep)
    elif args.tool == "score":
        found = held_out(args.model, args.calib, args.val, args.metric)
    else:
        found = run_ort(args.model, args.calib)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
