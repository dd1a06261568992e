"""Calibration speed, memory and INT8 accuracy: quantlab vs ONNX Runtime's quantize_static.

One run measures, on the same models, samples and batch size:

- ``quantlab``: ``pipeline.run_calibration`` with ``entropy``, ``max``, ``percentile`` and
  ``mse`` (time split into statistics collection and threshold search);
- ``onnxruntime``: ``quantize_static`` in QDQ format, int8 symmetric activations and
  weights, per-channel weights, with ``CalibrationMethod.MinMax``, ``Entropy`` and
  ``Percentile`` at ORT's defaults. ``quantize_static`` cannot set the entropy
  histogram's bins, and with ORT's defaults (128 bins, 128 quantized bins) the KL search
  has a single candidate, the full range, so its Entropy writes MinMax's scales.
  ``Entropy-4096`` is ORT's entropy calibrator as its maintainers advise tuning it
  (microsoft/onnxruntime#10204, #10261): built with ``create_calibrator`` and handed to
  ``quantize_static`` through its calibration cache;
- ``floor``: bare FP32 forward passes in ONNX Runtime, the least any calibrator
  that runs the model must spend.

Every configuration runs in its own child process (peak RSS is that process's own)
under an address-space limit, an RSS watchdog and a time limit, so a peer that
needs too much memory is stopped and reported instead of taking the machine down.
One unmeasured quantlab child runs first, so one-time costs (numba compiling its
kernels into its on-disk cache) are in no measured time. Speed is judged on the
marginal cost per sample, which leaves out the fixed costs of a run. The table, the
ratios the issue asks about and PASS/FAIL per target are printed and written to
``benchmarks/results/calibration-<date>.json``.

    python benchmarks/calibration.py                  # 64, 256, 512 samples, both models
    python benchmarks/calibration.py --quick          # 64 samples only (smoke check)

Modules only the parent process needs (torch, the zoo, quantlab.evaluation.compare/tasks with
pandas) are imported inside the functions that use them, so the measured children
do not carry them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import onnx
import psutil
from harness import GIB, MIB, format_table, limit_address_space, peak_rss, run_child, timed
from onnx import numpy_helper

BATCH_SIZE = 32
SIZES = (64, 256, 512)
QUICK_SIZES = (64,)
MODELS = ("shapes-det", "resnet18")
# (tool, method) in run order: the floor first, so every ratio has its denominator.
CONFIGS = (
    ("floor", "fp32"),
    ("floor", "fp32-exposed"),
    ("quantlab", "entropy"),
    ("quantlab", "max"),
    ("quantlab", "percentile"),
    ("quantlab", "mse"),
    ("onnxruntime", "MinMax"),
    ("onnxruntime", "Entropy"),
    ("onnxruntime", "Percentile"),
    ("onnxruntime", "Entropy-4096"),
)
# ORT histogram settings of the tuned entropy run: 2048 bins per sign, TensorRT's
# resolution of |x|, searched for the 255 levels of int8 (MXNet's choice).
ORT_TUNED_ENTROPY = {"Entropy-4096": {"num_bins": 4096, "num_quantized_bins": 255}}
ORT_ENTROPY_METHODS = ("Entropy", *ORT_TUNED_ENTROPY)
# The speed-up target is against what quantize_static does with CalibrationMethod.Entropy;
# the ratio to the tuned run is printed as information.
SPEEDUP_PEER = "Entropy"
# Imported by a child before its clock starts, so import time is not calibration time.
TOOL_MODULES = {
    "floor": "onnxruntime",
    "quantlab": "quantlab.calibration.pipeline",
    "onnxruntime": "onnxruntime.quantization",
}
SEED = 0
RESNET_SHAPE = (3, 224, 224)
RESNET_EVAL_SAMPLES = 64
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)
# Targets from the issue.
SPEEDUP_TARGET = 20.0
FLOOR_RATIO_TARGET = 2.0
PEAK_RSS_TARGET = 2 * 10**9
FLATNESS_TARGET = 0.10
# "Equal" accuracy: differences below these are evaluation noise (mAP over 500 images,
# output SQNR over 64 samples), not a quantization loss.
ACCURACY_TOLERANCE = {"mAP": 0.002, "SQNR dB": 0.1}
# Two scales of one tensor are "the same" when they agree to float32 round-off.
SCALE_RTOL = 1e-6
RESULTS_DIR = Path(__file__).resolve().parent / "results"
INT8_MODEL = "model.int8.onnx"
RESULT_FILE = "result.json"
# Configurations shorter than this are repeated (--repeats) and their fastest run kept:
# a single short run moves by a few tenths of a second with the machine's other work.
REPEAT_BELOW_S = 30.0


@dataclass
class Subject:
    """A benchmark model: its ONNX file, calibration samples and how INT8 accuracy is scored."""

    name: str
    model_path: Path
    calibration_path: Path
    input_name: str
    metric: str
    score: Callable[[Path], float]


# ---------------------------------------------------------------- data (parent and child)


def read_samples(path: Path, start: int, stop: int) -> np.ndarray:
    """Samples ``[start, stop)`` of an ``.npy`` file as an owned array.

    The file is mapped only for the copy: mapped pages of a long-lived mapping count
    in RSS, which would make every tool's peak grow with the number of samples.
    """
    return np.array(np.load(path, mmap_mode="r")[start:stop])


def read_batches(path: Path, size: int) -> Iterator[np.ndarray]:
    """The first `size` samples of `path` in batches of BATCH_SIZE."""
    for start in range(0, size, BATCH_SIZE):
        yield read_samples(path, start, min(start + BATCH_SIZE, size))


class BatchReader:
    """ONNX Runtime's ``CalibrationDataReader`` protocol (``get_next``) over read_batches."""

    def __init__(self, path: Path, size: int, input_name: str):
        self._batches = read_batches(path, size)
        self._input_name = input_name

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next batch as ORT's feed dict, None when done."""
        batch = next(self._batches, None)
        return None if batch is None else {self._input_name: batch}


# ---------------------------------------------------------------- child: one tool, one config


def run_floor(spec: Mapping) -> dict[str, float]:
    """FP32 forward passes over the samples; the outputs are read as ORT's own buffers and dropped.

    With ``fp32-exposed`` the model's outputs are the tensors quantlab calibrates: the
    forward passes plus handing every such activation out, before any statistics.
    """
    import onnxruntime as ort

    session = ort.InferenceSession(spec["model"], providers=["CPUExecutionProvider"])
    outputs = [output.name for output in session.get_outputs()]
    for batch in read_batches(Path(spec["data"]), spec["size"]):
        session.run_with_ort_values(outputs, {
            spec["input_name"]: ort.OrtValue.ortvalue_from_numpy(batch)})
    return {}


def run_quantlab(spec: Mapping) -> dict[str, float]:
    """``pipeline.run_calibration``; returns the seconds spent collecting and calibrating."""
    from quantlab.calibration import calibrate, collect, pipeline
    from quantlab.data import BatchSource

    data = Path(spec["data"])
    source = BatchSource(str(data), spec["size"], BATCH_SIZE,
                         lambda start, stop: {spec["input_name"]: read_samples(data, start, stop)})
    stages: dict[str, float] = {}
    with timed(collect, "collect", stages), timed(calibrate, "calibrate", stages):
        pipeline.run_calibration(spec["model"], source, spec["out"], method=spec["method"],
                                 progress=False)
    return stages


def run_onnxruntime(spec: Mapping) -> dict[str, float]:
    """``quantize_static``: QDQ, int8 symmetric activations and weights, per-channel.

    A tuned method (ORT_TUNED_ENTROPY) calibrates with ``create_calibrator`` first and
    passes the ranges to ``quantize_static`` as its calibration cache.
    """
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        create_calibrator,
        quantize_static,
    )
    from onnxruntime.quantization.calibrate import save_tensors_data

    out = Path(spec["out"])
    reader = BatchReader(Path(spec["data"]), spec["size"], spec["input_name"])
    method = CalibrationMethod[spec["method"].split("-")[0]]
    cache = None
    if spec["method"] in ORT_TUNED_ENTROPY:
        cache = out / "ranges.json"
        with tempfile.TemporaryDirectory(prefix="ort.calibrate.") as scratch:
            calibrator = create_calibrator(
                Path(spec["model"]), augmented_model_path=str(Path(scratch, "augmented.onnx")),
                calibrate_method=method, extra_options=ORT_TUNED_ENTROPY[spec["method"]])
            calibrator.collect_data(reader)
            save_tensors_data(calibrator.compute_data(), cache)
        reader = None
    quantize_static(
        spec["model"],
        str(out / INT8_MODEL),
        reader,
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=method,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
        calibration_cache_path=cache,
    )
    return {}


RUNNERS: dict[str, Callable[[Mapping], dict[str, float]]] = {
    "floor": run_floor,
    "quantlab": run_quantlab,
    "onnxruntime": run_onnxruntime,
}


def child_main(spec: Mapping) -> None:
    """Run one configuration under the address-space limit; write its result.json."""
    limit_address_space(spec["memory_limit"])
    importlib.import_module(TOOL_MODULES[spec["tool"]])
    baseline_rss = psutil.Process().memory_info().rss
    start = time.perf_counter()
    try:
        stages = RUNNERS[spec["tool"]](spec)
        result = {"status": "ok", "wall_s": time.perf_counter() - start, "stages": stages}
    except Exception as exc:  # any failure of the tool is a result to report, not a crash
        text = f"{type(exc).__name__}: {exc}"
        out_of_memory = isinstance(exc, MemoryError) or "alloc" in text.lower()
        result = {"status": "out of memory" if out_of_memory else "failed",
                  "error": text.strip()[:500]}
    result["baseline_rss"] = baseline_rss
    result["peak_rss"] = peak_rss()
    Path(spec["out"], RESULT_FILE).write_text(json.dumps(result))


# ---------------------------------------------------------------- parent: models and data


def synthetic_images(count: int, seed: int,
                     shape: tuple[int, int] = RESNET_SHAPE[1:]) -> np.ndarray:
    """Seeded ``(count, 3, H, W)`` inputs that look like ImageNet-normalized photos.

    Natural images have an amplitude spectrum falling as 1/f and strongly correlated
    RGB channels, so: 1/f noise shared by the channels (luminance) plus weaker
    per-channel 1/f noise (colour), mapped to [0, 1] pixels, then ImageNet mean/std.
    """
    rng = np.random.default_rng(seed)
    height, width = shape
    frequency = np.hypot(np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :])
    frequency[0, 0] = np.inf  # no DC term: each image's mean is set below

    def pink_noise(channels: int) -> np.ndarray:
        white = rng.standard_normal((count, channels, height, width), np.float32)
        return np.fft.irfft2(np.fft.rfft2(white) / frequency, s=(height, width)).astype(np.float32)

    field = pink_noise(1) + 0.4 * pink_noise(3)
    field /= field.std(axis=(1, 2, 3), keepdims=True)
    brightness = rng.uniform(0.3, 0.6, (count, 1, 1, 1)).astype(np.float32)
    pixels = np.clip(brightness + 0.2 * field, 0.0, 1.0)
    return (pixels - IMAGENET_MEAN) / IMAGENET_STD


def model_outputs(model: Path, inputs: np.ndarray, input_name: str) -> dict[str, np.ndarray]:
    """Graph outputs of `model` in ONNX Runtime over `inputs`, batch by batch."""
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(model)
    parts = [backend.run({input_name: inputs[start:start + BATCH_SIZE]})
             for start in range(0, len(inputs), BATCH_SIZE)]
    return {name: np.concatenate([part[name] for part in parts]) for name in backend.outputs}


def prepare_shapes_det(folder: Path, count: int) -> Subject:
    """The zoo detector, its calibration split and COCO mAP on its held-out split."""
    from quantlab import zoo
    from quantlab.calibration.pipeline import export_zoo_model
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.errors import DataError
    from quantlab.evaluation import tasks

    entry = zoo.get("shapes-det")
    model_path = folder / "model.onnx"
    export_zoo_model(entry.name, model_path)
    samples = entry.calibration_set()
    if len(samples) < count:
        raise DataError(f"shapes-det has {len(samples)} calibration samples; asked for {count}.")
    np.save(folder / "calibration.npy", samples[:count])
    eval_set = entry.eval_set()

    def score(model: Path) -> float:
        return tasks.evaluate(tasks.Task.from_zoo(entry, eval_set), OnnxRuntimeBackend(model).run,
                              tasks.zoo_batches(entry, eval_set))["map"]

    return Subject(entry.name, model_path, folder / "calibration.npy", entry.input_name, "mAP",
                   score)


def prepare_resnet18(folder: Path, count: int) -> Subject:
    """Seeded random-weight ResNet-18 and synthetic images; accuracy = output SQNR vs FP32."""
    import torch
    from torchvision.models import resnet18

    from quantlab import graph
    from quantlab.evaluation.compare import TensorError

    torch.manual_seed(SEED)
    model_path = folder / "model.onnx"
    calibration = synthetic_images(count, SEED)
    graph.export_torch(resnet18(weights=None), calibration[:2], model_path)
    np.save(folder / "calibration.npy", calibration)
    held_out = synthetic_images(RESNET_EVAL_SAMPLES, SEED + 1)
    reference = model_outputs(model_path, held_out, "input")

    def score(model: Path) -> float:
        error = TensorError()
        for name, values in model_outputs(model, held_out, "input").items():
            error.update(reference[name], values)
        return error.sqnr_db

    return Subject("resnet18", model_path, folder / "calibration.npy", "input", "SQNR dB", score)


PREPARE = {"shapes-det": prepare_shapes_det, "resnet18": prepare_resnet18}


def exposed_model(subject: Subject) -> Path:
    """The FP32 model whose outputs are the activations quantlab calibrates (written once)."""
    from quantlab import graph
    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import with_outputs

    path = subject.model_path.with_name("model.exposed.onnx")
    if not path.exists():
        model = graph.load_model(subject.model_path)
        graph.save_model(with_outputs(model, qdq.activation_tensors_to_calibrate(model)), path)
    return path


# ---------------------------------------------------------------- parent: running children


def launch(subject: Subject, size: int, tool: str, method: str, folder: Path,
           args: argparse.Namespace) -> tuple[str | None, int, int]:
    """Run one configuration's child under the watchdog, writing into the existing `folder`.

    Returns why it was stopped (None if it ended by itself), its sampled peak RSS and
    its exit code.
    """
    spec = {
        "tool": tool, "method": method, "size": size,
        "model": str(exposed_model(subject) if method == "fp32-exposed" else subject.model_path),
        "data": str(subject.calibration_path), "input_name": subject.input_name,
        "out": str(folder), "memory_limit": int(args.memory_limit_gb * GIB),
    }
    return run_child(__file__, spec, folder / "log.txt", spec["memory_limit"], args.time_limit)


def warm_up(subject: Subject, args: argparse.Namespace) -> None:
    """One unmeasured quantlab entropy child on the first batch; its result is discarded.

    Whatever a first run pays once per install (numba compiling its kernels into its
    on-disk cache) is then paid here, not inside a measured configuration.
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="quantlab-warm-up-") as scratch:
        stopped, _, _ = launch(subject, BATCH_SIZE, "quantlab", "entropy", Path(scratch), args)
    print(f"Warm-up (not measured): quantlab entropy on the first batch of {subject.name}, so "
          f"one-time compilation is in no measured time: {stopped or 'done'}, "
          f"{time.monotonic() - start:.1f} s", flush=True)


def measure(subject: Subject, size: int, tool: str, method: str, folder: Path,
            args: argparse.Namespace) -> dict:
    """Run one configuration's child once into the new `folder`; its row without accuracy."""
    folder.mkdir(parents=True)
    stopped, sampled_peak, exit_code = launch(subject, size, tool, method, folder, args)
    row = {"model": subject.name, "size": size, "tool": tool, "method": method}
    result_path = folder / RESULT_FILE
    if stopped or not result_path.is_file():
        log_tail = (folder / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
        status = stopped or f"crashed (exit {exit_code})"
        return {**row, "status": status, "peak_rss": sampled_peak, "error": " | ".join(log_tail)}
    result = json.loads(result_path.read_text())
    row.update(status=result["status"], peak_rss=max(result["peak_rss"], sampled_peak),
               baseline_rss=result["baseline_rss"])
    if result["status"] != "ok":
        return {**row, "error": result["error"]}
    stages = result["stages"]
    return {**row, "wall_s": result["wall_s"], "collect_s": stages.get("collect"),
            "calibrate_s": stages.get("calibrate"),
            # model loading, Q/DQ insertion, writing the folder
            "other_s": result["wall_s"] - sum(stages.values()) if stages else None}


def run_config(subject: Subject, size: int, tool: str, method: str, folder: Path,
               args: argparse.Namespace) -> dict:
    """Run one configuration (repeated if short) and return its row of results.

    A run shorter than REPEAT_BELOW_S is repeated ``--repeats`` times in all, each in its
    own child: the fastest wall time is kept (the least disturbed by the machine) and
    the largest peak RSS. The INT8 model of the first run is scored.
    """
    row = measure(subject, size, tool, method, folder, args)
    if row["status"] != "ok":
        return row
    if row["wall_s"] < REPEAT_BELOW_S:
        repeats = [measure(subject, size, tool, method, folder / f"repeat-{k}", args)
                   for k in range(1, args.repeats)]
        done = [r for r in [row, *repeats] if r["status"] == "ok"]
        row = {**min(done, key=lambda r: r["wall_s"]), "repeats": len(done),
               "peak_rss": max(r["peak_rss"] for r in [row, *repeats])}
    if method == "fp32-exposed":
        return {**row, "accuracy": None}  # the floor's FP32 model again: nothing new to score
    model = subject.model_path if tool == "floor" else folder / INT8_MODEL
    accuracy = subject.score(model)
    # The FP32 model scored against itself has SQNR +inf: no figure, and no Infinity in JSON.
    row["accuracy"] = accuracy if math.isfinite(accuracy) else None
    return row


def activation_scales(model_path: Path) -> dict[str, float]:
    """Scale of every QuantizeLinear in a Q/DQ model, keyed by the tensor it quantizes."""
    model = onnx.load(str(model_path))
    initializers = {init.name: init for init in model.graph.initializer}
    return {
        node.input[0]: float(numpy_helper.to_array(initializers[node.input[1]]).reshape(-1)[0])
        for node in model.graph.node
        if node.op_type == "QuantizeLinear" and node.input[1] in initializers
    }


def compare_scales(first: Path, second: Path) -> dict:
    """How many activation scales two Q/DQ models of one FP32 model share and how many differ."""
    a, b = activation_scales(first), activation_scales(second)
    common = sorted(set(a) & set(b))
    ratios = np.array([a[name] / b[name] for name in common])
    differ = np.abs(ratios - 1.0) > SCALE_RTOL
    return {
        "tensors": len(common),
        "different": int(differ.sum()),
        "median_ratio": float(np.median(ratios)) if common else math.nan,
    }


def run_folder(root: Path, model: str, size: int, tool: str, method: str) -> Path:
    """Where one configuration's child writes its INT8 model, log and result."""
    return root / model / str(size) / tool / method


def scale_checks(folder: Path, rows: Sequence[dict]) -> list[dict]:
    """Per model, size and tool: does each pair of its methods write different scales?

    quantlab's methods are compared with each other and ONNX Runtime's with each other;
    the two tools quantize different sets of tensors.
    """
    ok = {(r["model"], r["size"], r["tool"], r["method"]) for r in rows if r["status"] == "ok"}
    checks = []
    for model, size in dict.fromkeys((r["model"], r["size"]) for r in rows):
        for tool in ("quantlab", "onnxruntime"):
            methods = [m for t, m in CONFIGS if t == tool and (model, size, tool, m) in ok]
            for method, other in itertools.combinations(methods, 2):
                result = compare_scales(
                    run_folder(folder, model, size, tool, method) / INT8_MODEL,
                    run_folder(folder, model, size, tool, other) / INT8_MODEL)
                checks.append({"model": model, "size": size, "tool": tool,
                               "methods": f"{method} vs {other}", **result})
    return checks


# ---------------------------------------------------------------- parent: ratios and targets


def _find(rows: Sequence[dict], model: str, size: int, tool: str, method: str) -> dict | None:
    return next((r for r in rows if (r["model"], r["size"], r["tool"], r["method"])
                 == (model, size, tool, method) and r["status"] == "ok"), None)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or not positive (timing noise)."""
    if numerator is None or denominator is None or numerator <= 0 or denominator <= 0:
        return None
    return numerator / denominator


def _best(rows: Iterable[dict]) -> dict | None:
    return max(rows, key=lambda r: r["accuracy"], default=None)


def _wall(row: dict | None) -> float | None:
    return row["wall_s"] if row else None


def ratios(rows: Sequence[dict], metrics: Mapping[str, str]) -> list[dict]:
    """Per model and size: whole-run speed ratios, accuracy gaps (None where a run is missing)."""
    result = []
    for model, size in dict.fromkeys((r["model"], r["size"]) for r in rows):
        ours = _find(rows, model, size, "quantlab", "entropy")
        floor = _find(rows, model, size, "floor", "fp32")
        scored = [r for r in rows if (r["model"], r["size"]) == (model, size)
                  and r["status"] == "ok" and r["accuracy"] is not None]
        ours_best = _best(r for r in scored if r["tool"] == "quantlab")
        ort_best = _best(r for r in scored if r["tool"] == "onnxruntime")
        result.append({
            "model": model, "size": size, "metric": metrics[model],
            "speedup_vs_ort": {
                method: _ratio(_wall(_find(rows, model, size, "onnxruntime", method)), _wall(ours))
                for method in ORT_ENTROPY_METHODS},
            "time_vs_floor": _ratio(_wall(ours), _wall(floor)),
            "quantlab_best_method": ours_best["method"] if ours_best else None,
            "quantlab_best_accuracy": ours_best["accuracy"] if ours_best else None,
            "ort_best_method": ort_best["method"] if ort_best else None,
            "ort_best_accuracy": ort_best["accuracy"] if ort_best else None,
            "accuracy_delta": (ours_best["accuracy"] - ort_best["accuracy"]
                               if ours_best and ort_best else None),
            "quantlab_entropy_accuracy": ours["accuracy"] if ours else None,
            "entropy_accuracy_delta": (ours["accuracy"] - ort_best["accuracy"]
                                       if ours and ours["accuracy"] is not None and ort_best
                                       else None),
        })
    return result


def per_sample_costs(rows: Sequence[dict]) -> list[dict]:
    """Per model, tool and method: whole-run ms/sample at each completed size, marginal cost.

    The marginal cost, (wall at the largest completed size - wall at the smallest) /
    (samples between them), leaves out what does not grow with the samples (session
    creation, threshold search, writing the output); it needs two completed sizes.
    """
    costs = []
    for model, tool, method in dict.fromkeys((r["model"], r["tool"], r["method"]) for r in rows):
        done = sorted((r["size"], r["wall_s"]) for r in rows if r["status"] == "ok"
                      and (r["model"], r["tool"], r["method"]) == (model, tool, method))
        cost = {"model": model, "tool": tool, "method": method,
                "ms_per_sample": {size: 1000 * wall / size for size, wall in done},
                "marginal_sizes": None, "marginal_ms_per_sample": None}
        if len(done) > 1:
            (first, first_wall), (last, last_wall) = done[0], done[-1]
            cost.update(marginal_sizes=[first, last],
                        marginal_ms_per_sample=1000 * (last_wall - first_wall) / (last - first))
        costs.append(cost)
    return costs


def marginal_ratios(costs: Sequence[dict]) -> list[dict]:
    """Per model: speed ratios of quantlab entropy on marginal cost (None if not measurable)."""
    result = []
    for model in dict.fromkeys(c["model"] for c in costs):
        # benchmark() records every configuration of a prepared model, run or skipped.
        cost = {(c["tool"], c["method"]): c for c in costs if c["model"] == model}
        ours = cost["quantlab", "entropy"]["marginal_ms_per_sample"]
        floor = cost["floor", "fp32"]["marginal_ms_per_sample"]
        result.append({
            "model": model,
            "sizes": {f"{tool} {method}": c["marginal_sizes"]
                      for (tool, method), c in cost.items()},
            "speedup_vs_ort": {
                method: _ratio(cost["onnxruntime", method]["marginal_ms_per_sample"], ours)
                for method in ORT_ENTROPY_METHODS},
            "time_vs_floor": _ratio(ours, floor),
            "time_vs_exposed_floor": _ratio(
                ours, cost["floor", "fp32-exposed"]["marginal_ms_per_sample"]),
            # No calibrator that runs the forward passes can beat the floor, so this is
            # the largest speed-up over ORT's Entropy any such calibrator could show.
            "speedup_ceiling": _ratio(
                cost["onnxruntime", SPEEDUP_PEER]["marginal_ms_per_sample"], floor),
        })
    return result


def _verdict(checks: Sequence[tuple[str, bool]]) -> tuple[str, str]:
    if not checks:
        return "NOT MEASURED", ""
    return ("PASS" if all(ok for _, ok in checks) else "FAIL"), "; ".join(t for t, _ in checks)


def speed_checks(marginal: Sequence[dict], table: Sequence[dict], peer: str,
                 ratio: Callable[[Mapping], float | None],
                 passes: Callable[[float], bool]) -> list[tuple[str, bool]]:
    """One speed target's checks, on each model's ratio of marginal costs per sample.

    `peer` ("tool method") is what quantlab entropy is compared with; its sizes are shown
    when its marginal cost spans others than quantlab's. Where a marginal ratio cannot
    be measured (one size completed), the whole-run ratio at each size stands in, marked
    as such.
    """
    checks = []
    for m in marginal:
        value = ratio(m)
        if value is not None:
            ours, theirs = m["sizes"]["quantlab entropy"], m["sizes"][peer]
            span = "{}->{}".format(*ours) + ("" if theirs == ours else
                                              " ({} {}->{})".format(peer, *theirs))
            checks.append((f"{m['model']} marginal {span}: {value:.2f}x", passes(value)))
            continue
        for r in table:
            whole_run = ratio(r) if r["model"] == m["model"] else None
            if whole_run is not None:
                checks.append((f"{r['model']} {r['size']} whole run: {whole_run:.2f}x",
                               passes(whole_run)))
    return checks


def _accuracy_figure(r: Mapping, quantlab_method: str, quantlab_accuracy: float) -> str:
    return (f"{r['model']} {r['size']}: quantlab {quantlab_method} {quantlab_accuracy:.4g} vs "
            f"ORT {r['ort_best_method']} {r['ort_best_accuracy']:.4g} {r['metric']}")


def entropy_accuracy_figures(table: Sequence[dict]) -> str:
    """quantlab entropy vs ORT's best method at each size: information, not a target."""
    return "; ".join(_accuracy_figure(r, "entropy", r["quantlab_entropy_accuracy"])
                     for r in table if r["entropy_accuracy_delta"] is not None)


def targets(rows: Sequence[dict], table: Sequence[dict],
            marginal: Sequence[dict]) -> list[dict]:
    """PASS / FAIL / NOT MEASURED for each target of the issue, with the figures behind it."""
    speed = speed_checks(marginal, table, f"onnxruntime {SPEEDUP_PEER}",
                         lambda r: r["speedup_vs_ort"][SPEEDUP_PEER],
                         lambda value: value >= SPEEDUP_TARGET)
    floor = speed_checks(marginal, table, "floor fp32", lambda r: r["time_vs_floor"],
                         lambda value: value <= FLOOR_RATIO_TARGET)
    ours = [r for r in rows if r["tool"] == "quantlab" and "peak_rss" in r]
    memory = [(f"{r['model']} {r['size']} {r['method']}: {r['peak_rss'] / 1e9:.2f} GB"
               + ("" if r["status"] == "ok" else f" ({r['status']})"),
               r["status"] == "ok" and r["peak_rss"] < PEAK_RSS_TARGET) for r in ours]
    flatness = []
    for model, method in dict.fromkeys((r["model"], r["method"]) for r in ours):
        done = sorted((r["size"], r["peak_rss"]) for r in ours
                      if (r["model"], r["method"]) == (model, method) and r["status"] == "ok")
        if len(done) > 1:
            growth = done[-1][1] / done[0][1] - 1.0
            flatness.append((f"{model} {method} {done[0][0]}->{done[-1][0]}: {growth:+.1%}",
                             abs(growth) <= FLATNESS_TARGET))
    accuracy = [(_accuracy_figure(r, r["quantlab_best_method"], r["quantlab_best_accuracy"]),
                 r["accuracy_delta"] >= -ACCURACY_TOLERANCE[r["metric"]])
                for r in table if r["accuracy_delta"] is not None]
    per_sample = "marginal cost per sample; whole run where only one size completed"
    named = [
        (f"quantlab entropy >= {SPEEDUP_TARGET:.0f}x faster per sample than ORT's "
         f"{SPEEDUP_PEER} ({per_sample})", speed),
        (f"quantlab entropy <= {FLOOR_RATIO_TARGET:.0f}x the FP32 forward floor ({per_sample})",
         floor),
        (f"quantlab peak RSS < {PEAK_RSS_TARGET / 1e9:.0f} GB", memory),
        (f"quantlab peak RSS flat across sizes (within {FLATNESS_TARGET:.0%})", flatness),
        ("quantlab's best method INT8 accuracy >= ORT's best method, at each size (ties within "
         f"{ACCURACY_TOLERANCE['mAP']} mAP / {ACCURACY_TOLERANCE['SQNR dB']} dB)", accuracy),
    ]
    return [dict(zip(("target", "verdict", "figures"), (name, *_verdict(checks)), strict=True))
            for name, checks in named]


# ---------------------------------------------------------------- parent: printing


def _number(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def display_row(row: Mapping, metric: str) -> dict[str, str]:
    """One result row, formatted for the printed table."""
    accuracy = row.get("accuracy")
    return {
        "model": row["model"], "size": str(row["size"]), "tool": row["tool"],
        "method": row["method"], "status": row["status"],
        "wall s": _number(row.get("wall_s"), "{:.2f}"),
        "collect s": _number(row.get("collect_s"), "{:.2f}"),
        "calibrate s": _number(row.get("calibrate_s"), "{:.2f}"),
        "other s": _number(row.get("other_s"), "{:.2f}"),
        "peak RSS MiB": _number(row["peak_rss"] / MIB if "peak_rss" in row else None, "{:.0f}"),
        "accuracy": "-" if accuracy is None else f"{accuracy:.4g} {metric}",
    }


def report(results: Mapping) -> None:
    """Print the results table, per-sample costs, ratios, scale checks and targets."""
    rows, costs, table = results["rows"], results["per_sample_costs"], results["ratios"]
    print("\n" + format_table([display_row(r, results["metrics"][r["model"]]) for r in rows]))
    for r in rows:
        if "error" in r:
            print(f"  {r['model']} {r['size']} {r['tool']} {r['method']}: {r['error']}")
    print("\nLargest size completed:")
    for c in costs:
        largest = max(c["ms_per_sample"], default="none")
        print(f"  {c['model']} {c['tool']} {c['method']}: {largest}")
    if costs:
        sizes = sorted({r["size"] for r in rows})
        print("\nCost per sample, ms: whole run (wall / samples) at each size, and marginal "
              "(extra wall per extra sample from the smallest to the largest completed size):")
        print(format_table([{
            "model": c["model"], "tool": c["tool"], "method": c["method"],
            **{f"whole run {size}": _number(c["ms_per_sample"].get(size), "{:.2f}")
               for size in sizes},
            "marginal": _number(c["marginal_ms_per_sample"], "{:.2f}"),
            "over": "-" if c["marginal_sizes"] is None else "{}->{}".format(*c["marginal_sizes"]),
        } for c in costs]))
    if any(c["marginal_ms_per_sample"] is not None for c in costs):
        print(f"\nquantlab entropy on marginal cost per sample (the speed targets; "
              f"ORT {', '.join(ORT_ENTROPY_METHODS[1:])} as information):")
        print(format_table([{
            "model": m["model"],
            **{f"x faster than ORT {method}": _number(m["speedup_vs_ort"][method], "{:.1f}")
               for method in ORT_ENTROPY_METHODS},
            "ceiling (ORT Entropy / floor)": _number(m["speedup_ceiling"], "{:.1f}"),
            "x floor": _number(m["time_vs_floor"], "{:.2f}"),
            "x exposed floor": _number(m["time_vs_exposed_floor"], "{:.2f}"),
        } for m in results["marginal_ratios"]]))
    elif costs:
        print("  Marginal cost not measured: no configuration completed at two sizes. The "
              "speed targets are judged on whole-run cost (marked \"whole run\").")
    if table:
        print("\nPer model and size: quantlab entropy on whole-run wall time (fixed costs "
              "included), INT8 accuracy vs ORT's best method:")
        print(format_table([{
            "model": r["model"], "size": str(r["size"]),
            **{f"x faster than ORT {method}": _number(r["speedup_vs_ort"][method], "{:.1f}")
               for method in ORT_ENTROPY_METHODS},
            "x floor": _number(r["time_vs_floor"], "{:.2f}"),
            "quantlab best - ORT best": "-" if r["accuracy_delta"] is None else
            f"{r['accuracy_delta']:+.4g} {r['metric']} "
            f"({r['quantlab_best_method']} vs {r['ort_best_method']})",
            "quantlab entropy - ORT best": "-" if r["entropy_accuracy_delta"] is None else
            f"{r['entropy_accuracy_delta']:+.4g} {r['metric']}",
        } for r in table]))
    print("\nDo the methods write different scales?")
    for c in results["scale_checks"]:
        verdict = ("IDENTICAL: the method setting had no effect" if c["different"] == 0
                   else f"{c['different']}/{c['tensors']} differ, median ratio "
                        f"{c['median_ratio']:.3f}")
        print(f"  {c['model']} {c['size']} {c['tool']} {c['methods']}: {verdict}")
    print("\nTargets:")
    for v in results["targets"]:
        print(f"  {v['verdict']:<12} {v['target']}\n{'':15}{v['figures']}")
    entropy_figures = entropy_accuracy_figures(table)
    if entropy_figures:
        print(f"  {'INFO':<12} quantlab entropy INT8 accuracy vs ORT's best method "
              f"(information, not a target)\n{'':15}{entropy_figures}")


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; sizes are checked here, where they enter."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help="calibration sample counts (multiples of the batch size, 32)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--quick", action="store_true",
                        help=f"only {QUICK_SIZES[0]} samples (a smoke check)")
    parser.add_argument("--repeats", type=int, default=3,
                        help=f"runs of each configuration shorter than {REPEAT_BELOW_S:.0f} s; "
                             "the fastest is kept (default 3)")
    parser.add_argument("--memory-limit-gb", type=float, default=16.0,
                        help="address-space and RSS limit of each child, GiB (default 16)")
    parser.add_argument("--time-limit", type=float, default=1200.0,
                        help="wall-time limit of each child, seconds (default 1200)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep models and runs here (default: a temporary folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes = list(QUICK_SIZES)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}.")
    # ORT's histogram calibrators stack the batches, so all must have the same size.
    bad = [s for s in args.sizes if s < BATCH_SIZE or s % BATCH_SIZE]
    if bad:
        parser.error(f"sizes {bad} are not positive multiples of the batch size {BATCH_SIZE}")
    args.sizes = sorted(set(args.sizes))
    return args


def prepare(models: Sequence[str], folder: Path, count: int) -> tuple[list[Subject], dict]:
    """Each model with `count` calibration samples; a model whose data are missing is skipped.

    Returns the prepared subjects and, per skipped model, why.
    """
    from quantlab.errors import QuantlabError

    subjects, skipped = [], {}
    for name in models:
        (folder / name).mkdir(parents=True, exist_ok=True)
        try:
            subjects.append(PREPARE[name](folder / name, count))
        except QuantlabError as exc:
            skipped[name] = str(exc)
            print(f"[{name}] skipped: {exc}", flush=True)
    return subjects, skipped


def benchmark(args: argparse.Namespace, folder: Path) -> dict:
    """Prepare every model, warm up, run every configuration at every size; return all results."""
    subjects, skipped = prepare(args.models, folder, max(args.sizes))
    if subjects:
        warm_up(subjects[0], args)
    rows = []
    for subject in subjects:
        failed_at: dict[tuple[str, str], int] = {}
        for size in args.sizes:
            for tool, method in CONFIGS:
                if (tool, method) in failed_at:
                    rows.append({"model": subject.name, "size": size, "tool": tool,
                                 "method": method,
                                 "status": f"skipped (failed at {failed_at[tool, method]})"})
                    continue
                row = run_config(subject, size, tool, method,
                                 run_folder(folder, subject.name, size, tool, method), args)
                if row["status"] != "ok":
                    failed_at[tool, method] = size
                rows.append(row)
                print(f"[{subject.name} {size}] {tool} {method}: {row['status']}, "
                      f"{_number(row.get('wall_s'), '{:.1f} s')}, "
                      f"{row.get('peak_rss', 0) / MIB:.0f} MiB", flush=True)
    metrics = {subject.name: subject.metric for subject in subjects}
    table = ratios(rows, metrics)
    costs = per_sample_costs(rows)
    marginal = marginal_ratios(costs)
    return {"rows": rows, "metrics": metrics, "skipped_models": skipped,
            "per_sample_costs": costs, "marginal_ratios": marginal, "ratios": table,
            "scale_checks": scale_checks(folder, rows),
            "targets": targets(rows, table, marginal)}


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark (or, with --child, one configuration of it)."""
    args = parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return
    start = time.monotonic()
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        folder = args.workdir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="quantlab-calibration-bench-")))
        results = benchmark(args, folder)
    report(results)
    elapsed = time.monotonic() - start
    print(f"\nElapsed {elapsed / 60:.1f} min; load average {load_before[0]:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end (2+ on 2 cores means the timings are contended).")
    import onnxruntime

    import quantlab

    stamp = datetime.now()
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"calibration-{stamp:%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps({
        "date": stamp.isoformat(timespec="seconds"),
        "command": sys.argv,
        "settings": {"sizes": args.sizes, "models": args.models, "batch_size": BATCH_SIZE,
                     "memory_limit_gb": args.memory_limit_gb, "time_limit_s": args.time_limit},
        "machine": {"cpus": os.cpu_count(), "memory_gb": psutil.virtual_memory().total / 1e9,
                    "platform": platform.platform(), "load_average_start": load_before,
                    "load_average_end": os.getloadavg()},
        "versions": {"quantlab": quantlab.__version__, "onnxruntime": onnxruntime.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "elapsed_s": elapsed,
        **results,
    }, indent=1, default=float))
    print(f"Results: {path}")


if __name__ == "__main__":
    main()
