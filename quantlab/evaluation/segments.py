"""Cut an ONNX graph into sequential segments, so one sample's tensors never all live at once.

A segment is a sub-graph cut in topological order: it computes one group of
wanted tensors, reads its inputs from the graph inputs or from earlier
segments (the *boundary* tensors), and exposes only its group and the boundary
tensors a later segment reads. Running the segments in order over one sample
computes every tensor exactly once — one forward pass — while only one
segment's exposed tensors and the live boundary tensors are in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import helper

from quantlab.errors import ModelError, QuantlabError
from quantlab.graph import Graph

# Metadata key marking a model as a segment of another (index / count).
SEGMENT_KEY = "quantlab.segment"
# Ops whose output is the shape (or size) of their input, whatever its values.
SHAPE_OPS = frozenset({"Shape", "Size"})
# Ops that draw random numbers: never run twice, since a second draw would differ.
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                        "RandomUniformLike", "Multinomial", "Bernoulli"})


@dataclass
class Segment:
    """One sub-graph: ``model`` reads `inputs` and writes `outputs` (its group, then boundaries).

    `last_use` is filled by :func:`plan_segments`: for each output, the index
    of the last segment that reads it (its own index when no later one does).
    """

    index: int
    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str]
    group: list[str]
    last_use: dict[str, int] = field(default_factory=dict)


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Every outer tensor a node reads: its inputs and the outer names its subgraphs use."""
    names = [i for i in node.input if i]
    for attribute in node.attribute:
        for body in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
            inner = {o for n in body.node for o in n.output} | {i.name for i in body.input} | {
                i.name for i in body.initializer}
            names.extend(i for n in body.node for i in node_inputs(n) if i not in inner)
    return list(dict.fromkeys(names))


def sample_free(index: Graph) -> set[str]:
    """Tensors without a sample axis: shapes, and what is computed from shapes and constants.

    A Shape or Size output is one whatever its input, and so is every output of a
    deterministic node without subgraphs that reads only such tensors, constants and
    graph inputs without a sample axis (``--batch-axis NAME=none``).
    """
    free = {spec.name for spec in index.inputs if spec.batch_axis is None} | index.constants
    for node in index.model.graph.node:
        deterministic = node.op_type not in RANDOM_OPS and not _has_subgraph(node)
        if node.op_type in SHAPE_OPS or deterministic and all(i in free for i in node.input if i):
            free.update(o for o in node.output if o)
    return free


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.HasField("g") or len(a.graphs) for a in node.attribute)


def assign_nodes(index: Graph, groups: Sequence[Sequence[str]]) -> list[int | None]:
    """Per node (graph order), the first group that needs it; None for nodes no group needs.

    A node belongs to the earliest group one of whose tensors depends on it, so
    every node's producers sit in the same or an earlier segment.
    """
    nodes = list(index.model.graph.node)
    wanted = {}
    for number, group in enumerate(groups):
        for name in group:
            wanted.setdefault(name, number)
    # Readers include nodes whose subgraphs (If/Loop bodies) use a tensor from outside.
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node_inputs(node):
            readers.setdefault(name, []).append(i)
    need: list[int | None] = [None] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        candidates = [wanted[o] for o in node.output if o in wanted]
        for output in node.output:
            candidates.extend(need[j] for j in readers.get(output, []) if need[j] is not None)
        need[i] = min(candidates) if candidates else None
    return need


def plan_segments(index: Graph, groups: Sequence[Sequence[str]],
                  extra: Iterable[str] = ()) -> list[Segment]:
    """Cut `index`'s model into one segment per group of wanted tensors (topological order).

    Segment k holds the nodes the tensors of ``groups[k]`` need that no earlier
    group needs. `extra` names tensors to expose where they are produced (for a
    caller that reads them outside the graph, e.g. the local-error model's
    feeds). Graph inputs a segment reads are among its inputs. Empty groups
    make segments without nodes, so segment k always serves group k.
    """
    nodes = list(index.model.graph.node)
    need = assign_nodes(index, groups)
    extra = set(extra)
    members: list[list[onnx.NodeProto]] = [[] for _ in groups]
    for node, number in zip(nodes, need, strict=True):
        if number is not None:
            members[number].append(node)
    # Each segment runs its own nodes and recomputes the sample-free values it reads.
    runs = _with_recomputed(nodes, need, len(groups), sample_free(index))
    reads = []
    for part in runs:
        own = {o for n in part for o in n.output}
        reads.append(list(dict.fromkeys(i for n in part for i in node_inputs(n)
                                        if i not in index.initializers and i not in own)))
    last_read: dict[str, int] = {}
    for number, names in enumerate(reads):
        for name in names:
            last_read[name] = number
    segments = []
    for number, part in enumerate(members):
        own = {o for n in runs[number] for o in n.output if o}
        group = [t for t in dict.fromkeys(groups[number]) if t in own or t in index.input_names]
        # Handed on: what later segments read of this one's own nodes (never a recomputed value).
        boundary = [o for n in part for o in n.output
                    if o and last_read.get(o, -1) > number or o in extra and o not in group]
        outputs = list(dict.fromkeys([*(t for t in group if t in own), *boundary]))
        model = _sub_model(index, runs[number], reads[number], outputs, f"segment_{number}")
        _set_segment_metadata(model, number, len(members))
        segment = Segment(number, model, reads[number], outputs, group)
        segment.last_use = {o: max(number, last_read.get(o, number)) for o in outputs}
        segments.append(segment)
    return segments


def boundary(index: Graph, position: int) -> list[str]:
    """What a run starting at node `position` of `index`'s model (its node list, in
    topological order) is fed: the graph inputs and the tensors of earlier nodes that a
    later node reads, or that are graph outputs (topological order)."""
    nodes = index.model.graph.node
    before = {o for n in nodes[:position] for o in n.output if o} | set(index.input_names)
    wanted = {i for n in nodes[position:] for i in node_inputs(n)} | set(index.outputs)
    return [name for name in dict.fromkeys([*index.input_names, *index.order])
            if name in before and name in wanted and name not in index.initializers]


def tail_model(index: Graph, fed: Sequence[str]) -> tuple[onnx.ModelProto, list[str]]:
    """The nodes of `index`'s model that compute its graph outputs from the tensors `fed`
    (:func:`boundary`): the sub-model, its tensors typed and shaped as `index` knows them,
    and the outputs it computes (the others are fed)."""
    model = index.model
    known = set(fed)
    computed = [o for o in index.outputs if o not in known]
    kept: set[int] = set()
    pending = list(computed)
    while pending:
        name = pending.pop()
        node = None if name in known or name in index.initializers else index.producers[name]
        if node is not None and id(node) not in kept:
            kept.add(id(node))
            pending.extend(node_inputs(node))
    nodes = [n for n in model.graph.node if id(n) in kept]
    reads = {i for n in nodes for i in node_inputs(n)}
    inputs = [name for name in fed if name in reads]
    free = sample_free(index)
    made = {o for n in nodes for o in n.output if o} - set(computed)
    graph = helper.make_graph(
        nodes, f"{model.graph.name}_tail", [_loose_input(index, i, exact=i in free)
                                             for i in inputs],
        [_typed_output(index, o) for o in computed],
        [init for init in model.graph.initializer if init.name in reads],
        value_info=[index.values[name] for name in index.order
                    if name in made and name in index.values])
    tail = helper.make_model(graph, opset_imports=model.opset_import)
    tail.ir_version = model.ir_version
    tail.functions.extend(model.functions)
    return tail, computed


def _with_recomputed(nodes: Sequence[onnx.NodeProto], need: Sequence[int | None], count: int,
                     free: set[str]) -> list[list[onnx.NodeProto]]:
    """Per segment, its nodes (`need`) plus the producers of the sample-free values they read,
    back to Shape/Size outputs, constants and graph inputs (graph order)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    runs: list[list[onnx.NodeProto]] = []
    for number in range(count):
        chosen = {i for i, k in enumerate(need) if k == number}
        pending = [name for i in chosen for name in node_inputs(nodes[i])]
        while pending:
            name = pending.pop()
            position = producer.get(name)
            if position is None or position in chosen or name not in free:
                continue
            if nodes[position].op_type in SHAPE_OPS:
                continue  # its input may be an activation: the shape itself is handed over
            chosen.add(position)
            pending.extend(node_inputs(nodes[position]))
        runs.append([nodes[i] for i in sorted(chosen)])
    return runs


def _set_segment_metadata(model: onnx.ModelProto, number: int, count: int) -> None:
    model.metadata_props.add(key=SEGMENT_KEY, value=f"{number}/{count}")


def _sub_model(index: Graph, nodes: Sequence[onnx.NodeProto], inputs: Sequence[str],
               outputs: Sequence[str], name: str) -> onnx.ModelProto:
    """A model of `nodes` reading `inputs` (any leading size on each axis) and writing `outputs`."""
    used = {i for n in nodes for i in node_inputs(n)}
    initializers = [init for init in index.model.graph.initializer if init.name in used]
    free = sample_free(index)
    graph = helper.make_graph(
        list(nodes), name, [_loose_input(index, i, exact=i in free) for i in inputs],
        [_typed_output(index, o) for o in outputs], initializers)
    model = helper.make_model(graph, opset_imports=index.model.opset_import)
    model.ir_version = index.model.ir_version
    model.functions.extend(index.model.functions)  # model-local functions the nodes may call
    return model


def _typed_output(index: Graph, name: str) -> onnx.ValueInfoProto:
    """An output of the tensor's element type; shapes are left to ONNX Runtime."""
    value = index.values.get(name)
    elem_type = value.type.tensor_type.elem_type if value is not None else 0
    return helper.make_tensor_value_info(name, elem_type or onnx.TensorProto.FLOAT, None)


def _loose_input(index: Graph, name: str, exact: bool = False) -> onnx.ValueInfoProto:
    """An input of the tensor's type and rank with every dimension symbolic (`exact`: only
    those not inferred, for a sample-free value such as a Shape output).

    Inferred shapes of intermediate tensors are sometimes more specific than what
    runs (a batch fixed by an earlier Reshape); any size is accepted so the
    segment runs whatever the full graph would compute. A shape vector keeps its
    length: ONNX Runtime's shape inference reads a Resize's `sizes` sliced from it.
    """
    value = index.values.get(name)
    elem_type = value.type.tensor_type.elem_type if value is not None else onnx.TensorProto.FLOAT
    shape = index.shapes.get(name)
    dims = None if shape is None else [
        d if exact and d is not None else f"{name}_d{i}" for i, d in enumerate(shape)]
    return helper.make_tensor_value_info(name, elem_type or onnx.TensorProto.FLOAT, dims)


def group_by_bytes(names: Sequence[str], sizes: Mapping[str, int], budget: int) -> list[list[str]]:
    """Split `names` (kept in order) into consecutive groups whose `sizes` sum to <= `budget`.

    A single tensor larger than the budget gets a group of its own.
    """
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        size = sizes.get(name, 0)
        if groups[-1] and used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def run_failure(error: QuantlabError, whole: Callable[[], object] | None, stage: str,
                segment: int, count: int, samples: str, hint: str) -> QuantlabError:
    """What to raise when `segment` of the `count` segments of `stage` (words: "'onnx_fp32'",
    "the model") failed on `samples`.

    `whole` runs the uncut model on the same samples: when it fails too, its own error
    is the answer (it names the model's real inputs, and blames the data only if they
    do not fit them); when it runs, the cut is at fault and the error says so, with
    `hint` (how to cut less). Without `whole`, the cut is taken to be at fault.
    """
    if whole is not None:
        try:
            whole()
        except QuantlabError as own:
            return own
        uncut = f"{stage} runs uncut on {samples}, but"
    else:
        uncut = f"On {samples},"
    return ModelError(
        f"{uncut} segment {segment + 1} of the {count} it was cut into to fit the memory "
        f"budget failed: {str(error).rstrip('.')}. This is a quantlab bug; please report it "
        f"with the model. {hint}")
