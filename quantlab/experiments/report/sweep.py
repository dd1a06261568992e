"""The sweep report section: metric vs calibrator (with intervals), metric vs calibration
size, the scales that have not converged, the sufficiency verdicts and every configuration.

Everything shown is data handed in (:class:`quantlab.experiments.sweep.SweepResult`); tensor names
come from the model file and are escaped by the report's templates.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from markupsafe import escape

from quantlab.experiments.report import Section, figure_html, table_html
from quantlab.experiments.sweep import SweepResult

# Tensors shown in the convergence figure (the most moving first).
MOVING_SHOWN = 20


def configuration_columns(metric: str) -> dict[str, tuple[str, str]]:
    """Unit and one-line meaning of each column of :func:`configurations_frame`."""
    return {
        "configuration": ("calibrator @samples", "the calibrator, its parameter and the number "
                                                 "of calibration samples its scales come from"),
        "value": (metric, "the all-INT8 model's metric on the evaluation samples"),
        "low": (metric, "lower end of the value's paired-bootstrap interval"),
        "high": (metric, "upper end of the value's paired-bootstrap interval"),
        "delta vs FP32": (metric, "value minus the FP32 model's value on the same samples"),
        "seconds": ("s", "scales, Q/DQ model and its evaluation (the shared statistics pass "
                         "not counted)"),
        "best": ("yes/empty", "the configuration the sweep recommends"),
    }


def sweep_section(result: SweepResult, metric: str, reproduce: str = "") -> Section:
    """The report section of a sweep; `reproduce` is the calibrate command of its best/."""
    best = result.best_record
    verdicts = "".join(f"<p><b>{escape(what.capitalize())}.</b> {escape(text)}</p>"
                       for what, text in result.sentences.items())
    again = (f" <code>{escape(reproduce)}</code> writes the same scales and Q/DQ model as "
             "best/." if reproduce else "")
    head = (f"<p>Best configuration at {result.full} calibration samples (the scales of "
            f"fewer move more; every size is in the first figure): <code>"
            f"{escape(best['label'])}</code>, {escape(metric)} {best['value']:.4g} (FP32 "
            f"{best['fp32']:.4g}).{again} Statistics were collected in one "
            f"pass over {result.full} calibration samples with snapshots at every size; each "
            "configuration's INT8 Q/DQ model ran in ONNX Runtime with integer kernels. Intervals "
            f"are {2 * best['confidence'] - 1:.0%} paired-bootstrap intervals on "
            f"{best['samples']} evaluation samples.</p>")
    html = (head + verdicts
            + figure_html(method_figure(result, metric),
                          f"{metric} per calibrator at every calibration size, with "
                          "paired-bootstrap intervals")
            + figure_html(size_figure(result, metric),
                          f"{metric} against the calibration-set size, per calibrator")
            + figure_html(movement_figure(result),
                          f"How far each amax of {best['setting']} moves from {result.half} to "
                          f"{result.full} samples (the tensors that move most; red: over the "
                          "tolerance), and its bootstrap spread over the calibration samples")
            + table_html(configurations_frame(result), caption="Every configuration",
                         columns=configuration_columns(metric)))
    return Section("Calibration sweep", html, anchor="sweep")


def configurations_frame(result: SweepResult) -> pd.DataFrame:
    """One row per configuration."""
    return pd.DataFrame([{
        "configuration": r["label"], "value": r["value"], "low": r["interval"][0],
        "high": r["interval"][1], "delta vs FP32": np.nan if r["delta"] is None else r["delta"],
        "seconds": r["seconds"], "best": "yes" if i == result.best else "",
    } for i, r in enumerate(result.records)])


def method_figure(result: SweepResult, metric: str):
    """The metric of every setting at every size (side by side, larger to the right), with
    its interval."""
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in result.records))
    sizes = sorted({r["size"] for r in result.records})
    width = 0.7 / len(sizes)
    figure, axis = plt.subplots(figsize=(7, 3.4))
    colors = plt.cm.viridis(np.linspace(0.15, 0.85, len(sizes)))
    for k, size in enumerate(sizes):
        rows = [r for r in result.records if r["size"] == size]
        x = np.array([settings.index(r["setting"]) for r in rows]) + (k - (len(sizes) - 1) / 2
                                                                      ) * width
        values = np.array([r["value"] for r in rows])
        low = values - np.array([r["interval"][0] for r in rows])
        high = np.array([r["interval"][1] for r in rows]) - values
        axis.errorbar(x, values, yerr=[np.maximum(low, 0), np.maximum(high, 0)], fmt="o",
                      capsize=3, color=colors[k], label=f"@{size}")
    fp32 = result.records[0]["fp32"]
    if np.isfinite(fp32):
        axis.axhline(fp32, color="#5b6575", linestyle="--", label="FP32")
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                title="samples", title_fontsize=8)
    axis.set_xticks(np.arange(len(settings)), settings, rotation=30, ha="right")
    axis.set_ylabel(metric)
    return figure


def size_figure(result: SweepResult, metric: str):
    """The metric against the calibration size, one line per setting."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.4))
    for setting in result.amax:
        rows = [r for r in result.records if r["setting"] == setting]
        axis.plot([r["size"] for r in rows], [r["value"] for r in rows], marker="o",
                  label=setting)
    axis.set_xscale("log", base=2)
    sizes = sorted({r["size"] for r in result.records})
    axis.set_xticks(sizes, [str(n) for n in sizes])
    axis.minorticks_off()
    axis.set_xlabel("calibration samples")
    axis.set_ylabel(metric)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return figure


def movement_figure(result: SweepResult):
    """Relative amax movement n/2 -> n of the best setting's most moving tensors."""
    import matplotlib.pyplot as plt

    moves = result.movement[result.best_record["setting"]]
    shown = sorted(moves.items(), key=lambda item: -item[1])[:MOVING_SHOWN]
    figure, axis = plt.subplots(figsize=(7, 0.6 + 0.22 * max(len(shown), 1)))
    colors = ["#c0392b" if m > result.tolerance else "#76b900" for _, m in shown]
    axis.barh(np.arange(len(shown)), [100 * m for _, m in shown], color=colors)
    if result.spread:
        axis.scatter([100 * result.spread.get(name, np.nan) for name, _ in shown],
                     np.arange(len(shown)), marker="D", color="#1d2430", s=14, zorder=3,
                     label=f"bootstrap spread ({result.spread_samples} samples)")
    axis.axvline(100 * result.tolerance, color="#5b6575", linestyle="--", label="tolerance")
    axis.set_yticks(np.arange(len(shown)), [name for name, _ in shown], fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel(f"|amax({result.full}) - amax({result.half})| / amax({result.full}); "
                    "spread: std / mean, %")
    axis.legend(loc="lower right")
    return figure
