"""The C emitter the CUDA generators write through (onnxfuse/cuda/emit.py), and the backend's
module-level expression tables (codegen.UNARY_MATH, codegen.EXPRESSIONS)."""
from __future__ import annotations

from onnxfuse.cuda import codegen
from onnxfuse.cuda.emit import CSource
from onnxfuse.program import OPS


def test_blocks_indent_their_bodies_and_close_with_their_end():
    src = CSource()
    src.line("#include <math.h>")
    with src.block("struct args", end="};"):
        src.line("float* y;")
    with src.block('extern "C" __global__ void k(const args a)'):
        src.constants({"ROWS": 4, "TILE": 32})
        src.decls([("b", "DIV(bid, H)"), ("h", "MOD(bid, H)")])
        src.pragma("unroll")
        with src.block("for (int c = 0; c < 4; ++c)", comment="one column a lane"):
            src.line("#define X 1", "a.y[c] = 0.0f;", "")
            with src.block(""):
                src.line("float v = 1.0f;")
        src.line("for (int i = 0; i < 2; ++i)")
        with src.indented():
            src.line("a.y[i] = 1.0f;")
    assert src.text() == "\n".join([
        "#include <math.h>",
        "struct args {", "  float* y;", "};",
        'extern "C" __global__ void k(const args a) {',
        "  constexpr int ROWS = 4, TILE = 32;",
        "  const auto b = DIV(bid, H);", "  const auto h = MOD(bid, H);",
        "#pragma unroll",
        "  for (int c = 0; c < 4; ++c) {  // one column a lane",
        "#define X 1", "    a.y[c] = 0.0f;", "",
        "    {", "      float v = 1.0f;", "    }",
        "  }",
        "  for (int i = 0; i < 2; ++i)", "    a.y[i] = 1.0f;",
        "}", ""])
    assert src.depth == 0


def test_a_block_left_by_an_exception_restores_the_depth():
    src = CSource()
    try:
        with src.block("if (x)"):
            raise RuntimeError
    except RuntimeError:
        pass
    assert src.depth == 0


def test_every_program_op_has_one_cuda_expression_in_the_module_tables():
    assert set(codegen.UNARY_MATH) | set(codegen.EXPRESSIONS) | {"cast"} == set(OPS)
    assert not set(codegen.UNARY_MATH) & set(codegen.EXPRESSIONS)
    assert codegen.instr_expr("exp", ["x"], (), "f32") == "expf(x)"
    assert codegen.instr_expr("exp", ["x"], (), "f64") == "exp(x)"
    assert codegen.instr_expr("selu", ["x"], (1.5, 2.0), "f32") == "(x <= (CT)0) ? 0x1.0000000000000p+1f * (0x1.8000000000000p+0f * (expf(x) - (CT)1)) : 0x1.0000000000000p+1f * x"
    assert codegen.instr_expr("where", ["c", "x", "y"], (), "f32") == "(c != (CT)0) ? x : y"
