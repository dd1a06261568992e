"""Options shared by the commands that read data (calibrate, validate, plan).

One set of data, input and preprocessing options, so every command reads a
folder of images the same way; `calibrate` records them in its experiment
folder and `validate --from DIR` reads them back.
"""

from __future__ import annotations

import argparse
import json

DATA_HELP = """\
data:
  DATA is a folder of images (decoded, resized, x = (pixels * scale - mean) / std),
  a COCO annotation .json (its images), a .npy of preprocessed samples of a
  single-input model, or a .npz with one array per model input, keyed by input
  name. Arrays are in the model's layout and dtype: samples on each input's sample
  axis (axis 0, or e.g. axis 1 for recurrent state [layers, N, hidden]); integer
  and boolean inputs (token ids, masks) are passed unchanged. A 0-d array in the
  .npz, or --input NAME=VALUE, gives a value shared by every sample (a sample
  rate): it is frozen into the model, which also inlines the If branches it
  decides. A model whose batch dimension is fixed (batch 1) is run one batch of
  that size at a time.
"""


def add_data_arguments(parser: argparse.ArgumentParser, required: bool = True,
                       data_help: str = "image folder, COCO .json, .npy or .npz (see 'data' "
                                        "below)") -> None:
    """--data, --batch-size, --max-samples, the input options and image preprocessing."""
    parser.add_argument("--data", required=required, metavar="DATA", help=data_help)
    parser.add_argument("--batch-size", type=int, default=32, metavar="B",
                        help="samples per batch (default: %(default)s; a model with a fixed "
                             "batch dimension gets batches of that size)")
    parser.add_argument("--max-samples", type=int, metavar="N",
                        help="use at most the first N samples (default: all)")
    inputs = parser.add_argument_group("model inputs")
    inputs.add_argument("--input", dest="constants", action="append", default=[],
                        type=_constant, metavar="NAME=VALUE",
                        help="freeze input NAME to VALUE for every sample (a number or a "
                             "JSON list), e.g. --input sr=16000; repeatable")
    inputs.add_argument("--batch-axis", dest="batch_axes", action="append", default=[],
                        type=_batch_axis, metavar="NAME=AXIS",
                        help="the axis of input NAME that holds the samples (default: 0, or "
                             "the one dynamic axis of an input whose axis 0 is fixed while "
                             "the others' is dynamic); 'none' for an input without samples")
    images = parser.add_argument_group("image preprocessing (image folders and COCO files)")
    images.add_argument("--resize", type=int, nargs=2, metavar=("H", "W"),
                        help="input height and width (default: the model input's size)")
    images.add_argument("--resize-mode", default="squash",
                        choices=("squash", "letterbox", "center-crop"),
                        help="squash: stretch to H x W; letterbox: fit inside, keep the aspect "
                             "ratio, pad with --pad-value; center-crop: scale the short side to "
                             "--resize-short, crop the centre (default: %(default)s)")
    images.add_argument("--resize-short", type=int, metavar="S",
                        help="center-crop: short side before cropping (default: max(H, W); "
                             "ImageNet style: --resize 224 224 --resize-short 256)")
    images.add_argument("--pad-value", type=float, default=114.0, metavar="V",
                        help="letterbox padding, in pixel units 0..255 (default: %(default)s)")
    images.add_argument("--interpolation", default="bilinear",
                        choices=("nearest", "bilinear", "bicubic", "lanczos"),
                        help="resampling filter (default: %(default)s)")
    images.add_argument("--scale", type=float, default=1 / 255,
                        help="pixel multiplier before mean/std (default: 1/255)")
    images.add_argument("--mean", type=float, nargs="+",
                        help="per-channel mean, after scaling (default: 0 per channel)")
    images.add_argument("--std", type=float, nargs="+",
                        help="per-channel std (default: 1 per channel)")
    images.add_argument("--channel-order", default="RGB", choices=("RGB", "BGR", "L"),
                        help="channel order fed to the model (default: RGB; L = grayscale)")
    images.add_argument("--layout", default="NCHW", choices=("NCHW", "NHWC"),
                        help="tensor layout of the model input (default: NCHW)")


def preprocess_from_args(args: argparse.Namespace, recorded: dict | None = None):
    """The Preprocess the options give; options left at their defaults take `recorded` values.

    `recorded` is the ``preprocess`` entry of a calibration folder's
    ``calibration.json``, so `validate --from DIR` reads images as calibration did
    unless the user overrides an option explicitly.
    """
    from quantlab.data import Preprocess

    given = {
        "size": tuple(args.resize) if args.resize else None,
        "scale": args.scale,
        "mean": tuple(args.mean) if args.mean else None,
        "std": tuple(args.std) if args.std else None,
        "channel_order": args.channel_order,
        "layout": args.layout,
        "resize_mode": args.resize_mode,
        "resize_short": args.resize_short,
        "pad_value": args.pad_value,
        "interpolation": args.interpolation,
    }
    if recorded:
        defaults = Preprocess()
        base = Preprocess.from_dict(recorded)
        given = {key: value if value != getattr(defaults, key) else getattr(base, key)
                 for key, value in given.items()}
    return Preprocess(**given)


def input_options(args: argparse.Namespace) -> dict:
    """``constants`` and ``batch_axes`` for :func:`quantlab.pipeline.prepare_model`."""
    return {"constants": dict(args.constants), "batch_axes": dict(args.batch_axes)}


def _constant(text: str) -> tuple[str, object]:
    name, value = _split(text, "--input")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"--input {text}: the value '{value}' is not a number or a JSON list "
            "(e.g. --input sr=16000 or --input scale=[1.0,2.0])") from None
    if not isinstance(parsed, (int, float, list)) or isinstance(parsed, bool):
        raise argparse.ArgumentTypeError(
            f"--input {text}: give a number or a JSON list of numbers, not {value}.")
    return name, parsed


def _batch_axis(text: str) -> tuple[str, int | None]:
    name, value = _split(text, "--batch-axis")
    if value.lower() == "none":
        return name, None
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--batch-axis {text}: the axis '{value}' is not a whole number or 'none'.") from None


def _split(text: str, option: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{option} {text}: expected NAME=VALUE.")
    return name, value
