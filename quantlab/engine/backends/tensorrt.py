"""TensorRT backend: build engines from quantlab's artifacts and run them, through Polygraphy.

Building and running go through Polygraphy's loaders and runner (NVIDIA's own,
pure Python, imports TensorRT lazily): ``NetworkFromOnnxPath`` -> a
``PostprocessNetwork`` pinning layers / ``MarkDebug`` / ``ModifyNetworkOutputs``
-> ``CreateConfig`` -> ``EngineBytesFromNetwork``, and ``TrtRunner`` to run.
Every argument TensorRT receives is decided by :func:`build_settings`, plain
Python tested without TensorRT. Which build exists depends on the installed
TensorRT (docs/tensorrt.md has every call's version range and source):

- **strongly typed** (TensorRT >= 9.0; the default from 10.0, the only mode of
  11.x): from ``model.int8.onnx``; the Q/DQ pairs and the ONNX types decide;
- **explicit** (TensorRT 8.x - 10.x; the default before 10.0): the same
  ``model.int8.onnx`` in a weakly typed network with ``BuilderFlag.INT8`` (and
  FP16 where it has float16 parts) and no calibrator, how TensorRT 8.6 builds
  Q/DQ models;
- **implicit INT8** (TensorRT <= 10.x; removed in 11.0): from the FP32
  ``model.onnx`` with ``BuilderFlag.INT8`` and a calibrator that either reads
  quantlab's ``calibration.cache`` or is fed quantlab's batches, plus the plan's
  fp32/fp16 layers pinned and obeyed (:func:`implicit_pins`).

Intermediate tensors for layer-by-layer comparison (``debug_tensors="layers"``)
are obtained the way the installed version allows (:func:`debug_strategy`):
unfused debug tensors mapped back to ONNX names through the engine inspector
(10.12+), ``mark_debug`` on the tensors the engine built without marks keeps
(10.0+), extra network outputs (8.x, which can change fusions; the report says
so). It is never faked: where `tensorrt` or `polygraphy` is missing every entry
point raises :class:`BackendUnavailableError` saying what to install.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx

from quantlab import graph
from quantlab.engine.backends import Backend
from quantlab.errors import BackendUnavailableError, ConfigError, DataError, ModelError

# Version ranges of the build paths and of the debug-tensor calls (checked against the Python
# bindings of every TensorRT release branch, python/src/infer/*.cpp; docs/tensorrt.md).
STRONGLY_TYPED_SINCE = (9, 0)  # NetworkDefinitionCreationFlag.STRONGLY_TYPED
IMPLICIT_INT8_UNTIL = (11, 0)  # BuilderFlag.INT8/FP16, IInt8*Calibrator, ILayer.precision: gone
MARK_DEBUG_SINCE = (10, 0)  # INetworkDefinition.mark_debug, IDebugListener
MARK_UNFUSED_SINCE = (10, 12)  # INetworkDefinition.mark_unfused_tensors_as_debug_tensors
PRECISIONS = ("fp32", "fp16", "int8")
# strongly_typed: model.int8.onnx, types decide; explicit: model.int8.onnx in a weakly typed
# network with BuilderFlag.INT8 (how TensorRT 8.x builds Q/DQ models); implicit: model.onnx with
# BuilderFlag.INT8 and a calibrator.
MODES = ("strongly_typed", "explicit", "implicit")
UNFUSED = "unfused"  # debug_tensors: mark_unfused_tensors_as_debug_tensors (TensorRT >= 10.12)
UNNAMED = "(Unnamed Layer*"  # how TensorRT names a layer (and its outputs) nobody named
LAYERS = "layers"  # debug_tensors: every ONNX tensor the engine keeps, the version's way
ENGINE_SUFFIXES = (".plan", ".engine", ".trt")  # a prebuilt, serialized engine
# How a tensor the engine stage compares was obtained (validate's "obtained" column).
SOURCES = {
    "graph_output": "a graph output of the engine",
    "debug_unfused": "an unfused debug tensor (mark_unfused_tensors_as_debug_tensors, TensorRT "
                     ">= 10.12), reported under TensorRT's internal name and mapped to its ONNX "
                     "name through the engine inspector's layer information",
    "debug_marked": "marked with mark_debug (TensorRT >= 10.0) because the engine built without "
                    "marks keeps it (engine inspector), so the marks leave the fusions as they are",
    "network_output": "marked as an extra network output (TensorRT < 10 has no debug tensors) "
                      "because the engine built without marks keeps it; an output can still "
                      "change TensorRT's fusions",
    "debug_prebuilt": "a debug tensor of the prebuilt engine (ICudaEngine.is_debug_tensor)",
}

_INSTALL = (
    "install quantlab[tensorrt] on a machine with an NVIDIA GPU (`pip install -e \".[tensorrt]\"`; "
    "TensorRT's wheels come from NVIDIA's index, https://pypi.nvidia.com), or validate the "
    "Q/DQ model with ONNX Runtime (the default engine stage)"
)


def require_tensorrt() -> ModuleType:
    """The `tensorrt` module; BackendUnavailableError naming what to install if it (or
    Polygraphy, which quantlab builds and runs engines with) is missing."""
    try:
        import tensorrt
    except ImportError:
        raise BackendUnavailableError(
            f"the TensorRT backend needs the `tensorrt` Python package, which is not installed; "
            f"{_INSTALL}."
        ) from None
    try:
        import polygraphy  # noqa: F401
    except ImportError:
        raise BackendUnavailableError(
            "the TensorRT backend builds and runs engines through NVIDIA's Polygraphy, which is "
            "not installed; `pip install polygraphy` (or install quantlab[tensorrt])."
        ) from None
    return tensorrt


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a TensorRT version string ('10.3.0.26' -> (10, 3, 0))."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not match:
        raise ConfigError(f"TensorRT version '{text}' is not a dotted version such as 10.3.0.")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_version() -> tuple[int, int, int]:
    """The installed TensorRT's version (BackendUnavailableError where it is missing)."""
    return parse_version(require_tensorrt().__version__)


def _text(version: Sequence[int]) -> str:
    return ".".join(str(v) for v in version)


def default_mode(version: tuple[int, ...]) -> str:
    """The build of ``model.int8.onnx`` (the model quantlab validated) on TensorRT `version`:
    'strongly_typed' from 10.0 on (the only path of 11.x), 'explicit' before (TensorRT 8.x
    builds Q/DQ networks weakly typed with BuilderFlag.INT8)."""
    return "strongly_typed" if tuple(version) >= (10, 0) else "explicit"


def check_mode(mode: str, version: tuple[int, ...]) -> None:
    """ConfigError unless build `mode` exists in TensorRT `version`, saying which does."""
    text = _text(version)
    if mode not in MODES:
        raise ConfigError(f"build mode '{mode}' is not one of {', '.join(MODES)}.")
    if mode in ("implicit", "explicit") and tuple(version) >= IMPLICIT_INT8_UNTIL:
        raise ConfigError(
            f"TensorRT {text} has no {mode} INT8 build: BuilderFlag.INT8/FP16, calibrators, "
            "layer precisions and precision constraints were removed in TensorRT 11.0. Build "
            "the strongly typed engine from model.int8.onnx (quantlab build DIR --mode "
            "strongly_typed), or use TensorRT 8.6-10.x for this path."
        )
    if mode == "strongly_typed" and tuple(version) < STRONGLY_TYPED_SINCE:
        raise ConfigError(
            f"TensorRT {text} has no strongly typed networks (added in 9.0). Build "
            "model.int8.onnx with --mode explicit (weakly typed, BuilderFlag.INT8: how "
            "TensorRT 8.x builds Q/DQ models), or model.onnx with calibration.cache (--mode "
            "implicit)."
        )


def debug_strategy(version: tuple[int, ...]) -> str:
    """How the engine stage obtains intermediate tensors on TensorRT `version` (a key of
    :data:`SOURCES`): unfused debug tensors mapped back through the inspector from 10.12,
    mark_debug on the tensors the unmarked engine keeps from 10.0, network outputs before."""
    if tuple(version) >= MARK_UNFUSED_SINCE:
        return "debug_unfused"
    if tuple(version) >= MARK_DEBUG_SINCE:
        return "debug_marked"
    return "network_output"


def check_debug_tensors(debug_tensors: Sequence[str] | str | None,
                        version: tuple[int, ...]) -> None:
    """ConfigError unless TensorRT `version` can expose `debug_tensors` ('layers', 'unfused' or
    tensor names: debug tensors from 10.0, extra network outputs before)."""
    if debug_tensors == UNFUSED and tuple(version) < MARK_UNFUSED_SINCE:
        raise ConfigError(
            f"TensorRT {_text(version)} cannot mark unfused tensors as debug tensors (added in "
            "10.12); pass debug_tensors='layers', which exposes the tensors the engine keeps "
            "the way this version can (mark_debug from 10.0, network outputs before)."
        )


def _names(debug_tensors: Sequence[str] | str | None) -> list[str]:
    # A single tensor name is one name, not its characters (trt-review F19).
    if not debug_tensors or debug_tensors in (UNFUSED, LAYERS):
        return []
    return [debug_tensors] if isinstance(debug_tensors, str) else list(debug_tensors)


@dataclass(frozen=True)
class LayerPins:
    """Layer precisions and output types an implicit INT8 build pins and obeys.

    Only fp32/fp16 are pinned: an int8 pin makes an OBEY build fail where a layer
    has no INT8 kernel (INT8 nodes are left to TensorRT, as trtexec does), and
    output types are set only on nodes whose outputs are all float (a type broadcast
    onto index or Bool outputs fails the build). With an fp16 pin the FP16 builder
    flag lets TensorRT pick FP16 for *every* unconstrained layer, so every other
    float node the Q/DQ model leaves unquantized is pinned fp32: what was validated.
    """

    precisions: dict[str, str] = field(default_factory=dict)
    output_types: dict[str, str] = field(default_factory=dict)

    @property
    def fp16(self) -> bool:
        """Whether the build needs BuilderFlag.FP16 (an fp16 pin)."""
        return "fp16" in self.precisions.values()


def implicit_pins(model: onnx.ModelProto, plan: Mapping[str, str]) -> LayerPins:
    """The :class:`LayerPins` of `plan` (``{ONNX node: precision}``) on the FP32 `model`."""
    from quantlab.calibration import qdq

    index = graph.Graph.of(model)
    nodes = {node.name: node for node in index.model.graph.node}
    unknown = [name for name in plan if name not in nodes]
    if unknown:
        raise ConfigError(f"the plan names {len(unknown)} node(s) the model does not have: "
                          f"{unknown[:5]}; plan this model.")
    plan = {node: str(p).lower() for node, p in plan.items()}
    bad = {node: p for node, p in plan.items() if p not in PRECISIONS}
    if bad:
        raise ConfigError(f"the plan gives node(s) {list(bad)[:5]} precision(s) "
                          f"{sorted(set(bad.values()))}; layer precisions are "
                          f"{', '.join(PRECISIONS)}.")
    float_out = {name for name, node in nodes.items()
                 if node.output and all(o in index.floats for o in node.output if o)}
    precisions = {node: p for node, p in plan.items() if p in ("fp32", "fp16")}
    if "fp16" in precisions.values():
        placement = qdq.place(index, plan)
        quantized = {node for edges in placement.readers.values() for node, _ in edges}
        quantized.update(node for node, _ in placement.weights)
        for name in nodes:
            if name in float_out and name not in quantized and plan.get(name) != "int8":
                precisions.setdefault(name, "fp32")
    precisions = {name: precisions[name] for name in nodes if name in precisions}
    return LayerPins(precisions, {n: p for n, p in precisions.items() if n in float_out})


def layer_node(name: str, metadata: str, inputs: Sequence[str], origin: Mapping[str, str],
               nodes: Mapping[str, str]) -> str | None:
    """The node of `nodes` (a plan's) a network layer computes, for pinning: its name's, the
    one its ``Metadata`` names, or, for a layer onnx-tensorrt left "(Unnamed Layer* N)" with
    no Metadata (a Gemm's bias add: the importer registers only the MatMul, and Metadata is
    written only on registered layers, 8.6-GA ImporterContext.cpp L112-137; trt-review F9),
    the node of the layer whose unnamed output it reads (`origin`: tensor -> node)."""
    if name in nodes:
        return name
    from quantlab.engine.trt_layers import metadata_nodes

    found = next((node for node in metadata_nodes(metadata) if node in nodes), None)
    if found is None and not metadata and name.startswith(UNNAMED):
        found = next((origin[t] for t in inputs if t in origin), None)
    return found


@dataclass(frozen=True)
class BuildSettings:
    """Every choice quantlab hands Polygraphy and TensorRT for one build (:func:`build_settings`).

    `tf32` keeps TensorRT's default (trtexec's too; Polygraphy clears it unless asked),
    so the engine built here is the one ``trtexec.txt`` builds.
    """

    mode: str
    strongly_typed: bool
    int8: bool
    fp16: bool
    tf32: bool
    precision_constraints: str | None
    pins: LayerPins
    mark_unfused: bool
    mark_debug: tuple[str, ...]
    mark_outputs: tuple[str, ...]
    profile: dict[str, tuple[tuple[int, ...], ...]]


def build_settings(
    model: onnx.ModelProto,
    version: tuple[int, ...],
    mode: str | None = None,
    calibrated: bool = False,
    layer_precisions: Mapping[str, str] | None = None,
    debug_tensors: Sequence[str] | str | None = None,
    max_batch: int = 1,
    input_shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
    calibration_batch: int | None = None,
) -> BuildSettings:
    """The :class:`BuildSettings` of building `model` on TensorRT `version` (see build_engine).

    `calibrated`: a calibrator is given; `calibration_batch`: its samples per
    batch, which must be the calibration profile's OPT batch (TensorRT reads
    exactly the OPT volume from each batch pointer).
    """
    mode = mode or default_mode(version)
    check_mode(mode, version)
    check_debug_tensors(debug_tensors, version)
    if mode != "implicit" and (calibrated or layer_precisions):
        raise ConfigError(
            f"a {mode} build takes its precisions from the Q/DQ model; a calibrator or layer "
            "precisions apply only to an implicit INT8 build from model.onnx (TensorRT <= 10)."
        )
    if mode == "implicit" and not calibrated:
        raise ConfigError(
            "an implicit INT8 build needs a calibrator reading calibration.cache or fed "
            "calibration batches (quantlab.engine.backends.trt_calibrator.make_calibrator)."
        )
    pins = LayerPins()
    if layer_precisions:
        pins = implicit_pins(model, layer_precisions)
    profile = input_profile(model, max_batch, input_shapes)
    if calibration_batch is not None:
        _check_calibration_batch(model, profile, calibration_batch)
    names = _names(debug_tensors)
    marked = tuple(names) if tuple(version) >= MARK_DEBUG_SINCE else ()
    outputs = tuple(names) if tuple(version) < MARK_DEBUG_SINCE else ()
    unfused = debug_tensors == UNFUSED or (debug_tensors == LAYERS
                                           and debug_strategy(version) == "debug_unfused")
    fp16 = pins.fp16 if mode == "implicit" else mode == "explicit" and has_float16(model)
    if fp16 and mode == "explicit":
        pins = explicit_pins(model)
    return BuildSettings(
        mode=mode, strongly_typed=mode == "strongly_typed", int8=mode != "strongly_typed",
        fp16=fp16, tf32=True, precision_constraints="obey" if pins.precisions else None,
        pins=pins, mark_unfused=unfused, mark_debug=marked, mark_outputs=outputs,
        profile=profile)


def explicit_pins(model: onnx.ModelProto) -> LayerPins:
    """The :class:`LayerPins` of a weakly typed (explicit) build of a Q/DQ `model` with float16
    parts: BuilderFlag.FP16 lets TensorRT pick FP16 for any unconstrained layer, so every node
    is pinned to the type its outputs have in the model (fp32 or fp16), as a strongly typed
    build would keep it (trt-review-r2 N10). Q/DQ and Cast nodes, and the layers reading a
    DequantizeLinear (INT8, TensorRT's to choose), are left alone."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in (
        *inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)}
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    names = {onnx.TensorProto.FLOAT: "fp32", onnx.TensorProto.FLOAT16: "fp16"}
    precisions = {}
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Cast") \
                or dequantized & set(node.input):
            continue
        kinds = {names.get(types.get(o)) for o in node.output if o}
        if len(kinds) == 1 and None not in kinds:
            precisions[node.name] = kinds.pop()
    return LayerPins(precisions, dict(precisions))


def explicit_build_pins(model: onnx.ModelProto) -> LayerPins | None:
    """The pins of a weakly typed build of the Q/DQ `model` (:func:`explicit_pins`) where it
    has float16 parts, else None (INT8 on, no FP16: nothing to pin)."""
    return explicit_pins(model) if has_float16(model) else None


def has_float16(model: onnx.ModelProto) -> bool:
    """Whether the Q/DQ `model` has fp16 nodes (Cast to float16 or float16 weights): a weakly
    typed build runs them in FP16 only with BuilderFlag.FP16."""
    half = onnx.TensorProto.FLOAT16
    return any(init.data_type == half for init in model.graph.initializer) or any(
        node.op_type == "Cast" and any(a.name == "to" and a.i == half for a in node.attribute)
        for node in model.graph.node)


def _check_calibration_batch(model: onnx.ModelProto, profile: Mapping, batch: int) -> None:
    for spec in graph.input_specs(model):
        if spec.batch_axis is None or spec.name not in profile:
            continue
        opt = profile[spec.name][1][spec.batch_axis]
        if opt != batch:
            raise ConfigError(
                f"the calibrator hands batches of {batch} sample(s) but the calibration "
                f"profile's OPT shape of input '{spec.name}' has {opt}; TensorRT reads exactly "
                "the OPT volume from each batch, so it would calibrate on part of a batch or "
                f"read past it. Build with max_batch={batch} or make the feeder with "
                f"batch={opt}."
            )


def _pin_layers(network: object, pins: LayerPins, trt: ModuleType) -> None:
    # ILayer.precision and ILayer.set_output_type (8.x - 10.x); output types only on float
    # outputs, the way trtexec's --layerOutputTypes skips shape and index tensors.
    dtypes = {"fp32": trt.float32, "fp16": trt.float16}
    floats = (trt.float32, trt.float16)
    origin: dict[str, str] = {}  # unnamed tensor -> the pinned node whose layer wrote it
    with warnings.catch_warnings():
        # Deprecated from 10.12 (pyGraph.cpp 10.16 L409/415) and still what implicit INT8
        # obeys until it goes in 11.0: the warning would only repeat per layer (r2 N19).
        warnings.simplefilter("ignore", DeprecationWarning)
        for layer in network:
            inputs = [layer.get_input(i).name for i in range(layer.num_inputs)
                      if layer.get_input(i) is not None]
            node = layer_node(layer.name, getattr(layer, "metadata", ""), inputs, origin,
                              pins.precisions)
            if node is None:
                continue
            outputs = [layer.get_output(i) for i in range(layer.num_outputs)]
            origin.update((o.name, node) for o in outputs if o.name.startswith(UNNAMED))
            layer.precision = dtypes[pins.precisions[node]]
            if node in pins.output_types:
                for index, output in enumerate(outputs):
                    if output.dtype in floats:
                        layer.set_output_type(index, dtypes[pins.precisions[node]])


def sample_axes(model: onnx.ModelProto | None, inputs: Sequence[str]) -> dict[str, int]:
    """Input -> its sample axis: the one `model` names, axis 0 of every input without a model."""
    if model is None:
        return dict.fromkeys(inputs, 0)
    return {spec.name: spec.batch_axis for spec in graph.input_specs(model)
            if spec.batch_axis is not None}


def profile_max_batch(shapes: Mapping[str, tuple[Sequence[int], Sequence[int]]],
                      axes: Mapping[str, int]) -> int | None:
    """The most samples an engine takes per run (trt-review-r2 N2): ``shapes`` maps each input
    to its engine shape and, where that has a dynamic (-1) dimension, its profile's MAX shape;
    `axes` gives the sample axes (:func:`sample_axes`). None where no input has one."""
    sizes = [int(high[axes[name]]) if shape[axes[name]] == -1 else int(shape[axes[name]])
             for name, (shape, high) in shapes.items()
             if name in axes and axes[name] < len(shape)]
    return min(sizes) if sizes else None


def input_profile(model: onnx.ModelProto, max_batch: int,
                  shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
                  dynamic_only: bool = False):
    """The optimization profile of `model`'s inputs as ``{name: (min, opt, max)}`` shapes.

    A dynamic sample axis runs from 1 to `max_batch` (opt = max: TensorRT
    calibrates at the opt shape); any other dynamic dimension takes the size of the
    data the model was calibrated on (:func:`quantlab.graph.record_data_shapes`);
    `shapes` (``{name: (min, opt, max)}``) overrides everything. With `dynamic_only`,
    only the inputs with a dynamic dimension (trtexec refuses shapes for the others).
    """
    shapes = dict(shapes or {})
    recorded = graph.data_shapes(model)
    profile = {}
    for spec in graph.input_specs(model):
        if dynamic_only and None not in spec.shape:
            continue
        if spec.name in shapes:
            profile[spec.name] = tuple(tuple(int(d) for d in s) for s in shapes[spec.name])
            continue
        fed = recorded.get(spec.name) or [None] * len(spec.shape)
        low = [d if d is not None else f for d, f in zip(spec.shape, fed, strict=True)]
        high = list(low)
        if spec.batch_axis is not None and spec.batch_size is None:
            low[spec.batch_axis], high[spec.batch_axis] = 1, int(max_batch)
        if any(d is None for d in low):
            raise ConfigError(
                f"input '{spec.name}' has dynamic dimensions {spec.shape} besides its sample "
                "axis, and the model records no data shape for them, so TensorRT's optimization"
                " profile cannot be set. Run quantlab calibrate (or plan) on this model with "
                "data: its model.onnx records the shape the data had. From Python, pass "
                "input_shapes={name: (min, opt, max)}."
            )
        profile[spec.name] = (tuple(low), tuple(high), tuple(high))
    return profile


def build_engine(
    model: str | os.PathLike,
    mode: str | None = None,
    calibrator: object | None = None,
    layer_precisions: Mapping[str, str] | None = None,
    debug_tensors: Sequence[str] | str | None = None,
    max_batch: int = 1,
    input_shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
    workspace: int | None = None,
) -> bytes:
    """Build a serialized TensorRT engine from the ONNX file `model`.

    `mode` (:data:`MODES`; default :func:`default_mode`): 'strongly_typed'
    (TensorRT >= 9) and 'explicit' (8.x - 10.x, weakly typed with
    ``BuilderFlag.INT8``) build the Q/DQ ``model.int8.onnx``; 'implicit'
    (TensorRT <= 10) builds the FP32 `model` with ``BuilderFlag.INT8`` and
    `calibrator` (:func:`quantlab.engine.backends.trt_calibrator.make_calibrator`)
    and pins `layer_precisions` (:func:`implicit_pins`). `debug_tensors` lists
    tensors to expose to :meth:`TensorRTBackend.run` (mark_debug from 10.0, network
    outputs before), or is 'unfused' (10.12+). Every argument TensorRT gets comes
    from :func:`build_settings`.
    """
    trt = require_tensorrt()
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        MarkDebug,
        ModifyNetworkOutputs,
        NetworkFromOnnxPath,
        PostprocessNetwork,
        Profile,
    )

    path = Path(model)
    if not path.is_file():
        raise ModelError(f"ONNX model {path} does not exist.")
    feeder = getattr(calibrator, "feeder", None)
    onnx_model = graph.load_model(path)
    settings = build_settings(onnx_model, parse_version(trt.__version__), mode,
                              calibrator is not None, layer_precisions, debug_tensors, max_batch,
                              input_shapes, getattr(feeder, "batch", None))
    profile = Profile()
    for name, (low, opt, high) in settings.profile.items():
        profile.add(name, min=low, opt=opt, max=high)
    network = NetworkFromOnnxPath(str(path), strongly_typed=settings.strongly_typed,
                                  mark_unfused_tensors_as_debug_tensors=settings.mark_unfused)
    if settings.pins.precisions:
        network = PostprocessNetwork(network, lambda network: _pin_layers(network, settings.pins,
                                                                          trt), "pin layers")
    if settings.mark_debug:
        network = MarkDebug(network, list(settings.mark_debug))
    if settings.mark_outputs:
        outputs = [o.name for o in onnx_model.graph.output]
        network = ModifyNetworkOutputs(network, outputs + [t for t in settings.mark_outputs
                                                           if t not in outputs])
    # DETAILED: the engine inspector then reports each layer's tensors, types and ONNX nodes.
    options = {"profiles": [profile], "profiling_verbosity": trt.ProfilingVerbosity.DETAILED,
               "tf32": settings.tf32 and hasattr(trt.BuilderFlag, "TF32")}
    if workspace:
        options["memory_pool_limits"] = {trt.MemoryPoolType.WORKSPACE: int(workspace)}
    if settings.int8:
        options.update(int8=True, fp16=settings.fp16, calibrator=calibrator,
                       precision_constraints=settings.precision_constraints)
    try:
        engine = bytes(EngineBytesFromNetwork(network, config=CreateConfig(**options))())
    except Exception as exc:  # Polygraphy raises PolygraphyException after TensorRT's log
        if feeder is not None:
            feeder.raise_error()  # the calibrator's own error explains the failure better
            if feeder.skipped_samples and not feeder.used_batches:  # r2 N17
                raise DataError(
                    f"TensorRT could not build an engine from {path}: every calibration batch "
                    f"({feeder.skipped_samples} samples) was skipped, its shape off the "
                    "calibration profile's OPT shape, so TensorRT had no data to calibrate "
                    f"on ({exc}). Give the feeder batches of the OPT shape.") from None
        raise ModelError(f"TensorRT could not build an engine from {path}: {exc}") from None
    if feeder is not None:
        # TensorRT's trampoline prints and swallows a callback's exception (pyInt8.cpp): a
        # refused cache is not written, a failing get_batch ends calibration (trt-review F4).
        feeder.raise_error()
    return engine


def layer_information(engine: bytes) -> str:
    """The engine inspector's layer information (JSON) of a serialized engine: what
    :func:`quantlab.engine.trt_layers.engine_layers` reads. Detailed for engines built by
    :func:`build_engine` (``ProfilingVerbosity.DETAILED``), layer names only otherwise."""
    trt = require_tensorrt()
    from polygraphy.backend.trt import EngineFromBytes

    inspector = EngineFromBytes(engine)().create_engine_inspector()
    return inspector.get_engine_information(trt.LayerInformationFormat.JSON)


@dataclass
class ExposedTensors:
    """Which ONNX tensors an engine returns and how: ``sources`` maps an ONNX tensor to a key of
    :data:`SOURCES`, ``engine_names`` an ONNX tensor to the name TensorRT reports it under, and
    ``notes`` say what the strategy costs (validate shows them with the results)."""

    sources: dict[str, str] = field(default_factory=dict)
    engine_names: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, onnx_name: str, source: str, engine_name: str | None = None) -> None:
        """Record that `onnx_name` comes back (under `engine_name`, default its own name)."""
        self.sources.setdefault(onnx_name, source)
        self.engine_names.setdefault(onnx_name, engine_name or onnx_name)

    def table(self, model: onnx.ModelProto | graph.Graph) -> list[dict[str, str]]:
        """One row per float tensor of `model` (graph inputs left out), in topological order:
        ``tensor``, ``obtained`` (a :data:`SOURCES` key, or 'not exposed') and
        ``engine_name`` (what TensorRT calls it)."""
        index = graph.Graph.of(model)
        inputs = set(index.input_names)
        return [{"tensor": name, "obtained": self.sources.get(name, "not exposed"),
                 "engine_name": self.engine_names.get(name, "")}
                for name in index.order if name in index.floats and name not in inputs]

    def keep_returned(self, returned: set[str]) -> None:
        """Drop the unfused tensors TensorRT did not return in a run: NvInfer.h promises no
        more than that *some* unfused tensors are marked."""
        dropped = [name for name, source in self.sources.items()
                   if source == "debug_unfused" and self.engine_names[name] not in returned]
        for name in dropped:
            del self.sources[name], self.engine_names[name]
        if dropped:
            self.notes.append(f"{len(dropped)} unfused tensor(s) the inspector lists were not "
                              "reported by TensorRT's debug listener and are not compared")


def exposed_tensors(layer_info: str | Mapping | Sequence, model: onnx.ModelProto | graph.Graph,
                    source: str, marked: Sequence[str] = ()) -> ExposedTensors:
    """The :class:`ExposedTensors` of an engine built from `model` whose inspector layer
    information is `layer_info`, intermediate tensors obtained the `source` way.

    'debug_unfused': every engine tensor :func:`quantlab.engine.trt_layers.engine_tensor_names`
    maps to an ONNX tensor; 'debug_marked' / 'network_output': the `marked` tensors the
    engine still holds. Graph outputs are always there; the rest of the float tensors is
    what the engine does not expose (:meth:`TensorRTBackend.not_exposed`).
    """
    from quantlab.engine.trt_layers import engine_layers, engine_tensor_names, held_as_float

    index = graph.Graph.of(model)
    result = ExposedTensors()
    for name in index.outputs:
        result.add(name, "graph_output")
    layers = engine_layers(layer_info, index.model)
    if source == "debug_unfused":
        mapping = engine_tensor_names(layers, index)
        inputs = set(index.input_names)
        for engine_name, onnx_name in mapping.items():
            if onnx_name in index.floats and onnx_name not in inputs:
                result.add(onnx_name, source, engine_name)
    else:
        held = held_as_float(layers, index)
        for name in marked:
            if name in held or source == "network_output":
                result.add(name, source)
    ordered = {name: result.sources[name] for name in index.order if name in result.sources}
    result.sources = ordered
    result.notes.append(f"intermediate tensors: {SOURCES[source]}")
    return result


class TensorRTBackend:
    """Run an engine built from `model` (or the prebuilt `engine` file) in TensorRT.

    `model` is the ONNX file the engine is built from (``model.int8.onnx`` for a
    strongly typed or explicit build, ``model.onnx`` for an implicit one; with a
    prebuilt `engine` it names the tensors); `build` holds :func:`build_engine`'s
    options. `debug_tensors` is None (graph outputs only), a list of names,
    'unfused' (10.12+), or 'layers': every ONNX tensor the engine keeps, obtained
    the installed version's way (:func:`debug_strategy`). ``run(batch, tensors)``
    returns outputs and exposed tensors under their ONNX names; ``exposed`` says how
    each was obtained.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        name: str = "tensorrt",
        engine: str | os.PathLike | bytes | None = None,
        debug_tensors: Sequence[str] | str | None = None,
        **build: object,
    ):
        trt = require_tensorrt()
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner
        from polygraphy.datatype import DataType

        if model is None and engine is None:
            raise ConfigError("the TensorRT backend needs an ONNX model to build or an engine.")
        if engine is not None and build:
            raise ConfigError(
                f"build options {sorted(build)} do not apply to a prebuilt engine; rebuild it "
                "(quantlab build) or pass the ONNX model instead.")
        self.name = name
        self.version = parse_version(trt.__version__)
        check_debug_tensors(debug_tensors, self.version)
        # The ONNX model the engine was built from: its tensor names are the engine's (what
        # validate matches stages by); None for a prebuilt engine given without it.
        self.model = graph.load_model(model) if model is not None else None
        if engine is None:
            engine, self.exposed = self._build(model, debug_tensors, build)
        else:
            if not isinstance(engine, bytes):
                path = Path(engine)
                if not path.is_file():
                    raise ModelError(f"engine file {path} does not exist.")
                engine = path.read_bytes()
            self.exposed = ExposedTensors(notes=["a prebuilt engine: only its outputs and the "
                                                 "tensors it was built to expose are compared"])
        self.engine_bytes = engine
        self.debug_tensors = debug_tensors
        self._runner = TrtRunner(EngineFromBytes(engine), name=name)
        self._runner.activate()
        meta = self._runner.get_input_metadata()
        self.inputs = {name: np.dtype(DataType.to_dtype(m.dtype, "numpy"))
                       for name, m in meta.items()}
        engine_obj = self._runner.engine
        outputs = [engine_obj.get_tensor_name(i) for i in range(engine_obj.num_io_tensors)
                   if engine_obj.get_tensor_mode(engine_obj.get_tensor_name(i))
                   == trt.TensorIOMode.OUTPUT]
        # Extra network outputs (TensorRT < 10) are exposed tensors, not the model's outputs.
        model_outputs = {o.name for o in self.model.graph.output} if self.model else None
        self.outputs = [o for o in outputs if model_outputs is None or o in model_outputs]
        for output in self.outputs:
            self.exposed.add(output, "graph_output")
        self.sample_axes = sample_axes(self.model, list(self.inputs))
        self.max_batch = profile_max_batch(
            {name: (tuple(engine_obj.get_tensor_shape(name)),
                    tuple(engine_obj.get_tensor_profile_shape(name, 0)[2])
                    if -1 in tuple(engine_obj.get_tensor_shape(name)) else ())
             for name in self.inputs}, self.sample_axes)
        if self.model is not None and hasattr(engine_obj, "is_debug_tensor"):
            for tensor in graph.topological_tensors(self.model):
                if engine_obj.is_debug_tensor(tensor):
                    self.exposed.add(tensor, "debug_prebuilt")
        if "debug_unfused" in self.exposed.sources.values():
            self.exposed.keep_returned(set(self._runner.infer(self._zeros(engine_obj))))

    def _zeros(self, engine_obj: object) -> dict[str, np.ndarray]:
        """A batch of zeros at each input's smallest profile shape (a probe run)."""
        feed = {}
        for name, dtype in self.inputs.items():
            shape = tuple(engine_obj.get_tensor_shape(name))
            if -1 in shape:
                shape = tuple(engine_obj.get_tensor_profile_shape(name, 0)[0])
            feed[name] = np.zeros(shape, dtype)
        return feed

    def _build(self, model: str | os.PathLike, debug_tensors, build: dict
               ) -> tuple[bytes, ExposedTensors]:
        """Build the engine exposing `debug_tensors`; for 'layers' (and 'unfused') read the
        inspector to know which ONNX tensors come back, and how."""
        names = _names(debug_tensors)
        if debug_tensors not in (LAYERS, UNFUSED):
            engine = build_engine(model, debug_tensors=names or None, **build)
            source = "debug_marked" if self.version >= MARK_DEBUG_SINCE else "network_output"
            exposed = ExposedTensors()
            for name in names:
                exposed.add(name, source)
            return engine, exposed
        strategy = "debug_unfused" if debug_tensors == UNFUSED else debug_strategy(self.version)
        if strategy == "debug_unfused":
            engine = build_engine(model, debug_tensors=UNFUSED, **build)
            return engine, exposed_tensors(layer_information(engine), self.model, strategy)
        from quantlab.engine.trt_layers import engine_layers, surviving_tensors

        # Marks (debug or output) keep a tensor from being fused: mark only what the engine
        # built without marks keeps, so the engine compared is that one.
        plain = build_engine(model, **build)
        outputs = {o.name for o in self.model.graph.output}
        kept = [t for t in surviving_tensors(engine_layers(layer_information(plain), self.model),
                                             self.model) if t not in outputs]
        if strategy == "network_output":
            kept = [t for t in kept if not set("*?[") & set(t)]  # Polygraphy reads fnmatch
        try:
            engine = build_engine(model, debug_tensors=kept or None, **build)
        except ModelError as exc:
            if not kept:
                raise
            # Marks have broken Q/DQ builds ("Could not find any implementation", TensorRT#3813,
            # #1961): compare the engine built without them, end to end (trt-review-r2 N11).
            exposed = exposed_tensors(layer_information(plain), self.model, strategy)
            exposed.notes.append(f"the build marking {len(kept)} intermediate tensor(s) failed "
                                 f"({exc}); only the outputs of the engine built without marks "
                                 "are compared")
            return plain, exposed
        exposed = exposed_tensors(layer_information(engine), self.model, strategy, kept)
        if strategy == "network_output":
            exposed.notes.append(
                f"TensorRT {_text(self.version)} has no debug tensors: {len(kept)} intermediate "
                "tensor(s) were marked as network outputs, which can change TensorRT's fusions; "
                "compare end to end on the engine built without them (quantlab build)")
        return engine, exposed

    def run(
        self, batch: Mapping[str, np.ndarray], tensors: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run one batch; return the requested tensors (default: the engine's outputs) under
        their ONNX names."""
        missing = [name for name in self.inputs if name not in batch]
        if missing:
            raise DataError(f"batch has no array for engine input(s) {missing}.")
        size = max((np.shape(batch[name])[axis] for name, axis in self.sample_axes.items()
                    if name in self.inputs and np.ndim(batch[name]) > axis), default=0)
        if self.max_batch is not None and size > self.max_batch:
            raise DataError(
                f"a batch of {size} samples is more than the engine '{self.name}' takes: its "
                f"optimization profile allows at most {self.max_batch}. Pass --batch-size "
                f"{self.max_batch} or rebuild it with a larger --max-batch (quantlab build).")
        # order="C" keeps a 0-d input 0-d (np.ascontiguousarray makes it 1-d).
        feed = {name: np.asarray(batch[name], dtype=dtype, order="C")
                for name, dtype in self.inputs.items()}
        values = self._runner.infer(feed)
        wanted = list(tensors) if tensors is not None else self.outputs
        where = {name: self.exposed.engine_names.get(name, name) for name in wanted}
        absent = [name for name in wanted if where[name] not in values]
        if absent:
            raise ModelError(
                f"tensor(s) {absent[:5]} are neither outputs nor exposed tensors of the engine "
                f"'{self.name}' (exposed: {list(self.exposed.sources)[:5]}). TensorRT fused "
                "them away or they were not marked: build with debug_tensors='layers' or "
                "[...] naming them."
            )
        return {name: np.array(values[where[name]]) for name in wanted}

    def available(self, names: Sequence[str]) -> list[str]:
        """The tensors of `names` that :meth:`run` can return, in the order given."""
        return [name for name in names if name in self.exposed.sources]

    def not_exposed(self, names: Sequence[str]) -> list[str]:
        """The tensors of `names` the engine does not return (fused away or not marked)."""
        return [name for name in names if name not in self.exposed.sources]

    @property
    def tensor_sources(self) -> dict[str, str]:
        """ONNX tensor -> how it is obtained (a key of :data:`SOURCES`)."""
        return dict(self.exposed.sources)

    @property
    def notes(self) -> list[str]:
        """What the way tensors were obtained costs, for the report."""
        return list(self.exposed.notes)

    def close(self) -> None:
        """Release the engine and its device memory."""
        if self._runner.is_active:
            self._runner.deactivate()


def make_engine_backend(
    kind: str,
    path_or_model: str | os.PathLike | onnx.ModelProto,
    name: str | None = None,
    max_batch: int = 1,
    debug_tensors: Sequence[str] | str | None = None,
    **options: object,
) -> Backend:
    """A `Backend` for validate's engine stage.

    `kind` 'onnxruntime' runs the Q/DQ model `path_or_model` in ONNX Runtime
    (any tensor can be requested; `max_batch` and `debug_tensors` do not apply).
    'tensorrt' builds an engine from the ONNX file (``model.int8.onnx``: strongly
    typed on TensorRT >= 10, explicit before) for batches of up to `max_batch`
    samples, exposing `debug_tensors` (names, 'unfused' or 'layers'), or loads a prebuilt
    ``.plan``/``.engine`` file (``model=`` the ONNX file it was built from names its
    tensors). `options` go to the backend's constructor.
    """
    if kind == "onnxruntime":
        from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(path_or_model, name=name or "engine_int8", **options)
    if kind != "tensorrt":
        raise ConfigError(f"engine backend '{kind}' is neither 'onnxruntime' nor 'tensorrt'.")
    require_tensorrt()
    if isinstance(path_or_model, onnx.ModelProto):
        raise ConfigError("the TensorRT backend builds from an ONNX file path, not a ModelProto.")
    path = Path(path_or_model)
    if path.suffix.lower() in ENGINE_SUFFIXES:  # built already: nothing left to mark
        return TensorRTBackend(options.pop("model", None), name=name or "tensorrt", engine=path,
                               **options)
    return TensorRTBackend(path, name=name or "tensorrt", debug_tensors=debug_tensors,
                           max_batch=max_batch, **options)
