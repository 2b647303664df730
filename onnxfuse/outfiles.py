"""Where output files go: checks made before any work, temporary files that never outlive the
process, write errors as one line.

Every file onnxfuse writes is first written to a temporary name in its target directory and
renamed into place. `check_output_path` makes sure that can work before a long run starts (the
directory exists, is a real writable directory, and takes a file of that name); `temporary`
creates such a file and registers it, so that SIGTERM, SIGINT and SIGHUP (installed by
`remove_temporaries_on_signals`) remove it before the process ends; `temporary_directory` does
the same for the working directories of a run (the new weights' scratch file, the model files
made for onnxruntime); `OutputError` is a path that cannot be written or a failed write (disk
full, I/O error): one line naming the path.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
from pathlib import Path

from . import supervise

# Pseudo filesystems no model belongs in: files there are kernel interfaces (creating one fails,
# or worse, writes to a kernel setting).
_PSEUDO_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
# A temporary name is ".NAME.<8 random characters>.tmp": this many characters longer than NAME.
_TEMP_EXTRA = len(".") + 8 + len(".tmp")
# Suffixes appended to OUT's name for files written next to it (the external data file,
# ".<16 hex digits of its digest>.data": modelsave.data_file_name).
_SIDE_SUFFIXES = ("." + "0" * 16 + ".data",)

_live: set[str] = set()
_live_directories: set[str] = set()
# While a temporary is being created and registered, a signal waits (its handler would find the
# new file or directory not yet registered): the signal numbers that came meanwhile.
_creating = 0
_pending: list[int] = []


class OutputError(Exception):
    """An output that cannot be written (a bad path, a full disk, an I/O error): the message is
    one line naming the path; the CLI exits with status 2."""


def _directory(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def check_output_path(path: str | os.PathLike, label: str = "output") -> None:
    """Raise OutputError (one line) when `path` cannot be written; nothing is left behind.

    Checked: not a directory, not under /proc, /sys or /dev, the directory exists and is a
    directory, the name (with the temporary and side-file suffixes) fits the filesystem's name
    length, and a file can actually be created there (a probe file, removed at once: permission
    bits alone miss read-only mounts and full disks)."""
    path = Path(path)
    if not path.name or path.name in (".", ".."):
        raise OutputError(f"{path}: cannot write {label}: not a file name")
    directory = _directory(path)
    absolute = Path(os.path.abspath(directory))
    try:
        real = absolute.resolve()
    except OSError:  # a symlink loop
        real = absolute
    for root in _PSEUDO_ROOTS:
        for p in (absolute, real):
            if p == root or root in p.parents:
                raise OutputError(f"{path}: cannot write {label}: {root} is a kernel pseudo filesystem, not storage")
    try:
        if not directory.exists():
            raise OutputError(f"{path}: cannot write {label}: directory {directory} does not exist")
        if not directory.is_dir():
            raise OutputError(f"{path}: cannot write {label}: {directory} is not a directory")
    except OSError as e:  # a directory name too long, a symlink loop...
        raise OutputError(f"{path}: cannot write {label}: {_reason(e)}") from None
    try:
        name_max = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    extra = max(len(s) for s in _SIDE_SUFFIXES) + _TEMP_EXTRA
    if len(os.fsencode(path.name)) + extra > name_max:
        raise OutputError(f"{path}: cannot write {label}: the file name is {len(os.fsencode(path.name))} bytes long;"
                          f" this filesystem takes at most {name_max - extra} here (temporary and data files"
                          " add to it)")
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; give the {label} a file name")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot write {label}: directory {directory} is not writable")
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(f"{path}: cannot write {label}: {_reason(e)}") from None
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass


def _reason(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    if e.errno == errno.EROFS:
        return "read-only file system"
    if e.errno == errno.EDQUOT:
        return "disk quota exceeded"
    if e.errno == errno.ENAMETOOLONG:
        return "file name too long"
    return (e.strerror or type(e).__name__).lower() if e.strerror else str(e)


def write_error(path: str | os.PathLike, e: OSError, label: str = "output") -> OutputError:
    """The one-line error of a failed write of `path`."""
    return OutputError(f"{path}: cannot write {label}: {_reason(e)}")


@contextlib.contextmanager
def _signals_wait():
    global _creating
    _creating += 1
    try:
        yield
    finally:
        _creating -= 1
        if not _creating and _pending:
            signum = _pending[0]
            _pending.clear()
            _on_signal(signum, None)


def temporary(directory: str | os.PathLike, name: str) -> tuple[int, str]:
    """(fd, path) of a new temporary file for `name` in `directory`, registered for removal on
    SIGTERM/SIGINT until `release` (after its rename, or its removal)."""
    with _signals_wait():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        _live.add(tmp)
        supervise.record("+", "f", os.path.abspath(tmp))
    return fd, tmp


def temporary_directory(prefix: str, directory: str | os.PathLike | None = None) -> str:
    """A new temporary directory (in `directory`, else the system's temporary directory),
    removed with everything in it on SIGTERM/SIGINT until `remove_directory`."""
    with _signals_wait():
        made = tempfile.mkdtemp(prefix=prefix, dir=directory)
        _live_directories.add(made)
        supervise.record("+", "d", os.path.abspath(made))
    return made


def remove_directory(path: str) -> None:
    """Remove a temporary directory and everything in it (if it is still there) and forget it."""
    shutil.rmtree(path, ignore_errors=True)
    _live_directories.discard(path)
    supervise.record("-", "d", os.path.abspath(path))


def release(tmp: str) -> None:
    _live.discard(tmp)
    supervise.record("-", "f", os.path.abspath(tmp))


def publish(tmp: str, final: str | os.PathLike, keep_temporary: bool = False, also_release=()) -> None:
    """Rename the temporary file `tmp` to `final` and forget it, with no signal handled in
    between. keep_temporary: `final` stays one of the run's temporary files (removed on a
    signal) until a later publish names it in `also_release`, which releases those paths the
    moment `final` is in place."""
    with _signals_wait():
        os.replace(tmp, final)
        if keep_temporary:
            _live.add(str(final))
            supervise.record("+", "f", os.path.abspath(final))
        release(tmp)
        for path in also_release:
            release(str(path))


def remove(tmp: str) -> None:
    """Remove a temporary file (if it is still there) and forget it."""
    try:
        os.unlink(tmp)
    except OSError:
        pass
    release(tmp)


def is_live(path: str | os.PathLike) -> bool:
    return str(path) in _live


def live_temporaries() -> list[str]:
    return sorted(_live | _live_directories)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like KeyboardInterrupt (every `finally` runs); the CLI
    exits with 128 + the signal's number (143, 129)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = int(signum)


def _on_signal(signum, frame):
    if _creating:
        _pending.append(signum)
        return
    for tmp in list(_live):
        remove(tmp)
    for path in list(_live_directories):
        remove_directory(path)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def remove_temporaries_on_signals() -> None:
    """Install the SIGTERM, SIGINT and SIGHUP handlers (main thread only; elsewhere a no-op):
    registered temporary files are removed at once, then the run unwinds (KeyboardInterrupt or
    Terminated) so that every cleanup on the way runs too. A SIGHUP that was being ignored (a
    run under nohup) stays ignored."""
    try:
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, _on_signal)
    except ValueError:  # not the main thread
        pass
