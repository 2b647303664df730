"""embedding-lookups: a position-embedding Gather by ids sliced from an arange buffer becomes a
Slice of the table, and a lookup by ids that are all one index becomes a constant row; lookups
whose ids are not proved, or whose result's shape a reader needs, are left alone."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from test_pass_matmul_batch import assert_same, ops, optimize

PASS = ["embedding-lookups"]
ROWS, HIDDEN = 8, 4


def embeddings_model(positions=None, token_types=None, reader="Add", slice_axis=1, table_rows=ROWS):
    """BERT's embeddings as the dynamo exporter writes them: word rows + token type rows (ids
    gathered from a registered buffer, expanded to [batch, seq]) + position rows (ids sliced
    `[:, :seq]` from a registered buffer)."""
    r = np.random.default_rng(0)
    positions = np.arange(ROWS, dtype=np.int64)[None] if positions is None else positions
    token_types = np.zeros((1, ROWS), np.int64) if token_types is None else token_types
    inits = [
        numpy_helper.from_array(r.standard_normal((20, HIDDEN)).astype(np.float32), "word"),
        numpy_helper.from_array(r.standard_normal((2, HIDDEN)).astype(np.float32), "token_type"),
        numpy_helper.from_array(r.standard_normal((table_rows, HIDDEN)).astype(np.float32), "position"),
        numpy_helper.from_array(positions, "position_ids"),
        numpy_helper.from_array(token_types, "token_type_ids"),
        numpy_helper.from_array(np.asarray([0], np.int64), "zero"),
        numpy_helper.from_array(np.asarray([slice_axis], np.int64), "slice_axis"),
        numpy_helper.from_array(np.asarray([1], np.int64), "one"),
    ]
    nodes = [
        helper.make_node("Shape", ["ids"], ["batch"], start=0, end=1),
        helper.make_node("Shape", ["ids"], ["seq"], start=1, end=2),
        helper.make_node("Slice", ["position_ids", "zero", "seq", "slice_axis", "one"], ["pos_ids"]),
        helper.make_node("GatherElements", ["token_type_ids", "pos_ids"], ["tt_row"], axis=1),
        helper.make_node("Concat", ["batch", "seq"], ["bs"], axis=0),
        helper.make_node("Expand", ["tt_row", "bs"], ["tt_ids"]),
        helper.make_node("Gather", ["word", "ids"], ["word_rows"]),
        helper.make_node("Gather", ["token_type", "tt_ids"], ["tt_rows"]),
        helper.make_node("Gather", ["position", "pos_ids"], ["pos_rows"]),
    ]
    if reader == "Add":
        nodes += [helper.make_node("Add", ["word_rows", "tt_rows"], ["s"]),
                  helper.make_node("Add", ["s", "pos_rows"], ["out"])]
        outs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "s", HIDDEN])]
    else:  # the lookups are outputs of their own: their shapes are what the caller sees
        nodes += [helper.make_node("Identity", ["tt_rows"], ["tt_out"]),
                  helper.make_node("Identity", ["pos_rows"], ["pos_out"])]
        outs = [helper.make_tensor_value_info("tt_out", TensorProto.FLOAT, ["b", "s", HIDDEN]),
                helper.make_tensor_value_info("pos_out", TensorProto.FLOAT, [1, "s", HIDDEN])]
    g = helper.make_graph(nodes, "embeddings", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                          outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return m


def feeds(batch, seq):
    return {"ids": np.random.default_rng(seq).integers(0, 20, (batch, seq)).astype(np.int64)}


def test_position_and_token_type_lookups_need_no_gather_and_compute_the_same():
    m = embeddings_model()
    out, matches = optimize(m, PASS)
    assert matches == 2
    kinds = ops(out)
    # the word lookup stays; the token type ids' GatherElements, Expand and Concat go with theirs
    assert kinds.count("Gather") == 1 and "GatherElements" not in kinds and "Expand" not in kinds
    assert "Concat" not in kinds
    slices = [n for n in out.graph.node if n.op_type == "Slice"]
    assert [n.input[0] for n in slices] == ["position"]
    assert_same(m, out, [feeds(2, 5), feeds(1, ROWS), feeds(3, 1)])


def test_a_token_type_buffer_of_another_constant_index_reads_that_row():
    m = embeddings_model(token_types=np.ones((1, ROWS), np.int64))
    out, matches = optimize(m, PASS)
    assert matches == 2
    assert_same(m, out, [feeds(2, 5)])


def test_ids_that_are_not_all_one_index_or_not_an_arange_keep_their_gathers():
    token_types = np.zeros((1, ROWS), np.int64)
    token_types[0, 3] = 1
    positions = np.arange(ROWS, dtype=np.int64)[None][:, ::-1].copy()
    m = embeddings_model(positions=positions, token_types=token_types)
    out, matches = optimize(m, PASS)
    assert matches == 0 and ops(out).count("Gather") == 3
    assert_same(m, out, [feeds(2, 5)])


def test_a_table_with_more_rows_than_the_position_buffer_keeps_its_gather():
    # Slice bounds clamp to the buffer's length, not the table's: a longer sequence would differ.
    out, matches = optimize(embeddings_model(table_rows=ROWS + 4), PASS)
    assert matches == 1 and ops(out).count("Gather") == 2


def test_a_slice_on_another_axis_keeps_its_gather():
    out, matches = optimize(embeddings_model(slice_axis=0), PASS)
    assert ops(out).count("Gather") >= 2 and "position" not in [n.input[0] for n in out.graph.node if n.op_type == "Slice"]


def test_lookups_whose_shape_is_seen_by_a_non_broadcasting_reader_are_left_alone():
    m = embeddings_model(reader="Identity")  # (the word lookup is not read: it goes)
    out, matches = optimize(m, PASS)
    assert matches == 0 and ops(out).count("Gather") == 2 and "GatherElements" in ops(out)


def test_in_the_default_pipeline_only_the_word_lookup_and_the_position_rows_slice_remain():
    m = embeddings_model()
    out, _ = optimize(m, None)
    kinds = ops(out)
    assert kinds.count("Gather") == 1 and kinds.count("Slice") == 1, kinds
    assert not {"GatherElements", "Expand", "Concat"} & set(kinds), kinds
    from onnxfuse.runtime import make_session

    for f in (feeds(2, 5), feeds(1, 1)):
        got = make_session(out).run(None, f)[0]
        want = make_session(m).run(None, f)[0]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_explain_says_why_each_lookup_keeps_its_gather():
    from onnxfuse.api import optimize as optimize_model
    from onnxfuse.optimize_options import OptimizeOptions

    token_types = np.zeros((1, ROWS), np.int64)
    token_types[0, 3] = 1
    positions = np.arange(ROWS, dtype=np.int64)[None][:, ::-1].copy()
    m = embeddings_model(positions=positions, token_types=token_types)
    result = optimize_model(m, settings=OptimizeOptions(passes=tuple(PASS), explain=tuple(PASS), verify=False,
                                                        count_kernels=False))
    said = [r for rs in result.summary["unmatched"]["embedding-lookups"].values() for r in rs]
    # the position lookup: both rules' patterns match it, each says why
    assert (f"position-ids-as-slice: the ids are not 0..{ROWS - 1}; uniform-index-lookup: the ids are not provably"
            " one index within the table's rows") in said
    assert "the ids are not provably one index within the table's rows" in said
