"""The zoo itself: manifest, lookup, and the generated models being what they claim to be."""
from __future__ import annotations

import importlib
import json
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxfuse import zoo
from onnxfuse.profile import count_kernels
from onnxfuse.runtime import make_session

MODELS = zoo.list_models()
GENERATED = [m for m in MODELS if m.source == "generated"]
SIZE_LIMIT = 2_000_000  # bytes


def _by_name(name):
    return next(m for m in MODELS if m.name == name)


def _generator(model):
    """The generator script of a generated model, imported as a module of onnxfuse.models."""
    return importlib.import_module(f"onnxfuse.models.{model.generator.stem}")


def _ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _run(model, feeds, level="all"):
    return make_session(model, threads=1, level=level).run(None, feeds)


# --------------------------------------------------------------------------- manifest and lookup


def test_manifest_lists_the_nine_light_models_and_the_four_generated_ones():
    light = {m.name for m in MODELS if m.source == "onnx-wheel"}
    assert light == {"bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
                     "squeezenet", "vgg19", "zfnet512"}
    assert {m.name for m in GENERATED} == {"char_rnn", "gpt_stack", "mobilenetv3", "mlp_ensemble"}
    assert len({m.name for m in MODELS}) == len(MODELS)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_manifest_inputs_and_dims_match_the_model_file(model):
    proto = onnx.load(str(model.file), load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    graph_inputs = [v for v in proto.graph.input if v.name not in initializers]
    declared = []
    for v in graph_inputs:
        t = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim)
        declared.append((v.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, dims))
    assert [(i.name, i.dtype, tuple(i.shape)) for i in model.inputs] == declared
    symbolic = {d for i in model.inputs for d in i.shape if isinstance(d, str)}
    assert set(model.dims) == symbolic, "dims must give a default for every symbolic dimension, and only those"
    assert model.description
    if model.source == "onnx-wheel":
        assert model.reference is not None and model.reference.is_file()
        assert model.file.parent == zoo.wheel_models_dir()
    else:
        assert model.reference is None and model.generator is not None and model.generator.is_file()
        assert model.file.parent == model.generator.parent


def test_get_and_resolve_accept_name_and_zoo_uri():
    assert zoo.get("zoo:gpt_stack") == zoo.get("gpt_stack")
    assert zoo.resolve("zoo:char_rnn") == zoo.resolve("char_rnn") == str(_by_name("char_rnn").path)
    assert zoo.get("resnet50").uri == "zoo:resnet50"


def test_unknown_zoo_name_error_lists_the_known_names():
    with pytest.raises(zoo.ZooError) as info:
        zoo.resolve("zoo:resnet51")
    message = str(info.value)
    assert "resnet51" in message and "\n" not in message
    for m in MODELS:
        assert m.name in message


def test_zoo_dir_from_environment_wins(tmp_path, monkeypatch):
    manifest = json.loads((zoo.models_dir() / zoo.MANIFEST).read_text())
    manifest["models"] = [m for m in manifest["models"] if m["name"] == "mlp_ensemble"]
    (tmp_path / zoo.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setenv("ONNXFUSE_ZOO_DIR", str(tmp_path))
    assert zoo.names() == ["mlp_ensemble"]
    with pytest.raises(zoo.ZooError, match="is missing"):
        zoo.resolve("mlp_ensemble")  # the manifest names a file that is not in tmp_path


def test_missing_manifest_is_a_zoo_error(tmp_path, monkeypatch):
    monkeypatch.setattr(zoo, "_PKG", tmp_path / "onnxfuse")
    monkeypatch.delenv("ONNXFUSE_ZOO_DIR", raising=False)
    with pytest.raises(zoo.ZooError, match="manifest"):
        zoo.list_models()


def test_light_reference_inputs_follow_the_onnx_backend_test():
    model = _by_name("squeezenet")
    (x,) = model.reference_inputs().values()
    assert x.shape == (1, 3, 224, 224) and x.dtype == np.float32
    assert x.flat[0] == 0 and x.flat[-1] == np.float32((x.size - 1) / x.size)


# --------------------------------------------------------------------------- generated models


@pytest.mark.parametrize("model", GENERATED, ids=lambda m: m.name)
def test_generated_model_is_small_valid_and_exporter_versioned(model):
    assert model.path.stat().st_size < SIZE_LIMIT
    proto = onnx.load(str(model.path))
    onnx.checker.check_model(proto, full_check=True)
    assert 8 <= proto.ir_version <= 10
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 17)]


@pytest.mark.parametrize("model", GENERATED, ids=lambda m: m.name)
def test_generator_reproduces_the_committed_model(model):
    regenerated = _generator(model).build()
    committed = onnx.load(str(model.path))
    if regenerated.SerializeToString() == committed.SerializeToString():
        return
    # mobilenetv3 calibrates its BatchNorm statistics in onnxruntime; rounded to 4 significant
    # digits, a different CPU may still flip a last digit. Everything else must be identical.
    def structure(m):
        copy = onnx.ModelProto()
        copy.CopyFrom(m)
        del copy.graph.initializer[:]
        return copy.SerializeToString()

    assert structure(regenerated) == structure(committed)
    assert [t.name for t in regenerated.graph.initializer] == [t.name for t in committed.graph.initializer]
    for a, b in zip(regenerated.graph.initializer, committed.graph.initializer):
        np.testing.assert_allclose(numpy_helper.to_array(a), numpy_helper.to_array(b), rtol=1e-3, atol=1e-6, err_msg=a.name)


def test_char_rnn_is_an_unrolled_two_layer_lstm_with_32_split_cells():
    proto = _by_name("char_rnn").load()
    ops = _ops(proto)
    assert ops["Split"] == 32 and ops["Sigmoid"] == 96 and ops["Tanh"] == 64
    assert ops["MatMul"] == 2 * 32 + 1  # gate MatMuls per cell + the logits head
    init = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Split":
            assert list(init[node.input[1]]) == [128] * 4 and len(node.output) == 4
    gathers = [n for n in proto.graph.node if n.op_type == "Gather"]
    assert gathers[0].input == ["embed.weight", "tokens"] and len(gathers) == 1 + 16
    assert [i.name for i in proto.graph.input] == ["tokens", "h0.0", "c0.0", "h0.1", "c0.1"]


def _lstm_reference(proto, feeds):
    """char_rnn computed in numpy from its own weights: the textbook LSTM cell."""
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in proto.graph.initializer}
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    h = [feeds["h0.0"].astype(np.float64), feeds["h0.1"].astype(np.float64)]
    c = [feeds["c0.0"].astype(np.float64), feeds["c0.1"].astype(np.float64)]
    emb = w["embed.weight"][feeds["tokens"][0]]
    for t in range(emb.shape[0]):
        x = emb[t][None]
        for layer in range(2):
            p = f"cells.{layer}."
            gates = x @ w[p + "weight_ih_t"] + w[p + "bias_ih"] + h[layer] @ w[p + "weight_hh_t"] + w[p + "bias_hh"]
            i, f, g, o = np.split(gates, 4, axis=1)
            c[layer] = sig(f) * c[layer] + sig(i) * np.tanh(g)
            h[layer] = sig(o) * np.tanh(c[layer])
            x = h[layer]
    return [x @ w["head.weight_t"] + w["head.bias"], h[0], c[0], h[1], c[1]]


def test_char_rnn_computes_an_lstm_with_unsaturated_states():
    proto = _by_name("char_rnn").load()
    rng = np.random.default_rng(7)
    feeds = {"tokens": rng.integers(0, 65, (1, 16)).astype(np.int64)}
    for layer in range(2):
        feeds[f"h0.{layer}"] = rng.uniform(-0.5, 0.5, (1, 128)).astype(np.float32)
        feeds[f"c0.{layer}"] = rng.uniform(-0.5, 0.5, (1, 128)).astype(np.float32)
    outputs = _run(proto, feeds)
    for got, want in zip(outputs, _lstm_reference(proto, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    hidden = outputs[1]
    assert np.abs(hidden).max() < 0.9 and hidden.std() > 0.02  # neither saturated nor dead


def _shape_chain_reshapes(proto) -> int:
    """Reshapes whose target is Concat(Unsqueeze(Gather(Shape(...))), ...), as torch exports view()."""
    producer = {o: n for n in proto.graph.node for o in n.output}

    def is_(name, op):
        return name in producer and producer[name].op_type == op

    count = 0
    for n in proto.graph.node:
        if n.op_type == "Reshape" and is_(n.input[1], "Concat"):
            parts = producer[n.input[1]].input
            if any(
                is_(p, "Unsqueeze") and is_(producer[p].input[0], "Gather") and is_(producer[producer[p].input[0]].input[0], "Shape")
                for p in parts
            ):
                count += 1
    return count


def test_gpt_stack_has_runtime_reshape_chains_symbolic_dims_and_the_gpt_block_ops():
    proto = _by_name("gpt_stack").load()
    ops = _ops(proto)
    assert _shape_chain_reshapes(proto) == 4 * 4  # q, k, v and the merged heads, per block
    assert ops["LayerNormalization"] == 4 * 2 + 1
    assert ops["Split"] == 4 and all(len(n.output) == 3 for n in proto.graph.node if n.op_type == "Split")
    assert ops["Softmax"] == 4 and ops["Pow"] == 4 and ops["Tanh"] == 4 and ops["Div"] == 4
    dims = [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq"]
    assert [d.dim_param for d in proto.graph.output[0].type.tensor_type.shape.dim][:2] == ["batch", "seq"]


def test_gpt_stack_runs_at_any_batch_and_sequence_and_is_causal():
    proto = _by_name("gpt_stack").load()
    rng = np.random.default_rng(3)
    session = make_session(proto, threads=1)
    for batch, seq in ((1, 1), (3, 64)):
        ids = rng.integers(0, 256, (batch, seq)).astype(np.int64)
        (logits,) = session.run(None, {"input_ids": ids})
        assert logits.shape == (batch, seq, 256)
        assert 0.3 < logits.std() < 5 and np.isfinite(logits).all()
    ids = rng.integers(0, 256, (2, 20)).astype(np.int64)
    changed = ids.copy()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    (a,) = session.run(None, {"input_ids": ids})
    (b,) = session.run(None, {"input_ids": changed})
    np.testing.assert_array_equal(a[:, :12], b[:, :12])  # earlier positions cannot see token 12
    assert np.abs(a[:, 12:] - b[:, 12:]).max() > 1e-3


def test_mobilenetv3_keeps_batchnorm_and_writes_hardswish_three_ways():
    proto = _by_name("mobilenetv3").load()
    ops = _ops(proto)
    producer = {o: n for n in proto.graph.node for o in n.output}
    convs = [n for n in proto.graph.node if n.op_type == "Conv"]
    se_convs = [n for n in convs if len(n.input) == 3]  # the squeeze-excite 1x1 convs have a bias
    assert ops["BatchNormalization"] == len(convs) - len(se_convs) > 20
    assert all(producer[n.input[0]].op_type == "Conv" for n in proto.graph.node if n.op_type == "BatchNormalization")
    assert ops["HardSwish"] >= 2  # the op

    def mul_of_x_and(op):  # Mul(x, op(x)): x * HardSigmoid(x)
        return sum(
            1 for n in proto.graph.node
            if n.op_type == "Mul" and n.input[1] in producer and producer[n.input[1]].op_type == op
            and producer[n.input[1]].input[0] == n.input[0]
        )

    assert mul_of_x_and("HardSigmoid") >= 2
    relu6_forms = [  # Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6)
        n for n in proto.graph.node
        if n.op_type == "Div" and producer[n.input[0]].op_type == "Mul"
        and producer[producer[n.input[0]].input[1]].op_type == "Clip"
    ]
    assert len(relu6_forms) >= 2
    assert ops["GlobalAveragePool"] == 6 + 1  # squeeze-excite blocks + the head
    groups = [a.i for n in convs for a in n.attribute if a.name == "group"]
    assert sum(g > 1 for g in groups) == 8  # one depthwise conv per inverted-residual block
    residuals = [  # Add(block output, block input): both computed, neither a constant
        n for n in proto.graph.node if n.op_type == "Add" and all(i in producer for i in n.input)
    ]
    assert len(residuals) == 4


def test_mlp_ensemble_is_eight_members_in_two_linear_forms():
    proto = _by_name("mlp_ensemble").load()
    ops = _ops(proto)
    assert ops["Gemm"] == 4 * 3 and ops["MatMul"] == 4 * 3 and ops["Relu"] == 8 * 2
    concat = next(n for n in proto.graph.node if n.op_type == "Concat")
    assert len(concat.input) == 8 and concat.output[0] == "scores"
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_generated_models_produce_sensible_activations():
    rng = np.random.default_rng(11)
    image = rng.standard_normal((2, 3, 64, 64)).astype(np.float32)
    (logits,) = _run(_by_name("mobilenetv3").load(), {"image": image})
    assert np.isfinite(logits).all() and 0.05 < logits.std() < 20
    x = rng.standard_normal((4, 64)).astype(np.float32)
    (scores,) = _run(_by_name("mlp_ensemble").load(), {"x": x})
    assert np.isfinite(scores).all() and 0.05 < scores.std() < 20


# Kernels per inference under onnxruntime alone (ORT_ENABLE_ALL, CPU, 1 thread) that the project
# states for these models (README.md, models/README.md, the StackedMLP figures); onnxruntime
# versions may shift them a little.
STATED_KERNELS = {"char_rnn": 435, "mlp_ensemble": 25}


@pytest.mark.parametrize("name", sorted(STATED_KERNELS))
def test_onnxruntime_kernel_count_is_near_the_stated_figure(name):
    model = _by_name(name)
    kernels, by_op = count_kernels(str(model.path), threads=1, dims=model.dims)
    stated = STATED_KERNELS[name]
    assert abs(kernels - stated) <= 0.05 * stated, f"{name}: {kernels} kernels ({by_op})"


# --------------------------------------------------------------------------- corpus (torch.onnx exports)

CORPUS = [m for m in MODELS if m.source == "corpus"]
CORPUS_FILE_LIMIT = 400_000  # bytes: graphs without weight values


def test_corpus_has_each_architecture_from_both_exporters():
    by_exporter: dict = {}
    for m in CORPUS:
        stem = m.name.rsplit("_", 1)[0]
        by_exporter.setdefault(m.exporter, set()).add(stem)
        assert m.name.endswith({"torchscript": "_ts", "dynamo": "_dynamo"}[m.exporter])
        assert m.family in ("transformer", "rnn", "cnn")
    assert by_exporter["torchscript"] == by_exporter["dynamo"]
    assert {"bert", "gpt2", "llama", "vit", "whisper_encoder", "t5_encoder", "resnet18", "mobilenet_v3_small",
            "efficientnet_b0", "shufflenet_v2", "convnext", "lstm", "gru"} <= by_exporter["dynamo"]


@pytest.mark.parametrize("model", CORPUS, ids=lambda m: m.name)
def test_corpus_model_is_stored_without_its_weights_and_declares_two_shape_sets(model):
    assert model.file.stat().st_size < CORPUS_FILE_LIMIT
    stored = onnx.load(str(model.file), load_external_data=False)
    opset = {o.domain: o.version for o in stored.opset_import}[""]
    assert opset == (17 if model.exporter == "torchscript" else 18)
    for t in stored.graph.initializer:
        size = int(np.prod(t.dims, dtype=np.int64))
        if zoo.is_seeded(t):
            continue
        # what stays verbatim: integers, small tensors, few distinct values, inf/NaN
        assert size <= zoo.SEEDED_MIN_ELEMENTS or t.data_type not in (onnx.TensorProto.FLOAT,) \
            or zoo.seeded_record(t, 0) is None, t.name
    assert any(zoo.is_seeded(t) for t in stored.graph.initializer)
    assert len(model.shape_sets) == 2 and model.shape_sets[0] != model.shape_sets[1]


def test_corpus_weights_are_regenerated_the_same_way_in_memory_and_on_disk():
    model = _by_name("bert_dynamo")
    loaded = model.load()
    assert not any(zoo.is_seeded(t) for t in loaded.graph.initializer)
    on_disk = onnx.load(zoo.resolve(model.uri))
    assert on_disk.SerializeToString() == loaded.SerializeToString()
    assert model.load().SerializeToString() == loaded.SerializeToString()
    stored = {t.name: t for t in onnx.load(str(model.file), load_external_data=False).graph.initializer}
    for t in loaded.graph.initializer:
        values = onnx.numpy_helper.to_array(t)
        record = {e.key: e.value for e in stored[t.name].external_data}
        if "fill" in record:
            assert np.all(values == np.float32(float(record["fill"]))), t.name
        elif "std" in record:
            assert abs(values.std() - float(record["std"])) < 0.1 * float(record["std"]) + 1e-6, t.name
            assert list(values.shape) == list(stored[t.name].dims)


def test_seeded_record_keeps_small_integer_and_masklike_tensors():
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((64, 128)).astype(np.float32), "w")
    ones = numpy_helper.from_array(np.ones(128, np.float32), "ln.weight")
    small = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "inv_freq")
    ids = numpy_helper.from_array(np.arange(128, dtype=np.int64), "position_ids")
    mask = numpy_helper.from_array(np.triu(np.full((16, 16), -np.inf, np.float32), 1), "causal")
    binary = numpy_helper.from_array((rng.random((16, 16)) < 0.5).astype(np.float32), "binary")
    record = zoo.seeded_record(weight, 7)
    assert zoo.is_seeded(record) and list(record.dims) == [64, 128] and not record.raw_data
    assert {e.key: e.value for e in zoo.seeded_record(ones, 1).external_data}["fill"] == "1.0"
    for kept in (small, ids, mask, binary):
        assert zoo.seeded_record(kept, 1) is None, kept.name
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [], initializer=[record]))
    (values,) = [numpy_helper.to_array(t) for t in zoo.materialize_weights(model).graph.initializer]
    assert values.shape == (64, 128) and values.dtype == np.float32
    original = numpy_helper.to_array(weight)
    assert abs(values.mean() - original.mean()) < 0.1 and abs(values.std() - original.std()) < 0.1


def test_corpus_model_runs_through_the_cli_as_zoo_uri(tmp_path, cli):
    out = tmp_path / "lstm.onnx"
    result = cli("optimize", "zoo:lstm_dynamo", out)
    assert result.exit_code == 0, result.stderr
    assert "verified" in result.stdout and out.is_file()
