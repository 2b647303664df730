"""Rewrite models/baseline.json: kernels per inference of every zoo model, before and after onnxfuse.

    python models/update_baseline.py              # every model
    python models/update_baseline.py gpt_stack    # only the named ones (the others are kept)

For each model: the default CPU pipeline, verified against the original in onnxruntime,
then kernels per inference counted with onnxruntime's profiler (ORT_ENABLE_ALL, CPU provider,
1 thread): "ort" is the original model under onnxruntime alone, "onnxfuse" the optimized one
with our library. tests/test_zoo.py fails when a model runs more or fewer kernels than recorded
here, on a machine with the same NCHWc block (see below). A corpus model that onnxfuse cannot optimize yet (a known failure, marked in
tests/test_zoo.py) is recorded with "onnxfuse": null; for the other zoo models a failure stops
the rewrite.

"nodes" is the number of nodes of the optimized graph: what onnxfuse writes does not depend on
the CPU, so tests/test_zoo.py checks it on every machine. The kernel counts of a model with a
convolution or pool do depend on it (onnxruntime's NCHWc layout: MLAS's channel block is 8 with
AVX2, 16 with AVX-512): they are recorded for the block in "nchwc_block"; run on a machine with
another block, this script records them under the model's "at_block" instead, and the suite
compares a machine's counts with onnxruntime alone there where no counts of its block are
recorded.
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
from onnxfuse.runtime import nchwc_block


def _format(doc: dict) -> str:
    """JSON with one line per model, so that a baseline change is a one-line diff."""
    lines = ["{"]
    for key in ("about", "onnxruntime", "nchwc_block"):
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
    block = nchwc_block()
    recorded_block = baseline.get("nchwc_block", block)

    def record(name: str, entry: dict, dependent: bool) -> None:
        old = counts.get(name, {})
        if block != recorded_block and dependent:  # counts of another block: kept beside the entry's
            new = dict(old) if old else {"ort": entry["ort"], "onnxfuse": entry["onnxfuse"]}
            new["at_block"] = {**old.get("at_block", {}), str(block): {"ort": entry["ort"], "onnxfuse": entry["onnxfuse"]}}
            if "nodes" in entry:
                new["nodes"] = entry["nodes"]
            counts[name] = new
        else:
            counts[name] = {**entry, **({"at_block": old["at_block"]} if "at_block" in old else {})}

    for model in models:
        t0 = time.perf_counter()
        try:
            result = optimize_for_baseline(model)
            summary = result.summary
        except VerificationError as e:
            if model.source != "corpus":
                raise
            original = model.load()
            ort, _ = count_kernels(original, threads=1, dims=model.dims or None)
            record(model.name, {"ort": ort, "onnxfuse": None}, zoo.layout_dependent(original))
            print(f"{model.name:14s} ort {ort:5d}  onnxfuse fails: {str(e)[:160]}", file=sys.stderr)
            continue
        record(model.name, {"ort": summary["kernels_before"], "onnxfuse": summary["kernels_after"],
                            "nodes": len(result.model.graph.node)},
               zoo.layout_dependent(model.load(), result.model))
        print(
            f"{model.name:14s} ort {summary['kernels_before']:5d}  onnxfuse {summary['kernels_after']:5d}"
            f"  ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
        )
    known = zoo.names()
    doc = {
        "about": "Kernels per inference (onnxruntime profiler, ORT_ENABLE_ALL, CPU provider, 1 thread, "
        "symbolic dims = the zoo defaults): ort = original model, onnxfuse = after the default CPU "
        "pipeline, measured where onnxruntime's NCHWc block is nchwc_block (at_block: counts of a model "
        "with convolutions or pools at another block); nodes = nodes of the optimized graph (the same "
        "on every CPU). Rewrite with: python models/update_baseline.py [NAME...]",
        "onnxruntime": onnxruntime.__version__,
        "nchwc_block": recorded_block,
        "models": {name: counts[name] for name in known if name in counts},
    }
    zoo.baseline_path().write_text(_format(doc))
    print(f"wrote {zoo.baseline_path()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    main()
