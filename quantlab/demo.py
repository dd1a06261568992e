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
import pandas as pd
from markupsafe import Markup, escape
from tqdm import tqdm

from quantlab import calibrate, collect, pipeline, plan, qdq, tasks, zoo
from quantlab.api import PlanOptions, plan_model
from quantlab.backends.onnxruntime import OnnxRuntimeBackend, optimized_op_types
from quantlab.data import DataOptions, open_data
from quantlab.errors import OutputExistsError
from quantlab.experiment import check_output, output_folder
from quantlab.graph import input_specs
from quantlab.planner.flow import PlanSettings
from quantlab.progress import progress_bar
from quantlab.records import DemoSummary
from quantlab.report import Section, figure_html, table_html, write_report
from quantlab.report.plan import COLUMNS as DECISION_COLUMNS
from quantlab.report.plan import (
    decisions_frame,
    reason_codes_html,
    reasons_legend,
    unit_strip_html,
)
from quantlab.validate import validate

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
    name: str, out: Path, methods: Sequence[str], eval_limit: int | None, progress: bool
) -> tuple[dict, list[Section]]:
    """Calibrate and evaluate `name` with every method (:func:`_calibrations`); for PLANNED
    also validate and plan. Returns the model's summary record and its report sections."""
    record, best = _calibrations(name, out, methods, eval_limit, progress)
    sections = [Section(name, _calibration_html(record), anchor=name)]
    if name == PLANNED:
        record["validation"] = _validate(zoo.get(name), best, out / name / "validate",
                                         progress)
        del best  # the plan runs in its own memory budget
        record["plan"] = _plan(name, out / name / "plan", methods, eval_limit, progress)
        decided = plan.Plan.load(out / name / "plan" / "plan.json")
        sections.insert(0, _story_section(record, decided, out / name / "plan"))
        sections.append(Section(f"{name}: precision plan", _plan_html(record["plan"], decided),
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
    # As `quantlab calibrate` does by default: depthwise inputs equalized where it helps.
    model, repaired = pipeline.equalized(model, source)
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
    _log(f"[{entry.name}] first divergence: {_layer_text(record['divergence'])}; largest "
         f"errors: {'; '.join(_layer_text(w) for w in worst)}")
    return record


def _layer_text(layer: dict | None) -> str:
    """``tensor (depthwise Conv node, 0.9 dB)``."""
    if layer is None:
        return "none"
    kind = "depthwise Conv" if layer["depthwise"] else layer["op_type"]
    return f"{layer['tensor']} ({kind} {layer['node']}, {layer['sqnr_db']:.1f} dB)"


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
          progress: bool) -> dict:
    """Plan `name` into `out` (plan.json, the models, trtexec.txt, its own report) as
    `quantlab plan` does, and return its figures for the story."""
    folder = f"{name}/plan"  # where it ends up, relative to the demo's folder
    shown = "quantlab plan " + " ".join(plan_argv(name, folder, methods, eval_limit))
    _log(f"[{name}] {shown}")
    options, reading = plan_settings(name, methods, eval_limit)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # its lines name the staging folder
        outcome = plan_model(name, "zoo", "zoo", options, out, data_options=reading,
                             progress=progress)
    for line in [*printed.getvalue().splitlines(), *outcome.lines(notes=progress)]:
        _log(f"[{name}] {line.replace(str(out), folder)}")
    summary = outcome.summary
    return {"command": shown, "folder": folder, "max_drop": PLAN_MAX_DROP,
            "int8_mac_share": summary.int8_mac_share, "certificate": summary.certificate,
            "model_runs": sum(e["model_run"] for e in summary.evaluations),
            "repairs": [r["repair"] for r in summary.repairs
                        if r["chosen"] and r["repair"] != "none"]}


def _story_section(record: dict, decided: plan.Plan, folder: Path) -> Section:
    """The first screen: FP32, all-INT8 and planned INT8 of PLANNED in numbers, the layer
    the validator names, the units the plan pins and why, the command that builds it."""
    label = tasks.METRIC_LABELS[record["metric"]]
    planned = record["plan"]
    certificate = planned["certificate"]
    budget = 100 * planned["max_drop"]
    lost = 100 * (record["fp32"] - record["int8"])
    rows = pd.DataFrame({
        "model": ["FP32", f"all INT8 ({record['method']}, the best of "
                          f"{len(record['methods'])} calibrators)",
                  "planned INT8" + (f" ({', '.join(planned['repairs'])})"
                                    if planned["repairs"] else "")],
        "INT8 share of MACs": ["0 %", "100 %", f"{planned['int8_mac_share']:.1%}"],
        label: [record["fp32"], record["int8"], certificate["value"]],
        "vs FP32, points": ["", f"{-lost:+.2f}",
                            f"{100 * (certificate['value'] - certificate['reference']):+.2f}"],
        f"within {budget:g} point": [
            "reference", "no" if lost > budget else "yes, not certified",
            f"certified: {certificate['confidence']:.0%} bound of the margin "
            f"{100 * certificate['interval'][0]:+.2f} points" if certificate["certified"]
            else "NOT certified"],
    })
    checked = record["validation"]
    where = Markup("the first layer below 30 dB SQNR is <code>{}</code>; the largest errors "
                   "are {}").format(
        _layer_text(checked["divergence"]),
        Markup(", ").join(Markup("<code>{}</code>").format(_layer_text(w))
                          for w in checked["worst"]))
    total = sum(d.macs for d in decided.units.values()) or 1
    pinned = {unit: d for unit, d in decided.units.items() if d.precision != "int8"}
    # The units a rule spoke about, whatever the measurement then decided, and the pins.
    shown = {unit: d for unit, d in decided.units.items() if d.reasons or unit in pinned}
    pins = pd.DataFrame({
        "unit": list(shown),
        "runs in": [d.precision.upper() for d in shown.values()],
        "share of MACs": [f"{d.macs / total:.2%}" for d in shown.values()],
        "reasons (hover a code)": [reason_codes_html(d.reasons) for d in shown.values()],
        "local INT8 SQNR, dB": [d.evidence.get("local_sqnr_int8_db", float("nan"))
                                for d in shown.values()],
        "output-noise rank": [d.evidence.get("output_rank") for d in shown.values()],
    })
    commands = [line for line in (folder / "trtexec.txt").read_text().splitlines()
                if line.startswith("trtexec")]
    build = next((line for line in commands if "--stronglyTyped" in line), commands[0])
    html = Markup("<p><b>{}</b>: {}. {} on its {} held-out images; INT8 is the Q/DQ model on "
                  "ONNX Runtime's integer kernels.</p>").format(
        record["name"], record["description"].rstrip("."), label, record["eval_samples"])
    html += Markup(table_html(rows, caption=f"FP32, all INT8 and the plan under a {budget:g}-"
                                            f"point {label} budget", columns={
        "model": ("name", "which model: FP32, every unit INT8, or the plan's mix"),
        "INT8 share of MACs": ("%", "share of the linear ops' multiply-accumulates run in INT8"),
        label: ("0-1", f"{label} on the held-out images"),
        "vs FP32, points": ("points", f"{label} minus FP32's, x 100"),
        f"within {budget:g} point": ("verdict", "whether the drop stays inside the budget; "
                                         "certified: the paired-bootstrap lower bound of the "
                                         "margin to the limit is above 0"),
    }))
    html += Markup("<ol><li><b>Calibrate</b>: one statistics pass, {} calibrators ({}); the best "
                   "all-INT8 model loses {:.1f} points.</li>").format(
        len(record["methods"]),
        ", ".join(f"{m} {v[record['metric']]:.3f}" for m, v in record["methods"].items()), lost)
    html += Markup("<li><b>Validate</b> layer by layer, each INT8 layer fed the FP32 inputs "
                   "(local mode, {} images): {} (<a href=\"{}/report.html\">"
                   "validation report</a>).</li>").format(
        record["validation"]["samples"], where, record["validation"]["folder"])
    repaired = (Markup(" with the repair(s) <code>{}</code>").format(", ".join(planned["repairs"]))
                if planned["repairs"] else "")
    kept = (Markup("{} of the {} units leave INT8, {:.1%} of the MACs").format(
        len(pinned), len(decided.units), 1 - planned["int8_mac_share"]) if pinned else
        Markup("every one of the {} units stays in INT8").format(len(decided.units)))
    unit_of = {node: d for d in decided.units.values() for node in d.nodes}
    after = [(w, unit_of[w["node"]]) for w in checked["worst"] if w["node"] in unit_of]
    remeasured = Markup("; the planner measures {} on their own in its plan").format(
        Markup(", ").join(Markup("<code>{}</code> {} at {:.1f} dB").format(
            w["node"], d.precision.upper(), d.evidence.get(f"local_sqnr_{d.precision}_db",
                                                            float("inf")))
            for w, d in after)) if after else ""
    html += Markup("<li><b>Plan</b> (<code>{}</code>): {}{}{}; certified on {} held-out images "
                   "after {} evaluation(s) of the real INT8 model (<a href=\"#plan\">the plan"
                   "</a>).</li>").format(planned["command"], kept, repaired, remeasured,
                                         certificate["samples"], planned["model_runs"])
    html += Markup("<li><b>Build</b> the engine in <code>{}/</code>, strongly typed from the "
                   "plan's Q/DQ model (TensorRT 10; the commands for other versions are in its "
                   "<code>trtexec.txt</code>, <code>quantlab build</code> runs them):<pre>{}</pre>"
                   "</li></ol>").format(
        planned["folder"], build)
    html += Markup(table_html(pins, caption="Units a rule flagged or the plan keeps out of "
                                            "INT8: reasons, and what was measured", columns={
        "unit": ("name", "a linear op (with what TensorRT fuses into it) the plan decides"),
        "runs in": ("precision", "what the plan runs it in"),
        "share of MACs": ("%", "its share of the linear ops' multiply-accumulates"),
        "reasons (hover a code)": ("codes", "rules and measurements that decided it (legend "
                                            "below)"),
        "local INT8 SQNR, dB": ("dB", "its output with INT8 inputs and weights against FP32, "
                                      "fed FP32 inputs, on the calibration samples"),
        "output-noise rank": ("1 = worst", "its rank by the output noise the planner "
                                           "predicts it adds in INT8"),
    }))
    html += reasons_legend(r for d in shown.values() for r in d.reasons)
    return Section(f"{record['name']}: from FP32 to a certified INT8 plan", html, anchor="story")


def _plan_html(planned: dict, decided: plan.Plan) -> str:
    """The plan in the demo's report: the strip of units and every unit's decision; its own
    report (front, evaluations, noise waterfall) is linked."""
    return (Markup("<p><code>{}</code> wrote <code>{}/</code>: plan.json, model.int8.onnx, "
                   "trtexec.txt and <a href=\"{}/report.html\">its report</a> (the predicted "
                   "front, every evaluation, the noise each pin removes).</p>").format(
        planned["command"], planned["folder"], planned["folder"])
        + unit_strip_html(decided)
        + Markup(table_html(decisions_frame(decided), caption="Decision per unit",
                            columns=DECISION_COLUMNS))
        + reasons_legend(r for d in decided.units.values() for r in d.reasons))


# Unit and one-line meaning of each column of the zoo's summary and latency tables.
SUMMARY_COLUMNS = {
    "model": ("name", "zoo model (quantlab zoo)"),
    "task": ("name", "what the model does, which sets its metric"),
    "metric": ("name", "the task metric on the held-out split"),
    "FP32": ("0-1", "the FP32 model's metric"),
    "INT8": ("0-1", "the all-INT8 model's metric (its best calibrator)"),
    "INT8 calibration": ("name", "that calibrator"),
    "delta": ("0-1", "INT8 minus FP32"),
}
LATENCY_COLUMNS = {
    "model": ("name", "zoo model"),
    f"FP32 ms / batch {LATENCY_BATCH}": ("ms", "median ONNX Runtime CPU time of one batch, FP32"),
    f"INT8 ms / batch {LATENCY_BATCH}": ("ms", "the same for the all-INT8 Q/DQ model"),
    "INT8 speed-up": ("x", "FP32 time / INT8 time"),
    "INT8 kernels in ORT": ("op x count", "integer kernels ONNX Runtime ran (QLinearConv, "
                                          "MatMulInteger, ...)"),
}


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
        }
    )


def _latency_frame(records: Sequence[dict]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "model": [r["name"] for r in records],
            f"FP32 ms / batch {LATENCY_BATCH}": [r["fp32_latency_ms"] for r in records],
            f"INT8 ms / batch {LATENCY_BATCH}": [r["int8_latency_ms"] for r in records],
            "INT8 speed-up": [r["speedup"] for r in records],
            "INT8 kernels in ORT": [
                ", ".join(f"{op} x{n}" for op, n in r["int8_kernels"].items()) or "none"
                for r in records
            ],
        }
    )


def _bars(axis, records: Sequence[dict], key: str, fmt: str | None = None) -> None:
    """FP32 and INT8 bars of `key` (``{}`` the precision) side by side per model."""
    x = np.arange(len(records))
    for offset, precision, color in ((-0.2, "fp32", "#5b6575"), (0.2, "int8", "#76b900")):
        bars = axis.bar(x + offset, [r[key.format(precision)] for r in records], 0.4,
                        label=precision.upper(), color=color)
        if fmt:
            axis.bar_label(bars, fmt=fmt, fontsize=8)


def _accuracy_figure(records: Sequence[dict]):
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.4))
    _bars(axis, records, "{}", "%.3f")
    axis.set_xticks(np.arange(len(records)),
                    [f"{r['name']}\n({tasks.METRIC_LABELS[r['metric']]})" for r in records])
    axis.set_ylim(0, 1.08)
    axis.set_title("Task metric on the held-out split, all INT8 (best calibrator)")
    axis.legend(loc="lower right")
    figure.tight_layout()
    return figure


def _latency_figure(records: Sequence[dict], machine: str):
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.2))
    _bars(axis, records, "{}_latency_ms")
    axis.set_xticks(np.arange(len(records)), [r["name"] for r in records])
    axis.set_ylabel(f"ms per batch of {LATENCY_BATCH} (median)")
    axis.set_title(f"ONNX Runtime on this CPU ({machine}): not TensorRT", fontsize=10)
    axis.legend()
    figure.tight_layout()
    return figure


def int8_dot_product() -> str | None:
    """The int8 dot-product instructions this CPU has (VNNI, ARM dotprod), '' for none,
    None where /proc/cpuinfo cannot be read."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    return ", ".join(f for f in ("avx512_vnni", "avx_vnni", "asimddp") if f in flags)


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


def _calibration_html(record: dict) -> str:
    """A model's calibration methods and metrics, FP32 vs the best method's INT8."""
    # COCO scores -1 where the split has no object of a size (map_large of 128 px images).
    shown = [k for k, v in record["metrics_fp32"].items() if not isinstance(v, dict) and v != -1]
    metrics = pd.DataFrame(
        {
            "metric": [tasks.METRIC_LABELS.get(k, k) for k in shown],
            "FP32": [record["metrics_fp32"][k] for k in shown],
            "INT8": [record["metrics_int8"][k] for k in shown],
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
        + table_html(by_method, caption="INT8 metric by calibration method", columns={
            "calibration method": ("name", "calibrator of every activation scale "
                                           "(docs/calibration.md)"),
            f"INT8 {label}": ("0-1", f"the all-INT8 model's {label} on the held-out samples"),
            "delta vs FP32": ("0-1", "INT8 minus FP32 on the same samples")})
        + table_html(metrics, caption=f"All metrics, FP32 vs INT8 ({record['method']})",
                     columns={"metric": ("name", "task metric on the held-out samples"),
                              "FP32": ("0-1", "the FP32 model's value"),
                              "INT8": ("0-1", f"the all-INT8 model's value ({record['method']})")})
    )
    if record["task"] == "detection":
        body += figure_html(_per_class_figure(record), "Per-class AP, FP32 vs INT8")
    return body


def _overview_section(records: Sequence[dict]) -> Section:
    summary = table_html(
        _summary_frame(records), columns=SUMMARY_COLUMNS,
        caption=(
            "Metrics computed on each model's held-out evaluation split; INT8 = the Q/DQ model "
            "run by ONNX Runtime (CPU) with integer kernels, every layer in INT8."
        ),
    )
    return Section("Every zoo model, all INT8", summary + figure_html(
        _accuracy_figure(records), "FP32 vs all-INT8 task metric per model"), anchor="zoo")


def _latency_section(records: Sequence[dict]) -> Section:
    found = int8_dot_product()
    machine = ("int8 dot-product instructions unknown" if found is None
               else f"with {found}" if found else "no int8 dot-product instructions")
    html = (
        "<p>A sanity check, not a deployment figure: the deployment latency is the TensorRT "
        "engine's (<code>quantlab build</code>). On CPU, ONNX Runtime's int8 kernels pay for "
        "quantize/dequantize and NCHW-to-NHWC layout changes, which dominate models this "
        "small; "
        + ("and this CPU lacks int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI), so "
           "they also widen to 16 bits.</p>" if found == "" else
           f"this CPU's int8 dot-product instructions: {found or 'unknown'}.</p>")
        + table_html(_latency_frame(records), caption="ONNX Runtime CPU latency, all INT8",
                     columns=LATENCY_COLUMNS)
        + figure_html(_latency_figure(records, machine),
                      f"ONNX Runtime CPU latency per batch of {LATENCY_BATCH} on this machine")
    )
    return Section("CPU latency in ONNX Runtime (not a TensorRT figure)", html,
                   anchor="latency")


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
            record, sections = run_model(name, staging, methods, eval_limit, progress)
            records.append(record)
            story += [s for s in sections if s.anchor == "story"]
            details += [s for s in sections if s.anchor != "story"]
        summary = DemoSummary(methods=list(methods),
                              seconds=round(time.perf_counter() - started, 1), models=records)
        summary.save(staging)
        write_report(
            staging / "report.html",
            "quantlab demo: calibrate, validate and plan INT8 for TensorRT",
            [*story, _overview_section(records), *details, _latency_section(records)],
            subtitle=f"Every zoo model exported, calibrated ({', '.join(methods)}), quantized "
            f"to Q/DQ INT8 and evaluated in ONNX Runtime; {PLANNED} validated layer by layer "
            f"and planned under a {100 * PLAN_MAX_DROP:g}-point budget. "
            f"{summary.seconds:.0f} s on {os.cpu_count()} CPU cores.",
        )
    _log(f"wrote {out / 'report.html'} and {out / 'summary.json'} in {summary.seconds:.0f} s")
    return summary
