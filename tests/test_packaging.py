"""What ships: the sdist carries every file the native library is built from, and an optimized
model runs, on onnxfuse's kernels, in a virtual environment that has the plain `onnxruntime`
wheel and nothing of onnxfuse but the library file, through the README's own Python snippet."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxfuse
from onnxfuse.fused import DOMAIN_VERSION
from small_models import with_fused_op_set

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
LIBRARY_PLACEHOLDER = '"/path/to/_onnxfuse_ops.so"'
MODEL_FILE = "char_rnn.opt.onnx"


def _sdist_names(outdir: Path) -> tuple[str, set[str]]:
    done = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(outdir), str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "warn" in line.lower()]
    assert not warnings, f"building the sdist warns: {warnings}"
    (sdist,) = glob.glob(str(outdir / "onnxfuse-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    return top, {n[len(top) + 1:] for n in names if n.startswith(top + "/")}


def test_sdist_carries_every_file_the_library_and_package_are_built_from(tmp_path):
    top, names = _sdist_names(tmp_path)
    assert top == f"onnxfuse-{onnxfuse.__version__}"
    kernels = sorted(p.relative_to(REPO).as_posix() for pattern in ("*.cc", "*.h", "*.inc")
                     for p in (REPO / "kernels").glob(pattern))
    assert any(k.endswith(".cc") for k in kernels) and any(k.endswith(".inc") for k in kernels)
    missing = [k for k in kernels if k not in names]
    assert not missing, f"the sdist lacks {missing}: add them to MANIFEST.in"
    # Every quoted #include of a kernel source names a file the sdist has.
    for source in kernels:
        for included in re.findall(r'^#include "([^"]+)"', (REPO / source).read_text(), re.M):
            assert f"kernels/{included}" in names, f"{source} includes {included}, which the sdist lacks"
    for required in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "models/manifest.json",
                     "models/char_rnn.onnx", "onnxfuse/__init__.py", "onnxfuse/__main__.py", "onnxfuse/cuda/codegen.py"):
        assert required in names, f"the sdist lacks {required}"
    python = sorted(p.relative_to(REPO).as_posix() for d in ("onnxfuse", "passes") for p in (REPO / d).rglob("*.py"))
    assert not [p for p in python if p not in names]
    assert not [n for n in names if n.endswith((".so", ".pyc"))], "build products in the sdist"
    # Tests run from a clone (they need conftest.py, bench/ and the zoo's sources): none ship.
    assert not [n for n in names if n.startswith("tests/")], "test files in the sdist"
    # Every committed corpus model is package data of a declared package.
    corpus = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "models" / "corpus").glob("*.onnx"))
    assert corpus and not [c for c in corpus if c not in names]


def test_package_metadata_names_license_authors_and_the_extras():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and newer")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["authors"]
    extras = project["optional-dependencies"]
    assert set(extras) == {"cpu", "gpu", "cuda", "test", "bench"}
    # onnxruntime has a lower and an upper bound in every extra that brings it, the same in all
    bounds = {dep.split(">=", 1)[1] for deps in extras.values() for dep in deps if dep.startswith("onnxruntime")}
    assert len(bounds) == 1 and "<" in next(iter(bounds)), bounds
    # each extra is documented for users
    install = (REPO / "docs" / "install.md").read_text()
    for extra in extras:
        assert f"[{extra}]" in install or f"{extra}]" in install, f"docs/install.md does not document [{extra}]"


def _plain_onnxruntime_python(cache_dir: Path) -> str:
    """A virtual environment with the plain onnxruntime wheel (onnxruntime's own version here)
    and numpy, nothing else; created once and kept in pytest's cache directory."""
    python = cache_dir / "bin" / "python"
    probe = [str(python), "-c", "import onnxruntime, numpy"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(cache_dir)], check=True, timeout=300)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           f"onnxruntime=={ort.__version__}", "numpy"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"installing onnxruntime from PyPI failed:\n{done.stderr[-3000:]}"
    return str(python)


def _readme_python_snippet() -> str:
    text = README.read_text()
    block = re.search(r"<!-- app-python -->\s*```python\n(.*?)```\s*<!-- /app-python -->", text, re.S)
    assert block, "README.md: no Python snippet between the app-python markers"
    return block.group(1)


CHECKS = '''
# --- appended by the test ---
import importlib.util
from importlib import metadata
assert importlib.util.find_spec("onnxfuse") is None and importlib.util.find_spec("onnx") is None
assert metadata.version("onnxruntime")
try:
    metadata.version("onnxruntime-gpu")
    raise SystemExit("onnxruntime-gpu is installed in the plain environment")
except metadata.PackageNotFoundError:
    pass
np.save("logits.npy", logits)
options = ort.SessionOptions()
options.register_custom_ops_library(library)
try:
    ort.InferenceSession("newer_opset.onnx", options, providers=["CPUExecutionProvider"])
    print("REFUSAL: none")
except Exception as e:
    print("REFUSAL:", e)
'''


def test_readme_snippet_runs_the_optimized_model_in_plain_onnxruntime(tmp_path, request):
    python = _plain_onnxruntime_python(Path(request.config.cache.mkdir(f"plain-onnxruntime-{ort.__version__}")))
    optimized = onnxfuse.optimize("zoo:char_rnn", count_kernels=False, threads=1).model
    onnxfuse.save(optimized, str(tmp_path / MODEL_FILE))
    onnxfuse.save(with_fused_op_set(optimized, DOMAIN_VERSION + 1), str(tmp_path / "newer_opset.onnx"))

    snippet = _readme_python_snippet()
    assert LIBRARY_PLACEHOLDER in snippet and f'"{MODEL_FILE}"' in snippet
    script = snippet.replace(LIBRARY_PLACEHOLDER, repr(onnxfuse.get_library_path())) + CHECKS
    (tmp_path / "app.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ONNXFUSE_LIBRARY")}
    done = subprocess.run([python, "app.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]

    refusal = next(line for line in done.stdout.splitlines() if line.startswith("REFUSAL:"))
    assert f"was written for onnxfuse op set {DOMAIN_VERSION + 1}" in refusal, refusal

    inputs = {"tokens": np.arange(16, dtype=np.int64).reshape(1, 16)}
    inputs.update({name: np.zeros((1, 128), np.float32) for name in ("h0.0", "c0.0", "h0.1", "c0.1")})
    plain = ort.InferenceSession(str(REPO / "models" / "char_rnn.onnx"), providers=["CPUExecutionProvider"])
    expected = plain.run(None, inputs)[0]
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, rtol=1e-3, atol=1e-4)
