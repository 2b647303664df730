#!/usr/bin/env bash
# On the offline GPU host, in a copy of this working tree: install the bundle gpu/prepare.sh
# built, build onnxfuse, run the GPU tests and the GPU benchmarks, and write the results.
#
#   bash gpu/run.sh            setup + tests + benchmarks
#   bash gpu/run.sh setup      only the installation (idempotent: done steps are skipped)
#   bash gpu/run.sh test       setup (skipped when done) + pytest -m gpu
#   bash gpu/run.sh bench      setup (skipped when done) + python -m bench.gpu
#
# Installs into a virtual environment that sees the host's own packages (numpy, onnx, pytest,
# and torch or cupy where present) after its own, so the bundled onnxruntime-gpu shadows a
# CPU-only onnxruntime of the host. The CUDA libraries onnxruntime-gpu loads (cudart, cublas,
# cublasLt, cufft, curand, cudnn) come from nvidia-* pip packages where the host has them
# (PyTorch installs them), else from CUDA_ROOT.
# Results: bench/results/gpu_*.md and *.json in this tree.
# Environment:
#   ONNXFUSE_BUNDLE_DIR  the bundle's folder (default .gpu-bundle/bundle in this tree)
#   ONNXFUSE_VENV        the virtual environment (default .gpu-venv in this tree)
#   PYTHON               the host's Python (default python3)
#   CUDA_ROOT            the CUDA toolkit (default: found from nvcc)
#   ONNXFUSE_COMMIT      the commit to report when this copy has no git history
#   TIME_LIMIT_S         seconds this run may take; the benchmarks get what the tests leave
#                        (default: no limit)
set -euo pipefail
phase=${1:-all}
case "$phase" in all|setup|test|bench) ;; *) echo "usage: gpu/run.sh [all|setup|test|bench]" >&2; exit 2;; esac
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bundle=${ONNXFUSE_BUNDLE_DIR:-$repo/.gpu-bundle/bundle}
venv=${ONNXFUSE_VENV:-$repo/.gpu-venv}
work=$venv/work
results=$repo/bench/results
time_limit=${TIME_LIMIT_S:-}
mkdir -p "$results"
step() { printf '\n=== [run %3ds] %s\n' "$SECONDS" "$*"; }
die() { printf '\n!!! [run] FAILED: %s\n' "$*" >&2; exit 1; }
relative() { sed "s#$repo/##g"; }  # reports name the tree's files relative to it

host_py=${PYTHON:-python3}
command -v "$host_py" >/dev/null || die "$host_py not found"
pyver=$("$host_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
nvcc_bin=$(command -v nvcc || true)
cuda_root=${CUDA_ROOT:-$( [ -n "$nvcc_bin" ] && dirname "$(dirname "$(readlink -f "$nvcc_bin")")" || echo /usr/local/cuda)}
export CUDA_ROOT=$cuda_root CUDA_HOME=$cuda_root

# ------------------------------------------------------------------------------------ setup ----
setup() {
  step "checking the bundle in $bundle against its MANIFEST"
  ONNXFUSE_BUNDLE_DIR=$bundle bash gpu/stage.sh
  [ -f "$bundle/MANIFEST" ] || die "$bundle/MANIFEST missing: copy the bundle gpu/prepare.sh built there"
  (cd "$bundle" && awk 'length($1) == 64 && $1 ~ /^[0-9a-f]+$/' MANIFEST | sha256sum -c --quiet) \
    || die "a bundle piece is missing or corrupt (see above)"
  echo "all pieces present and intact"
  mkdir -p "$work"
  local part
  for part in "$bundle"/*.part00; do  # files gpu/prepare.sh split for the transfer
    [ -f "$part" ] || continue
    cat "${part%.part00}".part?? > "$work/$(basename "${part%.part00}")"
  done

  local bundled_py
  bundled_py=$(awk '$1 == "python" {print $2}' "$bundle/MANIFEST")
  step "python: $host_py ($pyver); CUDA_ROOT=$cuda_root"
  [ "$pyver" = "$bundled_py" ] || echo "WARNING: the bundle holds wheels for Python $bundled_py; this python is $pyver"
  if [ ! -x "$venv/bin/python" ]; then
    step "creating $venv (host packages visible after its own)"
    "$host_py" -m venv --without-pip "$venv"
    local own host_sites
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    host_sites=$("$host_py" -c 'import site; print(" ".join(site.getsitepackages()))')
    for s in $host_sites; do echo "import site; site.addsitedir('$s')"; done > "$own/_onnxfuse_host_site.pth"
    echo "host site-packages: $host_sites"
  fi
  py=$venv/bin/python
  site_dir=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$py" -m pip --version >/dev/null 2>&1 || die "pip is not importable from $venv (host pip missing?)"

  step "installing the bundled wheels (onnxruntime-gpu, onnx-graphsurgeon, rich and its dependencies, pytools, platformdirs, mako, siphash24)"
  shopt -s nullglob
  local wheels=("$bundle"/*.whl "$work"/*.whl)
  shopt -u nullglob
  "$py" -m pip install -q --no-index --no-deps "${wheels[@]}" || die "installing the bundled wheels failed"

  # onnxruntime-gpu dlopens the CUDA libraries: from nvidia-* pip packages where present.
  local libdirs
  libdirs=$("$py" - <<'PY'
import glob, os, site
dirs = []
for sp in site.getsitepackages():
    for lib in sorted(glob.glob(os.path.join(sp, "nvidia", "**", "lib*.so*"), recursive=True)):
        d = os.path.dirname(lib)
        if d not in dirs:
            dirs.append(d)
print(":".join(dirs))
PY
)
  export LD_LIBRARY_PATH="${libdirs}${libdirs:+:}$cuda_root/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "export LD_LIBRARY_PATH=\"$LD_LIBRARY_PATH\"" > "$venv/env.sh"

  if [ ! -f "$site_dir/.pycuda_built" ] && [ ! -f "$site_dir/.pycuda_failed" ]; then
    step "building pycuda from source in the background (log: $work/pycuda.log)"
    (
      set -e
      src=$work/pycuda-src
      rm -rf "$src" && mkdir -p "$src"
      tar -C "$src" --strip-components=1 -xzf "$(ls "$bundle"/pycuda-*.tar.gz "$work"/pycuda-*.tar.gz 2>/dev/null | head -1)"
      cd "$src"
      curand=True
      ls "$cuda_root"/lib64/libcurand.so* >/dev/null 2>&1 || curand=False
      printf 'CUDA_ROOT = "%s"\nCUDA_ENABLE_CURAND = %s\nCUDA_ENABLE_GL = False\n' "$cuda_root" "$curand" > siteconf.py
      "$py" -m pip install -v --no-index --no-deps --no-build-isolation . && touch "$site_dir/.pycuda_built"
    ) > "$work/pycuda.log" 2>&1 || touch "$site_dir/.pycuda_failed" &
    pycuda_pid=$!
  fi

  if ! "$py" -c "import onnxfuse.runtime as r; r.library_path()" >/dev/null 2>&1 || [ -n "$(find kernels -newer "$venv/.onnxfuse_built" 2>/dev/null | head -1)" ] || [ ! -f "$venv/.onnxfuse_built" ]; then
    step "installing onnxfuse (editable) and building its native library"
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e "$repo" || die "building onnxfuse failed"
    touch "$venv/.onnxfuse_built"
  fi

  step "checking that onnxruntime is the GPU build and runs on CUDA"
  "$py" - <<'PY' || die "onnxruntime-gpu cannot run on CUDA here (see above)"
import glob, os, subprocess, sys
import numpy as np
import onnx
from onnx import helper, TensorProto
import onnxruntime as ort
print("onnxruntime", ort.__version__, "from", os.path.dirname(ort.__file__))
print("available providers:", ort.get_available_providers())
if "CUDAExecutionProvider" not in ort.get_available_providers():
    sys.exit("this onnxruntime has no CUDAExecutionProvider: the host's CPU build shadows onnxruntime-gpu")
g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g",
                      [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in "ab"],
                      [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
so = ort.SessionOptions(); so.log_severity_level = 1
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
print("session providers:", s.get_providers())
if s.get_providers()[0] != "CUDAExecutionProvider":
    prov = glob.glob(os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so"))
    if prov:
        print(subprocess.run(["ldd", prov[0]], capture_output=True, text=True).stdout)
    sys.exit("the CUDA execution provider did not load (missing CUDA libraries? see ldd above)")
x = np.arange(4, dtype=np.float32)
assert np.array_equal(s.run(None, {"a": x, "b": x})[0], 2 * x)
print("CUDA EP ok")
PY

  if [ -n "${pycuda_pid:-}" ]; then
    step "waiting for the pycuda build"
    wait "$pycuda_pid" || true
  fi
  if [ -f "$site_dir/.pycuda_built" ] && "$py" -c "import pycuda.driver as d; d.init(); print('pycuda', __import__('pycuda').VERSION_TEXT, 'devices:', d.Device.count())"; then
    :
  else
    echo "WARNING: pycuda is not usable; the standalone kernel tests fall back to CuPy. Last lines of the build log:"
    tail -25 "$work/pycuda.log" 2>/dev/null || true
  fi
}

env_report() {
  local commit
  commit=${ONNXFUSE_COMMIT:-$(git -C "$repo" rev-parse --verify -q HEAD 2>/dev/null || awk '$1 == "commit" {print $2 " (at prepare time)"}' "$bundle/MANIFEST" 2>/dev/null || echo unknown)}
  "$py" - "$commit" <<'PY'
import platform, subprocess, sys
def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, shell=True).stdout.strip()
    except Exception as e:
        return f"({e})"
import numpy, onnx, onnxruntime
try:
    import pycuda; pyc = pycuda.VERSION_TEXT
except Exception:
    pyc = "not available"
print(f"- device: {sh('nvidia-smi --query-gpu=name,memory.total --format=csv,noheader')}")
print(f"- driver: {sh('nvidia-smi --query-gpu=driver_version --format=csv,noheader')}")
print(f"- nvcc: {sh('nvcc --version | tail -1')}")
print(f"- python {platform.python_version()}, numpy {numpy.__version__}, onnx {onnx.__version__}, "
      f"onnxruntime-gpu {onnxruntime.__version__}, pycuda {pyc}")
print(f"- onnxfuse commit: {sys.argv[1]}")
PY
}

setup
py=$venv/bin/python
# shellcheck disable=SC1091
. "$venv/env.sh"
stamp=$(date -u +%Y%m%d-%H%M%S)
env_md=$venv/env.md
env_report > "$env_md"
cat "$env_md"
[ "$phase" = setup ] && exit 0

status=0
if [ "$phase" = all ] || [ "$phase" = test ]; then
  step "GPU tests: pytest -m gpu"
  set +e
  timeout_opt=()
  "$py" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout 300)
  "$py" -m pytest -m gpu tests -q -rs -p no:cacheprovider "${timeout_opt[@]}" \
      --junitxml="$results/gpu_tests.xml" 2>&1 | tee "$work/gpu-tests.txt"
  status=${PIPESTATUS[0]}
  set -e
  {
    echo "# onnxfuse GPU tests ($stamp)"
    echo
    cat "$env_md"
    echo
    echo '```'
    tail -60 "$work/gpu-tests.txt"
    echo '```'
  } | relative > "$results/gpu_tests.md"
  echo "pytest exit status: $status (results in bench/results/gpu_tests.md)"
fi

if [ "$phase" = all ] || [ "$phase" = bench ]; then
  left=$(( ${time_limit:-1000000000} - SECONDS ))
  if [ "$left" -lt 90 ]; then
    step "no time left for the benchmarks within TIME_LIMIT_S ($left s): run 'bash gpu/run.sh bench'"
  else
    # First the opt-in CUDA attention kernel (pass option attention_cuda) on the model it is for
    # (two short cases), then every model with the default passes in the time that is left.
    step "GPU benchmark of gpt_stack with fuse-attention on cuda (budget 90 s)"
    "$py" -m bench.gpu --models gpt_stack --attention --budget 90 --env "$env_md" \
        --md "$results/gpu_bench_attention.md" --json "$results/gpu_bench_attention.json" || die "bench.gpu --attention failed"
    left=$(( ${time_limit:-1000000000} - SECONDS ))
    step "GPU benchmarks (budget $((left - 30)) s)"
    "$py" -m bench.gpu --budget $((left - 30)) --env "$env_md" \
        --md "$results/gpu_bench.md" --json "$results/gpu_bench.json" || die "bench.gpu failed"
  fi
fi
step "done (pytest status $status)"
exit "$status"
