"""Compile the ConvBiasAct kernel of every zoo CNN conv layer for a CUDA architecture (no GPU
needed) and write ptxas's resource report: registers, spills, shared memory, tile, grid at batch 1.

    python -m bench.conv_cuda_kernels --arch sm_90 --out bench/results/conv_cuda_ptxas.md
    python -m bench.conv_cuda_kernels --models resnet50,mobilenetv3 --split-k --tensor-cores \
        --out bench/results/conv_cuda_ptxas_splitk_tc.md     (the opt-in kernels' heuristic tiles)
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from types import SimpleNamespace

import click

from bench import harness

from onnxfuse.cuda.compile import compiler_version, find_nvcc
from onnxfuse.cuda.conv_codegen import generate
from onnxfuse.cuda.conv_plan import Epilogue, clusters_supported, heuristic_tile, tensor_cores_supported
from onnxfuse.cuda.conv_tune import ptxas_check
from onnxfuse.normalize import normalize
from onnxfuse.zoo import resolve_input
from onnxfuse.passes.conv_bias_act import conv_layers

CNNS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
        "vgg19", "zfnet512", "mobilenetv3"]


@harness.script(__doc__)
@click.option("--arch", default="sm_90", show_default=True)
@click.option("--models", callback=harness.csv(), default=",".join(CNNS), show_default=True,
              help="comma-separated zoo CNNs")
@click.option("--split-k", is_flag=True, help="heuristic tiles with split-K over clusters (sm_90+)")
@click.option("--tensor-cores", is_flag=True, help="heuristic tiles of the 3xTF32 tensor-core GEMM (sm_80+)")
@click.option("--out", default=None, help="write the report here")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    clusters = args.split_k and clusters_supported(args.arch)
    tensor_cores = args.tensor_cores and tensor_cores_supported(args.arch)
    rows = []
    kernels = []
    for name in args.models:
        model = normalize(resolve_input(f"zoo:{name}")).model
        for node, shape, epi in conv_layers(model):
            k = generate(shape, epi or Epilogue(), heuristic_tile(shape, clusters=clusters, tensor_cores=tensor_cores))
            kernels.append(k)
            rows.append((name, node, shape, epi, k))
    t0 = time.time()
    report = ptxas_check(kernels, args.arch)
    seconds = time.time() - t0
    spills = [r for r in rows if report[r[4].entry].spill_stores or report[r[4].entry].spill_loads]
    regs = [report[k.entry].registers for k in kernels]
    kinds = Counter(k.kind for k in kernels)
    nvcc = find_nvcc()
    lines = [
        *stamp.header(f"ConvBiasAct kernels of every zoo CNN conv layer, compiled for {args.arch}")[:-1],
        f"{compiler_version(nvcc)}; flags as onnxfuse.cuda.compile "
        f"plus -cubin -Xptxas -v; one translation unit of {len({k.entry for k in kernels})} distinct kernels "
        f"compiled in {seconds:.0f} s. No GPU: these are compile-time facts only.",
        "",
        f"Layers: {len(rows)} ({kinds['gemm']} implicit GEMM, {kinds['gemm_tf32x3']} implicit GEMM on tensor cores "
        f"(3xTF32), {kinds['depthwise']} direct depthwise); "
        f"layers with spills: {len(spills)}; registers per thread min {min(regs)}, max {max(regs)}.",
        "Tile = heuristic (no --tune): BM x BN x BK / TM x TN for GEMM, BM x BN x BK / warp WM x WN for tensor "
        "cores, then /sK for split-K over a cluster of K blocks; threads for depthwise. "
        "Epilogue: what conv-bias-act fuses after BN folding (bare Convs compiled with bias only).",
        "",
        "| model | node | C,H,W -> K | kernel RxS / stride / pads / dil / group | epilogue | kind | tile | "
        "grid (batch 1) | regs | spill st/ld | smem B |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, node, s, epi, k in rows:
        info = report[k.entry]
        e = "bare" if epi is None else "+".join(
            x for x in [epi.activation if epi.activation != "none" else "", "residual" if epi.residual else "",
                        "relu" if epi.post_relu else ""] if x) or "bias"
        tile = (f"{k.tile[0]}x{k.tile[1]}x{k.tile[2]}/{k.tile[3]}x{k.tile[4]}" if k.kind != "depthwise" else f"{k.tile[0]}")
        if k.kind != "depthwise" and len(k.tile) > 5 and k.tile[5] > 1:
            tile += f"/s{k.tile[5]}"
        lines.append(
            f"| {name} | {node} | {s.c},{s.h},{s.w} -> {s.k} | {s.r}x{s.s} / {s.stride[0]},{s.stride[1]} / "
            f"{','.join(map(str, s.pads))} / {s.dilation[0]},{s.dilation[1]} / {s.group} | {e} | {k.kind} | {tile} | "
            f"{'x'.join(map(str, k.grid(1)))} | {info.registers} | {info.spill_stores}/{info.spill_loads} | {info.smem_bytes} |"
        )
    harness.write_report(args.out, "\n".join(lines) + "\n", echo=False)
    print("\n".join(lines[:8]))
    return 1 if spills else 0


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
