"""The one scorer (quantlab/evaluation/scoring.py): two-part metrics against their one-function
form, how often each part is called, and FP32's side kept across candidates."""

from __future__ import annotations

import numpy as np
import pytest

from quantlab.errors import DataError
from quantlab.evaluation import scoring


def _decode(y: np.ndarray) -> set[tuple[int, int]]:
    """A stand-in for a detector's decode: the (row, class) cells of one sample above 0.5."""
    return {(int(i), int(j)) for i, j in zip(*np.nonzero(y[0] > 0.5), strict=True)}


def _counts(outputs: dict, references: dict) -> tuple[int, int, int]:
    found, wanted = _decode(outputs["y"]), _decode(references["y"])
    return len(found & wanted), len(found - wanted), len(wanted - found)


def _f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0


def f1_function(outputs: list, references: list) -> float:
    """The one-function form: decodes every sample it is given, on every call."""
    totals = np.zeros(3, int)
    for o, r in zip(outputs, references, strict=True):
        for i in range(len(r["y"])):
            totals += _counts({"y": o["y"][i:i + 1]}, {"y": r["y"][i:i + 1]})
    return _f1(*totals)


class F1TwoPart:
    """The two-part form of the same metric; counts its per-sample calls."""

    def __init__(self):
        self.recorded = 0

    def record(self, outputs, references):
        self.recorded += 1
        return _counts(outputs, references)

    def score(self, records):
        return _f1(*np.sum(records, axis=0)) if records else 1.0


def _detections(seed: int, samples: int = 40, flip: float = 0.08):
    rng = np.random.default_rng(seed)
    references = [{"y": rng.random((8, 6, 4))} for _ in range(samples // 8)]
    outputs = [{"y": np.where(rng.random(r["y"].shape) < flip, 1 - r["y"], r["y"])}
               for r in references]
    return outputs, references


@pytest.mark.parametrize("budget", [{"max_drop": 0.05}, {"max_drop": 0.2}])
def test_a_two_part_metric_gives_the_certificate_of_its_one_function_form(budget):
    """Bit-identical certificates: the same resamples, the same arithmetic on the same
    counts; the per-sample part runs once per sample (and once per FP32 sample), however
    many resamples the bootstrap draws."""
    outputs, references = _detections(0)
    two_part = F1TwoPart()
    fast = scoring.certify(two_part, "f1", outputs, references, resamples=300, **budget)
    slow = scoring.certify(f1_function, "f1", outputs, references, resamples=300, **budget)
    assert fast == slow
    assert 0.5 < fast.value < 1.0 and fast.reference == 1.0
    assert two_part.recorded == 2 * 40  # candidate and FP32, each sample once


def test_fp32_records_are_made_once_for_every_candidate():
    """A shared Reference: FP32's per-sample part runs once in all, each candidate's once
    per sample, and certificates equal those scored with FP32 recorded afresh."""
    _, references = _detections(1)
    metric = F1TwoPart()
    scored = scoring.metric_for("f1", function=metric)
    reference = scoring.Reference(scored)
    for batch in references:
        reference.update(batch)
    assert metric.recorded == 40
    certificates = []
    for seed in (2, 3, 4):
        outputs = [{"y": np.where(np.random.default_rng(seed).random(r["y"].shape) < 0.05,
                                  1 - r["y"], r["y"])} for r in references]
        paired = scoring.PairedScore(scored, resamples=100, reference=reference)
        for o, r in zip(outputs, references, strict=True):
            paired.update(o, r)
        certificates.append(paired.certificate(max_drop=0.1))
        assert certificates[-1] == scoring.certify(F1TwoPart(), "f1", outputs, references,
                                                   max_drop=0.1, resamples=100)
    assert metric.recorded == 40 + 3 * 40
    assert len(reference.scores) == 1 + 100  # all samples, and each resample: scored once


def test_a_two_part_class_is_made_and_its_failures_are_named(tmp_path, monkeypatch):
    """`module:Class` makes the class with no arguments; a record that raises, or a score
    that is not a finite number, is a DataError naming the metric and the samples."""
    (tmp_path / "two_part_metric.py").write_text(
        "class F1:\n"
        "    def record(self, outputs, references):\n"
        "        return 1\n"
        "    def score(self, records):\n"
        "        return float('nan') if len(records) < 3 else 1.0\n"
        "class Broken:\n"
        "    def record(self, outputs, references):\n"
        "        raise KeyError('boxes')\n"
        "    def score(self, records):\n"
        "        return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = scoring.resolve_metric("two_part_metric:F1")
    assert not isinstance(found, type) and found.record(None, None) == 1
    outputs, references = _detections(0, samples=8)
    assert scoring.certify(found, "two_part_metric:F1", outputs, references,
                           max_drop=0.1).certified
    with pytest.raises(DataError, match=r"metric 'two_part_metric:Broken' failed on sample 0: "
                       r"KeyError: 'boxes'"):
        scoring.certify(scoring.resolve_metric("two_part_metric:Broken"),
                        "two_part_metric:Broken", outputs, references, max_drop=0.1)
    few = [{"y": r["y"][:2]} for r in references[:1]]
    with pytest.raises(DataError, match=r"metric 'f' returned NaN on FP32 on evaluation "
                       r"samples 0..1"):
        scoring.certify(found, "f", few, few, max_drop=0.1)


def test_task_records_score_as_the_task_metric():
    """A classification task's records are per-sample hits: the score of picked samples is
    their top-1, against labels, not FP32."""
    from quantlab.evaluation.tasks import Task

    rng = np.random.default_rng(5)
    labels = rng.integers(0, 4, 24)
    logits = [{"logits": rng.standard_normal((8, 4))} for _ in range(3)]
    task = Task("classification", lambda outputs, ids: outputs["logits"], labels=labels)
    paired = scoring.PairedScore("top1", task)
    for batch in logits:
        paired.update(batch, batch)
    hits = np.argmax(np.concatenate([b["logits"] for b in logits]), axis=1) == labels
    pick = rng.integers(0, 24, 24)
    assert paired.score()(pick) == pytest.approx(hits[pick].mean())
    assert paired.certificate().value == pytest.approx(hits.mean())
