"""The repairs the planner and the commands choose from, by the name the command line spells
(:data:`quantlab.choices.REPAIRS`). A new repair: its module with a
:class:`~quantlab.calibration.repairs.base.Repair`, and one line here (its name in
``choices.REPAIRS`` too, which the parser reads without importing NumPy).

Bias correction is not here: it shifts the INT8 ops of a Q/DQ model, not the FP32 model,
and both calibrate and plan run it on their own (:mod:`quantlab.calibration.repairs.bias`)."""

from __future__ import annotations

from quantlab.calibration.repairs.base import Repair
from quantlab.calibration.repairs.cle import CrossLayerEqualization
from quantlab.calibration.repairs.equalize import ConvInputEqualization
from quantlab.calibration.repairs.smoothquant import SmoothQuant

REGISTRY: dict[str, Repair] = {repair.name: repair for repair in (
    ConvInputEqualization("dw-equalize", pointwise=False),
    ConvInputEqualization("pw-equalize", pointwise=True),
    CrossLayerEqualization(),
    SmoothQuant(),
)}
