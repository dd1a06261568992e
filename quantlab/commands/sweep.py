"""Sweep calibrators, their parameters and calibration-set sizes; judge whether the data suffice.

MODEL is an .onnx file or a zoo model name. Statistics are collected in ONE pass
over the largest calibration size, with a snapshot at every size (statistics are
mergeable, so the snapshot at n equals a collection over the first n samples);
every configuration (--methods x --percentiles x --calib-sizes) takes its scales
from its snapshot, and its INT8 Q/DQ model is evaluated on --eval in ONNX Runtime
(integer kernels) with the metric's paired bootstrap interval against FP32.
--data may be a calibration folder: its stats.npz serves the size equal to its
sample count and its data are re-read with the recorded preprocessing.

Data sufficiency, one sentence each: whether the calibration set is large enough
for the best configuration's method (every amax moves by less than --tolerance
from n/2 to n samples, or which tensors still move), and whether the evaluation
set tells the two best configurations apart (paired bootstrap of their difference).

The model is the one `quantlab calibrate` quantizes by default: depthwise-conv
inputs equalized first (from the largest calibration size's samples; one more FP32
pass), unless --no-equalize; a calibration folder's model.onnx is taken as it is.
The configurations differ in their activation scales alone: every one (and best/)
takes weight amax max |w| and no bias correction, as `quantlab calibrate --method M
--weight-amax max --no-bias-correction` does; calibrate's default weight choice and
bias correction then add to the chosen calibrator (a few passes each, not swept).

Statistics do not depend on the batch size (histograms of every element, merged
exactly), so the batch size is not swept.

Writes into --out: sweep.json (every configuration: metric, interval, delta vs FP32;
the sufficiency verdicts), amax_movement.csv (every tensor's amax at n/2 and n per
setting), report.html (metric vs method with intervals, metric vs calibration size,
the scales that have not converged) and best/ (a calibration folder of the best
configuration: `quantlab validate --from`, `plan --data` and `check --baseline`
read it). An interrupted sweep resumes from --out (snapshots and finished
configurations are checkpointed there) when the model, the data's content (hashed),
the preprocessing and the options are the same; otherwise it starts over. A sweep
estimated to take over an hour is refused unless --allow-long is given.

examples:
  quantlab sweep digits-cnn --data zoo --eval zoo --metric top1 --out runs/cnn-sweep
  quantlab sweep model.onnx --data runs/calib --eval images/ --calib-sizes 32 64 128 \\
      --methods entropy percentile --out runs/sweep
"""

from __future__ import annotations

import argparse

from quantlab.commands.options import (
    DATA_HELP,
    Number,
    add_data_arguments,
    add_metric_argument,
    open_share,
    percentile,
    positive_int,
)

HELP = "sweep calibrators x parameters x calibration sizes in one pass; data sufficiency"
EPILOG = DATA_HELP
SWEEP_FILES = ("sweep.json", "amax_movement.csv", "report.html", "best")
# Snapshots and finished configurations of a running sweep, left in --out when interrupted.
PROGRESS_DIR = ".sweep-progress"
PROGRESS_FORMAT = "quantlab.sweep-progress"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab sweep`."""
    from quantlab.choices import DEFAULT_EQUALIZATION, DEFAULTS_FROM, METHODS

    parser.add_argument("model", metavar="MODEL", help=".onnx file or zoo model name")
    parser.add_argument("--eval", required=True, metavar="EVAL",
                        help="held-out data every configuration is evaluated on (same formats "
                             "as --data; 'zoo': a zoo model's held-out split)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    add_metric_argument(parser, "sqnr", "with --eval zoo",
                        "what every configuration is scored by, against FP32: ")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), metavar="METHOD",
                        help=f"calibrators (default: all of {', '.join(METHODS)})")
    # Defaults of quantlab.sweep, filled in by run (the parser does not import NumPy).
    parser.add_argument("--percentiles", nargs="+", type=percentile, metavar="P",
                        help="percentiles of the percentile calibrator (default: 99.9 99.99 "
                             "99.999)")
    parser.add_argument("--calib-sizes", nargs="+", type=Number(int, 2), metavar="N",
                        help="calibration-set sizes, nested prefixes of --data (default: 16, 32, "
                             "64, ... and all the data)")
    parser.add_argument("--tolerance", type=open_share, metavar="SHARE",
                        help="an amax moving by less than this share from n/2 to n samples has "
                             "converged (default: 0.02)")
    parser.add_argument("--resamples", type=positive_int, default=200, metavar="B",
                        help="paired bootstrap resamples (default: %(default)s)")
    parser.add_argument("--no-equalize", action="store_true",
                        help="do not equalize conv inputs first (by default the model is "
                             "equalized as `quantlab calibrate` does, "
                             f"{DEFAULT_EQUALIZATION} from {DEFAULTS_FROM}, on the largest "
                             "calibration size's samples; one more FP32 pass)")
    parser.add_argument("--allow-long", action="store_true",
                        help="run a sweep estimated to take over an hour")
    parser.add_argument("--force", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_data_arguments(parser, data_help="calibration folder (stats.npz reused), calibration "
                                         "data (image folder, COCO .json, .npy or .npz), or "
                                         "'zoo' (a zoo model's calibration split)")


def run(args: argparse.Namespace) -> int:
    """Run the sweep and write its folder."""
    from functools import partial
    from pathlib import Path

    from quantlab import calibrate, graph, pipeline, qdq, sweep
    from quantlab.commands.options import check_metric, data_options, resume_fingerprint
    from quantlab.data import checked_digest, preprocessing
    from quantlab.errors import ConfigError, DataError
    from quantlab.experiment import check_output
    from quantlab.planner import prepare
    from quantlab.progress import progress_bar

    check_output(args.out, force=args.force, produces=SWEEP_FILES)
    percentiles = args.percentiles or sweep.DEFAULT_PERCENTILES
    tolerance = sweep.TOLERANCE if args.tolerance is None else args.tolerance
    for method in args.methods:
        calibrate.check_method(method, {})
    check_metric(args.metric, args.eval == "zoo",
                 "with a zoo model, pass --eval zoo (its held-out split)", args.model)
    recorded = prepare.calibration_record(args.data)
    reading = data_options(args)
    preprocess = preprocessing(reading.preprocess, recorded and recorded.get("preprocess"))
    model = prepare.prepared_model(args.model, args.data, args.eval, recorded, reading)
    index = qdq.indexed(model)
    tensors = qdq.activation_tensors_to_calibrate(index)
    source, folder_stats = prepare.calibration_source(args.model, args.data, model, recorded,
                                                      preprocess, reading, who="sweep")
    graph.record_data_shapes(model, source)
    fixed = graph.fixed_batch_size(model) or 1
    sizes = sweep.check_sizes(args.calib_sizes or sweep.default_sizes(source.num_samples),
                              source.num_samples, source.description, fixed)
    configs = sweep.configurations(args.methods, percentiles, sizes)
    evaluation, task = prepare.evaluation_source(args.model, args.eval, model, preprocess,
                                                 reading)
    # One pass over each: NaN/Inf refused, and the content identifies the run (checkpoint).
    digests = (checked_digest(source, "--data"),
               checked_digest(evaluation, "--eval"))
    estimate = sweep.estimate_seconds(model, evaluation, args.metric, task, args.resamples,
                                      sizes[-1], len(configs))
    plan_text = (f"{len(configs)} configurations ({len(configs) // len(sizes)} calibrator "
                 f"settings x {len(sizes)} sizes {sizes}) on {evaluation.num_samples} evaluation "
                 f"samples, one collection pass over {sizes[-1]} calibration samples")
    if estimate > sweep.LONG_SWEEP_S and not args.allow_long:
        raise ConfigError(
            f"this sweep runs {plan_text}: about {estimate / 3600:.1f} h on this machine "
            "(estimated on the first evaluation batch). Pass --allow-long to run it, or cut it "
            "down: fewer --methods, --percentiles or --calib-sizes, --max-samples, or fewer "
            "--resamples (a detector's mAP bootstrap takes most of its time).")
    print(f"sweep: {plan_text}; estimated {_duration(estimate)}.")
    repairs = {}
    if recorded is None and not args.no_equalize:
        # The model `quantlab calibrate` quantizes by default: depthwise inputs equalized from
        # the calibration data (here the largest size's; a calibration folder's model.onnx
        # is already as it was calibrated).
        model, repairs = pipeline.equalized(model, source.subset(0, sizes[-1]))
        applied = repairs.get("depthwise_equalization", {}).get("applied", [])
        if applied:
            graph.record_data_shapes(model, source)
            index = qdq.indexed(model)
            tensors = qdq.activation_tensors_to_calibrate(index)
            print(f"sweep: equalized {len(applied)} depthwise-conv input(s) as `quantlab "
                  "calibrate` does (--no-equalize: not).")

    known = {}
    if folder_stats is not None:
        missing = sorted(set(tensors) - set(folder_stats.tensors))
        if missing:
            raise DataError(f"the statistics of {args.data} lack tensors {missing[:5]} the Q/DQ "
                            "model quantizes; they were collected on another model. Pass its "
                            "calibration data with --data instead.")
        known[folder_stats.num_samples] = type(folder_stats)(
            {name: folder_stats.tensors[name] for name in tensors}, folder_stats.num_samples,
            folder_stats.num_bins)
    progress_dir = Path(args.out) / PROGRESS_DIR
    # Statistics and records are reused only for the same model, data content (not paths,
    # sizes or dates: a file rewritten in place is other data), preprocessing, options and the
    # metric's code.
    checkpoint = _Checkpoint(progress_dir, resume_fingerprint(
        args, model, *digests, source.num_samples, evaluation.num_samples, preprocess.to_dict(),
        args.metric, args.resamples, tensors,
        None if folder_stats is None else (folder_stats.num_samples, folder_stats.num_bins)))
    blocks = checkpoint.blocks()
    if checkpoint.records or blocks:
        print(f"sweep: resuming: {len(checkpoint.records)} configuration(s) and "
              f"{sum(b.num_samples for b in blocks.values())} samples' statistics already in "
              f"{progress_dir}, of an interrupted sweep of the same model, data (same content), "
              "preprocessing, options and metric code.")
    elif checkpoint.ignored:
        print(f"sweep: {progress_dir} is from a sweep of another model, data, options or "
              "metric code (or unreadable); starting over.")
    progress = None if args.no_progress else partial(progress_bar, leave=False)
    evaluator = sweep.Evaluator(model, evaluation, args.metric, task, args.resamples, progress)
    try:
        result = sweep.run_sweep(
            model, source, evaluator, configs, tensors=tensors, known_stats=known,
            known_blocks=blocks, done=checkpoint.records, on_block=checkpoint.add_block,
            on_record=checkpoint.add_record, tolerance=tolerance,
            progress=None if args.no_progress else partial(progress_bar, leave=True),
            show_collection=not args.no_progress,
            **({"num_bins": folder_stats.num_bins} if folder_stats is not None else {}))
        reproduce = _write(args, index, source, configs, result, repairs, recorded)
    except Exception:
        # A failed run (a full disk, a metric that fails) leaves nothing in --out; only an
        # interrupted one (KeyboardInterrupt, SIGTERM: not Exceptions) keeps its checkpoint.
        checkpoint.remove()
        raise
    checkpoint.remove()
    best = result.best_record
    print(f"sweep: best {best['label']}: {args.metric} {best['value']:.4g} "
          f"(FP32 {best['fp32']:.4g}); {len(configs)} configurations from one collection pass "
          f"in {_duration(sum(result.seconds.values()))}; wrote {args.out}/ (best/: what "
          f"`{reproduce}` writes)")
    for sentence in result.sentences.values():
        print(sentence)
    return 0


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def reproducing_command(args: argparse.Namespace, best, recorded: dict | None) -> str:
    """The `quantlab calibrate` command whose folder holds the scales and Q/DQ model of the
    sweep's `best` configuration: its calibrator on the first `best.size` samples, weights at
    max |w|, no bias correction, equalized as the sweep was (the preprocessing options of the
    sweep, if any, go with it). `recorded`: --data's calibration.json, when a folder. calibrate
    takes no `zoo` data: a zoo model's split is named as the .npy to save it to."""
    data = recorded["data"] if recorded else args.data
    if data == "zoo":
        data = f"{args.model}-calibration.npy"  # numpy.save(zoo.get(MODEL).calibration_set())
    parts = ["quantlab calibrate", str(args.model), "--data", str(data),
             "--max-samples", str(best.size), "--method", best.method,
             *(f"--{name} {value:g}" for name, value in best.params),
             "--weight-amax max --no-bias-correction"]
    if args.no_equalize:
        parts.append("--no-equalize")
    return " ".join([*parts, "--out", "DIR"])


def _write(args, index, source, configs, result, repairs, recorded) -> str:
    """sweep.json, amax_movement.csv, report.html and best/ into --out, all or nothing;
    returns the calibrate command that reproduces best/."""
    import pandas as pd

    from quantlab import pipeline
    from quantlab.experiment import output_folder, write_json, write_text
    from quantlab.report import write_report
    from quantlab.report.sweep import sweep_section

    best = configs[result.best]
    calibrated = pipeline.calibrate_from_stats(
        index, result.snapshots[best.size], source.subset(0, best.size), best.method,
        dict(best.params))
    calibrated.repairs = repairs
    calibrated.repairs_requested = {"depthwise_equalization": not args.no_equalize,
                                    "bias_correction": False}
    reproduce = reproducing_command(args, best, recorded)
    movement = pd.DataFrame([
        {"setting": setting, "tensor": name, f"amax_{result.half}": half[name],
         f"amax_{result.full}": full[name], "movement": result.movement[setting][name],
         "bootstrap_spread": (result.spread.get(name, float("nan"))
                              if setting == best.setting else float("nan"))}
        for setting, (half, full) in result.amax.items() for name in full])
    with output_folder(args.out, force=args.force, produces=SWEEP_FILES) as folder:
        pipeline.write_results(calibrated, folder / "best")
        write_text(folder / "amax_movement.csv", movement.to_csv(index=False))
        write_json(folder / "sweep.json", {
            "format": "quantlab.sweep",
            "model": str(args.model),
            "metric": args.metric,
            "calibration": {"data": source.description, "num_samples": source.num_samples},
            "eval": {"data": args.eval, "num_samples": result.records[0]["samples"]},
            "sizes": sorted({c.size for c in configs}),
            "settings": list(result.movement),
            "tolerance": result.tolerance,
            "equalized": [entry["tensor"] for entry in
                          repairs.get("depthwise_equalization", {}).get("applied", [])],
            "collection_passes": 1,
            "configurations": result.records,
            "best": result.best_record["label"],
            # The calibrate command whose folder is best/ (the same scales and Q/DQ model).
            "reproduce": reproduce,
            "runner_up": (result.records[result.runner_up]["label"]
                          if result.runner_up is not None else None),
            "separation": result.separation.__dict__ if result.separation else None,
            "sufficiency": result.sentences,
            "max_movement": {s: max(m.values(), default=0.0)
                             for s, m in result.movement.items()},
            "bootstrap_spread": {"setting": best.setting, "samples": result.spread_samples,
                                 "blocks": result.spread_blocks,
                                 "max": max(result.spread.values(), default=None)},
            "seconds": result.seconds,
        })
        write_report(folder / "report.html", f"quantlab sweep: {args.model}",
                     [sweep_section(result, args.metric, reproduce)],
                     subtitle=f"{len(configs)} configurations, one collection pass")
    return reproduce


class _Checkpoint:
    """Blocks of statistics (block-START-STOP.npz) and finished configurations (records.json)
    of a running sweep, in --out/.sweep-progress; another sweep's (another fingerprint) are
    deleted."""

    def __init__(self, folder, fingerprint: str):
        from quantlab.experiment import read_json

        self.folder = folder
        self.fingerprint = fingerprint
        self.records: dict[str, dict] = {}
        # True when a checkpoint of another sweep (or an unreadable one) was found and deleted.
        self.ignored = False
        path = folder / "records.json"
        try:
            data = read_json(path) if path.is_file() else {}
        except (OSError, ValueError):
            data = {}
        if data.get("format") == PROGRESS_FORMAT and data.get("fingerprint") == fingerprint:
            self.records = dict(data["records"])
        else:
            self.ignored = folder.exists()
            self.remove()

    def blocks(self) -> dict:
        """The blocks of statistics saved so far, by (first sample, stop); none, and the
        checkpoint deleted (``ignored``), when one cannot be read (a run killed while writing
        it, a damaged disk): the sweep then starts over."""
        from quantlab.collect import Statistics
        from quantlab.errors import DataError

        found = {}
        try:
            for path in self.folder.glob("block-*.npz"):
                _, start, stop = path.stem.split("-")
                found[int(start), int(stop)] = Statistics.load(path)
        except (DataError, ValueError):
            self.records, self.ignored = {}, True
            self.remove()
            return {}
        return found

    def add_block(self, start: int, stop: int, stats) -> None:
        """Save the statistics of samples `start:stop`."""
        self._save()
        stats.save(self.folder / f"block-{start}-{stop}.npz")

    def add_record(self, record: dict) -> None:
        """Save one finished configuration."""
        self.records[record["label"]] = record
        self._save()

    def _save(self) -> None:
        from quantlab.experiment import write_json

        write_json(self.folder / "records.json", {"format": PROGRESS_FORMAT,
                                                  "fingerprint": self.fingerprint,
                                                  "records": self.records})

    def remove(self) -> None:
        """Delete the checkpoint (a finished or a different sweep)."""
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)
