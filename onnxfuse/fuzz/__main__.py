"""`python -m onnxfuse.fuzz ARGS` is `onnxfuse fuzz ARGS`."""
import sys

from ..cli import main

main(["fuzz", *sys.argv[1:]])
