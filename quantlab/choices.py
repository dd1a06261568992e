"""Choices the command line offers, importable without NumPy, ONNX or torch.

Building the parser (``quantlab --help``, ``quantlab COMMAND --help``) must not
import the numeric stack (a second and over 100 MB); the modules that act on
these names import them from here. The zoo's names live in :mod:`quantlab.zoo_names`.
"""

# Calibrators of quantlab.calibrate.
METHODS = ("entropy", "max", "percentile", "mse")
# The defaults of every command, one per role, here alone (each --help names this module):
# the calibrator of activations (calibrate --method, plan's starting scales, validate --zoo),
# the weight amax (calibrate --weight-amax, validate --zoo). mse since issue 19 (with the
# weight amax by layer error and bias correction), by benchmarks/default_method.py's rule:
# behind the best on 1 of 7 models (silero-vad), auto on 2, percentile on 3; plan's default
# followed in issue 44 (the demo's shapes-det plan: 100% INT8, mAP 0.6652 vs FP32 0.6657,
# certified on 500 images, as with percentile).
DEFAULT_METHOD = "mse"
# The calibrate command's own method: per layer, the calibrator whose amax gives the layer
# the least error on the calibration data (quantlab.pipeline.calibrate_from_stats).
AUTO_METHOD = "auto"
CALIBRATE_METHODS = (*METHODS, AUTO_METHOD)
# Validation modes of quantlab.validate: stages end to end, or each INT8 layer fed FP32 inputs.
MODES = ("global", "local")
# How quantlab.qdq chooses a weight channel's amax: max |w|, or least int8 squared error.
WEIGHT_CRITERIA = ("max", "mse")
# calibrate's weight amax: also "local", per channel the one of the two that gives the layer
# TensorRT runs the least error on the calibration data (quantlab.weights).
CALIBRATE_WEIGHT_CRITERIA = ("local", *WEIGHT_CRITERIA)
DEFAULT_WEIGHT_AMAX = "local"
# Repairs of quantlab.repairs the planner weighs (bias correction, which changes the INT8 ops
# alone, is weighed on its own): equalization of depthwise-conv inputs, of those and 1x1-conv
# inputs, cross-layer equalization, SmoothQuant.
REPAIRS = ("dw-equalize", "pw-equalize", "cle", "smoothquant")
# The repairs `quantlab plan` weighs by default.
DEFAULT_PLAN_REPAIRS = ("dw-equalize",)
# Where --help says a default comes from.
DEFAULTS_FROM = "quantlab/choices.py: one default per role for every command"
# Image resampling of quantlab.data.Preprocess: Pillow's filters (which antialias when
# shrinking), area averaging, and OpenCV's cv2.resize INTER_LINEAR (no antialiasing), which
# packages that preprocess with OpenCV feed their models.
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "area", "opencv-linear")
# Preprocess field -> the option that sets it.
PREPROCESS_OPTIONS = {"size": "--resize", "scale": "--scale", "mean": "--mean", "std": "--std",
                      "channel_order": "--channel-order", "layout": "--layout",
                      "resize_mode": "--resize-mode", "resize_short": "--resize-short",
                      "pad_value": "--pad-value", "interpolation": "--interpolation"}
