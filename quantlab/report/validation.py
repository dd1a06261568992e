"""The validation report section: task metrics, end-to-end outputs, per-pair SQNR and worst layers.

Rendered through the report's jinja environment (autoescaping), so tensor, node
and module names — which come from the model file — are always escaped.
Everything shown is data handed in (:class:`quantlab.compare.PairResult`); this
module never runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from markupsafe import Markup

from quantlab import tasks
from quantlab.compare import PairResult
from quantlab.report import _ENV, Section, figure_html, table_html

WORST_LAYERS = 10
# Where infinite SQNR (bit-identical tensors) is drawn on plots, above every finite value.
_PLOT_INF_MARGIN_DB = 10.0


def pair_label(pair: PairResult) -> str:
    """``onnx_fp32 vs engine_int8 (local)``."""
    return f"{pair.reference} vs {pair.test}" + (" (local)" if pair.mode == "local" else "")


def validation_section(
    pairs: Sequence[PairResult],
    metrics: Mapping[str, dict],
    order: Sequence[str],
    threshold_db: float,
    notes: Sequence[str] = (),
) -> Section:
    """The report section of a validation run."""
    rendered = []
    for pair in pairs:
        label = pair_label(pair)
        worst = pair.table.sort_values("sqnr_db").head(WORST_LAYERS)
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
            "worst": Markup(table_html(worst, caption=f"Worst {len(worst)} tensors, {label}")),
        })
    outputs = outputs_frame(pairs)
    html = _ENV.get_template("validation.html").render(
        metrics_table=Markup(table_html(metrics_frame(metrics), caption="Task metrics per stage"))
        if metrics else None,
        outputs_table=Markup(table_html(
            outputs, caption="End-to-end outputs: error of each model output per stage pair "
                             "(SQNR in dB, pooled over every sample: docs/metrics.md)"))
        if len(outputs) else None,
        notes=list(notes),
        pairs=rendered,
        threshold=f"{threshold_db:g}",
    )
    return Section("Layer-by-layer validation", html, anchor="validation")


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
