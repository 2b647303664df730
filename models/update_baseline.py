"""Rewrite models/baseline.json: kernels per inference of every zoo model, before and after onnxfuse.

    python models/update_baseline.py              # every model
    python models/update_baseline.py gpt_stack    # only the named ones (the others are kept)

For each model: the default CPU pipeline, verified against the original in onnxruntime,
then kernels per inference counted with onnxruntime's profiler (ORT_ENABLE_ALL, CPU provider,
1 thread): "ort" is the original model under onnxruntime alone, "onnxfuse" the optimized one
with our library. tests/test_zoo.py fails when a model runs more or fewer kernels than recorded
here. A corpus model that onnxfuse cannot optimize yet (a known failure, marked in
tests/test_zoo.py) is recorded with "onnxfuse": null; for the other zoo models a failure stops
the rewrite.
"""
from __future__ import annotations

import json
import sys
import time

import click
import onnxruntime

from onnxfuse import zoo
from onnxfuse.api import VerificationError, optimize_for_baseline
from onnxfuse.profile import count_kernels


def _format(doc: dict) -> str:
    """JSON with one line per model, so that a baseline change is a one-line diff."""
    lines = ["{"]
    for key in ("about", "onnxruntime"):
        lines.append(f"  {json.dumps(key)}: {json.dumps(doc[key])},")
    lines.append('  "models": {')
    items = list(doc["models"].items())
    for i, (name, counts) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        lines.append(f"    {json.dumps(name)}: {json.dumps(counts)}{comma}")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


@click.command(help=__doc__.splitlines()[0] + "\n\nNAMES: the zoo models to re-measure (default: all).")
@click.argument("names", nargs=-1)
def main(names: tuple[str, ...]) -> int:
    models = [zoo.get(n) for n in names] if names else zoo.list_models()
    baseline = zoo.load_baseline()
    counts = dict(baseline.get("models", {}))
    for model in models:
        t0 = time.perf_counter()
        try:
            summary = optimize_for_baseline(model).summary
        except VerificationError as e:
            if model.source != "corpus":
                raise
            ort, _ = count_kernels(model.load(), threads=1, dims=model.dims or None)
            counts[model.name] = {"ort": ort, "onnxfuse": None}
            print(f"{model.name:14s} ort {ort:5d}  onnxfuse fails: {str(e)[:160]}", file=sys.stderr)
            continue
        counts[model.name] = {"ort": summary["kernels_before"], "onnxfuse": summary["kernels_after"]}
        print(
            f"{model.name:14s} ort {summary['kernels_before']:5d}  onnxfuse {summary['kernels_after']:5d}"
            f"  ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
        )
    known = zoo.names()
    doc = {
        "about": "Kernels per inference (onnxruntime profiler, ORT_ENABLE_ALL, CPU provider, 1 thread, "
        "symbolic dims = the zoo defaults): ort = original model, onnxfuse = after the default CPU "
        "pipeline. Rewrite with: python models/update_baseline.py [NAME...]",
        "onnxruntime": onnxruntime.__version__,
        "models": {name: counts[name] for name in known if name in counts},
    }
    zoo.baseline_path().write_text(_format(doc))
    print(f"wrote {zoo.baseline_path()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    main()
