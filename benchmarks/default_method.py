"""Which calibrator should `quantlab calibrate` use by default? Measured, model by model.

For every model (the zoo: shapes-det, digits-cnn, digits-vit; the real models of
tests/realmodels.py: orientation, onet, vad, layout), on the same calibration data:

- quantlab: ONE collection of statistics (``pipeline.run_calibration`` with the first
  method), then each of entropy, max, percentile, mse (and ``auto``, the per-layer choice,
  where the tree has it) as ``quantlab calibrate --method M`` finishes it in that tree:
  ``pipeline.calibrate_from_stats`` with ``run_calibration``'s own defaults (since issue 19
  the weight amax by layer error and bias correction; before it, ``quantize_model`` with
  max |w|);
- peers (``--peers``), each on the FP32 model as quantlab normalizes it (Constant weights
  and, where the tree does, BatchNorm folded), before quantlab's repairs (depthwise-input
  equalization):
  - ONNX Runtime: ``quantize_static`` MinMax, configured as benchmarks/calibration.py does
    (QDQ, int8 activations and weights, ActivationSymmetric/WeightSymmetric, per-channel);
  - NVIDIA ModelOpt: ``modelopt.onnx.quantization.quantize`` int8, calibration_method entropy
    and max, each with high_precision_dtype fp32 and with its default (fp16), calibrated on
    the CPU (``calibration_eps=["cpu"]``), from another interpreter (``--modelopt-python``:
    nvidia-modelopt[onnx] pins its own onnx and onnxruntime-gpu).

Each tool (each ModelOpt configuration) runs in its own child process (peak RSS = the
child's VmHWM, as in benchmarks/calibration.py). ``--quantlab-root`` picks the quantlab tree
to measure (default: this script's), so one script measures a tree before and after a change
on the same data (``data_sha1`` in the results); ``--compare BEFORE AFTER`` prints the
before/after table of two result files. The INT8 models are then scored on held-out data in this
process with ONNX Runtime (session option ``session.qdqisint8allowed=1``, as quantlab's
validation runs Q/DQ models): the task metric where labels exist (zoo: mAP / top-1;
orientation: top-1 on its rotation labels), output SQNR vs FP32 in dB (float64, the worst
output) and an agreement figure (argmax / thresholded decisions / confident anchors).

    python benchmarks/default_method.py                       # every model
    python benchmarks/default_method.py --models digits-cnn orientation --quick
    python benchmarks/default_method.py --quantlab-root ../wt-base --peers    # quantlab only
    python benchmarks/default_method.py --compare BEFORE.json AFTER.json

Prints one table per model and the verdict; writes benchmarks/results/default_method-<date>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the quantlab tree measured unless --quantlab-root names another
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness as bench  # noqa: E402  (peak_rss, timed, run_child: the measurement rules)

QUANTLAB_METHODS = ["entropy", "max", "percentile", "mse"]  # + "auto" where the tree has it
AUTO = "auto"
ORT = "ort-MinMax"
PEERS = ("ort", "modelopt")
# NVIDIA ModelOpt's ONNX PTQ (modelopt.onnx.quantization.quantize, int8), one child each:
# label -> (calibration_method, high_precision_dtype). None = ModelOpt's default (fp16 in
# 0.47: everything left unquantized is cast to FP16); the child records the value it had.
MODELOPT = {"modelopt-entropy": ("entropy", "fp32"), "modelopt-max": ("max", "fp32"),
            "modelopt-entropy-fp16": ("entropy", None), "modelopt-max-fp16": ("max", None)}
ZOO = ("shapes-det", "digits-cnn", "digits-vit")
REAL = ("orientation", "onet", "vad", "layout")
MODELS = (*ZOO, *REAL)
# (calibration samples, held-out samples); zoo: None = the whole split.
SIZES = {"orientation": (64, 64), "onet": (64, 64), "vad": (64, 64), "layout": (16, 8)}
QUICK_SIZES = {"orientation": (32, 16), "onet": (32, 16), "vad": (32, 16), "layout": (8, 4)}
ZOO_QUICK_EVAL = 200
SIZE_OVERRIDES: dict[str, tuple[int, int]] = {}  # --size NAME CALIB VAL
# Differences smaller than this are noise: SQNR 0.2 dB; top-1 one sample of the held-out
# split; mAP 0.005 (the zoo detector's mAP moves by ~0.002 between identical runs on
# different machines, benchmarks/README.md).
SQNR_NOISE_DB = 0.2
MAP_NOISE = 0.005
LAYOUT_SCORE_THRESHOLD = 0.4
RESULTS_DIR = HERE / "results"


@dataclass
class Subject:
    """One model ready to benchmark: FP32 file, calibration/held-out files, how to score."""

    name: str
    model: Path
    calib: Path  # .npy or .npz, as `quantlab calibrate --data` takes it
    val: Path
    batch_size: int = 32
    sample_axes: dict[str, int] = field(default_factory=dict)  # default 0; 0-d arrays: none
    output_axes: dict[str, int] = field(default_factory=dict)  # sample axis of outputs
    labels: np.ndarray | None = None
    metric: str = "sqnr"  # "top1" | "map" | "sqnr": the figure the verdict compares
    eval_set: object = None  # zoo: its EvalSet (labels, COCO ground truth)


# --------------------------------------------------------------------- data and models


def prepare(name: str, folder: Path, quick: bool) -> Subject:
    """Write the subject's model and data into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    if name in ZOO:
        from quantlab import zoo
        from quantlab.calibration import pipeline

        entry = zoo.get(name)
        model = folder / "model.onnx"
        if not model.is_file():
            pipeline.export_zoo_model(name, model)
        eval_set = entry.eval_set(ZOO_QUICK_EVAL if quick else None)
        np.save(folder / "calib.npy", entry.calibration_set())
        np.save(folder / "val.npy", eval_set.inputs)
        return Subject(name, model, folder / "calib.npy", folder / "val.npy",
                       labels=eval_set.labels, eval_set=eval_set,
                       metric="map" if entry.task == "detection" else "top1")
    from tests import realmodels

    n_calib, n_val = SIZE_OVERRIDES.get(name) or (QUICK_SIZES if quick else SIZES)[name]
    data = realmodels.GENERATORS[name](folder / "data", n_calib=n_calib, n_val=n_val)
    if name == "onet":
        model = realmodels.export_onet(folder / "models")["quantlab"]
    else:
        model = realmodels.fetch(names=(name,))[name]
    if name == "vad":
        return Subject(name, model, data["calib_npz"], data["val_npz"],
                       sample_axes={"state": 1}, output_axes={"stateN": 1})
    if name == "orientation":
        return Subject(name, model, data["calib_npy"], data["val_npy"],
                       labels=np.load(data["val_labels"]), metric="top1")
    return Subject(name, model, data["calib_npy"], data["val_npy"],
                   batch_size=1 if name == "layout" else 32)


def load_arrays(path: Path, input_names: list[str]) -> dict[str, np.ndarray]:
    """{input name: array} of a .npy (single input) or .npz file."""
    if path.suffix == ".npz":
        with np.load(path) as archive:
            return {key: archive[key] for key in archive.files}
    return {input_names[0]: np.load(path)}


def batches(arrays: Mapping[str, np.ndarray], axes: Mapping[str, int], size: int):
    """Batches of `size` samples, each input sliced on its own sample axis (0-d: as is)."""
    name = next(n for n, a in arrays.items() if np.ndim(a))
    count = arrays[name].shape[axes.get(name, 0)]
    for start in range(0, count, size):
        yield {name: (a if np.ndim(a) == 0 else
                      np.take(a, range(start, min(start + size, count)), axis=axes.get(name, 0)))
               for name, a in arrays.items()}


def use_quantlab(root: str | Path) -> None:
    """Import `quantlab` and the real-model suite (tests/realmodels.py) from the tree `root`."""
    sys.path.insert(0, str(Path(root).resolve()))


def sha1(path: Path) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


def calibration_reader(spec: Mapping):
    """The calibration batches as ONNX Runtime's CalibrationDataReader (get_next), with the
    get_first and rewind ModelOpt also calls; inputs the normalized model froze are left out."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader

    model = onnx.load(spec["model"], load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    arrays = load_arrays(Path(spec["calib"]), names)
    arrays = {n: arrays[n] for n in names}

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.rewind()

        def get_next(self):
            return next(self._it, None)

        def get_first(self):
            return next(batches(arrays, spec["sample_axes"], spec["batch_size"]))

        def rewind(self):
            self._it = batches(arrays, spec["sample_axes"], spec["batch_size"])

    return Reader()


# ---------------------------------------------------------------------------- children


def child_quantlab(spec: Mapping) -> dict:
    """Collect once, then each method as `quantlab calibrate --method M` finishes it in this
    tree (``pipeline.calibrate_from_stats`` with ``run_calibration``'s own defaults: after
    issue 19 the weight amax by layer error and bias correction); write <method>.int8.onnx,
    and the normalized FP32 model before any repair (fp32.onnx: the peers' input and the
    reference)."""
    import inspect

    import quantlab
    from quantlab import graph
    from quantlab.calibration import collect, pipeline

    out = Path(spec["out"])
    methods = spec["methods"]
    defaults = {name: parameter.default for name, parameter
                in inspect.signature(pipeline.run_calibration).parameters.items()
                if name in ("weight_criterion", "bias_correction")}
    stages: dict[str, float] = {}
    start = time.perf_counter()
    with bench.timed(collect, "collect", stages), \
            bench.timed(pipeline, "calibrate_from_stats", stages):
        result = pipeline.run_calibration(spec["model"], spec["calib"], out / "run",
                                          method=methods[0], batch_size=spec["batch_size"],
                                          progress=False, force=True)
    first_wall = time.perf_counter() - start
    graph.save_model(result.qdq_model, out / f"{methods[0]}.int8.onnx")
    own = {methods[0]: stages["calibrate_from_stats"]}
    for method in methods[1:]:
        begin = time.perf_counter()
        calibrated = pipeline.calibrate_from_stats(result.model, result.stats, result.data,
                                                   method, **defaults)
        graph.save_model(calibrated.qdq_model, out / f"{method}.int8.onnx")
        own[method] = time.perf_counter() - begin
    # A user running `quantlab calibrate --method M` pays: loading + collection (+ the
    # equalization pass) + M's own thresholds, choices, Q/DQ insertion and bias correction.
    common = first_wall - stages["calibrate_from_stats"]
    # The FP32 model as quantlab normalizes it (BatchNorm folded where the tree does), before
    # its repairs (the tree after 9232738 equalizes depthwise inputs in run_calibration).
    graph.save_model(pipeline.prepare_model(spec["model"], spec["calib"]), out / "fp32.onnx")
    repairs = getattr(result, "repairs", {})  # absent before the repairs existed (9232738)
    return {"collect_s": stages["collect"], "common_s": common,
            "wall_s": {m: common + own[m] for m in methods}, "own_s": own,
            "fp32_model": str(out / "fp32.onnx"), "quantlab": quantlab.__file__,
            "calibrate_defaults": defaults,
            "repairs": {name: {k: len(v) for k, v in report.items() if isinstance(v, list)}
                        for name, report in repairs.items()}}


def child_ort(spec: Mapping) -> dict:
    """``quantize_static`` MinMax on the given FP32 model, as benchmarks/calibration.py."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    reader = calibration_reader(spec)
    start = time.perf_counter()
    quantize_static(spec["model"], str(Path(spec["out"]) / f"{ORT}.int8.onnx"), reader,
                    quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax,
                    # MinMax keeps only per-batch ReduceMin/ReduceMax values, never whole
                    # activations. (Do not set CalibMaxIntermediateOutputs: in ORT 1.32 MinMax
                    # then drops the collected batches, "No data is collected.")
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    return {"wall_s": {ORT: time.perf_counter() - start}}


def named_dynamic_dims(model_path: Path, copy: Path) -> Path:
    """`model_path`, or a copy of it whose input dimensions that have neither a size nor a
    name are named: ModelOpt 0.47 compares every input dimension with 0
    (``get_dynamic_graph_inputs``) and fails on such a dimension (vad's input and state),
    as on a size of -1 (Paddle's "any": the PP-OCR detector's batch)."""
    import onnx

    model = onnx.load(str(model_path))
    dims = [d for i in model.graph.input for d in i.type.tensor_type.shape.dim
            if (not d.HasField("dim_value") or d.dim_value < 0) and not d.HasField("dim_param")]
    if not dims:
        return model_path
    for k, dim in enumerate(dims):
        dim.dim_param = f"unnamed_{k}"
    onnx.save(model, str(copy))
    return copy


def child_modelopt(spec: Mapping) -> dict:
    """ModelOpt's ONNX PTQ, int8, on the given FP32 model, calibrated on the CPU."""
    import inspect

    import modelopt
    from modelopt.onnx.quantization import quantize

    label = spec["label"]
    method, dtype = MODELOPT[label]
    reader = calibration_reader(spec)
    model = named_dynamic_dims(Path(spec["model"]), Path(spec["out"]) / f"{label}.fp32.onnx")
    # ModelOpt and ORT's shape inference leave files in the working folder (vad: a .data file
    # per run and sym_shape_infer_temp.onnx): keep them in the run's folder.
    os.chdir(spec["out"])
    start = time.perf_counter()
    quantize(str(model), quantize_mode="int8", calibration_data_reader=reader,
             calibration_method=method, calibration_eps=["cpu"], log_level="WARNING",
             output_path=str(Path(spec["out"]) / f"{label}.int8.onnx"),
             **({"high_precision_dtype": dtype} if dtype else {}))
    wall = time.perf_counter() - start
    default = inspect.signature(quantize).parameters["high_precision_dtype"].default
    return {"wall_s": {label: wall}, "version": modelopt.__version__,
            "high_precision_dtype": dtype or default}


CHILDREN = {"quantlab": child_quantlab, "ort": child_ort, "modelopt": child_modelopt}


def child_main(spec: Mapping) -> None:
    """Run one tool in this child process; write <label>.json with its peak RSS."""
    bench.limit_address_space(spec["memory_limit"])
    use_quantlab(spec["root"])
    try:
        result = {"status": "ok", **CHILDREN[spec["tool"]](spec)}
    except Exception as exc:  # a failing tool is a result to report
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:600]}
    result["peak_rss"] = bench.peak_rss()
    Path(spec["out"], f"{spec['label']}.json").write_text(json.dumps(result))


def launch(tool: str, spec: dict, args, label: str | None = None,
           python: str = sys.executable) -> dict:
    """Run a child under the watchdog (memory, time, machine reserve); return its result."""
    label = label or tool
    spec = {**spec, "tool": tool, "label": label, "root": str(args.quantlab_root),
            "memory_limit": int(args.memory_limit_gb * bench.GIB)}
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / f"{label}.json"
    result_path.unlink(missing_ok=True)
    log = out / f"{label}.log"
    stopped, sampled, code = bench.run_child(__file__, spec, log, spec["memory_limit"],
                                             args.time_limit, python)
    if stopped or not result_path.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"status": stopped or f"crashed (exit {code})",
                "error": " | ".join(tail), "peak_rss": sampled}
    result = json.loads(result_path.read_text())
    result["peak_rss"] = max(result["peak_rss"], sampled)
    return result


# ------------------------------------------------------------------------- evaluation


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.qdqisint8allowed", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_all(path: Path, subject: Subject) -> dict[str, np.ndarray]:
    """Every output of the model on the held-out data (batch 1 for fixed-batch models)."""
    sess = session(path)
    names = [i.name for i in sess.get_inputs()]
    arrays = load_arrays(subject.val, names)
    arrays = {n: arrays[n] for n in names}  # inputs a normalized model froze are left out
    fixed = sess.get_inputs()[0].shape[0] == 1 and len(names) == 1
    parts = [sess.run(None, batch) for batch in
             batches(arrays, subject.sample_axes, 1 if fixed else subject.batch_size)]
    outputs = {}
    for k, output in enumerate(sess.get_outputs()):
        outputs[output.name] = np.concatenate([p[k] for p in parts],
                                              axis=subject.output_axes.get(output.name, 0))
    return outputs


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    ref = np.asarray(reference, np.float64)
    err = ref - np.asarray(test, np.float64)
    noise = float(np.sum(err * err))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(ref * ref)) / noise)


def score(subject: Subject, fp32: dict, int8: dict) -> dict:
    """Task metric (if labelled), worst output SQNR, and an agreement figure vs FP32."""
    row = {"sqnr_db": {o: sqnr_db(fp32[o], int8[o]) for o in fp32}}
    row["min_sqnr_db"] = min(row["sqnr_db"].values())
    name = subject.name
    if name in ZOO:
        from quantlab import zoo
        from quantlab.evaluation import tasks

        entry = zoo.get(name)
        eval_set = subject.eval_set
        if entry.task == "classification":
            row["top1"] = float(np.mean(int8[entry.output_names[0]].argmax(1)
                                        == eval_set.labels))
            row["agreement"] = float(np.mean(int8[entry.output_names[0]].argmax(1)
                                             == fp32[entry.output_names[0]].argmax(1)))
        else:
            predictions = []
            for start in range(0, len(eval_set.inputs), 32):
                stop = start + 32
                predictions += entry.postprocess({k: v[start:stop] for k, v in int8.items()},
                                                 list(eval_set.image_ids[start:stop]))
            row["map"] = float(tasks.coco_map(eval_set.coco, predictions)["map"])
    elif name == "orientation":
        logits = next(iter(int8.values()))
        row["top1"] = float(np.mean(logits.argmax(1) == subject.labels))
        row["agreement"] = float(np.mean(logits.argmax(1) == next(iter(fp32.values())).argmax(1)))
    elif name == "onet":
        row["agreement"] = float(np.mean(int8["prob"].argmax(1) == fp32["prob"].argmax(1)))
    elif name == "vad":
        row["agreement"] = float(np.mean((int8["output"] > 0.5) == (fp32["output"] > 0.5)))
    elif name == "layout":  # confident (anchor, class) pairs: |FP32 & INT8| / |FP32 | INT8|
        maps = [o for o in fp32 if fp32[o].shape[-1] == 10]
        a = np.concatenate([fp32[o].reshape(-1) for o in maps]) > LAYOUT_SCORE_THRESHOLD
        b = np.concatenate([int8[o].reshape(-1) for o in maps]) > LAYOUT_SCORE_THRESHOLD
        row["agreement"] = float((a & b).sum() / max((a | b).sum(), 1))
    return row


def noise(subject: Subject, samples: int) -> float:
    return {"top1": 1.0 / max(samples, 1), "map": MAP_NOISE}.get(subject.metric, SQNR_NOISE_DB)


def primary(subject: Subject, row: dict) -> float:
    return row["min_sqnr_db"] if subject.metric == "sqnr" else row[subject.metric]


# ---------------------------------------------------------------------------- driver


def bench_model(name: str, root: Path, args) -> dict:
    folder = root / name
    print(f"\n== {name}", flush=True)
    start = time.monotonic()
    subject = prepare(name, folder, args.quick)
    spec = {"model": str(subject.model), "calib": str(subject.calib), "out": str(folder / "runs"),
            "batch_size": subject.batch_size, "sample_axes": subject.sample_axes,
            "methods": list(QUANTLAB_METHODS)}
    quantlab = launch("quantlab", spec, args)
    fp32_model = (Path(quantlab["fp32_model"]) if quantlab["status"] == "ok"
                  else subject.model)
    peer_spec = {**spec, "model": str(fp32_model)}
    peers = {}
    if "ort" in args.peers:
        peers[ORT] = launch("ort", peer_spec, args, ORT)
    if "modelopt" in args.peers:
        for label in MODELOPT:
            peers[label] = launch("modelopt", peer_spec, args, label, args.modelopt_python)
    record = {"model": name, "metric": subject.metric, "calib": str(subject.calib),
              "val": str(subject.val),
              "data_sha1": {"calib": sha1(subject.calib), "val": sha1(subject.val)},
              "quantlab": quantlab, "peers": peers, "methods": {}}
    fp32 = run_all(fp32_model, subject)
    samples = len(next(iter(fp32.values())))
    record["noise"] = noise(subject, samples)
    record["val_samples"] = samples
    if subject.metric != "sqnr":
        record["fp32"] = score(subject, fp32, fp32).get(subject.metric)
    tools = [(m, quantlab) for m in QUANTLAB_METHODS] + list(peers.items())
    for method, result in tools:
        row = {"status": result["status"], "peak_rss": result.get("peak_rss")}
        if result["status"] != "ok":
            row["error"] = result.get("error")
        else:
            row["wall_s"] = result["wall_s"][method]
            try:
                row.update(score(subject, fp32, run_all(folder / "runs" / f"{method}.int8.onnx",
                                                        subject)))
                row["score"] = primary(subject, row)
            except Exception as exc:  # an INT8 model that does not run is a result too
                row.update(status="failed to run", error=f"{type(exc).__name__}: {exc}"[:300])
        record["methods"][method] = row
    record["seconds"] = time.monotonic() - start
    print_model(record)
    return record


def _fmt(value, spec=".3f"):
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) and math.isfinite(value) else str(value)


def print_model(record: dict) -> None:
    metric = record["metric"]
    q = record["quantlab"]
    print(f"{record['model']}: {record['val_samples']} held-out samples; primary figure "
          f"{'worst output SQNR (dB)' if metric == 'sqnr' else metric}"
          + (f", FP32 {record['fp32']:.4f}" if record.get("fp32") is not None else "")
          + (f"; quantlab collection {q['collect_s']:.1f} s (shared by its methods)"
             if q.get("status") == "ok" else ""))
    print(f"| method | {metric} | worst SQNR dB | agreement | wall s | peak RSS MiB | status |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for method, row in record["methods"].items():
        rss = row.get("peak_rss")
        print(f"| {method} | {_fmt(row.get(metric if metric != 'sqnr' else 'min_sqnr_db'))} | "
              f"{_fmt(row.get('min_sqnr_db'), '.2f')} | {_fmt(row.get('agreement'))} | "
              f"{_fmt(row.get('wall_s'), '.1f')} | "
              f"{_fmt(rss / bench.MIB if rss else None, '.0f')} | "
              f"{row['status']}{': ' + row['error'] if row.get('error') else ''} |", flush=True)


def verdict(records: list[dict]) -> dict:
    """Per quantlab method: >= ORT MinMax everywhere (within noise)? ever the clear worst?
    how far behind the best quantlab method, in units of noise?"""
    out = {}
    for method in QUANTLAB_METHODS:
        below_ort, worst, behind, gaps, sqnr_gaps, missing = [], [], [], {}, {}, []
        for record in records:
            rows = record["methods"]
            mine = rows[method].get("score")
            if mine is None:
                missing.append(record["model"])
                continue
            eps = record["noise"]
            ort_score = rows.get(ORT, {}).get("score")
            if ort_score is not None and mine < ort_score - eps:
                below_ort.append(record["model"])
            others = [rows[m]["score"] for m in QUANTLAB_METHODS
                      if m != method and rows[m].get("score") is not None]
            if others and mine < min(others) - eps:
                worst.append(record["model"])
            best = max([mine, *others])
            gaps[record["model"]] = (best - mine) / eps
            sqnrs = [rows[m]["min_sqnr_db"] for m in QUANTLAB_METHODS
                     if rows[m].get("min_sqnr_db") is not None]
            sqnr_gaps[record["model"]] = max(sqnrs) - rows[method]["min_sqnr_db"]
            if best - mine > eps:
                behind.append(record["model"])
        out[method] = {"below_ort_minmax": below_ort, "clear_worst_on": worst,
                       "behind_best_on": behind, "gap_in_noise_units": gaps,
                       "worst_sqnr_gap_db": sqnr_gaps,
                       "not_measured_on": missing,
                       "qualifies": bool(gaps) and not below_ort and not worst
                       and not missing}
    qualified = [m for m in QUANTLAB_METHODS if out[m]["qualifies"]]
    # Fewest models behind the best, then the smallest total gap; a tie on the task metric
    # (top-1 saturates on small held-out sets) is broken by the worst-output SQNR gap.
    choice = min(qualified, key=lambda m: (len(out[m]["behind_best_on"]),
                                           round(sum(out[m]["gap_in_noise_units"].values()), 6),
                                           sum(out[m]["worst_sqnr_gap_db"].values())),
                 default=None)
    return {"methods": out, "choice": choice,
            "ort_run": any(ORT in record["methods"] for record in records)}


def print_verdict(result: dict) -> None:
    print("\nVerdict (noise: SQNR 0.2 dB, top-1 one held-out sample, mAP 0.005"
          + ("" if result["ort_run"] else "; ORT MinMax not run: 'below' it is not judged") + "):")
    for method, v in result["methods"].items():
        gaps = ", ".join(f"{m} {g:.1f}" for m, g in v["gap_in_noise_units"].items())
        sqnr = ", ".join(f"{m} {g:.1f}" for m, g in v["worst_sqnr_gap_db"].items())
        print(f"  {method:10s} {'QUALIFIES' if v['qualifies'] else 'does not qualify'}: "
              f"below ORT MinMax on {v['below_ort_minmax'] or 'none'}; clear worst on "
              f"{v['clear_worst_on'] or 'none'}; behind the best on {v['behind_best_on'] or 'none'}"
              f"{'; not measured on ' + str(v['not_measured_on']) if v['not_measured_on'] else ''}"
              f" (gap to best / noise: {gaps}; worst-output SQNR behind the best method, dB: "
              f"{sqnr})")
    print(f"  => default: {result['choice'] or 'no method qualifies on every model'}")


def compare(before_path: Path, after_path: Path) -> None:
    """Before/after table of two runs' quantlab methods (same models and data), every change
    beyond noise flagged, and the after run's peer rows."""
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    old = {r["model"]: r for r in before["records"] if "methods" in r}
    print(f"before: {before_path} (quantlab {before.get('quantlab')})\n"
          f"after:  {after_path} (quantlab {after.get('quantlab')})")
    print("| model | method | metric before -> after | worst SQNR dB before -> after (diff) | "
          "agreement before -> after | change beyond noise |")
    print("| --- | --- | --- | --- | --- | --- |")
    flagged = []
    for record in (r for r in after["records"] if r["model"] in old):
        name, metric, eps = record["model"], record["metric"], record["noise"]
        base = old[name]
        if base.get("data_sha1") != record.get("data_sha1"):
            print(f"| {name} | | | | | NOT COMPARABLE: different data ({base.get('data_sha1')} "
                  f"vs {record.get('data_sha1')}) |")
            continue
        for method in [m for m in record["methods"] if m in QUANTLAB_METHODS + [AUTO]]:
            a, b = record["methods"][method], base["methods"].get(method, {"status": "none"})
            notes = [] if method in base["methods"] else ["new method"]
            if metric != "sqnr" and a.get(metric) is not None and b.get(metric) is not None \
                    and abs(a[metric] - b[metric]) > eps + 1e-9:  # one sample is within
                notes.append(f"{metric} {'WORSE' if a[metric] < b[metric] else 'better'}")
            if a.get("min_sqnr_db") is not None and b.get("min_sqnr_db") is not None \
                    and abs(a["min_sqnr_db"] - b["min_sqnr_db"]) > SQNR_NOISE_DB:
                notes.append(f"SQNR {'WORSE' if a['min_sqnr_db'] < b['min_sqnr_db'] else 'better'}")
            if a["status"] != "ok" or b["status"] not in ("ok", "none"):
                notes.append(f"status {b['status']} -> {a['status']}")
            if any("WORSE" in n or "status" in n for n in notes):
                flagged.append(f"{name} {method}")
            diff = (a["min_sqnr_db"] - b["min_sqnr_db"]
                    if a.get("min_sqnr_db") is not None and b.get("min_sqnr_db") is not None
                    else None)
            print(f"| {name} | {method} | "
                  + (f"{_fmt(b.get(metric))} -> {_fmt(a.get(metric))}" if metric != "sqnr"
                     else "-")
                  + f" | {_fmt(b.get('min_sqnr_db'), '.2f')} -> {_fmt(a.get('min_sqnr_db'), '.2f')}"
                  f" ({_fmt(diff, '+.2f')}) | {_fmt(b.get('agreement'))} -> "
                  f"{_fmt(a.get('agreement'))} | "
                  + ("; ".join(f"**{n}**" if "WORSE" in n else n for n in notes) or "-")
                  + " |")
    print(f"\nWorse than before beyond noise (metric: {MAP_NOISE} mAP / one held-out sample of "
          f"top-1; worst-output SQNR: {SQNR_NOISE_DB} dB): {', '.join(flagged) or 'none'}")
    peers = [(r, m) for r in after["records"] if "methods" in r
             for m in r["methods"] if m not in QUANTLAB_METHODS + [AUTO]]
    if peers:
        print("\nPeers, in the after run:\n| model | peer | metric | worst SQNR dB | agreement "
              "| wall s | peak RSS MiB | status |\n| --- | --- | ---: | ---: | ---: | ---: | ---: "
              "| --- |")
        for record, method in peers:
            row = record["methods"][method]
            rss = row.get("peak_rss")
            print(f"| {record['model']} | {method} | {_fmt(row.get(record['metric']))} | "
                  f"{_fmt(row.get('min_sqnr_db'), '.2f')} | {_fmt(row.get('agreement'))} | "
                  f"{_fmt(row.get('wall_s'), '.1f')} | "
                  f"{_fmt(rss / bench.MIB if rss else None, '.0f')} | {row['status']}"
                  f"{': ' + row['error'] if row.get('error') else ''} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--quantlab-root", type=Path, default=ROOT,
                        help="the quantlab tree to measure (default: this script's); its "
                             "tests/realmodels.py makes the real models' data")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS,
                        help="peers to run on the same FP32 model and data (none: quantlab only)")
    parser.add_argument("--modelopt-python", default=sys.executable,
                        help="interpreter of a virtual environment with nvidia-modelopt[onnx] "
                             "(its pins replace onnx and onnxruntime: keep it apart)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="print the before/after table of two result files and exit")
    parser.add_argument("--quick", action="store_true", help="smaller data (a smoke run)")
    parser.add_argument("--size", nargs=3, action="append", default=[],
                        metavar=("MODEL", "CALIB", "VAL"),
                        help="calibration and held-out samples of a real model (repeatable)")
    parser.add_argument("--workdir", type=Path, help="keep models, data and runs here")
    parser.add_argument("--memory-limit-gb", type=float, default=12.0)
    parser.add_argument("--time-limit", type=float, default=1800.0, help="seconds per child")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return
    if args.compare:
        compare(*args.compare)
        return
    use_quantlab(args.quantlab_root)
    import quantlab
    from quantlab import choices

    if getattr(choices, "AUTO_METHOD", None) == AUTO:  # calibrate's per-layer choice (issue 19)
        QUANTLAB_METHODS.append(AUTO)
    print(f"quantlab: {quantlab.__file__}", flush=True)
    for model, n_calib, n_val in args.size:
        SIZE_OVERRIDES[model] = (int(n_calib), int(n_val))
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f}; CPUs: {os.cpu_count()}; "
          f"RAM available: {psutil.virtual_memory().available / bench.GIB:.1f} GiB", flush=True)
    scratch = None
    if args.workdir is None:
        scratch = tempfile.TemporaryDirectory(prefix="quantlab-default-method-")
        args.workdir = Path(scratch.name)
    records = []
    for name in args.models:
        try:
            records.append(bench_model(name, args.workdir, args))
        except Exception as exc:  # one model's failure does not lose the others'
            print(f"{name}: FAILED before scoring: {type(exc).__name__}: {exc}", flush=True)
            records.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:600]})
    scored = [r for r in records if "methods" in r]
    result = verdict(scored)
    print_verdict(result)
    load_end = os.getloadavg()
    print(f"load average at end: {load_end[0]:.2f}")
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"default_method-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                "quantlab": quantlab.__file__,
                                "load": [load_start[0], load_end[0]], "records": records,
                                "verdict": result}, indent=1, default=str))
    print(f"wrote {path}")
    if scratch:
        scratch.cleanup()


if __name__ == "__main__":
    main()
