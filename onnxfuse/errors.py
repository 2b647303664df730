"""The exception for bad input, in a module of its own that imports nothing: the command line
catches it without loading onnx, so that errors found before any work are told at once."""


class InputError(Exception):
    """Bad input (a model file, an option value): the message is one line for the user."""
