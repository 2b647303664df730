"""Builds the native custom-op library (kernels/*.cc) with the package.

The library is an ordinary shared object that ONNX Runtime loads through
SessionOptions.register_custom_ops_library; it is built as a setuptools Extension
only so that `pip install .` and `pip install -e .` compile it with the package.
It needs g++ alone: no CUDA toolkit and no onnxruntime headers (the C API parts it
uses are declared in kernels/ort_api.h). The sources an sdist must carry for this
(kernels/*.cc, *.h, *.inc) are listed in MANIFEST.in; tests/test_packaging.py checks
the two agree.
"""
import glob
import re

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.install_lib import install_lib


class BuildPy(build_py):
    """build_py that byte-compiles only when asked (--compile, --optimize). A wheel needs no
    .pyc, and the stock command prints "byte-compiling is disabled" wherever
    PYTHONDONTWRITEBYTECODE is set, a warning about nothing."""

    def byte_compile(self, files):
        if self.compile or self.optimize:
            super().byte_compile(files)


class InstallLib(install_lib):
    """The same for the wheel's install_lib step (bdist_wheel turns compiling off)."""

    def byte_compile(self, files):
        if self.compile or self.optimize:
            return super().byte_compile(files)
        return []

with open("onnxfuse/version.py", encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

native = Extension(
    "onnxfuse._onnxfuse_ops",
    sources=sorted(glob.glob("kernels/*.cc")),
    depends=sorted(glob.glob("kernels/*.h") + glob.glob("kernels/*.inc")),
    include_dirs=["kernels"],
    language="c++",
    define_macros=[("ONNXFUSE_VERSION", f'"{VERSION}"')],
    extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno", "-fno-trapping-math", "-Wall"],
    # -s: a stripped library (about a tenth of the size with the interpreter's -g); the entry
    # points onnxruntime and `onnxfuse info` look up are dynamic symbols and stay.
    extra_link_args=["-ldl", "-lpthread", "-s"],
)

setup(ext_modules=[native], cmdclass={"build_py": BuildPy, "install_lib": InstallLib})
