"""The faster stand-ins for graphsurgeon and onnx steps that `optimize` uses (cleanup,
export_model, the weight-free shape inference, fold-batchnorm's name set, verification through
model files) give exactly what the originals give; toposort keeps the exporter's order."""
from __future__ import annotations

import random

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import api, modelio, normalize, ortfiles, verify, zoo
from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.passes import fold_batchnorm
from onnxfuse.pipeline import Context

ZOO = ["inception_v1", "shufflenet", "gpt_stack", "mobilenetv3"]


def zoo_model(name: str) -> onnx.ModelProto:
    entry = next(m for m in zoo.list_models() if m.name == name)
    return onnx.load(str(entry.path))


def large_weight_model() -> onnx.ModelProto:
    """y = reshape(x @ W + b, shape): W large (left out of inference), shape a small constant."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(96).astype(np.float32), "b")
    shape = numpy_helper.from_array(np.array([0, 8, 12], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["h"]),
         helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Reshape", ["r", "shape"], ["y"])],
        "large_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w, b, shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def shuffled(graph: gs.Graph, seed: int) -> gs.Graph:
    order = list(range(len(graph.nodes)))
    random.Random(seed).shuffle(order)
    graph.nodes = [graph.nodes[i] for i in order]
    return graph


def _is_topological(graph: gs.Graph) -> bool:
    seen = {t.name for t in graph.inputs} | {t.name for t in gu.tensor_map(graph).values() if isinstance(t, gs.Constant)}
    for node in graph.nodes:
        if any(gu.is_present(t) and t.name not in seen for t in node.inputs):
            return False
        seen.update(t.name for t in node.outputs)
    return True


@pytest.mark.parametrize("name", ZOO)
def test_toposort_keeps_an_order_that_is_already_topological(name):
    """The exporter's order stays: passes walk each branch in one piece (graphsurgeon's order,
    stably by depth, interleaved 2,500 parallel chains: 17% of their pass time)."""
    graph = gs.import_onnx(zoo_model(name))
    before = [n.name for n in graph.nodes]
    assert [n.name for n in gu.toposort(graph).nodes] == before


@pytest.mark.parametrize("name", ZOO)
def test_toposort_puts_every_producer_before_its_readers(name):
    model = zoo_model(name)
    for seed in range(3):
        graph = gu.toposort(shuffled(gs.import_onnx(model), seed))
        assert _is_topological(graph)
        assert sorted(n.name for n in graph.nodes) == sorted(n.name for n in model.graph.node)


def test_toposort_moves_a_node_out_of_place_to_just_before_its_first_reader():
    graph = gs.import_onnx(zoo_model("gpt_stack"))
    names = [n.name for n in graph.nodes]
    reader = next(k for k, n in enumerate(graph.nodes) if k > 3 and n.inputs and n.inputs[0].inputs)
    producer = graph.nodes[reader].inputs[0].inputs[0]
    moved = [n for n in graph.nodes if n is not producer] + [producer]  # a pass appends what it makes
    graph.nodes = moved
    before_reader = [n.name for n in moved if n is not producer]
    order = [n.name for n in gu.toposort(graph).nodes]
    readers = {c.name for t in producer.outputs for c in t.outputs}
    first_reader = min(order.index(r) for r in readers)
    assert order.index(producer.name) == first_reader - 1 and first_reader <= order.index(names[reader])
    assert [n for n in order if n != producer.name] == before_reader
    assert _is_topological(graph)


def test_toposort_leaves_cycles_to_graphsurgeon():
    graph = gs.import_onnx(zoo_model("inception_v1"))
    node = next(n for n in graph.nodes if n.outputs and n.outputs[0].outputs)
    reader = node.outputs[0].outputs[0]
    node.inputs.append(reader.outputs[0])  # node now reads what its reader writes
    with pytest.raises(Exception, match="[Cc]ycle"):
        gu.toposort(graph)


def _mutate(graph: gs.Graph, seed: int) -> None:
    """Detach and bypass some nodes, drop a graph output: what passes leave for cleanup."""
    rng = random.Random(seed)
    for node in rng.sample(graph.nodes, max(1, len(graph.nodes) // 8)):
        if rng.random() < 0.5:
            node.inputs.clear()
            node.outputs.clear()
        elif node.inputs and node.outputs and node.outputs[0].outputs:
            reader = node.outputs[0].outputs[0]
            for i, t in enumerate(reader.inputs):
                if t is node.outputs[0]:
                    reader.inputs[i] = node.inputs[0]
    if len(graph.outputs) > 1:
        graph.outputs = graph.outputs[:1]


@pytest.mark.parametrize("name", ZOO)
def test_cleanup_keeps_what_graphsurgeon_keeps(name):
    model = zoo_model(name)
    for seed in range(3):
        expected, actual = gs.import_onnx(model), gs.import_onnx(model)
        _mutate(expected, seed)
        _mutate(actual, seed)
        expected.cleanup(remove_unused_graph_inputs=False)
        gu.cleanup(actual)
        assert gs.export_onnx(actual, do_type_check=False) == gs.export_onnx(expected, do_type_check=False)


@pytest.mark.parametrize("name", ZOO + ["large"])
def test_export_model_writes_what_graphsurgeon_writes(name):
    model = large_weight_model() if name == "large" else zoo_model(name)
    graph = gs.import_onnx(model)
    for i, t in enumerate(graph.tensors().values()):  # some constants read (numpy), some not (lazy)
        if isinstance(t, gs.Constant) and i % 2:
            t.values
    expected = gs.export_onnx(graph, do_type_check=False).SerializeToString()
    assert gu.export_model(graph)[0].SerializeToString() == expected


def test_inference_model_describes_large_weights_by_type_and_shape():
    graph = gs.import_onnx(large_weight_model())
    model, left_out = facts.inference_model(graph)
    assert [t.name for t in model.graph.initializer] == ["b", "shape"]
    w = next(v for v in model.graph.input if v.name == "W")
    assert [d.dim_value for d in w.type.tensor_type.shape.dim] == [64, 96]
    assert left_out == 64 * 96 * 4


def test_shape_table_of_large_weight_model_knows_reshape_output():
    shapes = facts.ShapeTable(gs.import_onnx(large_weight_model()))
    graph = gs.import_onnx(large_weight_model())
    y = next(t for t in graph.outputs if t.name == "y")
    assert facts.ShapeTable(graph).dims(y) == shapes.dims(y) == ["batch", 8, 12]


def test_shape_table_infers_once_for_an_unchanged_graph(monkeypatch):
    graph = gs.import_onnx(large_weight_model())
    calls = []
    real = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = facts.ShapeTable(graph)
    second = facts.ShapeTable(graph)
    assert len(calls) == 1
    y = graph.outputs[0]
    assert first.dims(y) == second.dims(y) == ["batch", 8, 12]
    graph.nodes[2].op = "Sigmoid"  # a changed graph is inferred again
    facts.ShapeTable(graph)
    assert len(calls) == 2


@pytest.mark.parametrize("name", ZOO + ["large"])
def test_weight_free_inference_gives_onnx_inference_result(name):
    model = large_weight_model() if name == "large" else zoo_model(name)
    model.ir_version = min(max(model.ir_version, 4), 10)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    expected = onnx.shape_inference.infer_shapes(copy, check_type=False, strict_mode=False, data_prop=True)
    assert normalize.infer_shapes(model).SerializeToString() == expected.SerializeToString()


def test_fold_batchnorm_reuses_names_its_folds_free():
    """Three folds into one Conv: the third writes W/B under the names the first wrote, which
    the second freed (what unique_name over the whole graph gives)."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="n0")]
    prev = "c"
    for i, op in enumerate(["BatchNormalization", "Mul", "Mul"]):
        if op == "BatchNormalization":
            names = [f"bn{i}_{k}" for k in ("s", "b", "m", "v")]
            for k, n in enumerate(names):
                value = rng.random(4).astype(np.float32) + (1.0 if k in (0, 3) else 0.0)
                inits.append(numpy_helper.from_array(value, n))
            nodes.append(helper.make_node(op, [prev] + names, [f"t{i}"]))
        else:
            inits.append(numpy_helper.from_array(rng.random((1, 4, 1, 1)).astype(np.float32), f"k{i}"))
            nodes.append(helper.make_node(op, [prev, f"k{i}"], [f"t{i}"]))
        prev = f"t{i}"
    graph = helper.make_graph(nodes, "folds", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    g = gs.import_onnx(model)
    assert fold_batchnorm.run(g, Context()) == 3
    conv = next(n for n in g.nodes if n.op == "Conv")
    assert [t.name for t in conv.inputs[1:]] == ["n0_W_folded", "n0_B_folded"]


def test_released_names_are_reused_except_node_names():
    graph = gs.import_onnx(large_weight_model())
    matmul, add = graph.nodes[0], graph.nodes[1]
    add.name = "h"  # a node named like the tensor it writes
    taken = gu.taken_names(graph)
    assert {"x", "W", "xw", "h", "y"} <= taken
    xw, h = matmul.outputs[0], add.outputs[0]
    graph.nodes[2].inputs[0] = xw  # Relu reads x @ W: the Add and its output are unused
    gu.disconnect(add)
    gu.release_names(graph, taken, [xw, h])
    assert "xw" in taken  # still read by the Relu
    assert "h" in taken  # still a node's name
    assert "b" in taken  # not released
    gu.release_names(graph, taken, [next(t for t in gu.tensor_map(graph).values() if t.name == "x")])
    assert "x" in taken  # a graph input


def test_verification_through_model_files_matches_in_memory(monkeypatch):
    result = api.optimize(large_weight_model(), dims={"batch": 2})
    original = normalize.normalize(modelio.LoadedModel(large_weight_model(), "m")).model
    in_memory = verify.verify(original, result.model, {"batch": 2})
    monkeypatch.setattr(ortfiles, "EXTERNAL_DATA_MIN_BYTES", 0)
    through_files = verify.verify(original, result.model, {"batch": 2})
    assert through_files.ok and in_memory.ok
    assert through_files.original_profile == in_memory.original_profile
    assert through_files.optimized_profile == in_memory.optimized_profile
    assert [r.as_dict() for r in through_files.runs] == [r.as_dict() for r in in_memory.runs]
