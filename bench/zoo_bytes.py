"""Optimize every zoo model with the default pipeline (--target cpu and --target cuda, no
verification) and record the sha256 of each optimized model, to show a refactoring leaves every
output byte-identical:

    PYTHONPATH=<checkout A> python bench/zoo_bytes.py a.json
    PYTHONPATH=<checkout B> python bench/zoo_bytes.py b.json
    python bench/zoo_bytes.py --compare a.json b.json

(a checkout given by PYTHONPATH needs its passes/ copied to onnxfuse/passes, the package path
pyproject maps them to). Weights a zoo model keeps in a per-process temporary file are read in
as raw data before hashing, so that the file's name does not change the bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from onnx import TensorProto
from onnx import external_data_helper as ext


def inline(model):
    for t in ext._get_all_tensors(model):
        if ext.uses_external_data(t):
            info = ext.ExternalDataInfo(t)
            with open(info.location, "rb") as f:
                f.seek(info.offset or 0)
                t.raw_data = f.read(info.length) if info.length else f.read()
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
    return model


def record(out: str, names: list[str]) -> None:
    from onnxfuse import api, zoo

    res = json.load(open(out)) if os.path.exists(out) else {}
    for name in names or zoo.names():
        for target in ("cpu", "cuda"):
            t = time.time()
            try:
                m = zoo.get(name)
                r = api.optimize(f"zoo:{name}", target=target, verify_outputs=False, count_kernels=False,
                                 fallback_check=False, dims=m.dims or None)
                h = hashlib.sha256(inline(r.model).SerializeToString(deterministic=True)).hexdigest()
            except Exception as e:  # noqa: BLE001 - recorded, compared like a hash
                h = f"error: {type(e).__name__}: {str(e)[:200]}"
            res[f"{name}/{target}"] = h
            print(name, target, h[:16], f"{time.time() - t:.1f}s", flush=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=1)


def compare(a: str, b: str) -> int:
    x, y = json.load(open(a)), json.load(open(b))
    differ = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
    print(f"{len(x.keys() & y.keys()) - len(differ)} of {len(x.keys() | y.keys())} identical"
          + (f"; differ: {', '.join(differ)}" if differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    record(sys.argv[1], sys.argv[2:])
