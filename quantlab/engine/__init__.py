"""Engine: what TensorRT (or ONNX Runtime standing in for it) builds and runs (docs/tensorrt.md).

Owns ``backends/`` (``Backend.run``: ONNX Runtime, torch, TensorRT through Polygraphy),
``fp16`` (FP16 units as TensorRT runs them), ``fusion`` (the layer TensorRT runs for a linear
op), ``trt_layers`` (an engine's layers mapped back to ONNX nodes), ``trt_ranges`` (implicit
INT8 ranges), ``trtexec`` (trtexec command lines), ``cache`` (calibration cache I/O) and
``build`` (a folder's engine, ``quantlab build``).

Imports the core, ``calibration.qdq`` (the Q/DQ model it runs) and ``experiments.experiment``
(atomic writes). Must not import ``evaluation``, ``commands/``, ``cli`` or ``api``: a backend
never knows what its outputs are compared with; only ``build`` reads a plan folder
(``planner.folder``).
"""
