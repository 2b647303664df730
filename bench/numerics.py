"""Numerical agreement of every zoo model after onnxfuse with the original, in onnxruntime.

For each zoo model: optimize with the default CPU pipeline, run the original and the optimized
model (our custom-op library registered) on the same seeded inputs (the zoo's default sizes of
symbolic dimensions), and report per model the worst output's

  max abs error        max |opt - orig|
  max rel error        max |opt - orig| / |orig| over elements with orig != 0 (elementwise: it
                       grows without bound where an output crosses zero, so it is shown beside)
  normwise rel error   max |opt - orig| / max |orig|  (the error relative to the output's scale)

and, as a yardstick, the same three figures for onnxruntime against itself: the original model
under ORT_ENABLE_ALL vs under ORT_DISABLE_ALL (onnxruntime's own fusions, e.g. MatMul+Add into
Gemm, GELU into FastGelu, reorder sums exactly as ours do). Where that spread is as large as ours,
the figure measures float32 summation order, not a defect of a rewrite. Where onnxruntime can run
the model in float64 (no Conv), both float32 results are also compared with that float64 result:
the elementwise max rel error of the original's float32 run and of ours, against exact-ish values.

    python -m bench.numerics [--models a,b] [--seeds 3] [--out bench/results/numerics.md]
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from bench import harness


def _accumulate(worst: dict, prefix: str, got: np.ndarray, want: np.ndarray) -> None:
    """Fold one output's max abs / elementwise rel / normwise rel error into worst[prefix + ...]."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    d = np.abs(g - w)
    nz = w != 0
    worst[prefix + "abs"] = max(worst[prefix + "abs"], float(d.max()))
    worst[prefix + "rel"] = max(worst[prefix + "rel"], float((d[nz] / np.abs(w[nz])).max()) if nz.any() else 0.0)
    scale = float(np.abs(w).max())
    worst[prefix + "norm"] = max(worst[prefix + "norm"], float(d.max()) / scale if scale else 0.0)


def as_float64(model):
    """The model with every float32 tensor, type and Cast target turned into float64."""
    import onnx
    from onnx import TensorProto, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
    return m


def measure(name: str, seeds: int) -> dict:
    from onnxfuse import api, zoo
    from onnxfuse.runtime import make_session
    from onnxfuse.inputs import random_inputs

    zm = zoo.get(name)
    result = api.optimize(zm.uri, verify_outputs=False, count_kernels=False)
    original = zm.load()
    sess_a = make_session(original, threads=1, with_library=False)
    sess_b = make_session(result.model, threads=1)
    sess_c = make_session(original, threads=1, with_library=False, level="disable")
    worst = {"abs": 0.0, "rel": 0.0, "norm": 0.0, "ort_abs": 0.0, "ort_rel": 0.0, "ort_norm": 0.0}
    try:
        sess_d = make_session(as_float64(original), threads=1, with_library=False)
    except Exception:  # onnxruntime has no float64 kernel for some op (Conv): no exact reference
        sess_d = None
    else:
        worst.update({f"{who}64_{k}": 0.0 for who in ("ort", "ours") for k in ("abs", "rel", "norm")})
    for seed in range(seeds):
        feeds = random_inputs(original, zm.dims, seed=seed)
        want = sess_a.run(None, feeds)
        got = dict(zip([o.name for o in sess_b.get_outputs()], sess_b.run(None, feeds)))
        unoptimized = sess_c.run(None, feeds)
        exact = sess_d.run(None, {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}) \
            if sess_d is not None else [None] * len(want)
        for out, w, u, e in zip(sess_a.get_outputs(), want, unoptimized, exact):
            if w.size == 0 or w.dtype.kind != "f":
                continue
            _accumulate(worst, "", got[out.name], w)
            _accumulate(worst, "ort_", u, w)
            if e is not None:
                _accumulate(worst, "ort64_", w, e)
                _accumulate(worst, "ours64_", got[out.name], e)
    fused = sum(1 for n in result.model.graph.node if n.domain == "onnxfuse")
    return {"model": name, "fused": fused, **worst}


@harness.script(__doc__)
@click.option("--models", callback=harness.csv(), help="comma-separated zoo names (default: every zoo model)")
@click.option("--seeds", type=int, default=3, show_default=True, help="input draws per model")
@click.option("--out", type=click.Path(path_type=Path), default=harness.RESULTS / "numerics.md", show_default=True)
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    from onnxfuse import zoo

    models, seeds, out = args.models, args.seeds, args.out
    names = models or [m.name for m in zoo.list_models()]
    rows = []
    for name in names:
        r = measure(name, seeds)
        rows.append(r)
        harness.log(f"{name:14s} fused {r['fused']:3d}  max abs {r['abs']:.3g}  max rel {r['rel']:.3g}  normwise rel {r['norm']:.3g}"
              f"  | onnxruntime all vs none: max rel {r['ort_rel']:.3g}  normwise rel {r['ort_norm']:.3g}"
                    + (f"  | vs float64: original max rel {r['ort64_rel']:.3g}, ours {r['ours64_rel']:.3g}"
                       if "ort64_rel" in r else ""))
    lines = [
        *stamp.header("Numerical agreement of optimized zoo models with the originals"),
        "Original vs optimized (default CPU pipeline, onnxfuse library registered), onnxruntime CPU provider, "
        "1 thread, ORT_ENABLE_ALL, seeded random inputs (the zoo's default dims), worst output over "
        f"{seeds} draws. *max rel* is elementwise over nonzero reference elements (unbounded where "
        "an output crosses zero); *normwise rel* is max |error| / max |reference|, the relative error "
        "of the output as a vector (infinity norm). The last three columns are the yardstick: the "
        "original model under onnxruntime's own optimizations (ORT_ENABLE_ALL) against the same model "
        "unoptimized (ORT_DISABLE_ALL), measured the same way on the same inputs.",
        "",
        "| model | fused ops | max abs error | max rel error | normwise rel error "
        "| ORT all vs none: max abs | max rel | normwise rel |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['fused']} | {r['abs']:.3g} | {r['rel']:.3g} | {r['norm']:.3g} "
                     f"| {r['ort_abs']:.3g} | {r['ort_rel']:.3g} | {r['ort_norm']:.3g} |")
    exact_rows = [r for r in rows if "ort64_rel" in r]
    if exact_rows:
        lines += [
            "",
            "Against the model run in float64 by onnxruntime (where it can: no Conv), the float32 results of "
            "the original and of ours:",
            "",
            "| model | original f32: max rel | normwise rel | ours f32: max rel | normwise rel |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in exact_rows:
            lines.append(f"| {r['model']} | {r['ort64_rel']:.3g} | {r['ort64_norm']:.3g} "
                         f"| {r['ours64_rel']:.3g} | {r['ours64_norm']:.3g} |")
    harness.write_report(out, "\n".join(lines) + "\n", echo=False)
    harness.log(f"wrote {out}")
    return 0


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
