"""`quantlab sweep` against `quantlab calibrate` + an evaluation per configuration, run separately.

For every model, on the same calibration and evaluation data:

- sweep: ONE child process runs ``quantlab sweep`` (every method, three percentiles,
  calibration sizes 16..max): one collection pass with a snapshot per size, every
  configuration's INT8 model evaluated on the held-out data;
- sweep, fewer configurations: the same with one method and the largest size only, to
  show that peak RSS does not grow with the number of configurations;
- sweep on half the calibration data: its sufficiency sentence, checked against what
  doubling the data (the full sweep) gives;
- separately: one child process per configuration, as a user without the sweep would
  run it: ``quantlab calibrate --method M [--percentile P] --max-samples n`` into a
  folder, then that folder's INT8 model evaluated against FP32 on the held-out data
  (:class:`quantlab.experiments.sweep.Evaluator`, the sweep's own scoring).

Every child reports its wall time and peak RSS (VmHWM, benchmarks/harness.py) and how
many samples statistics collection ran; the sweep's best configuration is compared with
the separate run of `quantlab calibrate`'s default (percentile 99.99, all the data).

The real-model suite (``--real``: layout, orientation, vad, onet of tests/realmodels.py,
label-free output SQNR on held-out data) runs the full sweep, the sweep on half the
calibration data (not for layout: 8 pages) and, instead of the whole separate grid, only
``quantlab calibrate`` with its defaults followed by the same evaluation.

    python benchmarks/sweep.py                          # the zoo models
    python benchmarks/sweep.py --models digits-cnn --quick
    python benchmarks/sweep.py --real layout orientation vad onet --data-dir /work/data/suite

Prints one table per model; writes benchmarks/results/sweep-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import harness as bench  # noqa: E402  (peak_rss, watch: the benchmarks' measurement rules)

MODELS = ("digits-cnn", "shapes-det")
# Real-model suite: (calibration, evaluation) samples generated when --data-dir lacks them,
# the calibration sizes swept, the data's file suffix.
REAL = {
    "layout": {"samples": (8, 16), "sizes": [4, 8], "suffix": "npy"},
    "orientation": {"samples": (32, 16), "sizes": [16, 32], "suffix": "npy"},
    "vad": {"samples": (32, 16), "sizes": [16, 32], "suffix": "npz"},
    "onet": {"samples": (32, 16), "sizes": [16, 32], "suffix": "npy"},
}
METHODS = ("entropy", "max", "percentile", "mse")
PERCENTILES = (99.9, 99.99, 99.999)
QUICK_EVAL = 200
RESULTS_DIR = HERE / "results"
MEMORY_LIMIT = 8 * bench.GIB
TIME_LIMIT = 3 * 3600.0


def sizes(count: int) -> list[int]:
    """16, 32, ... below `count`, then `count` (quantlab sweep's default)."""
    found = [16 << k for k in range(32) if 16 << k < count]
    return [*found, count]


def _counting_collect(counts: dict) -> None:
    """Count the samples statistics collection runs in this (child) process."""
    from quantlab.calibration import collect

    original = collect.collect

    def counted(model, batches, *args, **kwargs):
        counts["collected_samples"] = counts.get("collected_samples", 0) + batches.num_samples
        counts["collect_calls"] = counts.get("collect_calls", 0) + 1
        return original(model, batches, *args, **kwargs)

    collect.collect = counted


def child_sweep(spec: Mapping) -> dict:
    """``quantlab sweep`` with the spec's methods, percentiles and sizes."""
    from quantlab.cli import main
    from quantlab.experiments.experiment import read_json

    counts: dict = {}
    _counting_collect(counts)
    out = Path(spec["out"])
    args = ["sweep", spec["model"], "--data", spec.get("data", "zoo"),
            "--eval", spec.get("eval", "zoo"), "--metric", spec["metric"],
            "--methods", *spec["methods"], "--percentiles", *map(str, PERCENTILES),
            "--calib-sizes", *map(str, spec["sizes"]), "--out", str(out), "--force",
            "--no-progress", "--allow-long"]
    if spec["eval_samples"]:
        args += ["--max-samples", str(spec["eval_samples"])]
    start = time.perf_counter()
    code = main(args)
    wall = time.perf_counter() - start
    result = read_json(out / "sweep.json")
    best = next(r for r in result["configurations"] if r["label"] == result["best"])
    return {"code": code, "wall_s": wall, "configurations": len(result["configurations"]),
            "best": best["label"], "best_value": best["value"],
            "values": {r["label"]: r["value"] for r in result["configurations"]},
            "sufficiency": result["sufficiency"], "max_movement": result["max_movement"],
            **counts}


def child_separate(spec: Mapping) -> dict:
    """``quantlab calibrate`` of one configuration, then its INT8 model evaluated."""
    import numpy as np

    from quantlab import graph, zoo
    from quantlab.cli import main
    from quantlab.data import open_data
    from quantlab.evaluation.tasks import Task
    from quantlab.experiments.sweep import Evaluator

    counts: dict = {}
    _counting_collect(counts)
    out = Path(spec["out"])
    entry = zoo.get(spec["model"])
    calib = out / "calib.npy"
    start = time.perf_counter()
    np.save(calib, entry.calibration_set()[:spec["size"]])
    args = ["calibrate", spec["model"], "--data", str(calib), "--method", spec["method"],
            "--out", str(out / "run"), "--force", "--no-progress"]
    if spec["percentile"] is not None:
        args += ["--percentile", str(spec["percentile"])]
    code = main(args)
    eval_set = entry.eval_set(spec["eval_samples"])
    fp32 = graph.load_model(out / "run" / "model.onnx")
    evaluation = open_data(eval_set.inputs, graph.input_specs(fp32), 32)
    evaluator = Evaluator(fp32, evaluation, spec["metric"], Task.from_zoo(entry, eval_set))
    value = evaluator.against_fp32(evaluator.outputs(
        graph.load_model(out / "run" / "model.int8.onnx"), "INT8")).value
    return {"code": code, "wall_s": time.perf_counter() - start, "value": value, **counts}


def child_default(spec: Mapping) -> dict:
    """``quantlab calibrate`` with its defaults on all the calibration data, then its INT8
    model evaluated against FP32 on the evaluation data (the sweep's scoring)."""
    from quantlab import graph
    from quantlab.cli import main
    from quantlab.data import open_data
    from quantlab.experiments.sweep import Evaluator

    counts: dict = {}
    _counting_collect(counts)
    run = Path(spec["out"]) / "run"
    start = time.perf_counter()
    code = main(["calibrate", spec["model"], "--data", spec["data"], "--out", str(run),
                 "--force", "--no-progress"])
    fp32 = graph.load_model(run / "model.onnx")
    evaluation = open_data(spec["eval"], graph.input_specs(fp32), 32)
    evaluator = Evaluator(fp32, evaluation, spec["metric"])
    value = evaluator.against_fp32(evaluator.outputs(
        graph.load_model(run / "model.int8.onnx"), "INT8")).value
    return {"code": code, "wall_s": time.perf_counter() - start, "value": value, **counts}


CHILDREN = {"sweep": child_sweep, "separate": child_separate, "default": child_default}


def run_child(kind: str, spec: dict, folder: Path) -> dict:
    """One child process; its result with its peak RSS."""
    log = folder / f"{kind}.log"
    stopped, sampled, code = bench.run_child(__file__, {"kind": kind, **spec}, log,
                                             MEMORY_LIMIT, TIME_LIMIT)
    lines = log.read_text().splitlines()
    if stopped or code != 0 or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"{kind} child failed ({stopped or code}); see {log}")
    return {**json.loads(lines[-1]), "sampled_peak_rss": sampled}


def benchmark(name: str, quick: bool, scratch: Path) -> dict:
    """Both ways on one model: the rows of its table."""
    from quantlab import zoo

    entry = zoo.get(name)
    metric = "map" if entry.task == "detection" else "top1"
    eval_samples = QUICK_EVAL if quick else None
    grid = sizes(len(entry.calibration_set()))
    if quick:
        grid = grid[-2:]
    folder = scratch / name
    folder.mkdir(parents=True, exist_ok=True)
    common = {"model": name, "metric": metric, "eval_samples": eval_samples}
    full = run_child("sweep", {**common, "methods": list(METHODS), "sizes": grid,
                               "out": str(folder / "sweep")}, folder)
    small = run_child("sweep", {**common, "methods": ["percentile"], "sizes": grid[-1:],
                                "out": str(folder / "sweep-small")}, folder)
    # Does the sufficiency sentence hold? The same sweep on half the data, judged by what
    # doubling it (the full sweep) actually gives.
    half = grid[-1] // 2
    halved = run_child("sweep", {**common, "methods": list(METHODS),
                                 "sizes": [n for n in grid if n < half] + [half],
                                 "out": str(folder / "sweep-half")}, folder)
    separate = {}
    for size in grid:
        for method in METHODS:
            for percentile in (PERCENTILES if method == "percentile" else (None,)):
                label = " ".join([method, *([f"{percentile:g}"] if percentile else [])])
                out = folder / f"separate-{label.replace(' ', '-')}-{size}"
                out.mkdir(exist_ok=True)
                separate[f"{label} @{size}"] = run_child("separate", {
                    **common, "method": method, "percentile": percentile, "size": size,
                    "out": str(out)}, out)
    default = f"percentile 99.99 @{grid[-1]}"
    return {
        "model": name, "metric": metric, "sizes": grid,
        "sweep": full, "sweep_small": small, "sweep_half": halved,
        "separate": {"runs": len(separate),
                     "wall_s": sum(r["wall_s"] for r in separate.values()),
                     "peak_rss": max(r["peak_rss"] for r in separate.values()),
                     "collected_samples": sum(r.get("collected_samples", 0)
                                              for r in separate.values()),
                     "values": {label: r["value"] for label, r in separate.items()}},
        "default": default,
    }


def real_data(name: str, dirs: list[Path], scratch: Path) -> tuple[str, str, str]:
    """(model, calibration data, evaluation data) of a real model: the first of `dirs` that
    holds NAME/calib.* and NAME/val.*, else generated into `scratch`."""
    from tests import realmodels

    spec = REAL[name]
    found = next((d / name for d in dirs if (d / name / f"calib.{spec['suffix']}").is_file()
                  and (d / name / f"val.{spec['suffix']}").is_file()), None)
    if found is None:
        found = scratch / "data" / name
        realmodels.GENERATORS[name](found, *spec["samples"])
    if name == "onet":
        exported = next((d / "onet_models" / "onet_quantlab.onnx" for d in dirs
                         if (d / "onet_models" / "onet_quantlab.onnx").is_file()), None)
        model = exported or realmodels.export_onet(scratch / "onet")["quantlab"]
    else:
        model = realmodels.fetch(names=(name,))[name]
    return (str(model), str(found / f"calib.{spec['suffix']}"),
            str(found / f"val.{spec['suffix']}"))


def real_benchmark(name: str, dirs: list[Path], scratch: Path,
                   grid: list[int] | None = None) -> dict:
    """The full sweep, the sweep on half the data and `quantlab calibrate`'s default, on one
    model of the real-model suite; `grid`: the sizes swept (default: REAL's)."""
    model, data, evaluation = real_data(name, dirs, scratch)
    grid = grid or REAL[name]["sizes"]
    folder = scratch / name
    folder.mkdir(parents=True, exist_ok=True)
    common = {"model": model, "data": data, "eval": evaluation, "metric": "sqnr",
              "eval_samples": None}
    result = {"model": name, "files": [model, data, evaluation], "metric": "sqnr",
              "sizes": grid, "default": f"percentile 99.99 @{grid[-1]}"}
    result["sweep"] = run_child("sweep", {**common, "methods": list(METHODS), "sizes": grid,
                                          "out": str(folder / "sweep")}, folder)
    if grid[-1] >= 16:  # layout's 8 pages: a 4-page sweep says little, and takes long
        half = grid[-1] // 2
        result["sweep_half"] = run_child("sweep", {
            **common, "methods": list(METHODS), "sizes": [n for n in grid if n < half] + [half],
            "out": str(folder / "sweep-half")}, folder)
    result["calibrate_default"] = run_child("default", {**common, "out": str(folder)}, folder)
    return result


def real_table(result: Mapping) -> str:
    """A real model's rows as plain text."""
    sweep, default = result["sweep"], result["calibrate_default"]
    mib = bench.MIB
    rows = [{"run": f"quantlab sweep ({sweep['configurations']} configurations)",
             "wall s": f"{sweep['wall_s']:.1f}",
             "peak RSS MiB": f"{sweep['peak_rss'] / mib:.0f}",
             "collection passes": f"1 ({sweep['collect_calls']} blocks)",
             "samples collected": sweep["collected_samples"]},
            {"run": "quantlab calibrate (default) + evaluate",
             "wall s": f"{default['wall_s']:.1f}",
             "peak RSS MiB": f"{default['peak_rss'] / mib:.0f}",
             "collection passes": str(default["collect_calls"]),
             "samples collected": default["collected_samples"]}]
    text = (bench.format_table(rows)
            + f"\nbest {sweep['best']}: sqnr {sweep['best_value']:.2f} dB; `quantlab calibrate` "
              f"default: {default['value']:.2f} dB run separately, "
              f"{sweep['values'][result['default']]:.2f} dB in the sweep ({result['default']})\n"
            + "\n".join(sweep["sufficiency"].values()))
    return text + ("\n" + doubling(result) if "sweep_half" in result else "")


def table(result: Mapping) -> str:
    """The model's rows as plain text."""
    sweep, small, separate = result["sweep"], result["sweep_small"], result["separate"]
    mib = bench.MIB
    rows = [
        {"run": f"quantlab sweep ({sweep['configurations']} configurations)",
         "wall s": f"{sweep['wall_s']:.1f}", "peak RSS MiB": f"{sweep['peak_rss'] / mib:.0f}",
         "collection passes": f"1 ({sweep['collect_calls']} blocks)",
         "samples collected": sweep["collected_samples"]},
        {"run": f"quantlab sweep ({small['configurations']} configuration)",
         "wall s": f"{small['wall_s']:.1f}", "peak RSS MiB": f"{small['peak_rss'] / mib:.0f}",
         "collection passes": f"1 ({small['collect_calls']} blocks)",
         "samples collected": small["collected_samples"]},
        {"run": f"calibrate + evaluate, {separate['runs']} runs",
         "wall s": f"{separate['wall_s']:.1f}",
         "peak RSS MiB": f"{separate['peak_rss'] / mib:.0f} (largest)",
         "collection passes": str(separate["runs"]),
         "samples collected": separate["collected_samples"]},
    ]
    return (bench.format_table(rows)
            + f"\nbest {sweep['best']}: {result['metric']} {sweep['best_value']:.4f}; "
              f"`quantlab calibrate` default ({result['default']}): "
              f"{separate['values'][result['default']]:.4f} run separately, "
              f"{sweep['values'][result['default']]:.4f} in the sweep; configurations whose "
              "separate run differs from the sweep's: "
              f"{sum(separate['values'][k] != v for k, v in sweep['values'].items())}\n"
              + "\n".join(sweep["sufficiency"].values()) + "\n" + doubling(result))


def doubling(result: Mapping) -> str:
    """The half-data sweep's calibration sentence, and what doubling the data gave the setting
    it judged (its best): its metric at n/2 (half sweep) and at n (full sweep), and how far
    its scales moved from n/2 to n (full sweep)."""
    halved, sweep = result["sweep_half"], result["sweep"]
    setting = halved["best"].rpartition(" @")[0]
    full = result["sizes"][-1]
    at_half, at_full = f"{setting} @{full // 2}", f"{setting} @{full}"
    return (f"on half the data ({full // 2} samples, best {halved['best']}): "
            f"{halved['sufficiency']['calibration']}\n"
            f"doubling it: {at_half} {halved['values'][at_half]:.4f} -> {at_full} "
            f"{sweep['values'][at_full]:.4f} ({result['metric']}); largest amax movement of "
            f"{setting} from {full // 2} to {full}: {sweep['max_movement'][setting]:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--quick", action="store_true",
                        help=f"the two largest sizes and {QUICK_EVAL} evaluation samples")
    parser.add_argument("--real", nargs="+", choices=list(REAL), default=[],
                        help="models of the real-model suite to run instead of --models")
    parser.add_argument("--data-dir", nargs="+", type=Path, default=[],
                        help="folders holding NAME/calib.np[yz] and NAME/val.np[yz] of the real "
                             "models (and onet_models/onet_quantlab.onnx); generated if absent")
    parser.add_argument("--sizes", nargs="+", type=int,
                        help="calibration sizes of the --real sweeps (default: per model)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        result = CHILDREN[spec["kind"]](spec)
        print(json.dumps({**result, "peak_rss": bench.peak_rss()}))
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="quantlab-bench-sweep-") as scratch:
        if args.real:
            for name in args.real:
                results.append(real_benchmark(name, args.data_dir, Path(scratch), args.sizes))
                print(f"\n{name}\n{real_table(results[-1])}", flush=True)
        else:
            for name in args.models:
                results.append(benchmark(name, args.quick, Path(scratch)))
                print(f"\n{name}\n{table(results[-1])}", flush=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"sweep-{datetime.now():%Y%m%d-%H%M}.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
