"""The plan as plain data: unit name -> precision with its reasons and evidence (plan.json);
the planner's last stage makes it from the records of the others (:func:`decide`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from quantlab.calibration import qdq
from quantlab.errors import DataError
from quantlab.experiments.experiment import read_artifact, write_json
from quantlab.graph import Graph
from quantlab.planner.rules import Reason, allowed_precisions
from quantlab.planner.units import Unit

if TYPE_CHECKING:  # the stages' records, for the last stage's signature: `Plan` stays light
    import onnx  # (gate.py and plan.json's readers import it without the planner's stages)

    from quantlab.planner.certify import Budget
    from quantlab.planner.choose import Search
    from quantlab.planner.evaluate import Evaluation
    from quantlab.planner.hard_samples import HardSamples
    from quantlab.planner.prepare import Prepared
    from quantlab.planner.rules import Rules
    from quantlab.planner.scales import Calibrated
    from quantlab.planner.search import FrontPoint
    from quantlab.planner.trials import NoiseModel

PLAN_FORMAT = "quantlab.plan"


PLAN_VERSION = 1
# The reason of a unit the search (not a rule) keeps out of INT8.
SEARCH_CODE = "M-SEARCH"
SEARCH_SOURCE = ("quantlab: trials on the hardest samples, MILP front, certified on held-out "
                 "data (docs/planner.md)")



@dataclass
class UnitDecision:
    """One unit's precision with the reasons, evidence and effects behind it."""

    precision: str
    nodes: list[str]
    macs: int
    reasons: list[Reason] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)
    predicted: float | None = None
    measured: float | None = None



@dataclass
class Plan:
    """Unit name -> decision; what `quantlab plan` writes as plan.json."""

    units: dict[str, UnitDecision]
    metric: str = ""
    budget: float | None = None
    # The repairs weighed before pins: one plain dict each (see make_plan).
    repairs: list[dict] = field(default_factory=list)
    # The all-FP16 plan's evaluation, the noise floor of the budget (certify.floor_record).
    floor: dict | None = None

    @classmethod
    def from_rules(cls, units: Sequence[Unit], reasons: Mapping[str, Sequence[Reason]]) -> Plan:
        """Every unit at the cheapest precision its hard reasons allow (INT8 when none bind)."""
        return cls({u.name: UnitDecision(allowed_precisions(reasons.get(u.name, []))[0],
                                         list(u.nodes), u.macs, list(reasons.get(u.name, [])))
                    for u in units})

    def node_precisions(self) -> dict[str, str]:
        """Node name -> precision, the `plan` argument of qdq.quantize_model."""
        return {node: d.precision for d in self.units.values() for node in d.nodes}

    def int8_mac_share(self) -> float:
        """Share of linear-op MACs planned INT8 (1.0 for a model without MACs)."""
        total = sum(d.macs for d in self.units.values())
        int8 = sum(d.macs for d in self.units.values() if d.precision == "int8")
        return int8 / total if total else 1.0

    def save(self, path: str | os.PathLike) -> Path:
        """Write plan.json atomically."""
        return write_json(path, {"format": PLAN_FORMAT, "version": PLAN_VERSION,
                                 "metric": self.metric, "budget": self.budget,
                                 "int8_mac_share": self.int8_mac_share(),
                                 "units": {name: asdict(d) for name, d in self.units.items()},
                                 "repairs": self.repairs, "floor": self.floor})

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan.json written by :meth:`save`."""
        path = Path(path)
        data = read_artifact(path, PLAN_FORMAT, "plan", "the plan.json written by `quantlab plan`")
        if data.get("version") != PLAN_VERSION:
            raise DataError(f"{path} is plan format version {data.get('version')!r}; this "
                            f"quantlab reads version {PLAN_VERSION}. Plan again to rewrite it.")
        try:
            units = {}
            for name, entry in data["units"].items():
                reasons = [Reason(r["code"], bool(r["hard"]), tuple(r["allowed"]),
                                  r["evidence"], r["source"]) for r in entry["reasons"]]
                if entry["precision"] not in qdq.PRECISIONS:
                    raise ValueError(f"precision {entry['precision']!r} of unit {name}")
                units[str(name)] = UnitDecision(
                    entry["precision"], list(entry["nodes"]), int(entry["macs"]), reasons,
                    dict(entry["evidence"]), entry["predicted"], entry["measured"])
            return cls(units, str(data["metric"]), data["budget"],
                       [dict(r) for r in data.get("repairs", [])], data.get("floor"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DataError(f"{path} is a damaged plan file (field {exc}); plan again to "
                            "rewrite it.") from None


def pinned_tensors(plan: Plan, g: Graph) -> set[str]:
    """Float inputs and outputs of the non-INT8 units' nodes: the calibration cache omits them
    so TensorRT <= 10 (implicit INT8) runs those layers in higher precision."""
    nodes = {node.name: node for node in g.model.graph.node}
    names = {name for decision in plan.units.values() if decision.precision != "int8"
             for node in decision.nodes for name in [*nodes[node].input, *nodes[node].output]}
    return {name for name in names if name in g.floats}


def decide(prepared: Prepared, rules: Rules, calibrated: Calibrated, hard: HardSamples,
           noise: NoiseModel, search: Search) -> Plan:
    """The plan as plain data: each unit's precision (the search's choice), its evidence
    (fitted contributions, rank, local SQNR, noise alone in INT8, calibrator, bias shift)
    and its reasons, and the repairs weighed."""
    fit, sensitivity = noise.model_fit.fitted, noise.model_fit.sensitivity
    decided = _plan_of(search.point, rules, prepared.context.settings.budget)
    applied = calibrated.runner.shifts  # the bias shifts kept (hard_samples' verdict)
    rank = {name: place for place, name in enumerate(sensitivity.ranking(), start=1)}
    all_int8 = sensitivity.predicted_nsr(fit.contribution)
    for unit in rules.units:
        decision = decided.units[unit.name]
        decision.predicted = fit.contribution.get(unit.name, 0.0)
        decision.evidence.update(_evidence(unit, rank[unit.name], calibrated, hard, noise))
        if decision.precision == "int8" and any(n in applied for n in unit.linear):
            decision.evidence["bias_shift_max"] = max(float(np.abs(applied[n]).max())
                                                      for n in unit.linear if n in applied)
        decision.reasons.extend(_search_reasons(unit, decision, rules, hard, noise, search,
                                                prepared.context.settings.high_precision,
                                                all_int8))
    if search.floor is not None:
        from quantlab.planner.certify import floor_record

        decided.floor = floor_record(search.floor.certificate)
    decided.repairs = [*prepared.repair_records.values(),
                       *([hard.shift_record] if hard.shift_record else [])]
    return decided


def _plan_of(point: FrontPoint, rules: Rules, budget: Budget) -> Plan:
    """The plan of a front point: the rules' units and reasons, the point's precisions and
    the budget's metric and amount."""
    plan = Plan.from_rules(rules.units, rules.reasons)
    for unit in rules.units:
        plan.units[unit.name].precision = point.precisions[unit.name]
    plan.metric, plan.budget = budget.metric, budget.amount
    return plan


def _evidence(unit: Unit, rank: int, calibrated: Calibrated, hard: HardSamples,
              noise: NoiseModel) -> dict:
    """A unit's measured figures for plan.json, in plan.json's order (`rank`: its place by
    output-noise contribution)."""
    fit = noise.model_fit.fitted
    evidence = {"output_nsr_contribution": fit.contribution.get(unit.name, 0.0),
                "output_rank": rank}
    for precision, figure in hard.local.get(unit.name, {}).items():
        evidence[f"local_sqnr_{precision}_db"] = figure
    if unit.name in noise.alone:
        evidence["output_nsr_alone"] = noise.alone[unit.name]
    if unit.name in fit.fp16_contribution:
        evidence["fp16_nsr_contribution"] = fit.fp16_contribution[unit.name]
    if unit.name in calibrated.calibrators:
        evidence["calibrator"] = calibrated.calibrators[unit.name]
    return evidence


def _search_reasons(unit: Unit, decision: UnitDecision, rules: Rules, hard: HardSamples,
                    noise: NoiseModel, search: Search, high_precision: str,
                    all_int8: float) -> list[Reason]:
    """Why the search (not a rule) keeps a unit out of INT8, and out of FP16 (`all_int8`:
    the predicted output NSR of all-INT8)."""
    reasons = []
    fit, units = noise.model_fit.fitted, len(rules.units)
    if decision.precision != "int8" and not any(r.hard for r in decision.reasons):
        reasons.append(Reason(
            SEARCH_CODE, False, (decision.precision,),
            f"rank {decision.evidence['output_rank']} of {units} by output-noise contribution "
            f"{decision.predicted:.3g} (all INT8: {all_int8:.3g}); " + (
                "the certified plan of the front keeps it out of INT8"
                if search.point.int8_mac_share > 0 else
                f"no plan with INT8 held the budget ({len(search.done)} evaluated)"),
            SEARCH_SOURCE))
    if decision.precision == "fp32" and "fp16" in rules.allowed[unit.name] and \
            high_precision == "fp16":
        if search.floor is None:
            why = (f"FP16 would add predicted output NSR "
                   f"{fit.fp16_contribution.get(unit.name, 0.0):.3g} (local FP16 SQNR "
                   f"{hard.local.get(unit.name, {}).get('fp16', float('nan')):.3g} dB); the "
                   "budget left by the INT8 units does not hold it")
        else:
            floor = search.floor.certificate
            why = (f"all-FP16 scored {floor.value:.4g} against the limit {floor.limit:.4g} and "
                   "could not be certified, so the plan of last resort is the FP32 model")
        reasons.append(Reason(SEARCH_CODE, False, ("fp32",), why, SEARCH_SOURCE))
    return reasons


def uncertified_plan(prepared: Prepared, rules: Rules, calibrated: Calibrated, search: Search
                     ) -> tuple[Plan, onnx.ModelProto, Evaluation] | None:
    """The search's uncertified plan (:attr:`Search.uncertified`) as plain data, with its Q/DQ
    model and evaluation; None when there is none."""
    if search.uncertified is None:
        return None
    point, evaluation = search.uncertified
    kept = _plan_of(point, rules, prepared.context.settings.budget)
    return kept, calibrated.runner.quantized(kept.node_precisions()), evaluation
