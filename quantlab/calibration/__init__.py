"""Calibration: statistics -> scales -> the Q/DQ model (docs/calibration.md, docs/qdq.md).

Owns the path from data to a calibrated model: ``collect`` (streaming statistics),
``calibrate`` (statistics -> amax: the calibrators), ``weights`` (weight amax by layer
error), ``folding`` (BatchNorm folded as TensorRT does), ``qdq`` (Q/DQ insertion), ``repairs/``
(weight changes that lower INT8 noise: equalization, CLE, SmoothQuant, bias correction) and
``pipeline`` (the calibration flow that ``quantlab calibrate`` runs).

Imports the core (``errors``, ``graph``, ``data``, ``metadata``, ``choices``), ``engine``
(ONNX Runtime runs the model; the cache and ranges a folder holds), ``evaluation``'s
``segments`` and ``sensitivity`` (local errors) and ``experiments``' folder writers and
records. Must not import ``commands/``, ``cli`` or ``api``: they call it. Only ``pipeline``'s
per-layer choice (method ``auto``) reaches the planner, inside a function.
"""
