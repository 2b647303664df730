"""Other ways onnxruntime computes an original (used by check.unexplained): node by node, each value
materialized in its declared type, and a float16 original computed in float32 throughout."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper


def _run_step(model: onnx.ModelProto, feeds: dict) -> dict:
    from ..runtime import make_session

    sess = make_session(model, with_library=False, threads=1, level="disable")
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def outer_names(graph: onnx.GraphProto) -> set[str]:
    """The names a subgraph reads from the scopes around it (outer-scope references)."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.name for t in graph.sparse_initializer}
    read: set[str] = set()
    for node in graph.node:
        read.update(i for i in node.input if i)
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                read |= outer_names(g)
        defined.update(o for o in node.output if o)
    return read - defined


def casts_double_to_half(model: onnx.ModelProto) -> bool:
    """Whether the original has a top-level Cast to float16 (of a double, perhaps)."""
    return any(n.op_type == "Cast" and any(a.name == "to" and a.i == TensorProto.FLOAT16 for a in n.attribute)
               for n in model.graph.node)


def node_by_node(model: onnx.ModelProto, feeds: dict, half_casts_rounded_once: bool = False) -> dict:
    """The original's outputs as onnxruntime computes them one top-level node at a time, each
    node's outputs materialized in their declared types before the next node reads them. A node
    with subgraphs (If, Loop, Scan) is one step whose inputs include the top-level values its
    bodies read (seeds 9021200, 9033095). half_casts_rounded_once: a Cast of a double to float16
    rounds once, to the nearest float16, as Cast is defined (onnxruntime rounds through float,
    twice, which moves a value within 2^-24 of a float16 midpoint by an ulp: seeds 1591, 9059180;
    ours rounds once, tests/test_dtypes.py)."""
    graph = model.graph
    values = dict(feeds)
    values.update({t.name: numpy_helper.to_array(t) for t in graph.initializer})
    for node in graph.node:
        if half_casts_rounded_once and node.op_type == "Cast" and node.input[0] in values and \
                values[node.input[0]].dtype == np.float64 and \
                any(a.name == "to" and a.i == TensorProto.FLOAT16 for a in node.attribute):
            values[node.output[0]] = np.asarray(values[node.input[0]].astype(np.float16))
            continue
        names = list(i for i in node.input if i)
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names += sorted(n for n in outer_names(g) if n in values)
        names = list(dict.fromkeys(names))
        inputs = [onnx.helper.make_tensor_value_info(i, onnx.helper.np_dtype_to_tensor_dtype(values[i].dtype),
                                                     values[i].shape) for i in names]
        outputs = [onnx.ValueInfoProto(name=o) for o in node.output if o]
        step = onnx.helper.make_model(onnx.helper.make_graph([node], "step", inputs, outputs),
                                      opset_imports=model.opset_import, ir_version=model.ir_version)
        values.update(_run_step(step, {i: values[i] for i in names}))
    return {o.name: values[o.name] for o in graph.output}


def _retype_tensor(t: TensorProto, src: int, dst: int) -> TensorProto:
    if t.data_type != src:
        return t
    np_dst = onnx.helper.tensor_dtype_to_np_dtype(dst)
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np_dst), t.name)


def retyped(model: onnx.ModelProto, src: int, dst: int) -> onnx.ModelProto:
    """The same model with every `src` tensor, value and Cast target `dst` instead (its graph
    inputs and outputs too)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)

    def graph(g: onnx.GraphProto) -> None:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.tensor_type.elem_type == src:
                vi.type.tensor_type.elem_type = dst
        for i, t in enumerate(g.initializer):
            g.initializer[i].CopyFrom(_retype_tensor(t, src, dst))
        for node in g.node:
            for a in node.attribute:
                if node.op_type == "Cast" and a.name == "to" and a.i == src:
                    a.i = dst
                elif a.type == onnx.AttributeProto.TENSOR:
                    a.t.CopyFrom(_retype_tensor(a.t, src, dst))
                elif a.type == onnx.AttributeProto.GRAPH:
                    graph(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        graph(sub)

    graph(m.graph)
    return m


def float16_in_float32(model: onnx.ModelProto, feeds: dict) -> dict | None:
    """A float16 original computed in float32 from its inputs to its outputs, each output rounded
    to float16 at the end: onnxruntime's float16 emulation (float32 kernels with Cast pairs it
    drops between them) where it drops every rounding. Which ones it drops depends on the graph's
    form: the optimized model's fallback functions, inlined, give it other forms (seed 9007059).
    None for a model without float16 values."""
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    if not any(v.dtype == np.float16 for v in feeds.values()) and \
            not any(t.data_type == f16 for t in model.graph.initializer):
        return None
    wide = retyped(model, f16, f32)
    fed = {k: (v.astype(np.float32) if v.dtype == np.float16 else v) for k, v in feeds.items()}
    got = _run_step(wide, fed)
    kinds = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    return {k: (v.astype(np.float16) if kinds.get(k) == f16 and v.dtype == np.float32 else v) for k, v in got.items()}


FLOAT_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64, TensorProto.FLOAT16: np.float16}


def value_types(model: onnx.ModelProto) -> dict[str, int] | None:
    """The element type of every top-level value of `model` (shape inference's, initializers'),
    or None where onnx's inference fails (then no variant is built)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # onnx's inference errors
        return None
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types

def zero_tie_variants(model: onnx.ModelProto):
    """The original with every top-level float Max and Min of -0 and +0 giving +0, then -0.

    onnxruntime's Max and Min of -0 and +0 return either zero by the tensors' lengths and the
    position in its vectorized loops (Min([1,7] with -0, [2,1,16,7] of +0) gives -0 in some rows
    and +0 in others), so every zero of that kind is one of its answers, and so is whatever is
    computed from it: a division by it gives an infinity of either sign (seed 9209141)."""
    types = value_types(model)
    if types is None:
        return
    floats = FLOAT_TYPES
    ties = [i for i, n in enumerate(model.graph.node) if n.op_type in ("Max", "Min") and len(n.input) == 2
            and types.get(n.input[0]) in floats and types.get(n.input[0]) == types.get(n.input[1])]
    if not ties:
        return
    for zero in (0.0, -0.0):
        variant = onnx.ModelProto()
        variant.CopyFrom(model)
        graph = variant.graph
        nodes = list(graph.node)
        for i in reversed(ties):
            n = nodes[i]
            a, b, y = n.input[0], n.input[1], n.output[0]
            p = f"{y}__zero_tie"
            np_type = floats[types[a]]
            graph.initializer.append(numpy_helper.from_array(np.array(zero, np_type), f"{p}_zero"))
            graph.initializer.append(numpy_helper.from_array(np.array(1.0, np_type), f"{p}_one"))
            n.output[0] = f"{p}_raw"
            # a tie: both operands zero, of opposite signs (1 / x is -inf for -0 alone)
            make = onnx.helper.make_node
            nodes[i + 1:i + 1] = [
                make("Equal", [a, f"{p}_zero"], [f"{p}_a0"]), make("Equal", [b, f"{p}_zero"], [f"{p}_b0"]),
                make("Div", [f"{p}_one", a], [f"{p}_ra"]), make("Div", [f"{p}_one", b], [f"{p}_rb"]),
                make("Less", [f"{p}_ra", f"{p}_zero"], [f"{p}_an"]), make("Less", [f"{p}_rb", f"{p}_zero"], [f"{p}_bn"]),
                make("Xor", [f"{p}_an", f"{p}_bn"], [f"{p}_apart"]), make("And", [f"{p}_a0", f"{p}_b0"], [f"{p}_zeros"]),
                make("And", [f"{p}_zeros", f"{p}_apart"], [f"{p}_tie"]),
                make("Where", [f"{p}_tie", f"{p}_zero", f"{p}_raw"], [y]),
            ]
        del graph.node[:]
        graph.node.extend(nodes)
        yield variant


def near_equal_variant(model: onnx.ModelProto, scale: float) -> onnx.ModelProto | None:
    """The original with each top-level float Equal true also for operands within `scale` of
    each other (relative), or None where it has none.

    Moving a comparison's operands apart (check.jump_variants) flips an Equal from true to false
    only; two correct elementary functions an ulp apart flip it the other way too: Equal(x,
    Tanh(x)) at x = 3.48e-4 is true for a correctly rounded tanh and false for onnxruntime's, an
    ulp below (seed 9218161)."""
    types = value_types(model)
    if types is None:
        return None
    floats = FLOAT_TYPES
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    graph = variant.graph
    nodes, changed = [], False
    make = onnx.helper.make_node
    for n in graph.node:
        np_type = floats.get(types.get(n.input[0])) if n.op_type == "Equal" and len(n.input) == 2 else None
        if np_type is None:
            nodes.append(n)
            continue
        a, b, y, p = n.input[0], n.input[1], n.output[0], f"{n.output[0]}__near"
        graph.initializer.append(numpy_helper.from_array(np.array(scale, np_type), f"{p}_scale"))
        nodes += [make("Sub", [a, b], [f"{p}_d"]), make("Abs", [f"{p}_d"], [f"{p}_ad"]),
                  make("Abs", [a], [f"{p}_aa"]), make("Abs", [b], [f"{p}_ab"]),
                  make("Max", [f"{p}_aa", f"{p}_ab"], [f"{p}_m"]), make("Mul", [f"{p}_m", f"{p}_scale"], [f"{p}_tol"]),
                  make("LessOrEqual", [f"{p}_ad", f"{p}_tol"], [f"{p}_near"]),
                  make("Equal", [a, b], [f"{p}_eq"]), make("Or", [f"{p}_eq", f"{p}_near"], [y])]
        changed = True
    if not changed:
        return None
    del graph.node[:]
    graph.node.extend(nodes)
    return variant


def _float64_outputs(model: onnx.ModelProto, feeds: dict) -> dict | None:
    """The original evaluated in float64 by onnx's reference evaluator (None where it cannot).

    A model that already computes in double is evaluated in the platform's extended precision
    where it has one (x86-64: 80 bits, exponents to 1e4932): its float64 evaluation is
    onnxruntime's own arithmetic and overflows where onnxruntime does. A linear scale folded
    into a MatMul's weight gives the finite x (W s) where onnxruntime's (x W) s overflowed first
    (seed 9290199); only a wider range tells which is the result."""
    from onnx.reference import ReferenceEvaluator

    try:
        m64 = _to_float64(model)
        feeds64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in feeds.items()}
        names = [o.name for o in m64.graph.output]
        with np.errstate(all="ignore"):
            if _computes_in_double(model) and np.finfo(np.longdouble).maxexp > np.finfo(np.float64).maxexp:
                wide = _extended_outputs(ReferenceEvaluator(m64), feeds64)
                if wide is not None:
                    return dict(zip(names, wide))
            return dict(zip(names, ReferenceEvaluator(m64).run(None, feeds64)))
    except Exception:  # the reference evaluator lacks an op or a dtype: no float64 explanation
        return None


def _computes_in_double(model: onnx.ModelProto) -> bool:
    g, double = model.graph, TensorProto.DOUBLE
    return (any(vi.type.tensor_type.elem_type == double for vi in list(g.input) + list(g.output))
            or any(t.data_type == double for t in g.initializer))


def _extended_outputs(evaluator, feeds: dict) -> list | None:
    """The evaluator's outputs with every float64 value held in np.longdouble: initializers and
    inputs widened, and each node's float64 results widened again (a Constant, a Cast to double).
    None where an operator refuses the wider type."""
    def widen(v):
        return v.astype(np.longdouble) if isinstance(v, np.ndarray) and v.dtype == np.float64 else v

    def widening(run):
        def wrapped(*args, **kwargs):
            out = run(*args, **kwargs)
            return tuple(widen(v) for v in out) if isinstance(out, (tuple, list)) else widen(out)
        return wrapped

    evaluator.rt_inits_ = {k: widen(v) for k, v in evaluator.rt_inits_.items()}
    for node in evaluator.rt_nodes_:
        node.run = widening(node.run)
    try:
        return evaluator.run(None, {k: widen(v) for k, v in feeds.items()})
    except Exception:  # an operator's own dtype checks: the float64 evaluation stands
        return None


def _to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model computing in float64: float32 tensors, values and Casts become double."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    f32, f64 = TensorProto.FLOAT, TensorProto.DOUBLE

    def tensor64(t: TensorProto) -> TensorProto:
        if t.data_type != f32:
            return t
        return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name)

    def graph64(g: onnx.GraphProto) -> None:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.tensor_type.elem_type == f32:
                vi.type.tensor_type.elem_type = f64
        for i, t in enumerate(g.initializer):
            g.initializer[i].CopyFrom(tensor64(t))
        for node in g.node:
            for a in node.attribute:
                if node.op_type == "Cast" and a.name == "to" and a.i == f32:
                    a.i = f64
                elif a.type == onnx.AttributeProto.TENSOR:
                    a.t.CopyFrom(tensor64(a.t))
                elif a.type == onnx.AttributeProto.GRAPH:
                    graph64(a.g)

    graph64(m.graph)
    return m


WRAPPED_DOMAIN = "onnxfuse.fuzz.wrapped"


def wrapped_in_a_function(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The model as one call of a model-local function holding all its nodes, the initializers
    passed in as inputs (the same computation); None for a graph with subgraphs."""
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node
           for a in n.attribute):
        return None
    names = [i.name for i in graph.input]
    names += [t.name for t in graph.initializer if t.name not in set(names)]
    outputs = [o.name for o in graph.output]
    if set(outputs) & set(names):
        return None
    body = onnx.helper.make_function(WRAPPED_DOMAIN, "Graph", names, outputs, list(graph.node),
                                     list(model.opset_import))
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    del variant.graph.node[:]
    variant.graph.node.append(onnx.helper.make_node("Graph", names, outputs, domain=WRAPPED_DOMAIN))
    variant.opset_import.append(onnx.helper.make_opsetid(WRAPPED_DOMAIN, 1))
    variant.functions.append(body)
    return variant


def _every_value_an_output(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every top-level node output also a graph output (same computation)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name and name not in have:
                probe.graph.output.append(onnx.ValueInfoProto(name=name))
                have.add(name)
    return probe


def _relu_on_flat_tensors(model: onnx.ModelProto) -> onnx.ModelProto:
    """The original with each Relu applied to its input flattened to one dimension and reshaped
    back (the same values), in subgraphs too (a Loop body's, seed 9468840). onnxruntime 1.31 runs
    the float16 Relu of an opset-18 model as its function body, Max(X, 0) (of other opsets: in
    float32), and its Max of -0 and +0 picks by the broadcast loop: -0 for shape [16], +0 for
    [16, 1, 1]."""
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    flat = "relu_flat__shape"
    if _flatten_relus(variant.graph, flat, ""):
        variant.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), flat))
    return variant


def _flatten_relus(graph: onnx.GraphProto, flat: str, scope: str) -> bool:
    """Each Relu of `graph` and its subgraphs rewritten so (`flat`: [-1]); whether any was."""
    found = False
    nodes = []
    for k, n in enumerate(graph.node):
        for attr in n.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for j, g in enumerate(subgraphs):
                found |= _flatten_relus(g, flat, f"{scope}{k}_{attr.name}{j}_")
        if n.op_type != "Relu" or n.domain not in ("", "ai.onnx"):
            nodes.append(n)
            continue
        found = True
        x, y = n.input[0], n.output[0]
        names = [f"{y}__relu_flat_{scope}{k}_{part}" for part in ("shape", "in", "out")]
        nodes += [onnx.helper.make_node("Shape", [x], [names[0]]),
                  onnx.helper.make_node("Reshape", [x, flat], [names[1]]),
                  onnx.helper.make_node("Relu", [names[1]], [names[2]]),
                  onnx.helper.make_node("Reshape", [names[2], names[0]], [y])]
    del graph.node[:]
    graph.node.extend(nodes)
    return found


# Ops whose float results two correct implementations may give a few ulps apart: the elementary
# functions (each within its ulp bound) and sums whose order is the kernel's. Exact ones (Add,
# Mul, Div, Sqrt, Cast...) are left out.
INEXACT_OPS = {"Exp", "Log", "Pow", "Tanh", "Sigmoid", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh",
               "Cosh", "Asinh", "Acosh", "Atanh", "Erf", "Softplus", "Elu", "Selu", "Celu", "Gelu", "Mish",
               "HardSwish", "Softmax", "LogSoftmax", "MatMul", "Gemm", "Conv", "ReduceSum", "ReduceMean",
               "ReduceLogSumExp", "ReduceL2", "LpNormalization", "LayerNormalization", "InstanceNormalization"}
NOISE_DRAWS = 3


def scaling_node(graph: onnx.GraphProto, value: str, factor, np_type, factor_name: str, out: str) -> onnx.NodeProto:
    """A Mul of `value` by the constant `factor` of type np_type into `out` (the factor an
    initializer of `graph` named factor_name): how a variant moves a value."""
    graph.initializer.append(numpy_helper.from_array(np.array(factor, np_type), factor_name))
    return onnx.helper.make_node("Mul", [value, factor_name], [out])


def rounding_noise_variants(model: onnx.ModelProto, scale: float):
    """The original with each float result of an inexact op (INEXACT_OPS, top level) scaled by
    1 + scale * u, u uniform in [-1, 1] and one per value: the same computation with those ops a
    few ulps off, as another correct implementation may give them. Behind an integer Cast the
    moved inputs move nothing (seed 9487524: Tanh(-Pow(-2, -2)) an ulp apart, then a MatMul, a
    Div by values near 0 and a Cos of 4.6e7); these moves still show how far the answer follows
    such differences."""
    types = value_types(model)
    if types is None:
        return
    rng = np.random.default_rng(11)
    for _ in range(NOISE_DRAWS):
        variant = onnx.ModelProto()
        variant.CopyFrom(model)
        graph = variant.graph
        nodes = []
        for n in graph.node:
            nodes.append(n)
            if n.op_type not in INEXACT_OPS or n.domain not in ("", "ai.onnx"):
                continue
            for k, name in enumerate(n.output):
                np_type = FLOAT_TYPES.get(types.get(name))
                factor = np_type(1 + scale * rng.uniform(-1.0, 1.0)) if np_type is not None and name else None
                if factor is None or factor == 1:
                    continue
                exact = f"{name}__noise_exact"
                n.output[k] = exact
                nodes.append(scaling_node(graph, exact, factor, np_type, f"{name}__noise_factor", name))
        del graph.node[:]
        graph.node.extend(nodes)
        yield variant
