"""PyTorch backend: runs the original module and maps its module outputs onto ONNX tensor names.

The export records, on every ONNX node, the torch module it was traced inside
(``graph.node_module_path``). A module call's output is the ONNX tensor that
leaves the module's scope: produced by a node inside it and read outside it (or
a graph output). A module called several times (ResNet's shared ReLU) owns one
contiguous run of nodes per call, in execution order, because the exporter
traces the forward pass in order. One probe forward pass on a one-sample batch
at construction records how often each module runs and the structure of its
outputs, so the mapping and the list of unmapped tensors are known up front.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from quantlab import graph
from quantlab.data import check_batch
from quantlab.errors import ConfigError, ModelError


@dataclass(frozen=True)
class ModuleOutput:
    """An ONNX tensor's torch origin: flattened output `index` of call `call` of `module`."""

    module: str
    call: int
    index: int


def flatten_tensors(value) -> list:
    """The tensors of a module output, flattened: tuples/lists in order, dicts in key order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flatten_tensors(item)]
    return []


class TorchBackend:
    """Run a torch module; return module outputs under the ONNX tensor names they map to.

    ``mapping`` maps ONNX tensor -> :class:`ModuleOutput`; ``unmapped`` lists the
    float tensors of the ONNX graph (topological order) with no torch module
    output, e.g. a residual Add written inline in a ``forward``;
    ``unmapped_modules`` lists module calls with no ONNX counterpart (a Conv whose
    BatchNorm was folded into it, a Dropout) and why.
    """

    def __init__(self, module, onnx_model: onnx.ModelProto, name: str = "torch",
                 sample: Mapping[str, np.ndarray] | None = None):
        self.module = module.eval()
        self.model = onnx_model
        self.name = name
        self.inputs = graph.input_specs(onnx_model)
        self.outputs = [spec.name for spec in graph.output_specs(onnx_model)]
        self._shapes = _inferred_shapes(onnx_model)
        calls = self._probe(sample or self._probe_sample())
        self.mapping, self.unmapped_modules = self._map(calls)
        for spec in self.inputs:
            self.mapping.pop(spec.name, None)
        floats = graph.float_tensors(onnx_model)
        self.unmapped = [t for t in graph.topological_tensors(onnx_model)
                         if t in floats and t not in self.mapping
                         and t not in {s.name for s in self.inputs}]

    def _probe_sample(self) -> dict[str, np.ndarray]:
        sample = {}
        for spec in self.inputs:
            if any(d is None for d in spec.shape[1:]):
                raise ConfigError(
                    f"ONNX input '{spec.name}' has dynamic dimensions {spec.shape}; the torch "
                    "backend needs one sample to map module outputs. Pass `sample=` (a batch "
                    "dict) to TorchBackend."
                )
            sample[spec.name] = np.zeros((1, *spec.shape[1:]), dtype=spec.dtype)
        return sample

    def _forward(self, batch: Mapping[str, np.ndarray]):
        import torch

        args = [torch.from_numpy(np.array(batch[s.name], dtype=s.dtype))  # writable copy
                for s in self.inputs]
        with torch.no_grad():
            return self.module(*args)

    def _probe(self, sample: Mapping[str, np.ndarray]) -> dict[str, list[list[tuple]]]:
        """Module path -> per call, the shapes of its flattened output tensors."""
        calls: dict[str, list[list[tuple]]] = {}

        def record(path):
            def hook(_module, _args, output):
                calls.setdefault(path, []).append(
                    [tuple(t.shape) for t in flatten_tensors(output)])
            return hook

        handles = [m.register_forward_hook(record(path))
                   for path, m in self.module.named_modules()]
        try:
            self._forward(sample)
        finally:
            for handle in handles:
                handle.remove()
        return calls

    def _map(self, calls: dict[str, list[list[tuple]]]
             ) -> tuple[dict[str, ModuleOutput], dict[str, str]]:
        runs = _scope_runs(self.model)
        mapping: dict[str, ModuleOutput] = {}
        unmapped_modules: dict[str, str] = {}
        # Outer modules first: a tensor leaving several nested scopes is taken from the
        # outermost, which runs once more often than a shared inner module (fewer ambiguities).
        for path in sorted(calls, key=lambda p: (p.count(".") if p else -1, p)):
            if path == "":
                leaving = [self.outputs]
            else:
                leaving = runs.get(path, [])
            if len(leaving) != len(calls[path]):
                unmapped_modules[path] = (
                    f"runs {len(calls[path])} time(s) in torch but {len(leaving)} node group(s) "
                    "carry its scope in the ONNX graph")
                continue
            for call, (shapes, candidates) in enumerate(zip(calls[path], leaving, strict=True)):
                assigned = self._match(shapes, candidates, strict_order=path == "")
                if assigned is None:
                    unmapped_modules[f"{path}#{call}"] = (
                        f"its {len(shapes)} output tensor(s) cannot be matched one-to-one with "
                        f"the tensors leaving its scope {candidates[:4]}")
                    continue
                for index, tensor in assigned.items():
                    mapping.setdefault(tensor, ModuleOutput(path, call, index))
        return mapping, unmapped_modules

    def _match(self, shapes: list[tuple], candidates: list[str], strict_order: bool
               ) -> dict[int, str] | None:
        """Output index -> ONNX tensor, pairing by shape; None when ambiguous."""
        if strict_order:
            ok = len(shapes) == len(candidates) and all(
                self._fits(s, c) for s, c in zip(shapes, candidates, strict=True))
            return dict(enumerate(candidates)) if ok else None
        if len(shapes) == 1:
            # A single-tensor module output is the last tensor leaving the scope that fits.
            fitting = [c for c in candidates if self._fits(shapes[0], c)]
            return {0: fitting[-1]} if fitting else None
        assigned: dict[int, str] = {}
        for index, shape in enumerate(shapes):
            fitting = [c for c in candidates if self._fits(shape, c)]
            if len(fitting) != 1 or fitting[0] in assigned.values():
                return None
            assigned[index] = fitting[0]
        return assigned

    def _fits(self, shape: tuple, tensor: str) -> bool:
        expected = self._shapes.get(tensor)
        if expected is None:
            return False
        return len(expected) == len(shape) and all(
            e is None or e == s for e, s in zip(expected[1:], shape[1:], strict=True))

    def run(self, batch: Mapping[str, np.ndarray], tensors: Sequence[str] | None = None
            ) -> dict[str, np.ndarray]:
        """Run one batch; return the requested ONNX tensors (default: graph outputs)."""
        check_batch(batch, self.inputs)
        wanted = list(tensors) if tensors is not None else list(self.outputs)
        input_names = {spec.name for spec in self.inputs}
        missing = [t for t in wanted if t not in self.mapping and t not in input_names]
        if missing:
            raise ModelError(
                f"tensor(s) {missing[:5]} have no torch module output mapped to them; request "
                "only tensors in TorchBackend.mapping (the unmapped ones are listed in "
                "TorchBackend.unmapped)."
            )
        by_call: dict[tuple[str, int], dict[int, str]] = {}
        for tensor in wanted:
            if tensor not in input_names:
                where = self.mapping[tensor]
                by_call.setdefault((where.module, where.call), {})[where.index] = tensor
        captured: dict[str, np.ndarray] = {}
        counts: dict[str, int] = {}

        def capture(path):
            def hook(_module, _args, output):
                call = counts.get(path, 0)
                counts[path] = call + 1
                indices = by_call.get((path, call))
                if indices:
                    # Copy now: a later in-place op (ReLU(inplace=True)) may overwrite it.
                    flat = flatten_tensors(output)
                    for index, tensor in indices.items():
                        captured[tensor] = flat[index].detach().cpu().numpy().copy()
            return hook

        modules = dict(self.module.named_modules())
        paths = {path for path, _ in by_call}
        handles = [modules[p].register_forward_hook(capture(p)) for p in paths]
        try:
            self._forward(batch)
        finally:
            for handle in handles:
                handle.remove()
        for name in input_names & set(wanted):
            captured[name] = np.asarray(batch[name])
        return {t: captured[t] for t in wanted}


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    values = list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input)
    return {
        v.name: tuple(d.dim_value if d.HasField("dim_value") else None
                      for d in v.type.tensor_type.shape.dim)
        for v in values if v.type.tensor_type.HasField("shape")
    }


def _scope_runs(model: onnx.ModelProto) -> dict[str, list[list[str]]]:
    """Module path -> per call (node run), the float tensors leaving that run, in graph order.

    A run is a maximal sequence of scoped nodes (in graph order) inside the module;
    nodes without scope metadata neither belong to nor interrupt a run.
    """
    consumers = graph.consumers(model)
    graph_outputs = {o.name for o in model.graph.output}
    floats = graph.float_tensors(model)
    paths = graph.module_paths(model)
    scoped = [(node, paths[node.name]) for node in model.graph.node if node.name in paths]
    members: dict[str, list[int]] = {}
    for position, (_, path) in enumerate(scoped):
        parts = path.split(".")
        for depth in range(1, len(parts) + 1):
            members.setdefault(".".join(parts[:depth]), []).append(position)
    runs: dict[str, list[list[str]]] = {}
    for path, positions in members.items():
        splits = np.flatnonzero(np.diff(positions) > 1) + 1
        for group in np.split(np.asarray(positions), splits):
            nodes = [scoped[p][0] for p in group]
            names = {n.name for n in nodes}
            leaving = [
                out for node in nodes for out in node.output
                if out in floats and (out in graph_outputs or any(
                    c.name not in names for c in consumers.get(out, [])))
            ]
            runs.setdefault(path, []).append(leaving)
    return runs
