"""mlp_ensemble: eight independent 3-layer MLPs on one input, outputs concatenated; dynamic batch.

Each member is Linear(64, 128) -> ReLU -> Linear(128, 128) -> ReLU -> Linear(128, 10). Members
0-3 are written as torch.onnx.export writes nn.Linear on a 2-D input (Gemm with transB=1);
members 4-7 as it writes a `x @ W.T + b` module (MatMul on the folded transposed weight, then
Add). Eight small independent chains: a graph whose cost is kernel launches, not FLOPs.

Regenerate: python models/mlp_ensemble.py   (deterministic: seeded numpy)
"""
from __future__ import annotations

import numpy as np

from onnxfuse.models._build import FLOAT, GraphBuilder, run_main, tensor

NAME = "mlp_ensemble"
MEMBERS = 8
IN = 64
HIDDEN = 128
CLASSES = 10
SEED = 20240604


def build():
    b = GraphBuilder(SEED)
    widths = [IN, HIDDEN, HIDDEN, CLASSES]
    outs = []
    for m in range(MEMBERS):
        x = "x"
        for layer in range(3):
            fan_in, fan_out = widths[layer], widths[layer + 1]
            # nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)); ReLU layers get He
            # scaling so activations keep their range through the stack.
            bound = np.sqrt(6.0 / fan_in) if layer < 2 else 1.0 / np.sqrt(fan_in)
            w = b.uniform((fan_out, fan_in), bound)
            bias = b.weight(f"members.{m}.{layer}.bias", b.uniform((fan_out,), 1.0 / np.sqrt(fan_in)))
            scope = f"/members.{m}/layer{layer}"
            if m < MEMBERS // 2:
                weight = b.weight(f"members.{m}.{layer}.weight", w)
                x = b.op("Gemm", [x, weight, bias], alpha=1.0, beta=1.0, transB=1, name=f"{scope}/Gemm")
            else:
                weight = b.weight(f"members.{m}.{layer}.weight_t", w.T)
                x = b.op("MatMul", [x, weight], name=f"{scope}/MatMul")
                x = b.op("Add", [x, bias], name=f"{scope}/Add")
            if layer < 2:
                x = b.op("Relu", [x], name=f"{scope}/Relu")
        outs.append(x)
    b.op("Concat", outs, axis=1, name="/Concat", outputs=["scores"])
    return b.model(
        NAME,
        [tensor("x", FLOAT, ["batch", IN])],
        [tensor("scores", FLOAT, ["batch", MEMBERS * CLASSES])],
        doc=__doc__.strip().splitlines()[0],
    )


if __name__ == "__main__":
    run_main(build, NAME)
