"""The TensorRT self-check (`quantlab doctor`): every path quantlab builds on this machine's
TensorRT, compared with ONNX Runtime's INT8 model, and the questions a reading of TensorRT's
sources could not settle (docs/tensorrt.md, "What quantlab doctor checks").

For each zoo model it calibrates a folder, then builds and compares the engine of every
path the installed TensorRT has (:func:`supported_paths`) with the backend's own
functions (:func:`quantlab.engine.backends.tensorrt.build_engine`, ``TensorRTBackend``,
``make_calibrator``, ``quantlab build``'s trtexec lines), so a failure here is a
failure of what a user runs. It answers:

1. ``gemm_ranges``: which ranges TensorRT's own calibration wants that quantlab's cache
   cannot name (Gemm internals), and whether the Gemm layers of the engine built from
   quantlab's cache run INT8;
2. ``cache_rewrite``: whether TensorRT writes back a cache it read;
3. ``conv_transpose_axis``: which ConvTranspose weight scales (per-tensor, axis 0,
   axis 1) give the engine ONNX Runtime's numbers;
4. ``cache_header``: the header TensorRT writes, against the one quantlab writes.

Everything goes to ``doctor.json`` (attach it to a bug report) and ``doctor.md``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quantlab import __version__, graph
from quantlab.calibration import qdq
from quantlab.engine import cache
from quantlab.errors import QuantlabError

DEFAULT_MODELS = ("digits-cnn", "digits-vit")
# Build paths, in the order they are checked.
PATHS = ("strongly_typed", "explicit", "implicit_calibrator", "implicit_trtexec",
         "implicit_pins")
# An engine agrees with ONNX Runtime's INT8 model end to end above this SQNR: both run the same
# int8 scales, so only kernel accumulation and rounding order differ.
AGREEMENT_DB = 30.0
BATCH = 8


def supported_paths(version: Sequence[int], has_trtexec: bool) -> list[str]:
    """The :data:`PATHS` TensorRT `version` has: strongly typed from 9.0; explicit and the
    implicit ones (calibrator, trtexec where it is on PATH, a plan with pins) before 11.0."""
    from quantlab.engine.backends.tensorrt import IMPLICIT_INT8_UNTIL, STRONGLY_TYPED_SINCE

    version = tuple(version)
    paths = ["strongly_typed"] if version >= STRONGLY_TYPED_SINCE else []
    if version < IMPLICIT_INT8_UNTIL:
        paths += ["explicit", "implicit_calibrator"]
        paths += ["implicit_trtexec"] if has_trtexec else []
        paths.append("implicit_pins")
    return paths


def gemm_ranges_answer(trt_scales: Mapping[str, float], needed: Sequence[str],
                       gemm_precisions: Mapping[str, Sequence[str | None]],
                       own_precisions: Mapping[str, Sequence[str | None]] | None = None
                       ) -> dict:
    """Question 1 from TensorRT's own cache (`trt_scales`), quantlab's list of ranges
    (`needed`) and the precisions of the Gemm nodes' layers (``{node: [precision of each
    layer]}``) in the engine built from quantlab's cache and in the one built from TensorRT's
    own (`own_precisions`)."""
    only_trt = sorted(set(trt_scales) - set(needed))
    # A Myelin region (precision None) says nothing of its Gemm, and a Gemm TensorRT keeps out
    # of INT8 from its own cache too (a last FC) is TensorRT's choice, not a missing range:
    # only a layer INT8 from TensorRT's cache and not from quantlab's is blamed (r2 N8).
    own = own_precisions or {}
    left = {node: list(p) for node, p in gemm_precisions.items()
            if any(value not in ("int8", None) for value in p)
            and all(value in ("int8", None) for value in own.get(node, ["int8"]))}
    if not gemm_precisions:
        answer = "no Gemm in this model"
    elif left:
        answer = (f"{len(left)} Gemm node(s) run INT8 from TensorRT's own cache but not from "
                  "quantlab's: TensorRT wants ranges quantlab cannot name")
    else:
        answer = ("every Gemm TensorRT runs INT8 from its own cache runs INT8 from quantlab's "
                  "cache")
    return {"tensorrt_only_ranges": only_trt, "gemm_layer_precisions": dict(gemm_precisions),
            "gemm_precisions_own_cache": dict(own), "gemm_out_of_int8": left, "answer": answer}


def cache_rewrite_answer(reads: int, writes: int) -> dict:
    """Question 2 from the calibrator's counts while TensorRT built from quantlab's cache."""
    if not reads:
        answer = "TensorRT did not read the cache"
    elif writes:
        answer = f"TensorRT wrote back the cache it read ({writes} time(s))"
    else:
        answer = "TensorRT does not write back a cache it read"
    return {"reads": reads, "writes": writes, "answer": answer}


def cache_header_answer(header: str, version: Sequence[int]) -> dict:
    """Question 4: the header TensorRT wrote against the one quantlab writes for `version`."""
    expected = f"TRT-{cache.trt_version_number('.'.join(map(str, version)))}"
    written = str(header).rsplit("-", 1)[0]
    return {"tensorrt_wrote": str(header), "quantlab_writes": expected,
            "answer": "same header" if written == expected else
            f"differs: TensorRT writes {written}, quantlab {expected}"}


def conv_transpose_models(seed: int = 0) -> dict[str, onnx.ModelProto]:
    """A ConvTranspose Q/DQ model with its weight scaled per tensor (quantlab's choice), along
    axis 0 (per input channel) and along axis 1 (per output channel), for question 3."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((4, 3, 2, 2)).astype(np.float32)
    weight[1] *= 8  # channels of different ranges: a wrong axis shows
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 8, 8])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="deconv", strides=[2, 2])
    model = graph.normalize(helper.make_model(
        helper.make_graph([node], "deconv", [x], [y], [numpy_helper.from_array(weight, "w")]),
        opset_imports=[helper.make_opsetid("", 17)]))
    base = qdq.quantize_model(model, {"x": 3.0})
    result = {"per_tensor": base}
    for axis in (0, 1):
        variant = onnx.ModelProto()
        variant.CopyFrom(base)
        deconv = next(n for n in variant.graph.node if n.op_type == "ConvTranspose")
        stored, dequantize = qdq.weight_dequantizer(weight, "w", axis, qdq.FreshNames(variant))
        variant.graph.initializer.extend(stored)
        variant.graph.node.insert(0, dequantize)
        deconv.input[1] = dequantize.output[0]
        result[f"axis{axis}"] = variant
    for variant in result.values():
        _drop_unread(variant)
    return result


def _drop_unread(model: onnx.ModelProto) -> None:
    # The per-tensor DequantizeLinear a variant replaced, and its initializers.
    outputs = {o.name for o in model.graph.output}
    read = {name for node in model.graph.node for name in node.input}
    nodes = [n for n in model.graph.node if any(o in read or o in outputs for o in n.output)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    read = {name for node in model.graph.node for name in node.input}
    kept = [init for init in model.graph.initializer if init.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def conv_transpose_answer(sqnr_db: Mapping[str, float | str]) -> dict:
    """Question 3 from each variant's end-to-end SQNR against ONNX Runtime (or the build error)."""
    agree = [name for name, value in sqnr_db.items()
             if isinstance(value, float) and value >= AGREEMENT_DB]
    return {"sqnr_db": dict(sqnr_db), "agree": agree,
            "answer": f"ONNX Runtime's numbers with: {', '.join(agree) or 'none'}"}


def run_doctor(out: str | os.PathLike, models: Sequence[str] = DEFAULT_MODELS,
               max_samples: int = 64) -> dict:
    """Run every check into the folder `out`; return the report (also in doctor.json).

    ConfigError for a name that is not a zoo model (before anything else: each is joined to
    `out`), BackendUnavailableError, naming what to install, where TensorRT is missing.
    """
    from quantlab.engine.backends.tensorrt import installed_version, require_tensorrt
    from quantlab.errors import ConfigError
    from quantlab.zoo_names import ZOO_NAMES

    unknown = [name for name in models if name not in ZOO_NAMES]
    if unknown:
        raise ConfigError(f"--zoo {unknown[0]} is not a zoo model; doctor checks "
                          f"{', '.join(ZOO_NAMES)}.")
    trt = require_tensorrt()
    import polygraphy

    version = installed_version()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"quantlab": __version__, "tensorrt": trt.__version__,
              "polygraphy": polygraphy.__version__, "gpu": _gpu_name(),
              "trtexec": shutil.which("trtexec"), "paths": [], "questions": {}}
    paths = supported_paths(version, report["trtexec"] is not None)
    questions = report["questions"]
    for name in models:
        calibrated = _attempt(_calibrate, name, out / name, version)
        if "answer" in calibrated:  # no folder: every path of this model fails with the reason
            report["paths"] += [{"model": name, "path": path, "status": "failed",
                                 "detail": calibrated["answer"]} for path in paths]
            continue
        folder = calibrated["result"]
        for path in paths:
            report["paths"].append(_check_path(path, name, folder, version, max_samples))
        if version < (11, 0):  # TensorRT calibrating itself: questions 1 and 4
            own = _attempt(_tensorrt_cache, folder, version)
            if "answer" in own:  # the check itself failed
                questions.setdefault("gemm_ranges", {})[name] = own
                continue
            header, scales, own_gemms = own["result"]
            gemm = _attempt(_gemm_ranges, folder, version, scales, own_gemms)
            questions.setdefault("gemm_ranges", {})[name] = gemm.get("result", gemm)
            questions.setdefault("cache_header", cache_header_answer(header, version))
    rewrite = [p["cache"] for p in report["paths"] if "cache" in p]
    if rewrite:
        questions["cache_rewrite"] = rewrite[0]
    ct = _attempt(_conv_transpose, out / "conv_transpose")
    questions["conv_transpose_axis"] = ct.get("result", ct)
    report["ok"] = all(p["status"] == "ok" for p in report["paths"])
    from quantlab.experiments.experiment import write_json, write_text

    write_json(out / "doctor.json", report)
    write_text(out / "doctor.md", format_report(report))
    return report


def format_report(report: Mapping) -> str:
    """The report as Markdown: versions, one row per (model, path), the four answers."""
    lines = [f"# quantlab doctor: TensorRT {report['tensorrt']}", "",
             f"quantlab {report['quantlab']}, Polygraphy {report['polygraphy']}, GPU "
             f"{report['gpu']}, trtexec {report['trtexec'] or 'not on PATH'}", "",
             "| model | path | status | worst-output SQNR dB | layers below "
             f"{AGREEMENT_DB:.0f} dB | INT8 share of MACs | latency ms (engine / ONNX Runtime) | "
             "TensorRT warnings | tensors compared (how) | not exposed | detail |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["paths"]:
        how = ", ".join(f"{k} {v}" for k, v in sorted(row.get("obtained", {}).items()))
        sqnr = row.get("worst_output_sqnr_db")
        share = row.get("int8_coverage", {}).get("share")
        latency = " / ".join(f"{v:.2f}" for v in row.get("latency_ms", {}).values())
        warned = ", ".join(f"{k} {len(v)}" for k, v in sorted(
            row.get("tensorrt_warnings", {}).items()))
        lines.append(f"| {row['model']} | {row['path']} | {row['status']} | "
                     f"{'' if sqnr is None else f'{sqnr:.1f}'} | "
                     f"{len(row.get('layers_below', []))} | "
                     f"{'' if share is None else f'{share:.1%}'} | {latency} | {warned} | {how} | "
                     f"{len(row.get('not_exposed', []))} | {row.get('detail', '')} |")
    lines += ["", "## Questions the sources could not settle", ""]
    for question, answer in report["questions"].items():
        answers = answer.items() if question == "gemm_ranges" else [(None, answer)]
        for model, item in answers:
            lines.append(f"- **{question}**{f' ({model})' if model else ''}: {item['answer']}")
    return "\n".join(lines) + "\n"


def _attempt(check, *args) -> dict:
    """``{"result": check(*args)}``, or ``{"answer": "check failed: ..."}``: a check that fails
    is a finding for the report, not the end of the self-check."""
    try:
        return {"result": check(*args)}
    except Exception as exc:  # TensorRT and Polygraphy raise their own exception types
        return {"answer": f"check failed: {type(exc).__name__}: {exc}"}


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _calibrate(name: str, folder: Path, version: tuple[int, ...]) -> Path:
    from quantlab import zoo
    from quantlab.calibration import pipeline

    trt_version = ".".join(map(str, version)) if version < (11, 0) else None
    pipeline.run_calibration(name, zoo.get(name).calibration_set(), folder, progress=False,
                             force=True, trt_version=trt_version)
    return folder


def _check_path(path: str, name: str, folder: Path, version: tuple[int, ...],
                max_samples: int) -> dict:
    """Build the engine of `path`, compare it with what it can reproduce; a row."""
    from polygraphy.logger import G_LOGGER

    row = {"model": name, "path": path}
    log = folder / f"doctor-{path}.tensorrt.log"
    log.unlink(missing_ok=True)
    G_LOGGER.log_file = str(log)  # TensorRT's own log, through Polygraphy's logger
    try:
        engine, extra = _engine(path, folder, version)
        row.update(extra)
        reference = _implicit_reference(folder) if path.startswith("implicit") else None
        row["reference"] = reference_of(path)
        row.update(_compare(name, folder, engine, path, max_samples, reference))
        engine.close()
    except Exception as exc:  # a path that fails is what the report is for; go on
        row.update(status="failed", detail=f"{type(exc).__name__}: {exc}")
    finally:
        G_LOGGER.log_file = None
    row["tensorrt_warnings"] = tensorrt_warnings(
        log.read_text(encoding="utf-8", errors="replace") if log.is_file() else "")
    return judge_row(row) if "status" not in row else row


# What implicit INT8 can reproduce: it quantizes with the cache's activation scales and its own
# max-abs weight scales, and knows nothing of bias correction, --weight-amax or the Q/DQ
# placement (developer guide, implicit quantization; trt-review-r2 N6).
IMPLICIT_REFERENCE = ("model.onnx quantized in ONNX Runtime with calibration.cache's scales, "
                      "max-abs per-channel weights and no bias correction: what an implicit "
                      "INT8 engine can reproduce (not model.int8.onnx)")
PINS_NOT_IN_REFERENCE = ("the pinned nodes run INT8 there (the reference carries the cache's "
                         "scales, not the pins): the pins are judged by the engine's layer "
                         "precisions, and this SQNR includes the pinned nodes' INT8 error")


def reference_of(path: str) -> str | None:
    """What the engine of `path` is judged against, where it is not model.int8.onnx run as is."""
    if not path.startswith("implicit"):
        return None
    return f"{IMPLICIT_REFERENCE}; {PINS_NOT_IN_REFERENCE}" if path == "implicit_pins" \
        else IMPLICIT_REFERENCE


# TensorRT log lines a user needs to see (trt-review-r2 section 3, item 3, with the issues).
WARNINGS = {
    "missing_scale": "Missing scale and zero-point",  # falls back to FP (#2462)
    "pins_ignored": "No conforming implementation",  # precision pins ignored (#2407, #3941)
    "calibrator_unused": "Calibrator won't be used",  # explicit precision mode (#1837)
    "fp16_weights": "converted to FP16",  # weights overflow / subnormal in FP16 (#3101)
    "no_implementation": "Could not find any implementation",  # (#3385, #3579, #3813)
}


def tensorrt_warnings(log: str) -> dict[str, list[str]]:
    """The TensorRT warning and error lines of a log (Polygraphy's ``[W]``/``[E]`` prefixes,
    TensorRT's ``[TRT] [W]``), by the kind of :data:`WARNINGS` they are ('other' for the rest)."""
    found: dict[str, list[str]] = {}
    for line in log.splitlines():
        if not any(tag in line for tag in ("[W]", "[E]", "WARNING", "ERROR")):
            continue
        text = line.strip()
        kind = next((k for k, pattern in WARNINGS.items() if pattern in text), "other")
        found.setdefault(kind, []).append(text)
    return found


def judge_row(row: dict) -> dict:
    """A measured row's status: 'pins ignored' where a plan node's engine layers run another
    precision (the pins were not obeyed), 'disagrees' where the worst output or a mapped
    intermediate is below :data:`AGREEMENT_DB` (naming the layers), else 'ok'."""
    problems = []
    if row.get("precision_mismatches"):
        nodes = sorted({m["node"] for m in row["precision_mismatches"]})
        problems.append(f"pins not obeyed on {', '.join(nodes)}")
    if row.get("worst_output_sqnr_db", np.inf) < AGREEMENT_DB:
        problems.append(f"worst output {row['worst_output_sqnr_db']:.1f} dB")
    for layer in row.get("layers_below", []):
        problems.append(f"{layer['tensor']} ({layer['node']}) {layer['sqnr_db']:.1f} dB")
    status = ("pins ignored" if row.get("precision_mismatches") else
              "disagrees" if problems else "ok")
    detail = "; ".join(problems)
    if row.get("reference"):
        detail = f"{detail}; " if detail else ""
        detail += "judged against " + row["reference"]
    return {**row, "status": status, "detail": detail}


def inspect_engine(layer_info: str | Mapping, model: onnx.ModelProto,
                   plan: Mapping[str, str] | None = None) -> dict:
    """What the inspector tells of an engine built from `model`: its INT8 coverage
    (:func:`quantlab.engine.trt_layers.int8_coverage`), its reformat layers, and for a `plan` the
    nodes whose layers run another precision."""
    from quantlab.engine.trt_layers import engine_layers, int8_coverage, precision_mismatches

    layers = engine_layers(layer_info, model)
    result = {"int8_coverage": int8_coverage(layers),
              "reformats": sum(layer.is_reformat for layer in layers)}
    if plan:
        result["plan"] = dict(plan)
        result["precision_mismatches"] = [m.__dict__ for m in precision_mismatches(layers, plan)]
    return result


def _engine(path: str, folder: Path, version: tuple[int, ...]) -> tuple[object, dict]:
    from quantlab.engine.backends.tensorrt import LAYERS, TensorRTBackend, layer_information

    if path in ("strongly_typed", "explicit"):
        engine = TensorRTBackend(folder / "model.int8.onnx", name=path, debug_tensors=LAYERS,
                                 mode=path, max_batch=BATCH)
        model = engine.model
        extra = {}
    elif path == "implicit_trtexec":
        _run_trtexec(folder)
        engine = TensorRTBackend(folder / "model.onnx", name=path,
                                 engine=folder / "model.implicit.plan")
        model, extra = engine.model, {}
    else:
        model = graph.load_model(folder / "model.onnx")
        plan = _pin_plan(model) if path == "implicit_pins" else None
        with tempfile.TemporaryDirectory(prefix="quantlab-doctor-") as scratch:
            feeder = _feeder(folder, model, version, Path(scratch), batches=None)
            engine = TensorRTBackend(folder / "model.onnx", name=path, debug_tensors=LAYERS,
                                     mode="implicit", calibrator=_calibrator(feeder),
                                     layer_precisions=plan, max_batch=BATCH)
        extra = {"cache": cache_rewrite_answer(feeder.cache_reads, feeder.cache_writes)}
        extra.update(inspect_engine(layer_information(engine.engine_bytes), model, plan))
        return engine, extra
    extra.update(inspect_engine(layer_information(engine.engine_bytes), model))
    return engine, extra


def _implicit_reference(folder: Path) -> onnx.ModelProto:
    """:data:`IMPLICIT_REFERENCE`: the FP32 model quantized with the cache's scales."""
    _, scales = cache.read_calibration_cache(folder / "calibration.cache")
    model = graph.load_model(folder / "model.onnx")
    wanted = qdq.activation_tensors_to_calibrate(model)
    return qdq.quantize_model(model, {t: scales[t] * 127.0 for t in wanted if t in scales},
                              per_channel=True, weight_criterion="max")


def _pin_plan(model: onnx.ModelProto) -> dict[str, str]:
    # The last linear node in FP16 and the first in FP32: both pins and the FP16 flag.
    linear = [node.name for node in model.graph.node if node.op_type in qdq.LINEAR_OPS]
    return {linear[-1]: "fp16", linear[0]: "fp32"} if len(linear) > 1 else {linear[0]: "fp16"}


def _feeder(folder: Path, model: onnx.ModelProto, version: tuple[int, ...], scratch: Path,
            batches: object | None):
    from quantlab.engine.backends.trt_calibrator import CalibrationFeeder

    header, _ = cache.read_calibration_cache(folder / "calibration.cache")
    path = scratch / "calibration.cache"
    if batches is None:  # read quantlab's cache (a copy: question 2)
        shutil.copyfile(folder / "calibration.cache", path)
    return CalibrationFeeder(batches, path, graph.input_specs(model), batch=BATCH,
                             algorithm=header.algorithm if batches is None else
                             "EntropyCalibration2", trt_version=".".join(map(str, version)))


def _calibrator(feeder):
    from quantlab.engine.backends.trt_calibrator import make_calibrator

    return make_calibrator(feeder)


def _run_trtexec(folder: Path) -> None:
    """Write trtexec.txt with `quantlab build` and run its implicit line in the folder."""
    import shlex

    from quantlab.engine.build import build_folder

    build_folder(folder, max_batch=BATCH, force=True)
    lines = (folder / "trtexec.txt").read_text(encoding="utf-8").splitlines()
    line = next(line for line in lines if line.startswith("trtexec --onnx=model.onnx"))
    run = subprocess.run(shlex.split(line), cwd=folder, capture_output=True, text=True)
    if run.returncode:
        tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
        raise QuantlabError(f"trtexec exited with {run.returncode}: {' / '.join(tail)}")


def _compare(name: str, folder: Path, engine, path: str, max_samples: int,
             reference_model: onnx.ModelProto | None = None) -> dict:
    """Validate `engine` against ONNX Runtime's INT8 model (or `reference_model`): layer table,
    the mapped layers below :data:`AGREEMENT_DB`, end to end, and both latencies."""
    from quantlab import zoo
    from quantlab.data import open_data
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.evaluation.tasks import Task
    from quantlab.evaluation.validate import validate

    entry = zoo.get(name)
    reference = OnnxRuntimeBackend(reference_model or
                                   graph.load_model(folder / "model.int8.onnx"),
                                   name="onnxruntime_int8")
    eval_set = entry.eval_set(max_samples)
    data = open_data({entry.input_name: eval_set.inputs}, graph.input_specs(reference.model),
                     BATCH)
    result = validate(reference, engine, data, folder / f"doctor-{path}",
                      task=Task.from_zoo(entry, eval_set), force=True, progress=False)
    pair = result.pairs[-1]
    obtained = pair.table["obtained"] if "obtained" in pair.table else []
    counts: dict[str, int] = {}
    for value in obtained:
        counts[value] = counts.get(value, 0) + 1
    table = pair.table
    below = table[table["sqnr_db"] < AGREEMENT_DB]
    batch = data.slice(next(iter(data)), 0, min(BATCH, data.num_samples))
    return {"worst_output_sqnr_db": min(m["sqnr_db"] for m in pair.outputs.values()),
            "layers_below": [{"tensor": r.tensor, "node": r.node, "sqnr_db": float(r.sqnr_db)}
                             for r in below.itertuples(index=False)],
            "latency_ms": {engine.name: _latency_ms(engine, batch),
                           reference.name: _latency_ms(reference, batch)},
            "metrics": result.metrics, "obtained": counts,
            "not_exposed": list(pair.not_compared), "notes": list(pair.warnings),
            "first_divergence": pair.divergence.to_dict() if pair.divergence else None,
            "report": str(result.report)}


def _latency_ms(backend, batch: Mapping[str, np.ndarray], runs: int = 20) -> float:
    """Median wall time of `runs` runs of `batch` (outputs only), after one warm-up run."""
    import time

    backend.run(batch)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        backend.run(batch)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def _tensorrt_cache(folder: Path, version: tuple[int, ...]) -> tuple[str, dict]:
    """TensorRT's own calibration of the folder's model from its batches: header, scales."""
    from quantlab import zoo
    from quantlab.data import open_data
    from quantlab.engine.backends.tensorrt import build_engine

    model = graph.load_model(folder / "model.onnx")
    name = folder.name
    batches = open_data(zoo.get(name).calibration_set(), graph.input_specs(model), BATCH,
                        max_samples=8 * BATCH)
    with tempfile.TemporaryDirectory(prefix="quantlab-doctor-") as scratch:
        feeder = _feeder(folder, model, version, Path(scratch), batches)
        engine = build_engine(folder / "model.onnx", "implicit", calibrator=_calibrator(feeder),
                              max_batch=BATCH)
        header, scales = cache.read_calibration_cache(feeder.cache_path)
    return str(header), scales, _gemm_precisions(engine, model)


def _gemm_precisions(engine: bytes, model: onnx.ModelProto) -> dict[str, list[str | None]]:
    """Gemm node -> the precision of each engine layer holding it."""
    from quantlab.engine.backends.tensorrt import layer_information
    from quantlab.engine.trt_layers import engine_layers, node_layers

    where = node_layers(engine_layers(layer_information(engine), model))
    return {node.name: [layer.precision for layer in where.get(node.name, [])]
            for node in model.graph.node if node.op_type == "Gemm"}


def _gemm_ranges(folder: Path, version: tuple[int, ...], scales: Mapping[str, float],
                 own: Mapping[str, list[str | None]]) -> dict:
    """Question 1: TensorRT's own ranges (`scales`) against quantlab's, and the precision of the
    Gemm layers of the engine built from quantlab's cache against those from TensorRT's (`own`)."""
    from quantlab.engine import trt_ranges
    from quantlab.engine.backends.tensorrt import build_engine

    model = graph.load_model(folder / "model.onnx")
    with tempfile.TemporaryDirectory(prefix="quantlab-doctor-") as scratch:
        feeder = _feeder(folder, model, version, Path(scratch), batches=None)
        engine = build_engine(folder / "model.onnx", "implicit", calibrator=_calibrator(feeder),
                              max_batch=BATCH)
    return gemm_ranges_answer(scales, trt_ranges.tensors_needing_ranges(model),
                              _gemm_precisions(engine, model), own)


def _conv_transpose(folder: Path) -> dict:
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.engine.backends.tensorrt import TensorRTBackend
    from quantlab.evaluation.compare import TensorError

    folder.mkdir(parents=True, exist_ok=True)
    x = {"x": np.random.default_rng(1).uniform(-3, 3, (1, 4, 8, 8)).astype(np.float32)}
    sqnr: dict[str, float | str] = {}
    for variant, model in conv_transpose_models().items():
        path = folder / f"{variant}.onnx"
        onnx.save(model, path)
        try:
            engine = TensorRTBackend(path, name=variant)
            error = TensorError()
            error.update(OnnxRuntimeBackend(model).run(x)["y"], engine.run(x)["y"])
            engine.close()
            sqnr[variant] = float(error.sqnr_db)
        except QuantlabError as exc:
            sqnr[variant] = f"build failed: {exc}"
    return conv_transpose_answer(sqnr)
