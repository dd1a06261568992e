"""Precision plans: units of decision, the rules that seed them, and the plan as plain data.

A *unit* is a linear op (Conv, ConvTranspose, Gemm, MatMul) with the Q/DQ pairs
on its inputs, merged with every unit that must share one of those pairs:
qdq's placement keys each activation pair by the tensor it sits on, so linear
ops reading one tensor, and a residual Add reading it as its skip input, share
a pair and are decided together. Rules (Stage A of the planner design in
docs/peers.md section 12) look at the graph and the calibration ranges only;
each returns a :class:`Reason` naming its code, the precisions it allows and
its source. Hard reasons restrict a unit's precisions; soft ones only seed the
search and never pin on their own.
"""

from __future__ import annotations

import hashlib
import heapq
import importlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx
from onnx import helper
from scipy import optimize

from quantlab import qdq
from quantlab.errors import ConfigError, DataError, ModelError
from quantlab.experiment import read_artifact, read_json, write_json
from quantlab.graph import Graph, concrete_types

PLAN_FORMAT = "quantlab.plan"
# The reason of a unit the search (not a rule) keeps out of INT8.
SEARCH_CODE = "M-SEARCH"
SEARCH_SOURCE = ("quantlab: switchboard group testing on the hardest samples, MILP front, "
                 "certified on held-out data (docs/peers.md section 12, stages B3, D, E)")
PLAN_VERSION = 1
# Largest finite float16 (IEEE 754 binary16).
FP16_MAX = 65504.0
# Ops that change neither which element is which nor (beyond a scale) its magnitude:
# a unit whose output reaches a graph output through these only is a prediction head.
POINTWISE_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "LeakyRelu", "Clip", "Exp",
    "Softmax", "Identity", "Cast", "Neg", "Abs", "Sqrt", "Pow", "HardSigmoid", "HardSwish",
})
RESHAPE_OPS = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Concat",
                         "Slice", "Split", "Gather"})
# Ops that turn network outputs into probabilities/weights: a linear op reading their
# output (YOLOv8's DFL expectation, a grid MatMul) is decode arithmetic, not a layer.
DECODE_INPUT_OPS = frozenset({"Softmax", "Sigmoid"})


@dataclass
class Unit:
    """One decision: linear ops and residual Adds whose Q/DQ pairs go on or off together."""

    name: str
    linear: list[str]
    nodes: list[str]
    tensors: list[str]
    weights: list[str]
    macs: int = 0


def find_units(g: Graph, input_shapes: Mapping[str, Sequence[int]] | None = None) -> list[Unit]:
    """The units of a normalized model, in topological order, with MACs per sample batch.

    `input_shapes` (the real shapes of a calibration batch) fixes dimensions the
    model leaves symbolic; MACs are counted for inputs of those shapes.
    """
    placement = qdq.place(g.model)
    nodes = {node.name: node for node in g.model.graph.node}
    parent = {name: name for name in nodes}

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def union(first: str, second: str) -> None:
        parent[find(first)] = find(second)

    tensors_of: dict[str, list[str]] = {}
    skip_index: dict[str, int] = {}
    decided: set[str] = set()
    for tensor, edges in placement.readers.items():
        owners = _owners(edges, nodes, g)
        if not all(nodes[o].op_type in qdq.LINEAR_OPS or nodes[o].op_type == "Add"
                   for o in owners):
            continue  # the pair between a linear op and its Relu: a fusion aid, exact either way
        skip_index.update((o, i) for o, i in owners.items() if nodes[o].op_type == "Add")
        decided.update(owners)
        first, *others = owners
        for owner in others:
            union(first, owner)
        tensors_of.setdefault(first, []).append(tensor)
    owner_of = {t: owner for owner, tensors in tensors_of.items() for t in tensors}
    for group in scale_groups(g, placement):
        # Pairs joined by a Concat share one scale (see scale_groups): one decision.
        first, *others = [owner_of[t] for t in group if t in owner_of]
        for owner in others:
            union(first, owner)
    weights_of: dict[str, list[str]] = {}
    for (node_name, _), (weight, _) in placement.weights.items():
        weights_of.setdefault(node_name, []).append(weight)
        decided.add(node_name)

    for add, index in skip_index.items():
        if not any(nodes[n].op_type in qdq.LINEAR_OPS for n in decided if find(n) == find(add)):
            # Only residual Adds: TensorRT fuses such an Add into the conv producing its other
            # input, and its skip pair exists for that fusion, so it joins that conv's unit.
            backbone = _backbone(nodes[add].input[1 - index], g)
            if backbone is not None and backbone.name in decided:
                union(add, backbone.name)
    order = {node.name: i for i, node in enumerate(g.model.graph.node)}
    groups: dict[str, list[str]] = {}
    for name in sorted(decided, key=order.__getitem__):
        groups.setdefault(find(name), []).append(name)

    shapes = _shapes(g, input_shapes)
    units = []
    for names in groups.values():
        linear = [n for n in names if nodes[n].op_type in qdq.LINEAR_OPS]
        tensors = sorted({t for n in names for t in tensors_of.get(n, [])},
                         key=lambda t: g.position.get(t, -1))
        weights = list(dict.fromkeys(w for n in names for w in weights_of.get(n, [])))
        macs = sum(linear_macs(nodes[n], shapes) for n in linear)
        units.append(Unit((linear or names)[0], linear, names, tensors, weights, macs))
    units.sort(key=lambda u: order[u.nodes[0]])
    return units


def scale_groups(g: Graph, placement: qdq.Placement | None = None) -> list[list[str]]:
    """Pair tensors that must share one scale: those joined by a Concat, and its output's.

    TensorRT moves Q/DQ through commuting ops, Concat among them (docs/tensorrt.md,
    "Q/DQ rules TensorRT expects"): the pair on a Concat's output moves onto each
    of its inputs, so an input that carries its own pair for another reader gets a
    second quantization at another scale unless the two scales are equal, and the
    Concat cannot be a plain copy of INT8 inputs (NVIDIA/TensorRT#4366, #3861;
    NNCF unifies Concat scales for the same reason, openvinotoolkit/nncf#646).
    Members are found through pass-through ops (a pair moved back across a Reshape)
    and nested Concats. Groups of two or more pair tensors, in topological order.
    """
    placement = placement or qdq.place(g.model)
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        parent.setdefault(name, name)
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def paired(tensor: str) -> str:
        """The tensor carrying the pair `tensor` is quantized with, across pass-through ops."""
        while tensor not in placement.readers and \
                (producer := g.producers.get(tensor)) is not None and \
                producer.op_type in qdq.PASS_THROUGH_OPS:
            tensor = producer.input[0]
        return tensor

    for node in g.model.graph.node:
        if node.op_type == "Concat":
            members = [paired(t) for t in [node.output[0], *node.input] if t in g.floats]
            for member in members[1:]:
                parent[find(member)] = find(members[0])
    groups: dict[str, list[str]] = {}
    for tensor in sorted(parent, key=lambda t: g.position.get(t, -1)):
        if tensor in placement.readers:
            groups.setdefault(find(tensor), []).append(tensor)
    return [group for group in groups.values() if len(group) > 1]


def share_scales(g: Graph, amax: Mapping[str, float]) -> dict[str, float]:
    """`amax` with every scale group (:func:`scale_groups`) at its widest member's amax.

    The widest range, so no member clips more than its own calibration allowed.
    """
    placement = qdq.place(g.model)
    shared = dict(amax)
    for group in scale_groups(g, placement):
        sources = {placement.source[t] for t in group} & set(amax)
        if sources:
            widest = max(amax[t] for t in sources)
            shared.update(dict.fromkeys(sources, widest))
    return shared


def _owners(edges, nodes, g: Graph) -> dict[str, int]:
    """Nodes deciding a pair (-> input index): its readers, followed forward through the
    pass-through ops the pair moved backward across."""
    owners, stack, seen = {}, list(edges), set()
    while stack:
        name, index = stack.pop()
        if (name, index) in seen:
            continue
        seen.add((name, index))
        node = nodes[name]
        if node.op_type in qdq.PASS_THROUGH_OPS and index == 0:
            stack.extend((c.name, i) for c in g.consumers.get(node.output[0], [])
                         for i, x in enumerate(c.input) if x == node.output[0])
        else:
            owners[name] = index
    return dict(sorted(owners.items()))


def _backbone(tensor: str, g: Graph) -> onnx.NodeProto | None:
    """The linear op producing `tensor`, directly or through a BatchNormalization."""
    producer = g.producers.get(tensor)
    if producer is not None and producer.op_type == "BatchNormalization":
        producer = g.producers.get(producer.input[0])
    return producer if producer is not None and producer.op_type in qdq.LINEAR_OPS else None


def _shapes(g: Graph, input_shapes) -> dict[str, tuple]:
    """Shapes of every tensor and initializer; symbolic dims fixed by `input_shapes`."""
    shapes = dict(g.shapes)
    inferred = concrete_types(g.model, input_shapes) if input_shapes else None
    for name, tensor_type in (inferred or {}).items():
        if tensor_type.HasField("shape"):
            shapes[name] = tuple(d.dim_value if d.HasField("dim_value") else None
                                 for d in tensor_type.shape.dim)
    shapes.update({init.name: tuple(init.dims) for init in g.model.graph.initializer})
    return shapes


def linear_macs(node: onnx.NodeProto, shapes: Mapping[str, tuple]) -> int:
    """Multiply-accumulates of one Conv / ConvTranspose / Gemm / MatMul from its shapes."""
    data, weight, out = (shapes.get(node.input[0]), shapes.get(node.input[1]),
                         shapes.get(node.output[0]))
    needed = {"Conv": (out, weight), "ConvTranspose": (data, weight)}.get(node.op_type,
                                                                           (out, data))
    if any(s is None or None in s for s in needed):
        raise ModelError(
            f"the shapes around node '{node.name}' ({node.op_type}) are not all known, so its "
            "MACs cannot be counted; pass the shapes of a real batch (the planner takes them "
            "from the calibration data)."
        )
    if node.op_type == "Conv":
        return int(np.prod(out, dtype=np.int64) * np.prod(weight[1:], dtype=np.int64))
    if node.op_type == "ConvTranspose":
        return int(np.prod(data, dtype=np.int64) * np.prod(weight[1:], dtype=np.int64))
    if node.op_type == "Gemm":
        trans_a = next((a.i for a in node.attribute if a.name == "transA"), 0)
        return int(np.prod(out, dtype=np.int64) * data[0 if trans_a else 1])
    return int(np.prod(out, dtype=np.int64) * data[-1])


# ---------------------------------------------------------------- rules


@dataclass(frozen=True)
class Reason:
    """Why a rule speaks about a unit: its code, whether it binds, what it allows, and why."""

    code: str
    hard: bool
    allowed: tuple[str, ...]
    evidence: str
    source: str


@dataclass
class RuleContext:
    """What the rules read: the graph index, weights, and calibration ranges of activations.

    ``amax`` is max |x| per tensor, ``p9999`` its 99.99th percentile (both from
    the statistics of the calibration run; tensors without statistics are skipped).
    """

    graph: Graph
    amax: Mapping[str, float] = field(default_factory=dict)
    p9999: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.weights = {init.name: onnx.numpy_helper.to_array(init)
                        for init in self.graph.model.graph.initializer}
        self.nodes = {node.name: node for node in self.graph.model.graph.node}


class Rule:
    """One planning rule: ``check(unit, context)`` returns a :class:`Reason` or None."""

    code: ClassVar[str]
    source: ClassVar[str]

    def check(self, unit: Unit, context: RuleContext) -> Reason | None:
        """The reason this rule gives for `unit`, or None when it does not apply."""
        raise NotImplementedError

    def reason(self, hard: bool, allowed: tuple[str, ...], evidence: str) -> Reason:
        """A :class:`Reason` carrying this rule's code and source."""
        return Reason(self.code, hard, allowed, evidence, self.source)


def _attribute(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


class KernelRule(Rule):
    """Linear ops TensorRT has no INT8 kernel for (small or odd channel counts, GEMV)."""

    code = "R-KERNEL"
    source = ("TensorRT Model Optimizer graph_utils.py (conv channel/kernel support, L1163; "
              "GEMV MatMul cannot use Tensor Cores, L1090)")

    def check(self, unit, context):
        problems = [p for n in unit.linear
                    if (p := self._problem(context.nodes[n], context)) is not None]
        if not problems:
            return None
        return self.reason(True, ("fp16", "fp32"), "; ".join(problems))

    def _problem(self, node: onnx.NodeProto, context: RuleContext) -> str | None:
        shapes = context.graph.shapes
        if node.op_type == "Conv" and node.input[1] in context.weights:
            weight = context.weights[node.input[1]]
            group = _attribute(node, "group", 1)
            out_channels, in_channels = weight.shape[0], weight.shape[1] * group
            kernel = weight.shape[2:]
            if in_channels >= 16 and out_channels >= 16:
                return None
            if group == 1:
                producer = context.graph.producers.get(node.input[0])
                first = producer is None
                supported = ((out_channels % 8 == 0 or in_channels % 8 == 0)
                             and (first or max(in_channels, out_channels) >= 16)
                             and len(set(kernel)) <= 1)
            else:
                supported = out_channels % 8 == 0 and min(kernel, default=0) >= 3
            if not supported:
                return (f"{node.name}: Conv with {in_channels} input / {out_channels} output "
                        f"channels, group {group}, kernel {list(kernel)}")
        elif node.op_type == "MatMul":
            a, b = shapes.get(node.input[0]), context.weights.get(node.input[1])
            b_shape = b.shape if b is not None else shapes.get(node.input[1])
            if a and b_shape and (a[-2:-1] == (1,) or b_shape[-1:] == (1,)):
                return f"{node.name}: GEMV MatMul ({list(a)} x {list(b_shape)})"
        return None


def _reaches_output_through(tensor: str, graph: Graph, allowed) -> bool:
    """True when every path from `tensor` ends at a graph output through nodes `allowed` accepts."""
    outputs, stack, seen = set(graph.outputs), [tensor], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        readers = graph.consumers.get(name, [])
        if not readers and name not in outputs:
            return False
        for node in readers:
            if not allowed(node):
                return False
            stack.extend(o for o in node.output if o)
    return True


class HeadRule(Rule):
    """Prediction heads (soft) and linear decode arithmetic (hard)."""

    code = "R-HEAD"
    source = ("TensorRT Model Optimizer get_skipped_output_layers (partitioning.py L244); "
              "onnxruntime#14233; ultralytics#26171/#26220/#25306 (detection heads in INT8)")

    def check(self, unit, context):
        g = context.graph

        def head_op(node: onnx.NodeProto) -> bool:
            return node.op_type in POINTWISE_OPS | RESHAPE_OPS or (
                node.op_type in qdq.LINEAR_OPS and self._reads_probabilities(node, g))

        heads = [n for n in unit.linear
                 if _reaches_output_through(context.nodes[n].output[0], g, head_op)]
        if not heads:
            return None
        decode = [n for n in heads if self._reads_probabilities(context.nodes[n], g)]
        if decode:
            return self.reason(True, ("fp32",), f"decode arithmetic: {', '.join(decode)} reads "
                               "Softmax/Sigmoid outputs and feeds a graph output")
        return self.reason(False, ("fp16", "fp32"), f"head: {', '.join(heads)} reaches a graph "
                           "output through pointwise/reshape ops and decode only")

    @staticmethod
    def _reads_probabilities(node: onnx.NodeProto, g: Graph) -> bool:
        name = node.input[0]
        while (producer := g.producers.get(name)) is not None:
            if producer.op_type in DECODE_INPUT_OPS:
                return True
            if producer.op_type not in RESHAPE_OPS:
                return False
            name = producer.input[0]
        return False


class DepthwiseRule(Rule):
    """Depthwise convs whose per-channel weight ranges spread widely (soft)."""

    code = "R-DW"
    source = ("Nagel et al. 2019, Data-Free Quantization (arXiv:1906.04721), section 3: "
              "depthwise ranges spanning orders of magnitude")
    # max / median of the per-channel weight amax above which the prior speaks.
    SPREAD = 32.0

    def check(self, unit, context):
        spreads = []
        for name in unit.linear:
            node = context.nodes[name]
            weight = context.weights.get(node.input[1])
            group = _attribute(node, "group", 1)
            if node.op_type != "Conv" or weight is None or group == 1 or weight.shape[1] != 1:
                continue
            channel_amax = np.abs(weight.reshape(weight.shape[0], -1)).max(axis=1)
            median = float(np.median(channel_amax))
            spread = float(channel_amax.max()) / median if median > 0 else np.inf
            if spread > self.SPREAD:
                spreads.append(f"{name}: channel weight range max/median {spread:.3g}")
        if not spreads:
            return None
        return self.reason(False, ("fp16", "fp32"), "; ".join(spreads))


class RangeRule(Rule):
    """Activations whose INT8 range is set by a few outliers (soft)."""

    code = "R-RANGE"
    source = "quantlab statistics: amax over OUTLIER_RATIO x the 99.99th percentile"
    # Same threshold as calibrate.OUTLIER_RATIO's warning.
    RATIO = 10.0

    def check(self, unit, context):
        wide = [f"{t}: amax {context.amax[t]:.4g} = {context.amax[t] / context.p9999[t]:.3g} x "
                "p99.99" for t in unit.tensors
                if t in context.amax and context.p9999.get(t, 0) > 0
                and context.amax[t] > self.RATIO * context.p9999[t]]
        if not wide:
            return None
        return self.reason(False, ("fp16", "fp32"), "; ".join(wide))


class Fp16RangeRule(Rule):
    """Units whose tensors FP16 cannot hold go FP32, never FP16 (hard)."""

    code = "R-FP16"
    source = ("TensorRT Model Optimizer AutoCast (data_max 512: the FP16 ULP at 512 is 0.5; "
              "init_max 65504)")
    DATA_MAX = 512.0

    def check(self, unit, context):
        found = []
        for name in unit.linear:
            node = context.nodes[name]
            for tensor in [*node.input, *node.output]:
                if tensor in context.weights:
                    peak = float(np.abs(context.weights[tensor]).max(initial=0.0))
                    if peak > FP16_MAX:
                        found.append(f"{tensor}: weight max |w| {peak:.4g} > {FP16_MAX:g}")
                elif context.amax.get(tensor, 0.0) > self.DATA_MAX:
                    found.append(f"{tensor}: max |x| {context.amax[tensor]:.4g} > "
                                 f"{self.DATA_MAX:g}")
        if not found:
            return None
        return self.reason(True, ("int8", "fp32"), "; ".join(found))


RULES: tuple[Rule, ...] = (KernelRule(), HeadRule(), DepthwiseRule(), RangeRule(),
                           Fp16RangeRule())


def apply_rules(units: Sequence[Unit], context: RuleContext,
                rules: Sequence[Rule] = RULES) -> dict[str, list[Reason]]:
    """Reasons per unit name (units no rule speaks about are absent)."""
    result = {}
    for unit in units:
        reasons = [r for rule in rules if (r := rule.check(unit, context)) is not None]
        if reasons:
            result[unit.name] = reasons
    return result


def allowed_precisions(reasons: Sequence[Reason]) -> tuple[str, ...]:
    """Precisions every hard reason allows, cheapest first; soft reasons restrict nothing.

    Raises ModelError when hard reasons contradict each other (nothing left).
    """
    allowed = set(qdq.PRECISIONS)
    for reason in reasons:
        if reason.hard:
            allowed &= set(reason.allowed)
    if not allowed:
        codes = ", ".join(r.code for r in reasons if r.hard)
        raise ModelError(f"rules {codes} leave no precision for one unit; this is a bug in the "
                         "rules, please report it with the model.")
    return tuple(p for p in qdq.PRECISIONS if p in allowed)


# ---------------------------------------------------------------- the plan


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
                                 "units": {name: asdict(d) for name, d in self.units.items()}})

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
            return cls(units, str(data["metric"]), data["budget"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DataError(f"{path} is a damaged plan file (field {exc}); plan again to "
                            "rewrite it.") from None


# ---------------------------------------------------------------- output-aware sensitivity


def sample_nsr(outputs: Mapping[str, np.ndarray],
               references: Mapping[str, np.ndarray]) -> np.ndarray:
    """Per-sample output noise-to-signal ratio: mean over float outputs of |y - r|^2 / |r|^2.

    Samples are on axis 0 of every output. Output SQNR in dB is -10 log10 of the mean.
    """
    ratios = []
    for name, reference in references.items():
        reference = np.asarray(reference)
        if not np.issubdtype(reference.dtype, np.floating):
            continue
        count = len(reference)
        ref = reference.reshape(count, -1).astype(np.float64)
        diff = np.asarray(outputs[name]).reshape(count, -1).astype(np.float64) - ref
        power = np.maximum((ref * ref).sum(axis=1), np.finfo(np.float64).tiny)
        ratios.append((diff * diff).sum(axis=1) / power)
    if not ratios:
        raise ModelError(f"the model has no float outputs to compare ({sorted(references)}); "
                         "pass a metric that reads its outputs (--metric module:function).")
    return np.mean(ratios, axis=0)


def hardest_samples(batches, reference: Callable, candidate: Callable, count: int,
                    progress: Callable | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The `count` samples where `candidate` disagrees most with `reference`, as one batch.

    `batches` is a :class:`quantlab.data.BatchSource`; `reference` and `candidate`
    run one batch (a backend's ``run``). Returns the batch (samples in data order)
    and their indices in the data. Only the kept samples stay in memory.
    """
    kept: list[tuple[float, int, dict]] = []  # a min-heap on disagreement
    start = 0
    for batch in progress(batches) if progress else batches:
        length = batches.length(batch)
        nsr = sample_nsr(candidate(batch), reference(batch))
        for index in np.argsort(-nsr, kind="stable")[:count]:
            item = (float(nsr[index]), start + int(index),
                    {k: np.array(v) for k, v in batches.slice(batch, index, index + 1).items()})
            if len(kept) < count:
                heapq.heappush(kept, item)
            elif item[0] > kept[0][0]:
                heapq.heapreplace(kept, item)
        start += length
    kept.sort(key=lambda item: item[1])
    samples = [item[2] for item in kept]
    merged = {}
    for name, first in samples[0].items():
        axis = batches.axes.get(name, 0)
        merged[name] = first if axis is None else np.concatenate([s[name] for s in samples],
                                                                 axis=axis)
    return merged, np.array([item[1] for item in kept])


@dataclass
class OutputSensitivity:
    """Each unit's contribution to the output noise when it runs INT8, fitted from trials.

    ``masks[t, i]`` is True when unit ``units[i]`` ran INT8 in trial ``t``, ``nsr[t]``
    the measured output noise-to-signal ratio of that trial, ``contribution`` the
    nonnegative a_i of nsr ~ sum of a_i over the INT8 units.
    """

    units: list[str]
    masks: np.ndarray
    nsr: np.ndarray
    contribution: np.ndarray

    def predicted_nsr(self, int8: Iterable[str]) -> float:
        """Predicted output noise-to-signal ratio when the units `int8` run INT8."""
        chosen = set(int8)
        return float(sum(a for u, a in zip(self.units, self.contribution, strict=True)
                         if u in chosen))

    def ranking(self) -> list[str]:
        """Units, largest contribution first."""
        return [self.units[i] for i in np.argsort(-self.contribution, kind="stable")]


def group_test(board, run: Callable, batch: Mapping[str, np.ndarray],
               references: Mapping[str, np.ndarray], trials: int = 24,
               int8_share: float = 0.5, ridge: float = 1e-3, seed: int = 0,
               fixed: Mapping[str, str] | None = None,
               known: Mapping[int, float] | None = None,
               on_trial: Callable[[int, float], None] | None = None,
               progress: Callable | None = None) -> OutputSensitivity:
    """Output-aware sensitivity from `trials` switchboard passes over one (hard) batch.

    Each trial runs a random plan (each unit INT8 with probability `int8_share`,
    else FP32) through ``run(batch, flags)`` (the switchboard backend run on the
    batch with the plan's flag inputs), and measures the output noise against
    `references` (the FP32 outputs on `batch`). Quantization noise of separate
    layers adds in power to first order, so nsr(S) ~ sum of a_i over the INT8
    units S, fitted by nonnegative least squares with a small ridge
    (``ridge * trials``) so that a few trials still give a unique answer. The
    all-INT8 plan is always one of the trials.
    Units in `fixed` (hard pins: unit -> precision) keep that precision in every
    trial and get no contribution. Trials in `known` (index -> nsr, from an
    interrupted run with the same seed) are not run again; `on_trial(t, nsr)` is
    called after each trial run.
    """
    fixed = dict(fixed or {})
    units = list(board.flags)
    rng = np.random.default_rng(seed)
    masks = rng.random((trials, len(units))) < int8_share
    masks[0] = True
    masks[:, [i for i, u in enumerate(units) if u in fixed]] = False
    nsr = np.empty(trials)
    known = dict(known or {})
    for t in progress(range(trials)) if progress else range(trials):
        if t in known:
            nsr[t] = known[t]
            continue
        precisions = {u: "int8" if m else "fp32" for u, m in zip(units, masks[t], strict=True)}
        precisions.update(fixed)
        outputs = run(batch, board.feeds(precisions))
        nsr[t] = float(sample_nsr(outputs, references).mean())
        if on_trial:
            on_trial(t, nsr[t])
    system = np.vstack([masks.astype(np.float64), np.sqrt(ridge * trials) * np.eye(len(units))])
    target = np.concatenate([nsr, np.zeros(len(units))])
    contribution, _ = optimize.nnls(system, target)
    return OutputSensitivity(units, masks, nsr, contribution)


# ---------------------------------------------------------------- search over the front


@dataclass
class FrontPoint:
    """The plan with the most INT8 MACs whose predicted noise stays within `budget`."""

    budget: float
    predicted: float
    int8_mac_share: float
    precisions: dict[str, str]


def fallback_precision(allowed: Sequence[str], high_precision: str = "fp16") -> str:
    """The precision a unit runs in when not INT8: FP16 where allowed and wanted, else FP32."""
    return "fp16" if high_precision == "fp16" and "fp16" in allowed else "fp32"


def solve(units: Sequence[Unit], allowed: Mapping[str, Sequence[str]],
          contribution: Mapping[str, float], budget: float,
          high_precision: str = "fp16",
          fp16_contribution: Mapping[str, float] | None = None) -> FrontPoint:
    """Maximize the INT8 share of MACs subject to the predicted noise staying <= `budget`.

    Each unit runs INT8 (adding `contribution`), FP16 (adding `fp16_contribution`,
    where its hard reasons and `high_precision` allow FP16; units missing from it
    add none, an infinite figure forbids FP16) or FP32 (adding none). Two 0/1
    knapsacks solved exactly by ``scipy.optimize.milp``: the most INT8 MACs within
    the budget, then the most FP16 MACs among the other units within what is left.
    """
    if not budget >= 0:
        raise ConfigError(f"the noise budget must be a number >= 0, got {budget}.")
    names = [u.name for u in units]
    macs = np.array([u.macs for u in units], dtype=np.float64)
    total = macs.sum()
    cost = np.array([float(contribution.get(n, 0.0)) for n in names])
    half = np.array([float((fp16_contribution or {}).get(n, 0.0)) for n in names])
    can_int8 = np.array(["int8" in allowed.get(n, qdq.PRECISIONS) for n in names], bool)
    can_fp16 = np.array([high_precision == "fp16" and "fp16" in allowed.get(n, qdq.PRECISIONS)
                         for n in names], bool) & np.isfinite(half)
    # Units without MACs (or all of them, for a model without) still prefer INT8 when free.
    gain = (macs / total if total else np.zeros(len(names))) + 1e-9
    chosen = _knapsack(gain, cost, budget, can_int8)
    rounded = _knapsack(gain, half, budget - cost[chosen].sum(), can_fp16 & ~chosen)
    precisions = {n: "int8" if c else "fp16" if r else "fp32"
                  for n, c, r in zip(names, chosen, rounded, strict=True)}
    share = float(macs[chosen].sum() / total) if total else 1.0
    return FrontPoint(budget, float(cost[chosen].sum() + half[rounded].sum()), share, precisions)


def _knapsack(value: np.ndarray, weight: np.ndarray, capacity: float,
              allowed: np.ndarray) -> np.ndarray:
    """The 0/1 choice of `allowed` items with the most value whose weight fits `capacity`."""
    if not allowed.any():
        return np.zeros(len(value), bool)
    weight = np.where(allowed, weight, 0.0)
    result = optimize.milp(-value, integrality=np.ones(len(value)),
                           bounds=optimize.Bounds(0.0, allowed.astype(np.float64)),
                           constraints=[optimize.LinearConstraint(weight[None, :], -np.inf,
                                                                  max(capacity, 0.0))],
                           options={"mip_rel_gap": 0.0})
    return np.round(result.x).astype(bool)


def front(units: Sequence[Unit], allowed: Mapping[str, Sequence[str]],
          contribution: Mapping[str, float], points: int = 24,
          high_precision: str = "fp16",
          fp16_contribution: Mapping[str, float] | None = None) -> list[FrontPoint]:
    """The predicted INT8-share-vs-noise front: the best plan at `points` budgets.

    Budgets run from 0 to the sum of all contributions, log-spaced from the smallest
    nonzero contribution (INT8 or FP16), so both the cheap pins and the last units
    show. Per INT8 share the plan of the largest budget is kept: the budget its INT8
    units leave goes to FP16 instead of FP32.
    """
    costs = [c for c in [*contribution.values(), *(fp16_contribution or {}).values()]
             if 0 < c < np.inf]
    budgets = [0.0]
    if costs:  # up to every unit in INT8 and every other one in FP16
        budgets += list(np.geomspace(min(costs), sum(costs), points - 1))
    best = {}  # INT8 share -> plan; budgets ascend, so the last plan of a share wins
    for budget in budgets:
        point = solve(units, allowed, contribution, budget, high_precision, fp16_contribution)
        best[point.int8_mac_share] = point
    return [best[share] for share in sorted(best)]


# ---------------------------------------------------------------- metrics and certification

Outputs = list[dict[str, np.ndarray]]


def output_sqnr(outputs: Outputs, references: Outputs) -> float:
    """Output SQNR in dB over all samples: -10 log10 of the mean per-sample NSR."""
    nsr = np.concatenate([sample_nsr(o, r) for o, r in zip(outputs, references, strict=True)])
    mean = float(nsr.mean())
    return float(-10.0 * np.log10(mean)) if mean > 0 else float("inf")


def argmax_agreement(outputs: Outputs, references: Outputs) -> float:
    """Share of samples whose argmax over axis 1 of the first output agrees with the reference."""
    name = next(iter(references[0]))
    same = [np.argmax(o[name], axis=1) == np.argmax(r[name], axis=1)
            for o, r in zip(outputs, references, strict=True)]
    return float(np.concatenate([s.reshape(len(s), -1).all(axis=1) for s in same]).mean())


METRICS: dict[str, Callable[[Outputs, Outputs], float]] = {
    "sqnr": output_sqnr, "agreement": argmax_agreement}


def resolve_metric(name: str) -> Callable[[Outputs, Outputs], float]:
    """A built-in label-free metric by name, or ``module:function`` imported."""
    if name in METRICS:
        return METRICS[name]
    if ":" not in name:
        raise ConfigError(f"unknown metric '{name}'; use one of {', '.join(METRICS)} or "
                          "module:function (function(outputs, references) -> float, higher "
                          "is better).")
    module_name, _, function_name = name.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load metric '{name}': {exc}. Pass module:function with the "
                          "module importable (on PYTHONPATH) and the function defined in it."
                          ) from None
    if not callable(function):
        raise ConfigError(f"metric '{name}' is not a function.")
    return function


def metric_value(metric: Callable, name: str, outputs: Outputs, references: Outputs) -> float:
    """`metric` on the outputs, checked to be a real number (NaN is refused, not compared)."""
    value = metric(outputs, references)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise DataError(f"metric '{name}' returned {value!r}; it must return a number "
                        "(higher is better).") from None
    if np.isnan(value):
        raise DataError(f"metric '{name}' returned NaN on {len(outputs)} batches; it must "
                        "return a number for any non-empty list of batches (check for a "
                        "division by zero or an empty selection in it).")
    return value


def split_samples(batches: Outputs) -> Outputs:
    """One entry per sample (axis 0 of every output) from entries per batch."""
    return [{name: value[i:i + 1] for name, value in batch.items()}
            for batch in batches for i in range(len(next(iter(batch.values()))))]


@dataclass
class Certificate:
    """Whether a plan's measured metric meets the budget, with a paired bootstrap interval.

    ``limit`` is the lowest acceptable metric value (FP32's minus the allowed drop,
    or the floor); ``interval`` the bootstrap interval of the candidate's margin over
    it on resampled samples (paired: FP32 is scored on the same resample).
    """

    metric: str
    reference: float
    value: float
    limit: float
    interval: tuple[float, float]
    confidence: float
    samples: int
    certified: bool
    too_small: bool
    needed_samples: int | None

    def too_small_message(self) -> str:
        """What to do when the evaluation set is too small to certify the budget ('' if not)."""
        if not self.too_small:
            return ""
        drop = self.reference - self.limit
        half_width = (self.interval[1] - self.interval[0]) / 2
        needed = f"about {self.needed_samples}" if self.needed_samples else "many more"
        return (f"the evaluation set is too small to certify a drop of {drop:.4g} in "
                f"{self.metric}: on its {self.samples} samples the paired-bootstrap interval of "
                f"the margin is +-{half_width:.3g} wide, more than half the budget "
                f"({drop / 2:.3g}); {needed} samples are needed. Pass more held-out data with "
                "--eval, or allow a larger --max-drop.")


def certify(metric: Callable, name: str, outputs: Outputs, references: Outputs, *,
            max_drop: float | None = None, floor: float | None = None,
            resamples: int = 200, confidence: float = 0.95, seed: int = 0) -> Certificate:
    """Check a candidate's outputs against FP32's with a metric function (see certify_paired).

    Resamples hand the metric one entry per sample, FP32 scored on the same ones.
    """
    samples, refs = split_samples(outputs), split_samples(references)

    def evaluate(pick: np.ndarray) -> tuple[float, float]:
        chosen, fp32 = [samples[i] for i in pick], [refs[i] for i in pick]
        return (metric_value(metric, name, chosen, fp32),
                metric_value(metric, name, fp32, fp32))

    reference = metric_value(metric, name, references, references)
    value = metric_value(metric, name, outputs, references)
    return certify_paired(name, evaluate, len(samples), (value, reference), max_drop=max_drop,
                          floor=floor, resamples=resamples, confidence=confidence, seed=seed)


def certify_paired(name: str, evaluate: Callable[[np.ndarray], tuple[float, float]],
                   count: int, full: tuple[float, float] | None = None, *,
                   max_drop: float | None = None, floor: float | None = None,
                   resamples: int = 200, confidence: float = 0.95,
                   seed: int = 0) -> Certificate:
    """Certify a plan from ``evaluate(sample indices) -> (candidate value, FP32 value)``.

    The margin (value minus limit) is bootstrapped over the `count` samples, FP32
    scored on the same resample (paired); the plan is certified when the lower end
    of the one-sided `confidence` interval is >= 0. With ``max_drop``, an interval
    half-width over max_drop / 2 means the evaluation set is too small to certify
    that budget; the size needed follows from the half-width shrinking as
    1 / sqrt(samples). `full` is evaluate on all samples when already known.
    """
    if (max_drop is None) == (floor is None):
        raise ConfigError("give exactly one of a maximum drop or a metric floor.")
    if max_drop is not None and not max_drop >= 0:
        raise ConfigError(f"the maximum drop must be >= 0, got {max_drop}: impossible even in "
                          "FP32, which is the reference every plan is compared with.")
    value, reference = full if full is not None else evaluate(np.arange(count))
    if floor is not None and floor > reference:
        raise ConfigError(f"the floor {floor} of metric '{name}' is above its value for the FP32 "
                          f"model itself ({reference:.6g}): impossible even in FP32. Lower it.")
    if max_drop is not None and not np.isfinite(reference):
        raise ConfigError(f"metric '{name}' of the FP32 model against itself is {reference}; a "
                          "drop from it means nothing. Use a floor (--min-sqnr) instead.")
    rng = np.random.default_rng(seed)
    margins = np.empty(resamples)
    for b in range(resamples):
        got, fp32 = evaluate(rng.integers(0, count, count))
        margins[b] = got - (fp32 - max_drop if max_drop is not None else floor)
    low, high = np.quantile(margins, [1 - confidence, confidence])
    limit = reference - max_drop if max_drop is not None else floor
    half_width = (high - low) / 2
    too_small = max_drop is not None and half_width > max_drop / 2
    needed = (int(np.ceil(count * (half_width / (max_drop / 2)) ** 2))
              if too_small and max_drop > 0 else None)
    return Certificate(name, reference, value, limit, (float(low), float(high)), confidence,
                       count, bool(low >= 0), bool(too_small), needed)


def task_evaluator(task, outputs: Outputs,
                   references: Outputs) -> Callable[[np.ndarray], tuple[float, float]]:
    """``evaluate(indices)`` of a task's primary metric (top-1, COCO mAP) for certify_paired.

    Predictions are made once per batch; a resample of images re-accumulates COCO's
    per-image matches (:func:`quantlab.tasks.coco_map_resampler`).
    """
    from quantlab.tasks import coco_map_resampler

    ids = task.ids()

    def predictions(batches: Outputs) -> list:
        found, start = [], 0
        for batch in batches:
            stop = start + len(next(iter(batch.values())))
            predicted = task.postprocess(dict(batch), ids[start:stop])
            if task.kind == "classification":
                found.extend(np.argmax(predicted, axis=1) == np.asarray(task.labels)[start:stop])
            else:
                found.extend(predicted)
            start = stop
        return found

    candidate, fp32 = predictions(outputs), predictions(references)
    if task.kind == "classification":
        hits, ref_hits = np.array(candidate, float), np.array(fp32, float)
        return lambda pick: (float(hits[pick].mean()), float(ref_hits[pick].mean()))
    count = len(np.concatenate([next(iter(b.values())) for b in outputs]))
    scores = [coco_map_resampler(task.coco, found, ids[:count]) for found in (candidate, fp32)]
    return lambda pick: (scores[0](pick), scores[1](pick))


# ---------------------------------------------------------------- TensorRT <= 10 calibration cache


def pinned_tensors(plan: Plan, g: Graph) -> set[str]:
    """Float inputs and outputs of the non-INT8 units' nodes: the calibration cache omits them
    so TensorRT <= 10 (implicit INT8) runs those layers in higher precision."""
    nodes = {node.name: node for node in g.model.graph.node}
    names = {name for decision in plan.units.values() if decision.precision != "int8"
             for node in decision.nodes for name in [*nodes[node].input, *nodes[node].output]}
    return {name for name in names if name in g.floats}


# ---------------------------------------------------------------- the planning flow


def run_batched(run: Callable, batch: Mapping[str, np.ndarray], source) -> dict[str, np.ndarray]:
    """`run` over `batch` in chunks of the source's batch size (fixed-batch models), outputs
    joined on axis 0."""
    length, parts = source.length(batch), []
    for start in range(0, length, source.batch_size):
        parts.append(run(source.slice(batch, start, min(start + source.batch_size, length))))
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


class Checkpoint:
    """What an interrupted plan run already measured, in a JSON file, so a re-run resumes.

    Holds the switchboard trials (index -> nsr) and the evaluations (front index ->
    :class:`Evaluation`) of a run identified by `fingerprint` (a hash of the model,
    the data, the scales and the settings); a file of another run is ignored and
    replaced. Every update is written atomically.
    """

    def __init__(self, path: str | os.PathLike | None, fingerprint: str):
        self.path = Path(path) if path is not None else None
        self.fingerprint = fingerprint
        self.trials: dict[int, float] = {}
        self.evaluations: dict[int, Evaluation] = {}
        if self.path is None or not self.path.is_file():
            return
        try:
            data = read_json(self.path)
            if data.get("fingerprint") != fingerprint:
                return
            self.trials = {int(t): float(v) for t, v in data["trials"].items()}
            self.evaluations = {int(i): Evaluation(
                e["int8_mac_share"], e["predicted"],
                Certificate(**{**e["certificate"],
                               "interval": tuple(e["certificate"]["interval"])}),
                e["seconds"]) for i, e in data["evaluations"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.trials, self.evaluations = {}, {}  # unreadable: start over

    def add_trial(self, index: int, nsr: float) -> None:
        """Record one switchboard trial."""
        self.trials[index] = nsr
        self._save()

    def add_evaluation(self, index: int, evaluation: Evaluation) -> None:
        """Record one evaluation of the front's plan `index`."""
        self.evaluations[index] = evaluation
        self._save()

    def _save(self) -> None:
        if self.path is not None:
            write_json(self.path, {"format": "quantlab.plan-progress",
                                   "fingerprint": self.fingerprint, "trials": self.trials,
                                   "evaluations": {i: asdict(e) for i, e in
                                                   self.evaluations.items()}})


def fingerprint(model: onnx.ModelProto, *parts) -> str:
    """A hash identifying a plan run: the model and the settings and data descriptions."""
    digest = hashlib.sha256(model.SerializeToString())
    digest.update(json.dumps([str(p) for p in parts]).encode())
    return digest.hexdigest()


@dataclass
class Evaluation:
    """One full evaluation of a plan on the real INT8 model: the ledger entry."""

    int8_mac_share: float
    predicted: float
    certificate: Certificate
    seconds: float


@dataclass
class PlanResult:
    """Everything `make_plan` produced; ``evaluations[chosen]`` certifies ``plan``.

    The chosen plan is the certified one with the most INT8 MACs or, when none is
    certified, the most conservative plan evaluated (its certificate says so).
    """

    plan: Plan
    qdq_model: onnx.ModelProto
    amax: dict[str, float]
    front: list[FrontPoint]
    sensitivity: OutputSensitivity
    evaluations: list[Evaluation]
    chosen: int
    hard_samples: list[int]

    @property
    def certificate(self) -> Certificate:
        """The certificate of the chosen plan."""
        return self.evaluations[self.chosen].certificate


def make_plan(model: onnx.ModelProto, calibration, evaluation, amax: Mapping[str, float],
              ranges: Mapping[str, float], p9999: Mapping[str, float], *,
              metric: str = "sqnr", max_drop: float | None = None,
              min_sqnr: float | None = None, trials: int = 24, hard_count: int = 64,
              max_evaluations: int = 4, high_precision: str = "fp16", task=None,
              resamples: int = 200, checkpoint: Checkpoint | None = None,
              candidates: Mapping[str, Mapping[str, float]] | None = None,
              progress: Callable | None = None) -> PlanResult:
    """Plan `model` (normalized) under a budget: rules, group testing, front, certification.

    `calibration` and `evaluation` are BatchSources (measurement on the former's
    hardest samples, certification on the latter); `amax` are the calibrated
    scales' amax, `ranges` max |x| and `p9999` the 99.99th percentile per tensor
    (for the rules). The budget is ``max_drop`` of `metric` from FP32, or
    ``min_sqnr`` (dB of output SQNR, metric "sqnr"). Up to `max_evaluations` plans
    of the front are evaluated on the real INT8 model (ONNX Runtime integer
    kernels): all-INT8 first (kept when within budget), then the front's plan the
    fitted model predicts at the budget, re-fitted after each evaluation and
    bisected between the best certified and the smallest failed plan. With a
    :class:`quantlab.tasks.Task` (labels or COCO ground truth of `evaluation`),
    `metric` may be its primary metric (``top1``, ``map``). A `checkpoint` of an
    interrupted run of the same plan skips the trials and evaluations it holds.
    `candidates` (calibration method -> amax) lets each unit take the method whose
    amax gives it the best local INT8 SQNR on the first calibration batch (a
    repair that costs no runtime, weighed before any pin).
    """
    from quantlab import switchboard
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend

    if (max_drop is None) == (min_sqnr is None):
        raise ConfigError("give exactly one budget: --max-drop X or --min-sqnr DB.")
    if min_sqnr is not None and metric != "sqnr":
        raise ConfigError(f"--min-sqnr is a floor on output SQNR; it does not go with --metric "
                          f"{metric} (use --max-drop there).")
    task_metric = task is not None and metric == task.primary_metric
    if task is not None:
        task.check_samples(evaluation.num_samples)
    metric_fn = None if task_metric else resolve_metric(metric)
    for message in data_shortfalls(calibration.num_samples, evaluation.num_samples, hard_count,
                                   metric, max_drop, task):
        warnings.warn(message, stacklevel=2)
    step = progress or (lambda items, **_: items)
    g = Graph(model)
    first = next(iter(calibration))
    units = find_units(g, {name: np.shape(value) for name, value in first.items()})
    reasons = apply_rules(units, RuleContext(g, ranges, p9999))
    allowed = {u.name: allowed_precisions(reasons.get(u.name, [])) for u in units}
    fixed = {n: fallback_precision(a, high_precision) for n, a in allowed.items()
             if "int8" not in a}

    calibrators: dict[str, str] = {}
    if candidates:
        amax, calibrators = choose_calibrators(g, candidates, units, first, amax)
    amax = share_scales(g, amax)
    fp32 = OnnxRuntimeBackend(model, name="fp32")
    board = switchboard.build(g, units, amax)
    board_backend = OnnxRuntimeBackend(board.model, name="switchboard", check_inputs=False)

    def board_run(precisions):
        flags = board.feeds(precisions)
        return lambda batch: board_backend.run({**batch, **flags})

    all_int8 = {u.name: fixed.get(u.name, "int8") for u in units}
    hard, hard_indices = hardest_samples(calibration, fp32.run, board_run(all_int8), hard_count,
                                         lambda b: step(b, desc="hardest samples"))
    references = run_batched(fp32.run, hard, calibration)
    sensitivity = group_test(
        board, lambda batch, flags: run_batched(
            lambda chunk: board_backend.run({**chunk, **flags}), batch, calibration), hard,
        references, trials=trials, fixed=fixed,
        known=checkpoint.trials if checkpoint else None,
        on_trial=checkpoint.add_trial if checkpoint else None,
        progress=lambda r: step(r, desc="switchboard trials"))
    contribution = dict(zip(sensitivity.units, sensitivity.contribution, strict=True))
    local = local_sqnr(g, amax, units, calibration.slice(hard, 0, calibration.batch_size))
    fp16_contribution = fp16_contributions(contribution, local, fixed)
    points = front(units, allowed, contribution, high_precision=high_precision,
                   fp16_contribution=fp16_contribution)

    fp32_outputs = [fp32.run(batch) for batch in step(evaluation, desc="FP32 evaluation")]

    def evaluate_point(index: int) -> Evaluation:
        if checkpoint and index in checkpoint.evaluations:
            return checkpoint.evaluations[index]
        point = points[index]
        start = time.perf_counter()
        nodes = {n: point.precisions[u.name] for u in units for n in u.nodes}
        int8 = OnnxRuntimeBackend(qdq.quantize_model(model, amax, nodes), name="int8")
        outputs = [int8.run(batch) for batch in step(evaluation, desc="INT8 evaluation")]
        if task_metric:
            certificate = certify_paired(
                metric, task_evaluator(task, outputs, fp32_outputs), evaluation.num_samples,
                max_drop=max_drop, floor=min_sqnr, resamples=resamples)
        else:
            certificate = certify(metric_fn, metric, outputs, fp32_outputs, max_drop=max_drop,
                                  floor=min_sqnr, resamples=resamples)
        result = Evaluation(point.int8_mac_share, point.predicted, certificate,
                            time.perf_counter() - start)
        if checkpoint:
            checkpoint.add_evaluation(index, result)
        return result

    evaluations: list[Evaluation] = []
    evaluated: dict[int, Evaluation] = {}
    last = len(points) - 1
    evaluated[last] = evaluate_point(last)
    evaluations.append(evaluated[last])
    if evaluated[last].certificate.too_small:  # said now, not after the other evaluations
        warnings.warn(evaluated[last].certificate.too_small_message(), stacklevel=2)
    low, high = -1, last  # highest certified index, lowest failed index
    if evaluated[last].certificate.certified:
        low = last
    while low < high - 1 and len(evaluations) < max_evaluations:
        guess = _next_guess(points, evaluated, low, high, max_drop, min_sqnr)
        evaluated[guess] = evaluate_point(guess)
        evaluations.append(evaluated[guess])
        if evaluated[guess].certificate.certified:
            low = guess
        else:
            high = guess

    certified = [i for i in evaluated if evaluated[i].certificate.certified]
    index = max(certified) if certified else min(evaluated)
    decided = Plan.from_rules(units, reasons)
    rank = {u: i + 1 for i, u in enumerate(sensitivity.ranking())}
    for unit in units:
        decision = decided.units[unit.name]
        decision.precision = points[index].precisions[unit.name]
        decision.predicted = contribution.get(unit.name, 0.0)
        decision.evidence["output_nsr_contribution"] = decision.predicted
        decision.evidence["output_rank"] = rank[unit.name]
        for precision, figure in local.get(unit.name, {}).items():
            decision.evidence[f"local_sqnr_{precision}_db"] = figure
        if unit.name in fp16_contribution:
            decision.evidence["fp16_nsr_contribution"] = fp16_contribution[unit.name]
        if unit.name in calibrators:
            decision.evidence["calibrator"] = calibrators[unit.name]
        if decision.precision != "int8" and not any(r.hard for r in decision.reasons):
            decision.reasons.append(Reason(
                SEARCH_CODE, False, (decision.precision,),
                f"rank {rank[unit.name]} of {len(units)} by output-noise contribution "
                f"{decision.predicted:.3g} (all INT8: {sensitivity.predicted_nsr(contribution):.3g}"
                f"); the certified plan of the front keeps it out of INT8", SEARCH_SOURCE))
        if decision.precision == "fp32" and "fp16" in allowed[unit.name] and \
                high_precision == "fp16":
            decision.reasons.append(Reason(
                SEARCH_CODE, False, ("fp32",),
                f"FP16 would add predicted output NSR "
                f"{fp16_contribution.get(unit.name, 0.0):.3g} (local FP16 SQNR "
                f"{local.get(unit.name, {}).get('fp16', float('nan')):.3g} dB); the budget left "
                "by the INT8 units does not hold it", SEARCH_SOURCE))
    decided.metric = metric
    decided.budget = max_drop if max_drop is not None else min_sqnr
    qdq_model = qdq.quantize_model(model, amax, decided.node_precisions(),
                                   high_precision=high_precision)
    differ = {u: p for u, p in read_back(qdq_model, units).items()
              if p != decided.units[u].precision}
    if differ:
        raise ModelError(f"the Q/DQ model runs units {sorted(differ)[:5]} as {differ} although "
                         "the plan says otherwise; this is a bug, please report it with the model.")
    return PlanResult(decided, qdq_model, dict(amax), points, sensitivity, evaluations,
                      next(i for i, e in enumerate(evaluations) if e is evaluated[index]),
                      hard_indices.tolist())


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
            f"{hard_count} hardest samples requested (--hard-samples): the switchboard passes "
            f"run on all {calibration_samples}, none singled out as hard. Pass more "
            f"calibration data (several times {hard_count} samples) or --hard-samples "
            f"below {calibration_samples}.")
    share = metric == "agreement" or (task is not None and task.kind == "classification"
                                       and metric == task.primary_metric)
    if share and max_drop is not None and max_drop * evaluation_samples < 1:
        messages.append(
            f"a drop of {max_drop:g} in {metric} is less than one sample of the "
            f"{evaluation_samples} in the evaluation set (1/{evaluation_samples} = "
            f"{1 / evaluation_samples:.3g}): only a plan that changes no prediction can be "
            f"certified. Pass at least {int(np.ceil(1 / max_drop))} samples with --eval (more "
            "the more predictions a plan changes), or allow a larger --max-drop.")
    return messages


def _next_guess(points: list[FrontPoint], evaluated: Mapping[int, Evaluation], low: int,
                high: int, max_drop: float | None, min_sqnr: float | None) -> int:
    """The front index to evaluate next, strictly between `low` and `high`.

    The metric's shortfall is taken proportional to the predicted noise, with the
    factor fitted on the evaluation nearest the budget (re-fitting, not assuming,
    AIMET's monotone curve); bisection when that guess leaves the open interval.
    """
    def shortfall(e: Evaluation) -> tuple[float, float]:
        c = e.certificate
        if min_sqnr is not None:  # noise power: SQNR in dB -> NSR
            return 10 ** (-c.value / 10), 10 ** (-min_sqnr / 10)
        return c.reference - c.value, max_drop

    nearest = evaluated[min(evaluated, key=lambda i: abs(i - (low + high) / 2))]
    measured, allowed = shortfall(nearest)
    guess = (low + high) // 2
    if measured > 0 and nearest.predicted > 0:
        budget = allowed * nearest.predicted / measured
        fitting = [i for i, p in enumerate(points) if p.predicted <= budget]
        if fitting and low < fitting[-1] < high:
            guess = fitting[-1]
    return min(max(guess, low + 1), high - 1)


# ---------------------------------------------------------------- local error (Stage B1)


def local_sqnr(g: Graph, amax: Mapping[str, float], units: Sequence[Unit],
               batch: Mapping[str, np.ndarray],
               precisions: Sequence[str] = ("int8", "fp16")) -> dict[str, dict[str, float]]:
    """Each unit's local SQNR in dB per precision: its nodes run alone on FP32 inputs.

    One pass of :func:`quantlab.sensitivity.local_error_model` over the Q/DQ models
    that run every unit in each of `precisions` ("int8", "fp16"), side by side; a
    unit's figure is its worst node output (-inf when FP16 overflows). `batch`
    should be small (a slice of the hard samples): every tensor the local graph
    reads is held at once. Returns unit -> precision -> dB.
    """
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.sensitivity import local_error_model

    everything = [n for u in units for n in u.nodes]
    local = local_error_model(
        [Graph(qdq.quantize_model(g.model, amax, dict.fromkeys(everything, precision)))
         for precision in precisions], g)
    inputs = set(g.input_names)
    compared = list(dict.fromkeys(local.outputs.values()))
    fp32 = OnnxRuntimeBackend(g.model, name="fp32").run(
        batch, [t for t in dict.fromkeys([*local.feeds, *compared]) if t not in inputs])
    fp32.update({name: batch[name] for name in inputs})
    values = OnnxRuntimeBackend(local.model, name="local", check_inputs=False).run(
        {name: fp32[name] for name in local.feeds})
    sqnr: dict[tuple[str, str], float] = {}
    for name, tensor in local.outputs.items():
        reference = fp32[tensor].astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            noise = float(((values[name] - reference) ** 2).sum())
        sqnr[(tensor, local.precisions[name])] = (
            -np.inf if not np.isfinite(noise) else
            10 * np.log10(float((reference ** 2).sum()) / noise) if noise > 0 else np.inf)
    nodes = {node.name: node for node in g.model.graph.node}
    result: dict[str, dict[str, float]] = {}
    for unit in units:
        for precision in precisions:
            figures = [sqnr[(o, precision)] for n in unit.linear for o in nodes[n].output
                       if (o, precision) in sqnr]
            if figures:
                result.setdefault(unit.name, {})[precision] = float(min(figures))
    return result


def fp16_contributions(contribution: Mapping[str, float],
                       local: Mapping[str, Mapping[str, float]],
                       unmeasured: Iterable[str] = ()) -> dict[str, float]:
    """Each unit's predicted output-noise contribution in FP16, from its local errors.

    To first order a unit's output contribution is its local noise power times a
    gain (how much of it reaches the output). The gain is measured in INT8
    (contribution / local INT8 NSR) and applied to the local FP16 NSR; `unmeasured`
    units (hard pins, kept out of the trials) and units whose INT8 error is nil take
    the median gain of the others. Infinite when FP16 overflows (local SQNR -inf).
    """
    def nsr(db: float) -> float:
        return float(10.0 ** (-db / 10.0)) if db > -np.inf else np.inf

    skipped = set(unmeasured)
    gains = {u: contribution.get(u, 0.0) / nsr(f["int8"]) for u, f in local.items()
             if u not in skipped and 0 < nsr(f.get("int8", np.inf)) < np.inf}
    typical = float(np.median([g for g in gains.values() if g > 0] or [1.0]))
    result = {}
    for unit, figures in local.items():
        if "fp16" in figures:
            noise = nsr(figures["fp16"])
            result[unit] = np.inf if noise == np.inf else noise * gains.get(unit, typical)
    return result


def read_back(qdq_model: onnx.ModelProto, units: Sequence[Unit]) -> dict[str, str]:
    """Each unit's precision as the written model runs it, read from the graph alone.

    INT8 when every linear op of the unit reads its data and weight through
    DequantizeLinear (directly or across pass-through ops), FP16 when they read
    float16 values, FP32 otherwise; make_plan checks the model it returns so.
    """
    g = Graph(onnx.shape_inference.infer_shapes(qdq_model))
    nodes = {node.name: node for node in qdq_model.graph.node}
    half = {init.name for init in qdq_model.graph.initializer
            if init.data_type == onnx.TensorProto.FLOAT16}

    def dequantized(tensor: str) -> bool:
        producer = g.producers.get(tensor)
        while producer is not None and producer.op_type in qdq.PASS_THROUGH_OPS:
            producer = g.producers.get(producer.input[0])  # the pair moved across it
        return producer is not None and producer.op_type == "DequantizeLinear"

    def precision(name: str) -> str:
        data = nodes[name].input[:2]
        if all(dequantized(i) for i in data):
            return "int8"
        if all(i in half or g.dtype(i) == np.float16 for i in data):
            return "fp16"
        return "fp32"

    result = {}
    for unit in units:
        found = {precision(n) for n in unit.linear}
        if found:
            result[unit.name] = found.pop() if len(found) == 1 else "mixed"
    return result


def choose_calibrators(g: Graph, candidates: Mapping[str, Mapping[str, float]],
                       units: Sequence[Unit], batch: Mapping[str, np.ndarray],
                       default: Mapping[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """Per unit, the calibration method whose amax gives it the best local INT8 SQNR.

    A unit's local error depends only on the amax of its own tensors (each pair
    tensor belongs to one unit), so the choice is made unit by unit from one local
    pass per method. Returns the merged amax (`default` for tensors of no unit)
    and unit -> method.
    """
    local = {method: local_sqnr(g, amax, units, batch, ("int8",))
             for method, amax in candidates.items()}
    merged, chosen = dict(default), {}
    for unit in units:
        scored = {m: local[m][unit.name]["int8"] for m in candidates if unit.name in local[m]}
        if not scored:
            continue
        chosen[unit.name] = max(scored, key=scored.get)
        merged.update({t: candidates[chosen[unit.name]][t] for t in unit.tensors})
    return merged, chosen
