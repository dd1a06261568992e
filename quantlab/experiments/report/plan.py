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

from quantlab.experiments.report import (
    _ENV,
    Section,
    figure_html,
    plot_text,
    prose_html,
    table_html,
)
from quantlab.plan import DISAGREEMENT, RULES, SEARCH_CODE, Plan, PlanResult, Reason

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
# How an evaluation in the ledger was run (its "run" column), for the legend.
RUN_CODES = {
    "int8": "the plan's Q/DQ model ran on the evaluation set (ONNX Runtime integer kernels)",
    "screened": "not evaluated: on calibration samples (all of them for output SQNR, else a "
                "random draw; not only the hardest) it failed the budget beyond doubt (its "
                "whole bootstrap interval below the limit)",
    "fp32": "not run: every unit in FP32 is the FP32 model, the reference itself",
}
# The columns of the plan's tables: name -> (unit, what it is).
COLUMNS = {
    "int8_mac_share": ("share 0-1", "share of the linear ops' MACs (Conv, Gemm, MatMul) the "
                                    "plan runs in INT8"),
    "predicted_nsr": ("ratio", "output noise-to-signal ratio the fitted noise model predicts "
                               "for the plan on the hardest calibration samples"),
    "metric": ("metric units", "the plan's --metric: on the evaluation set, or on calibration "
                               "samples where run is 'screened'"),
    "margin_low": ("metric units", "one-sided 95% paired-bootstrap lower bound of the margin "
                                   "(metric minus the lowest acceptable value): >= 0 certifies"),
    "certified": ("yes/no", "whether margin_low >= 0"),
    "chosen": ("yes/-", "the plan written to this folder"),
    "seconds": ("s", "wall time of the evaluation"),
    "run": ("code", "how the plan was evaluated (legend below)"),
    "unit": ("name", "a linear op with the ops that share its input scales"),
    "precision": ("int8/fp16/fp32", "what the unit runs in under the plan"),
    "MACs": ("% of MACs", "the unit's share of the model's linear-op multiply-accumulates"),
    "reasons": ("codes", "rules and measurements that decided it (legend below; hover a code "
                         "for its evidence)"),
    "noise rank": ("rank", "1 = the largest measured share of the output noise in INT8"),
    "output NSR": ("ratio", "output noise-to-signal ratio the unit adds in INT8 (fitted from "
                            "trials on the hardest calibration samples)"),
    "local SQNR INT8 dB": ("dB", "SQNR of the unit's outputs, run alone in INT8 on FP32 inputs"),
    "local SQNR FP16 dB": ("dB", "the same in FP16 (-inf: FP16 overflows)"),
    "FP16 output NSR": ("ratio", "predicted output noise-to-signal ratio of the unit in FP16"),
    "calibrator": ("method", "the calibrator whose scales the unit took (least local error)"),
    "nodes": ("count", "ONNX nodes in the unit"),
}


def plan_section(result: PlanResult, steps: Iterable[str] = ()) -> Section:
    """The report section of a plan; `steps` are its next steps (:func:`next_steps`)."""
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
                    f"({cost['fp32_pass_seconds']:.3g} s). {cost['random_trials']} of the "
                    "trials were random plans fitting the noise model (all-INT8 included; "
                    "docs/planner.md says how many run).")
        if cost.get("single_units"):
            summary += (f" Before them, {cost['single_units']} units were each run alone in "
                        f"INT8 on {cost['single_unit_samples']} of the hardest samples: "
                        "the fit starts from their measured noise (a unit's evidence "
                        "output_nsr_alone).")
    for e in result.evaluations:
        if e.screened:
            summary += (f" The all-INT8 plan was not evaluated: on {e.certificate.samples} "
                        f"calibration samples ({_screened_on(result)}) it scored "
                        f"{e.certificate.value:.4g} against a limit of "
                        f"{e.certificate.limit:.4g}, its whole bootstrap interval below it.")
    summary += _repairs_text(result.plan.repairs)
    too_small = certificate.too_small_message()
    too_small = too_small[:1].upper() + too_small[1:]
    html = _ENV.get_template("plan.html").render(
        steps=prose_html(" ".join(steps)), summary=summary, too_small=too_small,
        front_figure=Markup(figure_html(front_figure(result), "Predicted front: output noise "
                                        "of the best plan at each INT8 share; evaluated plans "
                                        "marked")),
        ledger_table=Markup(table_html(ledger_frame(result), caption="Evaluations of the real "
                                       "INT8 model (ONNX Runtime integer kernels), in order",
                                       columns=_metric_units(COLUMNS, certificate.metric))),
        run_legend=Markup("").join(
            Markup("<dt>{}</dt><dd>{}</dd>").format(code, text)
            for code, text in RUN_CODES.items()
            if code in {run for run in ledger_frame(result)["run"]}),
        waterfall_figure=Markup(figure_html(waterfall_figure(result), "Predicted output noise "
                                            "removed by each non-INT8 unit, from all-INT8 to "
                                            "the plan")),
        strip_figure=unit_strip_html(result.plan),
        decisions_table=Markup(table_html(decisions_frame(result.plan),
                                          caption="Decision per unit", columns=COLUMNS)),
        legend=reasons_legend(r for d in result.plan.units.values() for r in d.reasons),
    )
    return Section("Precision plan", html, anchor="plan")


def _repairs_text(repairs: list[dict]) -> str:
    """The plan summary's sentences on the repairs weighed (plan.json's ``repairs``)."""
    text = ""
    models = [r for r in repairs if "all_int8_nsr_first_batch" in r]
    if models:
        weighed = ", ".join(f"{r['repair']} {r['all_int8_nsr_first_batch']:.3g}" for r in models)
        chosen = next(r["repair"] for r in models if r["chosen"])
        text += (f" Repairs weighed before pins by all-INT8 output NSR on the first "
                 f"calibration batch: {weighed}; planned: {chosen}.")
    for r in repairs:
        if r["repair"] == "bias_correction":
            text += (f" Bias correction ({r['applied']} INT8 ops, measured in one pass on "
                     f"the calibration data) {'applied' if r['chosen'] else 'not applied'}: "
                     f"all-INT8 output NSR on the hardest samples {r['hard_nsr_before']:.3g} "
                     f"without, {r['hard_nsr_after']:.3g} with.")
    return text


def _screened_on(result: PlanResult) -> str:
    """Which calibration samples all-INT8 was screened on (planner.hard_samples._hardest)."""
    if result.certificate.metric == "sqnr":
        return "every one, its noise measured in the pass that found the hardest"
    return (f"a random draw, or all of them when they are no more than the "
            f"{len(result.hard_samples)} hardest")


def next_steps(result: PlanResult, folder: str, uncertified: str = "uncertified") -> list[str]:
    """What to do with the plan written to `folder`, one sentence each: build it, the units
    it keeps out of INT8, the better plan in `uncertified` and the samples it needs, or
    what to change when nothing certified."""
    certificate = result.certificate
    plan = result.plan
    out = {p: [n for n, d in plan.units.items() if d.precision == p] for p in ("fp16", "fp32")}
    steps = []
    if certificate.certified and result.fallback is not None:
        steps.append(f"No plan with INT8 was certified: this is the fallback, {result.fallback} "
                     f"everywhere the rules allow ({len(result.evaluations)} plans evaluated). "
                     "Allow a larger budget, pass more --eval samples, or use a metric less "
                     "sensitive to rounding.")
    elif certificate.certified:
        kept = "; ".join(f"{p.upper()}: {', '.join(names[:STRIP_NAMED])}"
                         + (f" and {len(names) - STRIP_NAMED} more" if len(names) > STRIP_NAMED
                            else "") for p, names in out.items() if names)
        steps.append(f"Certified at {plan.int8_mac_share():.1%} of MACs in INT8"
                     + (f", with these units out of INT8 ({kept})" if kept else "")
                     + f": `quantlab build {folder}` writes its trtexec commands (and the "
                       "engine, where TensorRT is installed).")
    else:
        steps.append("No plan certified: allow a larger budget, pass more --eval samples, or "
                     "keep FP16 outside INT8 (--high-precision fp16) where the rules allow it.")
    if result.uncertified is not None:
        kept_plan, _, evaluation = result.uncertified
        needed = (evaluation.certificate.needed_samples or
                  evaluation.certificate.samples_to_certify())
        steps.append(
            f"A plan with {kept_plan.int8_mac_share():.1%} of MACs in INT8 scored "
            f"{evaluation.certificate.value:.4g} against the limit "
            f"{evaluation.certificate.limit:.4g} but could not be certified on "
            f"{evaluation.certificate.samples} samples: it is in {folder}/{uncertified}/; "
            + (f"about {needed} evaluation samples would tell." if needed else
               "more evaluation samples would tell."))
    elif certificate.too_small:
        steps.append(f"Pass about {certificate.needed_samples or 'many more'} evaluation "
                     "samples with --eval to certify a plan with more INT8.")
    return steps


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
        "run": "int8" if e.model_run else "screened" if e.screened else "fp32",
    } for i, e in enumerate(result.evaluations)])


def _metric_units(columns: dict, metric: str) -> dict:
    """`columns` with "metric units" named for `metric` (dB for sqnr)."""
    from quantlab.experiments.report.validation import METRIC_UNITS

    unit = METRIC_UNITS.get(metric, "metric units")
    return {name: (unit if u == "metric units" else u, text)
            for name, (u, text) in columns.items()}


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
