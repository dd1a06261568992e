"""Experiment folders as runs: their kind, settings and key figures; an index; two side by side.

A run is a folder one command wrote (:mod:`quantlab.experiments.experiment`): ``calibrate``
(calibration.json), ``sweep`` (sweep.json), ``plan`` (plan.json), ``validate``
(summary.json with stage pairs) or ``demo``. This module only reads them:
:func:`load_run` says what a folder holds, :func:`find_runs` lists every run
under some roots, :func:`compare_runs` puts two side by side (settings that differ,
per-tensor scale ratios, per-layer SQNR where both were validated, metrics).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from quantlab.errors import ConfigError, DataError
from quantlab.experiments.experiment import is_leftover
from quantlab.experiments.records import (
    KINDS,
    CalibrationRecord,
    FolderRecord,
    PlanSummary,
    ValidationSummary,
    record_kind,
)

# The file that marks each kind of run (records.KINDS: the order they are recognized in).
MARKERS = {kind.KIND: "plan.json" if kind is PlanSummary else kind.FILE for kind in KINDS}


@dataclass
class Run:
    """One experiment folder: its kind, when it was written, its settings and key figures."""

    path: Path
    kind: str
    time: float
    settings: dict[str, object] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)
    # The INT8 model against FP32 (output SQNR, the --metric result) and the folder it was
    # read from (the run itself, or a validate run of it); empty when none holds one.
    accuracy: dict[str, object] = field(default_factory=dict)
    accuracy_from: Path | None = None

    @property
    def report(self) -> Path | None:
        """Its report.html, when it has one."""
        path = self.path / "report.html"
        return path if path.is_file() else None

    @property
    def model_folder(self) -> Path:
        """The folder holding its model.onnx and model.int8.onnx (a sweep's: best/, its best
        configuration's calibration)."""
        return self.path / "best" if self.kind == "sweep" else self.path

    @property
    def scales_file(self) -> Path | None:
        """The scales.json its INT8 model was made from (a sweep's: its best configuration's)."""
        path = self.model_folder / "scales.json"
        return path if path.is_file() else None


def run_kind(folder: str | os.PathLike) -> str | None:
    """The kind of run `folder` holds, or None when it is not an experiment folder."""
    kind = record_kind(folder)
    return kind.KIND if kind is not None else None


def load_run(folder: str | os.PathLike) -> Run:
    """The run in `folder`; ConfigError naming what an experiment folder holds if it is none."""
    folder = Path(folder)
    kind = record_kind(folder)
    if kind is None:
        raise ConfigError(
            f"{folder} is not a quantlab experiment folder: it holds none of calibration.json "
            "(with scales.json; `quantlab calibrate`), sweep.json (`quantlab sweep`), plan.json "
            "(`quantlab plan`) or a summary.json of `quantlab validate` / `quantlab demo`. "
            "Pass the --out folder of one of those commands.")
    try:
        record = kind.read(folder)
        settings, figures = record.index_settings(), record.figures(folder)
        accuracy, source = _accuracy(folder, record)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{folder / kind.FILE} is damaged or was edited ({exc!r}); run "
                        "the command again to rewrite it.") from None
    return Run(folder, kind.KIND, (folder / MARKERS[kind.KIND]).stat().st_mtime, settings,
               figures, accuracy, source)


def validations(folder: str | os.PathLike) -> list[Path]:
    """The validate runs of a calibration `folder`, newest first: those inside it, and those
    beside it that were run with ``--from`` it (their summary.json's ``calibration``)."""
    folder = Path(folder).resolve()
    inside = [p for p in folder.iterdir() if p.is_dir() and ValidationSummary.holds(p)]
    beside = [p for p in folder.parent.iterdir()
              if p.is_dir() and p != folder and ValidationSummary.holds(p)
              and ValidationSummary.read(p).calibration == str(folder)]
    return sorted(inside + beside, key=lambda p: -(p / ValidationSummary.FILE).stat().st_mtime)


def _accuracy(folder: Path, record: FolderRecord) -> tuple[dict, Path | None]:
    """(accuracy, the folder holding it) of the run in `folder` whose record is `record`: a
    calibration's is its newest validation's."""
    if isinstance(record, CalibrationRecord):
        for validation in validations(folder):
            return ValidationSummary.read(validation).accuracy(), validation
        return {}, None
    return record.accuracy(), folder


def accuracy_text(run: Run) -> str:
    """`run`'s accuracy in one line, or the command that measures it."""
    if run.accuracy:
        return "; ".join(f"{name} {as_text(value)}" for name, value in run.accuracy.items())
    data = run.settings.get("data")
    data = data if isinstance(data, str) and Path(data).exists() else "DATA"
    return (f"none recorded: `quantlab validate --from {run.path} --data {data} --metric "
            f"agreement --out {run.path / 'validate'}` measures it (or --metric top1/map "
            "with --zoo, or your module:function)")


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
    """The FP32-vs-INT8 per-layer table of `run`, or of its newest validate run (inside the
    folder, or beside it: :func:`validations`)."""
    candidates = [run.path] if run.kind == ValidationSummary.KIND else validations(run.path)
    for candidate in candidates:
        pair = ValidationSummary.read(candidate).engine_pair()
        if pair is not None:
            return pd.read_csv(candidate / pair["layers_csv"])
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
    accuracy: pd.DataFrame  # figure, a, b: the INT8 model against FP32 (accuracy_text if none)


def compare_runs(a: Run, b: Run) -> Comparison:
    """Settings that differ, per-tensor scale ratios, per-layer SQNR differences (where both
    were validated) and the key figures of runs `a` and `b`."""
    from quantlab.calibration.calibrate import Scales

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
    measured = list(dict.fromkeys([*a.accuracy, *b.accuracy]))
    accuracy = pd.DataFrame(
        [{"figure": k, "a": as_text(a.accuracy.get(k)), "b": as_text(b.accuracy.get(k))}
         for k in measured]
        + [{"figure": "measured in", "a": _measured_in(a), "b": _measured_in(b)}],
        columns=["figure", "a", "b"])
    return Comparison(a, b, settings, scales, layers, figures, accuracy)


def _measured_in(run: Run) -> str:
    return str(run.accuracy_from) if run.accuracy else accuracy_text(run)


def as_text(value: object) -> str:
    """A setting or figure as a table shows it."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return str(value)
