"""Fuzz seeds 12306, 16375, 20841: onnxruntime runs float16 ops that lack a CPU float16 kernel in
float32, inserting Casts around them, then drops the Casts next to ops that take any type, such
as onnxfuse.Pointwise. An input or output the program declares float16 then arrives, or is
expected, as float32; the kernel loads and stores it by its actual type."""
import pytest

from onnxfuse.fuzz import check_case


@pytest.mark.parametrize("seed", [12306, 16375, 20841])
def test_float16_program_values_passed_as_float32_by_onnxruntime(seed):
    assert check_case(seed) is None
