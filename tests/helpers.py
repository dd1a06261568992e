"""Models shared by several test files: the zoo modules under test, SSDlite's raw outputs, and
small ONNX graphs built from nodes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torchvision
from onnx import TensorProto, helper, numpy_helper

from quantlab import zoo


class SSDLiteRaw(torch.nn.Module):
    """SSDlite320 backbone + head raw outputs (box regression, class logits), no NMS/decoding."""

    def __init__(self):
        super().__init__()
        ssd = torchvision.models.detection.ssdlite320_mobilenet_v3_large(
            weights=None, weights_backbone=None)
        self.backbone, self.head = ssd.backbone, ssd.head

    def forward(self, x):
        out = self.head(list(self.backbone(x).values()))
        return out["bbox_regression"], out["cls_logits"]


def zoo_params() -> list:
    """``zoo.names()`` for parametrize; shapes-det (3x128x128, 41 convs) is marked slow."""
    return [pytest.param(name, marks=pytest.mark.slow) if name == "shapes-det" else name
            for name in zoo.names()]


def onnx_model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    """An opset-17 model (not normalized) from nodes, (name, shape) float inputs, output names
    (shapes left to inference) and numpy initializers stored as float32."""
    g = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in initializers.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


class TinyBlock(torch.nn.Module):
    """A pre-norm transformer block (2 heads) written with -1 in its reshapes, as Hugging Face's
    ViT is, so the traced graph runs for any number of tokens."""

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        n, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(n, -1, 3, self.heads, dim // self.heads
                                                 ).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(q @ k.transpose(-1, -2) / (dim // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(n, -1, dim))
        return x + self.mlp(self.norm2(x))


class TinyViT(torch.nn.Module):
    """A ViT whose position embeddings are interpolated in the graph to the input's patch grid
    (as Hugging Face's ``interpolate_pos_encoding``): exported with the TorchScript exporter,
    shape scalars (Shape -> Gather -> Div -> Cast) size a Resize of a weight and a Reshape."""

    def __init__(self, dim: int = 16, patch: int = 4, grid: int = 2, depth: int = 2,
                 classes: int = 5):
        super().__init__()
        self.patch = patch
        self.embed = torch.nn.Conv2d(3, dim, patch, patch)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = torch.nn.Parameter(torch.randn(1, grid * grid + 1, dim) * 0.5)
        self.blocks = torch.nn.Sequential(*(TinyBlock(dim) for _ in range(depth)))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def positions(self, dim, height, width):
        side = int((self.pos.shape[1] - 1) ** 0.5)
        patches = self.pos[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
        patches = torch.nn.functional.interpolate(
            patches, size=(height // self.patch, width // self.patch), mode="bicubic",
            align_corners=False)
        return torch.cat((self.pos[:, :1], patches.permute(0, 2, 3, 1).reshape(1, -1, dim)), 1)

    def forward(self, x):
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat((self.cls.expand(tokens.shape[0], -1, -1), tokens), dim=1)
        tokens = tokens + self.positions(tokens.shape[-1], x.shape[2], x.shape[3])
        return self.head(self.norm(self.blocks(tokens)[:, 0]))


def export_tiny_vit(path, size: int = 12) -> onnx.ModelProto:
    """TinyViT (seed 0) exported by torch.onnx.export(dynamo=False) to `path` for inputs
    (N, 3, H, W), all three dynamic, from an example of `size` x `size` pixels."""
    import warnings

    torch.manual_seed(0)
    module = TinyViT().eval()
    with warnings.catch_warnings():  # the tracer's warnings about Python ints from shapes
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 3, size, size),), str(path), dynamo=False,
                          opset_version=17, input_names=["pixels"], output_names=["logits"],
                          dynamic_axes={"pixels": {0: "n", 2: "h", 3: "w"},
                                        "logits": {0: "n"}})
    return onnx.load(str(path))


def assert_every_column_explained(html: str) -> int:
    """Every table of a report shows a unit under each column name and a legend entry (name,
    unit, a non-empty explanation) for each column, in order; returns the number of tables."""
    import re

    tables = re.findall(r"<thead><tr>(.*?)</tr></thead>.*?</table>\s*</div>\s*"
                        r"(<dl class=\"legend columns\">.*?</dl>)?", html, re.S)
    assert tables
    for header, legend in tables:
        columns = re.findall(r"<th>(.*?)<br><span class=\"unit\">\[(.+?)\]</span></th>", header)
        assert len(columns) == header.count("<th>"), header
        entries = re.findall(r"<dt>(.*?) \[(.+?)\]</dt><dd>(.+?)</dd>", legend)
        assert [(name, unit) for name, unit, _ in entries] == columns, (columns, entries)
    return len(tables)


def decomposed_block() -> onnx.ModelProto:
    """TinyBlock (16 features, 5 tokens) exported at opset 12 by the TorchScript exporter, as
    older exports and Paddle's are: LayerNorm written out (ReduceMean, Sub, Pow, ReduceMean,
    Add, Sqrt, Div, Mul, Add) and GELU as its erf form (Div, Erf, Add, Mul, Mul); normalized."""
    import io

    from quantlab import graph

    torch.manual_seed(0)
    buffer = io.BytesIO()
    torch.onnx.export(TinyBlock(16).eval(), torch.randn(1, 5, 16), buffer, opset_version=12,
                      dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return graph.normalize(onnx.load_from_string(buffer.getvalue()))


def depthwise_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, pad: int) -> np.ndarray:
    """Reference depthwise NCHW convolution (stride 1, group = channels) in float64."""
    from numpy.lib.stride_tricks import sliding_window_view

    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    windows = sliding_window_view(x, w.shape[2:], axis=(2, 3))  # n c h w kh kw
    return np.einsum("nchwij,cij->nchw", windows, w[:, 0].astype(np.float64)) + \
        b.astype(np.float64)[None, :, None, None]


def shared_weight_convs(channels: int, weights_as_inputs: bool, seed: int = 0):
    """Reliability case G08's shape: two depthwise convs sharing one weight and bias, one reading
    a = relu(x), the other -0.1 * a (inputs of opposite sign and range), summed by an Add.
    `weights_as_inputs` also lists the initializers as graph inputs (IR 3 exporters do).
    Returns the model and its float64 reference: x -> {"da": first conv, "y": the sum}."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((channels, 1, 3, 3)).astype(np.float32)
    b = rng.standard_normal(channels).astype(np.float32)
    model = onnx_model(
        [helper.make_node("Relu", ["x"], ["a"], name="relu"),
         helper.make_node("Mul", ["a", "minus_tenth"], ["n"], name="scale"),
         helper.make_node("Conv", ["a", "w", "b"], ["da"], name="dwa", group=channels,
                          pads=[1] * 4),
         helper.make_node("Conv", ["n", "w", "b"], ["db"], name="dwb", group=channels,
                          pads=[1] * 4),
         helper.make_node("Add", ["da", "db"], ["y"], name="add")],
        [("x", [None, channels, 8, 8])], ["y"], {"w": w, "b": b, "minus_tenth": -0.1})
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, [None, channels, 8, 8]))  # a file passes onnx.checker
    if weights_as_inputs:
        model.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, i.dims)
                                 for i in model.graph.initializer)

    def reference(x: np.ndarray) -> dict[str, np.ndarray]:
        a = np.maximum(x.astype(np.float64), 0)
        first = depthwise_conv(a, w, b, 1)
        return {"da": first, "y": first + depthwise_conv(-0.1 * a, w, b, 1)}

    return model, reference


def zoo_held_out(name: str, calibration_samples: int):
    """A zoo model as calibrate's decisions see it: its normalized graph, its first
    `calibration_samples` calibration samples (batches of 16), their statistics, and the
    held-out score of a Q/DQ model: the worst output's SQNR (dB, float64) against FP32 on
    64 evaluation samples."""
    from quantlab import graph
    from quantlab.calibration import collect, pipeline, qdq
    from quantlab.data import open_data
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    entry = zoo.get(name)
    model = graph.Graph(pipeline.export_zoo_model(name))
    source = open_data(entry.calibration_set()[:calibration_samples],
                       graph.input_specs(model.model), 16)
    stats = collect.collect(model, source, qdq.activation_tensors_to_calibrate(model),
                            progress=False)
    held_out = {model.input_names[0]: entry.eval_set(64).inputs}
    fp32 = OnnxRuntimeBackend(model.model).run(held_out)

    def score(quantized: onnx.ModelProto) -> float:
        out = OnnxRuntimeBackend(quantized).run(held_out)
        return min(10 * np.log10(np.sum(fp32[k].astype(np.float64) ** 2) /
                                 np.sum((out[k].astype(np.float64) - fp32[k]) ** 2))
                   for k in fp32)

    return model, source, stats, score
