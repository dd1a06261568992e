"""The planning flow: :func:`make_plan` runs the planner's stages in order, each handing one
record to the next (docs/planner.md tells the design):

1. :func:`~quantlab.planner.prepare.weigh_repairs` -> :class:`~quantlab.planner.prepare.Prepared`:
   every repaired option's all-INT8 noise on the first batch; the quietest is planned.
2. :func:`~quantlab.planner.rules.unit_rules` -> :class:`~quantlab.planner.rules.Rules`: units,
   the rules' reasons, the precisions each unit may take.
3. :func:`~quantlab.planner.scales.calibrate_units` ->
   :class:`~quantlab.planner.scales.Calibrated`: per unit the calibrator with the least local
   error, scales shared; each INT8 op's bias shift, one pass.
4. :func:`~quantlab.planner.hard_samples.hard_samples` ->
   :class:`~quantlab.planner.hard_samples.HardSamples`: one pass of all-INT8 over the
   calibration data; bias correction kept where it lowers the hardest samples' noise; every
   unit's local INT8 and FP16 error.
5. :func:`~quantlab.planner.trials.noise_model` -> :class:`~quantlab.planner.trials.NoiseModel`:
   all-INT8 judged first; where it did not certify, each unit alone on a few hardest samples
   (the prior), random trials fitting the noise model, front plans checked against the fit.
6. :func:`~quantlab.planner.choose.search_front` -> :class:`~quantlab.planner.choose.Search`:
   plans of the front certified on the evaluation set, FP16 then FP32 the fallback.
7. :func:`~quantlab.planner.decisions.decide` -> :class:`~quantlab.planner.decisions.Plan`: the
   decisions with their evidence and reasons; :class:`PlanResult` holds every record's figures.

The budget is one :class:`~quantlab.planner.certify.Budget` (``settings.budget``). Every plan
that runs, in a trial or an evaluation, is its own Q/DQ model in ONNX Runtime
(:class:`~quantlab.planner.measure.Runner`): what is measured is what is shipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import onnx

from quantlab.data import BatchSource
from quantlab.errors import ModelError
from quantlab.evaluation.scoring import metric_for
from quantlab.evaluation.tasks import Task
from quantlab.planner.certify import Certificate
from quantlab.planner.choose import Search, search_front
from quantlab.planner.context import PlanSettings, fp32_runs, open_context, try_metric
from quantlab.planner.decisions import Plan, decide, uncertified_plan
from quantlab.planner.evaluate import Checkpoint, Evaluation
from quantlab.planner.hard_samples import HardSamples, hard_samples
from quantlab.planner.measure import CalibratedModel
from quantlab.planner.prepare import Prepared, weigh_repairs
from quantlab.planner.rules import Rules, unit_rules
from quantlab.planner.scales import Calibrated, calibrate_units
from quantlab.planner.search import FrontPoint
from quantlab.planner.trials import NoiseModel, OutputSensitivity, noise_model
from quantlab.planner.units import read_back

# make_plan's settings when none are given (frozen: one value serves every call).
DEFAULT_SETTINGS = PlanSettings()


@dataclass
class PlanResult:
    """Everything `make_plan` produced; ``evaluations[chosen]`` certifies ``plan``.

    The chosen plan is the certified one with the most INT8 MACs or, when none
    with INT8 is certified, all-FP16 where it holds the budget, else the FP32
    model (the certificate says so).
    """

    plan: Plan
    qdq_model: onnx.ModelProto
    amax: dict[str, float]
    front: list[FrontPoint]
    sensitivity: OutputSensitivity
    evaluations: list[Evaluation]
    chosen: int
    hard_samples: list[int]
    # The FP32 model planned: the input model, or its repaired copy (plan.repairs says which).
    model: onnx.ModelProto | None = None
    # The plan with the most INT8 that scored inside the budget but could not be certified
    # (the evaluation set too small), with its Q/DQ model and evaluation; None if none did.
    uncertified: tuple[Plan, onnx.ModelProto, Evaluation] | None = None
    # Seconds per step of the flow (module docstring), in order.
    phases: dict[str, float] = field(default_factory=dict)
    # Each evaluated plan's predicted and measured noise on the hardest samples.
    noise_checks: list[dict] = field(default_factory=list)
    # What a trial cost against an FP32 pass over the same (hardest) samples.
    trial_cost: dict = field(default_factory=dict)
    # Times the search refitted the noise model instead of evaluating the plan it chose.
    refits: int = 0
    # The tensors still quantized with every unit out of INT8 (Q/DQ pairs outside the units
    # the plan decides); empty: the plan without INT8 units is the FP32 (or all-FP16) model
    # exactly, so every drop of a plan comes from its units (docs/planner.md).
    outside_units: list[str] = field(default_factory=list)

    @property
    def certificate(self) -> Certificate:
        """The certificate of the chosen plan."""
        return self.evaluations[self.chosen].certificate

    def largest_disagreement(self) -> float:
        """The largest factor between the noise model's prediction and a measurement, over
        the front checks, the localization and the evaluated plans (1: none)."""
        return max([self.sensitivity.largest_disagreement()] +
                   [c["factor"] for c in self.noise_checks])

    @property
    def fallback(self) -> str | None:
        """"all-FP16" or "FP32" when no plan with INT8 was certified and the plan is the
        fallback without INT8; None when the plan keeps INT8 (or no fallback was needed)."""
        if self.plan.int8_mac_share() > 0 or len(self.evaluations) < 2:
            return None
        return "all-FP16" if any(d.precision == "fp16" for d in self.plan.units.values()) \
            else "FP32"

    @property
    def model_runs(self) -> int:
        """Evaluations that ran a model on the evaluation set (not the FP32 plan, whose
        outputs are known, nor a plan screened out on the calibration samples)."""
        return sum(e.model_run for e in self.evaluations)


def make_plan(original: CalibratedModel, calibration: BatchSource, evaluation: BatchSource,
              settings: PlanSettings = DEFAULT_SETTINGS, *, task: Task | None = None,
              checkpoint: Checkpoint | None = None,
              repairs: Mapping[str, CalibratedModel] | None = None,
              progress: Callable | None = None) -> PlanResult:
    """Plan `original` (a normalized model and its calibration) under `settings`' budget.

    `calibration` and `evaluation` are BatchSources (measurement on the former's
    hardest samples, certification on the latter). With a
    :class:`quantlab.evaluation.tasks.Task` (labels or COCO ground truth of `evaluation`), the
    metric may be its primary metric (``top1``, ``map``). `repairs` (name -> a
    repaired copy and its calibration) are weighed first; ``plan.repairs`` records
    every option's noise. `checkpoint` (an interrupted run of the same plan) skips
    the trials and evaluations it holds. The stages are the module's; their steps'
    seconds are ``result.phases``.
    """
    settings.check()
    prepared = weigh_repairs(open_context(original.model, calibration, evaluation, settings,
                                          task, progress), original, repairs or {})
    rules = unit_rules(prepared)
    calibrated = calibrate_units(prepared, rules)
    hard = hard_samples(prepared, rules, calibrated)
    noise = noise_model(prepared, rules, calibrated, hard, checkpoint)
    search = search_front(prepared, rules, noise)
    return _result(prepared, rules, calibrated, hard, noise, search)


def _result(prepared: Prepared, rules: Rules, calibrated: Calibrated, hard: HardSamples,
            noise: NoiseModel, search: Search) -> PlanResult:
    """The plan (:func:`decide`), its Q/DQ model checked against it, and everything the
    stages measured."""
    decided = decide(prepared, rules, calibrated, hard, noise, search)
    runner, fit = calibrated.runner, noise.model_fit
    qdq_model = runner.quantized(decided.node_precisions())
    differ = {u: p for u, p in read_back(qdq_model, rules.units).items()
              if p != decided.units[u].precision}
    if differ:
        raise ModelError(f"the Q/DQ model runs units {sorted(differ)[:5]} as {differ} although "
                         "the plan says otherwise; this is a bug, please report it with the model.")
    return PlanResult(decided, qdq_model, dict(calibrated.amax), fit.fitted.front,
                      fit.sensitivity, search.evaluations, search.chosen,
                      hard.indices.tolist(), prepared.chosen.model,
                      uncertified_plan(prepared, rules, calibrated, search),
                      prepared.context.phases.seconds, search.noise_checks,
                      noise.trial_cost(hard.fp32_seconds), fit.refits, runner.outside_units())


def check_metric_on_model(model: onnx.ModelProto, calibration: BatchSource, metric: str) -> None:
    """Call a ``module:name`` or built-in `metric` once, FP32 against itself on the first
    calibration batch, so that a metric that fails fails before any long pass."""
    try_metric(metric_for(metric), *fp32_runs(model, calibration)[1:])
