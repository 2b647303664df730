"""Numerical agreement of every zoo model after onnxfuse with the original, in onnxruntime.

For each zoo model: optimize with the default CPU pipeline, run the original and the optimized
model (our custom-op library registered) on the same seeded inputs (the zoo's default sizes of
symbolic dimensions), and report per model the worst output's

  max abs error        max |opt - orig|
  max rel error        max |opt - orig| / |orig| over elements with orig != 0 (elementwise: it
                       grows without bound where an output crosses zero, so it is shown beside)
  normwise rel error   max |opt - orig| / max |orig|  (the error relative to the output's scale)

    python bench/numerics.py [--models a,b] [--seeds 3] [--out bench/results/numerics.md]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def measure(name: str, seeds: int) -> dict:
    from onnxfuse import api, zoo
    from onnxfuse.runtime import make_session
    from onnxfuse.verify import random_inputs

    zm = zoo.get(name)
    result = api.optimize(zm.uri, verify_outputs=False, count_kernels=False)
    original = zm.load()
    sess_a = make_session(original, threads=1, with_library=False)
    sess_b = make_session(result.model, threads=1)
    worst = {"abs": 0.0, "rel": 0.0, "norm": 0.0}
    for seed in range(seeds):
        feeds = random_inputs(original, zm.dims, seed=seed)
        want = sess_a.run(None, feeds)
        got = dict(zip([o.name for o in sess_b.get_outputs()], sess_b.run(None, feeds)))
        for out, w in zip(sess_a.get_outputs(), want):
            g, w = got[out.name].astype(np.float64), np.asarray(w, np.float64)
            if w.size == 0 or w.dtype.kind != "f":
                continue
            d = np.abs(g - w)
            nz = w != 0
            worst["abs"] = max(worst["abs"], float(d.max()))
            worst["rel"] = max(worst["rel"], float((d[nz] / np.abs(w[nz])).max()) if nz.any() else 0.0)
            scale = float(np.abs(w).max())
            worst["norm"] = max(worst["norm"], float(d.max()) / scale if scale else 0.0)
    fused = sum(1 for n in result.model.graph.node if n.domain == "onnxfuse")
    return {"model": name, "fused": fused, **worst}


def main(argv=None) -> int:
    from onnxfuse import zoo

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated zoo names (default: every zoo model)")
    ap.add_argument("--seeds", type=int, default=3, help="input draws per model")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/numerics.md")
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else [m.name for m in zoo.list_models()]
    rows = []
    for name in names:
        r = measure(name, args.seeds)
        rows.append(r)
        print(f"{name:14s} fused {r['fused']:3d}  max abs {r['abs']:.3g}  max rel {r['rel']:.3g}  normwise rel {r['norm']:.3g}",
              flush=True)
    import onnx
    import onnxruntime

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# Numerical agreement of optimized zoo models with the originals",
        "",
        f"Command: `python bench/numerics.py --seeds {args.seeds}`",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Commit: {commit}. "
        f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}; Python {platform.python_version()}, "
        f"onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}.",
        "",
        "Original vs optimized (default CPU pipeline, onnxfuse library registered), onnxruntime CPU provider, "
        "1 thread, ORT_ENABLE_ALL, seeded random inputs (the zoo's default dims), worst output over "
        f"{args.seeds} draws. *max rel* is elementwise over nonzero reference elements (unbounded where "
        "an output crosses zero); *normwise rel* is max |error| / max |reference|.",
        "",
        "| model | fused ops | max abs error | max rel error | normwise rel error |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['fused']} | {r['abs']:.3g} | {r['rel']:.3g} | {r['norm']:.3g} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
