"""Shared helpers for the zoo generator scripts in models/.

Each generator script (char_rnn.py, gpt_stack.py, ...) defines build() -> onnx.ModelProto and
calls run_main(); `python models/NAME.py` rewrites models/NAME.onnx. Generation is deterministic
(seeded numpy, no timestamps), so running a script again reproduces the committed bytes.
"""
from __future__ import annotations

from pathlib import Path

import click
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
OPSET = 17
# What torch.onnx writes for opset 17 (IR 8); onnxruntime 1.31 accepts IR <= 13 and onnx 1.23
# would otherwise stamp IR 14.
IR_VERSION = 8
PRODUCER = "onnxfuse-zoo"


class GraphBuilder:
    """Collects nodes and initializers with exporter-style unique names."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counts: dict[str, int] = {}
        self._consts: dict[tuple, str] = {}

    def _name(self, op_type: str) -> str:
        n = self._counts.get(op_type, 0)
        self._counts[op_type] = n + 1
        return f"/{op_type}_{n}"

    def op(self, op_type: str, inputs, n_out: int = 1, name: str | None = None, outputs=None, **attrs):
        """Appends one node; returns its output name (or a list when n_out > 1).
        outputs: explicit output names (graph outputs); otherwise derived from the node name."""
        name = name or self._name(op_type)
        outputs = list(outputs or [f"{name}_output_{i}" for i in range(n_out)])
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=name, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.array(array, order="C"), name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A constant tensor as an initializer, shared between identical values (as torch's
        constant folding deduplicates them)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(f"onnx::Const_{len(self._consts)}", array)
        return self._consts[key]

    def uniform(self, shape, bound: float) -> np.ndarray:
        return self.rng.uniform(-bound, bound, size=shape).astype(np.float32)

    def normal(self, shape, std: float) -> np.ndarray:
        return (self.rng.standard_normal(size=shape) * std).astype(np.float32)

    def model(self, graph_name: str, inputs, outputs, doc: str, opset: int = OPSET) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, graph_name, inputs, outputs, self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            producer_name=PRODUCER,
            doc_string=doc,
        )
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model, full_check=True)
        return model


def tensor(name: str, elem_type: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64


def run_main(build, name: str) -> None:
    """Command line of every generator: writes the model to models/NAME.onnx or --out."""

    @click.command(help=f"Generate the {name} zoo model.")
    @click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=HERE / f"{name}.onnx",
                  show_default=True, help="output path")
    def generate(out: Path) -> None:
        model = build()
        onnx.save(model, str(out))
        click.echo(f"wrote {out} ({out.stat().st_size} bytes, {len(model.graph.node)} nodes)", err=True)

    generate()
