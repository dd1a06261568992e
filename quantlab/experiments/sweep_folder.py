"""A sweep's folder: its checkpoint while it runs, and what it writes when done (sweep.json,
amax_movement.csv, report.html and best/, the calibration folder of the best configuration,
with the `quantlab calibrate` command that reproduces it)."""

from __future__ import annotations

import shutil
from pathlib import Path

from quantlab.calibration import collect, pipeline
from quantlab.data import BatchSource
from quantlab.errors import DataError
from quantlab.experiments.experiment import Checkpoint, write_text
from quantlab.experiments.records import SweepRecord
from quantlab.experiments.sweep import Config, SweepResult

# Snapshots and finished configurations of a running sweep, left in the folder when
# interrupted.
PROGRESS_DIR = ".sweep-progress"
PROGRESS_FORMAT = "quantlab.sweep-progress"


def reproducing_command(model: str, data: str, best: Config, recorded: dict | None,
                        equalize: bool) -> str:
    """The `quantlab calibrate` command whose folder holds the scales and Q/DQ model of the
    sweep's `best` configuration: its calibrator on the first `best.size` samples, weights at
    max |w|, no bias correction, equalized as the sweep was (`equalize`). `recorded`:
    `data`'s calibration.json, when a folder. calibrate takes no `zoo` data: a zoo model's
    split is named as the .npy to save it to."""
    data = recorded["data"] if recorded else data
    if data == "zoo":
        data = f"{model}-calibration.npy"  # numpy.save(zoo.get(MODEL).calibration_set())
    parts = ["quantlab calibrate", str(model), "--data", str(data),
             "--max-samples", str(best.size), "--method", best.method,
             *(f"--{name} {value:g}" for name, value in best.params),
             "--weight-amax max --no-bias-correction"]
    if not equalize:
        parts.append("--no-equalize")
    return " ".join([*parts, "--out", "DIR"])


def write_sweep_folder(out: str, force: bool, model: str, metric: str, evaluation: str,
                       index, source: BatchSource, configs: list[Config], result: SweepResult,
                       repairs: dict, equalize: bool, reproduce: str) -> None:
    """sweep.json (:class:`quantlab.experiments.records.SweepRecord`), amax_movement.csv,
    report.html and best/ into `out`, all or nothing."""
    import pandas as pd

    from quantlab.experiments.report import write_report
    from quantlab.experiments.report.sweep import sweep_section

    best = configs[result.best]
    calibrated = pipeline.calibrate_from_stats(
        index, result.snapshots[best.size], source.subset(0, best.size), best.method,
        dict(best.params))
    calibrated.repairs = repairs
    calibrated.repairs_requested = {"depthwise_equalization": equalize, "bias_correction": False}
    movement = pd.DataFrame([
        {"setting": setting, "tensor": name, f"amax_{result.half}": half[name],
         f"amax_{result.full}": full[name], "movement": result.movement[setting][name],
         "bootstrap_spread": (result.spread.get(name, float("nan"))
                              if setting == best.setting else float("nan"))}
        for setting, (half, full) in result.amax.items() for name in full])
    record = SweepRecord(
        model=str(model),
        metric=metric,
        calibration={"data": source.description, "num_samples": source.num_samples},
        eval={"data": evaluation, "num_samples": result.records[0]["samples"]},
        sizes=sorted({c.size for c in configs}),
        settings=list(result.movement),
        tolerance=result.tolerance,
        equalized=[entry["tensor"] for entry in
                   repairs.get("depthwise_equalization", {}).get("applied", [])],
        collection_passes=1,
        configurations=result.records,
        best=result.best_record["label"],
        reproduce=reproduce,
        runner_up=(result.records[result.runner_up]["label"]
                   if result.runner_up is not None else None),
        separation=result.separation.__dict__ if result.separation else None,
        sufficiency=result.sentences,
        max_movement={s: max(m.values(), default=0.0) for s, m in result.movement.items()},
        bootstrap_spread={"setting": best.setting, "samples": result.spread_samples,
                          "blocks": result.spread_blocks,
                          "max": max(result.spread.values(), default=None)},
        seconds=result.seconds)

    def files(folder: Path) -> None:
        pipeline.write_results(calibrated, folder / "best")
        write_text(folder / "amax_movement.csv", movement.to_csv(index=False))
        write_report(folder / "report.html", f"quantlab sweep: {model}",
                     [sweep_section(result, metric, reproduce)],
                     subtitle=f"{len(configs)} configurations, one collection pass")

    record.write(out, force, files)


class SweepCheckpoint(Checkpoint):
    """A running sweep's finished configurations (records.json, a
    :class:`quantlab.experiments.experiment.Checkpoint`) and blocks of statistics
    (block-START-STOP.npz) in its folder's PROGRESS_DIR; another sweep's (another fingerprint) are
    deleted."""

    def __init__(self, folder: Path, fingerprint: str):
        self.folder = folder
        super().__init__(folder / "records.json", PROGRESS_FORMAT, fingerprint,
                         {"records": dict})
        if self.ignored or not self.path.is_file():
            # Another sweep's, unreadable, or none: blocks beside it are not this sweep's.
            self.ignored = folder.exists()
            self.remove()

    @property
    def records(self) -> dict[str, dict]:
        return self.sections["records"]

    def blocks(self) -> dict:
        """The blocks of statistics saved so far, by (first sample, stop); none, and the
        checkpoint deleted (``ignored``), when one cannot be read (a run killed while writing
        it, a damaged disk): the sweep then starts over."""
        found = {}
        try:
            for path in self.folder.glob("block-*.npz"):
                _, start, stop = path.stem.split("-")
                found[int(start), int(stop)] = collect.Statistics.load(path)
        except (DataError, ValueError):
            self.ignored = True
            self.remove()
            return {}
        return found

    def add_block(self, start: int, stop: int, stats: collect.Statistics) -> None:
        """Save the statistics of samples `start:stop`."""
        self.save()
        stats.save(self.folder / f"block-{start}-{stop}.npz")

    def add_record(self, record: dict) -> None:
        """Save one finished configuration."""
        self.add("records", record["label"], record)

    def remove(self) -> None:
        """Delete the checkpoint (a finished or a different sweep)."""
        self.discard()
        shutil.rmtree(self.folder, ignore_errors=True)
