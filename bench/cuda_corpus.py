"""`--target cuda` on every corpus model: the fused ops the pipeline emits, the CUDA kernel each
carries, and ptxas's report on each kernel's stored PTX for an architecture (no GPU needed).

    python -m bench.cuda_corpus --arch sm_90 --out bench/results/cuda_corpus.md

Per model: fused nodes by op, the distinct kernels they carry, nodes without a usable kernel,
the largest register count, spill bytes and static shared memory per op, and the ops of other
domains that onnxruntime's CUDA provider has no float32 kernel for (they would run on the CPU).
Then every form a fused op takes over the corpus (what its generator specialises on), and the
onnxruntime contrib ops the CPU pipeline writes for the corpus, with the CUDA provider's support.
The transformer models run a second time with the opt-in CUDA attention fusion (pass option
attention_cuda), with the attention ops each then holds: onnxfuse.Attention (the generated kernel),
onnxruntime's MultiHeadAttention or Attention (the onnxscript-fusions stage's attention groups,
CUDA kernels of onnxruntime's own), or the Softmax of an attention left unfused. Exit status 1
when a fused node has no kernel ptxas accepts.
"""
from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from types import SimpleNamespace

import click

from bench import harness

from onnxfuse import api, zoo
from onnxfuse.cuda import audit
from onnxfuse.cuda.compile import compiler_version, find_nvcc


def corpus_names() -> list[str]:
    return [m.name for m in zoo.list_models() if m.source == "corpus"]


def _family(name: str) -> str:
    return zoo.get(name).family or "?"


# The ops an attention ends up as (or its Softmax when it stays unfused), as the table names them.
ATTENTION_OPS = {("onnxfuse", "Attention"): "onnxfuse.Attention",
                 ("com.microsoft", "MultiHeadAttention"): "MultiHeadAttention",
                 ("com.microsoft", "Attention"): "com.microsoft.Attention",
                 ("com.microsoft", "GroupQueryAttention"): "GroupQueryAttention",
                 ("", "Softmax"): "Softmax (unfused)"}


def attention_ops(model) -> Counter:
    return Counter(ATTENTION_OPS[(n.domain, n.op_type)] for n in model.graph.node
                   if (n.domain, n.op_type) in ATTENTION_OPS)


def _cuda_run(name: str, arch: str, options: dict) -> tuple[list[audit.NodeKernel], list[str], float, Counter]:
    t0 = time.perf_counter()
    result = api.optimize(f"zoo:{name}", target="cuda", arch=arch, verify_outputs=False, count_kernels=False,
                          options=options)
    records = audit.audit(result.model, arch)
    return (records, audit.foreign_ops_without_cuda_kernel(result.model), time.perf_counter() - t0,
            attention_ops(result.model))


def _cpu_contrib_ops(name: str) -> Counter:
    result = api.optimize(f"zoo:{name}", target="cpu", verify_outputs=False, count_kernels=False)
    return Counter(f"{n.domain}.{n.op_type}" for n in result.model.graph.node
                   if n.domain not in ("", "ai.onnx", "onnxfuse"))


def _row_start(name: str, recs) -> str:
    """The first cells of a model's row: the fused ops emitted, distinct kernels, nodes without one."""
    ops = Counter(r.op for r in recs)
    return (f"| {name} | {', '.join(f'{op} {n}' for op, n in ops.most_common()) or '-'} | "
            f"{len({r.entry for r in recs if r.entry})} | {sum(not r.ok for r in recs)} |")


def _worst(records: list[audit.NodeKernel], op: str) -> str:
    infos = [r.ptxas for r in records if r.op == op and r.ptxas is not None]
    if not infos:
        return "-"
    regs = max(i.registers for i in infos)
    spill = max(i.spill_stores + i.spill_loads for i in infos)
    smem = max(i.smem_bytes for i in infos)
    return f"{regs} / {spill} / {smem}"


@harness.script(__doc__)
@click.option("--arch", default="sm_90", show_default=True)
@click.option("--models", callback=harness.csv(), default=None, help="comma-separated corpus models (default: all)")
@click.option("--no-cpu-contrib", is_flag=True, help="skip the CPU pipeline runs that list its contrib ops")
@click.option("--out", default=None, help="write the report here")
@click.option("--opt-in", "opt_in", multiple=True,
              help="a boolean pass option set in every run (repeatable), e.g. squeeze_excite_cuda")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    names = args.models or corpus_names()
    base = {name: True for name in args.opt_in}
    per_model = {}
    attention_runs = {}
    contrib = {}
    for name in names:
        harness.log(f"{name}: cuda")
        per_model[name] = _cuda_run(name, args.arch, base)
        if _family(name) == "transformer":
            harness.log(f"{name}: cuda, attention_cuda")
            attention_runs[name] = _cuda_run(name, args.arch, {**base, "attention_cuda": True})
        if not args.no_cpu_contrib:
            harness.log(f"{name}: cpu")
            contrib[name] = _cpu_contrib_ops(name)

    all_records = [r for recs, *_ in [*per_model.values(), *attention_runs.values()] for r in recs]
    bad = [r for r in all_records if not r.ok]
    foreign = sorted({f for _, fs, *_ in [*per_model.values(), *attention_runs.values()] for f in fs})
    entries = {r.entry for r in all_records if r.entry}
    spilling = {r.entry for r in all_records if r.ptxas and (r.ptxas.spill_stores or r.ptxas.spill_loads)}
    nvcc = find_nvcc()
    lines = [
        *stamp.header(f"--target cuda on the corpus: fused ops and their kernels, ptxas for {args.arch}",
                      "onnxscript")[:-1],
        f"{compiler_version(nvcc)}; kernels compiled by cuda-compile (flags in onnxfuse/cuda/compile.py), then "
        f"each stored PTX assembled again by `ptxas -v -arch={args.arch}`. No GPU: compile-time facts only "
        "(optimize ran with --no-verify).",
        "",
        f"Fused nodes: {len(all_records)}; distinct kernels: {len(entries)}; nodes without a kernel ptxas "
        f"accepts: {len(bad)}; kernels with spills: {len(spilling)}; ops of other domains without a CUDA "
        f"float32 kernel: {len(foreign)}.",
        "",
        "## Per model (default pipeline)",
        "",
        "regs / spill bytes (stores + loads) / static shared memory bytes: the largest over the op's kernels.",
        "",
        *harness.table_head([("model", "l"), ("fused ops emitted", "l"), ("kernels", "r"), ("no kernel", "r"),
                             ("Pointwise regs/spill/smem", "l"), ("ConvBiasAct regs/spill/smem", "l"),
                             ("other domains without CUDA kernel", "l"), ("seconds", "r")]),
    ]
    for name, (recs, fs, secs, _) in per_model.items():
        lines.append(f"{_row_start(name, recs)} {_worst(recs, 'Pointwise')} | {_worst(recs, 'ConvBiasAct')} | "
                     f"{', '.join(fs) or '-'} | {secs:.0f} |")
    if attention_runs:
        lines += [
            "",
            "## Transformers with the opt-in CUDA attention fusion (pass option attention_cuda)",
            "",
            "attention ops: what each attention of the model is on cuda (onnxfuse.Attention: the generated kernel; "
            "MultiHeadAttention, com.microsoft.Attention: onnxruntime's CUDA kernels, written by the "
            "onnxscript-fusions stage's attention groups; Softmax (unfused): an attention left as its chain).",
            "",
            *harness.table_head([("model", "l"), ("fused ops emitted", "l"), ("kernels", "r"), ("no kernel", "r"),
                                 ("Attention regs/spill/smem", "l"), ("attention ops", "l"),
                                 ("other domains without CUDA kernel", "l")]),
        ]
        for name, (recs, fs, _, attn) in attention_runs.items():
            shown = ", ".join(f"{op} {n}" for op, n in sorted(attn.items())) or "-"
            lines.append(f"{_row_start(name, recs)} {_worst(recs, 'Attention')} | {shown} | {', '.join(fs) or '-'} |")
    forms: dict[tuple[str, str], list] = defaultdict(list)
    for name, (recs, *_) in [*per_model.items(), *attention_runs.items()]:
        for r in recs:
            forms[(r.op, r.form)].append((name, r))
    lines += [
        "",
        "## Forms of the fused ops",
        "",
        "Pointwise: instructions, inputs (those read through a Slice/Split view), outputs, dtypes. ConvBiasAct: "
        "kernel kind, window, stride, groups, epilogue. ChannelShuffle: groups, the inputs' channels, outputs. "
        "Registers and spills: the largest over the form's kernels.",
        "",
        *harness.table_head([("op", "l"), ("form", "l"), ("nodes", "r"), ("models", "l"), ("kernel", "l"),
                             ("regs", "r"), ("spill st/ld", "l"), ("smem B", "r")]),
    ]
    for (op, form), items in sorted(forms.items(), key=lambda kv: (kv[0][0], -len(kv[1]), kv[0][1])):
        recs = [r for _, r in items]
        infos = [r.ptxas for r in recs if r.ptxas is not None]
        models = sorted({n for n, _ in items})
        shown = ", ".join(models[:4]) + (f" +{len(models) - 4}" if len(models) > 4 else "")
        kernel = "yes" if all(r.ok for r in recs) else "; ".join(sorted({r.problem for r in recs if r.problem}))
        regs = max((i.registers for i in infos), default=0)
        st = max((i.spill_stores for i in infos), default=0)
        ld = max((i.spill_loads for i in infos), default=0)
        smem = max((i.smem_bytes for i in infos), default=0)
        lines.append(f"| {op} | {form} | {len(recs)} | {shown} | {kernel} | {regs} | {st}/{ld} | {smem} |")
    if contrib:
        used = Counter()
        where = defaultdict(list)
        for name, ops in contrib.items():
            for op, n in ops.items():
                used[op] += n
                where[op].append(name)
        lines += [
            "",
            "## Contrib ops of the CPU pipeline (--target cpu) and onnxruntime's CUDA provider",
            "",
            "The default cuda pipeline runs neither onnxscript-fusions nor fold-contrib-bias, so it writes none of "
            "these; with attention_cuda it runs the stage's attention groups alone (MultiHeadAttention and "
            "Attention, no GroupQueryAttention: its CUDA kernel takes float16 and bfloat16 only). CUDA kernel: "
            "float32 support listed for CUDAExecutionProvider in onnxruntime's docs/OperatorKernels.md (onnxfuse/cuda/audit.py, CUDA_CONTRIB_FLOAT32).",
            "",
            *harness.table_head([("op", "l"), ("nodes", "r"), ("models", "l"), ("CUDA float32 kernel", "l")]),
        ]
        for op, n in used.most_common():
            domain, _, kind = op.rpartition(".")
            has = (domain == "com.microsoft" and kind in audit.CUDA_CONTRIB_FLOAT32) or kind in audit.CUDA_ONNX_DOMAIN_EXTRAS
            lines.append(f"| {op} | {n} | {', '.join(where[op])} | {'yes' if has else 'no'} |")
        if not used:
            lines.append("| (none) | 0 | - | - |")
    spilled = sorted({r.entry for r in all_records if r.ptxas and (r.ptxas.spill_stores or r.ptxas.spill_loads)})
    if spilled:
        lines += ["", f"Kernels with spills: {', '.join(spilled)}."]
    if bad:
        lines += ["", "## Nodes without a usable kernel", ""]
        lines += [f"- {r.node} ({r.op}, {r.form}): {r.problem}" for r in bad]
    harness.write_report(args.out, "\n".join(lines) + "\n", echo=False)
    print("\n".join(lines[:9]))
    return 1 if bad or foreign else 0


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
