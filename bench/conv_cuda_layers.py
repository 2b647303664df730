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

    python bench/conv_cuda_layers.py [--models resnet50,mobilenetv3] [--tune] [--split-k] [--tensor-cores] [--md F] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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
    ios = {k: bound(ort, s, feeds, out_shape) for k, s in sessions.items()}
    for k, s in sessions.items():
        for _ in range(warmup):
            s.run_with_iobinding(ios[k][0])
    samples = {k: [] for k in sessions}
    clock = time.perf_counter_ns
    for _ in range(runs):
        for k, s in sessions.items():
            t = clock()
            s.run_with_iobinding(ios[k][0])
            samples[k].append((clock() - t) / 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


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
    from onnxfuse.modelio import normalize
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS[:3]))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tune", action="store_true", help="also time our kernel with the tile --tune picks")
    ap.add_argument("--split-k", action="store_true",
                    help="heuristic tiles with split-K over thread-block clusters (pass option conv_split_k)")
    ap.add_argument("--tensor-cores", action="store_true",
                    help="the 3xTF32 tensor-core GEMM (pass option conv_tensor_cores)")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; layers that would not fit are skipped")
    ap.add_argument("--md", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--env", default=None, help="a markdown file describing the machine, put above the table")
    args = ap.parse_args(argv)
    import onnxruntime as ort

    from onnxfuse import api
    from onnxfuse.cuda.conv_codegen import heuristic_tile

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("bench/conv_cuda_layers.py: this onnxruntime has no CUDA provider", file=sys.stderr)
        return 2
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from gpu import device_arch

    arch = device_arch()
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

    text = markdown(out, args, skipped, open(args.env).read() if args.env else "")
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": arch, "batch": args.batch, "runs": args.runs, "rows": out, "skipped": skipped}, f, indent=1)
    return 0


def markdown(rows, args, skipped, env) -> str:
    lines = ["# ConvBiasAct per layer on the GPU: our kernel vs onnxruntime's CUDA Conv", ""]
    if env:
        lines += [env.strip(), ""]
    lines += [f"Command: `python bench/conv_cuda_layers.py --models {args.models}{' --tune' if args.tune else ''}"
              f"{' --split-k' if args.split_k else ''}{' --tensor-cores' if args.tensor_cores else ''} "
              f"--batch {args.batch} --runs {args.runs}`. Median microseconds per run (IOBinding, "
              "onnxruntime's per-run overhead included in both); ratio = ours / ort (> 1: ours slower); "
              "rel err = max |ours - ort(TF32 off)| / max |ort|.", ""]
    head = "| model | node | layers | shape | epilogue | MMAC | tile | ort us | ours us | ratio | rel err |"
    sep = "|---|---|---:|---|---|---:|---|---:|---:|---:|---:|"
    if args.tune:
        head += " tuned tile | tuned us | tuned ratio |"
        sep += "---|---:|---:|"
    lines += [head, sep]
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
