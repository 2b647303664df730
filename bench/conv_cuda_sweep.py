"""Kernel-only GPU times of every ConvBiasAct tile candidate (split-K and 3xTF32 tensor-core tiles
included) per conv layer,
next to cuDNN's convolution (PyTorch, TF32 off, cudnn.benchmark) when PyTorch is present.

For each distinct fused (layer shape, epilogue) of the given zoo models at batch 1, every tile of
conv_plan.candidates(clusters=True) is compiled (one nvcc call per layer, layers in parallel)
and timed with CUDA events around single launches (median of --reps), in the device's primary
context; the heuristic's choice is marked. No onnxruntime overhead is in these figures.

    python -m bench.conv_cuda_sweep [--models resnet50,mobilenetv3] [--reps 50] [--md F] [--json F]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import click
import numpy as np

from bench import harness
from bench.conv_cuda_layers import compact_epilogue, compact_shape, distinct_layers


def _key(tile) -> str:
    return f"{type(tile).__name__}{tile.as_list() if hasattr(tile, 'as_list') else [tile.threads]}"


@harness.script(__doc__)
@click.option("--models", default="resnet50,mobilenetv3", show_default=True, help="comma-separated zoo CNNs")
@click.option("--reps", type=int, default=50, show_default=True)
@click.option("--arch", default="sm_90", show_default=True)
@click.option("--md", default=None, help="write the markdown table here")
@click.option("--json", default=None, help="write the rows as JSON here")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:
    from onnxfuse.cuda.compile import NVCC_FLAGS, find_nvcc
    from onnxfuse.cuda.conv_codegen import generate
    from onnxfuse.cuda.conv_plan import candidates, heuristic_tile

    layers = distinct_layers([m.strip() for m in args.models.split(",") if m.strip()])
    jobs = []
    for L in layers:
        shape, epi = L["shape"], L["epi"]
        tiles = candidates(shape, 1, clusters=True, tensor_cores=True)
        kernels = [generate(shape, epi, t) for t in tiles]
        jobs.append((L, tiles, kernels, heuristic_tile(shape, 1, clusters=True, tensor_cores=True)))
    nvcc = find_nvcc()
    tmp = tempfile.mkdtemp(prefix="onnxfuse-sweep-")

    def build(i):
        src = os.path.join(tmp, f"l{i}.cu")
        with open(src, "w") as f:
            f.write("\n".join(k.source for k in {k.entry: k for k in jobs[i][2]}.values()))
        out = os.path.join(tmp, f"l{i}.cubin")
        subprocess.run([nvcc, f"-arch={args.arch}", "-cubin", *NVCC_FLAGS, "-o", out, src], check=True,
                       capture_output=True)
        return out

    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        cubins = list(pool.map(build, range(len(jobs))))
    print(f"[sweep] compiled {sum(len(j[2]) for j in jobs)} kernels for {len(jobs)} layers", flush=True)

    import pycuda.driver as drv

    drv.init()
    ctx = drv.Device(0).retain_primary_context()
    ctx.push()
    try:
        torch = None
        try:
            import torch as _torch

            if _torch.cuda.is_available():
                torch = _torch
                torch.backends.cudnn.allow_tf32 = False
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.benchmark = True
        except Exception as e:  # no PyTorch: our kernels only
            print(f"[sweep] no cuDNN reference: {e}", flush=True)
        rows = []
        rng = np.random.default_rng(0)
        for (L, tiles, kernels, heur), cubin in zip(jobs, cubins):
            shape, epi = L["shape"], L["epi"]
            mod = drv.module_from_file(cubin)
            x = drv.to_device(rng.standard_normal((1, shape.c, shape.h, shape.w)).astype(np.float32))
            w = drv.to_device(rng.standard_normal((shape.k, shape.kred)).astype(np.float32))
            b = drv.to_device(rng.standard_normal(shape.k).astype(np.float32))
            z = drv.to_device(np.zeros((1, shape.k, shape.p, shape.q), np.float32))
            y = drv.mem_alloc(4 * shape.k * shape.p * shape.q)
            words = np.array([int(x), int(w), int(b), int(z) if epi.residual else 0, int(y), 1], dtype=np.uint64)
            arg = np.frombuffer(words.tobytes(), dtype=np.dtype((np.void, words.nbytes)))[0]
            times = {}
            for t, k in zip(tiles, kernels):  # key: kind and tile list
                fn = mod.get_function(k.entry)
                launch = dict(block=(k.threads, 1, 1), grid=k.grid(1))
                fn(arg, **launch)
                s, e = drv.Event(), drv.Event()
                ts = []
                for _ in range(args.reps):
                    s.record()
                    fn(arg, **launch)
                    e.record()
                    e.synchronize()
                    ts.append(s.time_till(e) * 1e3)
                times[_key(t)] = float(np.median(ts))
            cudnn = None
            if torch is not None:
                xt = torch.randn(1, shape.c, shape.h, shape.w, device="cuda")
                wt = torch.randn(shape.k, shape.cg, shape.r, shape.s, device="cuda")
                bt = torch.randn(shape.k, device="cuda")

                def conv():
                    return torch.nn.functional.conv2d(xt, wt, bt, shape.stride, (shape.pads[0], shape.pads[1]),
                                                      shape.dilation, shape.group)
                for _ in range(5):
                    conv()
                torch.cuda.synchronize()
                ts = []
                for _ in range(args.reps):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    conv()
                    e.record()
                    e.synchronize()
                    ts.append(s.elapsed_time(e) * 1e3)
                cudnn = float(np.median(ts))
            best = min(times, key=times.get)
            row = dict(model=L["model"], node=L["node"], count=L["count"], shape=compact_shape(shape),
                       epilogue=compact_epilogue(epi), heuristic=_key(heur),
                       times=times, best=best, cudnn_us=cudnn)
            rows.append(row)
            print(f"[sweep] {L['model']} {L['node']} {row['shape']}: best {best} {times[best]:.1f} us, "
                  f"heuristic {times.get(row['heuristic'], float('nan')):.1f} us, cudnn {cudnn}", flush=True)
    finally:
        ctx.pop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "reps": args.reps, "rows": rows}, f, indent=1)
    lines = [*stamp.header("ConvBiasAct tile candidates per layer: kernel-only GPU times"),
             "| model | node | layers | shape | epilogue | cudnn us | heuristic | heuristic us | best | best us |",
             "|---|---|---:|---|---|---:|---|---:|---|---:|"]
    for r in rows:
        h = r["times"].get(r["heuristic"])
        lines.append(f"| {r['model']} | {r['node']} | {r['count']} | {r['shape']} | {r['epilogue']} | "
                     f"{r['cudnn_us']:.1f} | {r['heuristic']} | {h:.1f} | {r['best']} | {r['times'][r['best']]:.1f} |"
                     if r["cudnn_us"] is not None and h is not None else
                     f"| {r['model']} | {r['node']} | {r['count']} | {r['shape']} | {r['epilogue']} | - | {r['heuristic']} | "
                     f"{h} | {r['best']} | {r['times'][r['best']]:.1f} |")
    harness.write_report(args.md, "\n".join(lines) + "\n")


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
