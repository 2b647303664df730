"""The graph passes, one module per pass (installed as onnxfuse.passes).

Each module defines PASS (or PASSES): an onnxfuse.pipeline.Pass with its name, its order in the
default pipeline, a one-line summary and run(graph, ctx) -> number of rewrites. A pass is a small
rule: what it matches, the condition under which it applies, what it writes. Fused ops are written
only through ctx.fuse(...), which also records the fallback function.
"""
