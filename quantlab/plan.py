"""Precision plans under an accuracy budget: the planner's public face.

The planning flow is :func:`quantlab.planner.flow.make_plan`; each of its steps lives
in a module of :mod:`quantlab.planner` (docs/planner.md): units and their scale
groups (``units``), rules with reason codes (``rules``), measurements (``measure``:
output noise, hardest samples, local INT8/FP16 error), trials and the noise model
(``trials``), the INT8-share front (``search``), evaluations and certification on
held-out data (``evaluate``, ``certify``), and the plan as plain data
(``decisions``). Their public names are importable from here.
"""

from quantlab.planner.certify import (  # noqa: F401 (public API)
    METRICS,
    Budget,
    Certificate,
    Outputs,
    argmax_agreement,
    certify,
    certify_paired,
    check_budget,
    data_shortfalls,
    floor_message,
    floor_record,
    metric_value,
    output_sqnr,
    resolve_metric,
    split_samples,
)
from quantlab.planner.decisions import (  # noqa: F401 (public API)
    PLAN_FORMAT,
    PLAN_VERSION,
    SEARCH_CODE,
    Plan,
    UnitDecision,
    pinned_tensors,
)
from quantlab.planner.evaluate import Checkpoint, Evaluation, fingerprint, plan_key  # noqa: F401
from quantlab.planner.flow import (  # noqa: F401 (public API)
    PlanResult,
    PlanSettings,
    check_metric_on_model,
    make_plan,
)
from quantlab.planner.measure import (  # noqa: F401 (public API)
    CalibratedModel,
    all_int8_nsr,
    choose_calibrators,
    fp16_contributions,
    hardest_samples,
    in_runs,
    local_sqnr,
    output_sample_axes,
    pooled_nsr,
    sample_energies,
    sample_nsr,
    samples_per_run,
    single_samples,
)
from quantlab.planner.rules import (  # noqa: F401 (public API)
    DECODE_INPUT_OPS,
    FP16_MAX,
    POINTWISE_OPS,
    RESHAPE_OPS,
    RULES,
    DepthwiseRule,
    Fp16RangeRule,
    HeadRule,
    KernelRule,
    RangeRule,
    Reason,
    Rule,
    RuleContext,
    allowed_precisions,
    apply_rules,
)
from quantlab.planner.search import (  # noqa: F401 (public API)
    FrontPoint,
    fallback_precision,
    front,
    solve,
)
from quantlab.planner.trials import (  # noqa: F401 (public API)
    DISAGREEMENT,
    FRONT_CHECKS,
    MAX_REFITS,
    OutputSensitivity,
    Trials,
    check_fit,
    group_test,
    localize,
)
from quantlab.planner.units import (  # noqa: F401 (public API)
    Unit,
    find_units,
    linear_macs,
    read_back,
    scale_groups,
    share_scales,
)
