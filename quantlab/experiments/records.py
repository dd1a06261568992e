"""Experiment folders as typed, versioned records: one class per kind of folder.

Each command's ``--out`` folder holds one JSON record (calibration.json, summary.json,
sweep.json) beside its models and report. The class of a kind names its files, writes
the folder all or nothing (:func:`quantlab.experiments.experiment.output_folder`), reads it back
with its format and version checked, and says which settings and figures the index
of runs (:mod:`quantlab.experiments.runs`) shows. One place per kind, so a new summary field is
one field here, and "re-report without re-running" is one ``read`` and one render.

Every record is written with ``"version"``; a file without one was written before
records had versions and reads as version 1. A reader refuses a newer version than
its own, a file of another kind and a missing or damaged file, naming the folder and
the file. A change of a field's meaning raises ``VERSION`` and reads the old one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from quantlab.errors import DataError
from quantlab.experiments.experiment import check_fields, output_folder, read_record, write_json

R = TypeVar("R", bound="FolderRecord")
# The stage whose test is the INT8 engine (validate.ENGINE is this name).
ENGINE_STAGE = "engine_int8"
# The key every record is written with (absent: version 1).
VERSION_KEY = "version"


@dataclass(kw_only=True)
class FolderRecord:
    """The JSON record of one experiment folder; subclasses declare its fields in file order."""

    KIND: ClassVar[str]  # the run's kind in the index (runs.Run.kind)
    COMMAND: ClassVar[str]  # the command that writes the folder
    FILE: ClassVar[str]  # the record's file in the folder
    WHAT: ClassVar[str]  # what messages call it
    FILES: ClassVar[tuple[str, ...]]  # what a run replaces in its --out (output_folder)
    VERSION: ClassVar[int] = 1
    # The "format" the file is written with, where it has one (sweep.json).
    FORMAT: ClassVar[str | None] = None
    # Checks and conversions of fields when read (experiment.check_fields).
    CHECKS: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}
    # Fields declared after files of the kind were first written: an older file has none,
    # so each is written only when set, and such a file reads and writes back the same.
    ADDED: ClassVar[frozenset[str]] = frozenset()

    # Fields of the file this class does not declare (an edited file, or one of a newer
    # quantlab of the same version): kept, written back and indexed as they are.
    others: dict = field(default_factory=dict)

    def values(self) -> dict:
        """The record's fields by name, as its file holds them, the undeclared ones last."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "others"
                   and not (f.name in self.ADDED and getattr(self, f.name) is None)},
                **self.others}

    def to_json(self) -> dict:
        """The record as its file holds it."""
        head = {"format": self.FORMAT} if self.FORMAT else {}
        return {**head, VERSION_KEY: self.VERSION, **self.values()}

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the record's file into `folder` (a staging folder of output_folder)."""
        return write_json(Path(folder) / self.FILE, self.to_json())

    def write(self, out: str | os.PathLike, force: bool = False,
              files: Callable[[Path], None] | None = None, produces: Iterable[str] = ()) -> Path:
        """Write the folder `out` all or nothing: ``files(staging)`` writes the run's other
        files, then the record; FILES and `produces` are what it replaces (see
        :func:`quantlab.experiments.experiment.output_folder`)."""
        with output_folder(out, force=force, produces=(*self.FILES, *produces)) as staging:
            if files is not None:
                files(staging)
            self.save(staging)
        return Path(out)

    @classmethod
    def is_kind(cls, data: Mapping) -> bool:
        """Whether the JSON object `data`, read from a file named FILE, is of this kind."""
        return cls.FORMAT is None or data.get("format") == cls.FORMAT

    @classmethod
    def holds(cls, folder: str | os.PathLike) -> bool:
        """Whether `folder` holds a run of this kind (cheap: the index asks every folder)."""
        return cls.has_record(folder)

    @classmethod
    def has_record(cls, folder: str | os.PathLike) -> bool:
        """Whether `folder` holds a readable FILE of this kind."""
        path = Path(folder) / cls.FILE
        if not path.is_file():
            return False
        try:
            return cls.is_kind(read_record(path, "record"))
        except DataError:
            return False

    @classmethod
    def read(cls: type[R], folder: str | os.PathLike) -> R:
        """The record of `folder`, its format, version and fields checked (DataError naming
        the folder and the file otherwise)."""
        folder = Path(folder)
        path = folder / cls.FILE
        made_by = f"the folder of a finished `{cls.COMMAND}` run"
        if not path.is_file():
            raise DataError(f"{folder} holds no {cls.FILE}, so it is not {made_by}"
                            f"{_holding(folder)}. Pass {made_by}.")
        data = read_record(path, cls.WHAT, made_by=made_by)
        version = data.pop(VERSION_KEY, 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise DataError(f"{path}: field '{VERSION_KEY}' ({version!r}) is not a record "
                            f"version. Run `{cls.COMMAND}` again to rewrite {folder}.")
        if version > cls.VERSION:
            raise DataError(
                f"{path} was written by a newer quantlab (record version {version}; this one "
                f"reads up to {cls.VERSION}). Read {folder} with that quantlab, or run "
                f"`{cls.COMMAND}` again with this one.")
        if not cls.is_kind(data):
            raise DataError(f"{path} is not the {cls.FILE} of a `{cls.COMMAND}` run"
                            f"{_holding(folder)}. Pass {made_by}.")
        data.pop("format", None)
        missing = [f.name for f in fields(cls) if f.name not in data
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise DataError(f"{path} lacks the field(s) {', '.join(missing)}; it is damaged or "
                            f"was edited. Run `{cls.COMMAND}` again to rewrite {folder}.")
        check_fields(path, data, cls.CHECKS, f" Pass {made_by}, or write it again.")
        declared = {f.name for f in fields(cls)} - {"others"}
        return cls(**{name: value for name, value in data.items() if name in declared},
                   others={name: value for name, value in data.items() if name not in declared})

    def index_settings(self) -> dict[str, object]:
        """What the user chose for this run, as the index and the comparison show it."""
        return record_settings(self.values())

    def figures(self, folder: Path) -> dict[str, object]:
        """The run's key results (`folder`: where the record was read from)."""
        return {}

    def accuracy(self) -> dict[str, object]:
        """The INT8 model against FP32 as this record holds it (empty: it holds none)."""
        return {}


def _holding(folder: Path) -> str:
    """", which holds a `quantlab X` run" for the kind `folder` holds, or "" for none."""
    kind = record_kind(folder)
    return f" (it holds a `{kind.COMMAND}` run)" if kind is not None else ""


def _positive_batch(value: object) -> object:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError("expected a whole number of at least 1")
    return value


def _mapping(value: object) -> dict:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, not a {type(value).__name__}")
    return dict(value or {})


def _preprocess(value: object) -> dict | None:
    """A recorded preprocessing, checked to make a Preprocess (kept as its JSON object)."""
    from quantlab.data import Preprocess

    if value is None:
        return None
    recorded = _mapping(value)
    for key in ("size", "mean", "std"):
        numbers = recorded.get(key)
        if numbers is not None and not (isinstance(numbers, list) and all(
                isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers)):
            raise TypeError(f"its {key} is {numbers!r}, not a list of numbers")
    Preprocess.from_dict(recorded)
    return recorded


def _stamp(value: object) -> object:
    if value is not None and not isinstance(value, str):
        raise TypeError("expected a hexadecimal digest")
    return value


def _data_path(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError("expected the path of the calibration data")
    return value


@dataclass(kw_only=True)
class CalibrationRecord(FolderRecord):
    """calibration.json of a `quantlab calibrate` folder (also a sweep's best/)."""

    KIND: ClassVar[str] = "calibrate"
    COMMAND: ClassVar[str] = "quantlab calibrate"
    FILE: ClassVar[str] = "calibration.json"
    WHAT: ClassVar[str] = "calibration record"
    FILES: ClassVar[tuple[str, ...]] = (
        "model.onnx", "model.int8.onnx", "scales.json", "calibration.cache", "stats.npz",
        "calibration.json")
    CHECKS: ClassVar[Mapping[str, Callable[[Any], Any]]] = {
        "data": _data_path, "preprocess": _preprocess, "data_stamp": _stamp,
        "frozen_inputs": _mapping, "sample_axes": _mapping}
    ADDED: ClassVar[frozenset[str]] = frozenset({"weight_rounding", "weight_rounding_choice"})

    # The user's model file (absolute) or zoo name; model.onnx is its normalized copy.
    model: str
    # Absolute (an older quantlab recorded it as typed: see data_path).
    data: str
    # Size and mtime of its files: `plan --data DIR` reuses stats.npz only while unchanged.
    data_stamp: str | None = None
    num_samples: int
    batch_size: int | None = None
    method: str
    params: dict
    tensors: int
    trt_version: str | None = None
    # How the images were read (Preprocess.to_dict), null where none was applied.
    preprocess: dict | None = None
    frozen_inputs: dict = field(default_factory=dict)
    sample_axes: dict = field(default_factory=dict)
    onnxruntime_session_config: dict | None = None
    repairs: dict | None = None
    repairs_requested: dict | None = None
    weight_amax: str | None = None
    weight_amax_choice: dict | None = None
    weight_rounding: str | None = None
    weight_rounding_choice: dict | None = None
    layer_calibrators: dict | None = None
    phases: list | None = None

    @classmethod
    def holds(cls, folder: str | os.PathLike) -> bool:
        """A calibrate folder holds scales.json beside calibration.json."""
        return (Path(folder) / cls.FILE).is_file() and (Path(folder) / "scales.json").is_file()

    @classmethod
    def read(cls, folder: str | os.PathLike) -> CalibrationRecord:
        """The record, ``data`` made absolute where an older quantlab recorded it relative
        (as typed): against the folder, else the working directory. A description that is
        no path ("arrays") stays as recorded."""
        record = super().read(folder)
        recorded = Path(record.data)
        if not recorded.is_absolute():
            found = next((p for p in (Path(folder) / recorded, recorded) if p.exists()), None)
            if found is not None:
                record.data = str(found.resolve())
        return record

    def preprocessing(self):
        """The recorded preprocessing as a :class:`quantlab.data.Preprocess`, or None."""
        from quantlab.data import Preprocess

        return Preprocess.from_dict(self.preprocess) if self.preprocess is not None else None

    def figures(self, folder: Path) -> dict[str, object]:
        method = " ".join([self.method, *(f"{v:g}" for v in self.params.values())])
        figures = {"method": method, "samples": self.num_samples, "tensors": self.tensors}
        if self.phases:  # what each phase cost: the index and the comparison page show it
            figures["seconds"] = round(sum(p["seconds"] for p in self.phases), 1)
            figures["phases"] = "; ".join(
                f"{p['phase']} {p['seconds']:.1f} s ({p['samples']} samples, "
                f"{p['model_runs']} runs)" for p in self.phases)
        return figures


# summary.json's "generator" of a plan folder: `quantlab build` reads its batch from it.
PLAN_GENERATOR = "quantlab plan"
DEMO_GENERATOR = "quantlab demo"
# Where a plan that scored inside the budget but could not be certified is written.
UNCERTIFIED = "uncertified"


@dataclass(kw_only=True)
class PlanSummary(FolderRecord):
    """summary.json of a `quantlab plan` folder (beside plan.json, the models, trtexec.txt)."""

    KIND: ClassVar[str] = "plan"
    COMMAND: ClassVar[str] = "quantlab plan"
    FILE: ClassVar[str] = "summary.json"
    WHAT: ClassVar[str] = "plan summary"
    FILES: ClassVar[tuple[str, ...]] = (
        "plan.json", "model.onnx", "model.int8.onnx", "calibration.cache",
        "calibration.trtexec.cache", "trtexec.txt", "summary.json", "report.html", UNCERTIFIED)
    CHECKS: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"max_batch": _positive_batch}

    model: str | None = None
    metric: str
    budget: dict  # max_drop, min_sqnr
    int8_mac_share: float
    certificate: dict  # planner.certify.Certificate's fields
    # "all-FP16" or "FP32" when no plan with INT8 certified and this is the fallback.
    fallback: str | None = None
    # Tensors quantized with every unit out of INT8 (none: every drop is the units').
    quantized_outside_units: list = field(default_factory=list)
    # The evaluation ledger: share, prediction, value, certified, interval, seconds, ...
    evaluations: list = field(default_factory=list)
    front: list = field(default_factory=list)  # the predicted front: int8_mac_share, predicted
    trials: int | None = None
    # Seconds per step of the planning flow (docs/planner.md).
    phases: dict = field(default_factory=dict)
    # A trial's median seconds against a warm FP32 pass over the same samples.
    trial_cost: object = None
    # The noise model checked: plans measured against its prediction (front checks,
    # localization) and every evaluated plan's prediction on the hardest samples.
    noise_model: dict = field(default_factory=dict)
    hard_samples: object = None
    calibration: dict  # data, method, calibrators
    eval: dict  # data, num_samples
    # `quantlab build DIR` reads these: trtexec.txt's profile is for this batch.
    generator: str = PLAN_GENERATOR
    max_batch: int | None = None
    repairs: list = field(default_factory=list)
    # The certified plan is this folder's; a better one that could not be certified on
    # this evaluation set is in uncertified/ (null: none).
    uncertified: dict | None = None
    next_steps: list = field(default_factory=list)

    @classmethod
    def is_kind(cls, data: Mapping) -> bool:
        """A plan's summary.json (one written before "generator" has none, nor "pairs")."""
        return data.get("generator", PLAN_GENERATOR) == PLAN_GENERATOR and "pairs" not in data

    @classmethod
    def holds(cls, folder: str | os.PathLike) -> bool:
        """A plan folder is marked by its plan.json."""
        return (Path(folder) / "plan.json").is_file()

    def index_settings(self) -> dict[str, object]:
        return {"metric": self.metric, **{f"budget.{k}": v for k, v in self.budget.items()},
                "data": self.calibration["data"], "method": self.calibration["method"],
                "eval": self.eval["data"], "eval_samples": self.eval["num_samples"]}

    def figures(self, folder: Path) -> dict[str, object]:
        certificate = self.certificate
        figures = {"int8_mac_share": self.int8_mac_share, self.metric: certificate["value"],
                   "fp32": certificate["reference"], "certified": certificate["certified"],
                   "margin_interval": certificate["interval"]}
        if not self.int8_mac_share:
            # No plan with INT8 certified: the planner fell back to the high-precision model.
            units = read_record(folder / "plan.json", "plan")["units"].values()
            precisions = sorted({u["precision"] for u in units})
            figures = {"plan": f"fallback: all-{'/'.join(p.upper() for p in precisions)}, "
                               "no INT8", **figures}
        return figures

    def accuracy(self) -> dict[str, object]:
        return {self.certificate["metric"]: self.certificate["value"],
                "fp32": self.certificate["reference"]}


@dataclass(kw_only=True)
class ValidationSummary(FolderRecord):
    """summary.json of a `quantlab validate` folder (beside layers_<A>_vs_<B>.csv per pair)."""

    KIND: ClassVar[str] = "validate"
    COMMAND: ClassVar[str] = "quantlab validate"
    FILE: ClassVar[str] = "summary.json"
    WHAT: ClassVar[str] = "validation summary"
    FILES: ClassVar[tuple[str, ...]] = ("summary.json", "report.html")

    samples: int
    data: str
    # The calibration folder validated (--from): compare and report find this run by it.
    calibration: str | None = None
    mode: str
    stages: dict  # stage name -> what it runs
    task: str | None = None
    metrics: dict  # stage -> task metrics
    # --metric: the engine against FP32 end to end, with its paired bootstrap interval.
    metric: dict | None = None
    divergence_rule: dict = field(default_factory=dict)  # threshold_db, min_drop_db
    tolerance: dict = field(default_factory=dict)  # atol, rtol
    memory: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    # Per stage pair: its layers csv, first divergence, output errors (validate._pair_record).
    pairs: list
    next_steps: list = field(default_factory=list)

    @classmethod
    def is_kind(cls, data: Mapping) -> bool:
        return "pairs" in data and "generator" not in data

    def engine_pair(self) -> dict | None:
        """The pair whose test is the INT8 engine, if validated."""
        return next((p for p in self.pairs if p["test"] == ENGINE_STAGE), None)

    def index_settings(self) -> dict[str, object]:
        return {"data": self.data, "samples": self.samples, "mode": self.mode,
                "stages": sorted(self.stages)}

    def figures(self, folder: Path) -> dict[str, object]:
        figures = {f"{stage}.{name}": value for stage, metrics in self.metrics.items()
                   for name, value in metrics.items() if not isinstance(value, Mapping)}
        pair = self.engine_pair()
        if pair is not None and pair["first_divergence"]:
            figures["first_divergence"] = pair["first_divergence"].get("tensor")
        return figures

    def accuracy(self) -> dict[str, object]:
        """The engine against FP32: output SQNR (dB) and, with --metric, the metric's INT8
        value, its change and the change's interval."""
        accuracy = {}
        pair = self.engine_pair()
        if pair is not None and pair["output_sqnr_db"] is not None:
            accuracy["output_sqnr_db"] = pair["output_sqnr_db"]
        if self.metric:
            name = self.metric["name"]
            accuracy[name] = self.metric[ENGINE_STAGE]
            if self.metric.get("change") is not None:
                accuracy[f"{name}.change"] = self.metric["change"]
                accuracy[f"{name}.interval"] = self.metric["interval"]
        return accuracy


@dataclass(kw_only=True)
class SweepRecord(FolderRecord):
    """sweep.json of a `quantlab sweep` folder (beside amax_movement.csv and best/)."""

    KIND: ClassVar[str] = "sweep"
    COMMAND: ClassVar[str] = "quantlab sweep"
    FILE: ClassVar[str] = "sweep.json"
    WHAT: ClassVar[str] = "sweep record"
    FILES: ClassVar[tuple[str, ...]] = ("sweep.json", "amax_movement.csv", "report.html", "best")
    FORMAT: ClassVar[str | None] = "quantlab.sweep"

    model: str
    metric: str
    calibration: dict  # data, num_samples
    eval: dict  # data, num_samples
    sizes: list
    settings: list  # the calibrator settings swept (a method and its parameters)
    tolerance: float
    equalized: list
    collection_passes: int
    configurations: list  # sweep.Config records: label, value, interval, ...
    best: str
    # The calibrate command whose folder is best/ (the same scales and Q/DQ model).
    reproduce: str
    runner_up: str | None
    separation: dict | None
    sufficiency: dict
    max_movement: dict
    bootstrap_spread: dict
    seconds: float

    def best_configuration(self) -> dict:
        """The configuration record of the best label."""
        return next(r for r in self.configurations if r["label"] == self.best)

    def index_settings(self) -> dict[str, object]:
        return {"model": self.model, "metric": self.metric, "data": self.calibration["data"],
                "eval": self.eval["data"], "eval_samples": self.eval["num_samples"],
                "sizes": self.sizes, "settings": self.settings,
                "tolerance": self.tolerance}

    def figures(self, folder: Path) -> dict[str, object]:
        best = self.best_configuration()
        return {"best": best["label"], self.metric: best["value"], "interval": best["interval"],
                "configurations": len(self.configurations),
                **{f"sufficiency.{k}": v for k, v in self.sufficiency.items()}}

    def accuracy(self) -> dict[str, object]:
        return {self.metric: self.best_configuration()["value"]}


@dataclass(kw_only=True)
class DemoSummary(FolderRecord):
    """summary.json of a `quantlab demo` folder (beside report.html and a folder per model)."""

    KIND: ClassVar[str] = "demo"
    COMMAND: ClassVar[str] = "quantlab demo"
    FILE: ClassVar[str] = "summary.json"
    WHAT: ClassVar[str] = "demo summary"
    FILES: ClassVar[tuple[str, ...]] = ("report.html", "summary.json")

    generator: str = DEMO_GENERATOR
    methods: list
    seconds: float
    # Per zoo model: its metrics per method, latencies, and for the planned one its
    # validation and plan (demo.run_model).
    models: list

    @classmethod
    def is_kind(cls, data: Mapping) -> bool:
        return data.get("generator") == DEMO_GENERATOR

    def index_settings(self) -> dict[str, object]:
        return {"methods": self.methods}

    def figures(self, folder: Path) -> dict[str, object]:
        return self.accuracy()

    def accuracy(self) -> dict[str, object]:
        return {f"{m['name']}.{m['metric']}": m["int8"] for m in self.models}


# The kinds in the order a folder is recognized: a sweep's folder holds no calibration.json
# of its own (best/ does), a plan's has no scales.json, validate and demo both write
# summary.json.
KINDS: tuple[type[FolderRecord], ...] = (SweepRecord, PlanSummary, CalibrationRecord,
                                         ValidationSummary, DemoSummary)


def record_kind(folder: str | os.PathLike) -> type[FolderRecord] | None:
    """The record class of the run `folder` holds, or None when it is no experiment folder."""
    return next((kind for kind in KINDS if kind.holds(folder)), None)


# Fields of a record that are results or fingerprints rather than something the user chose.
NOT_SETTINGS = frozenset({"data_stamp", "tensors", "phases"})


def record_settings(record: Mapping, prefix: str = "") -> dict[str, object]:
    """Every field of a run's record as a dotted name -> value, so that an option a command
    starts recording shows up without code here: scalars and lists of scalars as they are,
    a record one level down flattened, one deeper (a repair's report) summarized as its
    scalars and the lengths of its lists."""
    settings = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if key in NOT_SETTINGS:
            continue
        if isinstance(value, Mapping) and not prefix:
            settings.update(record_settings(value, f"{name}."))
        elif isinstance(value, Mapping):
            settings[name] = _summary(value)
        elif _plain(value):
            settings[name] = value
        else:
            settings[name] = f"{len(value)} entries"
    return settings


def _plain(value: object) -> bool:
    """A scalar, or a list of scalars."""
    if isinstance(value, (list, tuple)):
        return all(not isinstance(v, (Mapping, list, tuple)) for v in value)
    return not isinstance(value, Mapping)


def _summary(record: Mapping) -> str:
    """A nested record in one line: its scalars, and the length of its lists."""
    parts = [f"{k} {v}" if not isinstance(v, (Mapping, list, tuple)) else f"{k} {len(v)}"
             for k, v in record.items() if not isinstance(v, Mapping)]
    return ", ".join(parts) or f"{len(record)} entries"


def read_calibration_record(folder: str | os.PathLike) -> dict:
    """``calibration.json`` of a `quantlab calibrate` folder as a dict, its fields checked
    (:class:`CalibrationRecord`), ``preprocess`` a
    :class:`quantlab.data.Preprocess` or None."""
    record = CalibrationRecord.read(folder)
    return {**record.values(), "preprocess": record.preprocessing()}

