"""`quantlab demo`: every zoo model end to end — export, calibrate, Q/DQ, evaluate FP32 vs INT8.

Writes ``<out>/report.html`` (self-contained), ``<out>/summary.json`` (the same
figures for machines) and one artifact folder per model (``<out>/<model>/``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pandas as pd
from markupsafe import escape
from tqdm.auto import tqdm

from quantlab import calibrate, collect, pipeline, qdq, tasks, zoo
from quantlab.backends.onnxruntime import OnnxRuntimeBackend, optimized_op_types
from quantlab.data import open_data
from quantlab.errors import DataError, OutputExistsError
from quantlab.experiment import check_output, output_folder, read_record, write_json
from quantlab.graph import input_specs
from quantlab.report import Section, figure_html, table_html, write_report

DEMO_MARKER = "quantlab demo"
# What the demo writes into its folder, besides one folder per zoo model; nothing else there
# is replaced, even with --force.
DEMO_FILES = ("report.html", "summary.json")
# Integer kernels ONNX Runtime substitutes for Q/DQ groups; their presence in the
# optimized graph is the evidence that the INT8 model really runs in int8.
INTEGER_OPS = (
    "QLinearConv",
    "QLinearMatMul",
    "MatMulInteger",
    "QGemm",
    "ConvInteger",
    "QLinearAdd",
    "QLinearGlobalAveragePool",
    "QLinearSigmoid",
    "QLinearMul",
    "QLinearConcat",
    "QLinearAveragePool",
    "QLinearLeakyRelu",
    "QLinearSoftmax",
)
LATENCY_BATCH = 32
LATENCY_REPEATS = 15


def _log(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def _demo_folder(out: Path, force: bool) -> AbstractContextManager[Path]:
    """The staging folder of the demo's output (see experiment.output_folder).

    Only the demo's own files are replaced (DEMO_FILES and a folder per zoo model):
    an earlier demo's without force, the same names in any other folder with force.
    Nothing else in `out` (the user's notes, projects, other folders) is ever touched.
    """
    try:
        is_old_demo = read_record(out / "summary.json", "demo summary").get(
            "generator") == DEMO_MARKER
    except DataError:
        is_old_demo = False
    produces = (*DEMO_FILES, *zoo.names())
    try:
        check_output(out, force=force or is_old_demo, produces=produces)
    except OutputExistsError as exc:
        raise OutputExistsError(
            f"{exc} (quantlab demo replaces only its own report.html, summary.json and model "
            "folders, and those of an earlier demo without --force)"
        ) from None
    return output_folder(out, force=force or is_old_demo, produces=produces)


def median_latency_ms(backend: OnnxRuntimeBackend, batch: dict[str, np.ndarray]) -> float:
    """Median wall time of one `backend.run(batch)` in milliseconds, after warm-up."""
    for _ in range(3):
        backend.run(batch)
    times = []
    for _ in range(LATENCY_REPEATS):
        start = time.perf_counter()
        backend.run(batch)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _evaluate(entry, backend: OnnxRuntimeBackend, eval_set, label: str, progress: bool) -> dict:
    bar = (
        (lambda it: tqdm(it, desc=f"[{entry.name}] evaluate {label}", leave=False))
        if progress
        else None
    )
    return tasks.evaluate(tasks.Task.from_zoo(entry, eval_set), backend.run,
                          list(tasks.zoo_batches(entry, eval_set)), progress=bar)


def run_model(
    name: str, out: Path, methods: Sequence[str], eval_limit: int | None, progress: bool
) -> dict:
    """Export, collect statistics once, then calibrate, quantize and evaluate with each of
    `methods`; write the artifacts of the best method; return the model's summary record."""
    entry = zoo.get(name)
    _log(f"[{name}] export to ONNX")
    model = pipeline.export_zoo_model(name)
    inputs = input_specs(model)
    source = open_data(entry.calibration_set(), inputs, batch_size=32)
    _log(f"[{name}] collect statistics on {source.num_samples} calibration samples")
    stats = collect.collect(
        model, source, qdq.activation_tensors_to_calibrate(model), progress=progress
    )
    eval_set = entry.eval_set(eval_limit)
    metric = tasks.PRIMARY_METRIC[entry.task]
    fp32 = OnnxRuntimeBackend(model, name="onnxruntime fp32")
    record = {
        "name": name,
        "task": entry.task,
        "description": entry.description,
        "metric": metric,
        "eval_samples": len(eval_set.inputs),
        "calibration_samples": stats.num_samples,
        "metrics_fp32": _evaluate(entry, fp32, eval_set, "fp32", progress),
        "methods": {},
    }
    results, int8 = {}, {}
    for method in methods:
        results[method] = pipeline.calibrate_from_stats(model, stats, source, method)
        int8[method] = OnnxRuntimeBackend(results[method].qdq_model, name=f"int8 {method}")
        metrics = _evaluate(entry, int8[method], eval_set, f"int8 ({method})", progress)
        record["methods"][method] = metrics
        _log(f"[{name}] INT8 ({method}): {tasks.METRIC_LABELS[metric]} {metrics[metric]:.4f}")
    # The best method's artifacts are written; ties go to the earlier (default) method.
    best = max(methods, key=lambda m: record["methods"][m][metric])
    pipeline.write_results(results[best], out / name, force=True)
    record.update(
        method=best,
        metrics_int8=record["methods"][best],
        fp32=record["metrics_fp32"][metric],
        int8=record["methods"][best][metric],
    )
    batch = {entry.input_name: eval_set.inputs[:LATENCY_BATCH]}
    record["fp32_latency_ms"] = median_latency_ms(fp32, batch)
    record["int8_latency_ms"] = median_latency_ms(int8[best], batch)
    record["delta"] = record["int8"] - record["fp32"]
    record["speedup"] = record["fp32_latency_ms"] / record["int8_latency_ms"]
    ops = optimized_op_types(results[best].qdq_model)
    record["int8_kernels"] = {op: ops[op] for op in INTEGER_OPS if ops[op]}
    _log(
        f"[{name}] {tasks.METRIC_LABELS[metric]}: FP32 {record['fp32']:.4f}  "
        f"INT8 {record['int8']:.4f} ({best}, delta {record['delta']:+.4f}); "
        f"latency {record['fp32_latency_ms']:.1f} -> {record['int8_latency_ms']:.1f} ms"
    )
    return record


def _summary_frame(records: Sequence[dict]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "model": [r["name"] for r in records],
            "task": [r["task"] for r in records],
            "metric": [tasks.METRIC_LABELS[r["metric"]] for r in records],
            "FP32": [r["fp32"] for r in records],
            "INT8": [r["int8"] for r in records],
            "INT8 calibration": [r["method"] for r in records],
            "delta": [r["delta"] for r in records],
            f"FP32 ms / batch {LATENCY_BATCH}": [r["fp32_latency_ms"] for r in records],
            f"INT8 ms / batch {LATENCY_BATCH}": [r["int8_latency_ms"] for r in records],
            "INT8 speed-up": [r["speedup"] for r in records],
            "INT8 kernels in ORT": [
                ", ".join(f"{op} x{n}" for op, n in r["int8_kernels"].items()) or "none"
                for r in records
            ],
        }
    )


def _accuracy_figure(records: Sequence[dict]):
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = np.arange(len(records))
    labels = [f"{r['name']}\n({tasks.METRIC_LABELS[r['metric']]})" for r in records]
    for offset, key, color in ((-0.2, "fp32", "#5b6575"), (0.2, "int8", "#76b900")):
        values = [r[key] for r in records]
        bars = left.bar(x + offset, values, 0.4, label=key.upper(), color=color)
        left.bar_label(bars, fmt="%.3f", fontsize=8)
        latency = [r[f"{key}_latency_ms"] for r in records]
        right.bar(x + offset, latency, 0.4, label=key.upper(), color=color)
    left.set_xticks(x, labels)
    left.set_ylim(0, 1.08)
    left.set_title("Task metric on the held-out split")
    left.legend(loc="lower right")
    right.set_xticks(x, [r["name"] for r in records])
    right.set_ylabel(f"ms per batch of {LATENCY_BATCH} (median)")
    right.set_title("ONNX Runtime CPU latency")
    right.legend()
    figure.tight_layout()
    return figure


def _per_class_figure(record: dict):
    import matplotlib.pyplot as plt

    classes = list(record["metrics_fp32"]["per_class"])
    figure, axis = plt.subplots(figsize=(6, 3.2))
    x = np.arange(len(classes))
    for offset, key, color in ((-0.2, "fp32", "#5b6575"), (0.2, "int8", "#76b900")):
        values = [record[f"metrics_{key}"]["per_class"][c] for c in classes]
        axis.bar(x + offset, values, 0.4, label=key.upper(), color=color)
    axis.set_xticks(x, classes)
    axis.set_ylabel("AP@[.5:.95]")
    axis.set_title(f"{record['name']}: per-class AP")
    axis.legend(loc="lower right")
    figure.tight_layout()
    return figure


def _sections(records: Sequence[dict]) -> list[Section]:
    summary = table_html(
        _summary_frame(records),
        caption=(
            "Metrics computed on each model's held-out evaluation split; INT8 = the Q/DQ model "
            "run by ONNX Runtime (CPU) with integer kernels."
        ),
    ) + (
        "<p>Latency is a sanity check, not a deployment figure: on CPU, ONNX Runtime's int8 "
        "kernels pay for quantize/dequantize and NCHW-to-NHWC layout changes, which dominate "
        "models this small. The deployment latency is the TensorRT engine's.</p>"
    )
    sections = [
        Section(
            "Summary",
            summary
            + figure_html(
                _accuracy_figure(records), "FP32 vs INT8 task metric and latency per model"
            ),
        )
    ]
    for record in records:
        metrics = pd.DataFrame(
            {
                "metric": [
                    tasks.METRIC_LABELS.get(k, k)
                    for k, v in record["metrics_fp32"].items()
                    if not isinstance(v, dict)
                ],
                "FP32": [v for v in record["metrics_fp32"].values() if not isinstance(v, dict)],
                "INT8": [v for v in record["metrics_int8"].values() if not isinstance(v, dict)],
            }
        )
        label = tasks.METRIC_LABELS[record["metric"]]
        by_method = pd.DataFrame(
            {
                "calibration method": list(record["methods"]),
                f"INT8 {label}": [m[record["metric"]] for m in record["methods"].values()],
                "delta vs FP32": [
                    m[record["metric"]] - record["fp32"] for m in record["methods"].values()
                ],
            }
        )
        body = (
            f"<p>{escape(record['description'].rstrip('.'))}. Statistics collected once on "
            f"{record['calibration_samples']} calibration samples; every calibration method "
            f"computed its scales from them; evaluated on {record['eval_samples']} held-out "
            f"samples. The best method, <code>{record['method']}</code>, wrote the artifacts "
            f"in <code>{record['name']}/</code> (model.onnx, model.int8.onnx, scales.json, "
            "stats.npz; <code>quantlab calibrate --trt-version</code> adds a TensorRT "
            "calibration cache).</p>"
            + table_html(by_method, caption="INT8 metric by calibration method")
            + table_html(metrics, caption=f"All metrics, FP32 vs INT8 ({record['method']})")
        )
        if record["task"] == "detection":
            body += figure_html(_per_class_figure(record), "Per-class AP, FP32 vs INT8")
        sections.append(Section(record["name"], body))
    return sections


def run_demo(
    out: str | os.PathLike = "reports/demo",
    models: Sequence[str] | None = None,
    methods: Sequence[str] = calibrate.METHODS,
    eval_limit: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict:
    """Run the demo for `models` (default: every zoo model) and write report and summary."""
    out = Path(out)
    names = list(models or zoo.names())
    with _demo_folder(out, force) as staging:
        started = time.perf_counter()
        records = [run_model(name, staging, methods, eval_limit, progress) for name in names]
        summary = {
            "generator": DEMO_MARKER,
            "methods": list(methods),
            "seconds": round(time.perf_counter() - started, 1),
            "models": records,
        }
        write_json(staging / "summary.json", summary)
        write_report(
            staging / "report.html",
            "quantlab demo: INT8 accuracy of the reference models",
            _sections(records),
            subtitle=f"Every zoo model exported, calibrated ({', '.join(methods)}), quantized "
            "to Q/DQ INT8 and evaluated in ONNX Runtime.",
        )
    _log(f"wrote {out / 'report.html'} and {out / 'summary.json'} in {summary['seconds']:.0f} s")
    return summary
