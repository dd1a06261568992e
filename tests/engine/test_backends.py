"""Torch backend mapping (module outputs -> ONNX tensors) and the TensorRT availability check."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from helpers import SSDLiteRaw, shared_weight_convs, zoo_params

from quantlab import graph, zoo
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.engine.backends.tensorrt import TensorRTBackend
from quantlab.engine.backends.torch import TorchBackend
from quantlab.errors import BackendUnavailableError, ModelError
from quantlab.evaluation import compare


class TwoHeads(torch.nn.Module):
    """A submodule returning a tuple and one returning a dict; a ReLU module used twice."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.relu = torch.nn.ReLU()
        self.split = Split()
        self.named = Named()

    def forward(self, x):
        y = self.relu(self.conv(x))
        wide, narrow = self.split(y)
        parts = self.named(self.relu(wide - 1.0))
        return parts["mean"], parts["max"] + narrow.mean((1, 2, 3))[:, None]


class Split(torch.nn.Module):
    def forward(self, y):
        return y * 2.0, y[:, :1] + 1.0


class Named(torch.nn.Module):
    def forward(self, y):
        return {"mean": y.mean((2, 3)), "max": y.amax((1, 2, 3))[:, None]}


_RESULTS: dict = {}


def _torch_vs_ort(module, shape, tmp_path, samples=None):
    """Map, run both backends on `samples` (default: 2 random ones); return
    (backend, model, {tensor: cosine}).

    Results are cached per module class so the slow export runs once per model.
    """
    key = (type(module).__name__, shape)
    if key in _RESULTS:
        return _RESULTS[key]
    module = module.eval()
    x = samples if samples is not None else (
        np.random.default_rng(0).standard_normal((2, *shape)).astype(np.float32))
    model = graph.export_torch(module, x[:1], tmp_path / "m.onnx")
    backend = TorchBackend(module, model)
    names = list(backend.mapping)
    expected = OnnxRuntimeBackend(model).run({"input": x}, names)
    got = backend.run({"input": x}, names)
    cosines = {}
    for name in names:
        error = compare.TensorError()
        error.update(expected[name], got[name])
        cosines[name] = error.cosine
    _RESULTS[key] = backend, model, cosines
    return _RESULTS[key]


@pytest.mark.parametrize("factory, shape, min_mapped", [
    (lambda: torchvision.models.resnet18(weights=None), (3, 32, 32), 35),
    (lambda: torchvision.models.mobilenet_v3_small(weights=None), (3, 32, 32), 100),
    (SSDLiteRaw, (3, 96, 96), 150),
])
def test_torch_matches_onnxruntime_on_every_mapped_tensor(factory, shape, min_mapped, tmp_path):
    torch.manual_seed(0)
    backend, model, cosines = _torch_vs_ort(factory(), shape, tmp_path)
    assert len(cosines) >= min_mapped
    assert_mapping_agrees_and_is_complete(backend, model, cosines)


def assert_mapping_agrees_and_is_complete(backend, model, cosines):
    # FP32 kernels differ only in summation order (and BN folding): cosine 1 - O(1e-7).
    worst = min(cosines, key=cosines.get)
    assert cosines[worst] > 0.9999, worst
    # Graph outputs are always mapped (the root module's flattened outputs, in order).
    assert all(o.name in backend.mapping for o in model.graph.output)
    # Nothing dropped silently: every float tensor is mapped, unmapped, or a graph input.
    floats = graph.float_tensors(model)
    inputs = {s.name for s in graph.input_specs(model)}
    listed = set(backend.mapping) | set(backend.unmapped) | inputs
    assert {t for t in graph.topological_tensors(model) if t in floats} <= listed


# Mapped tensors measured on torch 2.14 export: module outputs minus the BN-folded Convs.
ZOO_MIN_MAPPED = {"shapes-det": 80, "digits-cnn": 11, "digits-vit": 33}


@pytest.mark.parametrize("name", zoo_params())
def test_torch_matches_onnxruntime_on_zoo_models(name, tmp_path):
    """The zoo's trained modules on two of their calibration samples."""
    entry = zoo.get(name)
    module = entry.build()
    backend, model, cosines = _torch_vs_ort(module, entry.input_shape, tmp_path,
                                            entry.calibration_set()[:2])
    assert len(cosines) >= ZOO_MIN_MAPPED[name]
    assert_mapping_agrees_and_is_complete(backend, model, cosines)
    # The module calls without an ONNX tensor are only the Convs whose BatchNorm folded into
    # them (the BN module owns the fused output) and Dropout (identity in eval mode).
    modules = dict(module.named_modules())
    dropped = {type(modules[path.split("#")[0]]) for path in backend.unmapped_modules}
    assert dropped <= {torch.nn.Conv2d, torch.nn.Dropout}, backend.unmapped_modules


def test_resnet_unmapped_are_inline_ops_and_folded_convs(tmp_path):
    torch.manual_seed(0)
    backend, model, _ = _torch_vs_ort(torchvision.models.resnet18(weights=None), (3, 32, 32),
                                      tmp_path)
    producers = graph.producers(model)
    # Residual Adds are written inline in BasicBlock.forward, the flatten in ResNet.forward.
    assert {producers[t].op_type for t in backend.unmapped} <= {"Add", "Reshape", "Flatten"}
    assert sum(producers[t].op_type == "Add" for t in backend.unmapped) == 8
    # BatchNorm folds into the Conv (the node carries the BN scope): the Conv module has none.
    assert "conv1" in backend.unmapped_modules and "bn1" not in backend.unmapped_modules
    # layer1.0.relu runs twice; its second call is the block's output, mapped via layer1.0.
    assert backend.mapping[producers_output(model, "layer1.0.relu", 1)].module in (
        "layer1.0", "layer1.0.relu")


def producers_output(model, module_path: str, call: int) -> str:
    """Output tensor of the `call`-th node carrying scope `module_path` exactly."""
    nodes = [n for n in model.graph.node if graph.node_module_path(n) == module_path]
    return nodes[call].output[0]


def test_tuple_and_dict_outputs_and_shared_module(tmp_path):
    torch.manual_seed(0)
    backend, model, cosines = _torch_vs_ort(TwoHeads(), (3, 6, 6), tmp_path)
    modules = {(m.module, m.index) for m in backend.mapping.values()}
    # Both tuple elements and both dict values are mapped, each to the right tensor (cosine);
    # "mean" is also graph output 0, which the root module's call owns.
    assert {("split", 0), ("split", 1), ("named", 1), ("", 0), ("", 1)} <= modules
    assert min(cosines.values()) > 0.9999
    # The shared ReLU's two calls map to two different tensors.
    relu_calls = {m.call for m in backend.mapping.values() if m.module == "relu"}
    assert relu_calls == {0, 1}
    with pytest.raises(ModelError, match="no torch module output"):
        backend.run({"input": np.zeros((1, 3, 6, 6), np.float32)}, ["no_such_tensor"])


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                    reason="tensorrt is installed; the unavailability message does not apply")
def test_tensorrt_backend_reports_missing_package(tmp_path):
    message = r"not installed; install quantlab\[tensorrt\] on a machine with an NVIDIA GPU"
    with pytest.raises(BackendUnavailableError, match=message):
        TensorRTBackend(tmp_path / "model.onnx")


@pytest.mark.parametrize("opset", [11, 13])
def test_torchscript_export_maps_module_outputs_from_node_names(tiny_model, tmp_path, opset):
    # torch.onnx.export(dynamo=False), the most common export, writes no name-scope metadata:
    # the module path is in the node names (/conv1/Conv). It must map as much as dynamo's.
    model, _, module = tiny_model
    path = tmp_path / "legacy.onnx"
    with torch.no_grad():
        torch.onnx.export(module, torch.zeros(1, 3, 16, 16), path, dynamo=False,
                          opset_version=opset, input_names=["input"], output_names=["logits"])
    legacy = graph.load_model(path)
    assert not [p for n in legacy.graph.node for p in n.metadata_props]
    sample = {"input": np.zeros((1, 3, 16, 16), np.float32)}
    mapped = TorchBackend(module, legacy, sample=sample).mapping
    dynamo = TorchBackend(module, model, sample=sample).mapping
    assert len(mapped) >= len(dynamo) >= 3
    x = {"input": np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    ours = TorchBackend(module, legacy, sample=sample).run(x, list(mapped))
    onnx_values = OnnxRuntimeBackend(legacy).run(x, list(mapped))
    for name in mapped:
        # float32 kernels of torch vs ONNX Runtime: relative error well below 1e-4.
        reference = onnx_values[name].astype(np.float64)
        error = np.linalg.norm(ours[name] - reference) / max(np.linalg.norm(reference), 1e-12)
        assert error < 1e-4, (name, error)


def test_node_module_path_reads_torchscript_scopes_and_ignores_bad_metadata():
    from onnx import helper

    node = helper.make_node("Conv", ["x", "w"], ["y"], name="/layer1/layer1.0/conv1/Conv")
    assert graph.node_module_path(node) == "layer1.0.conv1"
    assert graph.node_module_path(helper.make_node("Relu", ["x"], ["y"], name="/Relu")) == ""
    assert graph.node_module_path(helper.make_node("Relu", ["x"], ["y"], name="relu_3")) is None
    bad = helper.make_node("Relu", ["x"], ["y"], name="n")
    bad.metadata_props.add(key=graph.NAME_SCOPES_KEY, value="__import__('os').system('id')")
    assert graph.node_module_path(bad) is None


def test_exposed_inputs_and_their_aliases_outlive_the_run():
    # ONNX Runtime returns an input exposed as an output (or an Identity of it) as a view of
    # the feed's memory; a feed sliced on a non-leading axis is a temporary contiguous copy,
    # freed after the run. The backend must hand back arrays that stay valid (this crashed
    # collection of recurrent state with a segfault, or read garbage).
    from onnx import TensorProto, helper

    model = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["state"], ["same"]),
         helper.make_node("Relu", ["state"], ["relu"])], "g",
        [helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "N", 64])],
        [helper.make_tensor_value_info("relu", TensorProto.FLOAT, [2, "N", 64])]),
        opset_imports=[helper.make_opsetid("", 17)])
    backend = OnnxRuntimeBackend(graph.normalize(model))
    state = np.random.default_rng(0).standard_normal((2, 40, 64)).astype(np.float32)
    sliced = state[:, 8:24]  # not contiguous: the backend feeds a temporary copy
    values = backend.run({"state": sliced}, ["state", "same", "relu"])
    clobber = [np.full(sliced.shape, 7.0, np.float32) for _ in range(64)]  # reuse freed memory
    np.testing.assert_array_equal(values["state"], sliced)
    np.testing.assert_array_equal(values["same"], sliced)
    np.testing.assert_array_equal(values["relu"], np.maximum(sliced, 0))
    assert len(clobber) == 64


@pytest.mark.parametrize("channels, weights_as_inputs", [(3, False), (8, True)])
def test_a_conv_output_exposed_beside_another_conv_into_one_add_is_returned(
        channels, weights_as_inputs):
    # Reliability case G08: ONNX Runtime's ConvAddActivationFusion fused the Add into the Conv
    # of the exposed output 'da' and dropped it, so the session did not load. The other
    # graph optimizations stay on: the sum must still be right.
    model, reference = shared_weight_convs(channels, weights_as_inputs)
    x = np.random.default_rng(1).standard_normal((4, channels, 8, 8)).astype(np.float32)
    values = OnnxRuntimeBackend(graph.normalize(model)).run({"x": x}, ["da", "y"])
    for name, want in reference(x).items():
        np.testing.assert_allclose(values[name], want, rtol=1e-5, atol=1e-5)


def test_folded_batchnorm_maps_to_the_batchnorm_module(tmp_path):
    # dynamo without its optimizer keeps Conv -> BatchNormalization; quantlab folds the BN at
    # import, so the Conv node computes the BN module's output, not the Conv module's.
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                 torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1)).eval()
    with torch.no_grad():
        module[1].running_mean.uniform_(-1, 1)
        module[1].running_var.uniform_(0.5, 2.0)
        module[1].weight.uniform_(0.5, 2.0)
    with torch.no_grad():
        program = torch.onnx.export(module, (torch.zeros(1, 3, 8, 8),), dynamo=True,
                                    optimize=False, input_names=["input"])
    model = graph.normalize(program.model_proto)
    assert "BatchNormalization" not in {n.op_type for n in model.graph.node}
    backend = TorchBackend(module, model, sample={"input": np.zeros((1, 3, 8, 8), np.float32)})
    fused = next(n for n in model.graph.node if n.op_type == "Conv").output[0]
    assert backend.mapping[fused].module == "1"
    assert "0" in backend.unmapped_modules  # the Conv's own output no longer exists
    x = {"input": np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    ours = backend.run(x, [fused])[fused]
    reference = OnnxRuntimeBackend(model).run(x, [fused])[fused]
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5 * np.abs(reference).max())


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_release_arena_gives_back_a_runs_memory_and_keeps_its_outputs():
    """A backend kept for a whole flow holds ONNX Runtime's arena high-water mark between
    runs unless it releases it: after a run whose intermediates are 3 x 64 MiB, the
    process holds at least 64 MiB more without the release and less than 32 MiB more
    with it, and both give the same outputs."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Exp", ["a"], ["b"]),
             helper.make_node("Neg", ["b"], ["c"]),
             helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0)]
    model = helper.make_model(helper.make_graph(
        nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])]),
        opset_imports=[helper.make_opsetid("", 11)])
    x = np.full((4096, 4096), -1.0, np.float32)  # 64 MiB
    grown, outputs = {}, {}
    for release in (False, True):
        backend = OnnxRuntimeBackend(model, release_arena=release, check_inputs=False)
        backend.run({"x": x[:1]})  # the session built, its arena touched
        before = _rss_mb()
        outputs[release] = backend.run({"x": x})["y"]
        grown[release] = _rss_mb() - before
        del backend
    assert grown[False] >= 64 and grown[True] < 32, grown
    assert outputs[True] == outputs[False] == pytest.approx(-np.exp(0.0) * x.size)
