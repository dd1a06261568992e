"""One ONNX graph that runs every precision plan: a plan is a feed of booleans, not a rebuild.

Every Q/DQ pair the all-INT8 placement puts on a unit's tensor becomes
``Where(int8_u, DQ(Q(x)), x)`` and every float input and output of the unit's
nodes ``Where(fp16_u, Cast32(Cast16(x)), x)``, with ``int8_u`` and ``fp16_u``
boolean scalar graph inputs per unit (weights likewise). With bias-correction
shifts, a linear op's output adds ``Where(int8_u and bias_correction, shift, 0)``,
``bias_correction`` one more boolean input. In fake-quant (float) arithmetic,
feeding a plan's flags computes what :func:`qdq.quantize_model` builds for that
plan (and :func:`quantlab.repairs.shift_biases` with the shifts); the FP16 path
rounds a unit's inputs and outputs to float16 but accumulates in float32. The
idea is section 12 of docs/peers.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quantlab import qdq
from quantlab.errors import ConfigError
from quantlab.graph import Graph
from quantlab.plan import Unit


@dataclass
class Switchboard:
    """The switchboard model and, per unit, the names of its int8 and fp16 flag inputs.

    ``bias_flag`` is the input that turns the bias-correction shifts on (None when
    built without); :meth:`feeds` sets it to ``bias_corrected``.
    """

    model: onnx.ModelProto
    flags: dict[str, tuple[str, str]]
    bias_flag: str | None = None
    bias_corrected: bool = True

    def feeds(self, precisions: Mapping[str, str]) -> dict[str, np.ndarray]:
        """Flag inputs for unit name -> precision; units left out run in INT8."""
        unknown = sorted(set(precisions) - set(self.flags))
        if unknown:
            raise ConfigError(f"units {unknown[:5]} are not in the switchboard; its units are "
                              f"e.g. {list(self.flags)[:5]}.")
        result = {}
        for unit, (int8, fp16) in self.flags.items():
            precision = precisions.get(unit, "int8")
            if precision not in qdq.PRECISIONS:
                raise ConfigError(f"unit '{unit}' has precision '{precision}'; use one of "
                                  f"{', '.join(qdq.PRECISIONS)}.")
            result[int8] = np.array(precision == "int8")
            result[fp16] = np.array(precision == "fp16")
        if self.bias_flag is not None:
            result[self.bias_flag] = np.array(self.bias_corrected)
        return result


def build(g: Graph, units: list[Unit], amax: Mapping[str, float],
          per_channel: bool = True,
          shifts: Mapping[str, np.ndarray] | None = None) -> Switchboard:
    """The switchboard of a normalized model for `units` (from plan.find_units) and `amax`.

    `shifts` (linear node -> output shift per channel, from
    :func:`quantlab.repairs.bias_shifts`) are added to those nodes' outputs while
    their unit runs INT8 and the bias-correction flag is on.
    """
    model = onnx.ModelProto()
    model.CopyFrom(g.model)
    graph = model.graph
    names = qdq.FreshNames(model)
    placement = qdq.place(g.model)
    unit_of = {node: unit for unit in units for node in unit.nodes}
    unit_of_tensor = {tensor: unit for unit in units for tensor in unit.tensors}
    flags = {}
    for unit in units:
        flags[unit.name] = (names(f"{unit.name}::int8"), names(f"{unit.name}::fp16"))
        graph.input.extend(helper.make_tensor_value_info(flag, onnx.TensorProto.BOOL, [])
                           for flag in flags[unit.name])
    zero_point = names("quantlab_zero_point_int8")
    graph.initializer.append(numpy_helper.from_array(np.array(0, np.int8), zero_point))
    shifts = {n: v for n, v in (shifts or {}).items() if n in unit_of}
    bias_flag = names("quantlab::bias_correction") if shifts else None
    if bias_flag:
        graph.input.append(helper.make_tensor_value_info(bias_flag, onnx.TensorProto.BOOL, []))
        no_shift = names("quantlab_no_shift")
        graph.initializer.append(numpy_helper.from_array(np.array(0, np.float32), no_shift))

    def where(flag: str, chosen: str, otherwise: str, base: str) -> tuple[onnx.NodeProto, str]:
        out = names(f"{base}_switched")
        return helper.make_node("Where", [flag, chosen, otherwise], [out],
                                name=names(f"{base}_Where")), out

    after: dict[str, list[onnx.NodeProto]] = {}  # tensor -> nodes computed right after it
    prelude: list[onnx.NodeProto] = []
    rewired: dict[tuple[str, int], str] = {}
    for tensor, edges in placement.readers.items():
        unit = unit_of_tensor.get(tensor)
        if unit is None:
            continue  # the pair between a linear op and its Relu changes no value
        scale = names(f"{tensor}_scale")
        graph.initializer.append(numpy_helper.from_array(
            np.array(qdq.activation_scale(placement.source[tensor], amax)), scale))
        quantized, dequantized = names(f"{tensor}_quantized"), names(f"{tensor}_dequantized")
        gate, gated = where(flags[unit.name][0], dequantized, tensor, tensor)
        after[tensor] = [
            helper.make_node("QuantizeLinear", [tensor, scale, zero_point], [quantized],
                             name=names(f"{tensor}_QuantizeLinear")),
            helper.make_node("DequantizeLinear", [quantized, scale, zero_point], [dequantized],
                             name=names(f"{tensor}_DequantizeLinear")),
            gate,
        ]
        rewired.update({edge: gated for edge in edges})

    weights = {init.name: numpy_helper.to_array(init) for init in g.model.graph.initializer}
    gated_weights: dict[tuple[str, int | None, str], str] = {}
    for edge, (weight, axis) in placement.weights.items():
        axis = axis if per_channel else None
        unit = unit_of[edge[0]]
        key = (weight, axis, unit.name)
        if key not in gated_weights:
            stored, dequantize = qdq.weight_dequantizer(weights[weight], weight, axis, names)
            graph.initializer.extend(stored)
            gate, gated_weights[key] = where(flags[unit.name][0], dequantize.output[0], weight,
                                             weight)
            prelude += [dequantize, gate]
        rewired[edge] = gated_weights[key]

    floats = g.floats | {n for n, w in weights.items() if w.dtype == np.float32}
    for node in graph.node:  # shifts broadcast on the output's channel axis (1, or last)
        if node.name in shifts:
            rank = weights[node.input[1]].ndim if node.op_type in ("Conv", "ConvTranspose") \
                else 1
            shifts[node.name] = np.asarray(shifts[node.name], np.float32).reshape(
                (-1, *[1] * (rank - 2)))
    rounded: dict[tuple[str, str], str] = {}  # (tensor, unit) -> tensor through the fp16 gate

    def fp16_gate(tensor: str, unit: Unit, nodes: list[onnx.NodeProto]) -> str:
        if (tensor, unit.name) not in rounded:
            half, back = names(f"{tensor}_fp16"), names(f"{tensor}_fp16_fp32")
            gate, gated = where(flags[unit.name][1], back, tensor, f"{tensor}_fp16")
            nodes += [
                helper.make_node("Cast", [tensor], [half], name=names(f"{tensor}_Cast_fp16"),
                                 to=onnx.TensorProto.FLOAT16),
                helper.make_node("Cast", [half], [back], name=names(f"{tensor}_Cast_fp32"),
                                 to=onnx.TensorProto.FLOAT),
                gate,
            ]
            rounded[(tensor, unit.name)] = gated
        return rounded[(tensor, unit.name)]

    def shift_output(node: onnx.NodeProto, unit: Unit) -> list[onnx.NodeProto]:
        """output[0] := output[0] + Where(int8_u and bias_correction, shift, 0)."""
        shifted = node.output[0]
        node.output[0] = names(f"{shifted}_unshifted")
        shift = names(f"{node.name}_bias_shift")
        graph.initializer.append(numpy_helper.from_array(shifts[node.name], shift))
        on, gated = names(f"{node.name}_shift_on"), names(f"{node.name}_shift_gated")
        return [
            helper.make_node("And", [flags[unit.name][0], bias_flag], [on],
                             name=names(f"{node.name}_shift_And")),
            helper.make_node("Where", [on, shift, no_shift], [gated],
                             name=names(f"{node.name}_shift_Where")),
            helper.make_node("Add", [node.output[0], gated], [shifted],
                             name=names(f"{node.name}_shift_Add")),
        ]

    floats |= set(rewired.values())
    nodes = list(prelude)
    for tensor in g.input_names:
        nodes += after.get(tensor, [])
    for node in graph.node:
        unit = unit_of.get(node.name)
        for index, name in enumerate(node.input):
            name = rewired.get((node.name, index), name)
            if unit is not None and name in floats:
                name = fp16_gate(name, unit, nodes)
            node.input[index] = name
        produced, outputs = list(node.output), []
        if unit is not None:
            for index, name in enumerate(node.output):
                if name in floats:
                    node.output[index] = names(f"{name}_unrounded")
                    outputs.append((node.output[index], name))
        nodes.append(node)
        if node.name in shifts:
            nodes += shift_output(node, unit)
        for unrounded, name in outputs:
            nodes.append(helper.make_node("Identity", [fp16_gate(unrounded, unit, nodes)],
                                          [name], name=names(f"{name}_rounded")))
        for name in produced:
            nodes += after.get(name, [])
    del graph.node[:]
    graph.node.extend(nodes)
    return Switchboard(model, flags, bias_flag)
