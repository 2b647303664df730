"""What the numpy models of generated CUDA kernels share (attention_model, squeeze_excite_model)."""
from __future__ import annotations

import numpy as np

F = np.float32


def guarded_load(buf: np.ndarray, index, ok) -> np.ndarray:
    """buf[index] where ok, else 0: the kernel's guarded load, which reads no index where not ok.
    An index the kernel would read outside the buffer is an IndexError, so a model test catches
    the out-of-bounds read a GPU would not report."""
    index, ok = np.broadcast_arrays(np.asarray(index, np.int64), np.asarray(ok, bool))
    out = np.zeros(index.shape, F)
    read = index[ok]
    if read.size and (read.min() < 0 or read.max() >= buf.size):
        raise IndexError(f"the kernel would read element {int(read.max())} of a {buf.size}-element buffer")
    out[ok] = buf[read]
    return out
