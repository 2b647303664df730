"""Per-layer GPU table: every fused Conv layer of the zoo CNNs, our ConvBiasAct kernel against
onnxruntime's CUDA Conv (cuDNN), each layer on its own, side by side.

For each distinct (layer shape, epilogue) that conv-bias-act would fuse, two one-layer models run
on the CUDA provider with ORT_ENABLE_ALL, inputs and outputs bound on the device (IOBinding),
interleaved (A B A B ...):
    ort    Conv + activation (+ residual Add, + Relu) as ONNX ops: onnxruntime's own fusions and
           cuDNN (its default algorithm search and math mode)
    ours   the same model optimized with --target cuda: one ConvBiasAct node, our kernel, with the
           heuristic tile (and, with --tune, the tile timed fastest on this GPU)
Correctness: ours against onnxruntime's CUDA Conv with TF32 off (use_tf32=0), max error relative
to the output's largest magnitude. Latency: median per run, which includes onnxruntime's per-run
overhead (the same for both); `diff us` = ours - ort is what the layer adds or saves in a model.

    python -m bench.conv_cuda_layers [--models resnet50,mobilenetv3] [--tune] [--split-k] [--tensor-cores] [--md F] [--json F]
"""
from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import click
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench import harness
from bench.gpu import cuda_onnxruntime, report_options

MODELS = ["resnet50", "mobilenetv3", "squeezenet", "inception_v1", "densenet121"]
ONNX_ACT = {"relu": "Relu", "leakyrelu": "LeakyRelu", "sigmoid": "Sigmoid", "hardsigmoid": "HardSigmoid",
            "tanh": "Tanh", "hardswish": "HardSwish"}


def layer_model(shape, epi, batch: int = 1, seed: int = 0) -> onnx.ModelProto:
    """Conv (random weights, bias) followed by the epilogue as plain ONNX ops."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((shape.k, shape.cg, shape.r, shape.s)) / np.sqrt(shape.kred)).astype(np.float32)
    b = rng.standard_normal(shape.k).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[shape.r, shape.s],
                              strides=list(shape.stride), pads=list(shape.pads), dilations=list(shape.dilation),
                              group=shape.group)]
    v = "c"
    act = epi.activation
    if act == "silu":
        nodes += [helper.make_node("Sigmoid", [v], ["sg"]), helper.make_node("Mul", [v, "sg"], ["a"])]
        v = "a"
    elif act == "clip":
        inits += [numpy_helper.from_array(np.float32(epi.alpha), "lo"), numpy_helper.from_array(np.float32(epi.beta), "hi")]
        nodes += [helper.make_node("Clip", [v, "lo", "hi"], ["a"])]
        v = "a"
    elif act != "none":
        attrs = {"leakyrelu": {"alpha": epi.alpha}, "hardsigmoid": {"alpha": epi.alpha, "beta": epi.beta}}.get(act, {})
        nodes += [helper.make_node(ONNX_ACT[act], [v], ["a"], **attrs)]
        v = "a"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, shape.c, shape.h, shape.w])]
    out_shape = [batch, shape.k, shape.p, shape.q]
    if epi.residual:
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, out_shape))
        nodes += [helper.make_node("Add", [v, "z"], ["r"])]
        v = "r"
    if epi.post_relu:
        nodes += [helper.make_node("Relu", [v], ["pr"])]
        v = "pr"
    nodes[-1].output[0] = "y"
    g = helper.make_graph(nodes, "layer", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def session(ort, model, library: bool, tf32: bool = True):
    from onnxfuse.runtime import session_options

    so = session_options(with_library=library, level="all", provider="cuda")
    cuda = ("CUDAExecutionProvider", {} if tf32 else {"use_tf32": "0"})
    s = ort.InferenceSession(model.SerializeToString(), sess_options=so, providers=[cuda, "CPUExecutionProvider"])
    if s.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"the CUDA provider did not start: {s.get_providers()}")
    return s


def bound(ort, sess, feeds, out_shape):
    io = sess.io_binding()
    keep = [ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for v in feeds.values()]
    for name, ov in zip(feeds, keep):
        io.bind_ortvalue_input(name, ov)
    out = ort.OrtValue.ortvalue_from_shape_and_type(out_shape, np.float32, "cuda", 0)
    io.bind_ortvalue_output("y", out)
    return io, keep, out


def time_pair(ort, sessions: dict, feeds, out_shape, runs: int, warmup: int) -> dict:
    """Median microseconds per run of each session, one run of each per round (A B A B ...)."""
    ios = {k: bound(ort, s, feeds, out_shape) for k, s in sessions.items()}
    samples = harness.interleave({k: (lambda s=s, io=ios[k][0]: s.run_with_iobinding(io)) for k, s in sessions.items()},
                                 order="cycle", min_rounds=runs, max_rounds=runs, warmup=warmup, runs=1)
    return {k: samples.median_ms(k) * 1e3 for k in sessions}


def compact_shape(s) -> str:
    text = f"{s.c}x{s.h}x{s.w}->{s.k} {s.r}x{s.s}"
    if s.stride != (1, 1):
        text += f" s{s.stride[0]}" if s.stride[0] == s.stride[1] else f" s{s.stride}"
    if any(s.pads):
        text += f" p{s.pads[0]}" if len(set(s.pads)) == 1 else f" p{list(s.pads)}"
    if s.dilation != (1, 1):
        text += f" d{s.dilation[0]}"
    if s.group > 1:
        text += " dw" if s.depthwise else f" g{s.group}"
    return text


def compact_epilogue(e) -> str:
    parts = [e.activation] if e.activation != "none" else ["bias"]
    if e.residual:
        parts.append("add")
    if e.post_relu:
        parts.append("relu")
    return "+".join(parts)


def distinct_layers(models):
    from onnxfuse.normalize import normalize
    from onnxfuse.zoo import resolve_input
    from onnxfuse.passes.conv_bias_act import conv_layers

    seen, rows = {}, []
    for name in models:
        model = normalize(resolve_input(f"zoo:{name}")).model
        for node, shape, epi in conv_layers(model):
            if epi is None:
                continue
            key = (shape, epi)
            if key in seen:
                seen[key]["count"] += 1
                continue
            seen[key] = {"model": name, "node": node, "shape": shape, "epi": epi, "count": 1}
            rows.append(seen[key])
    return rows


@harness.script(__doc__)
@click.option("--models", default=",".join(MODELS[:3]), show_default=True, help="comma-separated zoo CNNs")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--runs", type=int, default=100, show_default=True)
@click.option("--warmup", type=int, default=10, show_default=True)
@click.option("--tune", is_flag=True, help="also time our kernel with the tile --tune picks")
@click.option("--split-k", is_flag=True,
              help="heuristic tiles with split-K over thread-block clusters (pass option conv_split_k)")
@click.option("--tensor-cores", is_flag=True, help="the 3xTF32 tensor-core GEMM (pass option conv_tensor_cores)")
@click.option("--budget", type=float, default=1e9, help="seconds; layers that would not fit are skipped")
@report_options
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    from onnxfuse import api
    from onnxfuse.cuda.conv_plan import heuristic_tile

    ort, arch = cuda_onnxruntime()
    layers = distinct_layers([m.strip() for m in args.models.split(",") if m.strip()])
    start = time.monotonic()
    out, skipped = [], 0
    for i, L in enumerate(layers):
        if time.monotonic() - start > args.budget:
            skipped = len(layers) - i
            break
        shape, epi = L["shape"], L["epi"]
        original = layer_model(shape, epi, args.batch)
        row = {k: L[k] for k in ("model", "node", "count")}
        row.update(shape=compact_shape(shape), epilogue=compact_epilogue(epi), macs=shape.macs(args.batch), depthwise=shape.depthwise,
                   tile=str(heuristic_tile(shape, args.batch, clusters=args.split_k, tensor_cores=args.tensor_cores)))
        try:
            variants = {"ours": api.optimize(original, target="cuda", arch=arch, verify_outputs=False,
                                             count_kernels=False, options={"conv_policy": "always", "conv_split_k": args.split_k,
                                                      "conv_tensor_cores": args.tensor_cores}).model}
            if args.tune:
                variants["tuned"] = api.optimize(original, target="cuda", arch=arch, verify_outputs=False,
                                                 count_kernels=False, tune=True,
                                                 options={"conv_policy": "always"}).model
            for name, m in variants.items():
                if not any(n.op_type == "ConvBiasAct" for n in m.graph.node):
                    raise RuntimeError(f"{name}: the layer was not fused")
            rng = np.random.default_rng(1)
            feeds = {"x": rng.standard_normal((args.batch, shape.c, shape.h, shape.w)).astype(np.float32)}
            out_shape = (args.batch, shape.k, shape.p, shape.q)
            if epi.residual:
                feeds["z"] = rng.standard_normal(out_shape).astype(np.float32)
            want = session(ort, original, False, tf32=False).run(None, feeds)[0].astype(np.float64)
            scale = max(float(np.max(np.abs(want))), 1e-30)
            sessions = {"ort": session(ort, original, False)}
            for name, m in variants.items():
                s = session(ort, m, True)
                got = s.run(None, feeds)[0].astype(np.float64)
                row[f"{name}_rel_err"] = float(np.max(np.abs(got - want))) / scale
                sessions[name] = s
            if args.tune:
                tuned = [n for n in variants["tuned"].graph.node if n.op_type == "ConvBiasAct"][0]
                row["tuned_tile"] = str([a.ints for a in tuned.attribute if a.name == "cuda_tile"][0])
            row["us"] = time_pair(ort, sessions, feeds, out_shape, args.runs, args.warmup)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out.append(row)
        us = row.get("us", {})
        print(f"[layers] {i + 1}/{len(layers)} {L['model']} {L['node']}: {us} {row.get('error', '')}", flush=True)

    harness.write_report(args.md, markdown(out, args, skipped, open(args.env).read() if args.env else "", stamp))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": arch, "batch": args.batch, "runs": args.runs, "rows": out, "skipped": skipped}, f, indent=1)
    return 0


main = harness.main_of(cli)


def markdown(rows, args, skipped, env, stamp: harness.RunStamp) -> str:
    lines = stamp.header("ConvBiasAct per layer on the GPU: our kernel vs onnxruntime's CUDA Conv")
    if env:
        lines += [env.strip(), ""]
    lines += ["Median microseconds per run (IOBinding, "
              "onnxruntime's per-run overhead included in both); ratio = ours / ort (> 1: ours slower); "
              "rel err = max |ours - ort(TF32 off)| / max |ort|.", ""]
    columns = [("model", "l"), ("node", "l"), ("layers", "r"), ("shape", "l"), ("epilogue", "l"), ("MMAC", "r"),
               ("tile", "l"), ("ort us", "r"), ("ours us", "r"), ("ratio", "r"), ("rel err", "r")]
    lines += harness.table_head(columns + ([("tuned tile", "l"), ("tuned us", "r"), ("tuned ratio", "r")]
                                           if args.tune else []))
    for r in rows:
        us = r.get("us", {})
        cells = [r["model"], r["node"], str(r["count"]), r["shape"], r["epilogue"], f"{r['macs'] / 1e6:.1f}", r["tile"],
                 f"{us['ort']:.1f}" if us else "-", f"{us['ours']:.1f}" if us else "-",
                 f"{us['ours'] / us['ort']:.2f}" if us else r.get("error", "-"),
                 f"{r['ours_rel_err']:.1e}" if "ours_rel_err" in r else "-"]
        if args.tune:
            cells += [r.get("tuned_tile", "-"), f"{us['tuned']:.1f}" if "tuned" in us else "-",
                      f"{us['tuned'] / us['ort']:.2f}" if "tuned" in us else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    timed = [r for r in rows if r.get("us")]
    if timed:
        def total(key):
            return sum(r["us"][key] * r["count"] for r in timed if key in r["us"])
        lines += ["", f"Layers timed: {len(timed)} distinct ({sum(r['count'] for r in timed)} in the models); "
                  f"ours faster on {sum(r['us']['ours'] < r['us']['ort'] for r in timed)}; "
                  f"max rel err {max(r.get('ours_rel_err', 0) for r in timed):.1e}. "
                  f"Sum over the models' layers: ort {total('ort'):.0f} us, ours {total('ours'):.0f} us"
                  + (f", tuned {total('tuned'):.0f} us" if args.tune else "") + "."]
    if skipped:
        lines.append(f"Not timed (time budget): {skipped} layers.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
