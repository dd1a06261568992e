"""Calibrate a model: collect activation statistics on representative data, compute
per-tensor scales, and write the artifacts TensorRT and ONNX Runtime consume.

MODEL is an .onnx file or a zoo model name (`quantlab zoo` lists them).
DATA is one of:
  a folder of images        decoded, resized to the model input, then
                            x = (pixels * scale - mean) / std  (see the options below)
  a .npy file               already-preprocessed samples of a single-input model,
                            axis 0 = samples
  a .npz file               one array per model input, keyed by input name
  a COCO annotation .json   its images (next to it or in images/)

Writes into --out: model.onnx (normalized FP32), stats.npz (statistics, re-usable),
scales.json (tensor -> amax, scale, method), calibration.cache (TensorRT implicit
INT8, TensorRT <= 10), model.int8.onnx (Q/DQ, TensorRT explicit quantization;
also runs int8 kernels in ONNX Runtime) and calibration.json.

examples:
  quantlab calibrate digits-cnn --data calibration_data/digits/calibration.npy --out runs/cnn
  quantlab calibrate model.onnx --data images/ --resize 224 224 \\
      --mean 0.485 0.456 0.406 --std 0.229 0.224 0.225 --out runs/r50 --method percentile
"""

from __future__ import annotations

import argparse

HELP = "collect statistics, compute scales, write the Q/DQ model and TensorRT cache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab calibrate`."""
    from quantlab.cache import DEFAULT_TRT_VERSION
    from quantlab.calibrate import METHODS

    parser.add_argument("model", metavar="MODEL", help=".onnx file or zoo model name")
    parser.add_argument(
        "--data",
        required=True,
        metavar="DATA",
        help="image folder, .npy, .npz or COCO .json (see above)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument(
        "--method",
        default="entropy",
        choices=METHODS,
        help="entropy = TensorRT's EntropyCalibration2 (default)",
    )
    parser.add_argument(
        "--percentile",
        type=float,
        metavar="P",
        help="percentile of |x| kept by --method percentile (default 99.99)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        metavar="B",
        help="samples per batch (default: %(default)s)",
    )
    parser.add_argument(
        "--max-samples",
        type=int,
        metavar="N",
        help="use at most the first N samples (default: all)",
    )
    parser.add_argument(
        "--trt-version",
        default=DEFAULT_TRT_VERSION,
        metavar="X.Y.Z",
        help="TensorRT version written into calibration.cache; TensorRT ignores a cache made "
        "for another version (default: %(default)s)",
    )
    parser.add_argument("--force", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    images = parser.add_argument_group("image preprocessing (image folders and COCO files)")
    images.add_argument(
        "--resize",
        type=int,
        nargs=2,
        metavar=("H", "W"),
        help="resize to H x W (default: the model input's size)",
    )
    images.add_argument(
        "--scale",
        type=float,
        default=1 / 255,
        help="pixel multiplier before mean/std (default: 1/255)",
    )
    images.add_argument(
        "--mean",
        type=float,
        nargs="+",
        default=[0.0, 0.0, 0.0],
        help="per-channel mean, after scaling (default: 0 0 0)",
    )
    images.add_argument(
        "--std",
        type=float,
        nargs="+",
        default=[1.0, 1.0, 1.0],
        help="per-channel std (default: 1 1 1)",
    )
    images.add_argument(
        "--channel-order",
        default="RGB",
        choices=("RGB", "BGR", "L"),
        help="channel order fed to the model (default: RGB; L = grayscale)",
    )
    images.add_argument(
        "--layout",
        default="NCHW",
        choices=("NCHW", "NHWC"),
        help="tensor layout of the model input (default: NCHW)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the calibration and print a summary of what was written."""
    from quantlab.data import Preprocess
    from quantlab.pipeline import run_calibration

    preprocess = Preprocess(
        size=tuple(args.resize) if args.resize else None,
        scale=args.scale,
        mean=tuple(args.mean),
        std=tuple(args.std),
        channel_order=args.channel_order,
        layout=args.layout,
    )
    params = {"percentile": args.percentile} if args.percentile is not None else {}
    result = run_calibration(
        args.model,
        args.data,
        args.out,
        method=args.method,
        method_params=params,
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        preprocess=preprocess,
        force=args.force,
        trt_version=args.trt_version,
        progress=not args.no_progress,
    )
    print(
        f"calibrated {len(result.scales.amax)} tensors on {result.stats.num_samples} samples "
        f"({args.method}); wrote {result.folder}/: model.int8.onnx, scales.json, "
        "calibration.cache, stats.npz"
    )
    return 0
