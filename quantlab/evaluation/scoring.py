"""Scoring a candidate's outputs against FP32's with a paired bootstrap interval: the one
scorer that `plan`, `validate`, `sweep` and `check` call (docs/metrics.md).

A metric has two parts (torchmetrics' update/compute split): a per-sample part that turns
one sample's outputs (and FP32's) into a small record, and a set part that scores a list of
records. Outputs stream through :class:`PairedScore` batch by batch and are dropped once
recorded; a bootstrap resample reduces records and never runs the per-sample part again.
Every metric takes this form (:func:`metric_for`):

- ``sqnr``: a sample's noise and signal energy per output, pooled (output SQNR);
- ``agreement``: a sample's argmax agreement, 0 or 1, averaged;
- a task's primary metric (``top1``, ``map``): a sample's hit or detections, COCO's
  per-image matching once and its accumulation per resample;
- ``module:name``, a user's two-part metric: ``name`` an object (or a class made with no
  arguments) with ``record(outputs, references) -> record`` on one sample and
  ``score(records) -> float`` (higher is better) on any list of them;
- ``module:function``, a plain ``function(outputs, references) -> float`` on lists of
  ``{output: array}`` (one entry per sample): called on all samples and once per resample,
  unless it carries ``function.resampler(outputs, references) -> score(positions)``.

FP32's side (:class:`Reference`) is recorded once and scored once per resample, for every
candidate certified against it with the same seed (the same resamples).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from quantlab.errors import ConfigError, DataError
from quantlab.evaluation.compare import joined_energies, output_sqnr_db, sample_energies
from quantlab.user_code import as_number, import_module
from quantlab.user_code import call as call_user

Outputs = list[dict[str, np.ndarray]]
Score = Callable[[np.ndarray], float]
# A user metric's resampler must give the metric's own value on all samples to this
# relative tolerance (the same arithmetic, summed in another order).
RESAMPLER_RTOL = 1e-9
CALLED_AS = ("It is called function(outputs, references) with two lists of {output name: "
             "array} (one entry per sample, samples on axis 0) and must return a number, "
             "higher is better.")
TWO_PART_CALLED_AS = ("Its record(outputs, references) is called on one sample's "
                      "{output name: array} (samples on axis 0, one sample) and score(records) "
                      "on a list of records; score must return a number, higher is better.")


def output_sqnr(outputs: Outputs, references: Outputs) -> float:
    """Output SQNR in dB over all samples (:func:`quantlab.evaluation.compare.output_sqnr_db`): each
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


def pooled_sqnr(noise: np.ndarray, power: np.ndarray) -> Score:
    """``score(pick)``: output SQNR of the samples picked from per-sample noise and signal
    energies ([samples, outputs] each, :func:`sample_energies`), pooled per output."""
    return lambda pick: output_sqnr_db(noise[pick].sum(axis=0), power[pick].sum(axis=0))


METRICS: dict[str, Callable[[Outputs, Outputs], float]] = {
    "sqnr": output_sqnr, "agreement": argmax_agreement}


def resolve_metric(name: str):
    """A built-in label-free metric by name, or ``module:name`` imported (from the current
    directory or PYTHONPATH): a function, or a two-part metric (an object with ``record``
    and ``score``; a class is made with no arguments)."""
    if name in METRICS:
        return METRICS[name]
    if ":" not in name:
        raise ConfigError(f"unknown metric '{name}'; use one of {', '.join(METRICS)} or "
                          "module:function (function(outputs, references) -> float, higher "
                          "is better) or module:name of a two-part metric (record(outputs, "
                          "references) per sample, score(records) -> float).")
    module_name, _, function_name = name.partition(":")
    try:
        found = getattr(import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load metric '{name}': {exc}. Pass module:function with the "
                          "module importable (in the current directory or on PYTHONPATH) and "
                          "the function defined in it.") from None
    if inspect.isclass(found) and _two_part(found):
        try:
            found = call_user(found)
        except Exception as exc:  # the user's code
            raise ConfigError(f"metric '{name}': {function_name}() failed: "
                              f"{type(exc).__name__}: {exc}. A two-part metric class is made "
                              "with no arguments.") from None
    if not (_two_part(found) or callable(found)):
        raise ConfigError(f"metric '{name}' is neither a function nor a two-part metric (an "
                          "object with record(outputs, references) and score(records)).")
    return found


def _two_part(found) -> bool:
    return callable(getattr(found, "record", None)) and callable(getattr(found, "score", None))


def _checked(value, name: str, where: str, allow_inf: bool = False, detail: str = "") -> float:
    """`value` as a finite float, else a DataError naming the metric and the samples
    (`detail` added where it is not finite); +inf only with `allow_inf` (output SQNR
    without any noise, exact by construction)."""
    try:
        value = as_number(value)
    except (TypeError, ValueError):
        raise DataError(f"metric '{name}' returned {value!r} on {where}; it must return a "
                        "number (higher is better).") from None
    if np.isnan(value) or (np.isinf(value) and not (allow_inf and value > 0)):
        cause = ("an output holds NaN or Inf (check the evaluation data and the model)"
                 if allow_inf else "check for a division by zero, a log of 0 or an empty "
                 "selection in it")
        shown = "NaN" if np.isnan(value) else f"{value:+}"
        raise DataError(f"metric '{name}' returned {shown} on {where}{detail}; a plan is never "
                        f"judged on that: {cause}.")
    return value


def _called(run: Callable, name: str, where: str, called_as: str):
    """``call()``, any exception of the user's code (a sys.exit too) a DataError naming the
    metric."""
    try:
        return call_user(run)
    except Exception as exc:  # the user's code: any exception is the metric failing
        raise DataError(f"metric '{name}' failed on {where}: {type(exc).__name__}: {exc}. "
                        f"{called_as}") from None


def metric_value(metric: Callable, name: str, outputs: Outputs, references: Outputs,
                 where: str = "the evaluation samples") -> float:
    """`metric` on the outputs of `where` (words for the message), checked to be a finite
    number; the built-in SQNR alone may be +inf (no noise at all, exact by construction).

    A metric that raises, returns a non-number, NaN or an infinity is a DataError naming
    it and the samples: such a value is never compared with a budget (a NaN sample made
    SQNR +inf, which certified any plan).
    """
    value = _called(lambda: metric(outputs, references), name, where, CALLED_AS)
    return _checked(value, name, where, allow_inf=metric is output_sqnr,
                    detail=f" ({len(outputs)} entries)")


def split_samples(batches: Outputs) -> Outputs:
    """One entry per sample (axis 0 of every output) from entries per batch."""
    return [{name: value[i:i + 1] for name, value in batch.items()}
            for batch in batches for i in range(len(next(iter(batch.values()))))]


class Metric:
    """A metric as a per-sample part (:meth:`records`) and a set part (:meth:`scorer`).

    ``records(outputs, references, start)``: one record per sample of a batch (samples on
    axis 0; `start`, the first sample's position in the data). ``scorer(records, where)``:
    ``score(positions)``, the metric of the samples at those positions (repeats count
    again), checked to be a finite number.
    """

    labels = False  # True: the task's ground truth, not FP32's outputs, is what it reads
    allow_inf = False
    is_output_sqnr = False  # pooled from per-sample energies (screens read them directly)

    def __init__(self, name: str):
        self.name = name

    @property
    def reads_outputs(self) -> bool:
        """A metric of outputs alone other than output SQNR: it is judged on outputs kept
        (the planner's screen keeps FP32's outputs on a random draw for it)."""
        return not (self.labels or self.is_output_sqnr)

    def records(self, outputs: Mapping[str, np.ndarray], references: Mapping[str, np.ndarray],
                start: int) -> list:
        raise NotImplementedError

    def scorer(self, records: list, where: str) -> Score:
        raise NotImplementedError


class _Sqnr(Metric):
    allow_inf = is_output_sqnr = True

    def records(self, outputs, references, start):
        noise, power = sample_energies(outputs, references)
        return list(zip(noise, power, strict=True))

    def scorer(self, records, where):
        noise, power = np.array([n for n, _ in records]), np.array([p for _, p in records])
        score = pooled_sqnr(noise, power)
        return lambda pick: _checked(score(pick), self.name, where, allow_inf=True)


class _Agreement(Metric):
    def records(self, outputs, references, start):
        return list(_agreements([outputs], [references]))

    def scorer(self, records, where):
        return _share(records)


def _share(hits: list) -> Score:
    """``score(positions)``: the share of the picked samples whose record is a hit (1)."""
    shares = np.asarray(hits, np.float64)
    return lambda pick: float(shares[pick].mean())


class _Task(Metric):
    """A task's primary metric (top-1, COCO mAP) against its ground truth."""

    labels = True

    def __init__(self, name: str, task):
        super().__init__(name)
        self.task = task

    def records(self, outputs, references, start):
        count = len(next(iter(outputs.values())))
        ids = self.task.ids()[start:start + count]
        predicted = self.task.postprocess(dict(outputs), ids)
        if self.task.kind == "classification":
            return list(np.argmax(predicted, axis=1) ==
                        np.asarray(self.task.labels)[start:start + count])
        by_image = {image: [] for image in ids}
        for detection in predicted:
            by_image[detection["image_id"]].append(detection)
        return [by_image[image] for image in ids]

    def scorer(self, records, where):
        from quantlab.evaluation.tasks import coco_map_resampler

        if self.task.kind == "classification":
            return _share(records)
        return coco_map_resampler(self.task.coco, [d for r in records for d in r],
                                  self.task.ids()[:len(records)])


class _Function(Metric):
    """A user's (or the benchmarks') ``function(outputs, references) -> float``: its records
    are the sample's outputs themselves."""

    def __init__(self, name: str, function: Callable):
        super().__init__(name)
        self.function = function
        self.allow_inf = function is output_sqnr

    def records(self, outputs, references, start):
        samples = split_samples([outputs])
        refs = samples if references is outputs else split_samples([references])
        return list(zip(samples, refs, strict=True))

    def scorer(self, records, where):
        outputs = [o for o, _ in records]
        # FP32 against itself: one list, as the metric was given before (`o is r` tells it).
        references = outputs if all(o is r for o, r in records) else [r for _, r in records]
        resampled = self._resampled(outputs, references, where)
        if resampled is not None:
            return resampled

        def score(pick: np.ndarray) -> float:
            chosen = [outputs[i] for i in pick]
            against = chosen if references is outputs else [references[i] for i in pick]
            return metric_value(self.function, self.name, chosen, against, _where(pick, where))

        return score

    def _resampled(self, outputs: Outputs, references: Outputs, where: str) -> Score | None:
        """``score(positions)`` from the function's ``resampler`` attribute, or None.

        A metric may carry ``metric.resampler(outputs, references) -> score`` (the
        metric's arguments): it computes per-sample figures once, so a bootstrap resample
        costs sums of numbers instead of the metric over every output again (COCO agreement
        mAP re-accumulates per-image matches). It is checked once against the metric's
        value on all samples, and every score it gives must be a finite number.
        """
        make = getattr(self.function, "resampler", None)
        if make is None:
            return None

        def failed(exc: Exception) -> DataError:
            return DataError(f"metric '{self.name}': its resampler failed on {where}: "
                             f"{type(exc).__name__}: {exc}. metric.resampler(outputs, "
                             "references) must return score(positions) -> float, the metric "
                             "of the samples at those positions.")

        whole = metric_value(self.function, self.name, outputs, references, where)
        try:
            resampler = call_user(make, outputs, references)
        except Exception as exc:  # the user's code: any exception is the resampler failing
            raise failed(exc) from None

        def score(pick: np.ndarray) -> float:
            try:
                got = as_number(call_user(resampler, pick))
            except Exception as exc:
                raise failed(exc) from None
            if not np.isfinite(got):
                raise DataError(f"metric '{self.name}': its resampler scored {got} on "
                                f"{_where(pick, where)}; a plan is never judged on that.")
            return got

        got = score(np.arange(len(outputs)))
        if not np.isclose(got, whole, rtol=RESAMPLER_RTOL, atol=0.0):
            raise DataError(f"metric '{self.name}': its resampler scores {where} {got!r} but "
                            f"the metric itself gives {whole!r}; score(all positions) must "
                            "equal the metric. Fix the resampler, or remove it (the bootstrap "
                            "then calls the metric on every resample).")
        return score


class _TwoPart(Metric):
    """A user's two-part metric: ``record(outputs, references)`` once per sample,
    ``score(records)`` on any list of them."""

    def __init__(self, name: str, metric):
        super().__init__(name)
        self.metric = metric

    def records(self, outputs, references, start):
        return [_called(lambda o=o, r=r: self.metric.record(o, r), self.name,
                        f"sample {start + i}", TWO_PART_CALLED_AS)
                for i, (o, r) in enumerate(zip(split_samples([outputs]),
                                               split_samples([references]), strict=True))]

    def scorer(self, records, where):
        def score(pick: np.ndarray) -> float:
            place = _where(pick, where)
            value = _called(lambda: self.metric.score([records[i] for i in pick]), self.name,
                            place, TWO_PART_CALLED_AS)
            return _checked(value, self.name, place)

        return score


def _where(pick: np.ndarray, whole: str) -> str:
    """Words for the samples `pick` names: `whole` (every sample once, in order) or a
    bootstrap resample of them."""
    if np.array_equal(pick, np.arange(len(pick))):
        return whole
    return f"a bootstrap resample of {whole}"


def metric_for(name: str, task=None, function=None) -> Metric:
    """The metric `name` in its two parts: a task's primary metric where `task` is judged
    by it (labels), else the built-in or ``module:name`` metric (`function`, when already
    resolved: :func:`resolve_metric`)."""
    from quantlab.evaluation.tasks import PRIMARY_METRIC

    if task is not None and name == task.primary_metric:
        return _Task(name, task)
    if name in PRIMARY_METRIC.values():
        raise ConfigError(f"metric '{name}' is a task metric: it needs the ground truth "
                          f"of a {name}-scored task (a quantlab.evaluation.tasks.Task), not "
                          f"{'none' if task is None else task.kind}.")
    found = resolve_metric(name) if function is None else function
    if found is output_sqnr:
        return _Sqnr(name)
    if found is argmax_agreement:
        return _Agreement(name)
    if _two_part(found):
        return _TwoPart(name, found)
    return _Function(name, found)


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

    @property
    def near_miss(self) -> bool:
        """Scored inside the budget but not certified: its interval reaches below the limit."""
        return not self.certified and self.value >= self.limit

    def samples_to_certify(self) -> int | None:
        """About how many samples would certify this score: the interval's lower half
        shrinks as 1 / sqrt(samples) until it fits above the limit (None: certified, or
        scored outside the budget)."""
        margin, below = self.value - self.limit, self.value - self.limit - self.interval[0]
        if self.certified or margin <= 0 or below <= 0:
            return None
        return int(np.ceil(self.samples * (below / margin) ** 2))

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


def remembered(score: Score, known: dict[bytes, float]) -> Score:
    """`score` with its value per set of picked samples kept in `known`: FP32's score on a
    bootstrap resample is the same for every plan certified against it (same references,
    same seed, so the same resamples)."""
    def score_once(pick: np.ndarray) -> float:
        key = np.asarray(pick).tobytes()
        if key not in known:
            known[key] = score(pick)
        return known[key]

    return score_once


def certify_paired(name: str, evaluate: Callable[[np.ndarray], tuple[float, float]],
                   count: int, full: tuple[float, float] | None = None, *,
                   max_drop: float | None = None, floor: float | None = None,
                   resamples: int = 200, confidence: float = 0.95,
                   seed: int = 0, progress: Callable | None = None) -> Certificate:
    """Certify a plan from ``evaluate(sample indices) -> (candidate value, FP32 value)``.

    The margin (value minus limit) is bootstrapped over the `count` samples, FP32
    scored on the same resample (paired); the plan is certified when the lower end
    of the one-sided `confidence` interval is >= 0. With ``max_drop``, an interval
    half-width over max_drop / 2 means the evaluation set is too small to certify
    that budget; the size needed follows from the half-width shrinking as
    1 / sqrt(samples). `full` is evaluate on all samples when already known. `progress`
    (``(items, desc=) -> items``) shows the resamples (a slow metric's bootstrap).
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
    for b in (progress or (lambda items, **_: items))(range(resamples),
                                                      desc=f"{name}: bootstrap"):
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


class Reference:
    """FP32's side of every paired score against it: its records (the metric of FP32's
    outputs against themselves) and its score on all samples and on each resample, kept:
    every candidate certified with the same seed is resampled the same way, so FP32 is
    scored once per resample, not once per candidate (half a custom metric's bootstrap)."""

    def __init__(self, metric: Metric, what: str = "evaluation samples",
                 scores: dict[bytes, float] | None = None):
        self.metric, self.what = metric, what
        self.records: list = []
        self.scores = {} if scores is None else scores
        self._score: Score | None = None

    def update(self, references: Mapping[str, np.ndarray]) -> None:
        """Record one batch of FP32's outputs (samples on axis 0)."""
        self.records += self.metric.records(references, references, len(self.records))
        self._score = None

    def score(self, pick: np.ndarray) -> float:
        """FP32's metric of the samples picked (kept per resample)."""
        if self._score is None:
            where = f"FP32 on {self.what} 0..{len(self.records) - 1}"
            made = []  # FP32's scorer, made when a resample is first not known

            def fresh(positions: np.ndarray) -> float:
                if not made:
                    made.append(self.metric.scorer(self.records, where))
                return made[0](positions)

            self._score = remembered(fresh, self.scores)
        return self._score(pick)


class PairedScore:
    """A candidate's metric against FP32's, folded batch by batch (:meth:`update`), scored
    with a paired bootstrap interval (:meth:`certificate`).

    `metric` is a :class:`Metric` or a metric name (:func:`metric_for`, with `task` for a
    task metric). `reference` is FP32's side when it is shared with other candidates (made
    and filled by the caller); without one, FP32's side is recorded from the batches given
    to :meth:`update`. Only records are kept, never outputs (a one-function metric's
    records are its outputs). `progress` (``(items, desc=) -> items``) shows the bootstrap.
    """

    def __init__(self, metric: Metric | str, task=None, resamples: int = 200,
                 reference: Reference | None = None, what: str = "evaluation samples",
                 progress: Callable | None = None):
        self.metric = metric if isinstance(metric, Metric) else metric_for(metric, task)
        self.resamples, self.what, self.progress = resamples, what, progress
        self.own_reference = reference is None
        self.reference = Reference(self.metric, what) if reference is None else reference
        self.records: list = []

    @classmethod
    def of_reference(cls, reference: Reference, resamples: int = 200) -> PairedScore:
        """FP32 scored as a candidate against itself (its records known already)."""
        paired = cls(reference.metric, resamples=resamples, reference=reference,
                     what=reference.what)
        paired.records = reference.records
        return paired

    def update(self, outputs: Mapping[str, np.ndarray],
               references: Mapping[str, np.ndarray]) -> None:
        """Fold one batch of the candidate's and FP32's outputs (samples on axis 0)."""
        self.records += self.metric.records(outputs, references, len(self.records))
        if self.own_reference:
            self.reference.update(references)

    @property
    def count(self) -> int:
        return len(self.records)

    def score(self) -> Score:
        """``score(positions)``: the candidate's metric of the samples at those positions."""
        return self.metric.scorer(self.records, f"{self.what} 0..{self.count - 1}")

    def certificate(self, max_drop: float | None = None, floor: float | None = None, *,
                    confidence: float = 0.95, seed: int = 0) -> Certificate:
        """The candidate's value, FP32's (``reference``) and the paired interval of the
        margin over the budget (`max_drop` from FP32's value, or `floor`); with neither,
        of the change from FP32 (margin over ``limit`` = FP32's value), or of the value
        itself where FP32's is infinite (output SQNR: ``limit`` 0)."""
        if self.count == 0:
            raise DataError(f"no {self.what} to score metric '{self.metric.name}' on.")
        if self.count != len(self.reference.records):
            raise DataError(f"metric '{self.metric.name}': the candidate has {self.count} "
                            f"{self.what} but FP32 {len(self.reference.records)}; score both on "
                            "the same samples.")
        whole = np.arange(self.count)
        fp32_value = self.reference.score(whole)
        candidate = self.score()
        value = candidate(whole)
        if max_drop is None and floor is None:
            if np.isfinite(fp32_value):
                max_drop = 0.0
            else:
                floor = 0.0
        return certify_paired(self.metric.name,
                              lambda pick: (candidate(pick), self.reference.score(pick)),
                              self.count, (value, fp32_value), max_drop=max_drop, floor=floor,
                              resamples=self.resamples, confidence=confidence, seed=seed,
                              progress=self.progress)


def certify(metric: Callable, name: str, outputs: Outputs, references: Outputs, *,
            max_drop: float | None = None, floor: float | None = None,
            resamples: int = 200, confidence: float = 0.95, seed: int = 0,
            what: str = "evaluation samples",
            fp32_scores: dict[bytes, float] | None = None) -> Certificate:
    """:class:`PairedScore` of a metric (a function, a two-part metric, or a built-in) on
    outputs held in lists of batches. `fp32_scores` (a dict the caller keeps across calls
    with the same `metric`, `references` and `seed`) holds FP32's score on all samples and
    on each resample (:class:`Reference`)."""
    scored = metric_for(name, function=metric)
    paired = PairedScore(scored, resamples=resamples, what=what,
                         reference=Reference(scored, what, fp32_scores))
    for batch, reference in zip(outputs, references, strict=True):
        paired.update(batch, reference)
        paired.reference.update(reference)
    return paired.certificate(max_drop, floor, confidence=confidence, seed=seed)


def versus(first: PairedScore, second: PairedScore, resamples: int = 200) -> Certificate:
    """The paired interval of first's metric minus second's, both scored against the same
    FP32 outputs (``interval``: margin over ``limit`` = second's value)."""
    one, two = first.score(), second.score()
    return certify_paired(first.metric.name, lambda pick: (one(pick), two(pick)), first.count,
                          max_drop=0.0, resamples=resamples)


# Kept for users of the first form: output_sqnr / argmax_agreement carry the per-sample
# figures' resamplers as one-function metrics did (docs/metrics.md).
output_sqnr.resampler = lambda outputs, references: pooled_sqnr(*joined_energies(
    [sample_energies(o, r) for o, r in zip(outputs, references, strict=True)]))
argmax_agreement.resampler = lambda outputs, references: (
    lambda agreements: lambda pick: float(agreements[pick].mean()))(
        _agreements(outputs, references))
