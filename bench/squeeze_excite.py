"""onnxfuse.SqueezeExcite against onnxruntime's own execution of the block, and of whole models.

    python -m bench.squeeze_excite                       # the block shapes of the corpus CNNs
    python -m bench.squeeze_excite --models efficientnet_b0_ts,mobilenet_v3_small_ts

Each pair (the original, and the same graph after the squeeze-excite pass or the default
pipeline) runs in one thread, interleaved round by round (the order alternating), each round
timing a few inferences by thread CPU time; the ratio is the median over rounds of
optimized / original. CPU provider, ORT_ENABLE_ALL.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import zoo
from onnxfuse.api import optimize_for_baseline
from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes
from onnxfuse.runtime import make_session

# (channels, squeezed channels, image side, hidden activation, gate, SiLU before the block):
# MobileNetV3-small's and EfficientNet-B0's largest and smallest blocks at 64x64 inputs.
BLOCKS = [(96, 24, 16, "Relu", "HardSigmoid", False), (576, 144, 2, "Relu", "HardSigmoid", False),
          (144, 6, 16, "silu", "Sigmoid", True), (1152, 48, 2, "silu", "Sigmoid", True)]


def block_model(c: int, r: int, side: int, hidden: str, gate: str, input_silu: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def silu(v, tag):
        nodes.append(helper.make_node("Sigmoid", [v], [f"{tag}_s"]))
        nodes.append(helper.make_node("Mul", [v, f"{tag}_s"], [f"{tag}_y"]))
        return f"{tag}_y"

    x = silu("X", "in") if input_silu else "X"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["m"]))
    nodes.append(helper.make_node("Conv", ["m", const("w1", rng.standard_normal((r, c, 1, 1)) * 0.1),
                                           const("b1", rng.standard_normal(r) * 0.1)], ["h"]))
    if hidden == "silu":
        a = silu("h", "hid")
    else:
        nodes.append(helper.make_node(hidden, ["h"], ["a"]))
        a = "a"
    nodes.append(helper.make_node("Conv", [a, const("w2", rng.standard_normal((c, r, 1, 1)) * 0.1),
                                           const("b2", rng.standard_normal(c) * 0.1)], ["z"]))
    nodes.append(helper.make_node(gate, ["z"], ["g"]))
    nodes.append(helper.make_node("Mul", [x, "g"], ["Y"]))
    graph = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, c, side, side])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, c, side, side])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def fused_block(model: onnx.ModelProto) -> onnx.ModelProto:
    ctx = Context(target="cpu", options=PassOptions.from_mapping({}))
    out, _ = run_passes(model, select_passes(["squeeze-excite"], "cpu"), ctx)
    return out


def time_pair(a: onnx.ModelProto, b: onnx.ModelProto, rounds: int, per_round: int = 5) -> tuple[float, float, float]:
    """(median ms of a, median ms of b, median per-round ratio b / a), thread CPU time."""
    sa, sb = make_session(a, threads=1), make_session(b, threads=1)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)
             for i in sa.get_inputs()}

    def timed(s):
        t0 = time.thread_time()
        for _ in range(per_round):
            s.run(None, feeds)
        return (time.thread_time() - t0) / per_round

    for s in (sa, sb):
        timed(s)
    ta, tb = [], []
    for r in range(rounds):
        if r % 2:
            ta.append(timed(sa))
            tb.append(timed(sb))
        else:
            tb.append(timed(sb))
            ta.append(timed(sa))
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3, statistics.median(y / x for x, y in zip(ta, tb))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="zoo models to time whole (comma-separated)")
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    print("| block | onnxruntime ms | SqueezeExcite ms | ratio |\n|---|---|---|---|")
    for spec in BLOCKS:
        m = block_model(*spec)
        a, b, ratio = time_pair(m, fused_block(m), args.rounds)
        c, r, side, hidden, gate, silu = spec
        name = f"C={c} R={r} {side}x{side} {hidden}/{gate}" + (" + SiLU in" if silu else "")
        print(f"| {name} | {a:.3f} | {b:.3f} | {ratio:.3f} |")
    if args.models:
        print("\n| model | kernels | onnxruntime ms | onnxfuse ms | ratio |\n|---|---|---|---|---|")
        for name in args.models.split(","):
            entry = zoo.get(name)
            result = optimize_for_baseline(entry)
            a, b, ratio = time_pair(entry.load(), result.model, max(20, args.rounds // 3))
            kernels = f"{result.summary['kernels_before']} -> {result.summary['kernels_after']}"
            print(f"| {name} | {kernels} | {a:.3f} | {b:.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
