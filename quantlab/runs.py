"""Experiment folders as runs: their kind, settings and key figures; an index; two side by side.

A run is a folder one command wrote (:mod:`quantlab.experiment`): ``calibrate``
(calibration.json), ``sweep`` (sweep.json), ``plan`` (plan.json), ``validate``
(summary.json with stage pairs) or ``demo``. This module only reads them:
:func:`load_run` says what a folder holds, :func:`find_runs` lists every run
under some roots, :func:`compare_runs` puts two side by side (settings that differ,
per-tensor scale ratios, per-layer SQNR where both were validated, metrics).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from quantlab.errors import ConfigError, DataError
from quantlab.experiment import is_leftover, read_json

# The file that marks each kind of run, in the order they are recognized (a sweep's
# folder holds no calibration.json of its own; a plan's has no scales.json).
MARKERS = {"sweep": "sweep.json", "plan": "plan.json", "calibrate": "calibration.json",
           "validate": "summary.json", "demo": "summary.json"}
ENGINE_STAGE = "engine_int8"


@dataclass
class Run:
    """One experiment folder: its kind, when it was written, its settings and key figures."""

    path: Path
    kind: str
    time: float
    settings: dict[str, object] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)

    @property
    def report(self) -> Path | None:
        """Its report.html, when it has one."""
        path = self.path / "report.html"
        return path if path.is_file() else None

    @property
    def scales_file(self) -> Path | None:
        """The scales.json its INT8 model was made from (a sweep's: its best configuration's)."""
        for path in (self.path / "scales.json", self.path / "best" / "scales.json"):
            if path.is_file():
                return path
        return None


def run_kind(folder: str | os.PathLike) -> str | None:
    """The kind of run `folder` holds, or None when it is not an experiment folder."""
    folder = Path(folder)
    for kind, marker in MARKERS.items():
        path = folder / marker
        if not path.is_file():
            continue
        if kind == "calibrate" and not (folder / "scales.json").is_file():
            continue
        if kind in ("validate", "demo"):
            try:
                summary = read_json(path)
            except (OSError, ValueError):
                continue
            is_demo = isinstance(summary, dict) and summary.get("generator") == "quantlab demo"
            if (kind == "demo") != is_demo or (kind == "validate" and "pairs" not in summary):
                continue
        return kind
    return None


def load_run(folder: str | os.PathLike) -> Run:
    """The run in `folder`; ConfigError naming what an experiment folder holds if it is none."""
    folder = Path(folder)
    kind = run_kind(folder)
    if kind is None:
        raise ConfigError(
            f"{folder} is not a quantlab experiment folder: it holds none of calibration.json "
            "(with scales.json; `quantlab calibrate`), sweep.json (`quantlab sweep`), plan.json "
            "(`quantlab plan`) or a summary.json of `quantlab validate` / `quantlab demo`. "
            "Pass the --out folder of one of those commands.")
    try:
        data = read_json(folder / MARKERS[kind])
        settings, figures = _READERS[kind](folder, data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{folder / MARKERS[kind]} is damaged or was edited ({exc!r}); run "
                        "the command again to rewrite it.") from None
    return Run(folder, kind, (folder / MARKERS[kind]).stat().st_mtime, settings, figures)


def _calibrate(folder: Path, data: dict) -> tuple[dict, dict]:
    settings = {"method": data["method"], **{f"params.{k}": v for k, v in data["params"].items()},
                "data": data["data"], "num_samples": data["num_samples"],
                "batch_size": data["batch_size"], "trt_version": data.get("trt_version"),
                **{f"preprocess.{k}": v for k, v in (data.get("preprocess") or {}).items()},
                "frozen_inputs": data.get("frozen_inputs")}
    method = " ".join([data["method"], *(f"{v:g}" for v in data["params"].values())])
    return settings, {"method": method, "samples": data["num_samples"],
                      "tensors": data["tensors"]}


def _sweep(folder: Path, data: dict) -> tuple[dict, dict]:
    best = next(r for r in data["configurations"] if r["label"] == data["best"])
    settings = {"model": data["model"], "metric": data["metric"],
                "data": data["calibration"]["data"], "eval": data["eval"]["data"],
                "eval_samples": data["eval"]["num_samples"], "sizes": data["sizes"],
                "settings": data["settings"], "tolerance": data["tolerance"]}
    figures = {"best": best["label"], data["metric"]: best["value"],
               "interval": best["interval"], "configurations": len(data["configurations"]),
               **{f"sufficiency.{k}": v for k, v in data["sufficiency"].items()}}
    return settings, figures


def _plan(folder: Path, data: dict) -> tuple[dict, dict]:
    summary = read_json(folder / "summary.json")
    certificate = summary["certificate"]
    settings = {"metric": summary["metric"], **{f"budget.{k}": v for k, v in
                                                summary["budget"].items()},
                "data": summary["calibration"]["data"], "method": summary["calibration"]["method"],
                "eval": summary["eval"]["data"], "eval_samples": summary["eval"]["num_samples"]}
    figures = {"int8_mac_share": summary["int8_mac_share"], summary["metric"]: certificate["value"],
               "fp32": certificate["reference"], "certified": certificate["certified"],
               "margin_interval": certificate["interval"]}
    return settings, figures


def _validate(folder: Path, data: dict) -> tuple[dict, dict]:
    settings = {"data": data["data"], "samples": data["samples"], "mode": data["mode"],
                "stages": sorted(data["stages"])}
    figures = {f"{stage}.{name}": value for stage, metrics in data["metrics"].items()
               for name, value in metrics.items() if not isinstance(value, Mapping)}
    for pair in data["pairs"]:
        if pair["test"] == ENGINE_STAGE and pair["first_divergence"]:
            figures["first_divergence"] = pair["first_divergence"].get("tensor")
    return settings, figures


def _demo(folder: Path, data: dict) -> tuple[dict, dict]:
    return ({"methods": data["methods"]},
            {f"{m['name']}.{m['metric']}": m["int8"] for m in data["models"]})


_READERS = {"calibrate": _calibrate, "sweep": _sweep, "plan": _plan, "validate": _validate,
            "demo": _demo}


def find_runs(roots: Iterable[str | os.PathLike]) -> list[Run]:
    """Every run in or under `roots`, newest first (hidden folders, such as staging folders
    and checkpoints, are skipped). ConfigError when a root is not a folder."""
    runs = []
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            raise ConfigError(f"{root} is not a folder; pass folders that hold experiment "
                              "folders (the --out folders of quantlab commands).")
        for folder, subfolders, _ in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders
                                   if not d.startswith(".") and not is_leftover(d))
            if run_kind(folder) is not None:
                runs.append(load_run(folder))
    return sorted(runs, key=lambda r: -r.time)


def validation_table(run: Run) -> pd.DataFrame | None:
    """The FP32-vs-INT8 per-layer table of `run`, or of a validate run directly inside it."""
    candidates = [run] if run.kind == "validate" else [
        load_run(p) for p in sorted(run.path.iterdir())
        if p.is_dir() and run_kind(p) == "validate"]
    for candidate in candidates:
        summary = read_json(candidate.path / MARKERS["validate"])
        for pair in summary["pairs"]:
            if pair["test"] == ENGINE_STAGE:
                return pd.read_csv(candidate.path / pair["layers_csv"])
    return None


@dataclass
class Comparison:
    """Two runs side by side."""

    a: Run
    b: Run
    settings: pd.DataFrame  # setting, a, b: those that differ
    scales: pd.DataFrame | None  # tensor, amax_a, amax_b, ratio (b / a), largest change first
    layers: pd.DataFrame | None  # tensor, sqnr_db_a, sqnr_db_b, difference (b - a)
    figures: pd.DataFrame  # figure, a, b


def compare_runs(a: Run, b: Run) -> Comparison:
    """Settings that differ, per-tensor scale ratios, per-layer SQNR differences (where both
    were validated) and the key figures of runs `a` and `b`."""
    from quantlab.calibrate import Scales

    keys = list(dict.fromkeys([*a.settings, *b.settings]))
    settings = pd.DataFrame(
        [{"setting": k, "a": as_text(a.settings.get(k)), "b": as_text(b.settings.get(k))}
         for k in keys if a.settings.get(k) != b.settings.get(k)],
        columns=["setting", "a", "b"])
    scales = None
    if a.scales_file and b.scales_file:
        amax_a, amax_b = Scales.load(a.scales_file).amax, Scales.load(b.scales_file).amax
        common = [name for name in amax_a if name in amax_b]
        scales = pd.DataFrame({"tensor": common, "amax_a": [amax_a[n] for n in common],
                               "amax_b": [amax_b[n] for n in common]})
        scales["ratio"] = scales["amax_b"] / scales["amax_a"]
        scales = scales.iloc[np.argsort(-np.abs(np.log(scales["ratio"].to_numpy())),
                                        kind="stable")].reset_index(drop=True)
    layers = None
    table_a, table_b = validation_table(a), validation_table(b)
    if table_a is not None and table_b is not None:
        layers = table_a[["tensor", "sqnr_db"]].merge(table_b[["tensor", "sqnr_db"]],
                                                      on="tensor", suffixes=("_a", "_b"))
        layers["difference"] = layers["sqnr_db_b"] - layers["sqnr_db_a"]
        finite = np.where(np.isfinite(layers["difference"]), layers["difference"], 0.0)
        layers = layers.iloc[np.argsort(finite, kind="stable")].reset_index(drop=True)
    names = list(dict.fromkeys([*a.figures, *b.figures]))
    figures = pd.DataFrame([{"figure": k, "a": as_text(a.figures.get(k)),
                             "b": as_text(b.figures.get(k))} for k in names],
                           columns=["figure", "a", "b"])
    return Comparison(a, b, settings, scales, layers, figures)


def as_text(value: object) -> str:
    """A setting or figure as a table shows it."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return str(value)
