"""Per-node error of quantization: each quantized node run alone on FP32 inputs.

:func:`local_error_model` cuts every compute node of a Q/DQ graph out with the
Q/DQ pairs (and weight DequantizeLinear) in front of it and puts all of them
side by side in one ONNX graph that reads tensors of the FP32 run. One batched
pass of that graph gives, per node, the error its own quantization adds — the
``local`` mode of validation, and the measurement the precision planner builds on.
Nodes the Q/DQ graph runs in FP16 (float16 inputs through ``Cast``, float16
initializers, as :func:`quantlab.calibration.qdq.quantize_model` writes them) are cut out
too; given several Q/DQ graphs of one FP32 model (the all-INT8 and the all-FP16
plan), each node appears once per precision, so one pass measures both.

A linear op is compared where TensorRT's layer ends: after its folded BatchNorm and
bias (folded at import) and after the activation TensorRT fuses into it
(:func:`quantlab.engine.fusion.fused_activation`: a Relu, a Clip, a decomposed HardSwish...),
which the cut-out applies in FP32 to the op's quantized output.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import onnx
from onnx import helper

from quantlab.calibration.qdq import LINEAR_OPS, PASS_THROUGH_OPS
from quantlab.engine.fusion import fused_activation
from quantlab.errors import ModelError
from quantlab.graph import Graph, names_read_inside

# Suffix of the copies of a node's sub-graph in the local-error graph.
LOCAL_SUFFIX = "::local::"
_FLOAT, _FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


@dataclass
class LocalErrorModel:
    """One ONNX graph holding, side by side, each quantized compute node with its input Q/DQ.

    ``model`` reads FP32 tensors (``feeds``, float activations and the computed
    non-float side inputs such as a Reshape's shape) and writes ``outputs``:
    local output name -> the FP32 tensor it is compared with; ``precisions``:
    local output name -> the precision its node ran in ("int8" or "fp16").
    ``quantized_inputs`` lists, per compared tensor, the FP32 tensors whose
    quantization (or rounding to float16) the node sees, from the first Q/DQ
    graph that computes it. ``nodes``: local output name -> the node of the FP32
    model cut out (a linear op's output is the end of its fused activation, so the
    compared tensor may be another node's); ``labels``: local output name -> the
    label of the Q/DQ graph it came from (its precision unless labels were given).
    """

    model: onnx.ModelProto
    feeds: list[str]
    outputs: dict[str, str]
    quantized_inputs: dict[str, list[str]] = field(default_factory=dict)
    precisions: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


class _Chain(NamedTuple):
    """How a node input is made from FP32 feeds."""

    nodes: list[onnx.NodeProto]  # the nodes to copy (or, for a float16 twin, to add)
    fed: list[str]  # FP32 tensors they read
    sources: list[str]  # FP32 tensors quantized or rounded on the way
    precision: str | None  # "int8" through Q/DQ, "fp16" through a float16 rounding


_PLAIN = _Chain([], [], [], None)


def local_error_model(qdq: Graph | Sequence[Graph], reference: Graph,
                      labels: Sequence[str] | None = None,
                      fuse_activations: bool = True,
                      weights_only: bool = False) -> LocalErrorModel:
    """Cut every quantized compute node of `qdq` out with its Q/DQ inputs.

    A node is quantized when one of its inputs comes from a DequantizeLinear,
    directly or through ops that commute with quantization (MaxPool, Reshape, ...),
    or reads float16 (a Cast to float16 or another FP16 node's output): such a
    node is copied with its float16 inputs and weights, and ONNX Runtime runs it as
    TensorRT's FP16 kernels do (:mod:`quantlab.engine.fp16`: float16 inputs and outputs,
    float32 accumulation). Its other
    non-constant inputs, the inputs of its Quantize nodes and Casts and the
    computed side inputs of the pass-through ops (a Reshape's shape made by Shape
    -> Gather -> Concat) are fed from the FP32 run of `reference` under the same
    names. `qdq` may be several Q/DQ graphs of `reference`: their nodes go side by
    side, once per (node, precision), or once per (node, label) with `labels` (one per
    graph: Q/DQ graphs of one precision that differ otherwise, such as their weight
    scales).

    With `fuse_activations` (default) a linear op is followed by the activation
    TensorRT fuses into its layer, copied from `reference` in FP32, and compared at
    that activation's output; the activation's nodes are not cut out on their own.
    Without it every node is compared at its own output (what bias correction needs).

    With `weights_only`, the activation Q/DQ pairs of `qdq` are left out: each node
    reading an INT8 weight (a dequantized constant) runs on the FP32 activations, so
    its error is that of its weights alone.
    """
    graphs = [qdq] if isinstance(qdq, Graph) else list(qdq)
    if weights_only:
        graphs = [_without_activation_pairs(index) for index in graphs]
    if labels is not None and len(labels) != len(graphs):
        raise ValueError(f"{len(labels)} labels for {len(graphs)} Q/DQ graphs")
    local = _LocalGraph(reference, fuse_activations)
    for number, index in enumerate(graphs):
        stored = {init.name: init for init in index.model.graph.initializer}
        chain = _chains(index, local.known, local.reference_nodes, weights_only)
        fused: set[str] = set()  # activation nodes measured with their linear op
        for node in index.model.graph.node:
            if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant", "Cast") or \
                    node.op_type in PASS_THROUGH_OPS or node.name not in local.reference_nodes \
                    or node.name in fused:
                continue
            parts = [chain(i) for i in node.input if i]
            precisions = {p.precision for p in parts if p is not None} - {None}
            if any(p is None for p in parts) or len(precisions) != 1:
                continue
            precision = precisions.pop()
            local.add(node, parts, precision, labels[number] if labels is not None else precision,
                      stored, fused)
    return local.model(graphs[0].model)


class _LocalGraph:
    """A local error model as :func:`local_error_model` builds it: the copied nodes, their
    initializers and FP32 feeds, and the record of what each output approximates."""

    def __init__(self, reference: Graph, fuse_activations: bool):
        self.reference, self.fuse_activations = reference, fuse_activations
        self.known = set(reference.order)
        self.reference_nodes = {node.name: node for node in reference.model.graph.node}
        self.reference_stored = {init.name: init for init in reference.model.graph.initializer}
        self.combined: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.feeds: dict[str, None] = {}
        self.seen: set[tuple[str, str]] = set()
        self.result = LocalErrorModel(onnx.ModelProto(), [], {})

    def add(self, node: onnx.NodeProto, parts: list[_Chain], precision: str, label: str,
            stored: Mapping[str, onnx.TensorProto], fused: set[str]) -> None:
        """`node` of a Q/DQ graph (initializers `stored`) cut out with the chains making its
        inputs, once per (node, label), compared where TensorRT's layer ends; the activation
        nodes it fuses join `fused`."""
        reference = self.reference
        twin = self.reference_nodes[node.name]
        activation = fused_activation(reference, twin) \
            if self.fuse_activations and node.op_type in LINEAR_OPS else []
        ends = [activation[-1].output[0]] if activation else list(twin.output)
        compared = {out: ref for out, ref in zip(node.output, ends, strict=False)
                    if ref in self.known and ref in reference.floats}
        needed = list(dict.fromkeys(t for p in parts for t in p.fed))
        if not compared or any(t not in self.known for t in needed) or \
                (node.name, label) in self.seen:
            return
        self.seen.add((node.name, label))
        fused.update(n.name for n in activation)
        suffix = f"{LOCAL_SUFFIX}{label}::{node.name}"
        copied = list({id(n): n for p in parts for n in p.nodes}.values())
        renamed = {out: out + suffix for n in copied for out in n.output}
        renamed.update({out: out + suffix for out in node.output})
        for sub in [*copied, node]:
            for name in sub.input:
                if name in stored:
                    self._initializer(name, stored[name], suffix, renamed)
            self.combined.append(_renamed_copy(sub, suffix, renamed))
        if precision == "fp16":
            self.combined += _widened(self.combined.pop(), {renamed[out] for out in compared})
        if activation:
            renamed[twin.output[0]] = renamed[node.output[0]]
            self._activation(activation, suffix, renamed)
            renamed[node.output[0]] = renamed[ends[0]]
        self.feeds.update(dict.fromkeys(needed))
        for out, ref in compared.items():
            self.result.outputs[renamed[out]] = ref
            self.result.precisions[renamed[out]] = precision
            self.result.nodes[renamed[out]] = node.name
            self.result.labels[renamed[out]] = label
            self.result.quantized_inputs.setdefault(
                ref, sorted({t for p in parts for t in p.sources}))

    def _initializer(self, name: str, value: onnx.TensorProto, suffix: str,
                     renamed: dict[str, str]) -> None:
        """`value` stored under `name`, or under `name` + `suffix` where an earlier Q/DQ graph
        holds other content under that name (both kept)."""
        if name in self.initializers and self.initializers[name] != value:
            renamed[name] = name + suffix
        self.initializers[renamed.get(name, name)] = _named(value, renamed.get(name, name))

    def _activation(self, activation: list[onnx.NodeProto], suffix: str,
                    renamed: dict[str, str]) -> None:
        """The fused `activation` in FP32 on the copied op's output (`renamed` maps the
        reference op's output to it), its constants from the reference."""
        for sub in activation:
            renamed.update({out: out + suffix for out in sub.output})
            for name in sub.input:
                if name in self.reference_stored and name not in renamed:
                    self._initializer(name, self.reference_stored[name], suffix, renamed)
                elif name and name not in renamed:  # a Constant node's output
                    renamed[name] = name + suffix
                    self.combined.append(_renamed_copy(self.reference.producers[name], suffix,
                                                       renamed))
            self.combined.append(_renamed_copy(sub, suffix, renamed))

    def model(self, first: onnx.ModelProto) -> LocalErrorModel:
        """The record with its model (opset and IR version of `first`)."""
        result = self.result
        if not result.outputs:
            raise ModelError(
                "the INT8 model has no compute node reading a QuantizeLinear/DequantizeLinear "
                "pair (or a float16 Cast) on a tensor of the FP32 model; local mode needs a Q/DQ "
                "model made from the FP32 model passed as reference (same tensor names). Use "
                "--mode global otherwise."
            )
        result.model = helper.make_model(
            helper.make_graph(
                self.combined, "local_errors",
                [_feed_value(self.reference, f) for f in self.feeds],
                [helper.make_tensor_value_info(name, _FLOAT, None) for name in result.outputs],
                list(self.initializers.values()),
            ),
            opset_imports=first.opset_import,
        )
        result.model.ir_version = first.ir_version
        result.feeds = list(self.feeds)
        return result


def _without_activation_pairs(qdq: Graph) -> Graph:
    """`qdq` with every reader of an activation pair's DequantizeLinear reading the tensor its
    QuantizeLinear quantizes (INT8 weights kept)."""
    bypass = {}
    for node in qdq.model.graph.node:
        quantize = qdq.producers.get(node.input[0]) if node.op_type == "DequantizeLinear" \
            else None
        if quantize is not None and quantize.op_type == "QuantizeLinear":
            bypass[node.output[0]] = quantize.input[0]
    model = onnx.ModelProto()
    model.CopyFrom(qdq.model)
    for node in model.graph.node:
        node.input[:] = [bypass.get(name, name) for name in node.input]
    return Graph(model)


def _chains(qdq: Graph, known: set[str], reference_nodes: dict, weights_only: bool = False):
    """``chain(tensor)``: how a node input of `qdq` is made from FP32 feeds (None: it cannot).
    With `weights_only`, a dequantized constant (an INT8 weight) counts as quantized."""

    def side_inputs(node: onnx.NodeProto) -> tuple[list[onnx.NodeProto], list[str]] | None:
        """Constant producers to copy and tensors to feed for a node's non-data inputs."""
        nodes, fed = [], []
        for name in node.input[1:]:
            if not name or name in qdq.initializers:
                continue
            producer = qdq.producers.get(name)
            if producer is not None and producer.op_type == "Constant":
                nodes.append(producer)
            elif name in known:
                fed.append(name)
            else:
                return None
        return nodes, fed

    def chain(tensor: str) -> _Chain | None:
        node = qdq.producers.get(tensor)
        if tensor in qdq.initializers or (node is None and tensor not in known):
            return _PLAIN
        if node is None:  # a graph input read as it is (weights_only: its pair left out)
            return _Chain([], [tensor], [], None)
        if node.op_type == "Constant":
            return _Chain([node], [], [], None)
        if node.op_type == "DequantizeLinear":
            source = node.input[0]
            sides = side_inputs(node)
            if sides is None:
                return None
            if source in qdq.constants:
                return _Chain([*sides[0], node], sides[1], [], "int8" if weights_only else None)
            quantize = qdq.producers.get(source)
            quantize_sides = side_inputs(quantize) if quantize is not None else None
            if quantize is None or quantize.op_type != "QuantizeLinear" or quantize_sides is None:
                return None
            fed = quantize.input[0]
            return _Chain([*quantize_sides[0], *sides[0], quantize, node],
                          [fed, *quantize_sides[1], *sides[1]], [fed], "int8")
        if node.op_type == "Cast" and _cast_to(node) == _FLOAT16 and node.input[0] in known:
            return _Chain([node], [node.input[0]], [node.input[0]], "fp16")
        if node.op_type in PASS_THROUGH_OPS:
            upstream = chain(node.input[0])
            sides = side_inputs(node)
            if upstream is not None and upstream.sources and sides is not None:
                return _Chain([*upstream.nodes, *sides[0], node], [*upstream.fed, *sides[1]],
                              upstream.sources, upstream.precision)
        twin = reference_nodes.get(node.name)
        if tensor not in known and twin is not None:
            # Another FP16 node's float16 output (the only outputs quantize_model renames):
            # the FP32 run's tensor, rounded to float16.
            fp32 = twin.output[list(node.output).index(tensor)]
            return _Chain([helper.make_node("Cast", [fp32], [tensor], name=f"{tensor}_Cast_fp16",
                                            to=_FLOAT16)], [fp32], [fp32], "fp16")
        return _Chain([], [tensor], [], None)

    return chain


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _renamed_copy(node: onnx.NodeProto, suffix: str, renamed: dict[str, str]) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = node.name + suffix
    del copy.input[:], copy.output[:]
    copy.input.extend(renamed.get(i, i) for i in node.input)
    copy.output.extend(renamed[o] for o in node.output)
    return copy


def _named(init: onnx.TensorProto, name: str) -> onnx.TensorProto:
    if init.name == name:
        return init
    copy = onnx.TensorProto()
    copy.CopyFrom(init)
    copy.name = name
    return copy


def _widened(node: onnx.NodeProto, outputs: Iterable[str]) -> list[onnx.NodeProto]:
    """An FP16 node with its float16 `outputs` cast to float32 under their own names, for the
    comparison. ONNX Runtime runs the node itself as TensorRT's FP16 kernels do
    (:func:`quantlab.engine.fp16.emulated`, applied by the backend to every model it runs)."""
    casts = []
    for index, name in enumerate(node.output):
        if name in outputs:
            node.output[index] = f"{name}::fp16"
            casts.append(helper.make_node("Cast", [node.output[index]], [name],
                                          name=f"{name}::fp32", to=_FLOAT))
    return [node, *casts]


def _feed_value(reference: Graph, name: str) -> onnx.ValueInfoProto:
    """The input declaration of a feed: its type and rank, every dimension symbolic."""
    value = reference.values.get(name)
    if value is None:
        return helper.make_tensor_value_info(name, _FLOAT, None)
    shape = reference.shapes.get(name)
    dims = None if shape is None else [f"{name}_d{i}" for i in range(len(shape))]
    return helper.make_tensor_value_info(name, value.type.tensor_type.elem_type, dims)


def error_sums(g: Graph, local: onnx.ModelProto, compared: Mapping[str, str],
               channel_axes: Mapping[str, int] | None = None,
               ) -> tuple[onnx.ModelProto, dict[str, tuple[str, str]]]:
    """`g`'s model with the `local` graph reading its tensors, and the errors summed in it.

    `local` reads tensors of `g` by name (its graph inputs) and `compared` maps each
    of its outputs to the tensor of `g` it approximates. The model returns, for each,
    the sum of squared differences and the reference's sum of squares, as float64
    (summed in float32: :meth:`_Attached.reduced`; `sums`: output -> (noise, power)
    names), and nothing else; an output in
    `channel_axes` has its noise summed per channel of that axis (a vector). Each added
    node sits right after the last node of `g` it reads, so ONNX Runtime frees a
    unit's tensors as the FP32 pass moves on: returning every unit's inputs and
    outputs of one 640 px sample instead held about 1 GB.
    """
    channel_axes = channel_axes or {}
    attached = _Attached(g, local)
    power = {ref: attached.reduced("ReduceSumSquare", attached.in_float32(ref))
             for ref in dict.fromkeys(compared.values())}
    sums = {name: (attached.reduced("ReduceSumSquare", attached.error(name, ref),
                                    channel_axes.get(name), len(g.shapes.get(ref) or ())),
                   power[ref])
            for name, ref in compared.items()}
    return attached.model(t for pair in sums.values() for t in pair), sums


def error_channel_sums(g: Graph, local: onnx.ModelProto, compared: Mapping[str, tuple[str, int]],
                       also: Sequence[str] = (),
                       ) -> tuple[onnx.ModelProto, dict[str, tuple[str, str]]]:
    """As :func:`error_sums`, the signed error summed per channel: `compared` maps each
    output of `local` to (the tensor of `g` it approximates, its channel axis); the model
    returns, for each, the sum of (output - reference) per channel and the error's
    element count (both float64; per channel: divide by the channels), by name
    (output -> (sums, count)), and the outputs of `g` named in `also`, as they are. What
    bias correction needs, without any other tensor leaving ONNX Runtime."""
    attached = _Attached(g, local)
    sums = {}
    for name, (ref, axis) in compared.items():
        error = attached.error(name, ref)
        attached.added += [onnx.helper.make_node("Size", [error], [f"{error}::size"]),
                           onnx.helper.make_node("Cast", [f"{error}::size"], [f"{error}::count"],
                                                 to=onnx.TensorProto.DOUBLE)]
        sums[name] = (attached.reduced("ReduceSum", error, axis, len(g.shapes.get(ref) or ())),
                      f"{error}::count")
    return attached.model((t for pair in sums.values() for t in pair), also), sums


class _Attached:
    """`g`'s nodes with a `local` graph reading its tensors, and the reductions added to them
    (:func:`error_sums`, :func:`error_channel_sums`): the nodes, the initializers, the
    model of it that returns only the named float64 outputs."""

    def __init__(self, g: Graph, local: onnx.ModelProto):
        self.g, self.local = g, local
        self.opset = next((o.version for o in local.opset_import if o.domain in ("", "ai.onnx")),
                          17)
        taken = {*g.input_names, *g.initializers, *g.producers}
        renamed = {init.name: f"{init.name}::local" for init in local.graph.initializer
                   if init.name in taken}
        self.added: list[onnx.NodeProto] = []
        for node in local.graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.input[:] = [renamed.get(name, name) for name in node.input]
            self.added.append(copy)
        self.initializers = [*g.model.graph.initializer,
                             *(_named(init, renamed.get(init.name, init.name))
                               for init in local.graph.initializer)]
        self.cast: set[str] = set()
        self.typed = {v.name: v for v in [*local.graph.output, *local.graph.value_info]}

    def in_float32(self, tensor: str) -> str:
        """`tensor` itself where it is known to be float32, else cast to float32 (once)."""
        value = self.g.values.get(tensor) or self.typed.get(tensor)
        if value is not None and value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            return tensor
        if tensor not in self.cast:
            self.cast.add(tensor)
            self.added.append(onnx.helper.make_node("Cast", [tensor], [f"{tensor}::f32"],
                                                    to=onnx.TensorProto.FLOAT))
        return f"{tensor}::f32"

    def error(self, name: str, reference: str) -> str:
        """`name` - `reference` in float32 (exact to float32's rounding of the difference)."""
        self.added.append(onnx.helper.make_node(
            "Sub", [self.in_float32(name), self.in_float32(reference)], [f"{name}::error"]))
        return f"{name}::error"

    def reduced(self, op: str, tensor: str, keep: int | None = None, rank: int = 0) -> str:
        """`op` (ReduceSumSquare, ReduceSum) of the float32 `tensor`, over every axis but
        `keep` when given, as float64.

        Summed in float32: ONNX Runtime's reductions add in vectorized blocks, so a 640 px
        map's sums agree with float64 ones to about 1e-5 (PP-OCRv3 detector: local SQNRs
        within 0.002 dB, the same weight amax on all 7,290 channels), at 2.5x the speed of
        casting every compared tensor to float64 first."""
        axes = [] if keep is None else [a for a in range(rank) if a != keep % rank]
        inputs, attributes = [tensor], {}
        # ReduceSum takes its axes as an input from opset 13, ReduceSumSquare from 18.
        if axes and self.opset >= (18 if op == "ReduceSumSquare" else 13):
            inputs.append(f"{tensor}::axes")
            self.initializers.append(onnx.numpy_helper.from_array(np.array(axes, np.int64),
                                                                  inputs[-1]))
        elif axes:
            attributes["axes"] = axes
        self.added += [
            onnx.helper.make_node(op, inputs, [f"{tensor}::{op}"], keepdims=0, **attributes),
            onnx.helper.make_node("Cast", [f"{tensor}::{op}"], [f"{tensor}::{op}::f64"],
                                  to=onnx.TensorProto.DOUBLE)]
        return f"{tensor}::{op}::f64"

    def model(self, outputs: Iterable[str], kept: Sequence[str] = ()) -> onnx.ModelProto:
        """The model returning the float64 `outputs` added, then the outputs of `g` in `kept`."""
        outputs = list(dict.fromkeys(outputs))
        given = {output.name: output for output in self.g.model.graph.output}
        model = onnx.helper.make_model(
            onnx.helper.make_graph(
                _feeding(_interleaved(list(self.g.model.graph.node), self.added),
                         [*outputs, *kept]),
                "local_error_sums",
                list(self.g.model.graph.input),
                [*(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.DOUBLE, None)
                   for t in outputs), *(given[t] for t in kept)],
                self.initializers),
            opset_imports=self.local.opset_import)
        model.ir_version = self.local.ir_version
        return model


def _feeding(nodes: list[onnx.NodeProto], outputs: Sequence[str]) -> list[onnx.NodeProto]:
    """The nodes of `nodes` (in topological order) that `outputs` are computed from, in order.

    ONNX Runtime runs every node of a graph, read or not: the FP32 model's nodes after the
    last tensor compared, and local copies no output reads, would run for nothing."""
    wanted, kept = set(outputs), []
    for node in reversed(nodes):
        if wanted.intersection(node.output):
            kept.append(node)
            wanted.update(node.input)
            wanted.update(names_read_inside(node))
    return kept[::-1]


def _interleaved(nodes: list[onnx.NodeProto], added: list[onnx.NodeProto],
                 ) -> list[onnx.NodeProto]:
    """`nodes` with each of `added` (in topological order) right after the last one it reads."""
    after = {out: index for index, node in enumerate(nodes) for out in node.output}
    slots: list[list[onnx.NodeProto]] = [[] for _ in range(len(nodes) + 1)]
    for node in added:
        slot = max((after.get(name, -1) for name in node.input if name), default=-1)
        after.update(dict.fromkeys(node.output, slot))
        slots[slot + 1].append(node)
    return [*slots[0], *(n for node, later in zip(nodes, slots[1:], strict=True)
                         for n in (node, *later))]
