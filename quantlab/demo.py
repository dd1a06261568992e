"""`quantlab demo`: the zoo end to end — calibrate, validate, plan — in one report.

Every zoo model is exported, calibrated with every method and evaluated FP32 vs
INT8. The model INT8 hurts, shapes-det (PLANNED), is then validated layer by
layer in local mode (which layer first diverges) and planned under a 1-point mAP
budget (which units leave INT8, certified on the held-out split), with the
trtexec commands that build its engine. Writes ``<out>/report.html``
(self-contained; its first section is that story in numbers), ``<out>/summary.json``
(the same figures for machines) and one artifact folder per model
(``<out>/<model>/``, with ``validate/`` and ``plan/`` for PLANNED).
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from quantlab import plan, zoo
from quantlab.api import PlanOptions, plan_model
from quantlab.calibration import calibrate, pipeline, qdq
from quantlab.data import DataOptions, open_data
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend, optimized_op_types
from quantlab.errors import OutputExistsError
from quantlab.evaluation import tasks
from quantlab.evaluation.validate import validate
from quantlab.experiments.experiment import check_output, output_folder
from quantlab.experiments.records import DemoSummary
from quantlab.experiments.report import Section, write_report
from quantlab.experiments.report.demo import (
    calibration_html,
    latency_section,
    layer_text,
    overview_section,
    plan_html,
    story_section,
)
from quantlab.graph import input_specs
from quantlab.planner.flow import PlanSettings
from quantlab.progress import progress_bar

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
# The zoo model INT8 hurts (11 points of mAP): the demo validates and plans it.
PLANNED = "shapes-det"
# Its budget: 1 point of mAP@[.5:.95], the README's example.
PLAN_MAX_DROP = 0.01
# Held-out images of the local validation: enough for every layer's SQNR to settle
# (the first divergence is the same on the whole split), a few seconds of work.
VALIDATE_SAMPLES = 64
# Layers with the largest local error named in the story.
WORST_LAYERS = 3


def _log(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def _demo_folder(out: Path, force: bool) -> AbstractContextManager[Path]:
    """The staging folder of the demo's output (see experiment.output_folder).

    Only the demo's own files are replaced (DemoSummary.FILES and a folder per zoo model):
    an earlier demo's without force, the same names in any other folder with force.
    Nothing else in `out` (the user's notes, projects, other folders) is ever touched.
    """
    is_old_demo = DemoSummary.holds(out)
    produces = (*DemoSummary.FILES, *zoo.names())
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
    def bar(batches):
        return progress_bar(batches, desc=f"[{entry.name}] evaluate {label}", unit="batch",
                            enabled=progress, leave=False)

    return tasks.evaluate(tasks.Task.from_zoo(entry, eval_set), backend.run,
                          list(tasks.zoo_batches(entry, eval_set)), progress=bar)


def run_model(
    name: str, out: Path, methods: Sequence[str], eval_limit: int | None, progress: bool,
    named: Path | None = None,
) -> tuple[dict, list[Section]]:
    """Calibrate and evaluate `name` with every method (:func:`_calibrations`); for PLANNED
    also validate and plan. Returns the model's summary record and its report sections.
    `named`: the folder `out` becomes (`out` may be the demo's staging folder)."""
    record, best = _calibrations(name, out, methods, eval_limit, progress)
    sections = [Section(name, calibration_html(record), anchor=name)]
    if name == PLANNED:
        record["validation"] = _validate(zoo.get(name), best, out / name / "validate",
                                         progress)
        del best  # the plan runs in its own memory budget
        record["plan"] = _plan(name, out / name / "plan", methods, eval_limit, progress,
                               (named or out) / name / "plan")
        decided = plan.Plan.load(out / name / "plan" / "plan.json")
        sections.insert(0, story_section(record, decided, out / name / "plan"))
        sections.append(Section(f"{name}: precision plan", plan_html(record["plan"], decided),
                                anchor="plan"))
    return record, sections


def _calibrations(name: str, out: Path, methods: Sequence[str], eval_limit: int | None,
                  progress: bool) -> tuple[dict, pipeline.CalibrationResult]:
    """Export, collect statistics once, then calibrate, quantize and evaluate with each of
    `methods`; write the artifacts of the best method. Returns the summary record and the
    best calibration (the other methods' models and sessions are freed on return)."""
    entry = zoo.get(name)
    _log(f"[{name}] export to ONNX")
    model = pipeline.export_zoo_model(name)
    inputs = input_specs(model)
    source = open_data(entry.calibration_set(), inputs, batch_size=32)
    # As `quantlab calibrate` does by default: depthwise inputs equalized where it helps,
    # decided inside the statistics pass.
    _log(f"[{name}] collect statistics on {source.num_samples} calibration samples")
    index, repaired, stats = pipeline.equalized_statistics(
        model, source, qdq.activation_tensors_to_calibrate, pipeline.Phases(progress))
    model = index.model
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
        results[method].repairs = repaired
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
    return record, results[best]


def _validate(entry, result: pipeline.CalibrationResult, out: Path, progress: bool) -> dict:
    """Local-mode validation of the best calibration on VALIDATE_SAMPLES held-out samples:
    its first divergence and its WORST_LAYERS largest errors as plain records (the report
    and per-layer table are written into `out`)."""
    eval_set = entry.eval_set(VALIDATE_SAMPLES)
    _log(f"[{entry.name}] validate layer by layer (local mode) on {len(eval_set.inputs)} "
         "held-out samples")
    data = open_data(eval_set.inputs, input_specs(result.model), batch_size=32)
    validation = validate(result.model, result.qdq_model, data, out,
                          task=tasks.Task.from_zoo(entry, eval_set), mode="local",
                          progress=progress, title=f"Validation of {entry.name} (local mode)")
    pair = validation.pairs[-1]
    nodes = {node.name: node for node in result.model.graph.node}

    def layer(tensor: str, node: str, op_type: str, sqnr_db: float) -> dict:
        return {"tensor": tensor, "node": node, "op_type": op_type, "sqnr_db": float(sqnr_db),
                "depthwise": _is_depthwise(result.model, nodes[node])}

    found = pair.divergence
    worst = [layer(row.tensor, row.node, row.op_type, row.sqnr_db) for row in
             pair.table.sort_values("sqnr_db").head(WORST_LAYERS).itertuples(index=False)]
    record = {"samples": len(eval_set.inputs), "folder": f"{entry.name}/validate",
              "divergence": found and layer(found.tensor, found.node, found.op_type,
                                            found.sqnr_db),
              "worst": worst}
    _log(f"[{entry.name}] first divergence: {layer_text(record['divergence'])}; largest "
         f"errors: {'; '.join(layer_text(w) for w in worst)}")
    return record


def _is_depthwise(model, node) -> bool:
    """A Conv with one input channel per group."""
    if node.op_type != "Conv":
        return False
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    weight = next((i for i in model.graph.initializer if i.name == node.input[1]), None)
    return group > 1 and weight is not None and weight.dims[1] == 1


def plan_argv(name: str, out: str, methods: Sequence[str], eval_limit: int | None) -> list[str]:
    """The `quantlab plan` command line the demo runs for zoo model `name`."""
    return [name, "--data", "zoo", "--eval", "zoo", "--metric",
            tasks.PRIMARY_METRIC[zoo.get(name).task], "--max-drop", f"{PLAN_MAX_DROP:g}",
            *([] if set(methods) == set(calibrate.METHODS) else ["--calibrators", *methods]),
            *(["--max-samples", str(eval_limit)] if eval_limit else []), "--out", out]


def plan_settings(name: str, methods: Sequence[str], eval_limit: int | None
                  ) -> tuple[PlanOptions, DataOptions]:
    """The plan of zoo model `name` as :func:`plan_argv`'s command line gives it."""
    planner = PlanSettings(metric=tasks.PRIMARY_METRIC[zoo.get(name).task],
                           max_drop=PLAN_MAX_DROP)
    calibrators = calibrate.METHODS if set(methods) == set(calibrate.METHODS) else tuple(methods)
    return PlanOptions(planner, calibrators=calibrators), DataOptions(max_samples=eval_limit)


def _plan(name: str, out: Path, methods: Sequence[str], eval_limit: int | None,
          progress: bool, named: Path) -> dict:
    """Plan `name` into `out` (plan.json, the models, trtexec.txt, its own report) as
    `quantlab plan` does, its next steps naming `named` (where `out` ends up), and return
    its figures for the story."""
    folder = f"{name}/plan"  # where it ends up, relative to the demo's folder
    shown = "quantlab plan " + " ".join(plan_argv(name, folder, methods, eval_limit))
    _log(f"[{name}] {shown}")
    options, reading = plan_settings(name, methods, eval_limit)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # its lines name the staging folder
        outcome = plan_model(name, "zoo", "zoo", options, out, data_options=reading,
                             progress=progress, named=named)
    for line in [*printed.getvalue().splitlines(), *outcome.lines(notes=progress)]:
        _log(f"[{name}] {line.replace(str(out), folder)}")
    summary = outcome.summary
    return {"command": shown, "folder": folder, "max_drop": PLAN_MAX_DROP,
            "int8_mac_share": summary.int8_mac_share, "certificate": summary.certificate,
            "model_runs": sum(e["model_run"] for e in summary.evaluations),
            "repairs": [r["repair"] for r in summary.repairs
                        if r["chosen"] and r["repair"] != "none"]}


def run_demo(
    out: str | os.PathLike = "reports/demo",
    models: Sequence[str] | None = None,
    methods: Sequence[str] = calibrate.METHODS,
    eval_limit: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> DemoSummary:
    """Run the demo for `models` (default: every zoo model) and write report and summary."""
    out = Path(out)
    names = list(models or zoo.names())
    with _demo_folder(out, force) as staging:
        started = time.perf_counter()
        records, story, details = [], [], []
        for name in names:
            record, sections = run_model(name, staging, methods, eval_limit, progress, out)
            records.append(record)
            story += [s for s in sections if s.anchor == "story"]
            details += [s for s in sections if s.anchor != "story"]
        summary = DemoSummary(methods=list(methods),
                              seconds=round(time.perf_counter() - started, 1), models=records)
        summary.save(staging)
        write_report(
            staging / "report.html",
            "quantlab demo: calibrate, validate and plan INT8 for TensorRT",
            [*story, overview_section(records), *details, latency_section(records, LATENCY_BATCH)],
            subtitle=f"Every zoo model exported, calibrated ({', '.join(methods)}), quantized "
            f"to Q/DQ INT8 and evaluated in ONNX Runtime; {PLANNED} validated layer by layer "
            f"and planned under a {100 * PLAN_MAX_DROP:g}-point budget. "
            f"{summary.seconds:.0f} s on {os.cpu_count()} CPU cores.",
        )
    _log(f"wrote {out / 'report.html'} and {out / 'summary.json'} in {summary.seconds:.0f} s")
    return summary
