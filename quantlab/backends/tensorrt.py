"""TensorRT backend: build engines from quantlab's artifacts and run them, through Polygraphy.

Building and running go through Polygraphy's loaders and runner (NVIDIA's own,
pure Python, imports TensorRT lazily): ``NetworkFromOnnxPath`` ->
``SetLayerPrecisions`` / ``MarkDebug`` -> ``CreateConfig`` ->
``EngineBytesFromNetwork``, and ``TrtRunner`` to run. Which build exists
depends on the installed TensorRT (docs/tensorrt.md has every call's version
range and source):

- **strongly typed** (TensorRT >= 9.0; the only mode of 11.x): from
  ``model.int8.onnx``; the Q/DQ pairs and the ONNX types decide every precision;
- **implicit INT8** (TensorRT <= 10.x; removed in 11.0): from the FP32
  ``model.onnx`` with ``BuilderFlag.INT8`` and a calibrator that either reads
  quantlab's ``calibration.cache`` or is fed quantlab's batches, plus per-layer
  precisions obeyed (``{ONNX node name: "fp32" | "fp16" | "int8"}``).

Intermediate tensors come from debug tensors, never from extra outputs (which
break TensorRT's fusions): tensors marked with ``mark_debug`` (TensorRT >=
10.0) or, with ``debug_tensors="unfused"``, every tensor TensorRT did not fuse
away (``mark_unfused_tensors_as_debug_tensors``, TensorRT >= 10.12). It is
never faked: where `tensorrt` or `polygraphy` is missing every entry point
raises :class:`BackendUnavailableError` saying what to install.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx

from quantlab import graph
from quantlab.backends import Backend
from quantlab.errors import BackendUnavailableError, ConfigError, DataError, ModelError

# Version ranges of the two build paths and of the debug-tensor calls (checked against the
# Python bindings of every TensorRT release branch, python/src/infer/*.cpp; docs/tensorrt.md).
STRONGLY_TYPED_SINCE = (9, 0)  # NetworkDefinitionCreationFlag.STRONGLY_TYPED
IMPLICIT_INT8_UNTIL = (11, 0)  # BuilderFlag.INT8, IInt8*Calibrator, ILayer.precision: gone in 11.0
MARK_DEBUG_SINCE = (10, 0)  # INetworkDefinition.mark_debug, IDebugListener
MARK_UNFUSED_SINCE = (10, 12)  # INetworkDefinition.mark_unfused_tensors_as_debug_tensors
PRECISIONS = ("fp32", "fp16", "int8")
UNFUSED = "unfused"
ENGINE_SUFFIXES = (".plan", ".engine", ".trt")  # a prebuilt, serialized engine

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


def default_mode(version: tuple[int, ...]) -> str:
    """The build path quantlab takes on TensorRT `version`: 'strongly_typed' from 10.0 on
    (explicit Q/DQ, the only path of 11.x), 'implicit' before."""
    return "strongly_typed" if tuple(version) >= (10, 0) else "implicit"


def check_mode(mode: str, version: tuple[int, ...]) -> None:
    """ConfigError unless build `mode` exists in TensorRT `version`, saying which does."""
    text = ".".join(str(v) for v in version)
    if mode == "implicit" and tuple(version) >= IMPLICIT_INT8_UNTIL:
        raise ConfigError(
            f"TensorRT {text} has no implicit INT8: calibrators, BuilderFlag.INT8/FP16, layer "
            "precisions and precision constraints were removed in TensorRT 11.0. Build the "
            "strongly typed engine from model.int8.onnx (quantlab build DIR --mode "
            "strongly_typed), or use TensorRT 10.x for the calibration-cache path."
        )
    if mode == "strongly_typed" and tuple(version) < STRONGLY_TYPED_SINCE:
        raise ConfigError(
            f"TensorRT {text} has no strongly typed networks (added in 9.0; quantlab uses them "
            "from 10.0). Build the implicit INT8 engine from model.onnx and calibration.cache "
            "(--mode implicit), or use TensorRT >= 10."
        )
    if mode not in ("implicit", "strongly_typed"):
        raise ConfigError(f"build mode '{mode}' is neither 'strongly_typed' nor 'implicit'.")


def check_debug_tensors(debug_tensors: Sequence[str] | str | None,
                        version: tuple[int, ...]) -> None:
    """ConfigError unless TensorRT `version` can expose `debug_tensors` as debug tensors."""
    text = ".".join(str(v) for v in version)
    if not debug_tensors:
        return
    if debug_tensors == UNFUSED:
        if tuple(version) < MARK_UNFUSED_SINCE:
            raise ConfigError(
                f"TensorRT {text} cannot mark unfused tensors as debug tensors (added in "
                "10.12); name the tensors to expose instead (mark_debug, TensorRT >= 10.0), "
                "which keeps them from being fused."
            )
    elif tuple(version) < MARK_DEBUG_SINCE:
        raise ConfigError(
            f"TensorRT {text} has no debug tensors (INetworkDefinition.mark_debug and "
            "IDebugListener arrived in 10.0), so the engine stage can only compare graph "
            "outputs; run with TensorRT >= 10 for layer-by-layer comparison."
        )


def layer_precisions_for(plan: Mapping[str, str], version: tuple[int, ...]) -> dict[str, str]:
    """Check a `{ONNX node name: precision}` plan for an implicit build; return it lowercased."""
    check_mode("implicit", version)
    result = {}
    for node, precision in plan.items():
        value = str(precision).lower()
        if value not in PRECISIONS:
            raise ConfigError(
                f"node '{node}' has precision '{precision}'; layer precisions are "
                f"{', '.join(PRECISIONS)}."
            )
        result[node] = value
    return result


def _trt_dtype(trt: ModuleType, precision: str):
    return {"fp32": trt.float32, "fp16": trt.float16, "int8": trt.int8}[precision]


def _pin_output_types(network: object, dtypes: Mapping[str, object]) -> None:
    # A pinned layer's outputs in its precision too (ILayer.set_output_type, 8.x - 10.x), as
    # trtexec's --layerOutputTypes: else it may write INT8 for an INT8 reader.
    for layer in network:
        if layer.name in dtypes:
            for index in range(layer.num_outputs):
                layer.set_output_type(index, dtypes[layer.name])


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

    `mode` 'strongly_typed' (default on TensorRT >= 10) builds `model` as typed
    (pass ``model.int8.onnx``); 'implicit' (TensorRT <= 10) builds the FP32
    `model` with ``BuilderFlag.INT8`` and `calibrator` (see
    :func:`quantlab.backends.trt_calibrator.make_calibrator`; it reads
    ``calibration.cache`` or is fed batches) and obeys `layer_precisions`.
    `debug_tensors` lists tensors to expose to :meth:`TensorRTBackend.run`, or
    is 'unfused' for every tensor TensorRT keeps.
    """
    trt = require_tensorrt()
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        MarkDebug,
        NetworkFromOnnxPath,
        PostprocessNetwork,
        Profile,
        SetLayerPrecisions,
    )

    version = parse_version(trt.__version__)
    mode = mode or default_mode(version)
    check_mode(mode, version)
    check_debug_tensors(debug_tensors, version)
    path = Path(model)
    if not path.is_file():
        raise ModelError(f"ONNX model {path} does not exist.")
    if mode == "strongly_typed" and (calibrator is not None or layer_precisions):
        raise ConfigError(
            "a strongly typed build takes its precisions from the Q/DQ model and its types; "
            "a calibrator or layer precisions apply only to an implicit INT8 build "
            "(TensorRT <= 10)."
        )
    if mode == "implicit" and calibrator is None:
        raise ConfigError(
            "an implicit INT8 build needs a calibrator reading calibration.cache or fed "
            "calibration batches (quantlab.backends.trt_calibrator.make_calibrator)."
        )
    precisions = layer_precisions_for(layer_precisions, version) if layer_precisions else {}
    fp32_model = graph.load_model(path)
    profile = Profile()
    for name, (low, opt, high) in input_profile(fp32_model, max_batch, input_shapes).items():
        profile.add(name, min=low, opt=opt, max=high)

    network = NetworkFromOnnxPath(
        str(path),
        strongly_typed=mode == "strongly_typed",
        mark_unfused_tensors_as_debug_tensors=debug_tensors == UNFUSED,
    )
    if precisions:
        dtypes = {node: _trt_dtype(trt, p) for node, p in precisions.items()}
        network = SetLayerPrecisions(network, dtypes)
        network = PostprocessNetwork(network, lambda network: _pin_output_types(network, dtypes),
                                     "pin output types")
    if debug_tensors and debug_tensors != UNFUSED:
        network = MarkDebug(network, list(debug_tensors))
    # DETAILED: the engine inspector then reports each layer's tensors, types and ONNX nodes.
    options = {"profiles": [profile], "profiling_verbosity": trt.ProfilingVerbosity.DETAILED}
    if workspace:
        options["memory_pool_limits"] = {trt.MemoryPoolType.WORKSPACE: int(workspace)}
    if mode == "implicit":
        options.update(
            int8=True,
            fp16="fp16" in precisions.values(),
            calibrator=calibrator,
            precision_constraints="obey" if precisions else None,
        )
    config = CreateConfig(**options)
    try:
        return bytes(EngineBytesFromNetwork(network, config=config)())
    except Exception as exc:  # Polygraphy raises PolygraphyException after TensorRT's log
        raise ModelError(f"TensorRT could not build an engine from {path}: {exc}") from None


def layer_information(engine: bytes) -> str:
    """The engine inspector's layer information (JSON) of a serialized engine: what
    :func:`quantlab.trt_layers.engine_layers` reads. Detailed for engines built by
    :func:`build_engine` (``ProfilingVerbosity.DETAILED``), layer names only otherwise."""
    trt = require_tensorrt()
    from polygraphy.backend.trt import EngineFromBytes

    inspector = EngineFromBytes(engine)().create_engine_inspector()
    return inspector.get_engine_information(trt.LayerInformationFormat.JSON)


class TensorRTBackend:
    """Run an engine built from `model` (or the prebuilt `engine` file) in TensorRT.

    `model` is the ONNX file the engine is built from (``model.int8.onnx`` for a
    strongly typed build, ``model.onnx`` for an implicit one; with a prebuilt
    `engine` it only names the tensors); `build` holds :func:`build_engine`'s
    options. ``run(batch, tensors)`` returns graph outputs
    and debug tensors: only tensors marked at build time (`debug_tensors`) can
    be requested.
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
            engine = build_engine(model, debug_tensors=debug_tensors, **build)
        elif not isinstance(engine, bytes):
            path = Path(engine)
            if not path.is_file():
                raise ModelError(f"engine file {path} does not exist.")
            engine = path.read_bytes()
        self.engine_bytes = engine
        self.debug_tensors = debug_tensors
        self._runner = TrtRunner(EngineFromBytes(engine), name=name)
        self._runner.activate()
        meta = self._runner.get_input_metadata()
        self.inputs = {name: np.dtype(DataType.to_dtype(m.dtype, "numpy"))
                       for name, m in meta.items()}
        engine_obj = self._runner.engine
        self.outputs = [engine_obj.get_tensor_name(i) for i in range(engine_obj.num_io_tensors)
                        if engine_obj.get_tensor_mode(engine_obj.get_tensor_name(i))
                        == trt.TensorIOMode.OUTPUT]

    def run(
        self, batch: Mapping[str, np.ndarray], tensors: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run one batch; return the requested tensors (default: the engine's outputs)."""
        missing = [name for name in self.inputs if name not in batch]
        if missing:
            raise DataError(f"batch has no array for engine input(s) {missing}.")
        feed = {name: np.ascontiguousarray(batch[name], dtype=dtype)
                for name, dtype in self.inputs.items()}
        values = self._runner.infer(feed)
        wanted = list(tensors) if tensors is not None else self.outputs
        absent = [name for name in wanted if name not in values]
        if absent:
            raise ModelError(
                f"tensor(s) {absent[:5]} are neither outputs nor debug tensors of the engine "
                f"'{self.name}' (debug tensors: {self._debug_description()}). TensorRT fused "
                "them away or they were not marked: build with debug_tensors=[...] naming "
                "them (mark_debug keeps them unfused)."
            )
        return {name: np.array(values[name]) for name in wanted}

    def available(self, names: Sequence[str]) -> list[str]:
        """The tensors of `names` that :meth:`run` can return: engine outputs and debug tensors
        (``ICudaEngine.is_debug_tensor``, TensorRT >= 10.0), in the order given."""
        engine = self._runner.engine
        debug = getattr(engine, "is_debug_tensor", lambda name: False)
        return [name for name in names if name in self.outputs or debug(name)]

    def _debug_description(self) -> str:
        if self.debug_tensors == UNFUSED:
            return "every unfused tensor"
        return f"{list(self.debug_tensors or [])[:5]}"

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
    'tensorrt' builds an engine from the ONNX file (strongly typed from
    ``model.int8.onnx`` on TensorRT >= 10) for batches of up to `max_batch`
    samples, exposing `debug_tensors` (names, or 'unfused'), or loads a prebuilt
    ``.plan``/``.engine`` file (``model=`` the ONNX file it was built from names its
    tensors). `options` go to the backend's constructor.
    """
    if kind == "onnxruntime":
        from quantlab.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(path_or_model, name=name or "engine_int8", **options)
    if kind != "tensorrt":
        raise ConfigError(f"engine backend '{kind}' is neither 'onnxruntime' nor 'tensorrt'.")
    require_tensorrt()
    if isinstance(path_or_model, onnx.ModelProto):
        raise ConfigError("the TensorRT backend builds from an ONNX file path, not a ModelProto.")
    path = Path(path_or_model)
    if path.suffix.lower() in ENGINE_SUFFIXES:
        return TensorRTBackend(options.pop("model", None), name=name or "tensorrt", engine=path,
                               debug_tensors=debug_tensors, **options)
    return TensorRTBackend(path, name=name or "tensorrt", debug_tensors=debug_tensors,
                           max_batch=max_batch, **options)
