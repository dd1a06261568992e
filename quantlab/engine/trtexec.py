"""trtexec command lines that build (and inspect) the engines of a calibration folder.

Flags as trtexec parses them (samples/common/sampleOptions.cpp of TensorRT
8.6, 10.16 and 11.1, docs/tensorrt.md): ``--stronglyTyped`` (9.0 - 10.x; a
deprecated no-op in 11.x, where every network is strongly typed), ``--int8``,
``--fp16``, ``--calib=FILE``, ``--precisionConstraints=obey``,
``--layerPrecisions`` and ``--layerOutputTypes=name:precision,...`` (10.x and
older; removed in 11.0),
``--minShapes/--optShapes/--maxShapes=name:AxBxC,...``,
``--profilingVerbosity=detailed --exportLayerInfo=FILE`` (all). A Q/DQ model
given ``--int8`` is built with explicit quantization: trtexec attaches its
random calibrator whenever ``--int8`` is set (sampleEngines.cpp 8.6 L1009-1081,
10.16 L1102-1181) and TensorRT ignores it on a network with Q/DQ layers
("Calibrator won't be used in explicit precision mode", TensorRT#1837).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from quantlab.engine.backends.tensorrt import LayerPins
from quantlab.errors import ConfigError

# trtexec's --layerPrecisions precisions (stringToValue<DataType> in sampleOptions.cpp).
LAYER_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8", "int32", "int64", "bool", "uint8",
                    "int4")


def _check_name(name: str, option: str) -> None:
    # trtexec splits the option's value at ',' before anything else and reads a quote as the
    # start of a 'quoted':name, so neither can be part of a name.
    if "," in name or "'" in name or not name:
        raise ConfigError(
            f"name {name!r} cannot be written in trtexec's {option} (it splits the list at ',' "
            "and reads ' as quoting); rename the node or tensor in the model."
        )


def layer_precisions(plan: Mapping[str, str]) -> str:
    """The value of ``--layerPrecisions`` for the layers `plan` pins out of INT8.

    `plan` maps ONNX node names (the layer names TensorRT's ONNX parser gives)
    to precisions; INT8 nodes are left to TensorRT (they run INT8 where the
    cache gives their tensors a range), so only fp32/fp16 pins are written, in
    plan order: ``conv1:fp32,/head/Concat:fp16``. trtexec splits each entry at
    its last ':' so names may hold ':'.
    """
    entries = []
    for node, precision in plan.items():
        value = str(precision).lower()
        if value not in LAYER_PRECISIONS:
            raise ConfigError(f"node '{node}' has precision '{precision}', which trtexec's "
                              f"--layerPrecisions does not take ({', '.join(LAYER_PRECISIONS)}).")
        if value == "int8":
            continue
        _check_name(node, "--layerPrecisions")
        entries.append(f"{node}:{value}")
    return ",".join(entries)


def shape_options(profile: Mapping[str, Sequence[Sequence[int]]]) -> list[str]:
    """``--minShapes/--optShapes/--maxShapes`` for the inputs of `profile`, which must be the
    model's dynamic ones (trtexec refuses shapes for a static input, and sets a dynamic
    dimension it is not given to 1: an audio length or image size of 1)."""
    dynamic = dict(profile)
    if not dynamic:
        return []
    for name in dynamic:
        _check_name(name, "--minShapes")
    options = []
    for flag, which in (("--minShapes", 0), ("--optShapes", 1), ("--maxShapes", 2)):
        value = ",".join(f"{name}:{'x'.join(str(d) for d in shapes[which])}"
                         for name, shapes in dynamic.items())
        options.append(f"{flag}={value}")
    return options


def _line(arguments: Sequence[str]) -> str:
    return " ".join(shlex.quote(argument) for argument in arguments)


def strongly_typed_command(qdq_model: str | Path, engine: str | Path,
                           profile: Mapping[str, Sequence[Sequence[int]]] | None = None,
                           layer_info: str | Path | None = None,
                           trt_major: int = 10) -> str:
    """trtexec building the strongly typed engine of the Q/DQ model (TensorRT 10.x, 11.x)."""
    arguments = ["trtexec", f"--onnx={qdq_model}"]
    if trt_major < 11:
        arguments.append("--stronglyTyped")  # opt-in in 10.x; always on (a no-op flag) in 11.x
    return _line(arguments + _tail(profile, engine, layer_info))


def explicit_command(qdq_model: str | Path, engine: str | Path, pins: LayerPins | None = None,
                     profile: Mapping[str, Sequence[Sequence[int]]] | None = None,
                     layer_info: str | Path | None = None) -> str:
    """trtexec building the Q/DQ model weakly typed with INT8 on (TensorRT 8.6 - 10.x): explicit
    quantization, no calibration; with `pins`
    (:func:`quantlab.engine.backends.tensorrt.explicit_pins`, a model with float16 parts) ``--fp16``
    and every layer pinned to its model type (r2 N10)."""
    pins = pins or LayerPins()
    arguments = ["trtexec", f"--onnx={qdq_model}", "--int8"] + (["--fp16"] if pins.fp16 else [])
    return _line(arguments + _pin_arguments(pins) + _tail(profile, engine, layer_info))


def implicit_command(fp32_model: str | Path, calibration_cache: str | Path, engine: str | Path,
                     pins: LayerPins | None = None,
                     profile: Mapping[str, Sequence[Sequence[int]]] | None = None,
                     layer_info: str | Path | None = None) -> str:
    """trtexec building the implicit INT8 engine of the FP32 model from the calibration cache,
    with the layers `pins` (:func:`quantlab.engine.backends.tensorrt.implicit_pins`) pinned and
    obeyed (TensorRT <= 10.x)."""
    pins = pins or LayerPins()
    arguments = ["trtexec", f"--onnx={fp32_model}", "--int8"]
    if pins.fp16:
        arguments.append("--fp16")
    arguments.append(f"--calib={calibration_cache}")
    return _line(arguments + _pin_arguments(pins) + _tail(profile, engine, layer_info))


def _pin_arguments(pins: LayerPins) -> list[str]:
    arguments = []
    if pins.precisions:
        # Output types too: otherwise a pinned layer may still write INT8 for an INT8 reader,
        # and its output is quantized after all (one type applies to every output of a layer).
        arguments += ["--precisionConstraints=obey",
                      f"--layerPrecisions={layer_precisions(pins.precisions)}"]
    if pins.output_types:
        arguments.append(f"--layerOutputTypes={layer_precisions(pins.output_types)}")
    return arguments


def _tail(profile, engine, layer_info) -> list[str]:
    arguments = shape_options(profile or {}) + [f"--saveEngine={engine}"]
    if layer_info:
        arguments += ["--profilingVerbosity=detailed", f"--exportLayerInfo={layer_info}"]
    return arguments


def trtexec_text(pins: LayerPins | None = None,
                 profile: Mapping[str, Sequence[Sequence[int]]] | None = None,
                 cache_name: str | None = "calibration.cache",
                 cache_header: str | None = None,
                 qdq_pins: LayerPins | None = None) -> str:
    """The content of ``trtexec.txt``: the commands for TensorRT 8.6 - 10.x (explicit Q/DQ),
    10.x / 11.x (strongly typed) and <= 10.x (implicit INT8 from `cache_name` with `pins`;
    None: the folder has no cache, and a comment says how to get one), with paths relative
    to the calibration folder they are run in. `qdq_pins`: the explicit build's pins where
    model.int8.onnx has float16 parts (:func:`quantlab.engine.backends.tensorrt.explicit_pins`)."""
    pins = pins or LayerPins()
    lines = [
        "# trtexec commands that build this folder's engine; run them inside this folder.",
        "# TensorRT 8.6 - 10.x: the Q/DQ model with INT8 on, weakly typed (explicit "
        "quantization: trtexec does not calibrate a network with Q/DQ layers)",
        explicit_command("model.int8.onnx", "model.plan", qdq_pins, profile, "layers.json"),
        "# TensorRT 10.x: strongly typed from the Q/DQ model (precisions from Q/DQ and types)",
        strongly_typed_command("model.int8.onnx", "model.plan", profile, "layers.json", 10),
        "# TensorRT 11.x: every network is strongly typed (--stronglyTyped is a no-op there)",
        strongly_typed_command("model.int8.onnx", "model.plan", profile, "layers.json", 11),
    ]
    if cache_name is None:
        lines.append("# TensorRT <= 10.x implicit INT8 needs a calibration cache, which this "
                     "folder has not: write one with --trt-version X.Y.Z "
                     "(quantlab calibrate or plan)")
        return "\n".join(lines) + "\n"
    lines.append("# TensorRT <= 10.x: implicit INT8 from the FP32 model and the calibration cache"
                 + (", the plan's fp32/fp16 layers obeyed" if pins.precisions else ""))
    if pins.fp16:
        lines.append("# (--fp16 lets TensorRT run any unconstrained layer in FP16: every float "
                     "layer the Q/DQ model keeps in FP32 is pinned fp32; layers the ONNX parser "
                     "leaves unnamed, such as a Gemm's bias add, cannot be named here)")
    if cache_header:
        # trtexec's calibrator allocates no input when the cache file exists
        # (RndInt8Calibrator, sampleEngines.cpp): a cache TensorRT rejects is not recalibrated,
        # the build fails (TensorRT#3430, DLA-SW#26).
        lines.append(f"# ({cache_name} is {cache_header}: trtexec builds from it only on that "
                     "TensorRT version; on another one it rejects the cache and the build fails)")
    lines.append(implicit_command("model.onnx", cache_name, "model.implicit.plan", pins, profile,
                                  "layers.implicit.json"))
    return "\n".join(lines) + "\n"
