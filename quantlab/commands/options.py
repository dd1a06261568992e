"""Options shared by the commands that read data (calibrate, validate, plan).

One set of data, input and preprocessing options, so every command reads a
folder of images the same way; `calibrate` records them in its experiment
folder and `validate --from DIR` reads them back.
"""

from __future__ import annotations

import argparse
import json
import math

from quantlab.choices import INTERPOLATIONS, PREPROCESS_OPTIONS

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
    parser.add_argument("--batch-size", type=positive_int, default=32, metavar="B",
                        help="samples per batch (default: %(default)s; a model with a fixed "
                             "batch dimension gets batches of that size)")
    parser.add_argument("--max-samples", type=positive_int, metavar="N",
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
    images.add_argument("--resize", type=positive_int, nargs=2, metavar=("H", "W"),
                        help="input height and width (default: the model input's size)")
    # The preprocessing options default to None: an option left out takes the value a
    # calibration folder recorded (or Preprocess's default), one given always wins, even
    # when it equals the default (see quantlab.data.preprocessing).
    images.add_argument("--resize-mode",
                        choices=("squash", "letterbox", "pad", "height-pad", "center-crop"),
                        help="squash: stretch to H x W; letterbox: fit inside, keep the aspect "
                             "ratio, pad with --pad-value, centred; pad: the same anchored "
                             "top-left, padded at the bottom and right (Ultralytics' "
                             "LetterBox(center=False)); "
                             "height-pad: scale to height H keeping the aspect ratio (width at "
                             "most W), pad on the right to W (text recognizers, PaddleOCR); "
                             "center-crop: scale the short side to --resize-short, crop the "
                             "centre (default: squash)")
    images.add_argument("--resize-short", type=positive_int, metavar="S",
                        help="center-crop: short side before cropping (default: max(H, W); "
                             "ImageNet style: --resize 224 224 --resize-short 256)")
    images.add_argument("--pad-value", type=pixel_value, metavar="V",
                        help="padding of letterbox, pad and height-pad, in pixel units 0..255 "
                             "before --scale/--mean/--std, fractions kept (default: 114; 127.5 "
                             "with --mean 0.5 --std 0.5 pads with 0 as PaddleOCR does)")
    images.add_argument("--interpolation", choices=INTERPOLATIONS,
                        help="resampling filter: Pillow's (which antialias when shrinking), "
                             "area (the mean of the source pixels each output pixel covers, "
                             "OpenCV's INTER_AREA when shrinking) or opencv-linear (cv2.resize "
                             "INTER_LINEAR, no antialiasing: what packages preprocessing with "
                             "OpenCV or cv2.dnn.blobFromImage feed) (default: bilinear)")
    images.add_argument("--scale", type=finite_float,
                        help="pixel multiplier before mean/std (default: 1/255)")
    images.add_argument("--mean", type=finite_float, nargs="+",
                        help="per-channel mean, after scaling (default: 0 per channel)")
    images.add_argument("--std", type=finite_float, nargs="+",
                        help="per-channel std (default: 1 per channel)")
    images.add_argument("--channel-order", choices=("RGB", "BGR", "L"),
                        help="channel order fed to the model (default: RGB; L = grayscale)")
    images.add_argument("--layout", choices=("NCHW", "NHWC"),
                        help="tensor layout of the model input (default: NCHW)")


# The zoo's task metrics (with its ground truth): top-1 for classifiers, COCO mAP@[.5:.95]
# for detectors.
TASK_METRICS = ("top1", "map")


def add_metric_argument(parser: argparse.ArgumentParser, default: str | None,
                        ground_truth: str, role: str = "") -> None:
    """--metric NAME|module:function, as plan, sweep and validate take it; `ground_truth` says
    how a zoo model's task metric gets its labels, `role` what the metric is for."""
    shown = f"default: {default}" if default else "default: none"
    parser.add_argument(
        "--metric", default=default, metavar="NAME",
        help=f"{role}sqnr (output SQNR, dB), agreement (share of samples whose argmax agrees "
             f"with FP32's), top1 or map (a zoo model's task metric, {ground_truth}) or your "
             "own from the current directory or PYTHONPATH. Best, module:NAME of a two-part "
             "metric (an object, or a class made with no arguments): NAME.record(outputs, "
             "references) turns one sample's {output name: array} (samples on axis 0) and "
             "FP32's into a small record (decoded boxes, match counts), called once per "
             "sample; NAME.score(records) -> float (higher is better) scores any list of "
             "them, so the bootstrap never decodes again. Or module:function, "
             "function(outputs, references) -> float with two lists of {output name: array}, "
             "one entry per sample, called on all samples and on every bootstrap resample. "
             "An output holding samples on another axis (a state [layers, N, hidden]) comes "
             f"with that axis moved first; docs/metrics.md ({shown})")


def check_metric(metric: str, ground_truth: bool, how: str, model: str | None = None) -> None:
    """ConfigError unless `metric` is known and fits: a task metric needs `ground_truth` (else
    the error says `how` to get it) and, when `model` is named, a zoo model of its task.
    Checked before any data is read."""
    from quantlab.errors import ConfigError
    from quantlab.evaluation.scoring import resolve_metric
    from quantlab.evaluation.tasks import PRIMARY_METRIC
    from quantlab.zoo_names import ZOO_NAMES

    if metric not in TASK_METRICS:
        resolve_metric(metric)  # an unknown metric, or a module that does not load, fails now
        return
    if not ground_truth:
        raise ConfigError(f"--metric {metric} needs ground truth: {how}.")
    if model is None:
        return
    if model not in ZOO_NAMES:
        raise ConfigError(f"--metric {metric} is a zoo model's task metric; {model} is not a "
                          "zoo model. Use sqnr, agreement or module:function.")
    from quantlab import zoo

    task = zoo.get(model).task
    if metric != PRIMARY_METRIC[task]:
        raise ConfigError(f"--metric {metric} does not fit {model}, a {task} model: its task "
                          f"metric is {PRIMARY_METRIC[task]}.")


def given_preprocessing(args: argparse.Namespace) -> dict:
    """The Preprocess fields the options set explicitly (every option left out is None)."""
    values = {field: getattr(args, option[2:].replace("-", "_"))
              for field, option in PREPROCESS_OPTIONS.items()}
    return {field: tuple(value) if isinstance(value, list) else value
            for field, value in values.items() if value is not None}


def data_options(args: argparse.Namespace):
    """The quantlab.data.DataOptions the data options give."""
    from quantlab.data import DataOptions

    return DataOptions(args.batch_size, args.max_samples, given_preprocessing(args),
                       **input_options(args))


def input_options(args: argparse.Namespace) -> dict:
    """``constants`` and ``batch_axes`` for :func:`quantlab.calibration.pipeline.prepare_model`;
    ConfigError when one name is given twice (the last would win without a word)."""
    from quantlab.errors import ConfigError

    for option, pairs in (("--input", args.constants), ("--batch-axis", args.batch_axes)):
        names = [name for name, _ in pairs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ConfigError(f"{option} {twice[0]} is given more than once; give each input "
                              "one value.")
    return {"constants": dict(args.constants), "batch_axes": dict(args.batch_axes)}


class Number:
    """The argparse type of every number option: a whole or real number, finite, within
    [`low`, `high`] (an end in `open_ends` excluded). Every command's int and float options
    use it, so nan, inf and values out of range are refused while parsing, before any work
    (tests/test_reliability_r4.py checks that no number option escapes it)."""

    def __init__(self, kind: type, low: float | None = None, high: float | None = None,
                 open_ends: str = ""):
        self.kind, self.low, self.high, self.open_ends = kind, low, high, open_ends
        self.__name__ = kind.__name__  # argparse names the type in its messages

    def __call__(self, text: str) -> float:
        try:
            value = self.kind(text)
        except ValueError:
            what = "a whole number" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"'{text}' is not {what}.") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}.")
        if self.low is not None and (value < self.low or value == self.low
                                     and "low" in self.open_ends):
            bound = "above" if "low" in self.open_ends else "at least"
            raise argparse.ArgumentTypeError(f"must be {bound} {self.low:g}, got {text}.")
        if self.high is not None and (value > self.high or value == self.high
                                      and "high" in self.open_ends):
            bound = "below" if "high" in self.open_ends else "at most"
            raise argparse.ArgumentTypeError(f"must be {bound} {self.high:g}, got {text}.")
        return value


positive_int = Number(int, 1)
finite_float = Number(float)
nonnegative_float = Number(float, 0)
# A percentile of |x| kept: (0, 100] (calibrate.check_method's range).
percentile = Number(float, 0, 100, open_ends="low")
# A share strictly between 0 and 1 (sweep --tolerance).
open_share = Number(float, 0, 1, open_ends="low high")
# A pixel value before --scale/--mean/--std.
pixel_value = Number(float, 0, 255)


def add_memory_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """--memory SIZE: the memory budget of `what` (None: the 2G default)."""
    parser.add_argument("--memory", type=memory_size, metavar="SIZE",
                        help=f"memory budget of {what}, e.g. 2G or 512M (default 2G; a model "
                             "whose tensors of one sample do not fit runs in segments, cut "
                             "in topological order)")


def memory_size(text: str) -> int:
    """argparse type: a memory budget in bytes from ``2G``, ``512M`` (collect.parse_memory)."""
    from quantlab.calibration.collect import parse_memory
    from quantlab.errors import ConfigError

    try:
        return parse_memory(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _constant(text: str) -> tuple[str, object]:
    import numpy as np

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
    try:
        array = np.asarray(parsed)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--input {text}: the list is ragged (its rows differ in length); give a "
            "rectangular JSON list.") from None
    if array.dtype.kind not in "iuf":
        raise argparse.ArgumentTypeError(
            f"--input {text}: give a number or a JSON list of numbers, not {value}.")
    if not np.isfinite(array).all():
        raise argparse.ArgumentTypeError(f"--input {text}: give finite numbers (JSON reads "
                                         "NaN, Infinity and 1e999 as non-finite).")
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
