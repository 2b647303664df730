"""The C and C++ programs of the documentation (examples/run_char_rnn.c, .cpp) compile as written
against onnxruntime's headers, link against the wheel's own libonnxruntime.so.1.* by the recipe of
docs/deploy.md, and run an optimized char_rnn on onnxfuse's kernels with the logits Python gets.

The wheels ship no headers. The test takes them from $ONNXFUSE_ORT_INCLUDE (a folder holding
onnxruntime_c_api.h), else from the npm package HEADERS_PACKAGE (fetched once with `npm pack`,
about 150 MB, and only its headers kept under pytest's cache); it skips with the reason when
neither a compiler, nor headers can be had. Headers of an API version newer than the installed
onnxruntime are refused: the C API only grows, so older headers are valid, newer ones are not."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from onnxfuse.fused import DOMAIN_VERSION
from small_models import with_fused_op_set

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
# onnxruntime's MIT-licensed headers at ORT_API_VERSION 29 (onnxruntime 1.29), in a Unity
# package on npm; no package on PyPI, npm or Debian carries the headers of 1.30 or newer.
HEADERS_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
HEADERS_API_VERSION = 29


def _headers_from_npm(cache: Path) -> Path:
    headers = cache / "include"
    if (headers / "onnxruntime_c_api.h").is_file():
        return headers
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("no onnxruntime headers: $ONNXFUSE_ORT_INCLUDE is not set and npm is not installed")
    work = cache / "download"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        done = subprocess.run([npm, "pack", HEADERS_PACKAGE, "--silent", "--pack-destination", str(work)],
                              capture_output=True, text=True, timeout=600, cwd=work)
    except subprocess.TimeoutExpired:
        pytest.skip(f"no onnxruntime headers: npm pack {HEADERS_PACKAGE} timed out")
    tarballs = list(work.glob("*.tgz"))
    if done.returncode != 0 or len(tarballs) != 1:
        pytest.skip(f"no onnxruntime headers: npm pack {HEADERS_PACKAGE} failed: {done.stderr.strip()[-300:]}")
    staging = cache / "include.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    with tarfile.open(tarballs[0]) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".h")
                   and "/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers/" in m.name]
        for m in members:
            with tar.extractfile(m) as src:
                (staging / Path(m.name).name).write_bytes(src.read())
    shutil.rmtree(work)
    assert (staging / "onnxruntime_c_api.h").is_file(), f"{HEADERS_PACKAGE} no longer holds onnxruntime_c_api.h"
    staging.rename(headers)
    return headers


@pytest.fixture(scope="module")
def headers(request) -> Path:
    given = os.environ.get("ONNXFUSE_ORT_INCLUDE")
    if given:
        path = Path(given)
        assert (path / "onnxruntime_c_api.h").is_file(), f"$ONNXFUSE_ORT_INCLUDE={given} has no onnxruntime_c_api.h"
        return path
    return _headers_from_npm(Path(request.config.cache.mkdir("onnxruntime-headers-" + HEADERS_PACKAGE.replace("@", "-"))))


def _api_version(headers: Path) -> int:
    m = re.search(r"^#define ORT_API_VERSION (\d+)", (headers / "onnxruntime_c_api.h").read_text(), re.M)
    assert m, "onnxruntime_c_api.h defines no ORT_API_VERSION"
    return int(m.group(1))


def _runtime_api_version() -> int:
    major, minor = (int(x) for x in ort.__version__.split(".")[:2])
    assert major == 1
    return minor  # onnxruntime 1.N serves C API versions 1..N


def _link_folder(tmp_path: Path) -> Path:
    """The recipe of docs/deploy.md: the wheel has only libonnxruntime.so.1.X.Y, whose SONAME is
    libonnxruntime.so.1; a folder of the application links both names to it."""
    capi = Path(ort.__file__).parent / "capi"
    (versioned,) = capi.glob("libonnxruntime.so.1.*")
    folder = tmp_path / "ortlib"
    folder.mkdir()
    (folder / "libonnxruntime.so.1").symlink_to(versioned)
    (folder / "libonnxruntime.so").symlink_to("libonnxruntime.so.1")
    return folder


PROGRAMS = [("run_char_rnn.c", "gcc", ["-std=c11"]), ("run_char_rnn.cpp", "g++", ["-std=c++17"])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    optimized = onnxfuse.optimize("zoo:char_rnn", count_kernels=False, threads=1).model
    onnxfuse.save(optimized, str(folder / "char_rnn.opt.onnx"))
    onnxfuse.save(with_fused_op_set(optimized, DOMAIN_VERSION + 1), str(folder / "newer_opset.onnx"))
    return folder


def _python_logits(model: Path, library: str | None) -> np.ndarray:
    options = ort.SessionOptions()
    if library:
        options.register_custom_ops_library(library)
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    inputs = {"tokens": np.arange(16, dtype=np.int64).reshape(1, 16)}
    inputs.update({name: np.zeros((1, 128), np.float32) for name in ("h0.0", "c0.0", "h0.1", "c0.1")})
    return session.run(["logits"], inputs)[0].reshape(-1)


@pytest.mark.parametrize("source, compiler, flags", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_example_program_compiles_links_against_the_wheel_and_runs_on_onnxfuse_kernels(
        source, compiler, flags, headers, models, tmp_path):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed")
    assert _api_version(headers) <= _runtime_api_version(), (
        f"headers of C API {_api_version(headers)} are newer than onnxruntime {ort.__version__}")
    ortlib = _link_folder(tmp_path)
    program = tmp_path / "run_char_rnn"
    build = [compiler, *flags, "-Wall", "-Wextra", "-Werror", "-o", str(program), str(EXAMPLES / source),
             f"-I{headers}", f"-L{ortlib}", "-lonnxruntime", "-Wl,-rpath,$ORIGIN/ortlib"]
    done = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "ONNXFUSE_LIBRARY")}
    library = onnxfuse.get_library_path()
    done = subprocess.run([str(program), str(models / "char_rnn.opt.onnx"), library], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    logits = np.array([float(v) for v in done.stdout.split()], np.float32)
    # the same onnxruntime and the same kernels as Python's session with the library
    np.testing.assert_allclose(logits, _python_logits(models / "char_rnn.opt.onnx", library), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(logits, _python_logits(REPO / "models" / "char_rnn.onnx", None), rtol=1e-3, atol=1e-4)

    # The library is in use: a model needing a newer onnxfuse op set is refused by it, with one
    # message, where the program without the library would run the fallback functions.
    done = subprocess.run([str(program), str(models / "newer_opset.onnx"), library], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 1 and f"was written for onnxfuse op set {DOMAIN_VERSION + 1}" in done.stderr, done.stderr
    done = subprocess.run([str(program), str(models / "char_rnn.opt.onnx")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr


def test_documentation_shows_the_example_programs_verbatim():
    """Each code block marked `<!-- example: PATH -->` in README.md and docs/ is that file."""
    shown: set[str] = set()
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for path, block in re.findall(r"<!-- example: (\S+) -->\n```\w*\n(.*?)```\n<!-- /example -->",
                                      page.read_text(), re.S):
            assert block == (REPO / path).read_text(), f"{page.name}: the block of {path} differs from the file"
            shown.add(path)
    assert shown >= {"examples/run_char_rnn.c", "examples/run_char_rnn.cpp"}, shown
