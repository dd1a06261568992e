"""Three-stage validation: PyTorch vs ONNX Runtime FP32 vs the INT8 engine, layer by layer.

Stages, in order: ``torch`` (the original module, optional), ``onnx_fp32`` (the
FP32 ONNX graph in ONNX Runtime) and ``engine_int8`` (the Q/DQ graph in ONNX
Runtime, the engine quantlab can run here). Each adjacent pair is compared per
tensor; every stage is scored on the task end to end. The evaluation set is
streamed batch by batch: only one batch of activations and the running sums of
:mod:`quantlab.compare` are ever in memory.

Modes for the FP32-vs-INT8 pair:

* ``global``: both graphs run end to end; a tensor's error includes the error of
  every layer before it.
* ``local``: every compute node of the Q/DQ graph that reads a dequantized input
  is run alone — with the Q/DQ pairs and weight DQ in front of it — on the FP32
  run's input tensors, so its row is the error that node's quantization adds.

The torch-vs-FP32 pair is always global (nothing is quantized there).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pandas as pd
from onnx import helper

from quantlab import compare, graph, tasks
from quantlab.backends.onnxruntime import OnnxRuntimeBackend, check_finite
from quantlab.data import BatchSource
from quantlab.errors import ConfigError, DataError, ModelError
from quantlab.experiment import atomic_write, prepare_output, write_json
from quantlab.qdq import PASS_THROUGH_OPS
from quantlab.report import Section, figure_html, table_html, write_report

MODES = ("global", "local")
TORCH, FP32, ENGINE = "torch", "onnx_fp32", "engine_int8"
STAGE_DESCRIPTIONS = {
    TORCH: "PyTorch module (forward hooks)",
    FP32: "FP32 ONNX model in ONNX Runtime",
    ENGINE: "INT8 Q/DQ model in ONNX Runtime (TensorRT is not installed here)",
}
WORST_LAYERS = 10
# Where infinite SQNR (bit-identical tensors) is drawn on plots, above every finite value.
_PLOT_INF_MARGIN_DB = 10.0


def layers_file(reference: str, test: str, mode: str = "global") -> str:
    """File name of a pair's per-tensor table, e.g. ``layers_onnx_fp32_vs_engine_int8.csv``."""
    suffix = "_local" if mode == "local" else ""
    return f"layers_{reference}_vs_{test}{suffix}.csv"


@dataclass
class Task:
    """How to score a stage end to end: classification (labels) or detection (COCO GT).

    `postprocess(outputs, image_ids)` turns one batch of raw outputs (by ONNX output
    name) into logits (N, classes) or a list of COCO detection dicts.
    """

    kind: str
    postprocess: Callable[[dict[str, np.ndarray], list[int]], object]
    labels: np.ndarray | None = None
    coco: dict | None = None
    image_ids: Sequence[int] | None = None

    def __post_init__(self):
        if self.kind == "classification" and self.labels is None:
            raise ConfigError("a classification task needs `labels` (one per sample).")
        if self.kind == "detection" and self.coco is None:
            raise ConfigError("a detection task needs `coco` ground truth (a COCO dict).")
        if self.kind not in ("classification", "detection"):
            raise ConfigError(
                f"task kind '{self.kind}' is not one of classification, detection.")

    @classmethod
    def from_zoo(cls, zoo_model, eval_set) -> Task:
        """The task of a zoo model scored on one of its evaluation sets."""
        return cls(zoo_model.task, zoo_model.postprocess, eval_set.labels, eval_set.coco,
                   list(eval_set.image_ids))

    def check_samples(self, num_samples: int) -> None:
        """Raise DataError unless the ground truth covers `num_samples` samples."""
        have = len(self.labels) if self.kind == "classification" else len(self.ids(num_samples))
        if have < num_samples:
            raise DataError(
                f"the data has {num_samples} samples but the {self.kind} ground truth covers "
                f"only {have}; pass as many labels/images as samples (or --max-samples {have})."
            )

    def ids(self, num_samples: int) -> list[int]:
        """Image ids of the first `num_samples` samples (0..N-1 when none were given)."""
        if self.image_ids is not None:
            return list(self.image_ids)
        return [image["id"] for image in self.coco["images"]] if self.coco else list(
            range(num_samples))


class _TaskScore:
    """Streaming task score of one stage: top-k hit counts, or the detections list."""

    def __init__(self, task: Task):
        self.task = task
        self.hits: dict[str, float] = {}
        self.count = 0
        self.detections: list = []

    def update(self, outputs: dict[str, np.ndarray], start: int, stop: int) -> None:
        ids = self.task.ids(stop)[start:stop]
        predicted = self.task.postprocess(outputs, ids)
        if self.task.kind == "classification":
            batch = tasks.topk_accuracy(predicted, self.task.labels[start:stop])
            for key, value in batch.items():
                self.hits[key] = self.hits.get(key, 0.0) + value * (stop - start)
            self.count += stop - start
        else:
            self.detections.extend(predicted)

    def result(self, num_samples: int) -> dict:
        if self.task.kind == "classification":
            return {key: value / self.count for key, value in self.hits.items()}
        ids = set(self.task.ids(num_samples)[:num_samples])
        coco = self.task.coco
        # Score against the images actually evaluated (--max-samples may cut the set).
        ground_truth = {
            "images": [i for i in coco["images"] if i["id"] in ids],
            "annotations": [a for a in coco["annotations"] if a["image_id"] in ids],
            "categories": coco["categories"],
        }
        return tasks.coco_map(ground_truth, self.detections)


@dataclass
class LocalErrorModel:
    """One ONNX graph holding, side by side, each quantized compute node with its input Q/DQ.

    ``model`` reads FP32 tensors (``feeds``) and writes ``outputs``: local output
    name -> the FP32 tensor it is compared with. ``quantized_inputs`` lists, per
    compared tensor, the FP32 tensors whose quantization the node sees.
    """

    model: onnx.ModelProto
    feeds: list[str]
    outputs: dict[str, str]
    quantized_inputs: dict[str, list[str]] = field(default_factory=dict)


def local_error_model(qdq_model: onnx.ModelProto, reference: onnx.ModelProto) -> LocalErrorModel:
    """Cut every quantized compute node of `qdq_model` out with its Q/DQ inputs.

    A node is quantized when one of its inputs comes from a DequantizeLinear,
    directly or through ops that commute with quantization (MaxPool, Reshape, ...).
    Its other non-constant inputs, and the inputs of its Quantize nodes, are fed
    from the FP32 run of `reference` under the same names.
    """
    producers = graph.producers(qdq_model)
    constants = graph.constant_tensors(qdq_model)
    initializer_names = {init.name for init in qdq_model.graph.initializer}
    known = set(graph.topological_tensors(reference))
    floats = graph.float_tensors(reference)
    values = {v.name: v for v in list(qdq_model.graph.value_info) + list(qdq_model.graph.input)}

    def chain(tensor: str) -> tuple[list[onnx.NodeProto], list[str], list[str]] | None:
        """Nodes from the FP32 feeds to `tensor`, the feeds, the quantized FP32 tensors."""
        node = producers.get(tensor)
        if tensor in initializer_names or node is None:
            return [], [], []
        if node.op_type == "Constant":
            return [node], [], []
        if node.op_type == "DequantizeLinear":
            source = node.input[0]
            if source in constants:
                return [*_constant_nodes(node, producers), node], [], []
            quantize = producers.get(source)
            if quantize is None or quantize.op_type != "QuantizeLinear":
                return None
            fed = quantize.input[0]
            nodes = [*_constant_nodes(quantize, producers), *_constant_nodes(node, producers)]
            return [*nodes, quantize, node], [fed], [fed]
        if node.op_type in PASS_THROUGH_OPS:
            upstream = chain(node.input[0])
            if upstream is not None and upstream[2]:
                return ([*upstream[0], *_constant_nodes(node, producers), node], upstream[1],
                        upstream[2])
        return [], [tensor], []

    combined: list[onnx.NodeProto] = []
    feeds: dict[str, None] = {}
    outputs: dict[str, str] = {}
    quantized_inputs: dict[str, list[str]] = {}
    for node in qdq_model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant") or \
                node.op_type in PASS_THROUGH_OPS:
            continue
        parts = [chain(i) for i in node.input if i]
        if any(p is None for p in parts) or not any(p[2] for p in parts):
            continue
        needed = [t for p in parts for t in p[1]]
        compared = [o for o in node.output if o in known and o in floats]
        if not compared or any(t not in known for t in needed):
            continue
        suffix = f"::local::{node.name}"
        renamed = {out: out + suffix for p in parts for n in p[0] for out in n.output}
        renamed.update({out: out + suffix for out in node.output})
        for sub in [n for p in parts for n in p[0]] + [node]:
            copy = onnx.NodeProto()
            copy.CopyFrom(sub)
            copy.name = sub.name + suffix
            del copy.input[:], copy.output[:]
            copy.input.extend(renamed.get(i, i) for i in sub.input)
            copy.output.extend(renamed[o] for o in sub.output)
            combined.append(copy)
        feeds.update(dict.fromkeys(needed))
        for out in compared:
            outputs[renamed[out]] = out
            quantized_inputs[out] = sorted({t for p in parts for t in p[2]})
    if not outputs:
        raise ModelError(
            "the INT8 model has no compute node reading a QuantizeLinear/DequantizeLinear pair "
            "on a tensor of the FP32 model; local mode needs a Q/DQ model made from the FP32 "
            "model passed as reference (same tensor names). Use --mode global otherwise."
        )
    used = {i for n in combined for i in n.input}
    model = helper.make_model(
        helper.make_graph(
            combined, "local_errors",
            [values[f] for f in feeds],
            [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs],
            [init for init in qdq_model.graph.initializer if init.name in used],
        ),
        opset_imports=qdq_model.opset_import,
    )
    model.ir_version = qdq_model.ir_version
    return LocalErrorModel(model, list(feeds), outputs, quantized_inputs)


def _constant_nodes(node: onnx.NodeProto, producers) -> list[onnx.NodeProto]:
    """Constant nodes feeding `node` (scales written as Constant instead of initializers)."""
    return [producers[i] for i in node.input
            if i in producers and producers[i].op_type == "Constant"]


@dataclass
class ValidationResult:
    """What `validate` wrote: the per-pair tables, summary, report path, stage metrics."""

    folder: Path
    tables: dict[tuple[str, str], pd.DataFrame]
    divergences: dict[tuple[str, str], compare.Divergence | None]
    metrics: dict[str, dict]
    summary: dict
    report: Path


@dataclass
class _Pair:
    reference: str
    test: str
    mode: str
    comparison: compare.Comparison
    upstream: dict[str, list[str]]
    unmapped: list[str]
    extra: dict[str, list[str]] = field(default_factory=dict)


def validate(
    onnx_model: onnx.ModelProto | str | os.PathLike,
    engine_model: onnx.ModelProto | str | os.PathLike,
    data: BatchSource,
    out: str | os.PathLike,
    torch_module=None,
    task: Task | None = None,
    mode: str = "global",
    threshold_db: float = 30.0,
    min_drop_db: float = 10.0,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    force: bool = False,
    progress: bool = True,
    title: str = "Validation",
) -> ValidationResult:
    """Run every stage over `data`, compare adjacent stages per tensor, score the task.

    Writes into `out`: one ``layers_<A>_vs_<B>.csv`` per stage pair, ``summary.json``
    (task metrics per stage, first divergence and end-to-end output errors per pair)
    and ``report.html``. `threshold_db`/`min_drop_db` define the first divergence
    (see :func:`quantlab.compare.first_divergence`); `atol`/`rtol` the tolerance of
    the ``frac_outside`` column.
    """
    from tqdm import tqdm

    from quantlab.backends.torch import TorchBackend

    if mode not in MODES:
        raise ConfigError(f"mode '{mode}' is not one of {', '.join(MODES)}.")
    fp32_model = _as_model(onnx_model)
    int8_model = _as_model(engine_model)
    if task is not None:
        task.check_samples(data.num_samples)
    pair_names = [(FP32, ENGINE)] if torch_module is None else [(TORCH, FP32), (FP32, ENGINE)]
    folder = prepare_output(out, force=force, produces=[
        *(layers_file(a, b, mode if b == ENGINE else "global") for a, b in pair_names),
        "summary.json", "report.html"])

    order = graph.topological_tensors(fp32_model)
    info = compare.tensor_info(fp32_model)
    fp32 = OnnxRuntimeBackend(fp32_model, name=FP32)
    engine = OnnxRuntimeBackend(int8_model, name=ENGINE)
    pairs: list[_Pair] = []
    torch_backend = None
    if torch_module is not None:
        torch_backend = TorchBackend(torch_module, fp32_model, name=TORCH,
                                     sample=_first_sample(data))
        mapped = [t for t in order if t in torch_backend.mapping]
        pairs.append(_Pair(TORCH, FP32, "global",
                           compare.Comparison(mapped, TORCH, FP32, atol, rtol),
                           compare.upstream_tensors(fp32_model, mapped), torch_backend.unmapped))
    shared = compare.common_tensors(fp32_model, int8_model)
    local = local_error_model(int8_model, fp32_model) if mode == "local" else None
    if local is None:
        compared = shared
        upstream = compare.upstream_tensors(fp32_model, compared)
    else:
        compared = [t for t in order if t in set(local.outputs.values())]
        # Fed the FP32 inputs, a node's only error is its own: judge it against +inf.
        upstream = {}
    floats = graph.float_tensors(fp32_model)
    pairs.append(_Pair(FP32, ENGINE, mode, compare.Comparison(compared, FP32, ENGINE, atol, rtol),
                       upstream, [t for t in order if t in floats and t not in set(compared)],
                       {"quantized_inputs": local.quantized_inputs} if local else {}))
    local_backend = OnnxRuntimeBackend(local.model, name="local") if local else None
    output_names = fp32.outputs
    outputs_comparison = {
        (p.reference, p.test): compare.Comparison(output_names, p.reference, p.test, atol, rtol)
        for p in pairs}
    scores = {name: _TaskScore(task) for name in ([TORCH] if torch_backend else []) + [FP32, ENGINE]
              } if task is not None else {}

    compared_anywhere = [t for p in pairs for t in p.comparison.tensors]
    fp32_wanted = list(dict.fromkeys([*output_names, *compared_anywhere,
                                      *(local.feeds if local else [])]))
    input_names = {spec.name for spec in fp32.inputs}
    start = 0
    for batch in tqdm(data, desc="validate", unit="batch", disable=not progress):
        stop = start + len(next(iter(batch.values())))
        check_finite(batch, list(batch), f"input batch of samples {start}..{stop - 1}")
        values = {FP32: fp32.run(batch, [t for t in fp32_wanted if t not in input_names])}
        values[FP32].update({name: batch[name] for name in input_names})
        check_finite(values[FP32], order, f"stage '{FP32}'")
        if torch_backend is not None:
            values[TORCH] = torch_backend.run(batch, pairs[0].comparison.tensors + output_names)
            check_finite(values[TORCH], order, f"stage '{TORCH}'")
        engine_outputs = engine.run(batch)
        check_finite(engine_outputs, output_names, f"stage '{ENGINE}'")
        if local is not None:
            local_values = local_backend.run({f: values[FP32][f] for f in local.feeds})
            values[ENGINE] = {local.outputs[k]: v for k, v in local_values.items()}
        else:
            values[ENGINE] = engine.run(batch, shared)
        check_finite(values[ENGINE], order, f"stage '{ENGINE}' ({mode} mode)")
        # The engine's end-to-end outputs come from its own run (local mode feeds its
        # layers FP32 inputs, so its layer values hold no end-to-end outputs).
        stage_outputs = {name: {o: values[name][o] for o in output_names}
                         for name in values if name != ENGINE}
        stage_outputs[ENGINE] = engine_outputs
        for pair in pairs:
            pair.comparison.update(values[pair.reference], values[pair.test])
            outputs_comparison[(pair.reference, pair.test)].update(
                stage_outputs[pair.reference], stage_outputs[pair.test])
        for name, score in scores.items():
            score.update(stage_outputs[name], start, stop)
        start = stop

    metrics = {name: score.result(data.num_samples) for name, score in scores.items()}
    tables, divergences, pair_summaries = {}, {}, []
    for pair in pairs:
        key = (pair.reference, pair.test)
        table = pair.comparison.table(info)
        for column, by_tensor in pair.extra.items():
            table[column] = [" ".join(by_tensor.get(t, [])) for t in table["tensor"]]
        tables[key] = table
        divergences[key] = compare.first_divergence(table, order, pair.upstream,
                                                    threshold_db, min_drop_db)
        file = layers_file(pair.reference, pair.test, pair.mode)
        atomic_write(folder / file, lambda tmp, t=table: t.to_csv(tmp, index=False))
        pair_summaries.append({
            "reference": pair.reference,
            "test": pair.test,
            "mode": pair.mode,
            "layers_csv": file,
            "tensors_compared": len(table),
            "tensors_not_compared": pair.unmapped,
            "first_divergence": divergences[key].to_dict() if divergences[key] else None,
            "outputs": {name: err.metrics()
                        for name, err in outputs_comparison[key].errors.items()},
        })
    summary = {
        "samples": data.num_samples,
        "data": data.description,
        "mode": mode,
        "stages": {name: STAGE_DESCRIPTIONS[name] for name in (TORCH, FP32, ENGINE)
                   if name != TORCH or torch_backend},
        "task": task.kind if task else None,
        "metrics": metrics,
        "divergence_rule": {"threshold_db": threshold_db, "min_drop_db": min_drop_db},
        "tolerance": {"atol": atol, "rtol": rtol},
        "pairs": pair_summaries,
    }
    write_json(folder / "summary.json", summary)
    report = write_report(folder / "report.html", title,
                          [report_section(tables, divergences, metrics, order, mode, threshold_db)],
                          subtitle=f"{data.description}, {data.num_samples} samples")
    return ValidationResult(folder, tables, divergences, metrics, summary, report)


def _as_model(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    return graph.normalize(model) if isinstance(model, onnx.ModelProto) else graph.load_model(model)


def _first_sample(data: BatchSource) -> dict[str, np.ndarray]:
    batch = next(iter(data))
    return {name: value[:1] for name, value in batch.items()}


def report_section(
    tables: Mapping[tuple[str, str], pd.DataFrame],
    divergences: Mapping[tuple[str, str], compare.Divergence | None],
    metrics: Mapping[str, dict],
    order: Sequence[str],
    mode: str,
    threshold_db: float,
) -> Section:
    """The report section: task metrics side by side, SQNR-vs-depth plots, worst layers."""
    parts = []
    if metrics:
        parts.append(table_html(_metrics_frame(metrics), caption="Task metrics per stage"))
    for (reference, test), table in tables.items():
        label = f"{reference} vs {test}" + (" (local)" if mode == "local" and test == ENGINE
                                            else "")
        parts.append(f"<h3>{label}</h3>")
        divergence = divergences[(reference, test)]
        parts.append("<p>" + (
            f"First divergence: tensor <code>{divergence.tensor}</code> from node "
            f"<code>{divergence.node}</code> ({divergence.op_type}, torch module "
            f"<code>{divergence.torch_module or '-'}</code>): {divergence.sqnr_db:.1f} dB "
            f"({divergence.reason})." if divergence else
            f"Every compared tensor stays above {threshold_db:g} dB SQNR.") + "</p>")
        parts.append(figure_html(_sqnr_figure(table, order, label, threshold_db),
                                 f"SQNR per tensor in topological order, {label}"))
        worst = table.sort_values("sqnr_db").head(WORST_LAYERS)
        parts.append(table_html(worst, caption=f"Worst {len(worst)} tensors, {label}"))
    return Section("Layer-by-layer validation", "\n".join(parts), anchor="validation")


def _metrics_frame(metrics: Mapping[str, dict]) -> pd.DataFrame:
    rows = []
    for stage, values in metrics.items():
        row = {"stage": stage}
        row.update({tasks.METRIC_LABELS.get(k, k): v for k, v in values.items()
                    if not isinstance(v, dict)})
        per_class = values.get("per_class") or {}
        row.update({f"AP {name}": ap for name, ap in per_class.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def _sqnr_figure(table: pd.DataFrame, order: Sequence[str], label: str, threshold_db: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = {name: i for i, name in enumerate(order)}
    x = np.array([depth[t] for t in table["tensor"]])
    sqnr = table["sqnr_db"].to_numpy(dtype=float)
    finite = np.isfinite(sqnr)
    top = (sqnr[finite].max() if finite.any() else threshold_db) + _PLOT_INF_MARGIN_DB
    figure, axis = plt.subplots(figsize=(8, 3))
    axis.plot(x[finite], sqnr[finite], ".-", lw=0.8, label="SQNR")
    if (~finite).any():
        axis.scatter(x[sqnr == math.inf], np.full((sqnr == math.inf).sum(), top), marker="^",
                     color="tab:green", label="identical (+inf dB)")
    axis.axhline(threshold_db, color="tab:red", ls="--", lw=0.8, label="divergence threshold")
    axis.set_xlabel("tensor index (topological order)")
    axis.set_ylabel("SQNR [dB]")
    axis.set_title(label)
    axis.legend(loc="lower left", fontsize=8)
    return figure
