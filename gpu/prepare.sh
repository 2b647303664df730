#!/usr/bin/env bash
# Build, on a machine with network access, the bundle an offline GPU host needs to run onnxfuse's
# GPU tests and benchmarks (gpu/run.sh):
#
#   bash gpu/prepare.sh            -> .gpu-bundle/ (git-ignored) and the steps that follow
#
# The bundle holds what the host cannot download: the onnxruntime-gpu wheel, pycuda's source
# (built on the host against its CUDA), and the pure-Python or small wheels the tests import
# (onnx-graphsurgeon, pytools with its compiled dependency siphash24, platformdirs, mako), all
# for the host's Python version and platform, plus MANIFEST: the sha256 of every piece, which
# gpu/run.sh checks before installing anything. Downloads are kept in .gpu-bundle/ between runs.
#
# Environment:
#   ORT_VERSION     onnxruntime-gpu version (default 1.31.1)
#   HOST_PYTHON     the host's Python version, for which wheels are fetched (default 3.12)
#   HOST_PLATFORM   the host's wheel platform tags, space-separated
#                   (default: manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
#   PART_MIB        split every file larger than this many MiB into NAME.partNN pieces, for a
#                   transfer medium with a file-size limit; gpu/run.sh joins them (default: no split)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
say() { printf '[prepare] %s\n' "$*"; }
die() { printf '[prepare] ERROR: %s\n' "$*" >&2; exit 1; }

ort_version=${ORT_VERSION:-1.31.1}
host_python=${HOST_PYTHON:-3.12}
read -r -a platforms <<< "${HOST_PLATFORM:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}"
root=.gpu-bundle
dl=$root/downloads
git check-ignore -q "$root/x" || die "$root/ is not git-ignored: it must never be committed"
mkdir -p "$dl"

# 1. Downloads: binary wheels for the host's Python and platform, pycuda as source.
platform_opts=()
for p in "${platforms[@]}"; do platform_opts+=(--platform "$p"); done
wheels=("onnxruntime-gpu==$ort_version" onnx-graphsurgeon rich markdown-it-py mdurl pygments pytools platformdirs mako siphash24)
say "downloading ${wheels[*]} for CPython $host_python (${platforms[*]}) into $dl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$host_python" --implementation cp \
    "${platform_opts[@]}" -d "$dl" "${wheels[@]}" || die "pip download of the wheels failed"
say "downloading pycuda's source into $dl"
python3 -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$dl" pycuda || die "pip download of pycuda failed"
ls "$dl"/onnxruntime_gpu-"$ort_version"-*.whl "$dl"/pycuda-*.tar.gz >/dev/null || die "a download is missing in $dl"

# 2. The bundle: every download (split into parts where PART_MIB asks), then MANIFEST.
bundle=$root/bundle
rm -rf "$bundle" && mkdir -p "$bundle"
for f in "$dl"/*; do
  size=$(stat -c %s "$f")
  if [ -n "${PART_MIB:-}" ] && [ "$size" -gt $(( PART_MIB * 1048576 )) ]; then
    split -b "${PART_MIB}M" -d -a 2 "$f" "$bundle/$(basename "$f").part"
  else
    ln -f "$f" "$bundle/" 2>/dev/null || cp "$f" "$bundle/"
  fi
done
{
  echo "# onnxfuse GPU bundle: sha256 and name of every piece; checked by gpu/run.sh"
  echo "python $host_python"
  echo "commit $(git rev-parse HEAD)"
  (cd "$bundle" && sha256sum -- *)
} > "$root/MANIFEST"
cp "$root/MANIFEST" "$bundle/MANIFEST"

say "bundle: $bundle ($(du -sh "$bundle" | cut -f1), $(ls "$bundle" | wc -l) files)"
cat <<EOF

Next, on the GPU host:
  1. Copy this working tree there with $bundle/ in it (or put the bundle's files in any
     folder there and name it with ONNXFUSE_BUNDLE_DIR). Pieces may arrive in several transfers:
     \`bash gpu/stage.sh DIR...\` moves them from where they landed into the bundle folder and
     lists what MANIFEST still misses.
  2. \`bash gpu/run.sh\` installs the bundle into a virtual environment, builds onnxfuse, runs the
     GPU tests and the GPU benchmarks, and writes bench/results/gpu_*.md.
  3. Copy bench/results/gpu_* back into this tree and commit them.
EOF
