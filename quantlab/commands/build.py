"""Build the TensorRT engine of a calibration folder, and write the trtexec commands that
reproduce it.

DIR is a folder written by `quantlab calibrate` (model.onnx, model.int8.onnx, and
calibration.cache if it was run with --trt-version). Always writes DIR/trtexec.txt:
the trtexec command lines for TensorRT 8.6 - 10.x (explicit: model.int8.onnx with
--int8), 10.x and 11.x (strongly typed, from model.int8.onnx) and, where the folder
has a cache, for TensorRT <= 10.x (implicit INT8 from model.onnx and the calibration
cache, with the plan's fp32/fp16 layers pinned by --layerPrecisions,
--layerOutputTypes and --precisionConstraints=obey; the plan is DIR/plan.json unless
--plan names one). Where TensorRT is installed (an NVIDIA GPU and quantlab[tensorrt])
it also builds DIR/model.plan -- from model.int8.onnx, strongly typed on TensorRT >=
10 and explicit before, or as --mode says -- and writes the engine's layer
information to DIR/layers.json, listing the plan's nodes whose engine layers run in
another precision. An implicit build reads a scratch copy of calibration.cache, so
TensorRT never rewrites the folder's cache.

examples:
  quantlab build runs/cnn
  quantlab build runs/det --plan runs/det/plan.json --max-batch 8 --mode implicit
"""

from __future__ import annotations

import argparse

from quantlab.commands.options import positive_int

HELP = "build the TensorRT engine of a calibration folder; write its trtexec commands"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab build`."""
    parser.add_argument("folder", metavar="DIR", help="a folder written by quantlab calibrate")
    parser.add_argument(
        "--mode", choices=("auto", "strongly_typed", "explicit", "implicit"), default="auto",
        help="strongly_typed: from model.int8.onnx (TensorRT >= 9; the only mode of 11); "
        "explicit: model.int8.onnx weakly typed with INT8 on (TensorRT 8.6 - 10); implicit: "
        "INT8 from model.onnx + calibration.cache (TensorRT <= 10); auto: strongly_typed on "
        "TensorRT >= 10, explicit before (default)")
    parser.add_argument("--plan", metavar="FILE",
                        help="plan.json (quantlab plan) or a JSON {node: precision}: its "
                        "fp32/fp16 nodes are pinned in implicit builds and checked in the engine "
                        "(default: DIR/plan.json if there is one)")
    parser.add_argument("--max-batch", type=positive_int, metavar="N",
                        help="largest batch of a dynamic sample axis (default: the batch a "
                             "`quantlab plan` folder was planned with, its trtexec.txt's; "
                             "else 1)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing model.plan or a trtexec.txt of other commands")


def run(args: argparse.Namespace) -> int:
    """Write trtexec.txt, then build the engine where TensorRT is installed
    (quantlab.engine.build.build_folder)."""
    from quantlab.engine.build import build_folder

    build_folder(args.folder, args.plan, args.max_batch, args.mode, args.force)
    return 0
