"""Load, export and normalize ONNX graphs; ONNX tensor names are quantlab's identity.

A normalized graph has opset >= 17, inferred shapes, and a unique name on every
node, so statistics, scales, plans and comparisons can all be keyed by names.
"""

from __future__ import annotations

import ast
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from quantlab.errors import ModelError
from quantlab.experiment import atomic_write

MIN_OPSET = 17
EXPORT_OPSET = 18
# Metadata key the torch.export-based ONNX exporter writes on every node: the
# list of torch module paths (outermost first) the node was traced inside.
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape (None for a dynamic dimension) and numpy dtype of a graph input/output."""

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX file, check it and return it normalized."""
    path = Path(path)
    if not path.exists():
        raise ModelError(
            f"model file {path} does not exist. Pass the path of an .onnx file or the name "
            "of a zoo model (`quantlab zoo` lists them)."
        )
    if path.is_dir():
        raise ModelError(f"model path {path} is a folder; pass the .onnx file inside it.")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # onnx raises DecodeError, ValueError or OSError here
        raise ModelError(
            f"{path} is not a readable ONNX model ({type(exc).__name__}: {exc}). "
            "Check that the file is an ONNX protobuf (export it with torch.onnx.export) "
            "and that it was copied completely."
        ) from None
    if not model.graph.node:
        raise ModelError(
            f"{path} parsed as ONNX but has no graph nodes; it is empty or not an ONNX model."
        )
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise ModelError(f"{path} is not a valid ONNX model: {first_line}") from None
    return normalize(model)


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Write `model` atomically (temporary file in the same folder, then one rename)."""
    return atomic_write(path, lambda tmp: onnx.save(model, tmp))


def normalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy with opset >= 17, unique node names and inferred shapes."""
    model = _upgrade_opset(model)
    model = _name_nodes(model)
    try:
        model = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:  # onnx raises InferenceError for inconsistent graphs
        raise ModelError(f"ONNX shape inference failed: {exc}") from None
    return model


def _upgrade_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    opset = opset_version(model)
    if opset >= MIN_OPSET:
        return model
    try:
        return onnx.version_converter.convert_version(model, MIN_OPSET)
    except Exception as exc:  # the converter raises RuntimeError / ConvertError
        raise ModelError(
            f"the model uses ONNX opset {opset} and could not be converted to opset "
            f"{MIN_OPSET} ({exc}). Re-export it with opset_version >= {MIN_OPSET}."
        ) from None


def _name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    seen: set[str] = set()
    for index, node in enumerate(model_copy.graph.node):
        name = node.name or f"{node.op_type}_{index}"
        while name in seen:
            name = f"{name}_{index}"
        node.name = name
        seen.add(name)
    return model_copy


def opset_version(model: onnx.ModelProto) -> int:
    """The default-domain opset the model imports."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


def export_torch(
    module,
    sample: np.ndarray | Sequence[np.ndarray],
    path: str | os.PathLike,
    input_names: Sequence[str] = ("input",),
    output_names: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """Export a torch module to a normalized ONNX file with a dynamic batch axis.

    Uses the torch.export-based exporter at opset 18, whose per-node name-scope
    metadata ties each ONNX node to the torch module that produced it.
    """
    import torch

    samples = [sample] if isinstance(sample, np.ndarray) else list(sample)
    args = tuple(torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)) for s in samples)
    module = module.eval()
    dynamic_shapes = tuple({0: torch.export.Dim("batch", min=1, max=4096)} for _ in args)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=EXPORT_OPSET,
            input_names=list(input_names),
            output_names=list(output_names) if output_names else None,
            dynamic_shapes=dynamic_shapes,
            verbose=False,
        )
    model = normalize(program.model_proto)
    save_model(model, path)
    return model


def input_specs(model: onnx.ModelProto) -> list[TensorSpec]:
    """Graph inputs that are not initializers, with shapes and dtypes."""
    initializers = {init.name for init in model.graph.initializer}
    return [_spec(v) for v in model.graph.input if v.name not in initializers]


def output_specs(model: onnx.ModelProto) -> list[TensorSpec]:
    """Graph outputs with shapes and dtypes."""
    return [_spec(v) for v in model.graph.output]


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    tensor_type = value.type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim)
    return TensorSpec(value.name, shape, helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """All initializers as numpy arrays, keyed by name."""
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def constant_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of tensors whose value is fixed: initializers and Constant-node outputs."""
    names = {init.name for init in model.graph.initializer}
    names.update(
        out for node in model.graph.node if node.op_type == "Constant" for out in node.output
    )
    return names


def topological_tensors(model: onnx.ModelProto) -> list[str]:
    """Non-constant tensors in topological order: graph inputs, then each node's outputs."""
    constants = constant_tensors(model)
    names = [spec.name for spec in input_specs(model)]
    for node in model.graph.node:
        names.extend(out for out in node.output if out and out not in constants)
    return names


def float_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of tensors whose inferred element type is float32."""
    values = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    return {v.name for v in values if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """Map tensor name -> node that produces it."""
    return {out: node for node in model.graph.node for out in node.output if out}


def consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """Map tensor name -> nodes that read it."""
    result: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            if name:
                result.setdefault(name, []).append(node)
    return result


def node_module_path(node: onnx.NodeProto) -> str | None:
    """The torch module path a node was exported from (``backbone.0.conv``), if recorded."""
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES_KEY:
            scopes = ast.literal_eval(prop.value)
            # The last scope is the aten op itself, the ones before are module paths.
            modules = [s for s in scopes[:-1] if s]
            return modules[-1] if modules else ""
    return None
