"""Insert QuantizeLinear/DequantizeLinear pairs following TensorRT's explicit-quantization rules.

The placement rules, each with its source, are in docs/qdq.md. In short: int8,
symmetric, zero point 0; activations per-tensor, weights per-channel on the
output-channel axis, stored as int8 initializers behind a per-axis
DequantizeLinear; Q/DQ on the inputs of Conv / ConvTranspose / Gemm / MatMul,
not on their outputs; on a residual Add only the residual (skip) input; pairs
move backward through ops that commute with quantization (MaxPool, Reshape,
...) instead of being doubled; biases stay float32.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quantlab import choices, graph
from quantlab.errors import ConfigError, DataError, ModelError

PRECISIONS = ("int8", "fp16", "fp32")
# What an "fp16" node of a plan runs in: FP16 (Cast pairs) or FP32 (`--high-precision fp32`).
HIGH_PRECISIONS = ("fp16", "fp32")
# Weighted ops TensorRT runs in INT8 when their inputs are quantized: op -> weight input index.
LINEAR_OPS = {"Conv": 1, "ConvTranspose": 1, "Gemm": 1, "MatMul": 1}
# Ops whose data input 0 commutes exactly with a zero-point-0 per-tensor quantizer
# (they only select, move or reorder elements). TensorRT propagates Q backward and
# DQ forward through them; ORT's QDQ propagation transformer does the same.
PASS_THROUGH_OPS = frozenset(
    {"MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Identity"}
)
# The residual Add fuses into the Conv that produces its other input (TensorRT guide).
_BACKBONE_OPS = ("Conv", "ConvTranspose")
_ONNX_DOMAINS = ("", "ai.onnx")
_QMAX = 127.0
# The smallest amax whose scale (amax / 127) is still a normal float32.
_MIN_AMAX = float(np.finfo(np.float32).tiny) * _QMAX
# How a weight channel's amax is chosen: max |w| (the default), or least int8 squared
# error over MSE_STEPS fractions of max |w| down to MSE_LOW (the clipping range the MSE
# search of TensorRT's pytorch-quantization and of NNCF covers). MSE lowers the weight
# error but lost 0.3-1.3 dB of output SQNR on 8 of 28 model/calibrator pairs of
# benchmarks/default_method.py and gained beyond noise on 3, so it is opt-in.
WEIGHT_CRITERIA = choices.WEIGHT_CRITERIA
MSE_LOW = 0.5
MSE_STEPS = 51
# Weight amax already searched, by content: the planner quantizes the same weights for
# every plan it builds.
_MSE_CACHE: dict[tuple, np.ndarray] = {}
_MSE_CACHE_SIZE = 4096


@dataclass
class Placement:
    """Where the pairs go; every activation pair is keyed by the tensor it sits on."""

    # tensor carrying a pair -> tensor whose amax gives its scale
    source: dict[str, str] = field(default_factory=dict)
    # tensor carrying a pair -> (node name, input index) edges that read its DQ output
    readers: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    # (node name, input index) -> (weight initializer name, axis or None for per-tensor)
    weights: dict[tuple[str, int], tuple[str, int | None]] = field(default_factory=dict)


def weight_axis(node: onnx.NodeProto, weight_input_index: int, rank: int) -> int | None:
    """Per-channel axis of a Conv / ConvTranspose / Gemm / MatMul weight input of `rank`
    dimensions, or None where TensorRT takes only a per-tensor weight scale.

    Conv weights are [C_out, C_in/g, k...] (axis 0); Gemm's B is [N, K] with
    transB=1 (axis 0) and [K, N] with transB=0 (axis 1); MatMul's constant 2-D B
    is [K, N] (axis 1). A MatMul B of any other rank is per-tensor: a 1-D B has
    no output-channel axis and axis 1 of a 3-D [b, K, N] is the reduction axis.
    ConvTranspose weights are per-tensor: its ONNX output-channel axis is 1, but
    NVIDIA's kernels assumed per-*input*-channel scales (axis 0) on 8.x and axis 1
    is unverified on 10.x/11.x (docs/qdq.md; `quantlab doctor` settles it).
    """
    if LINEAR_OPS.get(node.op_type) != weight_input_index:
        raise ModelError(
            f"node '{node.name}' ({node.op_type}) has no per-channel weight at input "
            f"{weight_input_index}; only input 1 of {', '.join(LINEAR_OPS)} is a weight with an "
            "output-channel axis. Quantize that input per-tensor instead."
        )
    if node.op_type == "ConvTranspose":
        return None
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    if node.op_type == "MatMul":
        return 1 if rank == 2 else None
    return 0


def weight_amax(weight: np.ndarray, axis: int | None, criterion: str = "max") -> np.ndarray:
    """Weight amax per channel along `axis` (a scalar array when `axis` is None).

    ``criterion="max"`` (default): max |w|. ``"mse"``: the amax in
    ``[MSE_LOW, 1] x max |w|`` (MSE_STEPS candidates) whose int8 rounding and clipping
    error of the channel is smallest; max |w| is a candidate, so the weight error never
    grows (TensorRT takes any Q/DQ weight scale). An all-zero channel gets the smallest
    amax whose scale is a normal float32, so it still quantizes to exactly zero.
    """
    if criterion not in WEIGHT_CRITERIA:
        raise ConfigError(f"weight criterion '{criterion}' is not one of "
                          f"{', '.join(WEIGHT_CRITERIA)}.")
    values = np.asarray(weight, dtype=np.float32)
    rows = (values.reshape(1, -1) if axis is None else
            np.moveaxis(values, axis % values.ndim, 0).reshape(values.shape[axis], -1))
    amax = np.abs(rows).max(axis=1, initial=0.0)
    if criterion == "mse" and rows.size:
        amax = _mse_weight_amax(rows, amax)
    amax = np.maximum(amax, _MIN_AMAX).astype(np.float32)
    return amax.reshape(()) if axis is None else amax


def _mse_weight_amax(rows: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """Per row, the candidate amax (fractions of `peak`) with the least int8 squared error."""
    key = (rows.shape, hashlib.blake2b(rows.tobytes(), digest_size=16).digest())
    if key not in _MSE_CACHE:
        best = np.full(len(rows), np.inf)
        chosen = peak.astype(np.float64)
        for fraction in np.linspace(1.0, MSE_LOW, MSE_STEPS):
            scale = np.maximum(peak * fraction, _MIN_AMAX)[:, None] / _QMAX
            error = ((np.clip(np.rint(rows / scale), -_QMAX, _QMAX) * scale - rows) ** 2
                     ).sum(axis=1)
            better = error < best
            best[better], chosen[better] = error[better], (peak * fraction)[better]
        if len(_MSE_CACHE) >= _MSE_CACHE_SIZE:
            _MSE_CACHE.pop(next(iter(_MSE_CACHE)))
        _MSE_CACHE[key] = chosen
    return _MSE_CACHE[key]


def indexed(model: onnx.ModelProto | graph.Graph) -> graph.Graph:
    """The index of `model`, normalized first; a Graph (of a normalized model) as it is.

    Every function here takes either: a caller quantizing one model many times (the
    planner) builds its index once and passes it.
    """
    return model if isinstance(model, graph.Graph) else graph.Graph(graph.normalize(model))


def activation_tensors_to_calibrate(
    model: onnx.ModelProto | graph.Graph, plan: Mapping[str, str] | None = None
) -> list[str]:
    """ONNX tensor names whose amax the Q/DQ model needs, in topological order."""
    index = indexed(model)
    wanted = set(place(index, plan).source.values())
    return [name for name in index.order if name in wanted]


def quantize_model(
    model: onnx.ModelProto | graph.Graph,
    amax: Mapping[str, float],
    plan: Mapping[str, str] | None = None,
    per_channel: bool = True,
    high_precision: str = "fp16",
    weight_criterion: str = "max",
    weight_amax: Mapping[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    """Return a copy of `model` with Q/DQ pairs placed by TensorRT's explicit-quantization rules.

    `amax` maps each tensor from `activation_tensors_to_calibrate` to its
    calibrated max |x| (scale = amax / 127). `plan` maps node name -> "int8",
    "fp16" or "fp32"; nodes missing from it run in INT8 where quantizable. An
    "fp16" node reads its float inputs through Cast(float16) (weights stored as
    float16) and its outputs are cast back to float32, so a strongly typed
    TensorRT network runs it in FP16 (ONNX Runtime runs it as :mod:`quantlab.engine.fp16`
    emulates that); `high_precision="fp32"` runs those nodes in
    FP32 instead (no casts). Weights are per-channel unless `per_channel` is False, their
    amax chosen by `weight_criterion` (:func:`weight_amax`) except where `weight_amax`
    (weight initializer -> per-channel amax,
    :func:`quantlab.calibration.weights.choose_weight_amax`) gives it.
    """
    if high_precision not in HIGH_PRECISIONS:
        raise ConfigError(f"high precision '{high_precision}' is not one of "
                          f"{', '.join(HIGH_PRECISIONS)}.")
    index = indexed(model)
    model = index.model
    placement = place(index, plan)
    scales = {t: activation_scale(t, amax) for t in set(placement.source.values())}
    result = _build(model, placement, scales, per_channel, weight_criterion, weight_amax or {})
    if high_precision == "fp16":
        _cast_to_fp16(result, {name for name, p in _precisions(model, plan).items()
                               if p == "fp16"})
    graph.drop_unused_initializers(result)  # weights now read as int8 or float16 copies
    return result


def _cast_to_fp16(model: onnx.ModelProto, names: set[str]) -> None:
    """Run the nodes `names` in float16: Cast their float32 inputs in, their outputs back.

    Weights and other float32 initializers become float16 initializers instead of
    Casts. A node reading another FP16 node's output reads its float16 value
    directly: Cast(float16) of Cast(float32) of a float16 value is that value.
    Inputs the ONNX operator types as float32 only (Resize's scales, NMS
    thresholds) stay float32: ONNX and ONNX Runtime refuse float16 there.
    """
    if not names:
        return
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in _ONNX_DOMAINS), None)
    floats = graph.float_tensors(model)
    floats.update(i.name for i in g.initializer if i.data_type == onnx.TensorProto.FLOAT)
    readers = graph.consumers(model)
    float32_read = {o.name for o in g.output} | graph.outer_scope_names(model) | {
        name for name, nodes in readers.items() if any(n.name not in names for n in nodes)}
    half = Converted(model, onnx.TensorProto.FLOAT16, "_fp16", "_Cast_fp16")
    nodes = []
    for node in g.node:
        if node.name not in names:
            nodes.append(node)
            continue
        for index, name in enumerate(node.input):
            if name in floats and _takes_float16(node, index, opset):
                node.input[index] = half(name, nodes)
        nodes.append(node)
        for index, name in enumerate(node.output):
            if name not in floats:
                continue
            node.output[index] = half.twins[name] = half.fresh(f"{name}_fp16")
            if name in float32_read:
                nodes.append(helper.make_node("Cast", [half.twins[name]], [name],
                                              name=half.fresh(f"{name}_Cast_fp32"),
                                              to=onnx.TensorProto.FLOAT))
    del g.node[:]
    g.node.extend(nodes)


class Converted:
    """Each tensor of a model converted to the float type `to` once, under a fresh name:
    an initializer as a converted copy, any other tensor through a Cast node."""

    def __init__(self, model: onnx.ModelProto, to: int, suffix: str, cast_suffix: str):
        self.graph = model.graph
        self.to, self.suffix, self.cast_suffix = to, suffix, cast_suffix
        self.fresh = FreshNames(model)
        self.initializers = {init.name: init for init in model.graph.initializer}
        self.twins: dict[str, str] = {}  # tensor -> its converted twin

    def __call__(self, name: str, nodes: list[onnx.NodeProto]) -> str:
        """The twin of `name`, made on first use (a Cast appended to `nodes`)."""
        if name not in self.twins:
            twin = self.twins[name] = self.fresh(f"{name}{self.suffix}")
            if name in self.initializers:
                value = numpy_helper.to_array(self.initializers[name])
                self.graph.initializer.append(numpy_helper.from_array(
                    value.astype(helper.tensor_dtype_to_np_dtype(self.to)), twin))
            else:
                nodes.append(helper.make_node("Cast", [name], [twin], to=self.to,
                                              name=self.fresh(f"{name}{self.cast_suffix}")))
        return self.twins[name]


def _takes_float16(node: onnx.NodeProto, index: int, opset: int | None) -> bool:
    """Whether ONNX allows a float16 tensor at input `index` of `node` (True where the op
    has no schema here: a custom domain's types are its own)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset or onnx.defs.onnx_opset_version(),
                                      node.domain)
    except onnx.defs.SchemaError:
        return True
    if not schema.inputs:
        return True
    formal = schema.inputs[min(index, len(schema.inputs) - 1)]  # the last one may be variadic
    allowed = next((c.allowed_type_strs for c in schema.type_constraints
                    if c.type_param_str == formal.type_str), [formal.type_str])
    return "tensor(float16)" in allowed


def float_only_nodes(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Nodes quantlab leaves in float although they could be quantized, by reason.

    ``control_flow``: If/Loop/Scan nodes whose bodies hold linear ops (bodies are
    not quantized; freeze the inputs that decide an `If` to inline it);
    ``custom_domain``: nodes of a non-ONNX domain (quantlab cannot know their math).
    """
    def linear_ops(g: onnx.GraphProto) -> int:
        return sum((node.op_type in LINEAR_OPS) + sum(map(linear_ops, graph.subgraphs(node)))
                   for node in g.node)

    result: dict[str, list[str]] = {"control_flow": [], "custom_domain": []}
    for node in model.graph.node:
        if node.domain not in _ONNX_DOMAINS:
            result["custom_domain"].append(f"{node.name} ({node.domain}:{node.op_type})")
        elif node.op_type in graph.CONTROL_FLOW_OPS:
            count = sum(map(linear_ops, graph.subgraphs(node)))
            if count:
                result["control_flow"].append(f"{node.name} ({node.op_type}, {count} linear ops)")
    return result


def _precisions(model: onnx.ModelProto, plan: Mapping[str, str] | None) -> dict[str, str]:
    result = {node.name: "int8" for node in model.graph.node}
    for name, precision in (plan or {}).items():
        if name not in result:
            known = ", ".join(list(result)[:5])
            raise ConfigError(
                f"plan names node '{name}', which is not in the model (nodes are e.g. {known}). "
                "Key the plan by ONNX node name as listed by the model's graph."
            )
        if precision not in PRECISIONS:
            raise ConfigError(
                f"plan gives node '{name}' precision '{precision}'; use one of "
                f"{', '.join(PRECISIONS)}."
            )
        result[name] = precision
    return result


def place(model: onnx.ModelProto | graph.Graph,
          plan: Mapping[str, str] | None = None) -> Placement:
    """Where TensorRT's rules put the Q/DQ pairs of a normalized `model` under `plan`."""
    g = graph.Graph.of(model)
    model = g.model
    precision = _precisions(model, plan)
    initializers = g.initializers
    producers, consumers = g.producers, g.consumers
    outputs = set(g.outputs)
    placement = Placement()

    def request(tensor: str, node: onnx.NodeProto, index: int, source: str) -> None:
        placement.source.setdefault(tensor, source)
        placement.readers.setdefault(tensor, []).append((node.name, index))

    tensors = {init.name: init for init in model.graph.initializer}
    floats = g.floats | {
        init.name for init in model.graph.initializer if init.data_type == onnx.TensorProto.FLOAT}
    for node in model.graph.node:
        if precision[node.name] != "int8" or node.domain not in _ONNX_DOMAINS:
            continue
        if node.op_type in LINEAR_OPS and all(name in floats for name in node.input[:2]):
            # Data and weight inputs only: a Conv/Gemm bias stays float (see docs/qdq.md).
            for index, name in enumerate(node.input[:2]):
                if name in initializers:
                    is_weight = index == LINEAR_OPS[node.op_type]
                    rank = len(tensors[name].dims)
                    placement.weights[(node.name, index)] = (
                        name, weight_axis(node, index, rank) if is_weight else None
                    )
                else:
                    request(name, node, index, name)
        elif node.op_type == "Add":
            index = _residual_input(node, producers, consumers, initializers)
            if index is not None:
                request(node.input[index], node, index, node.input[index])

    _propagate_backward(g.order, placement, precision, producers, consumers, outputs,
                        initializers)
    _pair_linear_outputs_before_relu(model, placement, precision, consumers, outputs, tensors)
    return placement


def _all_readers(tensor: str, placement: Placement, consumers, outputs) -> bool:
    """True when every consumer edge of `tensor` reads its DQ output (nothing sees float)."""
    if tensor in outputs:
        return False
    edges = {(n.name, i) for n in consumers.get(tensor, []) for i, x in enumerate(n.input)
             if x == tensor}
    return edges == set(placement.readers.get(tensor, []))


def _propagate_backward(order, placement, precision, producers, consumers, outputs,
                        initializers):
    """Move each pair backward through pass-through ops, keeping the consumer's scale.

    Q(op(u)) == op(Q(u)) for these ops, so the move is exact. When the op's input
    already carries a pair, the op reads that DQ output and no second pair is made.
    """
    for tensor in reversed(order):
        while tensor in placement.readers:
            producer = producers.get(tensor)
            if (
                producer is None
                or producer.op_type not in PASS_THROUGH_OPS
                or precision[producer.name] != "int8"
                or producer.input[0] in initializers
                or not _all_readers(tensor, placement, consumers, outputs)
            ):
                break
            source = placement.source.pop(tensor)
            del placement.readers[tensor]
            upstream = producer.input[0]
            placement.source.setdefault(upstream, source)
            placement.readers.setdefault(upstream, []).append((producer.name, 0))
            tensor = upstream


def _is_relu(node: onnx.NodeProto, initializers: Mapping[str, onnx.TensorProto]) -> bool:
    """Relu, or Clip with min 0 (ReLU6): ops for which relu(DQ(Q(x))) == DQ(Q(relu(x)))."""
    if node.op_type == "Relu":
        return True
    if node.op_type != "Clip" or len(node.input) < 2 or node.input[1] not in initializers:
        return False
    return float(numpy_helper.to_array(initializers[node.input[1]])) == 0.0


def _pair_linear_outputs_before_relu(model, placement, precision, consumers, outputs,
                                     initializers):
    """Add a pair between a quantized linear op and its only consumer Relu/ReLU6 (ORT fusion).

    With zero point 0 and the Relu output's own scale, relu(DQ(Q(x))) ==
    DQ(Q(relu(x))) (for ReLU6 too: its output amax never exceeds 6, so saturation
    agrees), so this pair changes no value; it lets ONNX Runtime fuse
    DQ -> Conv -> Q into QLinearConv, which it cannot do across a Relu.
    """
    for node in model.graph.node:
        if node.op_type not in LINEAR_OPS or precision[node.name] != "int8":
            continue
        output = node.output[0]
        readers = consumers.get(output, [])
        if output in outputs or output in placement.readers or len(readers) != 1:
            continue
        relu = readers[0]
        if not _is_relu(relu, initializers) or precision[relu.name] != "int8":
            continue
        relu_out = relu.output[0]
        if relu_out in placement.readers and _all_readers(relu_out, placement, consumers, outputs):
            placement.source[output] = placement.source[relu_out]
            placement.readers[output] = [(relu.name, 0)]


def _residual_input(node, producers, consumers, initializers) -> int | None:
    """Index of the residual (skip) input of an Add that TensorRT fuses into a Conv, else None.

    Follows TensorRT Model Optimizer's rule: an input produced by a Conv is the
    fusible branch; when both are, the one on the longer path from the lowest
    common ancestor is the branch and the other is the residual.
    """
    if len(node.input) != 2 or any(name in initializers for name in node.input):
        return None
    backbones = [_backbone(name, producers, consumers) for name in node.input]
    if not any(backbones):
        return None
    lca, distance = _lowest_common_ancestor(node.input[0], node.input[1], producers, initializers)
    if all(backbones):
        if backbones[0] is backbones[1] or lca is None:
            return None
        return 1 if distance[0] > distance[1] else 0
    branch = 0 if backbones[0] else 1
    if lca is not None and lca == backbones[branch].output[0]:
        return None  # both inputs derive from the Conv's own output: not a skip connection
    return 1 - branch


def _backbone(tensor, producers, consumers) -> onnx.NodeProto | None:
    """The Conv producing `tensor`, directly or through a BatchNormalization it alone feeds."""
    producer = producers.get(tensor)
    if producer is not None and producer.op_type == "BatchNormalization":
        if len(consumers.get(producer.input[0], [])) != 1:
            return None
        producer = producers.get(producer.input[0])
    return producer if producer is not None and producer.op_type in _BACKBONE_OPS else None


def _lowest_common_ancestor(first, second, producers, initializers):
    """Common ancestor tensor with the smallest summed distance, and the two distances."""
    first_dist = _ancestor_distances(first, producers, initializers)
    second_dist = _ancestor_distances(second, producers, initializers)
    common = set(first_dist) & set(second_dist)
    if not common:
        return None, (0, 0)
    lca = min(common, key=lambda t: (first_dist[t] + second_dist[t], t))
    return lca, (first_dist[lca], second_dist[lca])


def _ancestor_distances(tensor, producers, initializers) -> dict[str, int]:
    distances = {tensor: 0}
    frontier = [tensor]
    while frontier:
        following = []
        for name in frontier:
            producer = producers.get(name)
            for parent in producer.input if producer is not None else ():
                if parent and parent not in initializers and parent not in distances:
                    distances[parent] = distances[name] + 1
                    following.append(parent)
        frontier = following
    return distances


def activation_scale(tensor: str, amax: Mapping[str, float]) -> np.float32:
    """Per-tensor scale amax / 127 of `tensor`, with a DataError naming it when amax is bad."""
    if tensor not in amax:
        raise DataError(
            f"no amax for tensor '{tensor}', which the Q/DQ model quantizes. Calibrate every "
            "tensor returned by quantlab.calibration.qdq.activation_tensors_to_calibrate(model, "
            "plan) "
            "(or pin the nodes reading it to fp32 in the plan)."
        )
    value = float(amax[tensor])
    if not np.isfinite(value) or value < 0:
        raise DataError(
            f"amax of tensor '{tensor}' is {value}; it must be a finite number >= 0. "
            "Re-run calibration on data without NaN/Inf for this tensor."
        )
    return np.float32(max(value, _MIN_AMAX) / _QMAX)


def quantize_weight(weight: np.ndarray, scale: np.ndarray, axis: int | None) -> np.ndarray:
    """int8 weight: round half to even, saturate to the narrow range [-127, 127].

    Symmetric weights never need -128 (TensorRT's weight quantization is symmetric in
    [-127, 127]); an amax below max |w| (:func:`weight_amax`'s MSE choice) clips there too,
    which also keeps ONNX Runtime's u8s8 kernels clear of -128 x 255 saturation.
    """
    shape = [1] * weight.ndim
    if axis is not None:
        shape[axis] = -1
    scaled = weight.astype(np.float32) / np.reshape(scale, shape)
    return np.clip(np.rint(scaled), -_QMAX, _QMAX).astype(np.int8)


def weight_dequantizer(weight: np.ndarray, name: str, axis: int | None, names: FreshNames,
                       criterion: str = "max", amax: np.ndarray | None = None,
                       ) -> tuple[list[onnx.TensorProto], onnx.NodeProto]:
    """The int8 weight, scale and zero-point initializers of `name` and its DequantizeLinear
    (amax by `criterion`, or `amax` when given)."""
    if amax is None:
        amax = weight_amax(weight, axis, criterion)
    scale = np.maximum(np.asarray(amax, np.float32), np.float32(_MIN_AMAX)) / np.float32(_QMAX)
    q_name, s_name, z_name = (names(f"{name}_{s}") for s in ("quantized", "scale", "zero_point"))
    stored = [
        numpy_helper.from_array(quantize_weight(weight, scale, axis), q_name),
        numpy_helper.from_array(scale.astype(np.float32), s_name),
        numpy_helper.from_array(np.zeros(scale.shape, np.int8), z_name),
    ]
    attrs = {"axis": axis} if axis is not None else {}
    node = helper.make_node("DequantizeLinear", [q_name, s_name, z_name],
                            [names(f"{name}_dequantized")],
                            name=names(f"{name}_DequantizeLinear"), **attrs)
    return stored, node


class FreshNames:
    """Fresh tensor/node names that never collide with the model's own."""

    def __init__(self, model: onnx.ModelProto):
        self.used = {t for n in model.graph.node for t in (*n.input, *n.output, n.name)}
        self.used.update(i.name for i in model.graph.initializer)
        self.used.update(v.name for v in model.graph.input)

    def __call__(self, base: str) -> str:
        name, count = base, 0
        while name in self.used:
            count += 1
            name = f"{base}_{count}"
        self.used.add(name)
        return name


def _build(model, placement: Placement, scales, per_channel: bool,
           weight_criterion: str, given: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    result = onnx.ModelProto()
    result.CopyFrom(model)
    g = result.graph
    names = FreshNames(model)
    weights = graph.initializers(model)
    zero_point = names("quantlab_zero_point_int8")
    g.initializer.append(numpy_helper.from_array(np.array(0, dtype=np.int8), zero_point))
    rewired: dict[tuple[str, int], str] = {}

    # Weights: int8 initializer -> DequantizeLinear (per-axis), one DQ per (weight, axis).
    prelude = []
    weight_dq: dict[tuple[str, int | None], str] = {}
    for edge, (weight_name, axis) in placement.weights.items():
        axis = axis if per_channel else None
        if (weight_name, axis) not in weight_dq:
            amax = given.get(weight_name)
            shape = () if axis is None else (weights[weight_name].shape[axis],)
            if amax is not None and np.shape(amax) != shape:
                amax = None  # chosen for another axis (per-tensor weights): by the criterion
            stored, dequantize = weight_dequantizer(weights[weight_name], weight_name, axis,
                                                    names, weight_criterion, amax)
            g.initializer.extend(stored)
            prelude.append(dequantize)
            weight_dq[(weight_name, axis)] = dequantize.output[0]
        rewired[edge] = weight_dq[(weight_name, axis)]

    # Activations: one Q/DQ pair per tensor, placed right after its producer.
    pairs: dict[str, list[onnx.NodeProto]] = {}
    for tensor, readers in placement.readers.items():
        scale_name = names(f"{tensor}_scale")
        g.initializer.append(
            numpy_helper.from_array(np.array(scales[placement.source[tensor]]), scale_name))
        quantized, dequantized = names(f"{tensor}_quantized"), names(f"{tensor}_dequantized")
        pairs[tensor] = [
            helper.make_node("QuantizeLinear", [tensor, scale_name, zero_point], [quantized],
                             name=names(f"{tensor}_QuantizeLinear")),
            helper.make_node("DequantizeLinear", [quantized, scale_name, zero_point],
                             [dequantized], name=names(f"{tensor}_DequantizeLinear")),
        ]
        rewired.update({edge: dequantized for edge in readers})

    nodes = list(prelude)
    for tensor in (v.name for v in model.graph.input):
        nodes.extend(pairs.get(tensor, []))
    for node in g.node:
        for index in range(len(node.input)):
            node.input[index] = rewired.get((node.name, index), node.input[index])
        nodes.append(node)
        for tensor in node.output:
            nodes.extend(pairs.get(tensor, []))
    del g.node[:]
    g.node.extend(nodes)
    return result
