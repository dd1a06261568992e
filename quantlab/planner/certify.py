"""The planner's budget: one :class:`Budget` value, what it needs of the metric and the data,
and the noise floor of all-FP16. Metrics and the paired bootstrap live below the planner, in
:mod:`quantlab.evaluation.scoring` (one scorer for plan, validate, sweep and check); their names are
importable from here too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantlab.errors import ConfigError
from quantlab.evaluation.scoring import (  # noqa: F401 (the planner's names for them)
    METRICS,
    RESAMPLER_RTOL,
    Certificate,
    Outputs,
    PairedScore,
    Reference,
    argmax_agreement,
    certify,
    certify_paired,
    metric_for,
    metric_value,
    output_sqnr,
    pooled_sqnr,
    remembered,
    resolve_metric,
    split_samples,
)


def check_budget(metric: str, max_drop: float | None, min_sqnr: float | None) -> None:
    """ConfigError unless the budget can work with `metric`; known before any model run, so
    `quantlab plan` checks it before it reads any data."""
    if (max_drop is None) == (min_sqnr is None):
        raise ConfigError("give exactly one budget: --max-drop X or --min-sqnr DB.")
    if min_sqnr is not None and metric != "sqnr":
        raise ConfigError(f"--min-sqnr is a floor on output SQNR; it does not go with --metric "
                          f"{metric} (use --max-drop there).")
    if max_drop is not None and metric == "sqnr":
        raise ConfigError("--max-drop cannot work with --metric sqnr: the FP32 model's output "
                          "SQNR against itself is infinite, so a drop from it means nothing. "
                          "Give a floor (--min-sqnr DB) or another --metric.")
    for option, value in (("--max-drop", max_drop), ("--min-sqnr", min_sqnr)):
        if value is not None and not np.isfinite(value):
            raise ConfigError(f"{option} must be a finite number, got {value}.")
    if max_drop is not None and max_drop < 0:
        raise ConfigError(f"--max-drop must be >= 0, got {max_drop}: impossible even in FP32, "
                          "which is the reference every plan is compared with.")


@dataclass(frozen=True)
class Budget:
    """How much accuracy a plan may cost: `metric` may drop by `drop` from FP32's value, or
    (output SQNR) stay at `floor` dB or above; exactly one of them is set."""

    metric: str
    drop: float | None = None
    floor: float | None = None

    def check(self) -> None:
        check_budget(self.metric, self.drop, self.floor)

    @property
    def amount(self) -> float:
        """The drop or the floor, as plan.json's ``budget`` records it."""
        return self.drop if self.drop is not None else self.floor

    def limit(self, reference: float) -> float:
        """The least score that holds the budget, FP32 scoring `reference`."""
        return reference - self.drop if self.drop is not None else self.floor

    def margin(self, value: float, reference: float) -> float:
        """How far a score `value` lies above the limit (below: negative)."""
        return value - self.limit(reference)

    def certificate(self, scored: PairedScore) -> Certificate:
        """`scored`'s certificate against this budget."""
        return scored.certificate(self.drop, self.floor)

    def shortfall(self, certificate: Certificate) -> float:
        """What the budget limits: the noise power for an SQNR floor (dB -> NSR), else the
        metric's drop from FP32."""
        if self.floor is not None:
            return 10 ** (-certificate.value / 10)
        return certificate.reference - certificate.value

    def allowed_shortfall(self, shortfall: float, spread: float) -> float:
        """The largest shortfall a plan can show and still be certified, its bootstrap
        `spread` measured where it showed `shortfall`: the floor raised by the spread in
        dB, or :func:`certifiable_drop`."""
        if self.floor is not None:
            return 10 ** (-(self.floor + spread) / 10)
        return certifiable_drop(self.drop, shortfall, spread)


def certifiable_drop(budget: float, drop: float, spread: float) -> float:
    """The largest drop d that a plan can show and still be certified within `budget`.

    Certification needs the margin's lower end, ``budget - d - spread(d)``, at or
    above 0. A drop is made of changed predictions (boxes, labels), and the
    bootstrap spread of a count grows as its square root, so the spread measured
    at `drop` is scaled as ``spread * sqrt(d / drop)``; d solves
    ``d + spread * sqrt(d / drop) = budget`` (a quadratic in sqrt(d)). The whole
    budget when there is no spread, or no drop to scale it from.
    """
    if drop <= 0 or spread <= 0:
        return budget
    a = spread / np.sqrt(drop)
    return float(((np.sqrt(a * a + 4 * budget) - a) / 2) ** 2)


def data_shortfalls(calibration_samples: int, evaluation_samples: int, hard_count: int,
                    metric: str, max_drop: float | None, task=None) -> list[str]:
    """What the data cannot do for this plan, known before any model run (one message each).

    Fewer calibration samples than the hardest-sample count, and a budget smaller
    than one sample's worth of a share metric (top-1, argmax agreement) on the
    evaluation set: then only a plan that changes no prediction can be certified.
    """
    messages = []
    if calibration_samples < hard_count:
        messages.append(
            f"the calibration data hold {calibration_samples} samples, fewer than the "
            f"{hard_count} hardest samples requested (--hard-samples): the trials "
            f"run on all {calibration_samples}, none singled out as hard. Pass more "
            f"calibration data (several times {hard_count} samples) or --hard-samples "
            f"below {calibration_samples}.")
    share = metric == "agreement" or (task is not None and task.kind == "classification"
                                       and metric == task.primary_metric)
    if share and max_drop is not None and max_drop * evaluation_samples < 1:
        needed = (f"Pass at least {int(np.ceil(1 / max_drop))} samples with --eval (more the "
                  "more predictions a plan changes)" if max_drop > 0 else
                  "A drop of 0 allows no changed prediction whatever the evaluation set")
        messages.append(
            f"a drop of {max_drop:g} in {metric} is less than one sample of the "
            f"{evaluation_samples} in the evaluation set (1/{evaluation_samples} = "
            f"{1 / evaluation_samples:.3g}): only a plan that changes no prediction can be "
            f"certified. {needed}, or allow a larger --max-drop.")
    return messages


def floor_record(certificate: Certificate) -> dict:
    """The all-FP16 plan's evaluation as plain data: the noise floor of the budget."""
    return {"metric": certificate.metric, "value": certificate.value,
            "reference": certificate.reference, "limit": certificate.limit,
            "drop": certificate.reference - certificate.value,
            "margin_interval": list(certificate.interval), "samples": certificate.samples,
            "certified": certificate.certified}


def floor_message(certificate: Certificate, budget: Budget) -> str:
    """A warning when FP16 alone (no INT8) uses half the `budget` or more, counting the
    evaluation set's resolution (the bootstrap half-width); '' otherwise."""
    half = (certificate.interval[1] - certificate.interval[0]) / 2
    metric, max_drop = budget.metric, budget.drop
    if max_drop is not None:
        drop = certificate.reference - certificate.value
        if drop + half < max_drop / 2:
            return ""
        head = (f"all-FP16 (no INT8 at all) already drops {metric} by {drop:.3g} "
                f"(+-{half:.2g} on {certificate.samples} samples), against a budget of "
                f"{max_drop:.3g}: what is left for INT8 is at the evaluation set's resolution, "
                "so plans are decided by rounding noise.")
    else:
        if certificate.value - half > certificate.limit + 1.0:
            return ""
        head = (f"all-FP16 (no INT8 at all) reaches only {certificate.value:.3g} dB "
                f"(+-{half:.2g} on {certificate.samples} samples) against a floor of "
                f"{certificate.limit:.3g} dB: little is left for INT8.")
    if metric == "map":
        hint = (" COCO mAP@[.5:.95] moves with the IoU 0.9-0.95 bins, where FP16 rounding "
                "already shifts boxes; AP50 or F1 agreement at IoU 0.5 (--metric "
                "module:function) resolves such budgets, as do more --eval samples.")
    else:
        hint = (" Allow a larger budget, pass more --eval samples, or use a metric less "
                "sensitive to rounding (for detectors, AP50 or F1 agreement at IoU 0.5 through "
                "--metric module:function, rather than mAP@[.5:.95]).")
    return head + hint
