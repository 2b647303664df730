"""`python -m onnxfuse ...`: the `onnxfuse` command."""
from .cli import main

main(prog_name="onnxfuse")
