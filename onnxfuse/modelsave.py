"""Saving models atomically, with the IR version onnxruntime loads and large weights in a data file.

Every file is written to a temporary name in its target directory and renamed into place, so
a reader never sees a partial file and a failed write leaves an existing one untouched; a
failed write is an OutputError naming the path (outfiles.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import onnx

from . import outfiles
from .environment import ort_max_ir_version
from .fused import DOMAIN
from .modelio import PROTOBUF_LIMIT

# Tensors at least this big go to the data file when a model has to use one (small ones
# stay inline, as onnx itself does).
EXTERNAL_TENSOR_MIN_BYTES = 1024
# IR version from which function overloads (one fallback body per fused node) exist.
IR_WITH_OVERLOADS = 10


def uses_functions(model: onnx.ModelProto) -> bool:
    return bool(model.functions) or any(n.overload for n in model.graph.node) or any(
        n.domain == DOMAIN for n in model.graph.node
    )


def output_ir_version(model: onnx.ModelProto) -> int:
    """min(max(model IR, 10 when fused ops / overloads are used), newest onnxruntime loads)."""
    wanted = model.ir_version
    if uses_functions(model):
        wanted = max(wanted, IR_WITH_OVERLOADS)
    return min(wanted, ort_max_ir_version())


def _mode_for_new_file() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# A model holding more than this many bytes of weights by reference (loaded with external
# data) is written with a data file even under 2 GiB: inlining would read them all into memory.
INLINE_REFERENCED_MAX = 256 << 20


def _externalize(model: onnx.ModelProto, data_file, location: str, min_bytes: int,
                 digest: "_DigestOfWrites") -> None:
    """Move large tensor payloads into data_file (already open), pointing the model at `location`;
    `digest` is given every byte written, in order.

    Tensors held by reference are streamed from their files, never read whole; tensors in
    function bodies (fallback bodies' Constant nodes) stay inline."""
    from onnx import numpy_helper

    from .weights import ALIGN, all_tensors, copy_region, inline_function_tensors, region_of, set_reference

    inline_function_tensors(model)
    offset = 0
    for t in all_tensors(model, functions=False):
        if t.data_type == onnx.TensorProto.STRING:
            continue
        region = region_of(t)
        if region is None:
            if not t.HasField("raw_data"):
                # Typed fields (float_data, ...) become raw bytes so they can be moved out too.
                array = numpy_helper.to_array(t)
                if array.nbytes < min_bytes:
                    continue
                t.CopyFrom(numpy_helper.from_array(array, t.name))
            if len(t.raw_data) < min_bytes:
                continue
        # Align each tensor to 4 KiB so the data file can be memory-mapped tensor by tensor.
        zeros = b"\0" * ((-offset) % ALIGN)
        data_file.write(zeros)
        offset += len(zeros)
        if region is None:
            data = t.raw_data
            data_file.write(data)
            length = len(data)
        else:
            copy_region(region, data_file)
            data, length = region, region.length
        digest.add(zeros)
        digest.add(data)
        set_reference(t, location, offset, length)
        offset += length


def _needs_data_file(model: onnx.ModelProto, threshold: int) -> bool:
    from .weights import referenced_bytes

    # Weights that were inline in their model file are written inline again (streamed).
    if referenced_bytes(model, inline_origin=False) > INLINE_REFERENCED_MAX:
        return True
    referenced = referenced_bytes(model)
    try:
        size = model.ByteSize()
    except Exception:  # protobuf refuses to size a message over 2 GiB
        return True
    return size + referenced >= threshold


# A data file is named after OUT and its content: "<OUT name>.<DATA_DIGEST_CHARS hex digits of
# its SHA-256>.data". Each write that changes the weights makes a new file, which the new OUT
# names; the old OUT goes on naming the old one until OUT's rename, so a reader never pairs a
# model with another write's weights.
DATA_DIGEST_CHARS = 16
DATA_SUFFIX = ".data"


def data_file_name(model_name: str, digest: str) -> str:
    return f"{model_name}.{digest[:DATA_DIGEST_CHARS]}{DATA_SUFFIX}"


def _own_data_file(model_name: str, location: str) -> bool:
    """A data file name onnxfuse writes for a model named `model_name` (this version's, or the
    plain "<name>.data" of earlier ones): the only names it ever removes."""
    import re

    return bool(re.fullmatch(re.escape(model_name) + rf"(\.[0-9a-f]{{{DATA_DIGEST_CHARS}}})?" + re.escape(DATA_SUFFIX),
                             location))


# An existing OUT bigger than this is not read to find the data file it names (such a model holds
# its weights inline): its data file, if any, is left in place.
_OLD_OUT_READ_MAX = 64 << 20


def _data_files_of(path: Path) -> set[str]:
    """The data files (in OUT's directory, with a name onnxfuse writes) that the existing model
    file `path` names: the ones to remove once a new OUT has replaced it."""
    from .weights import all_tensors, external_entries

    try:
        if not path.is_file() or path.stat().st_size > _OLD_OUT_READ_MAX:
            return set()
        old = onnx.ModelProto()
        old.ParseFromString(path.read_bytes())
        found = set()
        for t in all_tensors(old):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                location = external_entries(t).get("location", "")
                if _own_data_file(path.name, location):
                    found.add(location)
        return found
    except Exception:  # not a model, unreadable: nothing of ours to remove
        return set()


class _DigestOfWrites:
    """The SHA-256 of a data file's bytes, computed on a second thread from what is written to
    it: bytes as they are, regions copied in the kernel read again from their source. Hashing
    then overlaps the copy instead of reading the finished file once more (TinyLlama-1.1B's 4.1
    GiB: a copy of 7.0 s, then 4.4 s of hashing the file; bench/results/save_digest.md).
    hexdigest() waits for it; close() stops it early after a failed write."""

    CHUNK = 16 << 20

    def __init__(self) -> None:
        import hashlib
        import queue
        import threading

        self._hash = hashlib.sha256()
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="onnxfuse-data-digest", daemon=True)
        self._thread.start()

    def add(self, item) -> None:
        """bytes, or a weights.FileRegion, after it has been written."""
        if item:
            self._items.put(item)

    def _run(self) -> None:
        from .weights import region_chunks

        while (item := self._items.get()) is not None:
            if self._error is not None or self._stopped:
                continue
            try:
                for chunk in [item] if isinstance(item, (bytes, bytearray)) else region_chunks(item, self.CHUNK):
                    if self._stopped:
                        break
                    self._hash.update(chunk)
            except BaseException as e:  # reported by hexdigest(), in the caller's thread
                self._error = e

    def close(self) -> None:
        self._stopped = True
        self._items.put(None)
        self._thread.join()

    def hexdigest(self) -> str:
        self._items.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()


def _sync_directory(directory: Path) -> None:
    """Make the renames done so far in `directory` durable before the next one."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # filesystems that cannot sync a directory
        pass
    finally:
        os.close(fd)


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    external_threshold: int = PROTOBUF_LIMIT,
    external_min_bytes: int = EXTERNAL_TENSOR_MIN_BYTES,
    before_commit: Callable[[list[str]], None] | None = None,
) -> list[str]:
    """Write `model` to `path` atomically, with the IR version onnxruntime accepts.

    Models of external_threshold bytes or more, and models holding over INLINE_REFERENCED_MAX
    bytes of weights by reference, keep tensors of external_min_bytes or more in a data file next
    to the model, `<name>.<digest>.data` (data_file_name), streamed there tensor by tensor (no
    protobuf message ever holds them). Both files are written to temporary names in the target
    directory; the data file is renamed to its new name first, then the model is renamed into
    place (the one step that publishes the write), then the data file the replaced model named
    is removed: a reader sees the old model with its own weights or the new one with its own,
    never a mix, and a failed or killed run leaves an existing OUT working. `before_commit` runs
    when every byte is written and before the first rename, given the paths about to be written:
    when it raises, nothing is renamed and the temporary files are removed. A failed write (disk
    full, I/O error) is an OutputError naming the path. Returns the paths written.
    """
    from .protowire import join_weights
    from .weights import all_tensors, copy_region, inline_tensor, is_inline_origin, region_of

    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.ir_version = output_ir_version(model)
    mode = _mode_for_new_file()
    temps: list[str] = []
    written: list[str] = []
    target = path
    data_path = None
    data_kept: list[str] = []
    try:
        data_tmp = None
        streamed: dict = {}
        if _needs_data_file(out, external_threshold):
            target = directory / (path.name + DATA_SUFFIX)
            fd, data_tmp = outfiles.temporary(directory, path.name + DATA_SUFFIX)
            temps.append(data_tmp)
            placeholder = os.path.basename(data_tmp)
            digest = _DigestOfWrites()
            try:
                with os.fdopen(fd, "wb") as f:
                    _externalize(out, f, placeholder, external_min_bytes, digest)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(data_tmp, mode)
                location = data_file_name(path.name, digest.hexdigest())
            finally:
                digest.close()
            for t in all_tensors(out, functions=False):
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    for entry in t.external_data:
                        if entry.key == "location" and entry.value == placeholder:
                            entry.value = location
            data_path = directory / location
            target = data_path
        else:
            # Initializers that were inline in their model file are streamed into the file;
            # other tensors are read inline.
            streamed = {i: r for i, r in enumerate(region_of(t) for t in out.graph.initializer)
                        if r is not None and is_inline_origin(r)}
            for i, t in enumerate(all_tensors(out)):
                if i not in streamed or i >= len(out.graph.initializer):
                    inline_tensor(t)
        target = path
        fd, model_tmp = outfiles.temporary(directory, path.name)
        temps.append(model_tmp)
        with os.fdopen(fd, "wb") as f:
            if data_tmp is None and streamed:
                join_weights(out.SerializeToString(), streamed, f.write, lambda r: copy_region(r, f))
            else:
                f.write(out.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(model_tmp, mode)
        if before_commit is not None:
            before_commit([str(path)] + ([str(data_path)] if data_path is not None else []))
        old_data = _data_files_of(path)
        if data_path is not None:
            target = data_path
            # A new name, which no model names yet (or, with the same digest, the same bytes):
            # the existing OUT and its data file are untouched. Until OUT's rename it is one of
            # the run's temporary files, removed if the run is stopped.
            if data_path.exists():  # the same digest: these very bytes, which the old OUT may name
                outfiles.remove(data_tmp)
                temps.remove(data_tmp)
                data_kept = []
            else:
                outfiles.publish(data_tmp, data_path, keep_temporary=True)
                temps[temps.index(data_tmp)] = str(data_path)
                data_kept = [str(data_path)]
            written.append(str(data_path))
            _sync_directory(directory)
        target = path
        outfiles.publish(model_tmp, path, also_release=data_kept)
        temps.clear()
        written.insert(0, str(path))
        for name in old_data - ({data_path.name} if data_path is not None else set()):
            try:
                os.unlink(directory / name)
            except OSError:
                pass
    except OSError as e:
        raise outfiles.write_error(target, e) from None
    finally:
        for t in temps:
            if outfiles.is_live(t):  # a published file is no longer the run's to remove
                outfiles.remove(t)
    return written


def check_writable(path: str | os.PathLike, label: str = "output") -> None:
    """Fail early (before any work) when OUT cannot be written: see outfiles.check_output_path."""
    outfiles.check_output_path(path, label)


def write_text_atomic(path: str | os.PathLike, text: str, label: str = "output") -> None:
    """Write `text` to `path` through a temporary file renamed into place; a failed write is an
    OutputError naming the path and leaves nothing behind."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    tmp = None
    try:
        fd, tmp = outfiles.temporary(directory, path.name)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for_new_file())
        os.replace(tmp, path)
        outfiles.release(tmp)
        tmp = None
    except OSError as e:
        raise outfiles.write_error(path, e, label) from None
    finally:
        if tmp is not None:
            outfiles.remove(tmp)
