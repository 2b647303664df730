"""What onnxruntime's weight packing costs a verification session: time to make the session,
its first run, and the process's peak memory, with packing (onnxruntime's default) and without
(`session.disable_prepacking`, what verification asks: onnxfuse.verify.PREPACK).

Each measurement is a fresh process (CPU provider, one thread, ORT_ENABLE_ALL), the two
settings alternating, `--rounds` times per model; a table of the median and range of each. Besides
the models given, a generated model of one 1 GiB MatMul weight (external data) is measured
unless `--no-matmul`. Inputs: random, symbolic dims at `--dim` values (default 1).

`--optimize` times `onnxfuse.api.optimize(MODEL)` instead (CLI defaults: verification, kernel
counts; saving left out), each in a fresh process, verification's sessions packing
(onnxfuse.verify.PREPACK set to True, as before it existed) and not (the default), alternating:
the report's seconds per stage, and the process's peak memory.

    python -m bench.verify_prepacking MODEL.onnx [MODEL.onnx ...] [--rounds 2] [--dim past_sequence=128]
    python -m bench.verify_prepacking --optimize MODEL.onnx [MODEL.onnx ...] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time


def measure(path: str, prepack: bool, dims: dict[str, int]) -> dict:
    """In this process: make the session, run it once; seconds and peak resident memory."""
    import numpy as np
    import onnxruntime as ort

    from onnxfuse.runtime import session_options

    so = session_options(with_library=False, threads=1, prepack=prepack)
    t = time.perf_counter()
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    create = time.perf_counter() - t
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(bool)": np.bool_}
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else dims.get(d, 1) for d in i.shape]
        dtype = types[i.type]
        feeds[i.name] = (rng.standard_normal(shape).astype(dtype) if dtype == np.float32
                         else np.ones(shape, dtype))
    t = time.perf_counter()
    sess.run(None, feeds)
    run = time.perf_counter() - t
    return {"create_s": create, "run_s": run, "peak_gib": _peak_resident_bytes() / 2**30}


def _peak_resident_bytes() -> int:
    """This process's peak resident memory since its exec (VmHWM; getrusage's ru_maxrss would
    carry over the peak of the process that started it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def optimize_once(path: str, prepack: bool) -> dict:
    """In this process: onnxfuse.api.optimize(path) with verification's sessions packing or not;
    the summary's seconds, kernel counts and peak resident memory."""
    from onnxfuse import api, verify

    verify.PREPACK = prepack
    t = time.perf_counter()
    result = api.optimize(path)
    wall = time.perf_counter() - t
    summary = result.summary
    return {"wall_s": wall, **{f"{k}_s": v for k, v in summary["seconds"].items()},
            "kernels": [summary.get("kernels_before"), summary.get("kernels_after")],
            "peak_gib": _peak_resident_bytes() / 2**30}


def one_matmul_model(directory: str) -> str:
    """A model of one MatMul with a 16384 x 16384 float weight (1 GiB) in external data."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    path = os.path.join(directory, "one_matmul.onnx")
    n = 16384
    weight = numpy_helper.from_array(np.random.default_rng(0).random((n, n), dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "one_matmul",
                              [helper.make_tensor_value_info("x", 1, [1, n])],
                              [helper.make_tensor_value_info("y", 1, [1, n])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path, save_as_external_data=True, location="one_matmul.data", size_threshold=1024)
    return path


def weight_gib(path: str) -> float:
    """Bytes of the model file and the data files beside it that it names."""
    import onnx

    from onnxfuse.weights import all_tensors

    model = onnx.load(path, load_external_data=False)
    files = {os.path.abspath(path)}
    for t in all_tensors(model, functions=False):
        for entry in t.external_data:
            if entry.key == "location":
                files.add(os.path.abspath(os.path.join(os.path.dirname(path), entry.value)))
    return sum(os.path.getsize(f) for f in files) / 2**30


def optimize_table(models: list[str], rounds: int, json_path: str | None, argv) -> int:
    import onnxruntime

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
          f"{os.cpu_count()} CPUs; onnxruntime {onnxruntime.__version__}; "
          f"`python -m bench.verify_prepacking {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| model | verification packs | optimize s | verify s | load s | passes s | peak GiB | kernels |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    results = {}
    for path in models:
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for _ in range(rounds):
            for setting in ("on", "off"):
                out = subprocess.run([sys.executable, "-m", "bench.verify_prepacking", "--optimize-child", path,
                                      setting], check=True, capture_output=True, text=True).stdout
                runs[setting].append(json.loads(out.strip().splitlines()[-1]))
        results[os.path.basename(path)] = runs
        for setting in ("on", "off"):
            cells = []
            for key in ("wall_s", "verify_s", "load_s", "passes_s", "peak_gib"):
                values = [r[key] for r in runs[setting]]
                cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
                             if key != "peak_gib" else f"{statistics.median(values):.2f}")
            kernels = runs[setting][0]["kernels"]
            print(f"| {os.path.basename(path)} | {'yes' if setting == 'on' else 'no'} | {' | '.join(cells)} | "
                  f"{kernels[0]} -> {kernels[1]} |", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dim", action="append", default=[], help="NAME=VALUE for symbolic input dims")
    ap.add_argument("--no-matmul", action="store_true", help="leave out the generated 1 GiB MatMul model")
    ap.add_argument("--optimize", action="store_true", help="time onnxfuse's optimize, packing and not")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # PATH on|off DIMS-JSON
    ap.add_argument("--optimize-child", nargs=2, help=argparse.SUPPRESS)  # PATH on|off
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1] == "on", json.loads(args.child[2]))))
        return 0
    if args.optimize_child:
        print(json.dumps(optimize_once(args.optimize_child[0], args.optimize_child[1] == "on")))
        return 0
    if args.optimize:
        return optimize_table(args.models, args.rounds, args.json, argv)
    dims = dict((d.split("=", 1)[0], int(d.split("=", 1)[1])) for d in args.dim)
    import onnxruntime

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
          f"{os.cpu_count()} CPUs; onnxruntime {onnxruntime.__version__}; "
          f"`python -m bench.verify_prepacking {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| model | weights GiB | packing | make session s | first run s | peak GiB | peak / weights |")
    print("|---|---:|---|---:|---:|---:|---:|")
    results = {}
    with tempfile.TemporaryDirectory(prefix="onnxfuse-prepacking-") as tmp:
        models = list(args.models) + ([] if args.no_matmul else [one_matmul_model(tmp)])
        for path in models:
            size = weight_gib(path)
            runs: dict[str, list[dict]] = {"on": [], "off": []}
            for _ in range(args.rounds):
                for setting in ("on", "off"):
                    out = subprocess.run([sys.executable, "-m", "bench.verify_prepacking", "--child", path, setting,
                                          json.dumps(dims)], check=True, capture_output=True, text=True).stdout
                    runs[setting].append(json.loads(out.strip().splitlines()[-1]))
            results[os.path.basename(path)] = runs
            for setting in ("on", "off"):
                cells = []
                for key in ("create_s", "run_s", "peak_gib"):
                    values = [r[key] for r in runs[setting]]
                    cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
                peak = statistics.median(r["peak_gib"] for r in runs[setting])
                print(f"| {os.path.basename(path)} | {size:.2f} | {setting} | {' | '.join(cells)} | "
                      f"{peak / size:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
