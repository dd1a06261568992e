"""Evaluation: a candidate measured against FP32 (docs/metrics.md).

Owns ``compare`` (per-tensor metrics on ``{name: array}`` only), ``scoring`` (the one scorer:
metrics, paired bootstrap certificates), ``tasks`` (task metrics: top-k, COCO mAP),
``segments`` (a graph cut in topological order), ``sensitivity`` (local errors),
``validate`` (three-stage validation, ``quantlab validate``) and ``gate`` (the regression
gate, ``quantlab check``).

``compare``, ``tasks`` and ``scoring`` import nothing outside this package but ``errors``
and ``user_code``: they never know which backend produced their arrays. ``validate`` and
``gate`` run whole flows and import what they run. Must not import ``commands/``, ``cli`` or
``api``.
"""
