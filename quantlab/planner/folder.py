"""A plan's folder: its file names, its writer, and the readers `quantlab build` uses.

Written all or nothing through its record, :class:`quantlab.experiments.records.PlanSummary`
(summary.json), which names its files: plan.json, model.onnx, model.int8.onnx,
trtexec.txt, summary.json, report.html, with a TensorRT version also calibration.cache
(and its trtexec copy), and uncertified/ where a better plan could not be certified.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from quantlab.errors import DataError
from quantlab.experiments.experiment import read_record
from quantlab.experiments.records import UNCERTIFIED, PlanSummary

# The checkpoint of a running plan, left in the folder when it is interrupted.
PROGRESS_FILE = ".plan-progress.json"


@dataclass
class PlanRun:
    """What summary.json records of how a plan was made besides the planner's result: the
    user's model, the budget, the data, the starting calibration and the batch trtexec.txt's
    profile is for."""

    model_file: str
    metric: str
    max_drop: float | None
    min_sqnr: float | None
    calibration_data: str
    method: str
    calibrators: list[str]
    eval_data: str
    eval_samples: int
    max_batch: int


def read_plan(path: str | os.PathLike) -> dict[str, str]:
    """{ONNX node name: precision} from a plan.json or a flat JSON mapping."""
    data = read_record(path, "plan", made_by="the plan.json written by `quantlab plan` or a "
                                             "JSON {node: precision}")
    if isinstance(data.get("units"), dict):
        try:
            return {node: str(unit["precision"]) for unit in data["units"].values()
                    for node in unit["nodes"]}
        except (KeyError, TypeError):
            raise DataError(f"plan {path}: a unit lacks 'precision' or 'nodes'.") from None
    if all(isinstance(v, str) for v in data.values()):
        return dict(data)
    raise DataError(f"plan {path} is neither a plan.json nor a JSON {{node: precision}} mapping.")


def planned_batch(folder: Path) -> int | None:
    """The batch a `quantlab plan` folder's trtexec.txt was written for (its summary.json),
    or None for another folder."""
    return PlanSummary.read(folder).max_batch if PlanSummary.has_record(folder) else None


def write_plan_folder(out: str | os.PathLike, result, run: PlanRun, profile,
                      trt_version: str | None, force: bool, steps: list[str]) -> PlanSummary:
    """Write `result` (a :class:`quantlab.planner.flow.PlanResult`) into `out`, trtexec.txt
    for the TensorRT `profile` and, with `trt_version`, the calibration cache without the
    pinned units' tensors; `steps` are the next steps the report and summary name. Returns
    summary.json's record."""
    from quantlab import graph
    from quantlab.engine import trtexec
    from quantlab.engine.backends import tensorrt as trt_backend
    from quantlab.experiments.experiment import write_text
    from quantlab.experiments.report import write_report
    from quantlab.experiments.report.plan import plan_section

    def files(folder: Path) -> None:
        result.plan.save(folder / "plan.json")
        graph.save_model(result.model, folder / "model.onnx")  # repaired when plan.json says
        graph.save_model(result.qdq_model, folder / "model.int8.onnx")
        if result.uncertified is not None:
            kept_plan, kept_model, _ = result.uncertified
            (folder / UNCERTIFIED).mkdir()
            kept_plan.save(folder / UNCERTIFIED / "plan.json")
            graph.save_model(kept_model, folder / UNCERTIFIED / "model.int8.onnx")
        cache_name, header = (None, None) if trt_version is None else _write_cache(
            folder, result, run.method, trt_version)
        write_text(folder / "trtexec.txt", trtexec.trtexec_text(
            trt_backend.implicit_pins(result.model, result.plan.node_precisions()), profile,
            cache_name, header and str(header), trt_backend.explicit_build_pins(result.qdq_model)))
        write_report(folder / "report.html", f"Plan of {Path(run.model_file).name}",
                     [plan_section(result, steps)], subtitle=run.model_file)

    summary = summary_record(result, run, steps)
    summary.write(out, force, files)
    (Path(out) / PROGRESS_FILE).unlink(missing_ok=True)
    return summary


def _uncertified(result) -> dict | None:
    """summary.json's ``uncertified``: the better plan written to uncertified/, or None."""
    if result.uncertified is None:
        return None
    certificate = result.uncertified[2].certificate
    return {"folder": UNCERTIFIED, "certified": False,
            "int8_mac_share": result.uncertified[2].int8_mac_share,
            "value": certificate.value, "limit": certificate.limit,
            "margin_interval": list(certificate.interval), "samples": certificate.samples,
            "needed_samples": certificate.needed_samples or certificate.samples_to_certify()}


def _write_cache(folder: Path, result, method: str, trt_version: str):
    """calibration.cache of the plan's INT8 tensors (the pinned units' left out) and, when
    `method`'s algorithm is not EntropyCalibration2, the relabelled copy trtexec reads;
    (the name trtexec.txt names, its header)."""
    from quantlab import graph
    from quantlab.calibration.pipeline import CACHE_ALGORITHM
    from quantlab.engine import cache
    from quantlab.planner.decisions import pinned_tensors

    pinned = pinned_tensors(result.plan, graph.Graph(result.model))
    kept = {name: amax / 127.0 for name, amax in result.amax.items() if name not in pinned}
    cache.write_calibration_cache(folder / "calibration.cache", kept,
                                  algorithm=CACHE_ALGORITHM[method], trt_version=trt_version)
    cache_name = "calibration.cache"
    if CACHE_ALGORITHM[method] != "EntropyCalibration2":
        cache_name = cache.TRTEXEC_CACHE
        cache.write_calibration_cache(folder / cache_name, kept, "EntropyCalibration2",
                                      trt_version=trt_version)
    header, _ = cache.read_calibration_cache(folder / cache_name)
    return cache_name, header


def summary_record(result, run: PlanRun, steps: list[str]) -> PlanSummary:
    """summary.json of a plan folder: the certificate, the evaluation ledger, the predicted
    front, seconds per step, the noise model's checks, and what `run` records."""
    from quantlab.planner.trials import DISAGREEMENT

    return PlanSummary(
        model=run.model_file,
        metric=run.metric,
        budget={"max_drop": run.max_drop, "min_sqnr": run.min_sqnr},
        int8_mac_share=result.plan.int8_mac_share(),
        certificate=result.certificate.__dict__,
        fallback=result.fallback,
        quantized_outside_units=result.outside_units,
        evaluations=[{"int8_mac_share": e.int8_mac_share, "predicted": e.predicted,
                      "value": e.certificate.value, "certified": e.certificate.certified,
                      "interval": e.certificate.interval, "seconds": e.seconds,
                      "model_run": e.model_run, "screened": e.screened, "note": e.note}
                     for e in result.evaluations],
        front=[{"int8_mac_share": p.int8_mac_share, "predicted": p.predicted}
               for p in result.front],
        trials=len(result.sensitivity.nsr),
        phases=result.phases,
        trial_cost=result.trial_cost,
        noise_model={"disagreement_factor": DISAGREEMENT,
                     "largest_disagreement": result.largest_disagreement(),
                     # Plans the search chose, found noisier than predicted on the hardest
                     # samples before their evaluation: refitted, chosen again.
                     "refits": result.refits,
                     "checks": result.sensitivity.checks,
                     "evaluated": result.noise_checks},
        hard_samples=result.hard_samples,
        calibration={"data": run.calibration_data, "method": run.method,
                     "calibrators": run.calibrators},
        eval={"data": run.eval_data, "num_samples": run.eval_samples},
        max_batch=run.max_batch,
        repairs=result.plan.repairs,
        uncertified=_uncertified(result),
        next_steps=steps,
    )
