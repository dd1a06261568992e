"""The demo's report (`quantlab demo`): the story of the planned model, each zoo model's
calibrations, the zoo overview and the CPU latency, with their figures.

Everything shown is the demo's records (:mod:`quantlab.demo` writes them into summary.json) and
the plan it made; this module runs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from markupsafe import Markup, escape

from quantlab.evaluation import tasks
from quantlab.experiments.report import Section, figure_html, table_html
from quantlab.experiments.report.plan import COLUMNS as DECISION_COLUMNS
from quantlab.experiments.report.plan import (
    decisions_frame,
    reason_codes_html,
    reasons_legend,
    unit_strip_html,
)
from quantlab.plan import Plan


def layer_text(layer: dict | None) -> str:
    """``tensor (depthwise Conv node, 0.9 dB)``."""
    if layer is None:
        return "none"
    kind = "depthwise Conv" if layer["depthwise"] else layer["op_type"]
    return f"{layer['tensor']} ({kind} {layer['node']}, {layer['sqnr_db']:.1f} dB)"


def story_section(record: dict, decided: Plan, folder: Path) -> Section:
    """The first screen: FP32, all-INT8 and planned INT8 of PLANNED in numbers, the layer
    the validator names, the units the plan pins and why, the command that builds it."""
    label = tasks.METRIC_LABELS[record["metric"]]
    planned = record["plan"]
    lost = 100 * (record["fp32"] - record["int8"])
    checked = record["validation"]
    where = Markup("the first layer below 30 dB SQNR is <code>{}</code>; the largest errors "
                   "are {}").format(
        layer_text(checked["divergence"]),
        Markup(", ").join(Markup("<code>{}</code>").format(layer_text(w))
                          for w in checked["worst"]))
    pinned = {unit: d for unit, d in decided.units.items() if d.precision != "int8"}
    # The units a rule spoke about, whatever the measurement then decided, and the pins.
    shown = {unit: d for unit, d in decided.units.items() if d.reasons or unit in pinned}
    commands = [line for line in (folder / "trtexec.txt").read_text().splitlines()
                if line.startswith("trtexec")]
    build = next((line for line in commands if "--stronglyTyped" in line), commands[0])
    html = Markup("<p><b>{}</b>: {}. {} on its {} held-out images; INT8 is the Q/DQ model on "
                  "ONNX Runtime's integer kernels.</p>").format(
        record["name"], record["description"].rstrip("."), label, record["eval_samples"])
    html += _outcomes_table(record, label, lost)
    html += Markup("<ol><li><b>Calibrate</b>: one statistics pass, {} calibrators ({}); the best "
                   "all-INT8 model loses {:.1f} points.</li>").format(
        len(record["methods"]),
        ", ".join(f"{m} {v[record['metric']]:.3f}" for m, v in record["methods"].items()), lost)
    html += Markup("<li><b>Validate</b> layer by layer, each INT8 layer fed the FP32 inputs "
                   "(local mode, {} images): {} (<a href=\"{}/report.html\">"
                   "validation report</a>).</li>").format(
        record["validation"]["samples"], where, record["validation"]["folder"])
    html += _plan_step(planned, decided, pinned, checked["worst"])
    html += Markup("<li><b>Build</b> the engine in <code>{}/</code>, strongly typed from the "
                   "plan's Q/DQ model (TensorRT 10; the commands for other versions are in its "
                   "<code>trtexec.txt</code>, <code>quantlab build</code> runs them):<pre>{}</pre>"
                   "</li></ol>").format(
        planned["folder"], build)
    html += _pins_table(decided, shown)
    html += reasons_legend(r for d in shown.values() for r in d.reasons)
    return Section(f"{record['name']}: from FP32 to a certified INT8 plan", html, anchor="story")


def _outcomes_table(record: dict, label: str, lost: float) -> Markup:
    """FP32, all INT8 and the plan: share of MACs in INT8, metric, drop (`lost` points for
    all INT8) and verdict against the budget."""
    planned = record["plan"]
    certificate = planned["certificate"]
    budget = 100 * planned["max_drop"]
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
    return Markup(table_html(rows, caption=f"FP32, all INT8 and the plan under a {budget:g}-"
                                           f"point {label} budget", columns={
        "model": ("name", "which model: FP32, every unit INT8, or the plan's mix"),
        "INT8 share of MACs": ("%", "share of the linear ops' multiply-accumulates run in INT8"),
        label: ("0-1", f"{label} on the held-out images"),
        "vs FP32, points": ("points", f"{label} minus FP32's, x 100"),
        f"within {budget:g} point": ("verdict", "whether the drop stays inside the budget; "
                                         "certified: the paired-bootstrap lower bound of the "
                                         "margin to the limit is above 0"),
    }))


def _plan_step(planned: dict, decided: Plan, pinned: dict, worst: Sequence[dict]) -> Markup:
    """The story's plan step: what leaves INT8, the repairs, the validator's `worst` layers
    as the planner measured them, the certificate."""
    repaired = (Markup(" with the repair(s) <code>{}</code>").format(", ".join(planned["repairs"]))
                if planned["repairs"] else "")
    kept = (Markup("{} of the {} units leave INT8, {:.1%} of the MACs").format(
        len(pinned), len(decided.units), 1 - planned["int8_mac_share"]) if pinned else
        Markup("every one of the {} units stays in INT8").format(len(decided.units)))
    unit_of = {node: d for d in decided.units.values() for node in d.nodes}
    after = [(w, unit_of[w["node"]]) for w in worst if w["node"] in unit_of]
    remeasured = Markup("; the planner measures {} on their own in its plan").format(
        Markup(", ").join(Markup("<code>{}</code> {} at {:.1f} dB").format(
            w["node"], d.precision.upper(), d.evidence.get(f"local_sqnr_{d.precision}_db",
                                                            float("inf")))
            for w, d in after)) if after else ""
    return Markup("<li><b>Plan</b> (<code>{}</code>): {}{}{}; certified on {} held-out images "
                  "after {} evaluation(s) of the real INT8 model (<a href=\"#plan\">the plan"
                  "</a>).</li>").format(planned["command"], kept, repaired, remeasured,
                                        planned["certificate"]["samples"], planned["model_runs"])


def _pins_table(decided: Plan, shown: dict) -> Markup:
    """The `shown` units (flagged by a rule or out of INT8): precision, share of MACs, reasons
    and measurements."""
    total = sum(d.macs for d in decided.units.values()) or 1
    pins = pd.DataFrame({
        "unit": list(shown),
        "runs in": [d.precision.upper() for d in shown.values()],
        "share of MACs": [f"{d.macs / total:.2%}" for d in shown.values()],
        "reasons (hover a code)": [reason_codes_html(d.reasons) for d in shown.values()],
        "local INT8 SQNR, dB": [d.evidence.get("local_sqnr_int8_db", float("nan"))
                                for d in shown.values()],
        "output-noise rank": [d.evidence.get("output_rank") for d in shown.values()],
    })
    return Markup(table_html(pins, caption="Units a rule flagged or the plan keeps out of "
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


def plan_html(planned: dict, decided: Plan) -> str:
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


# Unit and one-line meaning of each column of the zoo's summary table.
SUMMARY_COLUMNS = {
    "model": ("name", "zoo model (quantlab zoo)"),
    "task": ("name", "what the model does, which sets its metric"),
    "metric": ("name", "the task metric on the held-out split"),
    "FP32": ("0-1", "the FP32 model's metric"),
    "INT8": ("0-1", "the all-INT8 model's metric (its best calibrator)"),
    "INT8 calibration": ("name", "that calibrator"),
    "delta": ("0-1", "INT8 minus FP32"),
}


def latency_columns(batch: int) -> dict[str, tuple[str, str]]:
    """Unit and one-line meaning of each column of the latency table (`batch` samples a run)."""
    return {
        "model": ("name", "zoo model"),
        f"FP32 ms / batch {batch}": ("ms", "median ONNX Runtime CPU time of one batch, FP32"),
        f"INT8 ms / batch {batch}": ("ms", "the same for the all-INT8 Q/DQ model"),
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


def _latency_frame(records: Sequence[dict], batch: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "model": [r["name"] for r in records],
            f"FP32 ms / batch {batch}": [r["fp32_latency_ms"] for r in records],
            f"INT8 ms / batch {batch}": [r["int8_latency_ms"] for r in records],
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


def _latency_figure(records: Sequence[dict], machine: str, batch: int):
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.2))
    _bars(axis, records, "{}_latency_ms")
    axis.set_xticks(np.arange(len(records)), [r["name"] for r in records])
    axis.set_ylabel(f"ms per batch of {batch} (median)")
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


def calibration_html(record: dict) -> str:
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


def overview_section(records: Sequence[dict]) -> Section:
    """Every zoo model's FP32 and all-INT8 metric, in a table and a figure."""
    summary = table_html(
        _summary_frame(records), columns=SUMMARY_COLUMNS,
        caption=(
            "Metrics computed on each model's held-out evaluation split; INT8 = the Q/DQ model "
            "run by ONNX Runtime (CPU) with integer kernels, every layer in INT8."
        ),
    )
    return Section("Every zoo model, all INT8", summary + figure_html(
        _accuracy_figure(records), "FP32 vs all-INT8 task metric per model"), anchor="zoo")


def latency_section(records: Sequence[dict], batch: int) -> Section:
    """ONNX Runtime's CPU latency per batch of `batch` samples, FP32 against all INT8."""
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
        + table_html(_latency_frame(records, batch), caption="ONNX Runtime CPU latency, all "
                     "INT8", columns=latency_columns(batch))
        + figure_html(_latency_figure(records, machine, batch),
                      f"ONNX Runtime CPU latency per batch of {batch} on this machine")
    )
    return Section("CPU latency in ONNX Runtime (not a TensorRT figure)", html,
                   anchor="latency")
