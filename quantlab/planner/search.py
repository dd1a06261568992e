"""The MILP front: the most INT8 MACs within a predicted-noise budget, plan by plan (the
Search stage, :mod:`quantlab.planner.choose`, evaluates its plans)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from quantlab.calibration import qdq
from quantlab.errors import ConfigError
from quantlab.planner.units import Unit

# Budgets of the front past which the small steps are thinned (see front).
FRONT_STEPS = 32


@dataclass
class FrontPoint:
    """The plan with the most INT8 MACs whose predicted noise stays within `budget`."""

    budget: float
    predicted: float
    int8_mac_share: float
    precisions: dict[str, str]


def fallback_precision(allowed: Sequence[str], high_precision: str = "fp16") -> str:
    """The precision a unit runs in when not INT8: FP16 where allowed and wanted, else FP32."""
    return "fp16" if high_precision == "fp16" and "fp16" in allowed else "fp32"


def solve(units: Sequence[Unit], allowed: Mapping[str, Sequence[str]],
          contribution: Mapping[str, float], budget: float,
          high_precision: str = "fp16",
          fp16_contribution: Mapping[str, float] | None = None) -> FrontPoint:
    """Maximize the INT8 share of MACs subject to the predicted noise staying <= `budget`.

    Each unit runs INT8 (adding `contribution`), FP16 (adding `fp16_contribution`,
    where its hard reasons and `high_precision` allow FP16; units missing from it
    add none, an infinite figure forbids FP16) or FP32 (adding none). Two 0/1
    knapsacks solved exactly by ``scipy.optimize.milp``: the most INT8 MACs within
    the budget, then the most FP16 MACs among the other units within what is left.
    """
    with _native_stdout_silenced():
        return _solve(units, allowed, contribution, budget, high_precision, fp16_contribution)


def _solve(units: Sequence[Unit], allowed: Mapping[str, Sequence[str]],
           contribution: Mapping[str, float], budget: float, high_precision: str,
           fp16_contribution: Mapping[str, float] | None) -> FrontPoint:
    """:func:`solve` with HiGHS's stray prints let through (the caller silences them)."""
    if not budget >= 0:
        raise ConfigError(f"the noise budget must be a number >= 0, got {budget}.")
    names = [u.name for u in units]
    macs = np.array([u.macs for u in units], dtype=np.float64)
    total = macs.sum()
    cost = np.array([float(contribution.get(n, 0.0)) for n in names])
    half = np.array([float((fp16_contribution or {}).get(n, 0.0)) for n in names])
    can_int8 = np.array(["int8" in allowed.get(n, qdq.PRECISIONS) for n in names], bool)
    can_fp16 = np.array([high_precision == "fp16" and "fp16" in allowed.get(n, qdq.PRECISIONS)
                         for n in names], bool) & np.isfinite(half)
    # Units without MACs (or all of them, for a model without) still prefer INT8 when free.
    gain = (macs / total if total else np.zeros(len(names))) + 1e-9
    chosen = _knapsack(gain, cost, budget, can_int8)
    rounded = _knapsack(gain, half, budget - cost[chosen].sum(), can_fp16 & ~chosen)
    precisions = {n: "int8" if c else "fp16" if r else "fp32"
                  for n, c, r in zip(names, chosen, rounded, strict=True)}
    share = float(macs[chosen].sum() / total) if total else 1.0
    return FrontPoint(budget, float(cost[chosen].sum() + half[rounded].sum()), share, precisions)


def _knapsack(value: np.ndarray, weight: np.ndarray, capacity: float,
              allowed: np.ndarray) -> np.ndarray:
    """The 0/1 choice of `allowed` items with the most value whose weight fits `capacity`.

    Weights are scaled to the largest: HiGHS's feasibility tolerance (1e-7) then
    lets items lighter than 1e-7 of the largest count as free (noise contributions
    below any measurement's resolution), where unscaled it overfilled the budget.
    Without HiGHS's presolve: on knapsacks of a hundred units it took two thirds of
    each solve (20 ms on the layout detector's) and changed no choice.
    """
    # scipy.optimize takes 0.3 s to import: only the planner's solves need it.
    from scipy import optimize

    if not allowed.any():
        return np.zeros(len(value), bool)
    weight = np.where(allowed, weight, 0.0)
    # Scaled to [0, 1] (HiGHS mis-handles constraints spanning 1e-13..1: stray prints, repairs).
    unit = float(weight.max()) if weight.max() > 0 else 1.0
    weight, capacity = weight / unit, max(capacity, 0.0) / unit
    result = optimize.milp(-value / value.max(), integrality=np.ones(len(value)),
                           bounds=optimize.Bounds(0.0, allowed.astype(np.float64)),
                           constraints=[optimize.LinearConstraint(weight[None, :], -np.inf,
                                                                  capacity)],
                           options={"mip_rel_gap": 0.0, "presolve": False})
    return np.round(result.x).astype(bool)


@contextlib.contextmanager
def _native_stdout_silenced():
    """File descriptor 1 to /dev/null meanwhile (once around all of a front's threads: the
    descriptor is the process's): HiGHS <= 1.12 prints
    "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" from C++
    whatever its output options (ERGO-Code/HiGHS#2783), which would land in the middle
    of the progress bars."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no standard output to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def front(units: Sequence[Unit], allowed: Mapping[str, Sequence[str]],
          contribution: Mapping[str, float], high_precision: str = "fp16",
          fp16_contribution: Mapping[str, float] | None = None) -> list[FrontPoint]:
    """The predicted INT8-share-vs-noise front: the best plan at every budget that matters.

    The budgets are 0 and the running sums of the INT8 contributions in ascending
    order (the budget each next-cheapest unit needs), so that every unit can step
    in and the front has a point per INT8 share the knapsack reaches (log-spaced
    budgets crowd where the contributions are tiny and skip the large steps); past
    2 * FRONT_STEPS units, the FRONT_STEPS largest steps and as many evenly spaced
    among the others. Each step is solved again with room for all FP16
    contributions on top (two MILPs per budget). Per INT8 share the plan of the
    largest budget is kept: the budget its INT8 units leave goes to FP16 instead
    of FP32. The front always starts with a plan without INT8, every unit FP32
    where its rules allow: the plan of last resort (the FP32 model itself), even
    where units predicted free make the budget-0 plan partly INT8. The budgets are solved on
    all the cores (HiGHS lets go of the GIL while it solves).
    """
    budgets = _budgets(contribution, fp16_contribution)
    workers = max(1, min(len(budgets), len(os.sched_getaffinity(0))))
    with _native_stdout_silenced(), ThreadPoolExecutor(workers) as pool:
        points = list(pool.map(lambda budget: _solve(units, allowed, contribution, budget,
                                                     high_precision, fp16_contribution),
                               budgets))
    best = {}  # INT8 share -> plan; budgets ascend, so the last plan of a share wins
    for point in points:
        best[point.int8_mac_share] = point
    points = [best[share] for share in sorted(best)]
    if any(p == "int8" for p in points[0].precisions.values()):
        none = {u.name: fallback_precision(allowed.get(u.name, qdq.PRECISIONS), "fp32")
                for u in units}
        forced = sum(float((fp16_contribution or {}).get(n, 0.0)) for n, p in none.items()
                     if p == "fp16")  # units whose rules forbid FP32
        points.insert(0, FrontPoint(0.0, forced, 0.0, none))
    return points


def most_int8(units: Sequence[Unit], allowed: Mapping[str, Sequence[str]],
              contribution: Mapping[str, float], high_precision: str = "fp16",
              fp16_contribution: Mapping[str, float] | None = None) -> FrontPoint:
    """The last plan of :func:`front` (the most INT8, solved at its largest budget), without
    the rest of the front: one MILP pair instead of a hundred."""
    return solve(units, allowed, contribution, _budgets(contribution, fp16_contribution)[-1],
                 high_precision, fp16_contribution)


def _budgets(contribution: Mapping[str, float],
             fp16_contribution: Mapping[str, float] | None) -> np.ndarray:
    """The front's budgets, ascending (see :func:`front`)."""
    steps = np.cumsum(sorted(c for c in contribution.values() if 0 < c < np.inf))
    if len(steps) > 2 * FRONT_STEPS:  # the largest steps all, evenly spaced among the others
        steps = np.concatenate([steps[np.linspace(0, len(steps) - FRONT_STEPS - 1, FRONT_STEPS,
                                                  dtype=int)], steps[-FRONT_STEPS:]])
    steps = np.concatenate([[0.0], steps])
    half = sum(c for c in (fp16_contribution or {}).values() if 0 < c < np.inf)
    # Each step also with room for every FP16 unit: per INT8 share, its plan with most FP16.
    return np.unique(np.concatenate([steps, steps + half]))
