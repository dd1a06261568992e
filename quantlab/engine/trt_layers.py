"""Map a TensorRT engine's layers back to ONNX nodes, and check their precision against a plan.

Input is the engine inspector's layer information (``IEngineInspector.
get_engine_information(LayerInformationFormat.JSON)`` on an engine built with
``ProfilingVerbosity.DETAILED``, or ``trtexec --exportLayerInfo=FILE
--profilingVerbosity=detailed``): ``{"Layers": [...], "Bindings": [...]}``,
each layer a dict with ``Name``, ``LayerType``, ``Inputs``/``Outputs`` (tensor
``Name`` and ``Format/Datatype``), for convolutions ``Weights.Type``, and from
TensorRT 8.6 on ``Metadata`` (``[ONNX Layer: NODE]`` entries separated by
``\\x1e``/``\\x1f``, set by the ONNX parser). A layer's ONNX nodes are read from
two places, merged:

- its ``Metadata`` where TensorRT wrote it, else its name: fused layers join
  ONNX node names with ``" + "`` (vertical fusion) and ``" || "``
  (horizontal), wrap pointwise fusions in ``PWN(a, PWN(b))``, and
  name Myelin regions ``{ForeignNode[first...last]}`` (every node from first to
  last in network order, which is the ONNX node order the parser imports);
- with the ONNX model: every node between the layer's input and output tensors
  (the fused Relu a convolution's name omits, the DequantizeLinear folded into it).

Reformat layers (``Reformatting CopyNode for ... to LAYER``) and TensorRT-made
layers (``(Unnamed Layer* N)``, ``copied_squeeze_after_...``) hold no ONNX node.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from quantlab import graph
from quantlab.errors import DataError

# onnx-tensorrt's processMetadata writes "[ONNX Layer: NODE]", "[ONNX Layer: NODE | Local
# Function: F]" for a node inside an ONNX local function (importerUtils.cpp, main), and 8.6
# appends the node's doc string, "[ONNX Layer: NODE | /m.py(12): forward]" (8.6-GA
# onnx2trt_utils.cpp L2268-2281): the node is what comes before the first " | ".
_METADATA = re.compile(r"\[ONNX Layer: ([^\]\x1e\x1f]+?)(?: \| [^\]\x1e\x1f]*)?\]")
_FOREIGN = re.compile(r"^\{ForeignNode\[(.*)\.\.\.(.*)\]\}$")
_REFORMAT = re.compile(
    r"^(?:Reformatting CopyNode for|Reformatted) (?:Input|Output) Tensor \d+ to ")
_INTERNAL = ("(Unnamed Layer*", "copied_squeeze_after_", "unsqueeze_node_after_",
             "squeeze_after_", "ONNXTRT_")
_FLOATS = ("fp32", "fp16", "bf16")
# Words of a "Format/Datatype" string ("Thirty-two wide channel vectorized row major Int8
# format", "Row major linear FP32", "Half") -> precision, checked in this order.
_TYPES = (("Int8", "int8"), ("FP8", "fp8"), ("BF16", "bf16"), ("FP16", "fp16"), ("Half", "fp16"),
          ("FP32", "fp32"), ("Float", "fp32"), ("Int32", "int32"), ("Int64", "int64"),
          ("Bool", "bool"), ("Int4", "int4"))


def datatype(text: str) -> str | None:
    """The precision a ``Format/Datatype`` (or ``Weights.Type``) string names, or None."""
    for word, precision in _TYPES:
        if re.search(rf"\b{word}\b", text):
            return precision
    return None


def name_tokens(name: str) -> list[str]:
    """The parts of a fused layer name: ``"a + PWN(b, PWN(c)) || d"`` -> [a, b, c, d]."""
    tokens: list[str] = []
    for horizontal in name.split(" || "):
        for part in horizontal.split(" + "):
            tokens.extend(_pwn_tokens(part.strip()))
    return [t for t in tokens if t]


def _pwn_tokens(text: str) -> list[str]:
    if not (text.startswith("PWN(") and text.endswith(")")):
        return [text]
    inner, depth, start, parts = text[4:-1], 0, 0, []
    for i, char in enumerate(inner):
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return [token for part in parts for token in _pwn_tokens(part)]


@dataclass
class EngineLayer:
    """One layer of an engine: its name, type, tensors, datatypes and the ONNX nodes it holds."""

    name: str
    layer_type: str
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    input_types: list[str | None] = field(default_factory=list)
    output_types: list[str | None] = field(default_factory=list)
    weights_type: str | None = None
    metadata: str = ""
    nodes: list[str] = field(default_factory=list)
    macs: int | None = None  # multiply-accumulates per run of a layer with weights

    @property
    def is_reformat(self) -> bool:
        """A layer TensorRT added to change a tensor's format or type (no ONNX node of its own,
        except a QuantizeLinear it runs as a reformat)."""
        return bool(_REFORMAT.match(self.name)) or (self.layer_type in ("Reformat", "NoOp")
                                                    and not self.nodes)

    @property
    def is_opaque(self) -> bool:
        """A Myelin region (``{ForeignNode[...]}``, TensorRT 10's transformer blocks): the
        inspector shows only the region's I/O formats, not what runs inside."""
        return self.layer_type == "Myelin" or bool(_FOREIGN.match(self.name))

    @property
    def precision(self) -> str | None:
        """The precision the layer computes in: its weights' type, else its inputs' lowest
        float type (int8 < fp8 < fp16/bf16 < fp32); None where the JSON has no types or the
        layer is a Myelin region, whose I/O types say nothing of the nodes inside."""
        if self.is_opaque:
            return None
        if self.weights_type in ("int8", "fp8", "fp16", "bf16", "fp32", "int4"):
            return self.weights_type
        found = [t for t in self.input_types if t]
        for precision in ("int8", "int4", "fp8", "fp16", "bf16", "fp32"):
            if precision in found:
                return precision
        return found[0] if found else None


def read_layer_info(source: str | os.PathLike | Mapping | Sequence) -> list[dict]:
    """The layer dicts of layer-information JSON (a path, a JSON string, or parsed JSON).

    A names-only export (``ProfilingVerbosity.LAYER_NAMES_ONLY``: a list of
    strings) gives layers with a name only.
    """
    data = source
    if isinstance(source, (str, os.PathLike)):
        text = str(source)
        if not text.lstrip().startswith(("{", "[")):
            path = Path(source)
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise DataError(f"layer information {path} cannot be read ({exc}).") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"layer information is not JSON ({exc}).") from None
    layers = data.get("Layers") if isinstance(data, Mapping) else data
    if not isinstance(layers, list):
        raise DataError(
            "layer information has no 'Layers' list; export it with trtexec --exportLayerInfo "
            "--profilingVerbosity=detailed or IEngineInspector.get_engine_information(JSON)."
        )
    return [{"Name": layer} if isinstance(layer, str) else dict(layer) for layer in layers]


def metadata_nodes(metadata: str) -> list[str]:
    """The ONNX node names of a layer's ``Metadata`` (``ILayer.metadata``, TensorRT >= 8.6)."""
    return _METADATA.findall(metadata or "")


def engine_layers(source: str | os.PathLike | Mapping | Sequence,
                  model: onnx.ModelProto | None = None) -> list[EngineLayer]:
    """Parse layer information into :class:`EngineLayer` s, each with its ONNX nodes.

    Without `model` a layer's nodes are every name token and metadata entry that
    is not TensorRT-made; with it, only names of nodes of `model`, plus the
    nodes between the layer's input and output tensors.
    """
    index = _ModelIndex(model) if model is not None else None
    result = []
    for raw in read_layer_info(source):
        name = str(raw.get("Name", ""))
        layer = EngineLayer(
            name=name,
            layer_type=str(raw.get("LayerType", "")),
            inputs=[str(t.get("Name", "")) for t in raw.get("Inputs", [])],
            outputs=[str(t.get("Name", "")) for t in raw.get("Outputs", [])],
            input_types=[datatype(str(t.get("Format/Datatype", "")))
                         for t in raw.get("Inputs", [])],
            output_types=[datatype(str(t.get("Format/Datatype", "")))
                          for t in raw.get("Outputs", [])],
            weights_type=datatype(str((raw.get("Weights") or {}).get("Type", ""))),
            metadata=str(raw.get("Metadata", "")),
            macs=_macs(raw),
        )
        layer.nodes = _layer_nodes(layer, index)
        result.append(layer)
    _inherit_unnamed(result, index)
    return result


def _macs(raw: Mapping) -> int | None:
    """Multiply-accumulates of a convolution / fully connected layer: each output element
    takes ``Weights.Count / OutMaps`` of them (Count = OutMaps * Cin/Groups * kernel volume);
    None for a layer without weights or output ``Dimensions``."""
    count = (raw.get("Weights") or {}).get("Count")
    maps = raw.get("OutMaps")
    dims = (raw.get("Outputs") or [{}])[0].get("Dimensions")
    if not count or not maps or not dims:
        return None
    volume = 1
    for size in dims:
        volume *= max(int(size), 1)  # a dynamic (-1) dimension counts one sample
    return volume * int(count) // int(maps)


def int8_coverage(layers: Sequence[EngineLayer]) -> dict:
    """The share of an engine's multiply-accumulates in layers whose weights run INT8, over
    its layers with weights (convolutions, fully connected; Myelin regions are not counted:
    the inspector does not say what runs inside): ``int8_macs``, ``macs``, ``share`` (None
    without any such layer) and ``float_layers`` (the layers with weights not in INT8)."""
    weighted = [layer for layer in layers if layer.macs]
    total = sum(layer.macs for layer in weighted)
    int8 = sum(layer.macs for layer in weighted if layer.precision == "int8")
    return {"int8_macs": int8, "macs": total, "share": int8 / total if total else None,
            "float_layers": [layer.name for layer in weighted if layer.precision != "int8"]}


def _inherit_unnamed(layers: Sequence[EngineLayer], index: _ModelIndex | None) -> None:
    """Give a TensorRT-made layer without Metadata the nodes of the layer whose internal
    output it reads: onnx-tensorrt registers (names, and writes Metadata on) only one layer
    per node, so a Gemm's bias add is "(Unnamed Layer* N) [ElementWise]" reading the unnamed
    MatMul output, with empty Metadata (8.6-GA ImporterContext.cpp L112-137, builtin_op_importers
    Gemm; trt-review-r2 F9)."""
    onnx_tensors = set(index.producers) | index.graph_inputs if index else set()
    producer = {name: layer for layer in layers for name in layer.outputs}
    for layer in layers:
        if layer.nodes or layer.metadata or layer.is_reformat \
                or not layer.name.startswith(_INTERNAL):
            continue
        internal = [name for name in layer.inputs if name in producer and (
            name.startswith(_INTERNAL) if index is None else name not in onnx_tensors)]
        layer.nodes = list(dict.fromkeys(n for name in internal for n in producer[name].nodes))


def _layer_nodes(layer: EngineLayer, index: _ModelIndex | None) -> list[str]:
    if _REFORMAT.match(layer.name):
        return []
    # Metadata, where TensorRT wrote it (8.6+), names the layer's nodes; the name may then be
    # a kernel's ("PointWise", "__myl_...").
    candidates = metadata_nodes(layer.metadata)
    foreign = _FOREIGN.match(layer.name)
    if not candidates and foreign:
        first, last = foreign.groups()
        candidates = index.between(first, last) if index else [first, last]
    elif not candidates:
        candidates = [t for t in name_tokens(layer.name) if not t.startswith(_INTERNAL)]
    if index is None:
        return list(dict.fromkeys(candidates))
    found = [c for c in candidates if c in index.position]
    found += index.span(layer.inputs, layer.outputs)
    return sorted(set(found), key=index.position.__getitem__)


class _ModelIndex:
    """Node order, producers and constants of an ONNX model, for mapping layers to nodes."""

    def __init__(self, model: onnx.ModelProto):
        self.nodes = list(model.graph.node)
        self.position = {node.name: i for i, node in enumerate(self.nodes)}
        self.producers = graph.producers(model)
        self.constants = graph.constant_tensors(model)
        self.graph_inputs = {value.name for value in model.graph.input}

    def between(self, first: str, last: str) -> list[str]:
        """Node names from `first` to `last` in node order (empty if either is unknown)."""
        if first not in self.position or last not in self.position:
            return []
        start, stop = sorted((self.position[first], self.position[last]))
        return [node.name for node in self.nodes[start:stop + 1]]

    def span(self, inputs: Sequence[str], outputs: Sequence[str]) -> list[str]:
        """Nodes computing `outputs` from `inputs` and constants; empty when the walk leaves
        them (a tensor TensorRT renamed), so that nothing is attributed by guess."""
        if not outputs or not all(t in self.producers for t in outputs):
            return []
        stop = set(inputs) | self.constants
        found: dict[str, None] = {}
        pending = list(outputs)
        while pending:
            tensor = pending.pop()
            if tensor in stop:
                continue
            node = self.producers.get(tensor)
            if node is None:
                return []  # reached a graph input the layer does not read: not its span
            if node.name in found:
                continue
            found[node.name] = None
            pending.extend(name for name in node.input if name)
        return list(found)


@dataclass(frozen=True)
class PrecisionMismatch:
    """A planned node whose engine layer runs in another precision (engine None: not found)."""

    node: str
    planned: str
    engine: str | None
    layer: str | None


def node_layers(layers: Sequence[EngineLayer]) -> dict[str, list[EngineLayer]]:
    """ONNX node name -> every engine layer that holds it, reformats left out (a Gemm is a
    MatMul layer and an unnamed bias-add layer: onnx-tensorrt's Gemm importer)."""
    result: dict[str, list[EngineLayer]] = {}
    for layer in layers:
        if layer.is_reformat:
            continue
        for node in layer.nodes:
            result.setdefault(node, []).append(layer)
    return result


def precision_mismatches(layers: Sequence[EngineLayer],
                         plan: Mapping[str, str]) -> list[PrecisionMismatch]:
    """Every node of `plan` (``{ONNX node name: "int8" | "fp16" | "fp32"}``) with an engine
    layer computing in another precision, or that no layer holds, in plan order. Nodes inside
    Myelin regions are left out (:func:`opaque_nodes`): the inspector does not say their
    precision."""
    where = node_layers(layers)
    result = []
    for node, planned in plan.items():
        planned = str(planned).lower()
        held = [layer for layer in where.get(node, []) if not layer.is_opaque]
        if not held and where.get(node):
            continue
        if not held:
            result.append(PrecisionMismatch(node, planned, None, None))
        result.extend(PrecisionMismatch(node, planned, layer.precision, layer.name)
                      for layer in held if layer.precision != planned)
    return result


def opaque_nodes(layers: Sequence[EngineLayer], plan: Mapping[str, str]) -> list[str]:
    """Nodes of `plan` that only Myelin regions hold: their precision is not reported."""
    where = node_layers(layers)
    return [node for node in plan
            if where.get(node) and all(layer.is_opaque for layer in where[node])]


def engine_tensor_names(layers: Sequence[EngineLayer],
                        model: onnx.ModelProto | graph.Graph) -> dict[str, str]:
    """Engine tensor name -> the ONNX tensor of `model` it holds.

    A tensor keeps its ONNX name where the ONNX parser named it so and TensorRT
    did not rename it. Otherwise (a reformat's ``Reformatted ... Tensor`` or a
    fused layer's internal output, the names TensorRT >= 10.12 reports for
    unfused debug tensors, ``NvInfer.h`` markUnfusedTensorsAsDebugTensors) it is
    mapped when one thing says which ONNX tensor it is: a reformat copying an
    ONNX-named tensor, or a layer with one output whose ONNX nodes (Metadata or
    name) leave exactly one tensor to the rest of the graph. An ONNX tensor
    already held under its own name is not mapped twice.
    """
    index = graph.Graph.of(model)
    onnx_tensors = set(index.order)
    result = {name: name for name in held_as_float(layers, index) if name in onnx_tensors}
    held = set(result.values())
    outputs = set(index.outputs)
    producing = {node.name: node for node in index.model.graph.node}
    for layer in layers:
        internal = [name for name in layer.outputs if name not in result]
        if len(layer.outputs) != 1 or not internal:
            continue
        if layer.is_reformat:
            found = [name for name in layer.inputs if name in onnx_tensors]
        else:
            nodes = {name for name in layer.nodes if name in producing}
            found = [tensor for name in nodes for tensor in producing[name].output
                     if tensor in outputs or any(reader.name not in nodes
                                                 for reader in index.consumers.get(tensor, []))]
        if len(found) == 1 and found[0] not in held and found[0] in index.floats \
                and (layer.output_types or [None])[0] in (*_FLOATS, None):
            result[internal[0]] = found[0]
            held.add(found[0])
    return result


def held_as_float(layers: Sequence[EngineLayer], model: onnx.ModelProto | graph.Graph
                  ) -> set[str]:
    """Engine tensors that hold an ONNX float tensor's values: every name the layers read or
    write, except those the inspector types Int8 (or any non-float type) where the ONNX tensor
    is float, e.g. a convolution's output that carries the Q TensorRT fused into it: its
    buffer holds int8 codes, not the float values (trt-review-r2 N4). A tensor without a
    ``Format/Datatype`` (names-only layer information) is taken as held."""
    index = graph.Graph.of(model)
    types: dict[str, set] = {}
    for layer in layers:
        for name, kind in (*zip(layer.inputs, layer.input_types, strict=True),
                           *zip(layer.outputs, layer.output_types, strict=True)):
            types.setdefault(name, set()).add(kind)
    return {name for name, kinds in types.items()
            if name not in index.floats or kinds <= {*_FLOATS, None}}


def surviving_tensors(layers: Sequence[EngineLayer],
                      model: onnx.ModelProto | graph.Graph) -> list[str]:
    """The intermediate float ONNX tensors of `model` that an engine keeps under their own name
    (layer inputs and outputs; graph inputs left out), in topological order: marking them
    (mark_debug, or as outputs before TensorRT 10) keeps the fusions of the engine that was
    inspected."""
    index = graph.Graph.of(model)
    names = held_as_float(layers, index)
    inputs = set(index.input_names)
    return [name for name in index.order
            if name in names and name in index.floats and name not in inputs]
