"""The TensorRT self-check (`quantlab doctor`): every path quantlab builds on this machine's
TensorRT, compared with ONNX Runtime's INT8 model, and the questions a reading of TensorRT's
sources could not settle (docs/tensorrt.md, "What quantlab doctor checks").

For each zoo model it calibrates a folder, then builds and compares the engine of every
path the installed TensorRT has (:func:`supported_paths`) with the backend's own
functions (:func:`quantlab.backends.tensorrt.build_engine`, ``TensorRTBackend``,
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

from quantlab import __version__, cache, graph, qdq
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
    from quantlab.backends.tensorrt import IMPLICIT_INT8_UNTIL, STRONGLY_TYPED_SINCE

    version = tuple(version)
    paths = ["strongly_typed"] if version >= STRONGLY_TYPED_SINCE else []
    if version < IMPLICIT_INT8_UNTIL:
        paths += ["explicit", "implicit_calibrator"]
        paths += ["implicit_trtexec"] if has_trtexec else []
        paths.append("implicit_pins")
    return paths


def gemm_ranges_answer(trt_scales: Mapping[str, float], needed: Sequence[str],
                       gemm_precisions: Mapping[str, Sequence[str | None]]) -> dict:
    """Question 1 from TensorRT's own cache (`trt_scales`), quantlab's list of ranges
    (`needed`) and the precisions of the Gemm nodes' layers in the engine built from
    quantlab's cache (``{node: [precision of each layer]}``)."""
    only_trt = sorted(set(trt_scales) - set(needed))
    left = {node: list(p) for node, p in gemm_precisions.items()
            if any(value != "int8" for value in p)}
    if not gemm_precisions:
        answer = "no Gemm in this model"
    elif left:
        answer = (f"{len(left)} Gemm node(s) leave INT8 with quantlab's cache: TensorRT wants "
                  "ranges quantlab cannot name")
    else:
        answer = "every Gemm runs INT8 from quantlab's cache"
    return {"tensorrt_only_ranges": only_trt, "gemm_layer_precisions": dict(gemm_precisions),
            "gemm_out_of_int8": left, "answer": answer}


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
    from quantlab.backends.tensorrt import installed_version, require_tensorrt
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
            header, scales = own["result"]
            gemm = _attempt(_gemm_ranges, folder, version, scales)
            questions.setdefault("gemm_ranges", {})[name] = gemm.get("result", gemm)
            questions.setdefault("cache_header", cache_header_answer(header, version))
    rewrite = [p["cache"] for p in report["paths"] if "cache" in p]
    if rewrite:
        questions["cache_rewrite"] = rewrite[0]
    ct = _attempt(_conv_transpose, out / "conv_transpose")
    questions["conv_transpose_axis"] = ct.get("result", ct)
    report["ok"] = all(p["status"] == "ok" for p in report["paths"])
    from quantlab.experiment import write_json, write_text

    write_json(out / "doctor.json", report)
    write_text(out / "doctor.md", format_report(report))
    return report


def format_report(report: Mapping) -> str:
    """The report as Markdown: versions, one row per (model, path), the four answers."""
    lines = [f"# quantlab doctor: TensorRT {report['tensorrt']}", "",
             f"quantlab {report['quantlab']}, Polygraphy {report['polygraphy']}, GPU "
             f"{report['gpu']}, trtexec {report['trtexec'] or 'not on PATH'}", "",
             "| model | path | status | worst-output SQNR dB | tensors compared (how) | "
             "not exposed | detail |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["paths"]:
        how = ", ".join(f"{k} {v}" for k, v in sorted(row.get("obtained", {}).items()))
        sqnr = row.get("worst_output_sqnr_db")
        lines.append(f"| {row['model']} | {row['path']} | {row['status']} | "
                     f"{'' if sqnr is None else f'{sqnr:.1f}'} | {how} | "
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
    from quantlab import pipeline, zoo

    trt_version = ".".join(map(str, version)) if version < (11, 0) else None
    pipeline.run_calibration(name, zoo.get(name).calibration_set(), folder, progress=False,
                             force=True, trt_version=trt_version)
    return folder


def _check_path(path: str, name: str, folder: Path, version: tuple[int, ...],
                max_samples: int) -> dict:
    """Build the engine of `path`, compare it with ONNX Runtime's INT8 model; a row."""
    row = {"model": name, "path": path}
    try:
        engine, extra = _engine(path, folder, version)
        row.update(extra)
        row.update(_compare(name, folder, engine, path, max_samples))
        row["status"] = "ok" if row["worst_output_sqnr_db"] >= AGREEMENT_DB else "disagrees"
        engine.close()
    except Exception as exc:  # a path that fails is what the report is for; go on
        row.update(status="failed", detail=f"{type(exc).__name__}: {exc}")
    return row


def _engine(path: str, folder: Path, version: tuple[int, ...]) -> tuple[object, dict]:
    from quantlab.backends.tensorrt import LAYERS, TensorRTBackend, layer_information
    from quantlab.trt_layers import engine_layers, precision_mismatches

    if path in ("strongly_typed", "explicit"):
        return TensorRTBackend(folder / "model.int8.onnx", name=path, debug_tensors=LAYERS,
                               mode=path, max_batch=BATCH), {}
    if path == "implicit_trtexec":
        _run_trtexec(folder)
        return TensorRTBackend(folder / "model.onnx", name=path,
                               engine=folder / "model.implicit.plan"), {}
    model = graph.load_model(folder / "model.onnx")
    plan = _pin_plan(model) if path == "implicit_pins" else None
    with tempfile.TemporaryDirectory(prefix="quantlab-doctor-") as scratch:
        feeder = _feeder(folder, model, version, Path(scratch), batches=None)
        engine = TensorRTBackend(folder / "model.onnx", name=path, debug_tensors=LAYERS,
                                 mode="implicit", calibrator=_calibrator(feeder),
                                 layer_precisions=plan, max_batch=BATCH)
    extra = {"cache": cache_rewrite_answer(feeder.cache_reads, feeder.cache_writes)}
    if plan:
        layers = engine_layers(layer_information(engine.engine_bytes), model)
        extra["plan"] = plan
        extra["precision_mismatches"] = [m.__dict__ for m in precision_mismatches(layers, plan)]
    return engine, extra


def _pin_plan(model: onnx.ModelProto) -> dict[str, str]:
    # The last linear node in FP16 and the first in FP32: both pins and the FP16 flag.
    linear = [node.name for node in model.graph.node if node.op_type in qdq.LINEAR_OPS]
    return {linear[-1]: "fp16", linear[0]: "fp32"} if len(linear) > 1 else {linear[0]: "fp16"}


def _feeder(folder: Path, model: onnx.ModelProto, version: tuple[int, ...], scratch: Path,
            batches: object | None):
    from quantlab.backends.trt_calibrator import CalibrationFeeder

    header, _ = cache.read_calibration_cache(folder / "calibration.cache")
    path = scratch / "calibration.cache"
    if batches is None:  # read quantlab's cache (a copy: question 2)
        shutil.copyfile(folder / "calibration.cache", path)
    return CalibrationFeeder(batches, path, graph.input_specs(model), batch=BATCH,
                             algorithm=header.algorithm if batches is None else
                             "EntropyCalibration2", trt_version=".".join(map(str, version)))


def _calibrator(feeder):
    from quantlab.backends.trt_calibrator import make_calibrator

    return make_calibrator(feeder)


def _run_trtexec(folder: Path) -> None:
    """Write trtexec.txt with `quantlab build` and run its implicit line in the folder."""
    import shlex

    from quantlab.cli import main

    if main(["build", str(folder), "--max-batch", str(BATCH), "--force"]) != 0:
        raise QuantlabError(f"quantlab build {folder} failed (see above).")
    lines = (folder / "trtexec.txt").read_text(encoding="utf-8").splitlines()
    line = next(line for line in lines if line.startswith("trtexec --onnx=model.onnx"))
    run = subprocess.run(shlex.split(line), cwd=folder, capture_output=True, text=True)
    if run.returncode:
        tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
        raise QuantlabError(f"trtexec exited with {run.returncode}: {' / '.join(tail)}")


def _compare(name: str, folder: Path, engine, path: str, max_samples: int) -> dict:
    """Validate `engine` against ONNX Runtime's INT8 model: layer table and end-to-end."""
    from quantlab import zoo
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.data import open_data
    from quantlab.tasks import Task
    from quantlab.validate import validate

    entry = zoo.get(name)
    reference = OnnxRuntimeBackend(graph.load_model(folder / "model.int8.onnx"),
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
    return {"worst_output_sqnr_db": min(m["sqnr_db"] for m in pair.outputs.values()),
            "metrics": result.metrics, "obtained": counts,
            "not_exposed": list(pair.not_compared), "notes": list(pair.warnings),
            "first_divergence": pair.divergence.to_dict() if pair.divergence else None,
            "report": str(result.report)}


def _tensorrt_cache(folder: Path, version: tuple[int, ...]) -> tuple[str, dict]:
    """TensorRT's own calibration of the folder's model from its batches: header, scales."""
    from quantlab import zoo
    from quantlab.backends.tensorrt import build_engine
    from quantlab.data import open_data

    model = graph.load_model(folder / "model.onnx")
    name = folder.name
    batches = open_data(zoo.get(name).calibration_set(), graph.input_specs(model), BATCH,
                        max_samples=8 * BATCH)
    with tempfile.TemporaryDirectory(prefix="quantlab-doctor-") as scratch:
        feeder = _feeder(folder, model, version, Path(scratch), batches)
        build_engine(folder / "model.onnx", "implicit", calibrator=_calibrator(feeder),
                     max_batch=BATCH)
        header, scales = cache.read_calibration_cache(feeder.cache_path)
    return str(header), scales


def _gemm_ranges(folder: Path, version: tuple[int, ...], scales: Mapping[str, float]) -> dict:
    """Question 1: TensorRT's own ranges (`scales`) against quantlab's, and the precision of the
    Gemm layers of the engine built from quantlab's cache."""
    from quantlab import trt_ranges
    from quantlab.backends.tensorrt import build_engine, layer_information
    from quantlab.trt_layers import engine_layers, node_layers

    model = graph.load_model(folder / "model.onnx")
    with tempfile.TemporaryDirectory(prefix="quantlab-doctor-") as scratch:
        feeder = _feeder(folder, model, version, Path(scratch), batches=None)
        engine = build_engine(folder / "model.onnx", "implicit", calibrator=_calibrator(feeder),
                              max_batch=BATCH)
    where = node_layers(engine_layers(layer_information(engine), model))
    gemms = {node.name: [layer.precision for layer in where.get(node.name, [])]
             for node in model.graph.node if node.op_type == "Gemm"}
    return gemm_ranges_answer(scales, trt_ranges.tensors_needing_ranges(model), gemms)


def _conv_transpose(folder: Path) -> dict:
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.backends.tensorrt import TensorRTBackend
    from quantlab.compare import TensorError

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
