"""The pass pipeline: ModelProto in, optimized ModelProto out.

    normalize (initializers listed as inputs, shape inference)
      -> onnx-graphsurgeon graph -> passes in order (each: match -> condition -> rewrite)
      -> export -> fused-node overloads and fallback functions -> IR version onnxruntime accepts
"""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from . import ops, runtime
from .fused import DOMAIN, FusedRegistry, attach_functions, make_fused_node
from .graph.core import cleanup, constants_as_initializers, export_model, toposort
from .modelfields import keep_model_fields
from .target import NAMES as TARGETS
from .target import Target, as_target
from .weights import attach_graph, release_graph



@dataclass
class PassRound:
    """One run of a pass: its rewrites and the graph's node count around it."""

    round: int
    matches: int
    nodes_before: int
    nodes_after: int
    seconds: float

    def as_dict(self) -> dict:
        return {"round": self.round, "matches": self.matches, "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "seconds": round(self.seconds, 4)}


@dataclass
class PassStats:
    """A pass over all rounds of the pipeline. Other passes run between its rounds, so its
    totals add up its own runs only (nodes_removed: the sum of what each of its runs removed);
    the node counts around each run are in `rounds`."""

    name: str
    rounds: list[PassRound] = field(default_factory=list)

    def record(self, round_: int, matches: int, nodes_before: int, nodes_after: int, seconds: float) -> None:
        self.rounds.append(PassRound(round_ + 1, matches, nodes_before, nodes_after, seconds))

    @property
    def matches(self) -> int:
        return sum(r.matches for r in self.rounds)

    @property
    def nodes_removed(self) -> int:
        return sum(r.nodes_before - r.nodes_after for r in self.rounds)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rounds)

    def as_dict(self) -> dict:
        return {
            "pass": self.name,
            "matches": self.matches,
            "nodes_removed": self.nodes_removed,
            "seconds": round(self.seconds, 4),
            "rounds": [r.as_dict() for r in self.rounds],
        }


def _executed_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph onnxruntime executes for `model` (looked up at call time, so that a replaced
    runtime.executed_graph is the one asked)."""
    return runtime.executed_graph(model)


def _evaluate(model: onnx.ModelProto) -> list:
    """The outputs of an input-less `model` in onnxruntime, optimizations off (runtime.evaluate)."""
    return runtime.evaluate(model)


@dataclass
class PassOptions:
    """What callers may tell the passes (api.optimize's `options`, tests, benchmarks). Passes
    read it; what they report back goes in Context fields of its own."""

    # Values of symbolic dims (--dim, a zoo model's defaults): passes whose rule depends on a
    # size read them as verification does, 1 where not given.
    dims: dict[str, int] = field(default_factory=dict)
    # Names of the passes of this run (the pipeline fills it in): a pass may decide differently
    # when a later one (pointwise fusion) takes what it leaves.
    pipeline: list[str] | None = None
    tune: bool = False  # --tune: time ConvBiasAct tiles on this machine's GPU
    tune_batch: int = 1  # batch the tiles are timed at
    conv_policy: str = "pays"  # "pays": only layers where the kernel beat cuDNN; "always"
    conv_split_k: bool = False  # offer split-K over thread-block clusters (sm_90+)
    conv_tensor_cores: bool = False  # offer the 3xTF32 tensor-core GEMM (sm_80+)
    stacked_mlp: str = "pays"  # "pays": where StackedMLP beats onnxruntime; "always"
    attention_cuda: bool = False  # fuse attention on --target cuda (opt-in until timed on a GPU)
    squeeze_excite_cuda: bool = False  # squeeze-excite on --target cuda (opt-in until timed on a GPU)
    onnxscript_fusions: bool = True  # False: the onnxscript-fusions stage leaves the graph alone

    def pointwise_fusion_runs(self) -> bool:
        """Whether a pointwise-fusion pass is in this run: `pipeline` lists the selected pass
        names when the caller records them; without it the default pipeline, which fuses
        pointwise regions, is assumed."""
        return self.pipeline is None or any("pointwise" in n for n in self.pipeline)

    @classmethod
    def from_mapping(cls, values: Mapping[str, object] | None) -> PassOptions:
        """PassOptions from keyword values; a name that is no option is a ValueError."""
        values = dict(values or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown pass option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


@dataclass
class Context:
    """What a pass may read and use besides the graph."""

    # What the model will run on; a name ("cpu", "cuda") and `arch` are taken as Target(name, arch).
    target: Target | str = "cpu"
    arch: str | None = None  # CUDA architecture for --target cuda, e.g. "sm_90" (target.arch)
    registry: FusedRegistry = field(default_factory=FusedRegistry)
    options: PassOptions = field(default_factory=PassOptions)
    # Set by conv-bias-act when --tune found no GPU to time on (the heuristic tiles are used).
    tune_unavailable: str | None = None
    # Set at import: the graph holds weights by reference to their file (weights.py), which the
    # pipeline releases after each pass.
    weights_on_disk: bool = False
    # Attributes graphsurgeon cannot carry, set aside at import and restored at export.
    binary_attributes: dict = field(default_factory=dict)
    # Set at import: initializers that are also graph inputs (IR >= 4: defaults a caller may
    # override), held out of the graph so that no pass takes them for constants.
    input_defaults: list = field(default_factory=list)
    # What onnxruntime executes for a model, for passes that must not block its fusions: the
    # ort layer opens the session, never a pass. None: the passes' rules stand alone.
    executed_graph: Callable[[onnx.ModelProto], onnx.ModelProto] | None = _executed_graph
    # The outputs of a model without inputs as onnxruntime's kernels compute them, for passes
    # that fold constants. None: nothing is folded.
    evaluate: Callable[[onnx.ModelProto], list] | None = _evaluate

    # The pass now running (run_passes sets it), and why each candidate of each pass did not
    # match: pass name -> node name -> its reasons, one per round that gave a new one (a later
    # round meets the graph other passes changed: its reason alone can hide the first one).
    # Read by `--explain`.
    current_pass: str | None = None
    rejections: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # Passes whose rules record a reason for every candidate they leave (`--explain PASS`):
    # recording costs a line of text per candidate, so the others record none.
    explain: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.target = as_target(self.target, self.arch)
        self.arch = self.target.arch

    def reject(self, node: gs.Node, reason: str) -> None:
        """Record why `node` (a candidate root) was not rewritten by the running pass. Returns
        None, so that a matcher can `return ctx.reject(node, "...")`."""
        if self.current_pass is not None:
            reasons = self.rejections.setdefault(self.current_pass, {}).setdefault(node.name, [])
            if reason not in reasons:
                reasons.append(reason)
        return None

    @property
    def explainer(self) -> Callable[[gs.Node, str], None] | None:
        """What the rule engine hands each candidate's reason to (rules.apply's `explain`):
        `reject` while the running pass is one to explain, else None (no reasons made)."""
        return self.reject if self.current_pass in self.explain else None

    def fuse(self, graph: gs.Graph, op_type: str, nodes, inputs, outputs, attrs=None) -> gs.Node:
        """Replace a matched subgraph by one fused node with its fallback function. An output of
        an op whose contract gives float32 outputs (onnxfuse/ops) gets that type where it had none."""
        node = make_fused_node(graph, self.registry, op_type, nodes, inputs, outputs, attrs)
        op = ops.BY_NAME.get(op_type)
        if op is not None and all(p.dtype == "float32" for p in op.outputs):
            for t in node.outputs:
                if t.dtype is None:
                    t.dtype = np.float32
        return node


@dataclass(frozen=True)
class Pass:
    """A graph rewrite rule.

    name:    what `--passes` and `onnxfuse passes` call it
    order:   position in the default pipeline (lower runs first)
    summary: one line for `onnxfuse passes`
    run:     run(graph, ctx) -> number of rewrites made; the graph is cleaned up after it
    targets: the targets the pass applies to
    """

    name: str
    order: int
    summary: str
    run: Callable[[gs.Graph, Context], int]
    targets: tuple[str, ...] = TARGETS
    default: bool = True


def fused_op_pass(op: ops.FusedOp, order: int, summary: str, run: Callable[[gs.Graph, Context], int]) -> Pass:
    """The pass that writes fused op `op`: named as the op's module says (op.pass_name), applied
    on the targets with a kernel of the op (elsewhere its node would only run its fallback)."""
    return Pass(name=op.pass_name, order=order, summary=summary, run=run, targets=op.targets)


def all_passes() -> list[Pass]:
    """Every pass module in onnxfuse.passes defines PASS (or PASSES); sorted by order."""
    import importlib
    import pkgutil

    from . import passes as pkg

    found: list[Pass] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for p in getattr(mod, "PASSES", [getattr(mod, "PASS", None)]):
            if p is not None:
                found.append(p)
    names = [p.name for p in found]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RuntimeError(f"duplicate pass names: {sorted(dup)}")
    return sorted(found, key=lambda p: (p.order, p.name))


def select_passes(names: Sequence[str] | None, target: str) -> list[Pass]:
    passes = all_passes()
    if names is None:
        return [p for p in passes if p.default and target in p.targets]
    by_name = {p.name: p for p in passes}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown pass(es): {', '.join(unknown)}; known: {', '.join(by_name)}")
    chosen = set(names)
    return [p for p in passes if p.name in chosen]


def import_graph(model: onnx.ModelProto, ctx: Context) -> tuple[gs.Graph, list[onnx.FunctionProto], dict[str, str]]:
    """ModelProto -> graphsurgeon graph, keeping aside what graphsurgeon would lose."""
    kept = list(model.functions)
    overloads = {n.name: n.overload for n in model.graph.node if n.overload}
    ctx.registry.reserve([f.overload for f in kept if f.domain == DOMAIN], [n.name for n in model.graph.node])
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    del stripped.functions[:]
    ctx.binary_attributes = _set_aside_binary_attributes(stripped, ctx)
    ctx.input_defaults = _set_aside_input_defaults(stripped)
    graph = gs.import_onnx(stripped)
    # Weights held by reference stay on disk; passes map them when they read them.
    ctx.weights_on_disk = attach_graph(graph) > 0
    constants_as_initializers(graph)
    return graph, kept, overloads


def _set_aside_input_defaults(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """Remove the initializers that are also graph inputs from the model: from IR 4 on such an
    initializer is the input's default value, and the caller may feed another. graphsurgeon
    would make the value a constant and drop the input (a pass could then fold it)."""
    inputs = {i.name for i in model.graph.input}
    defaults = [t for t in model.graph.initializer if t.name in inputs]
    if defaults:
        kept = [t for t in model.graph.initializer if t.name not in inputs]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return defaults


def _set_aside_binary_attributes(model: onnx.ModelProto, ctx: Context) -> dict[str, list[onnx.AttributeProto]]:
    """Remove string attributes that are not text (a stored cubin, say) from the model's nodes,
    keyed by node name: graphsurgeon decodes every string attribute as UTF-8."""

    def is_text(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    aside: dict[str, list[onnx.AttributeProto]] = {}
    for node in model.graph.node:
        binary = [
            a
            for a in node.attribute
            if (a.type == onnx.AttributeProto.STRING and not is_text(a.s))
            or (a.type == onnx.AttributeProto.STRINGS and not all(is_text(x) for x in a.strings))
        ]
        if not binary:
            continue
        if not node.name:
            node.name = ctx.registry.unique_node_name(f"{node.op_type}_node")
        aside[node.name] = [onnx.AttributeProto.FromString(a.SerializeToString()) for a in binary]
        keep = [a for a in node.attribute if all(a is not b for b in binary)]
        del node.attribute[:]
        node.attribute.extend(keep)
    return aside


def export_graph(graph: gs.Graph, model: onnx.ModelProto, ctx: Context, kept, overloads) -> onnx.ModelProto:
    toposort(cleanup(graph))
    out, _ = export_model(graph)  # gs.export_onnx's model, copying each weight once
    # Restore what graphsurgeon does not carry: model metadata, overloads of nodes we kept.
    out.ir_version = model.ir_version
    keep_model_fields(model, out)
    out.producer_name = model.producer_name or "onnxfuse"
    for node in out.graph.node:
        if node.name in overloads and node.name not in ctx.registry.by_node:
            node.overload = overloads[node.name]
        node.attribute.extend(ctx.binary_attributes.get(node.name, []))
    written = {o.domain: o for o in out.opset_import}
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    # A domain a pass introduced (com.microsoft, from the onnxscript-fusions stage) is declared too.
    declared = {o.domain for o in model.opset_import}
    used = {n.domain for n in out.graph.node}
    out.opset_import.extend(o for d, o in written.items() if d in used and d not in declared and d != DOMAIN)
    attach_functions(out, ctx.registry, kept)
    inputs = {i.name for i in out.graph.input}
    out.graph.initializer.extend(t for t in ctx.input_defaults if t.name in inputs)
    return out


# The pipeline runs until a round of all passes rewrites nothing, so that optimizing an
# optimized model changes nothing: one pass can open a match for an earlier one (the pointwise
# pass frees a Slice that merge-slices could not merge while it had two readers).
MAX_ROUNDS = 3


# The graph a pipeline works on is a few hundred thousand Python objects (about 20 per node) that
# live until its end, built in bulk. At the interpreter's default thresholds (700, 10, 10) each
# 25% growth of the heap makes a full collection walk all of it: ten walks for a 25,000-node
# model (16% of its pass time), one for 2,500 nodes. Young collections every 100,000 container
# allocations instead of 700 leave full ones to be rare, and little garbage waits meanwhile
# (nodes a pass removes are unlinked and freed by reference counting).
YOUNG_COLLECTION_THRESHOLD = 100_000


@contextmanager
def fewer_collections():
    """Raise the young-generation threshold of the garbage collector for the block, then put
    the caller's thresholds back."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], YOUNG_COLLECTION_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def run_passes(model: onnx.ModelProto, passes: Sequence[Pass], ctx: Context,
               on_pass: Callable[[str, int], None] | None = None) -> tuple[onnx.ModelProto, list[PassStats]]:
    """Run `passes` in rounds until one rewrites nothing; on_pass(name, round) is called as each
    pass starts (for progress displays)."""
    with fewer_collections():
        return _run_passes(model, passes, ctx, on_pass)


def _run_passes(model, passes, ctx, on_pass):
    graph, kept, overloads = import_graph(model, ctx)
    if ctx.options.pipeline is None:
        ctx.options.pipeline = [p.name for p in passes]
    stats = {p.name: PassStats(p.name) for p in passes}
    for round_ in range(MAX_ROUNDS):
        rewrites = 0
        for p in passes:
            if on_pass is not None:
                on_pass(p.name, round_)
            before = len(graph.nodes)
            t0 = time.perf_counter()
            ctx.current_pass = p.name
            matches = int(p.run(graph, ctx) or 0)
            ctx.current_pass = None
            if matches:
                toposort(cleanup(graph))
            if ctx.weights_on_disk:
                release_graph(graph)
            stats[p.name].record(round_, matches, before, len(graph.nodes), time.perf_counter() - t0)
            rewrites += matches
        if not rewrites:
            break
    return export_graph(graph, model, ctx, kept, overloads), list(stats.values())
