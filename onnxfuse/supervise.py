"""The `onnxfuse` command runs its work in a child process and watches it, so that a run that
dies without a word still ends in one line and a documented exit status.

Some failures cannot be caught inside the process: protobuf and onnxruntime dereference a
failed allocation when an address-space limit (`ulimit -v`, `prlimit --as`) runs out
(SIGSEGV), the kernel's out-of-memory killer sends SIGKILL, a native library can crash. The
parent, which imports nothing heavy and allocates nothing, reports such a death, removes the
temporary files the child had registered (outfiles writes each registration to a journal
file the parent names in ONNXFUSE_RUN_JOURNAL) and exits with:

- 2 for a crash while a memory limit is set (out of memory: the environment),
- 3 for any other crash (an internal error),
- 137 for SIGKILL (the out-of-memory killer, or `kill -9`).

SIGTERM, SIGINT and SIGHUP sent to the parent are passed to the child, which handles them as
always (outfiles); the child's own exit status is the command's.
"""
from __future__ import annotations

import os
import signal
import sys

JOURNAL_ENV = "ONNXFUSE_RUN_JOURNAL"
SUPERVISED_ENV = "ONNXFUSE_SUPERVISED"
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_KILLED = 128 + 9

_CRASHES = {signal.SIGSEGV: "segmentation fault", signal.SIGBUS: "bus error", signal.SIGILL: "illegal instruction",
            signal.SIGFPE: "arithmetic fault", signal.SIGABRT: "aborted"}


def wanted() -> bool:
    """Supervise unless this process is already the supervised child, or fork is missing."""
    return hasattr(os, "fork") and os.environ.get(SUPERVISED_ENV) != "1"


def memory_limit() -> int | None:
    """The process's address-space limit in bytes (RLIMIT_AS), or None when unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def limit_text(limit: int) -> str:
    return f"{limit / (1 << 20):.0f} MiB"


def run_supervised() -> None:
    """Fork: return in the child (which then does the work); in the parent, wait for it and
    exit with its status, or with one line for a death by signal (see the module's text)."""
    import tempfile

    try:
        fd, journal = tempfile.mkstemp(prefix="onnxfuse-run-", suffix=".journal")
        os.close(fd)
    except OSError:  # no writable temporary directory: the run itself will say so
        journal = ""
    sys.stdout.flush()
    sys.stderr.flush()
    passed_on = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    # Held from before the fork until the parent passes them on: none is lost or kills the
    # parent alone in between.
    signal.pthread_sigmask(signal.SIG_BLOCK, passed_on)
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, passed_on)
        os.environ[SUPERVISED_ENV] = "1"
        if journal:
            os.environ[JOURNAL_ENV] = journal
        return

    def pass_on(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in passed_on:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, pass_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, passed_on)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = 0
            break
    if journal:
        _remove_left_over(journal)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    signum = os.WTERMSIG(status)
    if signum == signal.SIGKILL:
        _say("error: killed (SIGKILL): the kernel's out-of-memory killer does this when memory runs out"
             " (or someone ran kill -9)")
        os._exit(EXIT_KILLED)
    if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # died before its handler was installed
        _say({signal.SIGTERM: "terminated", signal.SIGINT: "interrupted", signal.SIGHUP: "hung up"}[signum])
        os._exit(128 + signum)
    what = _CRASHES.get(signum, f"signal {signum}")
    limit = memory_limit()
    if limit is not None:
        _say(f"error: out of memory: the run crashed ({what}) with an address-space limit of {limit_text(limit)}"
             " (ulimit -v); raise the limit, or run it on a machine with more memory")
        os._exit(EXIT_BAD_INPUT)
    _say(f"internal error: the run crashed ({what})")
    os._exit(EXIT_INTERNAL)


def _say(text: str) -> None:
    try:
        os.write(2, f"onnxfuse: {text}\n".encode())
    except OSError:
        pass


def _remove_left_over(journal: str) -> None:
    """Remove what the journal says the child still had registered, then the journal."""
    import shutil

    live: dict[str, str] = {}
    try:
        with open(journal, encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                line = line.rstrip("\n")
                if len(line) < 3:
                    continue
                op, kind, path = line[0], line[1], line[2:]
                if op == "+":
                    live[path] = kind
                else:
                    live.pop(path, None)
    except OSError:
        pass
    for path, kind in live.items():
        try:
            if kind == "d":
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass
    try:
        os.unlink(journal)
    except OSError:
        pass


def record(op: str, kind: str, path: str) -> None:
    """In the supervised child: note in the journal that temporary `path` (kind "f" file, "d"
    directory) was registered ("+") or is gone or published ("-"). One short append per call;
    a journal that cannot be written only means less is cleaned up after a crash."""
    journal = os.environ.get(JOURNAL_ENV)
    if not journal or "\n" in path:
        return
    try:
        fd = os.open(journal, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return
    try:
        os.write(fd, f"{op}{kind}{path}\n".encode("utf-8", "surrogateescape"))
    except OSError:
        pass
    finally:
        os.close(fd)
