"""onnxfuse.Attention (fuse-attention's CPU fused op) against onnxruntime running the original
attention chain: the zoo's GPT-style stack end to end, and one attention block per sequence length.

Runs are interleaved: rounds of `--burst` runs of each model, the order alternating, the ratio
(ours / onnxruntime) taken per round and its median reported. At one thread the clock is the
calling thread's CPU time (onnxruntime runs a one-thread session on the calling thread), which
other processes on a shared machine do not inflate by preempting it; at two threads it is wall
time. CPU provider, ORT_ENABLE_ALL applied after our passes, the library loaded for the
optimized model.

    python -m bench.attention_cpu [--rounds 60] [--out bench/results/attention_cpu.md]
                                  [--before OPTIMIZED.onnx [--before-library LIB.so]]

--before: gpt_stack as an earlier commit optimized it (onnxfuse optimize zoo:gpt_stack OUT at
that commit), timed interleaved against this commit's optimization, both with this library, or
the before model with --before-library (that commit's build of the library, loaded through
ONNXFUSE_LIBRARY into the same process).
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import click
import numpy as np
import onnx

from bench import harness


def interleaved(sess_a, sess_b, feeds, threads: int, rounds: int, burst: int, feeds_b=None) -> tuple[float, float, float]:
    """(median ms of a, median ms of b, median per-round ratio b / a); b runs on feeds_b if given.
    Samples of `burst` runs, the order alternating between rounds; the calling thread's CPU time
    at one thread, wall time above."""
    samples = harness.interleave(
        {"a": harness.session_run(sess_a, feeds), "b": harness.session_run(sess_b, feeds if feeds_b is None else feeds_b)},
        order="rotate", min_rounds=rounds, max_rounds=rounds, warmup=10, runs=burst, cpu_clock=threads == 1)
    clock = "cpu" if threads == 1 else "wall"
    return samples.median_ms("a", clock), samples.median_ms("b", clock), samples.ratio("a", "b", clock)


def block_model(seq: int, heads: int, head_dim: int, batch: int, bias: str = "last", sliced: bool = False):
    """One GPT attention block (QKV projection and its bias, Split, heads, causal mask, merge) at
    static sizes. bias "input": the bias a graph input, so fuse-attention leaves its Add separate.
    sliced: the mask as torch exports it, a run-time slice of a triu(-1e9) buffer (fuse-attention's
    causal mode), else that mask as a constant [1, 1, seq, seq] (an additive mask input)."""
    from tests.attention_models import attention_model

    causal = np.triu(np.full((seq, seq), -1e9, np.float32), 1)[None, None]
    masks = dict(causal=dict(table=causal)) if sliced else dict(mask_const=causal)
    m = attention_model(heads=heads, dh=head_dim, mask=None, scale_value=float(np.sqrt(head_dim)), qkv_bias=bias,
                        **masks)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((batch, seq, heads * head_dim)).astype(np.float32)}
    if bias == "input":
        feeds["qkv_bias"] = rng.standard_normal(3 * heads * head_dim).astype(np.float32)
    return m, feeds


@harness.script(__doc__)
@click.option("--rounds", type=int, default=60, show_default=True)
@click.option("--burst", type=int, default=10, show_default=True)
@click.option("--repeats", type=int, default=2, show_default=True, help="times each end-to-end row is measured")
@click.option("--out", default=None, help="write the report here (default: print it only)")
@click.option("--before", default=None, help="gpt_stack optimized at an earlier commit")
@click.option("--before-library", default=None, help="the library the --before model runs with")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:
    from onnxfuse import api, runtime, zoo
    from onnxfuse.passes.attention import CPU_MAX_CAUSAL_KEYS, CPU_MAX_KEYS

    original = onnx.load(str(zoo.get("gpt_stack").path))
    result = api.optimize(original, dims={"batch": 2, "seq": 32})
    optimized = result.model
    lines = [*stamp.header("Attention on the CPU: fused multi-head attention vs onnxruntime's chain"),
             f"gpt_stack kernels per inference (ORT_ENABLE_ALL, 1 thread): {result.summary.get('kernels_before', '?')} -> "
             f"{result.summary.get('kernels_after', '?')}.", "",
             "## gpt_stack end to end", "",
             "Ratio = ours / onnxruntime, median over interleaved rounds; times are medians per inference.", "",
             "| threads | batch | seq | onnxruntime ms | onnxfuse ms | ratio |", "|---:|---:|---:|---:|---:|---:|"]
    for threads in (1, 2):
        sa = runtime.make_session(original, threads=threads)
        sb = runtime.make_session(optimized, threads=threads)
        for batch, seq in ((2, 32), (1, 32), (2, 64), (1, 64)):
            feeds = {"input_ids": np.random.default_rng(batch * 100 + seq).integers(0, 256, (batch, seq)).astype(np.int64)}
            for _ in range(args.repeats):
                a, b, r = interleaved(sa, sb, feeds, threads, args.rounds, args.burst)
                row = f"| {threads} | {batch} | {seq} | {a:.3f} | {b:.3f} | {r:.3f} |"
                print(row, flush=True)
                lines.append(row)
    if args.before:
        before = onnx.load(args.before)
        library = f"`{args.before_library}`" if args.before_library else "this library"
        lines += ["", f"## gpt_stack: this commit's optimization against `{args.before}`", "",
                  f"Before with {library}, now with this library; 1 thread, interleaved; ratio = this commit / before.",
                  "", "| batch | seq | before ms | now ms | ratio |", "|---:|---:|---:|---:|---:|"]
        saved = os.environ.get("ONNXFUSE_LIBRARY")
        if args.before_library:
            os.environ["ONNXFUSE_LIBRARY"] = args.before_library
        sa = runtime.make_session(before, threads=1)
        if saved is None:
            os.environ.pop("ONNXFUSE_LIBRARY", None)
        else:
            os.environ["ONNXFUSE_LIBRARY"] = saved
        sb = runtime.make_session(optimized, threads=1)
        for batch, seq in ((2, 32), (1, 32), (2, 64)):
            feeds = {"input_ids": np.random.default_rng(batch * 100 + seq).integers(0, 256, (batch, seq)).astype(np.int64)}
            for _ in range(args.repeats + 1):
                a, b, r = interleaved(sa, sb, feeds, 1, args.rounds, args.burst)
                row = f"| {batch} | {seq} | {a:.3f} | {b:.3f} | {r:.3f} |"
                print(row, flush=True)
                lines.append(row)
    lines += ["", "## One attention block (QKV MatMul + bias + attention), batch 1, 4 heads of 32, causal mask, 1 thread", "",
              f"The fused op forced at every length (the pass applies it on the CPU up to {CPU_MAX_KEYS} keys, "
              f"{CPU_MAX_CAUSAL_KEYS} in causal mode). "
              "'bias separate': the bias a graph input, so its Add stays a kernel before the Attention node; "
              "'bias folded': a constant bias, added by the Attention kernel; both read the mask as an input. "
              "'causal': the mask a run-time slice of a triu(-1e9) constant, as torch exports it, fused by "
              "the CPU rule (the sequence dim symbolic and not declared, so the key-length limit does not "
              "apply) into an Attention node with causal = 1 and no mask input, against that model's own "
              "onnxruntime chain (the slice and its Shape arithmetic included).", "",
              "| seq | onnxruntime chain us | fused, bias separate us | fused, bias folded us | folded / onnxruntime "
              "| folded / separate | sliced-mask chain us | fused, causal us | causal / its chain |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes

    def fuse(m):
        # The cuda rule fuses at any length (opted in); the node runs on the CPU kernel here.
        ctx = Context(target="cuda", options=PassOptions(attention_cuda=True))
        fused, n = run_passes(m, select_passes(["fuse-attention"], "cpu"), ctx)
        assert sum(1 for x in fused.graph.node if x.op_type == "Attention") == 1, "fuse-attention did not apply"
        return fused

    def fuse_causal(m):
        """The CPU rule (causal mode is CPU-only): None past CPU_MAX_KEYS, where it does not apply."""
        fused, n = run_passes(m, select_passes(["fuse-attention"], "cpu"), Context(target="cpu"))
        nodes = [x for x in fused.graph.node if x.op_type == "Attention"]
        if not nodes:
            return None
        assert any(a.name == "causal" and a.i == 1 for a in nodes[0].attribute), "not fused as causal"
        return fused

    rounds = max(10, args.rounds // 3)
    for seq in (32, 64, 128, 256, 512):
        m, feeds = block_model(seq, 4, 32, 1)
        m_sep, feeds_sep = block_model(seq, 4, 32, 1, bias="input")
        feeds["x"] = feeds_sep["x"]
        sa = runtime.make_session(m, threads=1)
        sb = runtime.make_session(fuse(m), threads=1, with_library=True)
        sc = runtime.make_session(fuse(m_sep), threads=1, with_library=True)
        a, b, r = interleaved(sa, sb, feeds, 1, rounds, args.burst)
        c, b2, r2 = interleaved(sc, sb, feeds_sep, 1, rounds, args.burst, feeds_b=feeds)
        m_sliced, _ = block_model(seq, 4, 32, 1, sliced=True)
        causal = fuse_causal(m_sliced)
        causal_cells = "- | not fused | -"  # the CPU rule's key-length limit
        if causal is not None:
            se = runtime.make_session(m_sliced, threads=1)
            sf = runtime.make_session(causal, threads=1, with_library=True)
            e, f, r3 = interleaved(se, sf, feeds, 1, rounds, args.burst)
            causal_cells = f"{e * 1e3:.1f} | {f * 1e3:.1f} | {r3:.3f}"
        row = f"| {seq} | {a * 1e3:.1f} | {c * 1e3:.1f} | {b * 1e3:.1f} | {r:.3f} | {r2:.3f} | {causal_cells} |"
        print(row, flush=True)
        lines.append(row)
    harness.write_report(args.out, "\n".join(lines) + "\n")


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
