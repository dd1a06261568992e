"""Pages over several runs: the index of experiment folders, and two runs side by side.

Both are self-contained like every report (:mod:`quantlab.experiments.report`); folder names,
settings and tensor names are escaped by the templates.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import numpy as np
from markupsafe import Markup, escape

from quantlab.experiments.report import _ENV, Section, figure_html, prose_html, table_html
from quantlab.experiments.runs import Comparison, Run, accuracy_text, as_text

# Rows of the scale and layer tables on the comparison page (the largest changes first).
ROWS_SHOWN = 40
# Unit and one-line meaning of each column of the comparison page's tables.
COMPARISON_COLUMNS = {
    "setting": ("name", "a recorded option or input of the run (calibration.json, "
                        "summary.json)"),
    "figure": ("name", "a key result the run recorded (its metric, SQNR, INT8 share)"),
    "a": ("as recorded", "the value in run A"),
    "b": ("as recorded", "the value in run B"),
    "amax_a": ("tensor units", "the tensor's calibrated amax (scale x 127) in run A"),
    "amax_b": ("tensor units", "the tensor's calibrated amax in run B"),
    "ratio": ("x", "amax_b / amax_a; 1 is unchanged"),
    "sqnr_db_a": ("dB", "FP32 vs INT8 SQNR of the tensor in run A's validation (pooled over "
                        "samples; docs/metrics.md)"),
    "sqnr_db_b": ("dB", "the same in run B's validation"),
    "difference": ("dB", "sqnr_db_b - sqnr_db_a; negative: B is noisier"),
}


def index_section(runs: Sequence[Run], page: str | os.PathLike) -> Section:
    """Every run, newest first, with its key figures and a link (relative to `page`) to its
    own report."""
    base = Path(page).resolve().parent
    rows = [{
        "when": _dt.datetime.fromtimestamp(run.time).strftime("%Y-%m-%d %H:%M"),
        "kind": run.kind,
        "folder": str(run.path),
        "link": relative_link(run.report, base) if run.report else None,
        "figures": [(name, as_text(value)) for name, value in run.figures.items()],
        "accuracy": prose_html(accuracy_text(run)),
    } for run in runs]
    html = _ENV.get_template("runs.html").render(
        runs=rows, caption=f"{len(runs)} experiment folders, newest first")
    return Section("Runs", html, anchor="runs")


def relative_link(target: Path, base: Path) -> str:
    """The href of the file `target` from a page in `base`: a relative path, each character
    outside [A-Za-z0-9_.~/-] percent-encoded, so no folder name can make it a URL with a
    scheme (``javascript:``) or break the attribute."""
    return quote(Path(os.path.relpath(target.resolve(), base)).as_posix())


def comparison_sections(comparison: Comparison) -> list[Section]:
    """Settings that differ, key figures, per-tensor scale ratios and per-layer SQNR."""
    a, b = comparison.a, comparison.b
    head = (f"<p>A: <code>{escape(str(a.path))}</code> ({escape(a.kind)}); B: "
            f"<code>{escape(str(b.path))}</code> ({escape(b.kind)}).</p>")
    settings = (table_html(comparison.settings, caption="Settings that differ",
                           columns=COMPARISON_COLUMNS)
                if len(comparison.settings) else "<p>No setting differs.</p>")
    sections = [Section("Runs", head + settings + table_html(
        comparison.accuracy, caption="Accuracy of the INT8 model against FP32 (output SQNR in "
        "dB, the --metric result)", columns=COMPARISON_COLUMNS) + table_html(
        comparison.figures, caption="Key figures", columns=COMPARISON_COLUMNS))]
    if comparison.scales is not None:
        sections.append(Section("Scales", figure_html(
            ratio_figure(comparison), "amax of B over amax of A per tensor (log scale)")
            + table_html(comparison.scales.head(ROWS_SHOWN),
                         caption="Per-tensor amax, largest change first",
                         columns=COMPARISON_COLUMNS)))
    else:
        sections.append(Section("Scales", "<p>Only runs with a scales.json (calibrate, "
                                          "sweep) have scales to compare.</p>"))
    if comparison.layers is not None:
        sections.append(Section("Layers", table_html(
            comparison.layers.head(ROWS_SHOWN),
            caption="FP32 vs INT8 SQNR per tensor (dB), B - A, largest loss first",
            columns=COMPARISON_COLUMNS)))
    else:
        sections.append(Section("Layers", Markup(
            "<p>Per-layer SQNR is compared where both runs were validated (a validate run, "
            "inside the folder or beside it, run with --from it).</p>")))
    return sections


def ratio_figure(comparison: Comparison):
    """The amax ratio B / A of every common tensor, in graph order."""
    import matplotlib.pyplot as plt

    scales = comparison.scales
    figure, axis = plt.subplots(figsize=(7, 3))
    axis.bar(np.arange(len(scales)), scales["ratio"], color="#76b900")
    axis.axhline(1.0, color="#5b6575", linestyle="--")
    axis.set_yscale("log")
    axis.set_xlabel("tensor (largest change first)")
    axis.set_ylabel("amax B / amax A")
    return figure
