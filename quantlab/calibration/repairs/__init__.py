"""Repairs that change weights, not precisions: equalization, bias correction, SmoothQuant.

The repairs step of the planner (docs/planner.md): each repair rewrites a
model so that INT8 loses less, at no runtime cost (SmoothQuant's inserted Mul
excepted), and competes with pins in the planner. Every function works on
``onnx.ModelProto`` (the normalized FP32 model, or the Q/DQ model
:func:`quantlab.calibration.qdq.quantize_model` built from it) and plain data, and returns
the repaired copy with a :class:`RepairReport` saying what changed and what was
left alone and why. docs/repairs.md gives the formulas, their sources and the
measured effect on the zoo models.

One module per repair (:mod:`.cle`, :mod:`.bias`, :mod:`.smoothquant`,
:mod:`.equalize`), what they share in :mod:`.base` (the :class:`Repair` protocol, the
report, the keep rule :func:`lowers_noise`) and :mod:`.scaling` (per-channel weight
scaling, inserted Muls); :data:`REGISTRY` (:mod:`.registry`) maps the command line's
repair names to them.

Costs, in forward passes per calibration sample:

- :func:`cross_layer_equalization`: none (weights only).
- :func:`bias_correction`: one pass of the FP32 graph with the local graph attached, the
  errors summed in it (``mode="local"``),
  or one FP32 pass and `rounds` Q/DQ passes (``mode="global"``); :func:`bias_shifts`
  measures as the local mode does and :func:`shift_biases` applies its shifts to any
  plan's INT8 ops.
- :func:`smooth_quant`: one FP32 pass for the per-channel ranges (none when given).
- :func:`depthwise_equalization`: one FP32 pass for the per-channel ranges (none when given).

Passes stream: batches run in slices whose exposed tensors fit `run_bytes`, and
each run is folded into per-channel sums or maxima and dropped.
"""

from quantlab.calibration.repairs.base import (
    HOMOGENEOUS_OPS,
    SCALE_LIMIT,
    Repair,
    RepairReport,
    lowers_noise,
    quietest,
)
from quantlab.calibration.repairs.bias import (
    BIAS_CORRECTION_MODES,
    Settle,
    bias_correction,
    bias_shift_folds,
    bias_shifts,
    shift_biases,
)
from quantlab.calibration.repairs.cle import CrossLayerEqualization, cross_layer_equalization
from quantlab.calibration.repairs.equalize import (
    DEFAULT_MIN_GAIN_DB,
    DW_PERCENTILE,
    MIGRATION_ALPHAS,
    ConvInputEqualization,
    channel_percentiles,
    channel_ranges,
    depthwise_convs,
    depthwise_equalization,
    equalization_inputs,
    pointwise_convs,
)
from quantlab.calibration.repairs.registry import REGISTRY
from quantlab.calibration.repairs.smoothquant import (
    DEFAULT_MIN_SPREAD,
    SmoothQuant,
    channel_amax,
    smooth_quant,
)

__all__ = [
    "BIAS_CORRECTION_MODES", "DEFAULT_MIN_GAIN_DB", "DEFAULT_MIN_SPREAD", "DW_PERCENTILE",
    "HOMOGENEOUS_OPS", "MIGRATION_ALPHAS", "REGISTRY", "SCALE_LIMIT", "ConvInputEqualization",
    "CrossLayerEqualization", "Repair", "RepairReport", "Settle", "SmoothQuant", "bias_correction",
    "bias_shift_folds", "bias_shifts", "channel_amax", "channel_percentiles", "channel_ranges",
    "cross_layer_equalization", "depthwise_convs", "depthwise_equalization",
    "equalization_inputs", "lowers_noise", "pointwise_convs", "quietest", "shift_biases",
    "smooth_quant",
]
