"""An output-aware search of a calibration folder's activation scales, and its held-out
effect: how much the per-tensor scales leave on the table (issue 41).

    python benchmarks/scale_search.py FOLDER CALIB.npy VAL.npy [--pages 8] [--metric M]

FOLDER is a ``quantlab calibrate`` output (``model.onnx``, ``model.int8.onnx``). In graph
order, each activation quantizer's scale is tried at FACTORS times its value with every
change kept so far; a factor is kept when it lowers the model's output noise on the first
``--pages`` CALIB samples by more than 1 % (float Q/DQ arithmetic, against model.onnx).
Then both models, as calibrated and searched, are scored on VAL as
``calibrate_phases.py`` scores them (ONNX Runtime's int8 kernels, output SQNR pooled over
VAL, the worst output; with ``--metric`` its score). Two whole-model evaluations per
quantizer: a search, not a default's cost.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, run or imported
from calibrate_phases import held_out  # noqa: E402
from noise_bound import (  # noqa: E402
    _activation_quantizers,
    _copied,
    _session,
    folder_models,
    folder_parser,
)

FACTORS = (0.96, 1.04)
GAIN = 0.99  # a factor is kept when the noise falls under this share of the current one


def with_scales(model: onnx.ModelProto, factors: dict[str, float]) -> onnx.ModelProto:
    """`model` with each scale initializer in `factors` multiplied by its factor."""
    scaled = _copied(model)
    for initializer in scaled.graph.initializer:
        if initializer.name in factors:
            value = numpy_helper.to_array(initializer) * factors[initializer.name]
            initializer.CopyFrom(numpy_helper.from_array(value.astype(np.float32),
                                                         initializer.name))
    return scaled


def main() -> None:
    parser = folder_parser(__doc__)
    parser.add_argument("--pages", type=int, default=8, help="calibration samples searched on")
    args = parser.parse_args()
    fp32, int8 = folder_models(parser, args.folder)
    quantized = onnx.load(int8)
    samples = np.load(args.calib, mmap_mode="r")[:args.pages]
    reference = _session(onnx.load(fp32))
    feed = reference.get_inputs()[0].name
    references = [[r.astype(np.float64) for r in reference.run(None, {feed: s[None]})]
                  for s in samples]
    energy = sum(float(np.sum(r ** 2)) for runs in references for r in runs)

    def noise(factors: dict[str, float]) -> float:
        session = _session(with_scales(quantized, factors))
        return sum(float(np.sum((o - r) ** 2)) for s, runs in zip(samples, references, strict=True)
                   for o, r in zip(session.run(None, {feed: s[None]}), runs, strict=True))

    quantizers = _activation_quantizers(quantized)
    start, kept = time.perf_counter(), {}
    current = before = noise(kept)
    for quantizer in quantizers:
        scale = quantizer.input[1]
        tried = {factor: noise({**kept, scale: factor}) for factor in FACTORS}
        factor = min(tried, key=tried.get)
        if tried[factor] < GAIN * current:
            kept[scale], current = factor, tried[factor]
            print(json.dumps({"tensor": quantizer.input[0], "factor": factor,
                              "calib_sqnr_db": round(10 * np.log10(energy / current), 2)}),
                  flush=True)
    print(json.dumps({"search_s": round(time.perf_counter() - start, 1),
                      "evaluations": 1 + len(FACTORS) * len(quantizers),
                      "calib_sqnr_db": [round(10 * np.log10(energy / n), 2)
                                        for n in (before, current)],
                      "changed": len(kept)}), flush=True)
    for label, model in (("as calibrated", quantized), ("searched", with_scales(quantized, kept))):
        print(json.dumps({"model": label, **held_out(str(fp32), model.SerializeToString(),
                                                     args.val, args.metric)}), flush=True)


if __name__ == "__main__":
    main()
