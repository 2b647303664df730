"""Region-level verification: each fused node against the subgraph it replaced.

A whole-model comparison runs the original and the optimized model in onnxruntime, which
needs the weights of a whole model in memory (several times over while onnxruntime prepacks
them). A model larger than memory can still be checked region by region: every fused node
carries the subgraph it replaced as its fallback function, so a model holding just that node
(its weights included, by reference) runs once with the onnxfuse library, where the node runs
our kernel, and once without, where onnxruntime runs the fallback body: the original ops. Both
get the same seeded random inputs of the region's shapes, and every output is compared with
the tolerance of its type (verify.compare_output). Only one region's weights are mapped at a
time.

What this mode does not check: rewrites that make no fused node (a folded BatchNormalization,
concatenated GEMM weights); the whole-model mode checks those too.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import onnx
from onnx import helper

from .fused import DOMAIN
from .modelio import InputError, ort_error_text
from .verify import OutputCheck, UnfeedableInputError, Verification, compare_output, input_shape, random_inputs


@dataclass
class RegionCheck:
    """One fused node against its fallback body."""

    node: str
    op_type: str
    outputs: list[OutputCheck] = field(default_factory=list)
    error: str | None = None  # the fused kernel failed where the fallback body ran
    skipped: str | None = None  # why the region could not be run on its own (not a failure)

    @property
    def ok(self) -> bool:
        return self.error is None and all(o.ok for o in self.outputs)

    def as_dict(self) -> dict:
        return {"node": self.node, "op_type": self.op_type, "ok": self.ok, "error": self.error,
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


def _has_shape(t: onnx.TypeProto) -> bool:
    return t.tensor_type.HasField("shape") and t.tensor_type.elem_type != 0


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
    inputs, inits, nodes = [], [], []
    seen: set[str] = set()
    for name in node.input:
        if not name or name in seen:
            continue
        seen.add(name)
        if name in initializers:
            inits.append(initializers[name])
        elif name in constant_nodes:
            nodes.append(constant_nodes[name])
        else:
            t = types.get(name)
            if t is None or not _has_shape(t):
                return f"input '{name}' has no known type and shape"
            shape = input_shape(helper.make_value_info(name, t), dims)
            inputs.append(helper.make_tensor_value_info(name, t.tensor_type.elem_type, list(shape)))
    outputs = []
    for name in node.output:
        if not name:
            continue
        t = types.get(name)
        if t is None or t.tensor_type.elem_type == 0:
            return f"output '{name}' has no known type"
        outputs.append(helper.make_tensor_value_info(name, t.tensor_type.elem_type, None))
    graph = helper.make_graph(nodes + [node], f"region_{node.name}", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=list(optimized.opset_import), functions=[function])
    model.ir_version = optimized.ir_version
    return model


def verify_regions(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    provider: str = "cpu",
    threads: int | None = None,
) -> Verification:
    """Check every fused node of `optimized` against its fallback body (see the module text);
    the result's `regions` hold one RegionCheck per fused node."""
    from .runtime import open_session
    from .runtime import LibraryError, needs_library
    from .weights import RuntimeFiles, runtime_directory

    dims = dict(dims or {})
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
            names = [o.name for o in model.graph.output]
            elem_types = [o.type.tensor_type.elem_type for o in model.graph.output]
            try:
                sess, _ = open_session(path, provider=provider, threads=threads, with_library=False)
                expected = sess.run(None, feeds)
                del sess
            except InputError:
                raise
            except Exception as e:  # onnxruntime's exception types: the original ops reject these inputs
                check.skipped = f"the replaced subgraph does not run on random inputs: {ort_error_text(e)}"
                continue
            if not needs_library(model, provider):
                check.skipped = "no kernel of the onnxfuse library for this node on this provider"
                continue
            try:
                sess, _ = open_session(path, provider=provider, threads=threads, with_library=True)
                actual = sess.run(None, feeds)
                del sess
            except (InputError, LibraryError):
                raise
            except Exception as e:  # onnxruntime's exception types
                check.error = f"the fused node does not run: {ort_error_text(e)}"
                continue
            for name, elem, e, a in zip(names, elem_types, expected, actual):
                check.outputs.append(compare_output(name, elem, np.asarray(e), np.asarray(a)))
    finally:
        files.close()
        shutil.rmtree(directory, ignore_errors=True)
    return Verification(seed=seed, dims=dims, provider=provider, mode="regions", regions=checks)
