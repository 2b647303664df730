"""Region-level verification: each fused node against the subgraph it replaced.

A whole-model comparison runs the original and the optimized model in onnxruntime, which
needs the weights of a whole model in memory (verification's sessions map them once, with
no packed copy: verify.PREPACK). A model larger than memory can still be checked region by region: every fused node
carries the subgraph it replaced as its fallback function, so a model holding just that node
(its weights included, by reference) runs once with the onnxfuse library, where the node runs
our kernel, and once without, where onnxruntime runs the fallback body: the original ops. Both
get the same seeded random inputs of the region's shapes, and every output is compared with
the tolerance of its type (compare.compare_output). Only one region's weights are mapped at a
time.

Rewrites that make no fused node (concatenated GEMM weights, a folded BatchNormalization) are
checked the same way against the original: optimized nodes no original node matches are
grouped by the tensors they pass each other, and each group runs against the original nodes
that compute the same outputs from the same inputs (`rewrites`). A group whose counterpart
cannot be cut out of the original (it reads values the group does not, or spans more than
MAX_ORIGINAL_NODES nodes) is reported as not checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import onnx
from onnx import helper

from .compare import OutputCheck, compare_output
from .environment import ort_error_text
from .fused import DOMAIN
from .inputs import UnfeedableInputError, input_shape, random_inputs
from .modelio import InputError


@dataclass
class RegionCheck:
    """One fused node against its fallback body."""

    node: str
    op_type: str
    kind: str = "fused"  # "fused": a fused node against its fallback; "rewrite": other rewritten nodes
    outputs: list[OutputCheck] = field(default_factory=list)
    error: str | None = None  # the fused kernel failed where the fallback body ran
    skipped: str | None = None  # why the region could not be run on its own (not a failure)

    @property
    def ok(self) -> bool:
        return self.error is None and all(o.ok for o in self.outputs)

    def as_dict(self) -> dict:
        return {"node": self.node, "op_type": self.op_type, "kind": self.kind, "ok": self.ok, "error": self.error,
                "skipped": self.skipped, "outputs": [o.as_dict() for o in self.outputs]}


def _value_types(*models: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Tensor types (with shapes where known) by name, from the models' value_info and interfaces;
    earlier models win."""
    types: dict[str, onnx.TypeProto] = {}
    for model in models:
        g = model.graph
        for v in list(g.input) + list(g.output) + list(g.value_info):
            if v.type.HasField("tensor_type") and v.name not in types:
                types[v.name] = v.type
    return types


def _value_infos(names, types, dims: Mapping[str, int] | None = None) -> list[onnx.ValueInfoProto] | str:
    """The ValueInfos of a region's inputs (with `dims`: static shapes at those dims) or of its
    outputs (dims None: the element type alone), or why one cannot be made."""
    infos = []
    for name in names:
        if not name:
            continue
        t = types.get(name)
        elem = t.tensor_type.elem_type if t is not None else 0
        if dims is None:
            if elem == 0:
                return f"output '{name}' has no known type"
            infos.append(helper.make_tensor_value_info(name, elem, None))
            continue
        if elem == 0 or not t.tensor_type.HasField("shape"):
            return f"input '{name}' has no known type and shape"
        shape = input_shape(helper.make_value_info(name, t), dims)
        infos.append(helper.make_tensor_value_info(name, elem, list(shape)))
    return infos


def region_model(optimized: onnx.ModelProto, node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto],
                 dims: Mapping[str, int]) -> onnx.ModelProto | str:
    """A model of `node` alone: its computed inputs are graph inputs of static shapes, its
    constant inputs (initializers, Constant nodes) come along, its fallback function too.
    A string says why no such model can be made."""
    function = next((f for f in optimized.functions
                     if (f.domain, f.name, f.overload) == (node.domain, node.op_type, node.overload)), None)
    if function is None:
        return "no fallback function"
    initializers = {t.name: t for t in optimized.graph.initializer}
    constant_nodes = {o: n for n in optimized.graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
                      for o in n.output}
    computed, inits, nodes = [], [], []
    for name in dict.fromkeys(node.input):
        if name in initializers:
            inits.append(initializers[name])
        elif name in constant_nodes:
            nodes.append(constant_nodes[name])
        else:
            computed.append(name)
    inputs, outputs = _value_infos(computed, types, dims), _value_infos(node.output, types)
    for problem in (inputs, outputs):
        if isinstance(problem, str):
            return problem
    graph = helper.make_graph(nodes + [node], f"region_{node.name}", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=list(optimized.opset_import), functions=[function])
    model.ir_version = optimized.ir_version
    return model


# A rewritten region whose original counterpart takes more nodes than this to reach the
# region's inputs is not checked on its own (it would be most of the model).
MAX_ORIGINAL_NODES = 200


def _node_key(node: onnx.NodeProto) -> tuple:
    return (node.domain or "", node.op_type, tuple(node.input), tuple(node.output), node.overload,
            tuple(sorted(a.SerializeToString() for a in node.attribute)))


def _tensor_key(t: onnx.TensorProto) -> tuple:
    from .weights import region_of

    region = region_of(t)
    return (t.data_type, tuple(t.dims), region if region is not None else t.SerializeToString())


@dataclass
class Rewrite:
    """Optimized nodes that no original node matches (fused nodes aside), connected by the
    tensors they pass each other, with the original nodes that compute the same outputs from
    the same inputs."""

    nodes: list[onnx.NodeProto]
    original_nodes: list[onnx.NodeProto] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # computed tensors both read
    outputs: list[str] = field(default_factory=list)  # tensors the rest of the model reads
    problem: str | None = None  # why the original counterpart could not be found


def rewrites(original: onnx.ModelProto, optimized: onnx.ModelProto) -> list[Rewrite]:
    """The rewrites in `optimized` other than fused nodes, each with its original counterpart."""
    original_keys = {_node_key(n) for n in original.graph.node}
    original_inits = {t.name: t for t in original.graph.initializer}
    opt_inits = {t.name: t for t in optimized.graph.initializer}
    # An initializer whose name stayed but whose value changed makes its readers rewritten.
    changed_inits = {name for name, t in opt_inits.items()
                     if name in original_inits and _tensor_key(original_inits[name]) != _tensor_key(t)}
    changed = [n for n in optimized.graph.node
               if n.domain != DOMAIN and (_node_key(n) not in original_keys or set(n.input) & changed_inits)]
    if not changed:
        return []
    # A fused node that reads what a rewrite made and the original never had (the Split of
    # batched gate/up MatMuls taken into the gated activation's Pointwise) joins the rewrite:
    # the two together compute tensors the original has.
    original_producer = {o: n for n in original.graph.node for o in n.output if o}
    original_inputs = {v.name for v in original.graph.input}
    new_tensors = {o for n in changed for o in n.output if o and o not in original_producer and o not in original_inputs}
    changed += [n for n in optimized.graph.node if n.domain == DOMAIN and set(n.input) & new_tensors]
    # Connected components over the tensors changed nodes write and read.
    parent = list(range(len(changed)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    writer = {o: i for i, n in enumerate(changed) for o in n.output if o}
    for i, n in enumerate(changed):
        for name in n.input:
            if name in writer:
                parent[find(i)] = find(writer[name])
    groups: dict[int, list[onnx.NodeProto]] = {}
    for i, n in enumerate(changed):
        groups.setdefault(find(i), []).append(n)

    readers: dict[str, int] = {}
    for n in optimized.graph.node:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    graph_outputs = {o.name for o in optimized.graph.output}
    found = []
    for nodes in groups.values():
        made = {o for n in nodes for o in n.output if o}
        read_inside: dict[str, int] = {}
        for n in nodes:
            for name in n.input:
                read_inside[name] = read_inside.get(name, 0) + 1
        rewrite = Rewrite(nodes)
        rewrite.inputs = list(dict.fromkeys(
            name for n in nodes for name in n.input if name and name not in made and name not in opt_inits))
        rewrite.outputs = [o for o in dict.fromkeys(o for n in nodes for o in n.output if o)
                           if o in graph_outputs or readers.get(o, 0) > read_inside.get(o, 0)]
        found.append(rewrite)
        missing = [o for o in rewrite.outputs if o not in original_producer and o not in original_inputs]
        if missing:
            rewrite.problem = f"the original has no tensor '{missing[0]}'"
            continue
        leaves = set(rewrite.inputs)
        taken: dict[int, onnx.NodeProto] = {}
        stack = [o for o in rewrite.outputs if o not in leaves]
        seen: set[str] = set()
        while stack and rewrite.problem is None:
            name = stack.pop()
            if name in seen or name in leaves or name in original_inits or not name:
                continue
            seen.add(name)
            node = original_producer.get(name)
            if node is None:
                rewrite.problem = f"the original computes it from '{name}', which the rewrite does not read"
            elif len(taken) >= MAX_ORIGINAL_NODES:
                rewrite.problem = f"its original counterpart is over {MAX_ORIGINAL_NODES} nodes"
            elif id(node) not in taken:
                taken[id(node)] = node
                stack.extend(node.input)
        order = {id(n): i for i, n in enumerate(original.graph.node)}
        rewrite.original_nodes = sorted(taken.values(), key=lambda n: order[id(n)])
    return found


def _rewrite_models(original, optimized, rewrite: Rewrite, types, dims):
    """(the original's nodes as a model, the rewrite's nodes as a model), or why not."""
    inputs, outputs = _value_infos(rewrite.inputs, types, dims), _value_infos(rewrite.outputs, types)
    for problem in (inputs, outputs):
        if isinstance(problem, str):
            return problem
    made = []
    for source, nodes in ((original, rewrite.original_nodes), (optimized, rewrite.nodes)):
        inits = {t.name: t for t in source.graph.initializer}
        used = [inits[name] for name in dict.fromkeys(i for n in nodes for i in n.input) if name in inits]
        graph = helper.make_graph(nodes, "rewrite", inputs, outputs, used)
        model = helper.make_model(graph, opset_imports=list(source.opset_import), functions=list(source.functions))
        model.ir_version = source.ir_version
        made.append(model)
    return tuple(made)


def _run(path: str, feeds, provider: str, threads: int | None, with_library: bool | None = None):
    """(outputs, None) of one run of the model file at `path`, or (None, onnxruntime's message)
    where onnxruntime rejects the model or the inputs; our own errors propagate."""
    from .runtime import LibraryError, open_session

    try:
        # Weights read as the model holds them, not packed first: as verify.PREPACK says.
        sess, _ = open_session(path, provider=provider, threads=threads, with_library=with_library, prepack=False)
        return sess.run(None, feeds), None
    except (InputError, LibraryError):
        raise
    except Exception as e:  # onnxruntime's exception types
        return None, ort_error_text(e)


def _compare(outputs, expected, actual) -> list[OutputCheck]:
    """compare_output for each of a region model's `outputs` (ValueInfos)."""
    return [compare_output(o.name, o.type.tensor_type.elem_type, np.asarray(e), np.asarray(a))
            for o, e, a in zip(outputs, expected, actual)]


def check_regions(original: onnx.ModelProto, optimized: onnx.ModelProto, dims: dict[str, int], seed: int,
                  provider: str, threads: int | None) -> list[RegionCheck]:
    """Check every fused node of `optimized` against its fallback body, and every other rewrite
    against the original subgraph it replaced (see the module text): one RegionCheck for each.
    verify.verify(..., mode="regions") runs it."""
    from .ortfiles import RuntimeFiles, remove_runtime_directory, runtime_directory
    from .runtime import needs_library

    types = _value_types(optimized, original)
    checks: list[RegionCheck] = []
    directory = runtime_directory()
    files = RuntimeFiles(directory)
    try:
        for index, node in enumerate(optimized.graph.node):
            if node.domain != DOMAIN:
                continue
            check = RegionCheck(node.name or f"#{index}", node.op_type)
            checks.append(check)
            model = region_model(optimized, node, types, dims)
            if isinstance(model, str):
                check.skipped = model
                continue
            try:
                feeds = random_inputs(model, dims, seed + index)
            except UnfeedableInputError as e:
                check.skipped = str(e)
                continue
            path = files.write(model, f"region{index}.onnx")
            expected, problem = _run(path, feeds, provider, threads, with_library=False)
            if problem:  # the original ops reject these inputs
                check.skipped = f"the replaced subgraph does not run on random inputs: {problem}"
                continue
            if not needs_library(model, provider):
                check.skipped = "no kernel of the onnxfuse library for this node on this provider"
                continue
            actual, problem = _run(path, feeds, provider, threads, with_library=True)
            if problem:
                check.error = f"the fused node does not run: {problem}"
                continue
            check.outputs += _compare(model.graph.output, expected, actual)
        for index, rewrite in enumerate(rewrites(original, optimized)):
            ops = sorted({n.op_type for n in rewrite.nodes})
            label = rewrite.nodes[0].name or (rewrite.outputs[0] if rewrite.outputs else f"rewrite {index}")
            check = RegionCheck(label, "+".join(ops), kind="rewrite")
            checks.append(check)
            if rewrite.problem:
                check.skipped = rewrite.problem
                continue
            made = _rewrite_models(original, optimized, rewrite, types, dims)
            if isinstance(made, str):
                check.skipped = made
                continue
            reference, rewritten = made
            try:
                feeds = random_inputs(reference, dims, seed + 7919 + index)
            except UnfeedableInputError as e:
                check.skipped = str(e)
                continue
            paths = [files.write(m, f"rewrite{index}_{which}.onnx") for which, m in (("a", reference), ("b", rewritten))]
            expected, problem = _run(paths[0], feeds, provider, threads)
            if problem:  # the original ops reject these inputs
                check.skipped = f"the original subgraph does not run on random inputs: {problem}"
                continue
            actual, problem = _run(paths[1], feeds, provider, threads)
            if problem:
                check.error = f"the rewritten subgraph does not run: {problem}"
                continue
            check.outputs += _compare(rewritten.graph.output, expected, actual)
    finally:
        files.close()
        remove_runtime_directory(directory)
    return checks
