"""Calibrators against slow line-by-line references of the published algorithms."""

import math

import numpy as np
import pytest
from helpers import zoo_params

from quantlab import choices, graph, zoo
from quantlab.calibration import qdq
from quantlab.calibration.calibrate import (
    CALIBRATORS,
    KL_TIE_TOLERANCE,
    SAFE_AMAX,
    Calibrator,
    Scales,
    calibrate,
    check_method,
    entropy_threshold_bin,
    make_calibrator,
    mse_threshold_bin,
    percentile_threshold_bin,
)
from quantlab.calibration.collect import OVERSAMPLE, Statistics, TensorStats, collect
from quantlab.data import open_data
from quantlab.errors import ConfigError, DataError


def reference_entropy_bin(hist, start_bin=128, num_levels=128):
    """GTC 2017 / pytorch-quantization entropy search, one candidate and one bin at a time."""
    bins = [float(v) for v in hist]
    n = len(bins)
    bins[0] = bins[1]
    if sum(bins) == 0:
        return n
    divergences = []
    for i in range(start_bin, n + 1):
        outliers = sum(bins[i:])
        p = bins[:i]
        p[i - 1] += outliers
        # Quantize bins[:i] (without the outliers) into levels; spread each level
        # over the bins that are non-zero in bins[:i].
        level_sum = [0.0] * num_levels
        level_count = [0] * num_levels
        for j in range(i):
            level = j * num_levels // i
            if bins[j] != 0:
                level_sum[level] += bins[j]
                level_count[level] += 1
        q = [0.0] * i
        for j in range(i):
            if bins[j] != 0:
                level = j * num_levels // i
                q[j] = level_sum[level] / level_count[level]
        p_total, q_total = sum(p), sum(q)
        kl = 0.0
        for pj, qj in zip(p, q, strict=True):
            if pj == 0:
                continue
            if qj == 0:
                kl = math.inf
                break
            kl += pj / p_total * math.log((pj / p_total) / (qj / q_total))
        divergences.append(kl)
    best = min(divergences)
    if math.isinf(best):
        return n
    return max(start_bin + k for k, d in enumerate(divergences) if d <= best + KL_TIE_TOLERANCE)


def abs_histogram(samples, bins):
    samples = np.abs(samples)
    return np.histogram(samples, bins=bins, range=(0, samples.max()))[0]


def synthetic_histograms(bins):
    rng = np.random.default_rng(7)
    gauss = rng.standard_normal(200_000)
    sparse = np.zeros(bins)
    sparse[rng.choice(bins, 40, replace=False)] = rng.integers(1, 1000, 40)
    spike = np.zeros(bins)
    spike[bins // 3] = 5000
    return {
        "gaussian": abs_histogram(gauss, bins),
        "laplacian": abs_histogram(rng.laplace(size=200_000), bins),
        "student-t": abs_histogram(rng.standard_t(3, size=200_000), bins),
        "one-sided": abs_histogram(np.maximum(gauss, 0), bins),
        "uniform": abs_histogram(rng.uniform(-1, 1, 200_000), bins),
        "outlier": abs_histogram(np.append(gauss, 60.0), bins),
        "all-zero": np.zeros(bins),
        "zeros-only-in-bin-0": np.eye(1, bins)[0] * 100,
        "single-spike": spike,
        "sparse": sparse,
    }


@pytest.mark.parametrize("name", list(synthetic_histograms(512)))
def test_entropy_matches_reference_512_bins(name):
    hist = synthetic_histograms(512)[name]
    assert entropy_threshold_bin(hist) == reference_entropy_bin(hist)


@pytest.mark.parametrize("name", ["gaussian", "student-t", "sparse"])
def test_entropy_matches_reference_2048_bins(name):
    hist = synthetic_histograms(2048)[name]
    assert entropy_threshold_bin(hist) == reference_entropy_bin(hist)


def test_entropy_known_values():
    # A flat histogram is reproduced exactly by 128 levels only with no clipping.
    assert entropy_threshold_bin(np.full(2048, 10.0)) == 2048
    # One spike: every candidate that keeps it has KL 0; ties go to the widest range.
    spike = np.zeros(2048)
    spike[700] = 1.0
    assert entropy_threshold_bin(spike) == 2048
    # An isolated outlier sits alone in its level and is represented exactly:
    # the algorithm keeps it (folding it into an empty bin instead is infinite KL).
    hist = np.zeros(2048)
    hist[:256] = 1000.0
    hist[2047] = 1.0
    assert entropy_threshold_bin(hist) == 2048
    # A smooth exponential tail is clipped: wide levels blur the dense head.
    decay = np.exp(-np.arange(2048) / 30.0) * 1e6
    assert entropy_threshold_bin(decay) < 1024


@pytest.fixture(scope="module")
def resnet_stats(tmp_path_factory):
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    module = torchvision.models.resnet18(weights=None, num_classes=10)
    path = tmp_path_factory.mktemp("resnet") / "resnet18.onnx"
    model = graph.export_torch(module, np.zeros((1, 3, 32, 32), np.float32), path)
    floats = graph.float_tensors(model)
    tensors = [t for t in graph.topological_tensors(model) if t in floats]
    data = np.random.default_rng(0).standard_normal((16, 3, 32, 32)).astype(np.float32)
    source = open_data(data, graph.input_specs(model), batch_size=8)
    return collect(model, source, tensors, num_bins=512, progress=False)


def test_entropy_matches_reference_on_resnet18_histograms(resnet_stats):
    names = list(resnet_stats.tensors)
    assert len(names) > 20
    for name in names[::4]:
        hist, _ = resnet_stats.tensors[name].histogram(512)
        assert entropy_threshold_bin(hist) == reference_entropy_bin(hist), name


@pytest.mark.parametrize("name", zoo_params())
def test_entropy_matches_reference_on_zoo_histograms(name, tmp_path):
    # The histograms calibration really meets: every calibrated activation of each zoo
    # model on 32 of its calibration samples (512 bins keep the reference fast).
    entry = zoo.get(name)
    samples = entry.calibration_set()[:32]
    model = graph.export_torch(entry.build(), samples[:2], tmp_path / "model.onnx",
                               output_names=entry.output_names)
    source = open_data(samples, graph.input_specs(model), batch_size=16)
    stats = collect(model, source, qdq.activation_tensors_to_calibrate(model), num_bins=512,
                    progress=False)
    for tensor, tensor_stats in stats.tensors.items():
        hist, _ = tensor_stats.histogram(512)
        assert entropy_threshold_bin(hist) == reference_entropy_bin(hist), tensor


def test_calibrate_methods_on_resnet18(resnet_stats):
    maxima = calibrate(resnet_stats, "max")
    for method in ("entropy", "percentile", "mse"):
        scales = calibrate(resnet_stats, method)
        for name, amax in scales.amax.items():
            # Histogram methods clip or keep the range; entropy may add half a bin.
            assert 0 < amax <= maxima.amax[name] * (1 + 0.5 / 512) + 1e-12, (method, name)
        assert scales.num_samples == 16


def reference_percentile_bin(hist, percentile):
    total = sum(float(v) for v in hist)
    running = 0.0
    for k, count in enumerate(hist, start=1):
        running += float(count)
        if running >= total * percentile / 100.0:
            return k
    return len(hist)


@pytest.mark.parametrize("percentile", [50.0, 99.0, 99.99, 100.0])
def test_percentile_matches_reference(percentile):
    for name, hist in synthetic_histograms(512).items():
        if hist.sum():
            expected = reference_percentile_bin(hist, percentile)
            assert percentile_threshold_bin(hist, percentile) == expected, name


def test_percentile_amax_brackets_numpy_percentile():
    samples = np.abs(np.random.default_rng(3).standard_normal(100_000)).astype(np.float32)
    stats = Statistics({"x": _stats_of(samples)}, 1)
    amax = calibrate(stats, "percentile", percentile=99.0).amax["x"]
    width = samples.max() / 2048
    # The bin's upper edge lies at most one calibration bin (plus interpolation) above.
    assert np.percentile(samples, 99.0) <= amax <= np.percentile(samples, 99.0) + 1.5 * width


def reference_mse_bin(hist, start_bin):
    best_k, best_error = None, math.inf
    for k in range(start_bin, len(hist) + 1):
        scale = k / 127.0
        error = 0.0
        for j, count in enumerate(hist):
            centre = j + 0.5
            quantized = min(round(centre / scale), 127) * scale
            error += float(count) * (quantized - centre) ** 2
        if error < best_error:
            best_k, best_error = k, error
    return best_k


@pytest.mark.parametrize("name", ["gaussian", "laplacian", "student-t", "outlier", "sparse"])
def test_mse_matches_reference(name):
    hist = synthetic_histograms(256)[name]
    assert mse_threshold_bin(hist, 64) == reference_mse_bin(hist, 64)


def _stats_of(values):
    stats = TensorStats.empty(2048 * OVERSAMPLE)
    assert stats.update(np.array(values, np.float32))
    return stats


def test_max_and_entropy_amax_values():
    values = np.random.default_rng(1).uniform(-3.0, 2.0, 50_000).astype(np.float32)
    stats = Statistics({"x": _stats_of(values)}, 50_000)
    assert calibrate(stats, "max").amax["x"] == float(np.abs(values).max())
    # Uniform data is not clipped; TensorRT then writes amax = (2048 + 0.5) bins.
    amax = calibrate(stats, "entropy").amax["x"]
    assert amax == pytest.approx(float(np.abs(values).max()) * 2048.5 / 2048, rel=1e-12)


def test_all_zero_tensor_gets_safe_amax_and_warns_once_at_collection(recwarn):
    # collect() warns about all-zero tensors; calibrate() does not repeat it (it runs once
    # per method: the demo would warn five times). tests/test_cli.py checks one line in a run.
    stats = Statistics({"zero": _stats_of(np.zeros(100))}, 1)
    for method in ("entropy", "max", "percentile", "mse"):
        assert calibrate(stats, method).amax["zero"] == SAFE_AMAX
    assert not recwarn.list


def test_tensor_without_values_gets_safe_amax_with_warning():
    stats = Statistics({"x": _stats_of([1.0, 2.0]), "empty": TensorStats.empty(2048 * OVERSAMPLE)},
                       1)
    with pytest.warns(UserWarning, match=r"held no values.*'empty'"):
        assert calibrate(stats, "entropy").amax["empty"] == SAFE_AMAX


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_statistics_are_refused_naming_the_tensor(bad, recwarn):
    tensor = _stats_of([1.0, 2.0])
    tensor.max = bad
    stats = Statistics({"x": _stats_of([1.0]), "conv/out:0": tensor}, 1)
    for method in ("entropy", "max", "percentile", "mse"):
        with pytest.raises(DataError, match=r"'conv/out:0'.*non-finite.*Collect the statistics"):
            calibrate(stats, method)
    assert not [w for w in recwarn.list if "zeros" in str(w.message)]


def _one_outlier(rng, size=12_800, value=1e6):
    """|x| of ordinary activations with one extreme value (the reliability report's case 7.3)."""
    values = rng.standard_normal(size).astype(np.float32)
    values[4321] = value
    return values


def test_one_outlier_warns_naming_tensor_amax_percentile_and_sample():
    tensor = _stats_of(_one_outlier(np.random.default_rng(0)))
    tensor.max_sample = 17  # collect records the sample holding max |x| when it can
    stats = Statistics({"ok": _stats_of(np.random.default_rng(1).standard_normal(5000)),
                        "input": tensor}, 200)
    for method in ("entropy", "max", "percentile", "mse"):
        with pytest.warns(UserWarning) as record:
            amax = calibrate(stats, method).amax["input"]
        assert len(record) == 1  # one warning per call, listing the tensors
        message = str(record[0].message)
        assert f"'input' amax {amax:.4g}" in message
        assert "max |x| 1e+06 in sample 17" in message
        assert "99.99th percentile <= 488" in message  # 1e6 / 2048: the first bin
        assert "'ok'" not in message
        assert "Remove or fix the sample" in message


def test_extreme_value_a_method_clips_does_not_warn_for_it(recwarn):
    # max |x| 50 among 100,000 standard normal values: percentile (99.99) clips it near 3.9,
    # max keeps it and gets the warning with the advice to clip.
    values = np.random.default_rng(2).standard_normal(100_000)
    values[7] = 50.0
    stats = Statistics({"x": _stats_of(values)}, 100)
    calibrate(stats, "percentile")
    assert not recwarn.list
    with pytest.warns(UserWarning, match=r"'x' amax 50 .*--method percentile or mse"):
        calibrate(stats, "max")


def test_zoo_like_data_does_not_warn(recwarn):
    rng = np.random.default_rng(3)
    relu = np.maximum(rng.standard_normal(50_000), 0.0)  # half exact zeros, as after a ReLU
    stats = Statistics({"relu": _stats_of(relu), "x": _stats_of(rng.uniform(-3, 2, 50_000))}, 1)
    for method in ("entropy", "max", "percentile", "mse"):
        calibrate(stats, method)
    assert not recwarn.list


def test_bad_method_and_parameters():
    stats = Statistics({"x": _stats_of([1.0, 2.0])}, 1)
    with pytest.raises(ConfigError, match="kl"):
        calibrate(stats, "kl")
    with pytest.raises(ConfigError, match="percentile"):
        calibrate(stats, "entropy", percentile=99.0)
    with pytest.raises(ConfigError, match="percentile"):
        calibrate(stats, "percentile", percentile=0.0)
    with pytest.raises(ConfigError, match="start_bin"):
        check_method("mse", {"start_bin": 4096})
    assert check_method("percentile", {}) == {"percentile": 99.99}


@pytest.mark.parametrize(("method", "params", "match"), [
    ("entropy", {"num_levels": 0}, r"num_levels must be in \[1, 2048\], got 0"),
    ("entropy", {"num_levels": 4096}, "num_levels must be in"),
    ("entropy", {"num_levels": 2.5}, "num_levels must be an integer"),
    ("entropy", {"start_bin": True}, "start_bin must be an integer"),
    ("mse", {"start_bin": "128"}, "start_bin must be an integer"),
    ("entropy", {"start_bin": 0}, r"start_bin must be in \[1, 2048\]"),
    ("percentile", {"percentile": "99"}, "percentile must be a number, got '99'"),
    ("percentile", {"percentile": None}, "percentile must be a number"),
    ("percentile", {"percentile": float("nan")}, "percentile must be in"),
])
def test_check_method_refuses_bad_types_and_ranges_before_any_work(method, params, match):
    with pytest.raises(ConfigError, match=match):
        check_method(method, params)


def test_check_method_accepts_numpy_numbers_and_extreme_legal_values():
    assert check_method("percentile", {"percentile": np.float32(99.5)}) == {"percentile": 99.5}
    assert check_method("entropy", {"num_levels": np.int64(1), "start_bin": 1}) == {
        "num_levels": 1, "start_bin": 1}
    stats = Statistics({"x": _stats_of(np.random.default_rng(4).standard_normal(1000))}, 1)
    for levels in (1, 2048):
        assert math.isfinite(calibrate(stats, "entropy", num_levels=levels, start_bin=1).amax["x"])


def test_scales_round_trip(tmp_path):
    scales = Scales({"a": 0.1 + 0.2, "b/c:0": 1e-30, "d": 3.0}, "percentile",
                    {"percentile": 99.9}, 64)
    path = scales.save(tmp_path / "scales.json")
    loaded = Scales.load(path)
    assert loaded == scales
    assert loaded.scale["d"] == 3.0 / 127.0


def test_scales_load_errors(tmp_path):
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(DataError, match="other.json"):
        Scales.load(tmp_path / "other.json")
    (tmp_path / "broken.json").write_text('{"format": "quantlab.scales", "tensors": {"a": {}}}')
    with pytest.raises(DataError, match="broken.json"):
        Scales.load(tmp_path / "broken.json")



@pytest.mark.parametrize("amax", ['"NaN"', '"Infinity"', "NaN", "Infinity", '"1.5"', "0", "-1",
                                  "true", "null"])
def test_scales_load_refuses_non_finite_or_non_numeric_amax(tmp_path, amax):
    path = tmp_path / "scales.json"
    path.write_text('{"format": "quantlab.scales", "method": "max", "params": {}, '
                    '"num_samples": 1, "tensors": {"ok": {"amax": 1.0}, "conv_out": {"amax": '
                    + amax + "}}}")
    with pytest.raises(DataError, match=r"scales.json: tensor 'conv_out' has amax .*finite"):
        Scales.load(path)




def test_calibrator_registry_matches_the_methods_the_command_line_offers():
    assert tuple(CALIBRATORS) == choices.METHODS
    assert choices.DEFAULT_METHOD in CALIBRATORS
    assert set(choices.DEFAULT_PLAN_CALIBRATORS) <= set(CALIBRATORS)
    for label, (name, params) in choices.AUTO_CANDIDATES.items():
        assert isinstance(make_calibrator(name, params), CALIBRATORS[name]), label
    assert choices.AUTO_DEFAULT in choices.AUTO_CANDIDATES
    for name, cls in CALIBRATORS.items():
        assert issubclass(cls, Calibrator)
        assert check_method(name, {}) == cls().params  # the class's fields are the defaults
    # TensorRT has a calibrator of our entropy's name alone: other caches get min-max's header.
    from quantlab.calibration import pipeline

    assert pipeline.CACHE_ALGORITHM == {**dict.fromkeys(choices.CALIBRATE_METHODS,
                                                        "MinMaxCalibration"),
                                        "entropy": "EntropyCalibration2"}


def test_calibrator_classes_choose_the_reference_bins():
    rng = np.random.default_rng(5)
    hist = np.histogram(np.abs(rng.standard_t(3, 50_000)), bins=256)[0].astype(np.float64)
    top, width = 8.0, 8.0 / 256
    assert CALIBRATORS["max"]().amax(hist, top) == top
    assert CALIBRATORS["entropy"](start_bin=32, num_levels=16).amax(hist, top) == (
        reference_entropy_bin(hist, 32, 16) + 0.5) * width
    assert CALIBRATORS["percentile"](99.0).amax(hist, top) == (
        reference_percentile_bin(hist, 99.0) * width)
    assert CALIBRATORS["mse"](start_bin=64).amax(hist, top) == (
        reference_mse_bin(hist, 64) * width)
