"""batch-shared-weight-matmul: one weight applied to independent inputs becomes one GEMM over
stacked rows; recurrent (dependent) applications and unpaying groups are left alone."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from test_pass_matmul_batch import assert_same, model, ops, optimize, rng_arrays

PASS = ["batch-shared-weight-matmul"]


def stacked_rnn_model(steps=5, batch=2, d=6, h=4, gemm=False):
    """A two-layer tanh RNN unrolled over `steps`: layer 2 reads layer 1's h1_t through W2
    (independent across steps) and its own h2_{t-1} through U2 (a chain)."""
    w1, u1, w2, u2, b2 = rng_arrays(0, (d, h), (h, h), (h, h), (h, h), (h,))
    nodes, outs = [], []
    h1, h2 = "h1_init", "h2_init"
    for t in range(steps):
        nodes += [helper.make_node("MatMul", [f"x{t}", "W1"], [f"a{t}"]),
                  helper.make_node("MatMul", [h1, "U1"], [f"r{t}"]),
                  helper.make_node("Add", [f"a{t}", f"r{t}"], [f"s{t}"]),
                  helper.make_node("Tanh", [f"s{t}"], [f"h1_{t}"])]
        h1 = f"h1_{t}"
        if gemm:
            nodes.append(helper.make_node("Gemm", [h1, "W2", "b2"], [f"p{t}b"]))
        else:
            nodes += [helper.make_node("MatMul", [h1, "W2"], [f"p{t}"]),
                      helper.make_node("Add", [f"p{t}", "b2"], [f"p{t}b"])]
        nodes += [helper.make_node("MatMul", [h2, "U2"], [f"q{t}"]),
                  helper.make_node("Add", [f"p{t}b", f"q{t}"], [f"z{t}"]),
                  helper.make_node("Tanh", [f"z{t}"], [f"h2_{t}"])]
        h2 = f"h2_{t}"
        outs.append((h2, [batch, h]))
    inputs = [(f"x{t}", [batch, d]) for t in range(steps)] + [("h1_init", [batch, h]), ("h2_init", [batch, h])]
    m = model(nodes, {"W1": w1, "U1": u1, "W2": w2, "U2": u2, "b2": b2}, inputs, outs)
    feeds = {name: np.random.default_rng(i).standard_normal(shape).astype(np.float32) for i, (name, shape) in enumerate(inputs)}
    return m, feeds


@pytest.mark.parametrize("gemm", [False, True])
def test_layer2_input_projections_become_one_matmul_and_compute_the_same(gemm):
    m, feeds = stacked_rnn_model(gemm=gemm)
    out, matches = optimize(m, PASS)
    # Both input projections are batched (W1 on the inputs x_t, W2 on layer 1's h1_t); the
    # recurrent U1 h1_{t-1} and U2 h2_{t-1} stay one per step.
    assert matches == 10
    kinds = ops(out)
    assert kinds.count("Concat") == 2 and kinds.count("Split") == 2
    assert kinds.count("MatMul") == 2 + 2 * 5 and "Gemm" not in kinds
    assert_same(m, out, [feeds])


def test_recurrent_projection_chain_is_left_alone():
    # h_t = tanh(h_{t-1} @ U): each application needs the previous one's output.
    (u,) = rng_arrays(1, (4, 4))
    nodes, h = [], "h0"
    for t in range(4):
        nodes += [helper.make_node("MatMul", [h, "U"], [f"m{t}"]), helper.make_node("Tanh", [f"m{t}"], [f"h{t + 1}"])]
        h = f"h{t + 1}"
    m = model(nodes, {"U": u}, [("h0", [2, 4])], [(h, [2, 4])])
    out, matches = optimize(m, PASS)
    assert matches == 0 and ops(out) == ops(m)


def test_two_applications_save_no_kernel_and_are_left_alone():
    (w,) = rng_arrays(2, (3, 5))
    nodes = [helper.make_node("MatMul", ["a", "W"], ["ya"]), helper.make_node("MatMul", ["b", "W"], ["yb"])]
    m = model(nodes, {"W": w}, [("a", [2, 3]), ("b", [2, 3])], [("ya", [2, 5]), ("yb", [2, 5])])
    assert optimize(m, PASS)[1] == 0


def test_dynamic_rows_are_left_alone():
    (w,) = rng_arrays(3, (3, 5))
    nodes = [helper.make_node("MatMul", [n, "W"], [f"y{n}"]) for n in "abc"]
    m = model(nodes, {"W": w}, [(n, ["B", 3]) for n in "abc"], [(f"y{n}", ["B", 5]) for n in "abc"])
    assert optimize(m, PASS)[1] == 0


def test_rows_above_the_limit_batch_only_a_prefix():
    from onnxfuse.passes.batch_shared_weight import MAX_ROWS

    rows = MAX_ROWS // 4
    (w,) = rng_arrays(4, (3, 5))
    names = [f"i{k}" for k in range(6)]
    nodes = [helper.make_node("MatMul", [n, "W"], [f"y{n}"]) for n in names]
    m = model(nodes, {"W": w}, [(n, [rows, 3]) for n in names], [(f"y{n}", [rows, 5]) for n in names])
    out, matches = optimize(m, PASS)
    assert matches == 4
    feeds = {n: np.random.default_rng(k).standard_normal((rows, 3)).astype(np.float32) for k, n in enumerate(names)}
    assert_same(m, out, [feeds])
