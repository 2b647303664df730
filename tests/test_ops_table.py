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


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_the_header_the_kernels_register_through_is_generated_from_the_table():
    from onnxfuse.ops import header

    assert header.HEADER.read_text() == header.render(), "kernels/fused_ops.h is stale: python -m onnxfuse.ops.header"
    assert header.main(["--check"]) == 0


def test_the_library_registers_each_op_with_the_signature_its_module_declares():
    info = library_info(library_path())
    for name, provider, inputs, outputs in info["signatures"]:
        op = ops.BY_NAME[name]
        assert tuple(inputs) == op.signature("inputs"), (name, provider)
        assert tuple(outputs) == op.signature("outputs"), (name, provider)
    assert len(info["signatures"]) == len(info["ops"])


def test_each_kernel_source_registers_its_op_through_the_header():
    # Every registration in kernels/*.cc is ONNXFUSE_REGISTER_FUSED_OP(NAME, PROVIDER, ...): the name and
    # signature come from the generated header; the file is the one the op's module names.
    import re

    found = set()
    for path in sorted((ROOT / "kernels").glob("*.cc")):
        text = path.read_text()
        assert "ONNXFUSE_REGISTER_OP(" not in text, f"{path.name}: a registration not built by fused_op<>"
        made = re.findall(r"ONNXFUSE_REGISTER_FUSED_OP\((\w+), k(Cpu|Cuda)Provider,", text)
        for name, provider in made:
            found.add((name, ops.CPU if provider == "Cpu" else ops.CUDA, f"kernels/{path.name}"))
    listed = {(op.name, p, src) for op in ops.FUSED_OPS for p, src in op.kernels.items()}
    assert found == listed


def test_each_op_lives_in_its_own_module_with_a_model_and_a_form():
    import importlib

    from onnxfuse.pipeline import all_passes

    passes = {p.name for p in all_passes()}
    modules = set()
    for op in ops.FUSED_OPS:
        assert op.reference is not None and op.form is not None, op.name
        module = op.reference.__module__
        assert module.startswith("onnxfuse.ops.") and importlib.import_module(module).OP is op
        modules.add(module)
        assert op.pass_name in passes, op.name
        if op.cuda_generator:
            importlib.import_module(op.cuda_generator)
        assert op.domain == "onnxfuse" and op.since_version == 1
    assert len(modules) == len(ops.FUSED_OPS)


def test_cuda_compile_generates_a_kernel_for_each_op_whose_module_names_a_generator():
    from onnxfuse.passes import cuda_compile

    spec_kernels = {name: gen.__module__ for name, (_, gen) in cuda_compile.SPEC_KERNELS.items()}
    # Pointwise's kernel is generated from its program in cuda-compile itself, ConvBiasAct's by
    # its pass (the tile is chosen with the layer); the others from a spec read off the node.
    expected = {op.name: op.cuda_generator for op in ops.FUSED_OPS
                if op.cuda_generator and op.name not in ("Pointwise", "ConvBiasAct")}
    assert spec_kernels == expected


def test_each_op_is_written_on_every_target_with_a_kernel_of_it():
    from onnxfuse.pipeline import all_passes

    by_name = {p.name: p for p in all_passes()}
    for op in ops.FUSED_OPS:
        assert op.targets and set(op.targets) <= set(by_name[op.pass_name].targets), op.name
    assert by_name["conv-bias-act"].targets == ("cuda",)
    assert by_name["channel-shuffle"].targets == by_name["squeeze-excite"].targets == ("cpu", "cuda")
