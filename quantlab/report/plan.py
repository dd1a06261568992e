"""The plan report section: the predicted front, the evaluations, the waterfall, the decisions.

Rendered through the report's jinja environment (autoescaping): unit, node and
reason texts come from the model file and are always escaped. Everything shown
is data handed in (:class:`quantlab.plan.PlanResult`); this module runs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd
from markupsafe import Markup

from quantlab.plan import DISAGREEMENT, RULES, SEARCH_CODE, Plan, PlanResult, Reason
from quantlab.report import _ENV, Section, figure_html, plot_text, table_html

# What each reason code means, for the legend under a table of codes: the rule's own summary.
REASON_CODES = {
    **{rule.code: (type(rule).__doc__ or "").strip().rstrip(".") for rule in RULES},
    SEARCH_CODE: "kept out of INT8 by the search: measured output-noise contribution too "
                 "large for the budget",
}
# Most sensitive units named under the strip of units (besides those out of INT8).
STRIP_NAMED = 3
# Colours of the precisions in figures (INT8 as the report's accent).
PRECISION_COLORS = {"int8": "#76b900", "fp16": "#2e86c1", "fp32": "#5b6575"}


def plan_section(result: PlanResult) -> Section:
    """The report section of a plan."""
    certificate = result.certificate
    verdict = "certified" if certificate.certified else "NOT certified"
    metric = certificate.metric + (" (output SQNR in dB: each float output's noise energy over "
                                   "its signal energy, pooled over the samples, averaged over "
                                   "the outputs, as validate reports it)"
                                   if certificate.metric == "sqnr" else "")
    summary = (
        f"{result.plan.int8_mac_share():.1%} of linear-op MACs run INT8. Metric "
        f"{metric}: {certificate.value:.4g} (FP32 {certificate.reference:.4g}, "
        f"lowest acceptable {certificate.limit:.4g}); {verdict}: the {certificate.confidence:.0%} "
        f"one-sided paired-bootstrap bound of the margin is {certificate.interval[0]:.4g} on "
        f"{certificate.samples} samples, after {result.model_runs} evaluations of the real "
        f"INT8 model and {len(result.sensitivity.nsr)} trials (plans run on the "
        f"{len(result.hard_samples)} hardest calibration samples).")
    disagreement = result.largest_disagreement()
    checked = len(result.sensitivity.checks) + len(result.noise_checks)
    summary += (f" The noise model (each unit's additive share of the output noise) was checked "
                f"against {checked} measured plans: the largest disagreement is a factor "
                f"{disagreement:.3g}" + (
                    f", above {DISAGREEMENT:g}: the prediction failed there and the units "
                    "behind it were localized by halving and measured alone (summary.json "
                    "noise_model)." if disagreement > DISAGREEMENT else "."))
    if result.refits:
        summary += (f" {result.refits} plan(s) chosen for an evaluation measured noisier than "
                    "predicted on the hardest samples: the noise model was refitted and the "
                    "search chose again instead of evaluating them.")
    if result.phases:
        summary += " Seconds per step: " + ", ".join(
            f"{name} {seconds:.3g}" for name, seconds in result.phases.items()) + "."
    if result.trial_cost:
        cost = result.trial_cost
        summary += (f" A trial took {cost['trial_seconds_median']:.3g} s (median of "
                    f"{cost['trials_run']}: its Q/DQ model built and run once over the hardest "
                    f"samples), {cost['ratio']:.2g}x a warm FP32 pass over them "
                    f"({cost['fp32_pass_seconds']:.3g} s).")
    for e in result.evaluations:
        if e.screened:
            summary += (f" The all-INT8 plan was not evaluated: on {e.certificate.samples} "
                        f"calibration samples drawn at random it scored "
                        f"{e.certificate.value:.4g} against a limit of "
                        f"{e.certificate.limit:.4g}, its whole bootstrap interval below it.")
    models = [r for r in result.plan.repairs if "all_int8_nsr_first_batch" in r]
    if models:
        weighed = ", ".join(f"{r['repair']} {r['all_int8_nsr_first_batch']:.3g}" for r in models)
        chosen = next(r["repair"] for r in models if r["chosen"])
        summary += (f" Repairs weighed before pins by all-INT8 output NSR on the first "
                    f"calibration batch: {weighed}; planned: {chosen}.")
    for r in result.plan.repairs:
        if r["repair"] == "bias_correction":
            summary += (f" Bias correction ({r['applied']} INT8 ops, measured in one pass on "
                        f"the calibration data) {'applied' if r['chosen'] else 'not applied'}: "
                        f"all-INT8 output NSR on the hardest samples {r['hard_nsr_before']:.3g} "
                        f"without, {r['hard_nsr_after']:.3g} with.")
    too_small = certificate.too_small_message()
    too_small = too_small[:1].upper() + too_small[1:]
    html = _ENV.get_template("plan.html").render(
        summary=summary, too_small=too_small,
        front_figure=Markup(figure_html(front_figure(result), "Predicted front: output noise "
                                        "of the best plan at each INT8 share; evaluated plans "
                                        "marked")),
        ledger_table=Markup(table_html(ledger_frame(result), caption="Evaluations of the real "
                                       "INT8 model (ONNX Runtime integer kernels), in order")),
        waterfall_figure=Markup(figure_html(waterfall_figure(result), "Predicted output noise "
                                            "removed by each non-INT8 unit, from all-INT8 to "
                                            "the plan")),
        strip_figure=unit_strip_html(result.plan),
        decisions_table=Markup(table_html(decisions_frame(result.plan),
                                          caption="Decision per unit")),
        legend=reasons_legend(r for d in result.plan.units.values() for r in d.reasons),
    )
    return Section("Precision plan", html, anchor="plan")


def decisions_frame(plan: Plan) -> pd.DataFrame:
    """One row per unit: precision, MAC share, reason codes, output-noise rank and
    contribution (INT8), local INT8 and FP16 SQNR, the predicted output noise in FP16, the
    calibrator it took its scales from, node count."""
    total = sum(d.macs for d in plan.units.values()) or 1
    rows = [{
        "unit": name,
        "precision": d.precision,
        "MACs": f"{d.macs / total:.2%}",
        "reasons": reason_codes_html(d.reasons),
        "noise rank": d.evidence.get("output_rank"),
        "output NSR": d.predicted,
        "local SQNR INT8 dB": d.evidence.get("local_sqnr_int8_db"),
        "local SQNR FP16 dB": d.evidence.get("local_sqnr_fp16_db"),
        "FP16 output NSR": d.evidence.get("fp16_nsr_contribution"),
        "calibrator": d.evidence.get("calibrator", ""),
        "nodes": len(d.nodes),
    } for name, d in plan.units.items()]
    return pd.DataFrame(rows)


def reason_codes_html(reasons: Iterable[Reason]) -> Markup:
    """Reason codes, each with its full evidence on hover; binding (hard) ones in bold."""
    return Markup(" ").join(
        Markup('<abbr class="{}" title="{} ({}): {}">{}</abbr>').format(
            "hard" if r.hard else "soft", r.code, "hard" if r.hard else "soft", r.evidence,
            r.code) for r in reasons)


def reasons_legend(reasons: Iterable[Reason]) -> Markup:
    """What the codes among `reasons` mean, with their sources, under a table of codes."""
    sources = {r.code: r.source for r in reasons}
    items = Markup("").join(
        Markup("<dt>{}</dt><dd>{} <span class=\"source\">({})</span></dd>").format(
            code, REASON_CODES.get(code, ""), sources[code]) for code in sorted(sources))
    return Markup('<dl class="legend">{}<dt>bold</dt><dd>a binding rule; the others are '
                  "weighed by measurement. Hover a code for its evidence.</dd></dl>").format(items)


def ledger_frame(result: PlanResult) -> pd.DataFrame:
    """One row per evaluation: INT8 share, predicted noise, metric, interval, verdict, time."""
    return pd.DataFrame([{
        "int8_mac_share": e.int8_mac_share,
        "predicted_nsr": e.predicted,
        "metric": e.certificate.value,
        "margin_low": e.certificate.interval[0],
        "certified": "yes" if e.certificate.certified else "no",
        "chosen": "yes" if i == result.chosen else "",
        "seconds": e.seconds,
        "model_run": ("yes" if e.model_run else
                      f"no (failed on {e.certificate.samples} calibration samples)"
                      if e.screened else "no (the FP32 model)"),
    } for i, e in enumerate(result.evaluations)])


def front_figure(result: PlanResult):
    """INT8 MAC share against predicted output noise, with the evaluated plans."""
    import matplotlib.pyplot as plt

    floor = min([p.predicted for p in result.front if p.predicted > 0], default=1e-12) / 10
    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.step([max(p.predicted, floor) for p in result.front],
              [p.int8_mac_share for p in result.front], where="post", label="predicted front")
    for i, e in enumerate(result.evaluations):
        color = "tab:green" if e.certificate.certified else "tab:red"
        axis.scatter(max(e.predicted, floor), e.int8_mac_share,
                     facecolors="none" if e.screened else color, edgecolors=color,
                     marker="*" if i == result.chosen else "o", s=90 if i == result.chosen else 30,
                     zorder=3)
    axis.set_xscale("log")
    axis.set_xlabel("predicted output noise-to-signal ratio (hard samples)")
    axis.set_ylabel("INT8 share of MACs")
    axis.scatter([], [], color="tab:green", label="evaluated, certified")
    axis.scatter([], [], color="tab:red", label="evaluated, not certified")
    if any(e.screened for e in result.evaluations):
        axis.scatter([], [], facecolors="none", edgecolors="tab:red",
                     label="failed on the calibration samples")
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return figure


def waterfall_figure(result: PlanResult):
    """Bars from the all-INT8 predicted noise down by the chosen repair's measured effect
    (hardest samples, before and after) and each non-INT8 unit's contribution."""
    import matplotlib.pyplot as plt

    decisions = result.plan.units
    repairs = [(f"repair: {r['repair']}", max(r["hard_nsr_before"] - r["hard_nsr_after"], 0.0))
               for r in result.plan.repairs if "hard_nsr_before" in r and r["chosen"]]
    pins = repairs + sorted(((n, d.predicted or 0.0) for n, d in decisions.items()
                             if d.precision != "int8"), key=lambda item: -item[1])
    start = sum(d.predicted or 0.0 for d in decisions.values()) + sum(a for _, a in repairs)
    levels = start - np.cumsum([0.0] + [a for _, a in pins])
    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.bar(0, start, color="tab:gray")
    for i, (_, removed) in enumerate(pins, start=1):
        axis.bar(i, removed, bottom=levels[i], color="tab:blue")
    axis.bar(len(pins) + 1, levels[-1], color="tab:green")
    axis.set_xticks(range(len(pins) + 2), ["all INT8", *[plot_text(n) for n, _ in pins], "plan"],
                    rotation=60, ha="right", fontsize=7)
    axis.set_ylabel("predicted output NSR")
    return figure


def unit_strip_html(plan: Plan) -> Markup:
    """:func:`unit_strip_figure` embedded, with its caption."""
    return Markup(figure_html(unit_strip_figure(plan), "The network as its units in "
                              "topological order, coloured by precision, over each unit's "
                              "output-noise contribution in INT8 (fitted from trials on the "
                              "hardest calibration samples)"))


def unit_strip_figure(plan: Plan):
    """The network as a strip of units in topological order, coloured by precision, over the
    bars of their measured output-noise contribution in INT8; the units left out of INT8 named.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(plan.units)
    decisions = [plan.units[n] for n in names]
    colors = [PRECISION_COLORS[d.precision] for d in decisions]
    noise = np.array([d.predicted or 0.0 for d in decisions])
    floor = noise[noise > 0].min() / 10 if (noise > 0).any() else 1e-12
    x = np.arange(len(names))
    figure, (bars, strip) = plt.subplots(2, 1, figsize=(11, 3.6), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1], "hspace": 0.05})
    bars.bar(x, np.maximum(noise, floor), width=0.8, color=colors)
    bars.set_yscale("log")
    bars.set_ylabel("output NSR\ncontribution", fontsize=8)
    strip.bar(x, 1, width=1.0, color=colors, edgecolor="white", linewidth=0.5)
    strip.set_yticks([])
    strip.set_xlim(-0.5, len(names) - 0.5)
    # Named: the units out of INT8 and the STRIP_NAMED most sensitive ones.
    named = sorted({i for i, d in enumerate(decisions) if d.precision != "int8"}
                   | set(np.argsort(-noise, kind="stable")[:STRIP_NAMED].tolist()))
    strip.set_xticks(named, [plot_text(names[i]) for i in named], rotation=50, ha="right",
                     fontsize=7)
    strip.set_xlabel(f"{len(names)} units in topological order (input left, outputs right)")
    present = dict.fromkeys(d.precision for d in decisions)
    bars.legend(handles=[Patch(color=PRECISION_COLORS[p], label=p.upper()) for p in present],
                loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return figure
