"""Builds the native custom-op library (kernels/*.cc) with the package.

The library is an ordinary shared object that ONNX Runtime loads through
SessionOptions.register_custom_ops_library; it is built as a setuptools Extension
only so that `pip install .` and `pip install -e .` compile it with the package.
It needs g++ alone: no CUDA toolkit and no onnxruntime headers (the C API parts it
uses are declared in kernels/ort_api.h).
"""
import glob

from setuptools import Extension, setup

native = Extension(
    "onnxfuse._onnxfuse_ops",
    sources=sorted(glob.glob("kernels/*.cc")),
    include_dirs=["kernels"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno", "-fno-trapping-math", "-Wall"],
    extra_link_args=["-ldl", "-lpthread"],
)

setup(ext_modules=[native])
