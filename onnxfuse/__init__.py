"""onnxfuse: a graph optimizer for ONNX models that fuses launch-bound op chains."""

__version__ = "0.1.0"
