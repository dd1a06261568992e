"""The planner's fourth stage: the hardest calibration samples (one pass of all-INT8 over
the calibration data), FP32's outputs on them, bias correction kept or dropped on them,
every unit's local INT8 and FP16 error, and the samples all-INT8 is screened on."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from quantlab.calibration.repairs import RepairReport, lowers_noise
from quantlab.planner.context import Context
from quantlab.planner.evaluate import plan_key
from quantlab.planner.measure import (
    Draw,
    Runner,
    all_samples,
    hardest_samples,
    joined,
    local_sqnr,
    parts_nsr,
    single_samples,
)
from quantlab.planner.prepare import Prepared, repair_summary
from quantlab.planner.rules import Rules
from quantlab.planner.scales import Calibrated

# FP32's outputs on the hardest samples are held across the local errors up to this size, and
# made again after them when larger.
HELD_REFERENCES_BYTES = 64 << 20


@dataclass
class HardSamples:
    """The hardest calibration samples (`inputs`, their `indices`), FP32's outputs on them
    (`references`, the pass's `fp32_seconds`), the samples all-INT8 is screened on
    (`drawn`; None once read), bias correction's record (None without it), and every
    unit's local SQNR per precision."""

    inputs: dict[str, np.ndarray]
    indices: np.ndarray
    references: dict[str, np.ndarray]
    fp32_seconds: float
    drawn: Draw | None
    shift_record: dict | None
    local: dict[str, dict[str, float]]  # unit -> precision -> local SQNR (dB)


def hard_samples(prepared: Prepared, rules: Rules, calibrated: Calibrated) -> HardSamples:
    """The hardest samples ("hardest samples"), bias correction kept or dropped ("bias
    correction"), the local errors ("local errors"). FP32's outputs on the hardest samples
    are held across the local errors when small (HELD_REFERENCES_BYTES), else made again."""
    context, runner, shifts = prepared.context, calibrated.runner, calibrated.shifts
    calibration, phases, all_int8 = context.calibration, context.phases, rules.all_int8()
    with phases("hardest samples"):
        runner.shifts = shifts
        hard, indices, energies, drawn = _hardest(context, lambda: runner(all_int8))
    references, shift_record, all_int8_outputs = None, None, None
    if shifts:
        with phases("bias correction"):
            references, fp32_seconds = _fp32_timed(context, hard)
            held = sum(v.nbytes for v in references.values()) <= HELD_REFERENCES_BYTES
            # The kept variant's outputs, where the all-INT8 screen reads them (below).
            screened_on_hard = drawn is None and context.metric.reads_outputs
            shift_record, all_int8_outputs = _weigh_bias(runner, hard, references, all_int8,
                                                         shifts, calibrated.shift_report,
                                                         held and screened_on_hard)
        if not held:
            references = None  # let go under the local errors' peak (640 px detector: 0.3 GB)
    with phases("local errors"):
        local = local_sqnr(prepared.g, calibrated.amax, rules.units,
                           single_samples(calibration, hard, calibration.batch_size))
    if references is None:
        with phases("hardest samples"):
            references, fp32_seconds = _fp32_timed(context, hard)
    drawn = _screen_samples(context, drawn, energies,
                            Draw(inputs=hard, references=references, outputs=all_int8_outputs,
                                 outputs_of=plan_key(all_int8)),
                            shifts_kept=bool(runner.shifts) == bool(shifts))
    return HardSamples(hard, indices, references, fp32_seconds, drawn, shift_record, local)


def _hardest(context: Context, all_int8: Callable[[], Callable]):
    """:func:`quantlab.planner.measure.hardest_samples` of the all-INT8 run ``all_int8()``
    against FP32 over the calibration data; where all the samples are kept and no screen
    reads their energies (a metric other than output SQNR), all of them without the pass,
    which would rank samples that are all kept."""
    calibration, count = context.calibration, context.settings.hard_count
    if calibration.num_samples <= count and not context.metric.is_output_sqnr:
        return all_samples(calibration), np.arange(calibration.num_samples), None, None
    # Random samples drawn (FP32's outputs on them kept) for _screen_samples: for a metric
    # of outputs other than output SQNR, unless the hardest samples are all the samples.
    draw = context.metric.reads_outputs and calibration.num_samples > count
    return hardest_samples(calibration, context.fp32_run, all_int8(), count,
                           lambda b: context.step(b, desc="hardest samples"), draw=draw)


def _fp32_timed(context: Context, batch: Mapping[str, np.ndarray]
                ) -> tuple[dict[str, np.ndarray], float]:
    """FP32's outputs on `batch` and the pass's seconds: the floor a trial is measured
    against."""
    start = time.perf_counter()
    outputs = context.fp32_run(batch)
    return outputs, time.perf_counter() - start


def _screen_samples(context: Context, drawn: Draw | None,
                    energies: tuple[np.ndarray, np.ndarray] | None, hardest: Draw,
                    shifts_kept: bool) -> Draw | None:
    """The calibration samples all-INT8 is screened on
    (:func:`quantlab.planner.evaluate.screen`), or None (it is evaluated): for output SQNR
    every sample's energies from the hardest-samples pass, valid while the bias-correction
    step keeps the shifts that pass ran with; for another metric of outputs the pass's
    random draw, or the `hardest` when they are all the samples; none for a task metric
    (labels)."""
    if context.metric.is_output_sqnr:
        return Draw(energies=energies) if shifts_kept else None
    if context.metric.labels:
        return None
    return drawn if drawn is not None else hardest


def _weigh_bias(runner: Runner, hard: Mapping[str, np.ndarray],
                references: Mapping[str, np.ndarray], all_int8: Mapping[str, str],
                shifts: Mapping[str, np.ndarray], shift_report: RepairReport, keep: bool
                ) -> tuple[dict, dict[str, np.ndarray] | None]:
    """Bias correction kept (``runner.shifts``) only where it lowers all-INT8's noise on the
    `hard` samples (FP32's outputs on them: `references`); its record for plan.json, and
    with `keep` the kept variant's outputs on `hard` (the same plan on the same samples as
    the screen of all-INT8, :func:`_screen_samples`)."""
    def measured(kept: Mapping[str, np.ndarray]) -> tuple[float, list]:
        run = runner(all_int8, shifts=kept)
        if not keep:  # summed run by run, the outputs never held (:meth:`BoundedRun.pooled_nsr`)
            return run.pooled_nsr(hard, references), []
        parts = list(run.parts(hard))
        return parts_nsr(iter(parts), references), parts

    # One after the other: side by side, the second session's memory came on top (the
    # orientation model's plan peaked 0.25 GB higher), for a few tenths of a second (two
    # all-INT8 passes over 8 layout pages: 2.0 s side by side, 2.3-2.5 s one by one).
    (with_shifts, with_parts), (without, without_parts) = measured(shifts), measured({})
    chosen = lowers_noise(without, with_shifts)
    runner.shifts = dict(shifts) if chosen else {}
    outputs = joined(with_parts if chosen else without_parts) if keep else None
    return {"repair": "bias_correction", "chosen": bool(chosen), "hard_nsr_before": without,
            "hard_nsr_after": with_shifts, **repair_summary(shift_report.to_dict())}, outputs
