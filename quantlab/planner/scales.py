"""The planner's third stage: the scales each unit is planned with (the calibrator with the
least local error per unit, scales shared where units must share them), the runner of
plans on them, and each INT8 op's bias shift, measured once and weighed later."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantlab.calibration.repairs import RepairReport, bias_shifts
from quantlab.planner.measure import Runner, choose_calibrators, single_samples
from quantlab.planner.prepare import Prepared
from quantlab.planner.rules import Rules
from quantlab.planner.units import share_scales


@dataclass
class Calibrated:
    """The scales (amax per tensor, the calibrator chosen per unit), the plan runner on
    them, and each INT8 op's bias shift with its report (none without bias correction)."""

    amax: dict[str, float]
    calibrators: dict[str, str]
    runner: Runner
    shifts: dict[str, np.ndarray]
    shift_report: RepairReport | None


def calibrate_units(prepared: Prepared, rules: Rules) -> Calibrated:
    """The calibrators chosen ("calibrators") and the bias shifts measured ("bias shifts")."""
    context, chosen, g = prepared.context, prepared.chosen, prepared.g
    amax, calibrators = chosen.amax, {}
    with context.phases("calibrators"):
        if chosen.candidates:
            amax, calibrators = choose_calibrators(
                g, chosen.candidates, rules.units,
                single_samples(context.calibration, context.first), amax)
        amax = share_scales(g, amax)
    context.first = None  # under every later step's peak (a 640 px detector's batch: 157 MB)
    runner = Runner(chosen.model, g, rules.units, amax, context.settings.high_precision,
                    context.runs)
    shifts, report = {}, None
    with context.phases("bias shifts"):
        if context.settings.bias_correction:
            # One pass over the calibration data.
            shifts, report = bias_shifts(runner.model, runner.quantized(rules.all_int8()),
                                         context.calibration)
    return Calibrated(amax, calibrators, runner, shifts, report)
