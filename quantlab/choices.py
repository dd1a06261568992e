"""Choices the command line offers, importable without NumPy, ONNX or torch.

Building the parser (``quantlab --help``, ``quantlab COMMAND --help``) must not
import the numeric stack (a second and over 100 MB); the modules that act on
these names import them from here. The zoo's names live in :mod:`quantlab.zoo_names`.
"""

# Calibrators of quantlab.calibrate.
METHODS = ("entropy", "max", "percentile", "mse")
# The method `quantlab calibrate` uses unless told otherwise: chosen by measurement on
# the real-model suite and the zoo (benchmarks/default_method.py, docs/calibration.md).
DEFAULT_METHOD = "percentile"
# Validation modes of quantlab.validate: stages end to end, or each INT8 layer fed FP32 inputs.
MODES = ("global", "local")
# How quantlab.qdq chooses a weight channel's amax: max |w|, or least int8 squared error.
WEIGHT_CRITERIA = ("max", "mse")
