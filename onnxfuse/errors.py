"""The exceptions the command line tells apart, in a module of its own that imports nothing: it
catches them without loading onnx (or the CUDA toolchain's module), so that errors found before
any work are told at once."""


class InputError(Exception):
    """Bad input (a model file, an option value): the message is one line for the user."""


class CompileError(RuntimeError):
    """The CUDA toolchain is missing or rejected a kernel (onnxfuse.cuda.compile)."""
