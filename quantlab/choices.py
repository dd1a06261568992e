"""Choices the command line offers, importable without NumPy, ONNX or torch.

Building the parser (``quantlab --help``, ``quantlab COMMAND --help``) must not
import the numeric stack (a second and over 100 MB); the modules that act on
these names import them from here. The zoo's names live in :mod:`quantlab.zoo_names`.
"""

# Calibrators of quantlab.calibration.calibrate, by name (each a class in
# quantlab.calibration.calibrate.CALIBRATORS, which tests/calibration/test_calibrate.py checks
# against this tuple).
METHODS = ("entropy", "max", "percentile", "mse")
# The defaults of every command, one per role, here alone (each --help names this module):
# the calibrator of activations (calibrate --method, plan's starting scales, validate --zoo,
# quantlab.calibration.calibrate.calibrate),
# the weight amax (calibrate --weight-amax, validate --zoo). mse since issue 19 (with the
# weight amax by layer error and bias correction), by benchmarks/default_method.py's rule:
# behind the best on 1 of 7 models (silero-vad), auto on 2, percentile on 3; plan's default
# followed in issue 44 (the demo's shapes-det plan: 100% INT8, mAP 0.6652 vs FP32 0.6657,
# certified on 500 images, as with percentile).
DEFAULT_METHOD = "mse"
# The calibrators each planner unit chooses from (plan --calibrators): all of them.
DEFAULT_PLAN_CALIBRATORS = METHODS
# The calibrate command's own method: per layer, the calibrator whose amax gives the layer
# the least error on the calibration data (quantlab.calibration.pipeline.calibrate_from_stats).
AUTO_METHOD = "auto"
CALIBRATE_METHODS = (*METHODS, AUTO_METHOD)
# The amax each layer chooses from with method "auto" (label -> calibrator, parameters):
# the four calibrators and a percentile a decade further out, the best single calibrator
# on the equalized layout detector with plain weights (20.5 / 17.1 dB on its two page
# seeds, benchmarks/README.md).
AUTO_CANDIDATES = {
    "percentile": ("percentile", {}),
    "percentile 99.999": ("percentile", {"percentile": 99.999}),
    "entropy": ("entropy", {}),
    "max": ("max", {}),
    "mse": ("mse", {}),
}
AUTO_DEFAULT = "percentile"  # for tensors no layer chooses
# Validation modes of quantlab.evaluation.validate: stages end to end, or each INT8 layer fed FP32
# inputs.
MODES = ("global", "local")
# How quantlab.calibration.qdq chooses a weight channel's amax: max |w|, or least int8 squared
# error.
WEIGHT_CRITERIA = ("max", "mse")
# calibrate's weight amax: also "local", per channel the one of the two that gives the layer
# TensorRT runs the least error on the calibration data (quantlab.calibration.weights).
CALIBRATE_WEIGHT_CRITERIA = ("local", *WEIGHT_CRITERIA)
DEFAULT_WEIGHT_AMAX = "local"
# How calibrate rounds the int8 weights: to the nearest step, or by GPTQ on the layer's inputs
# with a conv's bias refitted (quantlab.calibration.rounding). Not the default: held out it
# gained 0.6-1.8 dB on the PP-OCRv3 detector's three page sets (map F1 +0.001-0.003), but
# lost 0.3-0.5 dB on the suite's ViT and onet, and YOLOv8n's map F1 fell below ModelOpt's
# (benchmarks/README.md, "weight rounding").
WEIGHT_ROUNDINGS = ("nearest", "gptq")
DEFAULT_WEIGHT_ROUNDING = "nearest"
# Repairs of quantlab.calibration.repairs, by name (each a Repair in
# quantlab.calibration.repairs.REGISTRY, which tests/calibration/test_repairs.py checks against this
# tuple): dw-equalize (per-channel equalization of depthwise-conv inputs), pw-equalize (that and
# 1x1-conv inputs, repairs.depthwise_equalization(pointwise=True)), cle (cross-layer equalization,
# data-free), smoothquant (activation outliers into weights).
# Bias correction changes the INT8 ops alone: on by default in calibrate and plan alike
# (--no-bias-correction), weighed on its own.
REPAIRS = ("dw-equalize", "pw-equalize", "cle", "smoothquant")
# The repairs, one default per role:
# - DEFAULT_EQUALIZATION is what calibrate applies unless --no-equalize (and sweep, which
#   quantizes calibrate's model), where the statistics predict >= 1 dB less noise:
#   pw-equalize since issue 19 (the layout detector's all-INT8 agreement mAP 89.87 -> 94.64
#   and 90.17 -> 97.64 on two page seeds, against dw-equalize).
# - DEFAULT_PLAN_REPAIRS are what plan weighs (--repairs), each repaired model's all-INT8 noise
#   against the model as given: dw-equalize alone. They differ because plan keeps a repair
#   for its all-INT8 noise, and pw-equalize's all-INT8 model, quieter on the layout detector
#   (agreement 96.40 / 95.83 against 89.50 / 91.82), led to smaller certified plans there
#   (0.0 % / 0.0 % of MACs in INT8 against 21.2 % / 5.9 % at a 2-point budget on 16 pages;
#   benchmarks/README.md, round 3 part 9). A calibration folder's model.onnx comes equalized
#   as calibrate did it; `plan --repairs pw-equalize` weighs it on a model.
DEFAULT_EQUALIZATION = "pw-equalize"
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
