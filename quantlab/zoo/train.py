"""Train the zoo models on CPU, reproducibly, and export their calibration splits.

    python -m quantlab.zoo.train {shapes-det,digits-cnn,digits-vit,all} [--epochs N]

Every run is seeded (torch, NumPy generators, data order), prints progress and the
final held-out metric, writes ``quantlab/zoo/weights/<name>.pt`` and the files
under ``calibration_data/`` that the zoo reads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from quantlab import zoo
from quantlab.evaluation import tasks
from quantlab.zoo import digits, digits_nets, shapes, shapes_det, shapes_det_net

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
SEED = 0

Batch = tuple[torch.Tensor, tuple[torch.Tensor, ...]]


def fit(model: nn.Module, next_batch: Callable[[int], Batch],
        loss_fn: Callable[..., torch.Tensor], steps: int, lr: float, weight_decay: float,
        log_every: int, evaluate: Callable[[], str] | None = None) -> None:
    """AdamW with a linear warm-up then cosine decay to zero; the one loop every model uses.

    ``next_batch(step)`` returns ``(inputs, targets)``; the loss is
    ``loss_fn(model(inputs), *targets)``. ``evaluate`` (optional) returns a short
    metric string printed with the progress line.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup
        else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))),
    )
    start, running = time.time(), 0.0
    for step in range(steps):
        model.train()
        inputs, targets = next_batch(step)
        loss = loss_fn(model(inputs), *targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        running += loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            count = (step % log_every) + 1
            metric = ""
            if evaluate is not None:
                model.eval()
                with torch.no_grad():
                    metric = "  " + evaluate()
            print(f"step {step + 1:5d}/{steps}  loss {running / count:.4f}  "
                  f"lr {schedule.get_last_lr()[0]:.2e}  {time.time() - start:6.0f}s{metric}",
                  flush=True)
            running = 0.0


def predict(model: nn.Module, inputs: np.ndarray, batch_size: int = 64) -> tuple[np.ndarray, ...]:
    """Run ``model`` in eval mode over ``inputs`` in batches; outputs concatenated as NumPy."""
    model.eval()
    chunks = []
    with torch.no_grad():
        for i in range(0, len(inputs), batch_size):
            out = model(torch.from_numpy(inputs[i:i + batch_size]))
            chunks.append(out if isinstance(out, tuple) else (out,))
    return tuple(np.concatenate([c[k].numpy() for c in chunks]) for k in range(len(chunks[0])))


def held_out_metric(name: str, model: nn.Module, limit: int | None = None) -> str:
    """The zoo's held-out metric of ``model`` (mAP for detection, top-1 for classification)."""
    entry = zoo.get(name)
    data = entry.eval_set(limit)
    outputs = dict(zip(entry.output_names, predict(model, data.inputs), strict=True))
    result = entry.postprocess(outputs, data.image_ids)
    if entry.task == "detection":
        metrics = tasks.coco_map(data.coco, result)
        map_all, map_50 = metrics["map"], metrics["map50"]
        return f"mAP@[.5:.95] {map_all:.4f}  mAP@.5 {map_50:.4f}"
    return f"top-1 {float((result.argmax(1) == data.labels).mean()):.4f}"


def train_shapes_det(epochs: int) -> nn.Module:
    """TTFNet-style training on an infinite stream of generated images (epoch = 200 batches)."""
    # Small batches: at a fixed CPU budget, more updates converged faster than larger batches.
    batch_size, steps = 16, 200 * epochs
    model = shapes_det_net.ShapesDetector()
    grid = shapes.IMAGE_SIZE // shapes_det.STRIDE

    def next_batch(step: int) -> Batch:
        samples = [shapes.generate(shapes.TRAIN_SEED, step * batch_size + i)
                   for i in range(batch_size)]
        images = np.stack([image for image, _ in samples])
        heat, box_target, box_weight = shapes_det.targets([o for _, o in samples], grid, grid)
        return torch.from_numpy(shapes_det.preprocess(images)), (
            torch.from_numpy(heat), torch.from_numpy(box_target), torch.from_numpy(box_weight))

    def loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], heat: torch.Tensor,
                box_target: torch.Tensor, box_weight: torch.Tensor) -> torch.Tensor:
        scores, boxes = outputs
        # TTFNet weights: heatmap 1, GIoU 5.
        return shapes_det_net.focal_loss(scores, heat) + 5.0 * shapes_det_net.giou_loss(
            boxes, box_target, box_weight)

    fit(model, next_batch, loss_fn, steps, lr=2e-3, weight_decay=1e-4, log_every=400,
        evaluate=lambda: held_out_metric("shapes-det", model, limit=100))
    return model


def train_digits(name: str, epochs: int) -> nn.Module:
    """Cross-entropy training on the digits train split with random 1-pixel shifts."""
    x, y = digits.split("train")
    model = digits_nets.MODELS[name]()
    batch_size = 64
    per_epoch = math.ceil(len(x) / batch_size)
    rng = np.random.default_rng(SEED)

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while True:
            order = rng.permutation(len(x))
            for i in range(0, len(x), batch_size):
                yield x[order[i:i + batch_size]], y[order[i:i + batch_size]]

    stream = batches()

    def next_batch(step: int) -> Batch:
        inputs, labels = next(stream)
        inputs = digits.random_shift(inputs, rng)
        return torch.from_numpy(inputs), (torch.from_numpy(labels),)

    fit(model, next_batch, nn.functional.cross_entropy, per_epoch * epochs, lr=3e-3,
        weight_decay=5e-2 if name == "digits-vit" else 1e-4, log_every=per_epoch * 10,
        evaluate=lambda: held_out_metric(name, model))
    return model


def onnx_max_abs_diff(name: str, model: nn.Module) -> float:
    """Export ``model`` as the rest of quantlab does and compare onnxruntime with torch."""
    import onnxruntime

    entry = zoo.get(name)
    inputs = entry.calibration_set()[:4]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.onnx"
        with contextlib.redirect_stdout(io.StringIO()):
            torch.onnx.export(model.eval(), (torch.from_numpy(inputs[:1]),), path, dynamo=True,
                              opset_version=18, input_names=[entry.input_name],
                              output_names=list(entry.output_names),
                              dynamic_shapes=({0: "batch"},))
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        actual = session.run(list(entry.output_names), {entry.input_name: inputs})
    expected = predict(model, inputs)
    return max(float(np.abs(a - e).max()) for a, e in zip(actual, expected, strict=True))


def export_calibration_data(name: str) -> None:
    """Write the calibration split of ``name`` that the zoo reads (calibration_data/README.md)."""
    root = zoo.calibration_root(must_exist=False)
    if name == "shapes-det":
        images, coco = shapes.make_split(shapes.CALIBRATION_SEED, 512)
        shapes.write_coco_folder(root / "shapes-det", images, coco)
    else:
        x, y = digits.split("calibration")
        (root / "digits").mkdir(parents=True, exist_ok=True)
        np.save(root / "digits" / "calibration.npy", x)
        np.save(root / "digits" / "labels.npy", y)
    print(f"calibration data of {name} written to {root}")


DEFAULT_EPOCHS = {"shapes-det": 48, "digits-cnn": 60, "digits-vit": 150}


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=[*zoo.names(), "all"])
    parser.add_argument("--epochs", type=int, default=None,
                        help="override the default epochs (shapes-det: 200 batches per epoch)")
    # On a machine shared with other jobs use 1: with 2 threads every op waits for the
    # thread that was descheduled, which made steps several times slower.
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads (default: %(default)s, all cores)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    WEIGHTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in zoo.names() if args.model == "all" else [args.model]:
        torch.manual_seed(SEED)
        export_calibration_data(name)
        epochs = args.epochs or DEFAULT_EPOCHS[name]
        print(f"== {name}: {epochs} epochs")
        start = time.time()
        model = train_shapes_det(epochs) if name == "shapes-det" else train_digits(name, epochs)
        torch.save(model.state_dict(), WEIGHTS_DIR / f"{name}.pt")
        print(f"== {name}: trained in {time.time() - start:.0f}s; held-out "
              f"{held_out_metric(name, model)}; weights {WEIGHTS_DIR / f'{name}.pt'}; "
              f"ONNX vs torch max |diff| {onnx_max_abs_diff(name, model):.2e}")


if __name__ == "__main__":
    main()
