"""Fingerprints of every zoo model's optimized output, to show a refactor changes nothing.

    python -m bench.zoo_outputs hash before.json            # at the old commit
    python -m bench.zoo_outputs hash after.json [NAME...]   # at the new one
    python -m bench.zoo_outputs compare before.json after.json

`hash` optimizes each zoo model with the default CPU pipeline and with --target cuda (no
verification, no kernel counts: what is written is all that is compared) and records the
SHA-256 of the optimized model serialized deterministically, with its node count. `compare`
lists the models whose output differs and counts the identical ones.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time

TARGETS = ("cpu", "cuda")


def fingerprints(names: list[str]) -> dict[str, list]:
    from onnxfuse import zoo
    from onnxfuse.api import optimize

    out: dict[str, list] = {}
    for name in names or [m.name for m in zoo.list_models()]:
        model = zoo.get(name)
        for target in TARGETS:
            start = time.perf_counter()
            try:
                result = optimize(model.load(), target=target, dims=model.dims or None, verify_outputs=False,
                                  count_kernels=False, threads=1)
                digest = hashlib.sha256(result.model.SerializeToString(deterministic=True)).hexdigest()
                entry = [digest, len(result.model.graph.node)]
            except Exception as e:  # noqa: BLE001 - a failure is a fingerprint too
                entry = [f"error {type(e).__name__}: {e}"[:200], -1]
            out[f"{name}/{target}"] = entry
            print(f"{name:32} {target:5} {entry[0][:16]} {entry[1]:5} nodes {time.perf_counter() - start:6.1f} s",
                  flush=True)
    return out


def compare(before: dict, after: dict) -> int:
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for key in differ:
        print(f"differs: {key}: {before.get(key, ['absent', 0])[1]} -> {after.get(key, ['absent', 0])[1]} nodes")
    print(f"{len(before.keys() & after.keys()) - len(differ)} of {len(before.keys() | after.keys())} identical")
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "hash":
        with open(argv[1], "w") as f:
            json.dump(fingerprints(argv[2:]), f, indent=1, sort_keys=True)
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        with open(argv[1]) as a, open(argv[2]) as b:
            return compare(json.load(a), json.load(b))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
