"""What naming a data file after its SHA-256 costs a save: the digest hashed on a second thread
while the weights are copied (onnxfuse.modelsave._DigestOfWrites, the default) against the same
bytes hashed after the copy, as saving did before.

Per model, one process optimizes it (no verification) and saves the result `--rounds` times
each way, alternating, each into a fresh directory next to the model; a table of save seconds
(median and range) and the data file's size. Only models that save with a data file (4.1 GiB of
TinyLlama-1.1B's weights, or any model whose weights went over modelsave.INLINE_REFERENCED_MAX)
exercise the digest.

    python -m bench.save_digest MODEL.onnx [MODEL.onnx ...] [--rounds 3]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

from onnxfuse import modelsave
from onnxfuse.weights import region_chunks


class HashedAfterwards(modelsave._DigestOfWrites):
    """The former order: nothing hashed until the copy is done, then every byte in one thread."""

    def __init__(self) -> None:
        self._pending: list = []

    def add(self, item) -> None:
        if item:
            self._pending.append(item)

    def close(self) -> None:
        pass

    def hexdigest(self) -> str:
        digest = hashlib.sha256()
        for item in self._pending:
            for chunk in [item] if isinstance(item, (bytes, bytearray)) else region_chunks(item, self.CHUNK):
                digest.update(chunk)
        return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from onnxfuse import api

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {os.cpu_count()} CPUs; "
          f"`python -m bench.save_digest {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| model | data file GiB | digest | save s |\n|---|---:|---|---:|")
    threaded = modelsave._DigestOfWrites
    for path in args.models:
        model = api.optimize(path, verify_outputs=False, count_kernels=False).model
        seconds: dict[str, list[float]] = {"while copying": [], "after the copy": []}
        size = 0
        for _ in range(args.rounds):
            for label, digest in (("after the copy", HashedAfterwards), ("while copying", threaded)):
                out = tempfile.mkdtemp(prefix="onnxfuse-save-", dir=os.path.dirname(os.path.abspath(path)))
                try:
                    modelsave._DigestOfWrites = digest
                    t = time.perf_counter()
                    written = modelsave.save_model(model, os.path.join(out, "out.onnx"))
                    seconds[label].append(time.perf_counter() - t)
                    size = sum(os.path.getsize(p) for p in written[1:])
                finally:
                    modelsave._DigestOfWrites = threaded
                    shutil.rmtree(out)
        for label, values in seconds.items():
            print(f"| {os.path.basename(path)} | {size / 2**30:.2f} | {label} | "
                  f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
