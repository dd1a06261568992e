"""Experiment folders as typed, versioned records: round trips, main's version-less files, and
the errors for a folder of another kind, a newer version and a missing or damaged file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantlab.errors import DataError
from quantlab.experiments import runs
from quantlab.experiments.experiment import Checkpoint, read_json, write_json
from quantlab.experiments.records import (
    KINDS,
    CalibrationRecord,
    DemoSummary,
    PlanSummary,
    SweepRecord,
    ValidationSummary,
    read_calibration_record,
    record_kind,
)

# Records written by main's code before they had a version (data/main-records/README.md).
MAIN = Path(__file__).parents[1] / "data" / "main-records"
FIXTURES = {CalibrationRecord: "calibration.json", PlanSummary: "plan-summary.json",
            ValidationSummary: "validation-summary.json", SweepRecord: "sweep.json",
            DemoSummary: "demo-summary.json"}


def _main_folder(kind, folder: Path) -> Path:
    """A folder holding main's record of `kind` under its file name (a plan's with plan.json,
    a calibration's with a scales.json beside it)."""
    folder.mkdir()
    shutil.copy(MAIN / FIXTURES[kind], folder / kind.FILE)
    if kind is PlanSummary:
        shutil.copy(MAIN / "plan.json", folder / "plan.json")
    if kind is CalibrationRecord:
        (folder / "scales.json").write_text("{}")
    return folder


def _with_version(text: str, head: str = "{\n") -> str:
    """Main's file text with the one line records add after `head`."""
    assert text.startswith(head)
    return f'{head}  "version": 1,\n{text[len(head):]}'


@pytest.mark.parametrize("kind", list(FIXTURES), ids=lambda k: k.KIND)
def test_a_folder_written_by_main_reads_as_version_1_and_writes_back_the_same_bytes(
        kind, tmp_path):
    folder = _main_folder(kind, tmp_path / "main")
    record = kind.read(folder)
    original = (MAIN / FIXTURES[kind]).read_text()
    data = read_json(MAIN / FIXTURES[kind])
    # Every field of main's file is a declared field of the record: none left over.
    assert record.others == {}
    assert record.values() == {k: v for k, v in data.items() if k != "format"}
    assert record_kind(folder) is kind
    record.save(tmp_path / "again")
    written = (tmp_path / "again" / kind.FILE).read_text()
    head = '{\n  "format": "quantlab.sweep",\n' if kind is SweepRecord else "{\n"
    assert written == _with_version(original, head)
    assert kind.read(tmp_path / "again") == record


@pytest.mark.parametrize("kind", list(FIXTURES), ids=lambda k: k.KIND)
def test_each_kind_round_trips_through_its_folder(kind, tmp_path):
    record = kind.read(_main_folder(kind, tmp_path / "main"))
    record.others = {"a_field_of_a_newer_quantlab": [1, 2]}

    def files(staging: Path) -> None:
        (staging / "report.html").write_text("<p>report</p>")

    out = record.write(tmp_path / "out", files=files)
    if kind is PlanSummary:
        shutil.copy(MAIN / "plan.json", out / "plan.json")
    if kind is CalibrationRecord:
        (out / "scales.json").write_text("{}")
    assert kind.read(out) == record
    assert (out / "report.html").is_file() and read_json(out / kind.FILE)["version"] == 1
    # written again over itself only with force, as every command's folder
    with pytest.raises(Exception, match="already holds results"):
        record.write(out)
    assert kind.read(record.write(out, force=True)) == record


def test_the_index_reads_main_folders_through_the_records(tmp_path):
    plan = runs.load_run(_main_folder(PlanSummary, tmp_path / "plan"))
    main = read_json(MAIN / "plan-summary.json")
    assert plan.kind == "plan" and plan.figures["int8_mac_share"] == main["int8_mac_share"]
    assert plan.accuracy == {"top1": main["certificate"]["value"],
                             "fp32": main["certificate"]["reference"]}
    validation = runs.load_run(_main_folder(ValidationSummary, tmp_path / "validate"))
    engine = next(p for p in read_json(MAIN / "validation-summary.json")["pairs"]
                  if p["test"] == "engine_int8")
    assert validation.accuracy["output_sqnr_db"] == engine["output_sqnr_db"]
    calibration = runs.load_run(_main_folder(CalibrationRecord, tmp_path / "calibrate"))
    assert calibration.settings["data"] == "array"  # no path: kept as recorded
    assert "version" not in calibration.settings
    sweep = runs.load_run(_main_folder(SweepRecord, tmp_path / "sweep"))
    best = read_json(MAIN / "sweep.json")["best"]
    assert sweep.figures["best"] == best


@pytest.mark.parametrize("kind", list(FIXTURES), ids=lambda k: k.KIND)
def test_a_folder_of_another_kind_is_refused_naming_the_folder_and_what_it_holds(kind, tmp_path):
    for other in FIXTURES:
        if other is kind:
            continue
        folder = _main_folder(other, tmp_path / other.KIND)
        with pytest.raises(DataError) as caught:
            kind.read(folder)
        message = str(caught.value)
        assert str(folder) in message and kind.FILE in message
        assert f"it holds a `{other.COMMAND}` run" in message
        assert f"`{kind.COMMAND}`" in message
        shutil.rmtree(folder)


@pytest.mark.parametrize("kind", list(FIXTURES), ids=lambda k: k.KIND)
def test_a_newer_version_is_refused(kind, tmp_path):
    folder = _main_folder(kind, tmp_path / "future")
    data = read_json(folder / kind.FILE)
    write_json(folder / kind.FILE, {**data, "version": kind.VERSION + 1})
    with pytest.raises(DataError, match=r"newer quantlab \(record version 2; this one reads "
                                        r"up to 1\)") as caught:
        kind.read(folder)
    assert str(folder / kind.FILE) in str(caught.value)


def test_a_missing_damaged_or_emptied_record_is_named(tmp_path):
    folder = _main_folder(ValidationSummary, tmp_path / "v")
    (folder / "summary.json").write_text('{"samples": 3, "pairs": [')
    with pytest.raises(DataError, match="summary.json is not a readable validation summary file"):
        ValidationSummary.read(folder)
    (folder / "summary.json").write_text('{"samples": 3, "pairs": []}')
    with pytest.raises(DataError, match="lacks the field.s. data, mode, stages, metrics;"):
        ValidationSummary.read(folder)
    with pytest.raises(DataError, match=f"{tmp_path / 'v'} holds no calibration.json"):
        CalibrationRecord.read(folder)
    with pytest.raises(DataError, match="field 'version' .'2'. is not a record version"):
        write_json(folder / "summary.json", {"version": "2"})
        ValidationSummary.read(folder)


def test_a_calibration_record_checks_its_fields_and_resolves_a_relative_data_path(tmp_path):
    folder = _main_folder(CalibrationRecord, tmp_path / "cal")
    (folder / "images").mkdir()
    data = read_json(folder / "calibration.json")
    write_json(folder / "calibration.json", {**data, "data": "images",
                                             "preprocess": {"size": [32, "x"]}})
    with pytest.raises(DataError, match="field 'preprocess'.*not a list of numbers"):
        CalibrationRecord.read(folder)
    write_json(folder / "calibration.json", {**data, "data": "images"})
    assert CalibrationRecord.read(folder).data == str((folder / "images").resolve())
    recorded = read_calibration_record(folder)
    assert recorded["preprocess"] is None and recorded["sample_axes"] == {"input": 0}


def test_kinds_are_recognized_in_order_and_every_kind_is_listed():
    assert {kind.KIND for kind in KINDS} == set(runs.MARKERS) == {
        "calibrate", "plan", "validate", "sweep", "demo"}
    assert runs.MARKERS["plan"] == "plan.json"  # a plan folder's summary.json is no marker


def test_a_checkpoint_resumes_its_own_run_only(tmp_path):
    path = tmp_path / "progress.json"
    sections = {"done": lambda done: {int(k): v for k, v in done.items()}}
    saved = Checkpoint(path, "quantlab.test-progress", "run-1", sections)
    saved.add("done", 3, {"value": 0.5})
    saved.add("done", 7, {"value": float("inf")})
    assert json.loads(path.read_text())["format"] == "quantlab.test-progress"
    resumed = Checkpoint(path, "quantlab.test-progress", "run-1", sections)
    assert resumed.sections == {"done": {3: {"value": 0.5}, 7: {"value": float("inf")}}}
    assert not resumed.ignored
    other = Checkpoint(path, "quantlab.test-progress", "run-2", sections)
    assert other.sections == {"done": {}} and other.ignored
    path.write_text("{")
    damaged = Checkpoint(path, "quantlab.test-progress", "run-1", sections)
    assert damaged.sections == {"done": {}} and damaged.ignored
    damaged.discard()
    assert not path.exists()
