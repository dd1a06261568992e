"""Metrics and certification (Stage E): label-free and user metrics, the paired bootstrap,
and what the data are too few to certify."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from quantlab.compare import output_sqnr_db
from quantlab.errors import ConfigError, DataError
from quantlab.planner.measure import joined_energies, sample_energies
from quantlab.user_code import as_number, call, import_module

Outputs = list[dict[str, np.ndarray]]
# A user metric's resampler must give the metric's own value on all samples to this
# relative tolerance (the same arithmetic, summed in another order).
RESAMPLER_RTOL = 1e-9


def output_sqnr(outputs: Outputs, references: Outputs) -> float:
    """Output SQNR in dB over all samples (:func:`quantlab.compare.output_sqnr_db`): each
    float output's noise and signal energy summed over every sample (pooled), their ratio
    averaged over the outputs; `validate` reports the same figure (docs/metrics.md).

    +inf only when no sample has any noise (FP32 against itself); NaN when an output
    holds NaN (:func:`metric_value` refuses it: it must never pass as "no noise").
    """
    energies = [sample_energies(o, r) for o, r in zip(outputs, references, strict=True)]
    return output_sqnr_db(sum(noise.sum(axis=0) for noise, _ in energies),
                          sum(power.sum(axis=0) for _, power in energies))


def argmax_agreement(outputs: Outputs, references: Outputs) -> float:
    """Share of samples whose argmax over axis 1 of the first output agrees with the reference."""
    return float(_agreements(outputs, references).mean())


def _agreements(outputs: Outputs, references: Outputs) -> np.ndarray:
    """Per sample: 1.0 where the argmax over axis 1 of the first output agrees, else 0.0."""
    name = next(iter(references[0]))
    same = [np.argmax(o[name], axis=1) == np.argmax(r[name], axis=1)
            for o, r in zip(outputs, references, strict=True)]
    return np.concatenate([s.reshape(len(s), -1).all(axis=1) for s in same]).astype(np.float64)


def pooled_sqnr(noise: np.ndarray, power: np.ndarray) -> Callable[[np.ndarray], float]:
    """``score(pick)``: output SQNR of the samples picked from per-sample noise and signal
    energies ([samples, outputs] each, :func:`sample_energies`), pooled per output."""
    return lambda pick: output_sqnr_db(noise[pick].sum(axis=0), power[pick].sum(axis=0))


def _sqnr_resampler(outputs: Outputs, references: Outputs) -> Callable[[np.ndarray], float]:
    """Output SQNR of picked samples from each sample's noise and signal energies, pooled."""
    return pooled_sqnr(*joined_energies([sample_energies(o, r) for o, r in
                                         zip(outputs, references, strict=True)]))


def _agreement_resampler(outputs: Outputs,
                         references: Outputs) -> Callable[[np.ndarray], float]:
    """Argmax agreement of picked samples from each sample's 0/1."""
    agreements = _agreements(outputs, references)
    return lambda pick: float(agreements[pick].mean())


# A metric's bootstrap from per-sample figures computed once (:func:`_resampled`).
output_sqnr.resampler = _sqnr_resampler
argmax_agreement.resampler = _agreement_resampler


METRICS: dict[str, Callable[[Outputs, Outputs], float]] = {
    "sqnr": output_sqnr, "agreement": argmax_agreement}


def resolve_metric(name: str) -> Callable[[Outputs, Outputs], float]:
    """A built-in label-free metric by name, or ``module:function`` imported (from the current
    directory or PYTHONPATH)."""
    if name in METRICS:
        return METRICS[name]
    if ":" not in name:
        raise ConfigError(f"unknown metric '{name}'; use one of {', '.join(METRICS)} or "
                          "module:function (function(outputs, references) -> float, higher "
                          "is better).")
    module_name, _, function_name = name.partition(":")
    try:
        function = getattr(import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load metric '{name}': {exc}. Pass module:function with the "
                          "module importable (in the current directory or on PYTHONPATH) and "
                          "the function defined in it.") from None
    if not callable(function):
        raise ConfigError(f"metric '{name}' is not a function.")
    return function


def check_budget(metric: str, max_drop: float | None, min_sqnr: float | None) -> None:
    """ConfigError unless the budget can work with `metric`; known before any model run, so
    `quantlab plan` checks it before it reads any data."""
    if (max_drop is None) == (min_sqnr is None):
        raise ConfigError("give exactly one budget: --max-drop X or --min-sqnr DB.")
    if min_sqnr is not None and metric != "sqnr":
        raise ConfigError(f"--min-sqnr is a floor on output SQNR; it does not go with --metric "
                          f"{metric} (use --max-drop there).")
    if max_drop is not None and metric == "sqnr":
        raise ConfigError("--max-drop cannot work with --metric sqnr: the FP32 model's output "
                          "SQNR against itself is infinite, so a drop from it means nothing. "
                          "Give a floor (--min-sqnr DB) or another --metric.")
    for option, value in (("--max-drop", max_drop), ("--min-sqnr", min_sqnr)):
        if value is not None and not np.isfinite(value):
            raise ConfigError(f"{option} must be a finite number, got {value}.")
    if max_drop is not None and max_drop < 0:
        raise ConfigError(f"--max-drop must be >= 0, got {max_drop}: impossible even in FP32, "
                          "which is the reference every plan is compared with.")


def metric_value(metric: Callable, name: str, outputs: Outputs, references: Outputs,
                 where: str = "the evaluation samples") -> float:
    """`metric` on the outputs of `where` (words for the message), checked to be a finite
    number; the built-in SQNR alone may be +inf (no noise at all, exact by construction).

    A metric that raises, returns a non-number, NaN or an infinity is a DataError naming
    it and the samples: such a value is never compared with a budget (a NaN sample made
    SQNR +inf, which certified any plan).
    """
    try:
        value = call(metric, outputs, references)
    except Exception as exc:  # the user's code: any exception is the metric failing
        raise DataError(
            f"metric '{name}' failed on {where}: {type(exc).__name__}: {exc}. It is called "
            "function(outputs, references) with two lists of {output name: array} (one entry "
            "per batch, samples on axis 0) and must return a number, higher is better."
        ) from None
    try:
        value = as_number(value)
    except (TypeError, ValueError):
        raise DataError(f"metric '{name}' returned {value!r} on {where}; it must return a "
                        "number (higher is better).") from None
    if np.isnan(value) or (np.isinf(value) and not (metric is output_sqnr and value > 0)):
        cause = ("an output holds NaN or Inf (check the evaluation data and the model)"
                 if metric is output_sqnr else "check for a division by zero, a log of 0 or "
                 "an empty selection in it")
        shown = "NaN" if np.isnan(value) else f"{value:+}"
        raise DataError(f"metric '{name}' returned {shown} on {where} ({len(outputs)} "
                        f"batch(es)); a plan is never judged on that: {cause}.")
    return value


def split_samples(batches: Outputs) -> Outputs:
    """One entry per sample (axis 0 of every output) from entries per batch."""
    return [{name: value[i:i + 1] for name, value in batch.items()}
            for batch in batches for i in range(len(next(iter(batch.values()))))]



@dataclass
class Certificate:
    """Whether a plan's measured metric meets the budget, with a paired bootstrap interval.

    ``limit`` is the lowest acceptable metric value (FP32's minus the allowed drop,
    or the floor); ``interval`` the bootstrap interval of the candidate's margin over
    it on resampled samples (paired: FP32 is scored on the same resample).
    """

    metric: str
    reference: float
    value: float
    limit: float
    interval: tuple[float, float]
    confidence: float
    samples: int
    certified: bool
    too_small: bool
    needed_samples: int | None

    @property
    def inconclusive(self) -> bool:
        """Too small a set to decide: the interval is too wide and reaches the budget.

        A plan whose whole interval is below the limit fails whatever the set's
        size, and its wide interval says little about plans nearer the budget.
        """
        return self.too_small and self.interval[1] >= 0

    def too_small_message(self) -> str:
        """What to do when the evaluation set is too small to certify the budget ('' if not)."""
        if not self.too_small:
            return ""
        drop = self.reference - self.limit
        half_width = (self.interval[1] - self.interval[0]) / 2
        needed = f"about {self.needed_samples}" if self.needed_samples else "many more"
        return (f"the evaluation set is too small to certify a drop of {drop:.4g} in "
                f"{self.metric}: on its {self.samples} samples the paired-bootstrap interval of "
                f"the margin is +-{half_width:.3g} wide, more than half the budget "
                f"({drop / 2:.3g}); {needed} samples are needed. Pass more held-out data with "
                "--eval, or allow a larger --max-drop.")


def certify(metric: Callable, name: str, outputs: Outputs, references: Outputs, *,
            max_drop: float | None = None, floor: float | None = None,
            resamples: int = 200, confidence: float = 0.95, seed: int = 0,
            what: str = "evaluation samples",
            fp32_scores: dict[bytes, float] | None = None) -> Certificate:
    """Check a candidate's outputs against FP32's with a metric function (see certify_paired).

    Resamples hand the metric one entry per sample, FP32 scored on the same ones (or
    the metric's resampler scores them, :func:`_resampled`); `what` names the samples
    in a metric's error. `fp32_scores` (a dict the caller keeps across calls with the
    same `metric`, `references` and `seed`) holds FP32's score on all samples and on each
    resample: every plan certified against the same references is resampled the same
    way, so FP32 against itself is scored once per resample, not once per plan (half a
    custom metric's bootstrap).
    """
    samples, refs = split_samples(outputs), split_samples(references)
    resample = f"a bootstrap resample of the {len(samples)} {what}"
    whole = f"{what} 0..{len(samples) - 1}"
    known = {} if fp32_scores is None else fp32_scores
    if b"" not in known:  # the key of all samples (no resample is empty)
        known[b""] = metric_value(metric, name, references, references, f"FP32 on {whole}")
    reference = known[b""]
    value = metric_value(metric, name, outputs, references, whole)
    resampled = _resampled(metric, name, outputs, references, value, whole)
    if resampled is not None:
        made = []  # FP32's resampler, made when a resample is first not known

        def fp32_score(pick: np.ndarray) -> float:
            if not made:
                made.append(_resampled(metric, name, references, references, reference,
                                       f"FP32 on {whole}"))
            return made[0](pick)

        fp32 = remembered(fp32_score, known)

        def evaluate(pick: np.ndarray) -> tuple[float, float]:
            return resampled(pick), fp32(pick)
    else:
        def fp32_score(pick: np.ndarray) -> float:
            chosen = [refs[i] for i in pick]
            return metric_value(metric, name, chosen, chosen, f"FP32 on {resample}")

        fp32 = remembered(fp32_score, known)

        def evaluate(pick: np.ndarray) -> tuple[float, float]:
            return (metric_value(metric, name, [samples[i] for i in pick],
                                 [refs[i] for i in pick], resample), fp32(pick))

    return certify_paired(name, evaluate, len(samples), (value, reference), max_drop=max_drop,
                          floor=floor, resamples=resamples, confidence=confidence, seed=seed)


def remembered(score: Callable[[np.ndarray], float], known: dict[bytes, float]
               ) -> Callable[[np.ndarray], float]:
    """`score` with its value per set of picked samples kept in `known`: FP32's score on a
    bootstrap resample is the same for every plan certified against it (same references,
    same seed, so the same resamples)."""
    def score_once(pick: np.ndarray) -> float:
        key = np.asarray(pick).tobytes()
        if key not in known:
            known[key] = score(pick)
        return known[key]

    return score_once


def _resampled(metric: Callable, name: str, outputs: Outputs, references: Outputs,
               whole: float | None = None, where: str = "all samples",
               ) -> Callable[[np.ndarray], float] | None:
    """``score(sample indices)`` from the metric's ``resampler`` attribute, or None.

    A metric may carry ``metric.resampler(outputs, references) -> score`` (the
    metric's arguments): it computes per-sample figures once, and ``score(pick)`` is
    the metric of the samples at positions `pick` (repeats count again), so a
    bootstrap resample costs sums of numbers instead of the metric over every output
    again (output SQNR: 400 calls took 10 s of a 15 s evaluation on an 800x608
    detector; COCO agreement mAP re-accumulates per-image matches). The built-ins
    carry one. A user's resampler is checked once against the metric's value on all
    samples (`whole`, computed when not given), and every score it gives must be a
    finite number.
    """
    make = getattr(metric, "resampler", None)
    if make is None:
        return None
    if metric in METRICS.values():
        return make(outputs, references)
    count = sum(len(next(iter(batch.values()))) for batch in references)

    def failed(exc: Exception) -> DataError:
        return DataError(f"metric '{name}': its resampler failed on {where}: "
                         f"{type(exc).__name__}: {exc}. metric.resampler(outputs, references) "
                         "must return score(positions) -> float, the metric of the samples "
                         "at those positions.")

    try:
        resampler = call(make, outputs, references)
    except Exception as exc:  # the user's code: any exception is the resampler failing
        raise failed(exc) from None

    def score(pick: np.ndarray) -> float:
        try:
            got = as_number(call(resampler, pick))
        except Exception as exc:
            raise failed(exc) from None
        if not np.isfinite(got):
            raise DataError(f"metric '{name}': its resampler scored {got} on a resample of "
                            f"{where}; a plan is never judged on that.")
        return got

    if whole is None:
        whole = metric_value(metric, name, outputs, references, where)
    got = score(np.arange(count))
    if not np.isclose(got, whole, rtol=RESAMPLER_RTOL, atol=0.0):
        raise DataError(f"metric '{name}': its resampler scores {where} {got!r} but the metric "
                        f"itself gives {whole!r}; score(all positions) must equal the metric. "
                        "Fix the resampler, or remove it (the bootstrap then calls the metric "
                        "on every resample).")
    return score


def certify_paired(name: str, evaluate: Callable[[np.ndarray], tuple[float, float]],
                   count: int, full: tuple[float, float] | None = None, *,
                   max_drop: float | None = None, floor: float | None = None,
                   resamples: int = 200, confidence: float = 0.95,
                   seed: int = 0) -> Certificate:
    """Certify a plan from ``evaluate(sample indices) -> (candidate value, FP32 value)``.

    The margin (value minus limit) is bootstrapped over the `count` samples, FP32
    scored on the same resample (paired); the plan is certified when the lower end
    of the one-sided `confidence` interval is >= 0. With ``max_drop``, an interval
    half-width over max_drop / 2 means the evaluation set is too small to certify
    that budget; the size needed follows from the half-width shrinking as
    1 / sqrt(samples). `full` is evaluate on all samples when already known.
    """
    if (max_drop is None) == (floor is None):
        raise ConfigError("give exactly one of a maximum drop or a metric floor.")
    if max_drop is not None and not max_drop >= 0:
        raise ConfigError(f"the maximum drop must be >= 0, got {max_drop}: impossible even in "
                          "FP32, which is the reference every plan is compared with.")
    value, reference = full if full is not None else evaluate(np.arange(count))
    if floor is not None and floor > reference:
        raise ConfigError(f"the floor {floor} of metric '{name}' is above its value for the FP32 "
                          f"model itself ({reference:.6g}): impossible even in FP32. Lower it.")
    if max_drop is not None and not np.isfinite(reference):
        raise ConfigError(f"metric '{name}' of the FP32 model against itself is {reference}; a "
                          "drop from it means nothing. Use a floor (--min-sqnr) instead.")
    rng = np.random.default_rng(seed)
    margins = np.empty(resamples)
    for b in range(resamples):
        got, fp32 = evaluate(rng.integers(0, count, count))
        margins[b] = got - (fp32 - max_drop if max_drop is not None else floor)
    # Infinite margins (output SQNR of resamples without noise) would interpolate to NaN.
    method = "linear" if np.isfinite(margins).all() else "inverted_cdf"
    low, high = np.quantile(margins, [1 - confidence, confidence], method=method)
    limit = reference - max_drop if max_drop is not None else floor
    half_width = (high - low) / 2 if max_drop is not None else 0.0  # only a drop can be too small
    too_small = max_drop is not None and half_width > max_drop / 2
    needed = (int(np.ceil(count * (half_width / (max_drop / 2)) ** 2))
              if too_small and max_drop > 0 else None)
    return Certificate(name, reference, value, limit, (float(low), float(high)), confidence,
                       count, bool(low >= 0), bool(too_small), needed)


def metric_scorer(name: str, function: Callable | None, task, outputs: Outputs,
                  references: Outputs) -> Callable[[np.ndarray], float]:
    """``score(picked samples)``: the metric of `outputs` on the samples picked: `task`'s
    primary metric (:func:`task_scorer`) when `function` is None, else `function` against
    `references` (the built-in metrics from per-sample figures computed once,
    :func:`_resampled`)."""
    if function is None:
        return task_scorer(task, outputs)
    resampled = _resampled(function, name, outputs, references)
    if resampled is not None:
        return resampled
    samples, refs = split_samples(outputs), split_samples(references)
    return lambda pick: metric_value(function, name, [samples[i] for i in pick],
                                     [refs[i] for i in pick])


def against_reference(name: str, evaluate: Callable[[np.ndarray], tuple[float, float]],
                      count: int, resamples: int = 200) -> Certificate:
    """A candidate's metric and its paired interval against the reference's (FP32): of the
    difference (margin over ``limit`` = the reference's value), or of the value itself where
    the reference's is infinite (output SQNR: ``limit`` 0)."""
    full = evaluate(np.arange(count))
    bound = {"max_drop": 0.0} if np.isfinite(full[1]) else {"floor": 0.0}
    return certify_paired(name, evaluate, count, full, resamples=resamples, **bound)


class PairedScore:
    """A candidate's `metric` against FP32's, folded batch by batch, scored with a paired
    bootstrap interval (:func:`against_reference`).

    `metric` is a label-free metric or ``module:function`` (:func:`resolve_metric`), or the
    primary metric of `task` (``top1``, ``map``: the batches come in the task's sample
    order). Output SQNR keeps each sample's noise and signal energy per output (pooled when
    scored); any other metric keeps both stages' outputs, samples first, as the planner
    does.
    """

    def __init__(self, metric: str, task=None, resamples: int = 200):
        from quantlab.tasks import PRIMARY_METRIC

        if metric in PRIMARY_METRIC.values() and (task is None or task.primary_metric != metric):
            raise ConfigError(f"metric '{metric}' is a task metric: it needs the ground truth "
                              f"of a {metric}-scored task (a quantlab.tasks.Task), not "
                              f"{'none' if task is None else task.kind}.")
        self.metric = metric
        self.task = task if task is not None and metric == task.primary_metric else None
        self.function = None if self.task is not None else resolve_metric(metric)
        self.resamples = resamples
        self.outputs: Outputs = []
        self.references: Outputs = []
        self.energies: list[tuple[np.ndarray, np.ndarray]] = []

    def update(self, outputs: dict[str, np.ndarray], references: dict[str, np.ndarray]) -> None:
        """Fold one batch of the candidate's and FP32's outputs (samples on axis 0)."""
        if self.function is output_sqnr:
            self.energies.append(sample_energies(outputs, references))
        else:
            self.outputs.append(dict(outputs))
            self.references.append(dict(references))

    def certificate(self) -> Certificate:
        """The candidate's value, FP32's (``reference``) and the paired interval."""
        if self.function is output_sqnr:
            score = pooled_sqnr(*joined_energies(self.energies))
            return against_reference(self.metric, lambda pick: (score(pick), float("inf")),
                                     sum(len(n) for n, _ in self.energies), self.resamples)
        candidate = metric_scorer(self.metric, self.function, self.task, self.outputs,
                                  self.references)
        fp32 = metric_scorer(self.metric, self.function, self.task, self.references,
                             self.references)
        count = sum(len(next(iter(batch.values()))) for batch in self.references)
        return against_reference(self.metric, lambda pick: (candidate(pick), fp32(pick)), count,
                                 self.resamples)


def task_evaluator(task, outputs: Outputs,
                   references: Outputs) -> Callable[[np.ndarray], tuple[float, float]]:
    """``evaluate(indices)`` of a task's primary metric (top-1, COCO mAP) for certify_paired:
    :func:`task_scorer` of the candidate's outputs and of FP32's."""
    return paired(task_scorer(task, outputs), task_scorer(task, references))


def paired(candidate: Callable[[np.ndarray], float], reference: Callable[[np.ndarray], float]
           ) -> Callable[[np.ndarray], tuple[float, float]]:
    """``evaluate(indices)`` for certify_paired from the candidate's and the reference's
    ``score(indices)`` (one reference scorer serves every candidate of a plan search)."""
    return lambda pick: (candidate(pick), reference(pick))


def task_scorer(task, outputs: Outputs) -> Callable[[np.ndarray], float]:
    """``score(indices)``: a task's primary metric (top-1, COCO mAP) of the samples picked.

    Predictions are made once per batch; a resample of images re-accumulates COCO's
    per-image matches (:func:`quantlab.tasks.coco_map_resampler`).
    """
    from quantlab.tasks import coco_map_resampler

    ids = task.ids()
    found, start = [], 0
    for batch in outputs:
        stop = start + len(next(iter(batch.values())))
        predicted = task.postprocess(dict(batch), ids[start:stop])
        if task.kind == "classification":
            found.extend(np.argmax(predicted, axis=1) == np.asarray(task.labels)[start:stop])
        else:
            found.extend(predicted)
        start = stop
    if task.kind == "classification":
        hits = np.array(found, float)
        return lambda pick: float(hits[pick].mean())
    return coco_map_resampler(task.coco, found, ids[:start])


def data_shortfalls(calibration_samples: int, evaluation_samples: int, hard_count: int,
                    metric: str, max_drop: float | None, task=None) -> list[str]:
    """What the data cannot do for this plan, known before any model run (one message each).

    Fewer calibration samples than the hardest-sample count, and a budget smaller
    than one sample's worth of a share metric (top-1, argmax agreement) on the
    evaluation set: then only a plan that changes no prediction can be certified.
    """
    messages = []
    if calibration_samples < hard_count:
        messages.append(
            f"the calibration data hold {calibration_samples} samples, fewer than the "
            f"{hard_count} hardest samples requested (--hard-samples): the trials "
            f"run on all {calibration_samples}, none singled out as hard. Pass more "
            f"calibration data (several times {hard_count} samples) or --hard-samples "
            f"below {calibration_samples}.")
    share = metric == "agreement" or (task is not None and task.kind == "classification"
                                       and metric == task.primary_metric)
    if share and max_drop is not None and max_drop * evaluation_samples < 1:
        needed = (f"Pass at least {int(np.ceil(1 / max_drop))} samples with --eval (more the "
                  "more predictions a plan changes)" if max_drop > 0 else
                  "A drop of 0 allows no changed prediction whatever the evaluation set")
        messages.append(
            f"a drop of {max_drop:g} in {metric} is less than one sample of the "
            f"{evaluation_samples} in the evaluation set (1/{evaluation_samples} = "
            f"{1 / evaluation_samples:.3g}): only a plan that changes no prediction can be "
            f"certified. {needed}, or allow a larger --max-drop.")
    return messages


def floor_record(certificate: Certificate) -> dict:
    """The all-FP16 plan's evaluation as plain data: the noise floor of the budget."""
    return {"metric": certificate.metric, "value": certificate.value,
            "reference": certificate.reference, "limit": certificate.limit,
            "drop": certificate.reference - certificate.value,
            "margin_interval": list(certificate.interval), "samples": certificate.samples,
            "certified": certificate.certified}


def floor_message(certificate: Certificate, metric: str, max_drop: float | None) -> str:
    """A warning when FP16 alone (no INT8) uses half the budget or more, counting the
    evaluation set's resolution (the bootstrap half-width); '' otherwise."""
    half = (certificate.interval[1] - certificate.interval[0]) / 2
    if max_drop is not None:
        drop = certificate.reference - certificate.value
        if drop + half < max_drop / 2:
            return ""
        head = (f"all-FP16 (no INT8 at all) already drops {metric} by {drop:.3g} "
                f"(+-{half:.2g} on {certificate.samples} samples), against a budget of "
                f"{max_drop:.3g}: what is left for INT8 is at the evaluation set's resolution, "
                "so plans are decided by rounding noise.")
    else:
        if certificate.value - half > certificate.limit + 1.0:
            return ""
        head = (f"all-FP16 (no INT8 at all) reaches only {certificate.value:.3g} dB "
                f"(+-{half:.2g} on {certificate.samples} samples) against a floor of "
                f"{certificate.limit:.3g} dB: little is left for INT8.")
    if metric == "map":
        hint = (" COCO mAP@[.5:.95] moves with the IoU 0.9-0.95 bins, where FP16 rounding "
                "already shifts boxes; AP50 or F1 agreement at IoU 0.5 (--metric "
                "module:function) resolves such budgets, as do more --eval samples.")
    else:
        hint = (" Allow a larger budget, pass more --eval samples, or use a metric less "
                "sensitive to rounding (for detectors, AP50 or F1 agreement at IoU 0.5 through "
                "--metric module:function, rather than mAP@[.5:.95]).")
    return head + hint
