"""Per-tensor error metrics between two runs, streamed over batches; first divergence.

Everything here works on ``{tensor_name: array}`` dicts and never knows which
backend produced them (Polygraphy's comparator design). Sums are accumulated in
float64, so the metrics over N batches equal the metrics over their
concatenation up to float64 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import onnx
import pandas as pd

from quantlab import graph
from quantlab.errors import ModelError

METRICS = ("cosine", "sqnr_db", "rel_l2", "max_abs", "frac_outside")
TABLE_COLUMNS = ("tensor", "node", "op_type", "torch_module", *METRICS)


class TensorError:
    """Streaming error statistics of one tensor pair (reference vs test).

    `update` accumulates float64 sums; the properties decide the metrics. An
    element is *outside* the tolerance when ``|test - ref| > atol + rtol * |ref|``
    (the ``numpy.isclose`` rule).
    """

    def __init__(self, atol: float = 1e-3, rtol: float = 1e-3):
        self.atol, self.rtol = atol, rtol
        self.count = 0
        self.sum_ref2 = 0.0
        self.sum_test2 = 0.0
        self.sum_dot = 0.0
        self.sum_err2 = 0.0
        self.max_abs = 0.0
        self.outside = 0

    def update(self, ref: np.ndarray, test: np.ndarray) -> None:
        """Add one batch of a tensor (arrays of equal shape)."""
        ref = np.asarray(ref, dtype=np.float64).ravel()
        test = np.asarray(test, dtype=np.float64).ravel()
        err = test - ref
        self.count += ref.size
        self.sum_ref2 += float(ref @ ref)
        self.sum_test2 += float(test @ test)
        self.sum_dot += float(ref @ test)
        self.sum_err2 += float(err @ err)
        if err.size:
            abs_err = np.abs(err)
            self.max_abs = max(self.max_abs, float(abs_err.max()))
            self.outside += int(np.count_nonzero(abs_err > self.atol + self.rtol * np.abs(ref)))

    @property
    def cosine(self) -> float:
        """Cosine similarity; exactly 1 for identical tensors (also all-zero), 0 if one is zero."""
        if self.sum_err2 == 0.0:
            return 1.0
        norms = math.sqrt(self.sum_ref2) * math.sqrt(self.sum_test2)
        if norms == 0.0:
            return 0.0
        # sqrt rounding can push |dot| / norms one ulp past 1.
        return min(1.0, max(-1.0, self.sum_dot / norms))

    @property
    def sqnr_db(self) -> float:
        """10 log10(sum ref^2 / sum (ref - test)^2); +inf for identical tensors."""
        if self.sum_err2 == 0.0:
            return math.inf
        if self.sum_ref2 == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.sum_ref2 / self.sum_err2)

    @property
    def rel_l2(self) -> float:
        """||test - ref|| / ||ref||; 0 when identical, +inf when only ref is all-zero."""
        if self.sum_err2 == 0.0:
            return 0.0
        if self.sum_ref2 == 0.0:
            return math.inf
        return math.sqrt(self.sum_err2 / self.sum_ref2)

    @property
    def frac_outside(self) -> float:
        """Fraction of elements outside atol + rtol * |ref|."""
        return self.outside / self.count if self.count else 0.0

    def metrics(self) -> dict[str, float]:
        """The five metrics as a dict (keys in :data:`METRICS`)."""
        return {name: getattr(self, name) for name in METRICS}


class Comparison:
    """Compare two runs tensor by tensor, batch after batch, keeping only sums in memory."""

    def __init__(self, tensors: Sequence[str], reference: str = "reference", test: str = "test",
                 atol: float = 1e-3, rtol: float = 1e-3):
        self.tensors = list(tensors)
        self.reference, self.test = reference, test
        self.errors = {name: TensorError(atol, rtol) for name in self.tensors}

    def update(self, reference: Mapping[str, np.ndarray], test: Mapping[str, np.ndarray]) -> None:
        """Add one batch: both dicts must hold every compared tensor, with equal shapes."""
        for side, values in ((self.reference, reference), (self.test, test)):
            missing = [t for t in self.tensors if t not in values]
            if missing:
                raise ModelError(
                    f"the '{side}' run has no tensor(s) {missing[:5]} to compare; compare only "
                    "tensors both models produce (see quantlab.compare.common_tensors)."
                )
        for name in self.tensors:
            ref, out = reference[name], test[name]
            if np.shape(ref) != np.shape(out):
                raise ModelError(
                    f"tensor '{name}' has shape {np.shape(ref)} in '{self.reference}' but "
                    f"{np.shape(out)} in '{self.test}'; the two models do not compute the same "
                    "tensor under this name. Check that both come from the same export."
                )
            self.errors[name].update(ref, out)

    def table(self, info: pd.DataFrame | None = None) -> pd.DataFrame:
        """One row per tensor (compared order): tensor, node, op_type, torch_module, metrics."""
        rows = []
        for name in self.tensors:
            described = info.loc[name] if info is not None and name in info.index else None
            rows.append({
                "tensor": name,
                "node": "" if described is None else described["node"],
                "op_type": "" if described is None else described["op_type"],
                "torch_module": "" if described is None else described["torch_module"],
                **self.errors[name].metrics(),
            })
        return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def tensor_info(model: onnx.ModelProto) -> pd.DataFrame:
    """Per non-constant tensor: producing node, its op type and torch module path ('' if none)."""
    producers = graph.producers(model)
    rows = []
    for name in graph.topological_tensors(model):
        node = producers.get(name)
        rows.append({
            "tensor": name,
            "node": node.name if node is not None else "(graph input)",
            "op_type": node.op_type if node is not None else "",
            "torch_module": (graph.node_module_path(node) or "") if node is not None else "",
        })
    return pd.DataFrame(rows, columns=["tensor", "node", "op_type", "torch_module"]).set_index(
        "tensor", drop=False)


def common_tensors(reference: onnx.ModelProto, test: onnx.ModelProto,
                   candidates: Sequence[str] | None = None) -> list[str]:
    """Float tensors of `reference` (topological order) that `test` also has, by name.

    Raises ModelError when the graph outputs of the two models differ by name,
    since then not even the end-to-end results can be compared.
    """
    ref_outputs = [o.name for o in reference.graph.output]
    test_outputs = [o.name for o in test.graph.output]
    if ref_outputs != test_outputs:
        raise ModelError(
            f"the models' outputs do not match by name: the reference has {ref_outputs}, the "
            f"test model has {test_outputs} (missing from the test model: "
            f"{sorted(set(ref_outputs) - set(test_outputs))}). Both must come from the same "
            "ONNX export; quantize the FP32 model you pass as reference."
        )
    present = set(graph.topological_tensors(test)) | set(test_outputs)
    floats = graph.float_tensors(reference)
    ordered = graph.topological_tensors(reference)
    allowed = set(candidates) if candidates is not None else set(ordered)
    return [t for t in ordered if t in present and t in floats and t in allowed]


def upstream_tensors(model: onnx.ModelProto, compared: Sequence[str]) -> dict[str, list[str]]:
    """For each compared tensor, the nearest compared tensors (or graph inputs) feeding it.

    Walks back through tensors that are not compared (e.g. unmapped in torch) so a
    tensor's error can be judged against the error already present at its inputs.
    """
    producers = graph.producers(model)
    constants = graph.constant_tensors(model)
    inputs = {spec.name for spec in graph.input_specs(model)}
    keep = set(compared) | inputs
    memo: dict[str, frozenset[str]] = {}

    def nearest(tensor: str) -> frozenset[str]:
        # Iterative over the producing chain so deep graphs cannot exhaust the recursion limit.
        stack = [tensor]
        while stack:
            name = stack[-1]
            if name in memo:
                stack.pop()
                continue
            node = producers.get(name)
            parents = [i for i in node.input if i and i not in constants] if node else []
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


@dataclass(frozen=True)
class Divergence:
    """Where the error between two runs first jumps past the threshold."""

    tensor: str
    node: str
    op_type: str
    torch_module: str
    sqnr_db: float
    input_sqnr_db: float
    reason: str

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def first_divergence(table: pd.DataFrame, order: Sequence[str],
                     upstream: Mapping[str, Sequence[str]] | None = None,
                     threshold_db: float = 30.0, min_drop_db: float = 10.0) -> Divergence | None:
    """The earliest tensor (in `order`) whose error jumps past `threshold_db`.

    A tensor *jumps* when its SQNR is below `threshold_db` and at least
    `min_drop_db` below the lowest SQNR of its `upstream` tensors (graph inputs
    count as +inf dB): the node producing it adds the error rather than passing
    on error from before. If no tensor jumps but some fall below the threshold
    (error accumulating gradually over many layers), the first of those is
    returned with reason "gradual". None when every tensor is above the threshold.
    """
    sqnr = dict(zip(table["tensor"], table["sqnr_db"], strict=True))
    rows = table.set_index("tensor", drop=False)
    upstream = upstream or {}
    below = [t for t in order if t in sqnr and sqnr[t] < threshold_db]
    if not below:
        return None
    for tensor in below:
        before = min((sqnr.get(u, math.inf) for u in upstream.get(tensor, ())), default=math.inf)
        if sqnr[tensor] < before - min_drop_db:
            return _divergence(rows.loc[tensor], before, "jump")
    first = below[0]
    before = min((sqnr.get(u, math.inf) for u in upstream.get(first, ())), default=math.inf)
    return _divergence(rows.loc[first], before, "gradual")


def _divergence(row: pd.Series, before: float, reason: str) -> Divergence:
    return Divergence(row["tensor"], row["node"], row["op_type"], row["torch_module"],
                      float(row["sqnr_db"]), float(before), reason)
