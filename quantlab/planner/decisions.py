"""The plan as plain data: unit name -> precision with its reasons and evidence (plan.json)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantlab import qdq
from quantlab.errors import DataError
from quantlab.experiment import read_artifact, write_json
from quantlab.graph import Graph
from quantlab.planner.rules import Reason, allowed_precisions
from quantlab.planner.units import Unit

PLAN_FORMAT = "quantlab.plan"


PLAN_VERSION = 1



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
