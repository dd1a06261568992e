"""The planner's sixth stage: plans of the noise model's front evaluated on the evaluation set
and certified (:func:`quantlab.planner.evaluate.evaluate_front`), FP16 then FP32 the
fallback, the plan chosen, and every evaluated plan's noise checked against the fit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantlab.planner.evaluate import Evaluation, evaluate_front, uncertified, warn_undecided
from quantlab.planner.prepare import Prepared
from quantlab.planner.rules import Rules
from quantlab.planner.search import FrontPoint
from quantlab.planner.trials import ModelFit, NoiseModel, disagreement


@dataclass
class Search:
    """The evaluated plans in order (plan, evaluation), the chosen one's position, the
    all-FP16 evaluation (or None), every evaluated plan's noise predicted and measured, and
    the plan with the most INT8 that scored inside the budget uncertified (or None)."""

    done: list[tuple[FrontPoint, Evaluation]]
    chosen: int
    floor: Evaluation | None
    noise_checks: list[dict]
    uncertified: tuple[FrontPoint, Evaluation] | None

    @property
    def point(self) -> FrontPoint:
        """The chosen plan."""
        return self.done[self.chosen][0]

    @property
    def evaluations(self) -> list[Evaluation]:
        return [e for _, e in self.done]


def search_front(prepared: Prepared, rules: Rules, noise: NoiseModel) -> Search:
    """The evaluations ("evaluations") and the noise checks ("noise checks")."""
    phases = prepared.context.phases
    with phases("evaluations"):
        done, chosen, floor = evaluate_front(noise.evaluator, rules, noise.model_fit,
                                             noise.first)
    warn_undecided([e for _, e in done], done[chosen][1])
    with phases("noise checks"):  # every evaluated plan's prediction checked on the hard samples
        checks = _noise_checks(noise.model_fit, done)
    return Search(done, chosen, floor, checks, uncertified(done, done[chosen][0]))


def _noise_checks(model_fit: ModelFit, done: list[tuple[FrontPoint, Evaluation]]
                  ) -> list[dict]:
    """Each evaluated plan with INT8: its noise predicted by the final fit against its
    measured noise on the hardest samples (from a trial when one ran it, else one more
    trial), the evaluation's measured metric beside them."""
    sensitivity = model_fit.sensitivity
    index = {m.tobytes(): t for t, m in enumerate(sensitivity.masks)}
    records = []
    for point, evaluation in done:
        mask = model_fit.mask(point)
        if not mask.any():
            continue
        measured = (sensitivity.nsr[index[mask.tobytes()]] if mask.tobytes() in index
                    else model_fit.trials.run(mask[None])[0])
        predicted = float(mask.astype(np.float64) @ sensitivity.contribution)
        records.append({"int8_mac_share": evaluation.int8_mac_share, "predicted": predicted,
                        "measured": float(measured), "factor": disagreement(predicted, measured),
                        "value": evaluation.certificate.value,
                        "certified": evaluation.certificate.certified})
    return records
