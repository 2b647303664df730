"""onnxfuse.ops' table is the one list of fused ops, and it agrees with the native library."""
from __future__ import annotations

import onnx
from onnx import helper

from onnxfuse import ops
from onnxfuse.environment import library_info
from onnxfuse.fused import DOMAIN
from onnxfuse.runtime import CUDA_KERNELS, library_path, needs_library


def test_table_lists_exactly_the_ops_the_library_registers_on_each_provider():
    registered = {tuple(pair) for pair in library_info(library_path())["ops"]}
    listed = {(op.name, provider) for op in ops.FUSED_OPS for provider in op.providers}
    assert registered == listed, (
        f"only in the library: {sorted(registered - listed)}; only in onnxfuse.ops: {sorted(listed - registered)}"
    )


def test_runtime_cuda_kernels_are_the_tables_cuda_ops():
    assert CUDA_KERNELS == {op.name for op in ops.FUSED_OPS if ops.CUDA in op.providers}


def _model_with_fused_node(op_type: str, cuda_entry: bool) -> onnx.ModelProto:
    attrs = {"cuda_entry": "k"} if cuda_entry else {}
    node = helper.make_node(op_type, ["x"], ["y"], domain=DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 2, 2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 2, 2])],
    )
    return helper.make_model(graph)


def test_a_cpu_target_node_of_every_cuda_op_keeps_the_library_off_the_cuda_provider():
    # A node written for --target cpu has no compiled kernel: registering the library on the CUDA
    # provider would bind our CUDA kernel to it and fail at session creation, so the fallback
    # functions must run instead. SqueezeExcite was missing from the hand-written list.
    for name in sorted(CUDA_KERNELS):
        assert not needs_library(_model_with_fused_node(name, cuda_entry=False), "cuda"), name
        assert needs_library(_model_with_fused_node(name, cuda_entry=True), "cuda"), name
        assert needs_library(_model_with_fused_node(name, cuda_entry=False), "cpu"), name


def test_no_pass_compares_the_target_with_a_string():
    # Passes ask the Target what its kernels can do (onnxfuse/target.py); a name compared in a pass
    # is a decision the next target would have to find by reading every pass.
    import re
    from pathlib import Path

    compare = re.compile(r"""target(\.name)?\s*(==|!=|\bin\b|\bnot in\b)\s*[("']""")
    found = []
    for path in sorted((Path(__file__).resolve().parent.parent / "passes").glob("*.py")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if compare.search(line):
                found.append(f"{path.name}:{no}: {line.strip()}")
    assert not found, "\n".join(found)


def test_target_capabilities_follow_the_ops_table():
    from onnxfuse.target import Target

    cpu, cuda = Target("cpu"), Target("cuda", "sm_90")
    assert cpu.has_kernel("StackedMLP") and not cuda.has_kernel("StackedMLP")
    assert cuda.has_kernel("ConvBiasAct") and not cpu.has_kernel("ConvBiasAct")
    assert not cpu.has_kernel("NoSuchOp")
    assert cuda.compiles_kernels and not cpu.compiles_kernels
    assert cpu.float32_group_query_attention and not cuda.float32_group_query_attention
