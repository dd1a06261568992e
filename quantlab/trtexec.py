"""trtexec command lines that build (and inspect) the engines of a calibration folder.

Flags as trtexec parses them (samples/common/sampleOptions.cpp of TensorRT
10.16 and 11.1, docs/tensorrt.md): ``--stronglyTyped`` (10.x; a deprecated
no-op in 11.x, where every network is strongly typed), ``--int8``,
``--fp16``, ``--calib=FILE``, ``--precisionConstraints=obey``,
``--layerPrecisions`` and ``--layerOutputTypes=name:precision,...`` (10.x and
older; removed in 11.0),
``--minShapes/--optShapes/--maxShapes=name:AxBxC,...``,
``--profilingVerbosity=detailed --exportLayerInfo=FILE`` (both).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

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
    arguments += shape_options(profile or {})
    arguments.append(f"--saveEngine={engine}")
    if layer_info:
        arguments += ["--profilingVerbosity=detailed", f"--exportLayerInfo={layer_info}"]
    return _line(arguments)


def implicit_command(fp32_model: str | Path, calibration_cache: str | Path, engine: str | Path,
                     plan: Mapping[str, str] | None = None,
                     profile: Mapping[str, Sequence[Sequence[int]]] | None = None,
                     layer_info: str | Path | None = None) -> str:
    """trtexec building the implicit INT8 engine of the FP32 model from the calibration cache,
    with the plan's fp32/fp16 layers' precision and output types pinned and obeyed
    (TensorRT <= 10.x)."""
    pins = layer_precisions(plan or {})
    arguments = ["trtexec", f"--onnx={fp32_model}", "--int8"]
    if "fp16" in {str(p).lower() for p in (plan or {}).values()}:
        arguments.append("--fp16")
    arguments.append(f"--calib={calibration_cache}")
    if pins:
        # Output types too: otherwise a pinned layer may still write INT8 for an INT8 reader,
        # and its output is quantized after all (one type applies to every output of a layer).
        arguments += ["--precisionConstraints=obey", f"--layerPrecisions={pins}",
                      f"--layerOutputTypes={pins}"]
    arguments += shape_options(profile or {})
    arguments.append(f"--saveEngine={engine}")
    if layer_info:
        arguments += ["--profilingVerbosity=detailed", f"--exportLayerInfo={layer_info}"]
    return _line(arguments)


def trtexec_text(plan: Mapping[str, str] | None = None,
                 profile: Mapping[str, Sequence[Sequence[int]]] | None = None,
                 cache_name: str | None = "calibration.cache",
                 cache_header: str | None = None) -> str:
    """The content of ``trtexec.txt``: the commands for TensorRT 10.x / 11.x (strongly typed)
    and <= 10.x (implicit INT8 from `cache_name`; None: the folder has no cache, and a
    comment says how to get one), with paths relative to the calibration folder they are
    run in."""
    pins = layer_precisions(plan or {})
    lines = [
        "# trtexec commands that build this folder's engine; run them inside this folder.",
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
                 + (", the plan's fp32/fp16 layers obeyed" if pins else ""))
    if cache_header:
        lines.append(f"# ({cache_name} is {cache_header}: TensorRT uses it only if it is that "
                     "version; another version recalibrates on trtexec's random data)")
    lines.append(implicit_command("model.onnx", cache_name, "model.implicit.plan", plan, profile,
                                  "layers.implicit.json"))
    return "\n".join(lines) + "\n"
