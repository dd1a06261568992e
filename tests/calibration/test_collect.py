"""Streaming statistics: exact histograms, exact merges, bounded memory, clear errors."""

import tracemalloc
import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from quantlab import graph
from quantlab.calibration import collect as collect_module
from quantlab.calibration import qdq
from quantlab.calibration.collect import OVERSAMPLE, Statistics, TensorStats, _fold, collect
from quantlab.data import BatchSource, open_data
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError, DataError

TENSORS = ["x", "log_out", "relu_out", "zero_out"]


def small_model() -> onnx.ModelProto:
    """x -> Log(|x| scaled) -> Relu, plus an all-zero branch: four float tensors [N, 4, 8]."""
    nodes = [
        helper.make_node("Abs", ["x"], ["abs_out"]),
        helper.make_node("Log", ["abs_out"], ["log_out"]),
        helper.make_node("Relu", ["log_out"], ["relu_out"]),
        helper.make_node("Mul", ["x", "zero"], ["zero_out"]),
    ]
    shape = ["N", 4, 8]
    model = helper.make_model(
        helper.make_graph(
            nodes, "small",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
             for n in ("relu_out", "zero_out")],
            [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    return graph.normalize(model)


def source(model, data, batch_size=4):
    return open_data(data, graph.input_specs(model), batch_size=batch_size)


def data(seed=0, samples=16, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((samples, 4, 8)) * scale).astype(np.float32)


def run(model, arrays, **kwargs):
    with pytest.warns(UserWarning, match="zero_out"):
        return collect(model, source(model, arrays), TENSORS, num_bins=256, progress=False,
                       **kwargs)


def assert_identical(a: Statistics, b: Statistics, max_sample: bool = False):
    assert a.num_samples == b.num_samples and list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        x, y = a.tensors[name], b.tensors[name]
        assert (x.min, x.max, x.count, x.exponent) == (y.min, y.max, y.count, y.exponent), name
        if max_sample:
            assert x.max_sample == y.max_sample, name
        assert np.array_equal(x.hist, y.hist), name


def test_histogram_matches_direct_computation():
    model = small_model()
    arrays = data()
    stats = run(model, arrays)
    x = stats.tensors["x"]
    values = np.abs(arrays.astype(np.float64))
    exponent = int(np.frexp(values.max())[1])
    assert values.max() < 2.0 ** exponent <= 2 * values.max()
    expected = np.bincount(np.floor(values.ravel() / 2.0 ** exponent * 256 * OVERSAMPLE)
                           .astype(int), minlength=256 * OVERSAMPLE)
    assert x.exponent == exponent
    assert np.array_equal(x.hist, expected)
    assert (x.min, x.max, x.count) == (arrays.min(), arrays.max(), arrays.size)
    assert stats.num_samples == 16
    # The [0, amax] calibration histogram keeps every count and empty regions.
    hist, amax = x.histogram(256)
    assert amax == np.abs(arrays).max()
    assert hist.sum() == pytest.approx(arrays.size, rel=1e-12)
    direct = np.histogram(values, bins=256, range=(0, amax))[0]
    assert np.abs(np.cumsum(hist) - np.cumsum(direct)).max() <= np.max(x.hist)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_update_counts_exactly_while_the_grid_grows(dtype):
    # Batches whose range grows and shrinks by orders of magnitude; 1001 elements is
    # not a multiple of the kernel's lanes, so its tail loop is exercised too.
    rng = np.random.default_rng(7)
    batches = [(rng.standard_normal(1001) * s).astype(dtype) for s in (0.01, 5.0, 1e-3, 300.0)]
    # A value in the last bin of the grid the earlier batches set (the kernel's signal for
    # "out of range or NaN"): counted, and the grid kept.
    top = np.ldexp(1.0, int(np.frexp(np.abs(np.concatenate(batches)).max())[1]))
    batches.append(np.array([-np.nextafter(dtype(top), dtype(0)), 1.0], dtype))
    stats = TensorStats.empty(256 * OVERSAMPLE)
    for batch in batches:
        assert _fold(stats, batch, "t")
    values = np.abs(np.concatenate(batches).astype(np.float64))
    exponent = int(np.frexp(values.max())[1])
    expected = np.bincount(np.floor(values / 2.0 ** exponent * 256 * OVERSAMPLE).astype(int),
                           minlength=256 * OVERSAMPLE)
    assert stats.exponent == exponent
    assert np.array_equal(stats.hist, expected)
    assert stats.count == values.size
    for bad in (np.inf, -np.inf, np.nan):  # refused, nothing changed
        assert not _fold(stats, np.array([1.0, bad, 2.0], dtype), "t")
        assert np.array_equal(stats.hist, expected) and stats.count == values.size
        assert (stats.min, stats.max) == (-values.max(), np.concatenate(batches).max())


def test_channel_stats_equal_each_channel_updated_as_its_own_tensor_with_its_percentiles():
    # Channels from 1e-3 to 1e4 and one all zero, the third growing run by run: every
    # channel's histogram, grid, min, max and count equal those of a TensorStats fed that
    # channel alone (the slow reference), and a run holding NaN is refused unchanged.
    rng = np.random.default_rng(3)
    channels = collect_module.ChannelStats.empty(5, 1024)
    alone = [TensorStats.empty(1024) for _ in range(5)]
    for step in range(6):
        widths = np.array([1e-3, 1.0, 10.0 * (step + 1), 0.0, 1e4])
        values = (rng.standard_normal((2, 5, 7, 3)) * widths[None, :, None, None]
                  ).astype(np.float32)
        assert channels.update(values)
        for c, stats in enumerate(alone):
            assert stats.update(np.ascontiguousarray(values[:, c]))
    for c, stats in enumerate(alone):
        own = channels.channel(c)
        assert np.array_equal(own.hist, stats.hist)
        assert (own.exponent, own.min, own.max, own.count) == \
            (stats.exponent, stats.min, stats.max, stats.count)
    # Each channel's percentile of |x|: the per-channel NumPy reference (TensorRT's
    # histogram of the channel's own statistics, then its percentile bin), to the last bit.
    from quantlab.calibration.calibrate import percentile_threshold_bin

    for percentile in (99.99, 50.0, 100.0):
        reference = []
        for stats in alone:
            hist, top = stats.histogram(1024)
            reference.append(0.0 if top == 0.0 else
                             percentile_threshold_bin(hist, percentile) * top / 1024)
        assert channels.percentiles(percentile, 1024).tolist() == reference
        assert reference[3] == 0.0 and min(reference[:3] + reference[4:]) > 0
    before = channels.hist.copy()
    assert not channels.update(np.full((1, 5, 2), np.nan, np.float32))
    assert np.array_equal(channels.hist, before)



def test_divided_channels_give_the_statistics_of_the_divided_tensor():
    # Channels of ranges 1e-2..1e2 (ReLU's zeros, one all-zero channel, a negative one)
    # divided by factors that bring them within 4x of each other, as an equalization does.
    # Reference: the divided tensor itself, computed in float64 and collected exactly.
    # Count, min and max are exact (float64 rounding). The histogram is resampled from
    # channel bins: calibrators that read its tail agree to a fraction of a channel bin
    # (1/1024 of a channel's range), the mse / max amax to 0.5 %, the percentile's to 1 %.
    from quantlab.calibration import calibrate

    rng = np.random.default_rng(7)
    ranges = np.array([1e-2, 0.3, 1.0, 0.0, 7.0, 100.0])
    values = np.maximum(rng.standard_normal((12, 6, 20, 20)), 0) * ranges[None, :, None, None]
    values[:, 4] *= -1
    divisor = np.where(ranges > 0, ranges / ranges.max(), 1.0) * rng.uniform(0.25, 1.0, 6)
    channels = collect_module.ChannelStats.empty(6, collect_module.CHANNEL_BINS)
    exact = TensorStats.empty(2048 * OVERSAMPLE)
    for sample in range(12):
        assert channels.update(values[sample:sample + 1].astype(np.float32))
        divided = values[sample] / divisor[:, None, None]
        assert exact.update(np.ascontiguousarray(divided.astype(np.float32)).reshape(-1))
    derived = channels.divided(divisor, 2048 * OVERSAMPLE)
    assert derived.count == exact.count and derived.hist.sum() == exact.hist.sum()
    np.testing.assert_allclose([derived.min, derived.max], [exact.min, exact.max], rtol=1e-6)
    assert derived.exponent == exact.exponent and derived.max_sample == -1
    for method, tolerance in (("max", 1e-6), ("mse", 5e-3), ("percentile", 1e-2)):
        want, got = (calibrate.calibrate(Statistics({"t": s}, 12), method).amax["t"]
                     for s in (exact, derived))
        assert got == pytest.approx(want, rel=tolerance), method

def test_two_halves_merged_equal_one_pass_exactly():
    model = small_model()
    # The second half has larger values, so the grid must grow between the halves.
    arrays = np.concatenate([data(1), data(2, scale=37.0), data(3, scale=0.01)])
    whole = run(model, arrays)
    first, second = run(model, arrays[:16]), run(model, arrays[16:])
    assert_identical(first.merge(second), whole)
    # Any split and any order: the grid depends only on the final max.
    parts = [run(model, arrays[i:i + 8]) for i in (40, 8, 24, 0, 32, 16)]
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merge(part)
    assert_identical(merged, whole)


def test_slices_and_segments_give_identical_statistics(monkeypatch):
    model = small_model()
    arrays = data(4, scale=3.0)
    whole = run(model, arrays)
    # Batches of 4 run one sample at a time when a sample's activations fill RUN_BYTES.
    runs = []
    run_batch = OnnxRuntimeBackend.run

    def spy(self, batch, tensors=None):
        runs.append((self.name, len(next(iter(batch.values())))))
        return run_batch(self, batch, tensors)

    monkeypatch.setattr(OnnxRuntimeBackend, "run", spy)
    monkeypatch.setattr(collect_module, "RUN_BYTES", 4 * 32 * len(TENSORS))
    assert_identical(run(model, arrays), whole)
    assert runs == [("collect", 1)] * len(arrays)
    # A budget below one sample's activations: one segment per exposed tensor, each run
    # on one-sample slices only after the batch was cut down to single samples.
    runs.clear()
    assert_identical(run(model, arrays, memory_budget=2 * 128), whole)
    # (The first segment exposes the graph input x alone: folded from the feeds, not run.)
    assert {name for name, _ in runs} == {f"collect segment {k}" for k in range(1, 4)}
    assert {size for _, size in runs} == {1}


def test_a_failing_segment_is_blamed_on_the_cut_not_the_data(monkeypatch):
    """A segment that fails where the uncut model runs on the same samples: a ModelError that
    names the segment and the budget that runs uncut, not the data."""
    from quantlab.errors import InternalRunError, ModelError

    model = small_model()
    run_batch = OnnxRuntimeBackend.run

    def third_fails(self, batch, tensors=None):
        if self.name == "collect segment 2":
            raise InternalRunError("ONNX Runtime failed to run 'collect segment 2' fed tensors "
                                   "of shapes {'log_out': (1, 4, 8)}: no")
        return run_batch(self, batch, tensors)

    monkeypatch.setattr(OnnxRuntimeBackend, "run", third_fails)
    with pytest.raises(ModelError, match=r"^the model runs uncut on samples 0\.\.0, but segment "
                       r"3 of the 4 it was cut into .* fed tensors of shapes \{'log_out'.*: no\. "
                       r"This is a quantlab bug.* --memory 1M or more runs it uncut\.$"):
        collect(model, source(model, data()), TENSORS, num_bins=256, progress=False,
                memory_budget=2 * 128)


def test_segments_cut_in_topological_order_hand_on_boundary_tensors():
    model = small_model()
    index = graph.Graph(model)
    sizes = dict.fromkeys(TENSORS, 128)
    assert collect_module.plan_groups(index, TENSORS, sizes, cap=10**6) == [TENSORS]
    groups = collect_module.plan_groups(index, TENSORS, sizes, cap=256)
    assert groups == [["x", "log_out"], ["relu_out", "zero_out"]]
    runs = collect_module._runs(index, groups)
    segments = [run.segment for run in runs]
    assert [s.group for s in segments] == groups
    # The graph input x is read by both segments; log_out is handed on as a boundary.
    assert [s.inputs for s in segments] == [["x"], ["log_out", "x"]]
    assert [s.outputs for s in segments] == [["log_out"], ["relu_out", "zero_out"]]
    assert segments[0].last_use["log_out"] == 1
    # Each sub-model holds only its own nodes.
    assert [[n.op_type for n in s.model.graph.node] for s in segments] == [
        ["Abs", "Log"], ["Relu", "Mul"]]
    # Run one after another, they share one memory arena (peak: the largest segment's).
    assert all(run.backend.shared_arena for run in runs)


@pytest.mark.parametrize("budget", [None, 16 << 10, 1])
def test_each_sample_runs_through_the_graph_once(tiny_model, monkeypatch, budget):
    """Every segment session sees every sample exactly once, and is created once."""
    model, _, _ = tiny_model
    arrays = np.random.default_rng(3).standard_normal((10, 3, 16, 16)).astype(np.float32)
    tensors = qdq.activation_tensors_to_calibrate(model)
    fed: dict[str, list[np.ndarray]] = {}
    created: list[str] = []
    run_batch, init = OnnxRuntimeBackend.run, OnnxRuntimeBackend.__init__

    def spy_run(self, batch, tensors=None):
        first = batch.get("input")
        fed.setdefault(self.name, []).append(
            first.copy() if first is not None else len(next(iter(batch.values()))))
        return run_batch(self, batch, tensors)

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        created.append(self.name)

    monkeypatch.setattr(OnnxRuntimeBackend, "run", spy_run)
    monkeypatch.setattr(OnnxRuntimeBackend, "__init__", spy_init)
    stats = collect(model, source(model, arrays, batch_size=4), tensors, progress=False,
                    memory_budget=budget)
    assert stats.num_samples == 10
    assert len(created) == len(set(created)) == len(fed)
    if budget is not None:
        assert len(fed) >= 2  # segmented (a segment exposing only the graph input is not run)
    for name, runs in fed.items():
        counts = [r if isinstance(r, int) else len(r) for r in runs]
        assert sum(counts) == 10, (name, counts)
    # The segment reading the graph input saw the samples in order, each once.
    first = next(runs for runs in fed.values() if not isinstance(runs[0], int))
    assert np.array_equal(np.concatenate(first), arrays)


@pytest.mark.parametrize("zoo_name", ["digits-cnn", "digits-vit"])
def test_segmented_collection_equals_unsegmented_on_zoo_models(zoo_name):
    from quantlab import zoo
    from quantlab.calibration import pipeline

    model = pipeline.export_zoo_model(zoo_name)
    samples = zoo.get(zoo_name).calibration_set()[:24]
    tensors = qdq.activation_tensors_to_calibrate(model)
    whole = collect(model, source(model, samples, batch_size=8), tensors, progress=False)
    segmented = collect(model, source(model, samples, batch_size=8), tensors, progress=False,
                        memory_budget=8 << 10)
    assert_same_up_to_kernel_rounding(segmented, whole)


# Float32 rounding a different kernel may add to the same math: a segment is another graph,
# which ONNX Runtime fuses differently (Conv+Relu fused or not), and a CPU's vector width
# (AVX2, AVX-512) orders the sums differently. A few ULPs: 8 ULPs of float32 is 2**-20.
KERNEL_RTOL = 2.0 ** -20


def assert_same_up_to_kernel_rounding(a: Statistics, b: Statistics):
    """Statistics of the same tensors computed by different graphs or kernels.

    Exact by construction: the tensors, sample and value counts, the total of each
    histogram. Within KERNEL_RTOL: min and max. Histograms: a value within KERNEL_RTOL
    of a bin edge may land in the neighbouring bin (on an AVX-512 machine one
    max_pool2d value of digits-cnn does), so the histograms may differ by moves of one
    bin each, of at most the share of values that close to an edge: a bin is
    2**exponent / len(hist) wide and values are below 2**exponent, so at most
    2 * KERNEL_RTOL * len(hist) of them (2**-5 with digits-cnn's 2**14 bins), far above
    the 2 moves seen in 12288 values; a wrong segment (values missed, doubled or misplaced) moves
    whole histograms. The moves are counted as the earth mover's distance in bins,
    sum |cumsum(a) - cumsum(b)|. The sample holding the max is compared exactly: two
    samples' maxima within rounding of each other are as unlikely as the exponent
    (a power of two) falling between the two maxima.
    """
    assert a.num_samples == b.num_samples and list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        x, y = a.tensors[name], b.tensors[name]
        assert x.count == y.count and x.hist.sum() == y.hist.sum(), name
        np.testing.assert_allclose([x.min, x.max], [y.min, y.max], rtol=KERNEL_RTOL, err_msg=name)
        assert x.exponent == y.exponent and len(x.hist) == len(y.hist), name
        assert x.max_sample == y.max_sample, name
        moves = np.abs(np.cumsum(x.hist, dtype=np.int64) - np.cumsum(y.hist, dtype=np.int64))
        assert moves.sum() <= 2 * KERNEL_RTOL * len(x.hist) * x.count, (name, moves.sum())


def test_sizes_come_from_the_real_input_shapes(tiny_model):
    model, _, _ = tiny_model
    batch = {"input": np.zeros((4, 3, 16, 16), np.float32)}
    tensors = qdq.activation_tensors_to_calibrate(model)
    sizes = collect_module.activation_bytes(model, tensors, batch, graph.input_specs(model), 1)
    assert sizes["input"] == 3 * 16 * 16 * 4
    assert max(sizes.values()) == 8 * 16 * 16 * 4
    assert None not in sizes.values()


def test_sizes_inference_leaves_open_are_measured_on_the_first_sample(monkeypatch):
    model = small_model()
    arrays = data(9, scale=2.0)
    whole = run(model, arrays)
    monkeypatch.setattr(collect_module, "activation_bytes",
                        lambda model, names, *args: dict.fromkeys(names))
    runs = []
    run_batch = OnnxRuntimeBackend.run

    def spy(self, batch, tensors=None):
        runs.append(len(batch["x"]))
        return run_batch(self, batch, tensors)

    monkeypatch.setattr(OnnxRuntimeBackend, "run", spy)
    assert_identical(run(model, arrays), whole)
    assert runs == [1, 3, 4, 4, 4]  # the first sample alone, then whole-batch slices


def test_max_sample_points_at_the_largest_value_and_merges(tmp_path):
    model = small_model()
    arrays = data(10, samples=24)
    arrays[13, 2, 5] = -50.0
    arrays[20, 1, 1] = 50.0  # a tie later on: the first sample keeps it
    whole = run(model, arrays)
    assert whole.tensors["x"].max_sample == 13
    merged = run(model, arrays[:12]).merge(run(model, arrays[12:]))
    assert_identical(merged, whole, max_sample=True)
    loaded = Statistics.load(whole.save(tmp_path / "stats.npz"))
    assert_identical(loaded, whole, max_sample=True)


def test_version_1_statistics_still_load(tmp_path):
    stats = run(small_model(), data(11))
    stats.save(tmp_path / "stats.npz")
    with np.load(tmp_path / "stats.npz") as archive:
        arrays = {k: archive[k] for k in archive.files if k != "max_sample"}
    arrays["version"] = np.array(1)
    np.savez(tmp_path / "v1.npz", **arrays)
    loaded = Statistics.load(tmp_path / "v1.npz")
    assert_identical(loaded, stats)
    assert {s.max_sample for s in loaded.tensors.values()} == {-1}


def test_sample_axis_1_and_integer_inputs():
    """Recurrent state [2, N, 8] (samples on axis 1) and an int64 input are fed as they are."""
    nodes = [
        helper.make_node("Relu", ["state"], ["state_out"]),
        helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "ids_f"], ["scaled"]),
    ]
    model = graph.normalize(helper.make_model(
        helper.make_graph(nodes, "state", [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "N", 8]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 8]),
        ], [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
            for n in ("state_out", "scaled")]),
        opset_imports=[helper.make_opsetid("", 18)]))
    rng = np.random.default_rng(12)
    state = rng.standard_normal((2, 10, 8)).astype(np.float32)
    state[1, 7, 3] = 9.0
    arrays = {"x": rng.standard_normal((10, 8)).astype(np.float32), "state": state,
              "ids": rng.integers(0, 3, (10, 8))}
    tensors = ["state", "state_out", "scaled"]
    whole = collect(model, open_data(arrays, graph.input_specs(model), batch_size=4), tensors,
                    num_bins=256, progress=False)
    assert whole.tensors["state_out"].max_sample == 7
    assert whole.tensors["state_out"].amax == 9.0
    segmented = collect(model, open_data(arrays, graph.input_specs(model), batch_size=4),
                        tensors, num_bins=256, progress=False, memory_budget=64)
    assert_identical(segmented, whole, max_sample=True)


def test_fixed_batch_model_runs_its_batches_whole(monkeypatch):
    model = small_model()
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.dim_value = 2
    model = graph.normalize(model)
    runs = []
    run_batch = OnnxRuntimeBackend.run

    def spy(self, batch, tensors=None):
        runs.append(len(batch["x"]))
        return run_batch(self, batch, tensors)

    monkeypatch.setattr(OnnxRuntimeBackend, "run", spy)
    monkeypatch.setattr(collect_module, "RUN_BYTES", 1)
    stats = run(model, data(13, samples=6))
    assert stats.num_samples == 6 and set(runs) == {2}


def test_save_load_round_trip_and_bad_files(tmp_path):
    model = small_model()
    stats = run(model, data(5))
    path = stats.save(tmp_path / "stats.npz")
    assert_identical(Statistics.load(path), stats)
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(DataError, match="junk.npz"):
        Statistics.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "foreign.npz", weights=np.zeros(3))
    with pytest.raises(DataError, match="foreign.npz"):
        Statistics.load(tmp_path / "foreign.npz")
    # Reliability case R2: a text file, without NumPy's advice to unpickle it.
    (tmp_path / "notes.txt").write_text("min max\n0 1\n")
    with pytest.raises(DataError, match="notes.txt is not a statistics file") as error:
        Statistics.load(tmp_path / "notes.txt")
    assert "pickle" not in str(error.value)


def test_nan_batch_names_tensor_and_batch():
    model = small_model()
    arrays = data(6)
    arrays[9, 0, 0] = np.nan
    # The data layer checks every batch as it is read (one check for every command).
    with pytest.raises(DataError, match=r"samples 8\.\.11: tensor 'x' contains NaN or Inf "
                                        r"\(batch 2, counted from 0\)"):
        collect(model, source(model, arrays), TENSORS, progress=False)
    # A finite input whose zero makes Log produce -Inf inside the graph.
    arrays = data(6)
    arrays[5, 1, 1] = 0.0
    with pytest.raises(DataError, match=r"batch 1: tensor 'log_out'"):
        collect(model, source(model, arrays), TENSORS, progress=False)


def test_activations_are_released_batch_by_batch(monkeypatch):
    # The activations live in ONNX Runtime's buffers (not traced by tracemalloc): check
    # directly that none of a batch's arrays survives past the next batch's run (during it,
    # the thread behind folds them), and none the collection.
    model = small_model()
    returned: list[list[weakref.ref]] = []
    run_batch = OnnxRuntimeBackend.run

    def spy(self, batch, tensors=None):
        assert not [ref for refs in returned[:-1] for ref in refs if ref() is not None]
        values = run_batch(self, batch, tensors)
        returned.append([weakref.ref(array) for array in values.values()])
        return values

    monkeypatch.setattr(OnnxRuntimeBackend, "run", spy)
    run(model, data(8, samples=32))
    assert len(returned) == 8
    assert not [ref for refs in returned for ref in refs if ref() is not None]


def test_memory_does_not_grow_with_samples():
    model = small_model()

    def lazy(num_batches):
        def load(start, stop):
            return {"x": data(start, stop - start)}
        return BatchSource("generated", num_batches * 64, 64, load)

    def peak(num_batches):
        tracemalloc.start()
        with pytest.warns(UserWarning):
            collect(model, lazy(num_batches), TENSORS, num_bins=256, progress=False)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    peak(2)  # warm-up: sessions, imports and caches allocate once
    small, large = peak(8), peak(64)
    # 8x the samples. Keeping each batch's four tensors would add 56 x 4 x 8 KiB = 1.8 MB.
    # The peak itself moves by up to ~130 KB from run to run (240-370 KB measured for the
    # same call: the folding threads' temporaries overlap or not), so the bound is a
    # quarter of that growth, not a ratio of two noisy peaks.
    per_batch = len(TENSORS) * data(0, 64).nbytes
    assert large - small < (64 - 8) * per_batch / 4, (small, large)


def test_memory_budget_sizes():
    assert collect_module.parse_memory(None) == 2 << 30
    assert collect_module.parse_memory("2G") == collect_module.parse_memory("2GiB") == 2 << 30
    assert collect_module.parse_memory("512m") == 512 << 20
    assert collect_module.parse_memory(1000) == 1000
    for bad in ("2X", "lots", "0", "-1G"):
        with pytest.raises(ConfigError, match="memory budget"):
            collect_module.parse_memory(bad)
