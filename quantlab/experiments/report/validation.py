"""The validation report section: task metrics, end-to-end outputs, per-pair SQNR and worst layers.

Rendered through the report's jinja environment (autoescaping), so tensor, node
and module names — which come from the model file — are always escaped.
Everything shown is data handed in (:class:`quantlab.evaluation.compare.PairResult`); this
module never runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from markupsafe import Markup

from quantlab.engine.fusion import DecomposedOp
from quantlab.evaluation import tasks
from quantlab.evaluation.compare import PairResult
from quantlab.experiments.report import _ENV, Section, figure_html, prose_html, table_html

WORST_LAYERS = 10
# Ops whose output is their input's values at inference: no layer of their own to act on.
COPIES = ("Identity", "Dropout")
# Where infinite SQNR (bit-identical tensors) is drawn on plots, above every finite value.
_PLOT_INF_MARGIN_DB = 10.0
# An output whose channels' largest |values| span this factor mixes scales: one INT8 scale
# on it leaves the small channels a few levels (a detector's boxes in pixels beside its
# class scores in 0..1), which its pooled SQNR, dominated by the large ones, hides.
MIXED_SCALES = 100.0
# What a first divergence's reason code means (compare.first_divergence).
DIVERGENCE_REASONS = {
    "jump": "this node adds the error: its SQNR falls below the threshold and well below "
            "that of the tensors feeding it",
    "gradual": "no node jumps: error accumulates over many layers; this is the first tensor "
               "below the threshold",
}
# Local mode: the units named in "next steps" (worst first).
NAMED_UNITS = 5
# Units of the metrics `--metric` takes (a module:function metric is in its own units).
METRIC_UNITS = {"sqnr": "dB", "agreement": "share 0-1", "top1": "share 0-1",
                "map": "AP 0-1"}
# What each --metric is, for the legend of its table.
METRIC_DEFINITIONS = {
    "sqnr": "output SQNR as `quantlab plan` measures it: -10 log10 of the mean over samples "
            "of each sample's noise-to-signal ratio, all outputs together (the outputs table's "
            "sqnr_db pools every element instead, so loud samples weigh more)",
    "agreement": "share of samples whose argmax over axis 1 of the first output agrees with "
                 "FP32's",
    "top1": "share of samples whose highest logit is the label",
    "map": "COCO box mAP@[.5:.95] against the ground truth",
}
# Columns of the validation tables besides the shared ones (report.COLUMNS).
COLUMNS = {
    "top-1": ("share 0-1", "share of samples whose highest logit is the label"),
    "top-5": ("share 0-1", "share of samples whose label is among the 5 highest logits"),
    "mAP@[.5:.95]": ("AP 0-1", "COCO box mAP averaged over IoU 0.5 to 0.95 (pycocotools)"),
    "mAP@.5": ("AP 0-1", "COCO box AP at IoU 0.5"),
    "mAP@.75": ("AP 0-1", "COCO box AP at IoU 0.75"),
    "map_small": ("AP 0-1", "COCO mAP of small objects (< 32^2 pixels)"),
    "map_medium": ("AP 0-1", "COCO mAP of medium objects (32^2 to 96^2 pixels)"),
    "map_large": ("AP 0-1", "COCO mAP of large objects (> 96^2 pixels)"),
    "quantized_inputs": ("names", "FP32 tensors the layer reads quantized in local mode"),
    "obtained": ("code", "how the TensorRT engine exposed the tensor (SOURCES in "
                         "backends/tensorrt.py, docs/tensorrt.md)"),
    "metric": ("name", "the --metric: sqnr, agreement, top1, map or module:function"),
    "reference": ("metric units", "the reference stage's value (output SQNR of FP32 against "
                                  "itself: inf)"),
    "test": ("metric units", "the test stage's value, its outputs scored against the "
                             "reference's"),
    "change": ("metric units", "test minus reference (none where the reference is inf)"),
    "interval_low": ("metric units", "lower end of the paired-bootstrap interval of the "
                                     "change (of the value where there is no change)"),
    "interval_high": ("metric units", "upper end of that interval"),
    "samples": ("samples", "evaluation samples scored; the bootstrap resamples them"),
}


def pair_label(pair: PairResult) -> str:
    """``onnx_fp32 vs engine_int8 (local)``."""
    return f"{pair.reference} vs {pair.test}" + ("" if pair.mode == "global" else f" ({pair.mode})")


def worst_tensors(table: pd.DataFrame, exported: Mapping[str, DecomposedOp]) -> pd.DataFrame:
    """The :data:`WORST_LAYERS` lowest-SQNR rows of a per-tensor table, as a user can act on
    them: a decomposed op (LayerNorm, GELU, Softmax) is one row, its output named by the op,
    and the tensors inside it (a LayerNorm's Pow, a GELU's Erf) are left out, as are copies
    (:data:`COPIES`: an inference Dropout or an Identity repeats its input's values and
    figure; PP-OCR's recognizer listed two of them among its five worst)."""
    inside = table["tensor"].map(lambda t: t in exported and exported[t].output != t)
    inside |= table["op_type"].isin(COPIES)
    rows = table[~inside.astype(bool)].copy()
    ops = rows["tensor"].map(lambda t: exported[t] if t in exported else None)
    named = ops.notna()
    rows.loc[named, "op_type"] = [f"{op.label} ({len(op.nodes)} exported ops)"
                                  for op in ops[named]]
    return rows.sort_values("sqnr_db", kind="stable").head(WORST_LAYERS)


def validation_section(
    pairs: Sequence[PairResult],
    metrics: Mapping[str, dict],
    order: Sequence[str],
    threshold_db: float,
    notes: Sequence[str] = (),
    metric: Mapping | None = None,
    steps: Sequence[str] = (),
    exported: Mapping[str, DecomposedOp] | None = None,
) -> Section:
    """The report section of a validation run: `metric` is summary.json's ``metric`` (the
    engine against FP32 with its interval), `steps` the next steps (:func:`next_steps`),
    `exported` the ops the exporter decomposed (:func:`quantlab.engine.fusion.decomposed_ops`)."""
    rendered = []
    for pair in pairs:
        label = pair_label(pair)
        worst = worst_tensors(pair.table, exported or {})
        rendered.append({
            "label": label,
            "output_sqnr": pair.output_sqnr_db,
            "outputs": len(pair.outputs),
            "warnings": pair.warnings,
            "divergence": pair.divergence,
            "compared": len(pair.table),
            "figure": Markup(figure_html(sqnr_figure(pair.table, order, label, threshold_db),
                                         f"SQNR per tensor in topological order, {label}"))
            if len(pair.table) else None,
            "worst": Markup(table_html(worst, caption=f"Worst {len(worst)} tensors, {label}",
                                       columns=COLUMNS)),
        })
    outputs = outputs_frame(pairs)
    metric_table = None
    if metric:
        unit = METRIC_UNITS.get(metric["name"], "metric units")
        described = {k: (unit if v[0] == "metric units" else v[0], v[1])
                     for k, v in COLUMNS.items()}
        described["metric"] = ("name", f"{metric['name']}: " + METRIC_DEFINITIONS.get(
            metric["name"], "the user's function(outputs, references), higher is better"))
        metric_table = Markup(table_html(
            metric_frame(metric), columns=described,
            caption=f"--metric {metric['name']}: {metric['stages'][1]} against "
                    f"{metric['stages'][0]} end to end, {metric['confidence']:.0%} "
                    "paired-bootstrap interval"))
    task_columns = {**COLUMNS, **{f"AP {name}": ("AP 0-1", f"COCO mAP of class {name}")
                                  for values in metrics.values()
                                  for name in values.get("per_class") or {}}}
    html = _ENV.get_template("validation.html").render(
        steps=prose_html(" ".join(steps)),
        metric_table=metric_table,
        metrics_table=Markup(table_html(metrics_frame(metrics), caption="Task metrics per stage",
                                        columns=task_columns))
        if metrics else None,
        outputs_table=Markup(table_html(
            outputs, caption="End-to-end outputs: error of each model output per stage pair "
                             "(SQNR in dB, pooled over every sample: docs/metrics.md)",
            columns=COLUMNS))
        if len(outputs) else None,
        notes=list(notes),
        pairs=rendered,
        threshold=f"{threshold_db:g}",
        divergence_reasons=DIVERGENCE_REASONS,
    )
    return Section("Layer-by-layer validation", html, anchor="validation")


def metric_frame(metric: Mapping) -> pd.DataFrame:
    """summary.json's ``metric`` as one table row."""
    reference, test = metric["stages"]
    return pd.DataFrame([{
        "metric": metric["name"], "reference": metric[reference], "test": metric[test],
        "change": "none" if metric["change"] is None else metric["change"],
        "interval_low": metric["interval"][0], "interval_high": metric["interval"][1],
        "samples": metric["samples"]}])


def metric_line(metric: Mapping) -> str:
    """summary.json's ``metric`` in one line, as the console shows it."""
    reference, test = metric["stages"]
    low, high = metric["interval"]
    unit = {"sqnr": " dB"}.get(metric["name"], "")
    interval = f"{metric['confidence']:.0%} paired-bootstrap interval"
    if metric["change"] is None:
        return (f"metric {metric['name']}: {test} {metric[test]:.4g}{unit} ({interval} "
                f"{low:.4g}..{high:.4g}) on {metric['samples']} samples")
    return (f"metric {metric['name']}: {test} {metric[test]:.4g}, {reference} "
            f"{metric[reference]:.4g}, change {metric['change']:+.4g}{unit} ({interval} "
            f"{low:+.4g}..{high:+.4g}) on {metric['samples']} samples")


def next_steps(pairs: Sequence[PairResult], metric: Mapping | None, threshold_db: float,
               mode: str, model: str | None = None, data: str | None = None,
               calibration: str | None = None) -> list[str]:
    """What to do next, one sentence each, from the INT8 pair (the last of `pairs`): outputs
    that mix scales (not probabilities, and only without a `metric`), `quantlab plan` when
    an output or `metric` falls short (with the `model`, `calibration` folder and evaluation
    `data` where known), the units to pin
    (local mode) or the first divergence to isolate (global), `quantlab build` when INT8
    holds."""
    pair = pairs[-1]
    steps = []
    sqnr = {name: values["sqnr_db"] for name, values in pair.outputs.items()}
    for name, spread in pair.channels.items():
        # Quiet where it cannot help: classes of a softmax (or a CTC's steps) span any range
        # by design and the rare ones do not matter, and a --metric already reads the output.
        if (spread is None or spread["amax_max"] < MIXED_SCALES * spread["amax_min"]
                or spread["probabilities"] or metric is not None):
            continue
        if spread["worst_sqnr_db"] < min(threshold_db, sqnr[name] - 10.0):
            steps.append(
                f"Output '{name}' mixes scales: along axis {spread['axis']} its "
                f"{spread['channels']} channels' largest |values| run from "
                f"{spread['amax_min']:.3g} to {spread['amax_max']:.3g}, and channel "
                f"{spread['worst_channel']} is at {spread['worst_sqnr_db']:.1f} dB while the "
                f"output as a whole is at {sqnr[name]:.1f} dB: its SQNR speaks for the large "
                "channels only. Keep the ops that write it out of INT8, or judge it with a "
                "--metric that reads each part.")
    worst = min(sqnr.values(), default=math.inf)
    loses = metric is not None and metric["change"] is not None and metric["interval"][1] < 0
    if metric is not None and metric["change"] is not None:
        steps.append(
            f"INT8 changes {metric['name']} by {metric['change']:+.4g} "
            f"({metric['interval'][0]:+.4g}..{metric['interval'][1]:+.4g}): "
            + ("a loss beyond the interval's doubt." if loses else
               "within what the evaluation set can tell."))
    if worst < threshold_db or loses:
        on_task = metric is not None and metric["change"] is not None
        budget = (f"--metric {metric['name']} --max-drop DROP" if on_task
                  else f"--min-sqnr {threshold_db:g}")
        why = (f"INT8 loses {metric['name']}" if loses else
               f"An output is below {threshold_db:g} dB (lowest {worst:.1f} dB)"
               + (f", though {metric['name']} does not move beyond doubt; if the task is what "
                  "matters, plan on it" if on_task else ""))
        steps.append(
            f"{why}: run `quantlab plan {model or 'MODEL.onnx'} --data "
            f"{calibration or 'CALIBRATION'} --eval {data or 'EVAL'} {budget} --out PLAN` to "
            "keep out of INT8 only the units the budget needs, certified on this data.")
    if mode == "local":
        below = pair.table[pair.table["sqnr_db"] < threshold_db].sort_values("sqnr_db")
        if len(below):
            named = ", ".join(f"{row.node} ({row.sqnr_db:.1f} dB)"
                              for row in below.head(NAMED_UNITS).itertuples())
            more = f" and {len(below) - NAMED_UNITS} more" if len(below) > NAMED_UNITS else ""
            steps.append(
                f"Pin these units, whose own INT8 error is below {threshold_db:g} dB (worst "
                f"first): {named}{more}; `quantlab plan` measures which of them the budget "
                "needs out of INT8.")
    elif pair.divergence is not None and worst < threshold_db:
        steps.append(
            f"The error first jumps at {pair.divergence.node} ({pair.divergence.op_type}, "
            f"{pair.divergence.sqnr_db:.1f} dB): `quantlab validate --mode local` measures "
            "each layer's own error, to tell it from error passed on.")
    if worst >= threshold_db and not loses and not steps:
        steps.append(f"Every output is at or above {threshold_db:g} dB (lowest {worst:.1f} "
                     "dB).")
    if worst >= threshold_db and not loses:
        if metric is None:
            steps.append("Output SQNR does not say what the task loses: validate again with "
                         "--metric (agreement, top1 or map with --zoo, or module:function).")
        steps.append(f"Build the engine: `quantlab build {calibration or 'DIR'}` writes its "
                     "trtexec commands (and the engine, where TensorRT is installed).")
    return steps


def outputs_frame(pairs: Sequence[PairResult]) -> pd.DataFrame:
    """One row per (stage pair, model output): SQNR, cosine, relative L2, max |error|."""
    rows = [{"pair": f"{p.reference} vs {p.test}", "output": name, **values}
            for p in pairs for name, values in p.outputs.items()]
    return pd.DataFrame(rows, columns=["pair", "output", "sqnr_db", "cosine", "rel_l2",
                                       "max_abs", "frac_outside"])


def metrics_frame(metrics: Mapping[str, dict]) -> pd.DataFrame:
    """Task metrics, one row per stage, per-class AP as extra columns."""
    rows = []
    for stage, values in metrics.items():
        row = {"stage": stage}
        # COCO scores -1 where the data hold no object of a size (map_large of small images).
        row.update({tasks.METRIC_LABELS.get(k, k): v for k, v in values.items()
                    if not isinstance(v, dict) and v != -1})
        per_class = values.get("per_class") or {}
        row.update({f"AP {name}": ap for name, ap in per_class.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def sqnr_figure(table: pd.DataFrame, order: Sequence[str], label: str, threshold_db: float):
    """SQNR per compared tensor against its position in topological order."""
    import matplotlib.pyplot as plt

    depth = {name: i for i, name in enumerate(order)}
    x = np.array([depth.get(t, -1) for t in table["tensor"]])
    sqnr = table["sqnr_db"].to_numpy(dtype=float)
    finite = np.isfinite(sqnr)
    top = (sqnr[finite].max() if finite.any() else threshold_db) + _PLOT_INF_MARGIN_DB
    figure, axis = plt.subplots(figsize=(8, 3))
    axis.plot(x[finite], sqnr[finite], ".-", lw=0.8, label="SQNR")
    if (sqnr == math.inf).any():
        axis.scatter(x[sqnr == math.inf], np.full((sqnr == math.inf).sum(), top), marker="^",
                     color="tab:green", label="identical (+inf dB)")
    axis.axhline(threshold_db, color="tab:red", ls="--", lw=0.8, label="divergence threshold")
    axis.set_xlabel("tensor index (topological order)")
    axis.set_ylabel("SQNR [dB]")
    axis.set_title(label)
    # Outside the axes: the lowest points are the ones that matter and must stay visible.
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return figure
