"""Calibrate a model: collect activation statistics on representative data, compute
per-tensor scales, and write the artifacts TensorRT and ONNX Runtime consume.

MODEL is an .onnx file or a zoo model name (`quantlab zoo` lists them). Weights
stored as Constant nodes (Paddle exports), opsets below 17, a fixed batch of 1,
inputs with their samples on another axis, integer inputs and control flow
decided by a constant input are all handled at import.

Writes into --out: model.onnx (normalized FP32, with frozen inputs and sample axes
recorded), stats.npz (statistics, re-usable), scales.json (tensor -> amax, scale,
method), model.int8.onnx (Q/DQ: what TensorRT 10/11 builds from, strongly typed; also
runs int8 kernels in ONNX Runtime) and calibration.json (what was run, including the
preprocessing, which `quantlab validate --from DIR` reuses).

By default (the layers measured where TensorRT computes them: BatchNorm folded, the
activation fused) depthwise- and 1x1-conv inputs are equalized per channel (the 1x1 ones
only where their producer takes the division), activations take the
mse calibrator's amax, each weight channel max |w| or its MSE amax, whichever gives the
layer the least error (--weight-amax local), and each INT8 layer's mean error is
subtracted from its bias where that holds on data it was not measured on (each half
read until its shifts are settled, the other scored, both folds pooled);
calibration.json records every choice and each phase's time. These cost a few more
passes (PP-OCRv3 detector, 128 pages at 640x640: 1.3-1.55x ONNX Runtime's MinMax
calibration, benchmarks/README.md). `--method
percentile --weight-amax max --no-bias-correction --no-equalize` is the plain per-tensor
calibration.

With --trt-version X.Y.Z (TensorRT 8.x-10.x) also calibration.cache, for that
TensorRT's implicit INT8 (trtexec --int8 --calib=...). TensorRT reads a cache only
if it was written for its own version, and implicit INT8 needs a range for every
float tensor, so these are all collected: about twice the time of collecting the
Q/DQ model's inputs alone. The cache holds activation scales only: TensorRT's implicit
INT8 chooses its own weight scales and keeps the biases, so the weight amax and bias
corrections reach TensorRT through model.int8.onnx alone.

examples:
  quantlab calibrate digits-cnn --data calibration_data/digits/calibration.npy --out runs/cnn
  quantlab calibrate model.onnx --data images/ --resize 224 224 --resize-short 256 \\
      --resize-mode center-crop --mean 0.485 0.456 0.406 --std 0.229 0.224 0.225 --out runs/r50
  quantlab calibrate silero_vad.onnx --data chunks.npz --input sr=16000 --out runs/vad
"""

from __future__ import annotations

import argparse

from quantlab.commands.options import (
    DATA_HELP,
    add_data_arguments,
    add_memory_argument,
    percentile,
)

HELP = "collect statistics, compute scales, write the Q/DQ model (and a TensorRT cache)"
EPILOG = DATA_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab calibrate`."""
    from quantlab.choices import (
        CALIBRATE_METHODS,
        CALIBRATE_WEIGHT_CRITERIA,
        DEFAULT_EQUALIZATION,
        DEFAULT_METHOD,
        DEFAULT_WEIGHT_AMAX,
        DEFAULT_WEIGHT_ROUNDING,
        DEFAULTS_FROM,
        WEIGHT_ROUNDINGS,
    )

    parser.add_argument("model", metavar="MODEL", help=".onnx file or zoo model name")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        choices=CALIBRATE_METHODS,
        help=f"calibrator (default: %(default)s, from {DEFAULTS_FROM}; chosen by "
        "measurement: see docs/calibration.md; entropy = TensorRT's EntropyCalibration2; "
        "auto: each layer takes the amax of entropy, max, mse, percentile 99.99 or 99.999 that "
        "gives the "
        "layer TensorRT runs, activation included, the least error on up to 32 calibration "
        "samples, one local pass per candidate)",
    )
    parser.add_argument(
        "--percentile",
        type=percentile,
        metavar="P",
        help="percentile of |x| kept by --method percentile (default 99.99)",
    )
    parser.add_argument(
        "--trt-version",
        metavar="X.Y.Z",
        help="also write calibration.cache for this TensorRT's implicit INT8 (8.x-10.x; the "
        "version that will read it: TensorRT ignores a cache made for another). Collects "
        "every float tensor (about 2x longer). Not needed for TensorRT 10/11 explicit builds "
        "from model.int8.onnx",
    )
    add_memory_argument(parser, "collection")
    parser.add_argument("--weight-amax", choices=CALIBRATE_WEIGHT_CRITERIA,
                        default=DEFAULT_WEIGHT_AMAX,
                        help=f"per-channel weight amax (default: %(default)s, from "
                        f"{DEFAULTS_FROM}): local (per output channel, max "
                        "|w| or the mse amax, whichever gives the layer TensorRT runs the least "
                        "error on FP32 inputs; one pass, recorded per tensor in "
                        "calibration.json), max, or mse (least int8 error of the weights over "
                        "0.5-1 x max |w|)")
    parser.add_argument("--weight-rounding", choices=WEIGHT_ROUNDINGS,
                        default=DEFAULT_WEIGHT_ROUNDING,
                        help="how the int8 weights are rounded on their scales (default: "
                        f"%(default)s, from {DEFAULTS_FROM}): nearest (each weight to its "
                        "nearest step), or gptq (GPTQ: each layer's weights rounded one input "
                        "column at a time, the error spread over the columns not yet rounded, "
                        "for the least output error on the FP32 inputs of the first 8 "
                        "calibration samples; a conv's bias refitted; recorded per tensor in "
                        "calibration.json; about 5 s on a 640 px detector). Held out, gptq gained "
                        "0.6-1.8 dB on a PP-OCRv3 text detector and lost 0.3-0.5 dB on "
                        "two small models of the real-model suite: calibrate both and "
                        "`quantlab compare` them")
    parser.add_argument("--no-bias-correction", action="store_true",
                        help="keep the INT8 layers' biases (by default each INT8 layer's mean "
                        "output error on the calibration data is subtracted from its bias, "
                        "where, measured on each half of the data, it lowers the output "
                        "noise of samples of the other half, both halves pooled)")
    parser.add_argument("--no-equalize", action="store_true",
                        help="do not equalize conv inputs (by default each depthwise-conv "
                        "input whose channels differ in range gets per-channel scales folded "
                        "into its producer and the depthwise weights, and each 1x1-conv input "
                        "a share of them (SmoothQuant's trade, where its producer takes the "
                        "division), where the statistics predict >= 1 dB less noise; decided "
                        "on the statistics pass's first 64 samples, no pass of its own. "
                        f"This is `plan --repairs {DEFAULT_EQUALIZATION}`, from "
                        f"{DEFAULTS_FROM}; plan weighs dw-equalize alone by default, "
                        "choices.py says why)")
    parser.add_argument("--force", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_data_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the calibration and print a summary of what was written."""
    import sys

    from quantlab.api import CalibrateOptions, calibrate_model
    from quantlab.choices import PREPROCESS_OPTIONS
    from quantlab.commands.options import data_options, given_preprocessing

    options = CalibrateOptions(
        method=args.method,
        method_params={"percentile": args.percentile} if args.percentile is not None else {},
        weight_amax=args.weight_amax, weight_rounding=args.weight_rounding,
        bias_correction=not args.no_bias_correction,
        equalize=not args.no_equalize, trt_version=args.trt_version, memory=args.memory)
    result = calibrate_model(args.model, args.data, options, args.out,
                             data_options=data_options(args), force=args.force,
                             progress=not args.no_progress)
    unused = [PREPROCESS_OPTIONS[field] for field in given_preprocessing(args)]
    if unused and result.preprocess is None:
        print(f"note: {', '.join(unused)} had no effect: {args.data} holds arrays, which are "
              "fed as they are (the preprocessing options apply to image folders and COCO "
              "files); calibration.json records no preprocessing.", file=sys.stderr)
    cache = ", calibration.cache" if args.trt_version else ""
    chosen = result.layer_calibrators.get("chosen")
    if chosen:
        counts = {label: list(chosen.values()).count(label) for label in dict.fromkeys(
            chosen.values())}
        print(f"chose per layer: {', '.join(f'{label} {n}' for label, n in counts.items())}")
    corrected = result.repairs.get("bias_correction")
    if corrected and corrected["summary"].get("kept"):
        print(f"bias-corrected {len(corrected['applied'])} INT8 layers")
    elif corrected:
        print("bias correction left out: measured on each half of the calibration data, it "
              "did not lower the output noise of samples of the other half, both halves pooled "
              "(calibration.json, repairs)")
    equalized = result.repairs.get("depthwise_equalization")
    if equalized:
        print(f"equalized {len(equalized['applied'])} of "
              f"{len(equalized['applied']) + len(equalized['skipped'])} depthwise/1x1-conv inputs "
              "(calibration.json lists each, with the reason for those left alone)")
    print("phases: " + "; ".join(
        f"{p['phase']} {p['seconds']:.1f} s ({p['samples']} samples, {p['model_runs']} runs)"
        for p in result.phases))
    rounded = ("" if args.weight_rounding == "nearest"
               else f", weight rounding {args.weight_rounding}")
    print(
        f"calibrated {len(result.scales.amax)} tensors on {result.stats.num_samples} samples "
        f"({args.method}, weight amax {args.weight_amax}{rounded}); wrote {result.folder}/: "
        f"model.int8.onnx, scales.json{cache}, stats.npz"
    )
    return 0
