"""Load, export and normalize ONNX graphs; ONNX tensor names are quantlab's identity.

A normalized graph has opset >= 17, inferred shapes, and a unique name on every
node, so statistics, scales, plans and comparisons can all be keyed by names.
"""

from __future__ import annotations

import ast
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from quantlab import metadata
from quantlab.calibration.folding import fold_batchnorms, folded_batchnorms
from quantlab.errors import ConfigError, ModelError
from quantlab.experiments.experiment import atomic_write

MIN_OPSET = 17
EXPORT_OPSET = 18
# Metadata key the torch.export-based ONNX exporter writes on every node: the
# list of torch module paths (outermost first) the node was traced inside.
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
# Model metadata key holding {input name: sample axis} for inputs whose samples are not
# on axis 0 (recurrent state [layers, N, hidden]); written by `set_batch_axes`.
BATCH_AXES_KEY = "quantlab.batch_axes"
# Model metadata key listing the graph inputs frozen to constants by `freeze_inputs`.
FROZEN_INPUTS_KEY = "quantlab.frozen_inputs"
# Model metadata key holding {input name: shape, None on the sample axis} of the data an
# input with other dynamic dimensions was fed (audio length, image size); written by
# `record_data_shapes`, read where a fixed shape is needed (TensorRT's profile).
DATA_SHAPES_KEY = "quantlab.data_shapes"
# Model metadata key holding the file (absolute path) or zoo name a model was first loaded
# from, carried by every normalized copy (a calibration folder's model.onnx): reports are
# titled with the user's model, not with the copy; written by `record_source`.
SOURCE_KEY = "quantlab.source_model"
# sha256 (16 hex digits) of that first model's content (the file's bytes, a zoo export's
# inputs), carried like SOURCE_KEY: two folders hold the same model when it is equal.
DIGEST_KEY = "quantlab.source_digest"
# ONNX ops that hold subgraphs; their bodies are not quantized (see qdq.py).
CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape (None for a dynamic dimension) and numpy dtype of a graph input/output.

    `batch_axis` is the axis that holds the samples (None for an input without
    one, such as a scalar). `batch_size` is that axis's fixed size, None if dynamic.
    """

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype
    batch_axis: int | None = 0

    @property
    def batch_size(self) -> int | None:
        """The fixed number of samples the model takes on this input (None: any)."""
        if self.batch_axis is None or self.batch_axis >= len(self.shape):
            return None
        return self.shape[self.batch_axis]

    @property
    def sample_shape(self) -> tuple[int | None, ...]:
        """The shape of one sample: `shape` without the batch axis."""
        if self.batch_axis is None:
            return self.shape
        return self.shape[: self.batch_axis] + self.shape[self.batch_axis + 1 :]


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


# Protobuf cannot serialize a message of 2 GiB or more: larger models are written with
# their tensors in a side file ``<name>.data`` (ONNX external data) next to the model.
EXTERNAL_DATA_BYTES = 2**31 - (64 << 20)


def save_model(model: onnx.ModelProto, path: str | os.PathLike,
               external_data_bytes: int = EXTERNAL_DATA_BYTES) -> Path:
    """Write `model` atomically (temporary file in the same folder, then one rename).

    A model of `external_data_bytes` or more is written with its tensors in
    ``<file name>.data`` beside it (written first, so the model never names a
    missing file); load it with its folder.
    """
    path = Path(path)
    if model.ByteSize() < external_data_bytes:
        return atomic_write(path, lambda tmp: onnx.save(model, tmp))
    # onnx.save moves the tensors of the proto it is given into the side file: use a copy.
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return atomic_write(path, lambda tmp: onnx.save(
        copy, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
        location=f"{path.name}.data", size_threshold=0))


def normalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy with weights as initializers, opset >= 17, unique node names, inferred shapes,
    and every BatchNormalization that TensorRT would fuse folded into its Conv/Gemm.

    Initializers nothing reads (a folded BatchNormalization's parameters) are dropped.
    Constant nodes that hold tensors (every Paddle export stores its weights that
    way) become initializers, so every later step sees weights in one place.
    Initializers also listed as graph inputs (IR < 4 exporters) leave the inputs: they are
    weights, as TensorRT's parser and every step here take them.
    Declared shapes of intermediate tensors and outputs are dropped and inferred
    again: exporters sometimes declare shapes that do not match what runs. An input
    dimension declared as -1 (Paddle's exports: PP-OCR's ``x`` [-1, 3, ?, ?]) becomes
    symbolic, so no later step reads it as a size.
    """
    model = _fold_constant_nodes(model)
    _symbolic_unknown_dims(model)
    _initializers_apart(model)
    model = _upgrade_opset(model)
    model = _name_nodes(model)
    model = fold_batchnorms(model, node_module_path)
    drop_unused_initializers(model)
    del model.graph.value_info[:]
    declared = {}
    for output in model.graph.output:
        if output.type.HasField("tensor_type"):
            declared[output.name] = onnx.TypeProto()
            declared[output.name].CopyFrom(output.type)
            output.type.tensor_type.ClearField("shape")
    try:
        model = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:  # onnx raises InferenceError for inconsistent graphs
        raise ModelError(f"ONNX shape inference failed: {exc}") from None
    for output in model.graph.output:
        # Where inference finds nothing (outputs of control flow), the declaration stays.
        if output.name in declared and not output.type.tensor_type.HasField("shape"):
            output.type.CopyFrom(declared[output.name])
    return model


def _symbolic_unknown_dims(model: onnx.ModelProto) -> None:
    """Turn the graph inputs' and outputs' negative ``dim_value`` (unknown size) into a
    ``dim_param`` named after the tensor and axis, in place; each gets its own name, so
    shape inference assumes no two of them equal."""
    for value in [*model.graph.input, *model.graph.output]:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value < 0:
                dim.dim_param = f"{value.name}_{axis}"


def _fold_constant_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose top-level tensor-valued Constant nodes are initializers of the same name."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept = []
    for node in copy.graph.node:
        value = _constant_value(node)
        if value is None:
            kept.append(node)
        else:
            value.name = node.output[0]
            copy.graph.initializer.append(value)
    if len(kept) != len(copy.graph.node):
        del copy.graph.node[:]
        copy.graph.node.extend(kept)
    return copy


# The first IR version whose initializers need not be graph inputs.
_IR_INITIALIZERS_APART = 4


def _initializers_apart(model: onnx.ModelProto) -> None:
    """Make, in place, every initializer a constant apart from the graph inputs: drop the
    inputs that name one, and raise IR 3 (which wants each listed there) to 4.

    ONNX Runtime takes an initializer listed as an input for an input the caller may
    override, not a constant: it neither folds nor reorders it and its Conv+Add fusion then
    dropped an exposed Conv output (reliability case G08), and a rewrite of the initializer
    (depthwise equalization's per-channel scale) left the input declaring its old shape.
    Under IR 3 the initializers of folded Constant nodes, not listed, failed the opset
    converter ("Input w is undefined").
    """
    names = {init.name for init in model.graph.initializer}
    kept = [value for value in model.graph.input if value.name not in names]
    if len(kept) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(kept)
    model.ir_version = max(model.ir_version, _IR_INITIALIZERS_APART)


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor of a Constant node (any of its value attributes), None for other nodes."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    (attribute,) = node.attribute
    if attribute.name == "value":
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attribute.t)
        return tensor
    if attribute.name == "sparse_value":
        return None
    value = helper.get_attribute_value(attribute)
    dtype = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
             "value_ints": np.int64}.get(attribute.name)
    if dtype is None:  # value_string(s): not a numeric weight
        return None
    return numpy_helper.from_array(np.asarray(value, dtype=dtype))


def _upgrade_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    opset = opset_version(model)
    if opset >= MIN_OPSET:
        return model
    try:
        upgraded = onnx.version_converter.convert_version(model, MIN_OPSET)
        # Opset 17 needs IR version >= 8; the converter keeps the old one.
        upgraded.ir_version = max(upgraded.ir_version, 8)
        return upgraded
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
    """Graph inputs that are not initializers, with shapes, dtypes and sample axes.

    The sample axis is the one recorded by :func:`set_batch_axes`; otherwise axis 0,
    except for an input whose axis 0 is static while another axis carries the same
    symbolic dimension as the other inputs' axis 0 (recurrent state laid out
    ``[layers, N, hidden]``); a 0-d input has none.
    """
    initializers = {init.name for init in model.graph.initializer}
    values = [v for v in model.graph.input if v.name not in initializers]
    recorded = batch_axes(model)
    plain = [_spec(v) for v in values]
    symbols = [_dim_params(v) for v in values]
    batch_symbols = {dims[0] for dims in symbols if dims and dims[0]}
    dynamic_first = any(spec.shape and spec.shape[0] is None for spec in plain)
    specs = []
    for spec, dims in zip(plain, symbols, strict=True):
        dynamic = [i for i, d in enumerate(spec.shape) if d is None]
        if spec.name in recorded:
            axis = recorded[spec.name]
        elif not spec.shape:
            axis = None
        elif spec.shape[0] is not None and batch_symbols & set(dims[1:]):
            axis = next(i for i, d in enumerate(dims) if d in batch_symbols)
        elif spec.shape[0] is not None and dynamic_first and len(dynamic) == 1:
            # Axis 0 is fixed while the other inputs' sample axis is dynamic: the one
            # dynamic axis holds the samples (silero-vad's state [2, N, 128]).
            axis = dynamic[0]
        else:
            axis = 0
        specs.append(TensorSpec(spec.name, spec.shape, spec.dtype, axis))
    return specs


def _dim_params(value: onnx.ValueInfoProto) -> list[str]:
    return [d.dim_param if d.HasField("dim_param") else ""
            for d in value.type.tensor_type.shape.dim]


def batch_axes(model: onnx.ModelProto) -> dict[str, int | None]:
    """The sample axes recorded in the model's metadata by :func:`set_batch_axes`."""
    return metadata.read(model, BATCH_AXES_KEY, {})


def set_batch_axes(model: onnx.ModelProto, axes: Mapping[str, int | None]) -> onnx.ModelProto:
    """Record the sample axis of some inputs (``{"state": 1}``) in the model, in place.

    The record travels with the model file, so every later command feeds the
    same layout. Raises ConfigError for an unknown input or an axis out of range.
    """
    specs = {spec.name: spec for spec in input_specs(model)}
    merged = batch_axes(model)
    for name, axis in axes.items():
        if name not in specs:
            raise ConfigError(
                f"--batch-axis names input '{name}', which the model does not have; its inputs "
                f"are {sorted(specs)}."
            )
        rank = len(specs[name].shape)
        if axis is not None and not -rank <= axis < rank:
            raise ConfigError(
                f"--batch-axis {name}={axis}: input '{name}' has rank {rank}; the axis must be "
                f"in 0..{rank - 1}."
            )
        merged[name] = None if axis is None else axis % rank
    metadata.write(model, BATCH_AXES_KEY, merged)
    return model


def record_data_shapes(model: onnx.ModelProto, source) -> onnx.ModelProto:
    """Record, in place, the shapes `source` (a BatchSource) feeds the inputs that have
    dynamic dimensions besides their sample axis (silero-vad's audio length, a detector's
    image size).

    Reads one sample only when some input has such dimensions (a batch of 32 640 px
    images was 0.9 s of reading and checking). The record travels with
    the model file, so a later command that needs fixed shapes (TensorRT's optimization
    profile in ``trtexec.txt``, `quantlab build`) takes the ones the model was calibrated on.
    """
    wanted = [spec for spec in input_specs(model)
              if any(d is None for i, d in enumerate(spec.shape) if i != spec.batch_axis)]
    if not wanted:
        return model
    batch = next(iter(source.subset(0, 1)))
    shapes = {spec.name: [None if i == spec.batch_axis else int(d)
                          for i, d in enumerate(np.shape(batch[spec.name]))] for spec in wanted}
    metadata.write(model, DATA_SHAPES_KEY, {**data_shapes(model), **shapes})
    return model


def data_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """The shapes recorded by :func:`record_data_shapes` (None on the sample axis)."""
    return metadata.read(model, DATA_SHAPES_KEY, {})


def record_source(model: onnx.ModelProto, source: str | None, digest: str) -> onnx.ModelProto:
    """Record, in place, the file or zoo name `model` was loaded from (None: a model given
    in memory) and the `digest` of its content, unless a copy of a model already says where
    it came from (a calibration folder's model.onnx)."""
    if source is not None and metadata.read(model, SOURCE_KEY) is None:
        metadata.write(model, SOURCE_KEY, source)
    if metadata.read(model, DIGEST_KEY) is None:
        metadata.write(model, DIGEST_KEY, digest)
    return model


def architecture_digest(model: onnx.ModelProto) -> str:
    """sha256 (16 hex digits) of what a model computes but its weights' values: the ops in
    order, the inputs' and outputs' names and shapes, the initializers' shapes. A retrained
    or re-exported model keeps it; another network does not."""
    import hashlib
    import json

    def specs(values):
        return [(v.name, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
                for v in values]

    parts = [[(n.op_type, n.domain, len(n.input), len(n.output)) for n in model.graph.node],
             specs(model.graph.input), specs(model.graph.output),
             sorted((list(init.dims), init.data_type) for init in model.graph.initializer)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def source_digest(model: onnx.ModelProto) -> str | None:
    """The content digest recorded by :func:`record_source`, None if none was."""
    return metadata.read(model, DIGEST_KEY)


def source_model(model: onnx.ModelProto) -> str | None:
    """The file or zoo name recorded by :func:`record_source`, None if none was."""
    return metadata.read(model, SOURCE_KEY)


def freeze_inputs(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """Replace graph inputs by constants (``sr=16000``) and fold what they decide.

    The inputs become initializers of the given value (cast to the input's type);
    ONNX Script's optimizer then folds the constants and inlines every `If` whose
    condition became constant, so a network hidden in a branch becomes the
    graph. The names of frozen inputs are recorded in the model's metadata.
    """
    already = frozen_inputs(model)
    for name, value in list(values.items()):
        if name in already:
            if not np.array_equal(np.asarray(already[name]), np.asarray(value)):
                raise ConfigError(
                    f"--input {name}={value}: this model was made with input '{name}' frozen "
                    f"to {already[name]}; use the original model to run with another value."
                )
            values = {k: v for k, v in values.items() if k != name}
    if not values:
        return model
    specs = {spec.name: spec for spec in input_specs(model)}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for name, value in values.items():
        if name not in specs:
            raise ConfigError(
                f"--input {name}=...: the model has no input '{name}'; its inputs are "
                f"{sorted(specs)}."
            )
        spec = specs[name]
        array = np.asarray(value)
        if array.shape != spec.shape and (len(array.shape) != len(spec.shape) or any(
                d is not None and d != a for d, a in zip(spec.shape, array.shape, strict=True))):
            raise ConfigError(
                f"--input {name}: the value has shape {array.shape} but input '{name}' has "
                f"shape {spec.shape}. Give a value of that shape (a scalar for a 0-d input)."
            )
        cast = array.astype(spec.dtype)
        if np.issubdtype(spec.dtype, np.integer) and not np.array_equal(cast, array):
            raise ConfigError(
                f"--input {name}: input '{name}' is {spec.dtype}, and {value!r} is not an "
                "integer value."
            )
        copy.graph.initializer.append(numpy_helper.from_array(cast, name))
        kept = [v for v in copy.graph.input if v.name != name]
        del copy.graph.input[:]
        copy.graph.input.extend(kept)
    from onnxscript import optimizer

    try:
        folded = optimizer.optimize(copy, onnx_shape_inference=False)
    except Exception as exc:  # the optimizer raises many types on graphs it cannot fold
        warnings.warn(
            f"could not fold the model after freezing {sorted(values)} ({exc}); the frozen "
            "inputs are constants but control flow they decide was not inlined.", stacklevel=2)
        folded = copy
    frozen = {**frozen_inputs(folded),
              **{name: np.asarray(v).tolist() for name, v in values.items()}}
    metadata.write(folded, FROZEN_INPUTS_KEY, frozen)
    return normalize(folded)


def frozen_inputs(model: onnx.ModelProto) -> dict[str, object]:
    """The inputs :func:`freeze_inputs` turned into constants, with their values."""
    return metadata.read(model, FROZEN_INPUTS_KEY, {})


def outer_scope_names(model: onnx.ModelProto) -> set[str]:
    """Names read inside If/Loop/Scan bodies (at any depth), which may be outer tensors."""
    return {name for node in model.graph.node for name in names_read_inside(node)}


def names_read_inside(node: onnx.NodeProto) -> set[str]:
    """Names read inside the bodies `node` holds (If/Loop/Scan, at any depth): the outer
    tensors among them are inputs of `node` too."""
    names: set[str] = set()
    for body in subgraphs(node):
        for inner in body.node:
            names.update(inner.input)
            names.update(names_read_inside(inner))
    return names


def drop_unused_initializers(model: onnx.ModelProto) -> None:
    """Remove, in place, the initializers that no node reads (at any depth of If/Loop/Scan
    bodies) and that are neither a graph input nor a graph output."""
    g = model.graph
    still_read = {name for node in g.node for name in node.input}
    still_read.update(outer_scope_names(model))
    still_read.update(v.name for v in g.input)
    still_read.update(v.name for v in g.output)
    kept = [init for init in g.initializer if init.name in still_read]
    if len(kept) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(kept)


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The bodies a node holds (If branches, Loop/Scan bodies); empty for other nodes."""
    return [body for a in node.attribute
            for body in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def concrete_types(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]
                   ) -> dict[str, onnx.TypeProto.Tensor] | None:
    """Type and shape of every value of `model` when its inputs have `input_shapes`.

    ONNX shape inference with data propagation on a copy whose inputs have those
    concrete shapes (dynamic H/W and batch resolved), so sizes are the real ones
    rather than guesses. None when inference fails on the graph.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.value_info[:]
    for value in copy.graph.input:
        if value.name in input_shapes:
            shape = value.type.tensor_type.shape
            shape.ClearField("dim")
            for size in input_shapes[value.name]:
                shape.dim.add().dim_value = int(size)
    for output in copy.graph.output:
        output.type.tensor_type.ClearField("shape")
    try:
        copy = shape_inference.infer_shapes(copy, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - onnx raises InferenceError and others on odd graphs
        return None
    values = [*copy.graph.input, *copy.graph.value_info, *copy.graph.output]
    return {v.name: v.type.tensor_type for v in values}


def control_flow_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Top-level If/Loop/Scan nodes, whose bodies quantlab leaves in float."""
    return [node for node in model.graph.node if node.op_type in CONTROL_FLOW_OPS]


def fixed_batch_size(model: onnx.ModelProto) -> int | None:
    """The number of samples per run the model's inputs fix (1 for most exports), or None."""
    sizes = {spec.batch_size for spec in input_specs(model) if spec.batch_axis is not None}
    sizes.discard(None)
    if len(sizes) > 1:
        raise ModelError(
            f"the model's inputs fix different numbers of samples per run {sorted(sizes)}; "
            "pass --batch-axis NAME=AXIS for the inputs whose samples are not on axis 0."
        )
    return sizes.pop() if sizes else None


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


def module_paths(model: onnx.ModelProto) -> dict[str, str]:
    """Node name -> the torch module whose output the node computes, where recorded.

    A Conv with a BatchNormalization folded into it computes the BN module's output, so
    it takes the BN's scope (:mod:`quantlab.calibration.folding`); other nodes their own
    (:func:`node_module_path`).
    """
    folded = {f["node"]: f["scope"] for f in folded_batchnorms(model) if f.get("scope")}
    return {node.name: path for node in model.graph.node
            if (path := folded.get(node.name) or node_module_path(node))}


def node_module_path(node: onnx.NodeProto) -> str | None:
    """The torch module path a node was exported from (``backbone.0.conv``), if recorded.

    The torch.export-based exporter records it in metadata; the TorchScript-based
    one (``dynamo=False``) writes it into the node name, ``/layer1/layer1.0/conv1/Conv``,
    each scope either a child's attribute name or its full dotted path.
    """
    if node.name.startswith("/") and not any(p.key == NAME_SCOPES_KEY
                                             for p in node.metadata_props):
        path = ""
        for scope in node.name.split("/")[1:-1]:
            path = scope if not path or scope.startswith(f"{path}.") else f"{path}.{scope}"
        return path
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES_KEY:
            try:
                scopes = ast.literal_eval(prop.value)
                modules = [s for s in scopes[:-1] if s and isinstance(s, str)]
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                # Metadata is the exporter's; a malformed value maps no module.
                return None
            # The last scope is the aten op itself, the ones before are module paths.
            return modules[-1] if modules else ""
    return None


class Graph:
    """The index of one normalized model, built once at the boundary and passed inward.

    Holds the model and what every step asks of it: producers, consumers,
    non-constant tensors in topological order, float tensors, constants, input and
    output specs, and declared shapes (None for a symbolic dimension). Treat it as
    read-only: a changed model needs a new index.
    """

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.producers = producers(model)
        self.consumers = consumers(model)
        self.constants = constant_tensors(model)
        self.initializers = {init.name for init in model.graph.initializer}
        self.inputs = input_specs(model)
        self.outputs = [output.name for output in model.graph.output]
        self.order = topological_tensors(model)
        self.position = {name: i for i, name in enumerate(self.order)}
        self.floats = float_tensors(model)
        self.values = {v.name: v for v in [*model.graph.value_info, *model.graph.output,
                                            *model.graph.input]}
        self.shapes = {name: _spec(value).shape for name, value in self.values.items()
                       if value.type.tensor_type.HasField("shape")}

    @classmethod
    def of(cls, model: onnx.ModelProto | Graph) -> Graph:
        """The index of `model`; an index is taken as it is (functions accept either)."""
        return model if isinstance(model, Graph) else cls(model)

    @property
    def input_names(self) -> list[str]:
        """Names of the graph inputs (initializers excluded)."""
        return [spec.name for spec in self.inputs]

    def dtype(self, name: str) -> np.dtype | None:
        """The numpy dtype of tensor `name`, None when not inferred."""
        value = self.values.get(name)
        if value is None or not value.type.tensor_type.elem_type:
            return None
        return np.dtype(helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))

    def tensor_info(self):
        """Per non-constant tensor: producing node, its op type and torch module path ('' if none).

        A pandas DataFrame indexed by tensor name (columns tensor, node, op_type,
        torch_module), the descriptive columns of every comparison table.
        """
        import pandas as pd

        rows = []
        paths = module_paths(self.model)
        for name in self.order:
            node = self.producers.get(name)
            rows.append({
                "tensor": name,
                "node": node.name if node is not None else "(graph input)",
                "op_type": node.op_type if node is not None else "",
                "torch_module": paths.get(node.name, "") if node is not None else "",
            })
        return pd.DataFrame(rows, columns=["tensor", "node", "op_type", "torch_module"]).set_index(
            "tensor", drop=False)

    def common_tensors(self, other: Graph) -> list[str]:
        """Float tensors of this graph (topological order) that `other` also computes, by name.

        Raises ModelError when the graph outputs of the two models differ by name,
        since then not even the end-to-end results can be compared.
        """
        if self.outputs != other.outputs:
            raise ModelError(
                f"the models' outputs do not match by name: the reference has {self.outputs}, "
                f"the test model has {other.outputs} (missing from the test model: "
                f"{sorted(set(self.outputs) - set(other.outputs))}). Both must come from the "
                "same ONNX export; quantize the FP32 model you pass as reference."
            )
        present = set(other.order) | set(other.outputs)
        return [t for t in self.order if t in present and t in self.floats]

    def upstream(self, compared: Sequence[str]) -> dict[str, list[str]]:
        """For each compared tensor, the nearest compared tensors (or graph inputs) feeding it.

        Walks back through tensors that are not compared (e.g. unmapped in torch) so a
        tensor's error can be judged against the error already present at its inputs.
        """
        keep = set(compared) | set(self.input_names)
        memo: dict[str, frozenset[str]] = {}

        def nearest(tensor: str) -> frozenset[str]:
            # Iterative over the producing chain so deep graphs cannot exhaust the recursion limit.
            stack = [tensor]
            while stack:
                name = stack[-1]
                if name in memo:
                    stack.pop()
                    continue
                node = self.producers.get(name)
                parents = [i for i in node.input if i and i not in self.constants] if node else []
                pending = [p for p in parents if p not in keep and p not in memo]
                if pending:
                    stack.extend(pending)
                    continue
                found: set[str] = set()
                for parent in parents:
                    found |= {parent} if parent in keep else memo[parent]
                memo[name] = frozenset(found)
                stack.pop()
            return memo[tensor]

        return {t: sorted(nearest(t)) for t in compared}

    def sample_bytes(self, input_shapes: Mapping[str, Sequence[int]],
                     unknown_dim: int = 256) -> dict[str, int]:
        """Bytes of every non-constant tensor for the inputs of shape `input_shapes`.

        Shapes are inferred again on the model with those concrete input shapes
        (ONNX shape inference with data propagation), so the sizes are the real
        ones rather than guesses; a dimension still unknown (a data-dependent
        count such as NMS's) counts `unknown_dim`.
        """
        types = concrete_types(self.model, input_shapes) or {
            v.name: v.type.tensor_type
            for v in [*self.model.graph.input, *self.model.graph.value_info,
                      *self.model.graph.output]}
        sizes = {}
        for name, tensor_type in types.items():
            if not tensor_type.elem_type or name not in self.position:
                continue
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).itemsize
            dims = [d.dim_value if d.HasField("dim_value") else unknown_dim
                    for d in tensor_type.shape.dim]
            sizes[name] = itemsize * int(np.prod(dims, dtype=np.int64))
        return {name: sizes.get(name, 4 * unknown_dim) for name in self.order}

    def samples_within(self, input_shapes: Mapping[str, Sequence[int]], budget: int,
                       tensors: Sequence[str] | None = None) -> int:
        """How many samples of one sample's `input_shapes` keep `tensors` (default: every
        tensor, :meth:`sample_bytes`) within `budget` bytes; one at least."""
        sizes = self.sample_bytes(input_shapes)
        per_sample = sum(sizes.get(name, 0) for name in (sizes if tensors is None else tensors))
        return int(max(1, budget // max(1, per_sample)))
