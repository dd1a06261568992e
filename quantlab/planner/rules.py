"""Rules (the planner's second stage, docs/planner.md): graph and ranges only.

Each rule returns a :class:`Reason` naming its code, the precisions it allows and
its source. Hard reasons restrict a unit's precisions; soft ones only seed the
search and never pin on their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import onnx

from quantlab.calibration import qdq
from quantlab.errors import ModelError
from quantlab.graph import Graph
from quantlab.metadata import attribute
from quantlab.planner.units import Unit, find_units

if TYPE_CHECKING:  # the first stage's record: the rules stay light for plan.json's readers
    from quantlab.planner.prepare import Prepared

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
            group = attribute(node, "group", 1)
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
            group = attribute(node, "group", 1)
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


@dataclass
class Rules:
    """The planner's second record: the units of the model planned, the rules' reasons,
    the precisions each unit may take, and the hard pins (unit -> precision)."""

    units: list[Unit]
    reasons: dict[str, list[Reason]]
    allowed: dict[str, tuple[str, ...]]
    fixed: dict[str, str]

    def all_int8(self) -> dict[str, str]:
        """The plan with every unit in INT8 but the pinned ones."""
        return {u.name: self.fixed.get(u.name, "int8") for u in self.units}


def unit_rules(prepared: Prepared) -> Rules:
    """Units (MACs per sample: shapes inference misses, so one sample runs) and their rules;
    timed as "rules"."""
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.planner.search import fallback_precision

    context, chosen, g = prepared.context, prepared.chosen, prepared.g
    with context.phases("rules"):
        one = context.calibration.slice(context.first, 0, 1)
        fp32 = OnnxRuntimeBackend(chosen.model, name="fp32")
        units = find_units(g, {name: np.shape(value) for name, value in one.items()},
                           lambda names: {n: a.shape for n, a in fp32.run(one, names).items()})
        reasons = apply_rules(units, RuleContext(g, chosen.ranges, chosen.p9999))
        allowed = {u.name: allowed_precisions(reasons.get(u.name, [])) for u in units}
        fixed = {n: fallback_precision(a, context.settings.high_precision)
                 for n, a in allowed.items() if "int8" not in a}
    return Rules(units, reasons, allowed, fixed)
