#!/usr/bin/env bash
# Prepare, on a machine with network access, what the offline GPU host needs to run onnxfuse's
# GPU tests and benchmarks, split into transfer groups that each fit one device call.
#
#   bash gpu/prepare.sh            -> .gpu-bundle/g1 .. .gpu-bundle/gN and the calls to make
#
# What it builds (in the git-ignored .gpu-bundle/):
#   dl/          what /work/shared/gpu/bundle.sh downloads (onnxruntime-gpu cp312 wheel, pycuda
#                source, onnx-graphsurgeon, pytools, platformdirs, mako) plus siphash24, which
#                pytools needs and the host lacks
#   the onnxruntime-gpu wheel's contents repacked as .tar.xz (195 MiB instead of 244 MiB: one
#   transfer fewer), split into parts
#   gK/          transfer groups of at most GROUP_MIB MiB; the last one also holds the small files
#                and MANIFEST (sha256 of every piece, checked on the host)
#
# Environment: ORT_VERSION (1.31.1), GROUP_MIB (default: what the 64 MiB transfer limit leaves
# after the working tree, at most 58), ORT_PACK=wheel to skip the xz repack (one more group),
# BUNDLE_SH (path of bundle.sh).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
say() { printf '[prepare] %s\n' "$*"; }
die() { printf '[prepare] ERROR: %s\n' "$*" >&2; exit 1; }

ort_version=${ORT_VERSION:-1.31.1}
root=.gpu-bundle
dl=$root/dl
bundle_sh=${BUNDLE_SH:-}
for cand in "$bundle_sh" /work/shared/gpu/bundle.sh shared/gpu/bundle.sh; do
  [ -n "$cand" ] && [ -f "$cand" ] && { bundle_sh=$cand; break; }
done
[ -f "$bundle_sh" ] || die "bundle.sh not found (set BUNDLE_SH)"
git check-ignore -q "$root/x" || die "$root/ is not git-ignored: it must never be committed"

# 1. Downloads (kept between runs).
wheel_glob="onnxruntime_gpu-${ort_version}-cp312-*.whl"
if ! ls $dl/$wheel_glob >/dev/null 2>&1; then
  if ls $dl/$wheel_glob.part00 >/dev/null 2>&1; then
    say "joining the wheel parts bundle.sh left in $dl"
  else
    say "downloading with $bundle_sh into $dl (onnxruntime-gpu $ort_version for cp312)"
    PART_MB=100000 bash "$bundle_sh" "$dl" "$ort_version"
  fi
  if ls $dl/$wheel_glob.part00 >/dev/null 2>&1; then
    first=$(ls $dl/$wheel_glob.part00)
    cat "${first%.part00}".part?? > "${first%.part00}" && rm "${first%.part00}".part??
  fi
fi
wheel=$(ls $dl/$wheel_glob) || die "no onnxruntime-gpu wheel in $dl"
if ! ls $dl/siphash24-*.whl >/dev/null 2>&1; then
  say "downloading siphash24 (a compiled dependency of pytools) for cp312"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dl" siphash24
fi
ls $dl/pycuda-*.tar.gz $dl/onnx_graphsurgeon-*.whl $dl/pytools-*.whl $dl/platformdirs-*.whl $dl/mako-*.whl \
   $dl/siphash24-*.whl >/dev/null || die "a download is missing in $dl"

# 2. The onnxruntime-gpu payload: xz-compressed tar of the wheel's contents (or the wheel itself).
if [ "${ORT_PACK:-xz}" = wheel ]; then
  payload=$wheel
else
  payload=$dl/$(basename "$wheel" .whl).tar.xz
  if [ ! -f "$payload" ] || [ "$payload" -ot "$wheel" ]; then
    say "repacking $(basename "$wheel") as $(basename "$payload") (xz, takes a few minutes)"
    tmp=$(mktemp -d)
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$wheel" "$tmp"
    tar -C "$tmp" -cf - . | xz -T0 -6 > "$payload.tmp"
    mv "$payload.tmp" "$payload"
    rm -rf "$tmp"
  fi
fi

# 3. Transfer groups: the working tree travels with every call, so each group gets what is left.
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
tree_mib=$(( (tree_bytes + 1048575) / 1048576 ))
default_group=$(( 64 - tree_mib - 3 ))
[ $default_group -gt 58 ] && default_group=58
group_mib=${GROUP_MIB:-$default_group}
[ "$group_mib" -ge 8 ] || die "the working tree ($tree_mib MiB) leaves too little of the 64 MiB per call"
say "working tree: $tree_mib MiB; transfer groups of at most $group_mib MiB"

rm -rf "$root"/g[0-9]* "$root/parts"
mkdir -p "$root/parts"
split -b "${group_mib}M" -d -a 2 "$payload" "$root/parts/$(basename "$payload").part"
small=($dl/pycuda-*.tar.gz $dl/onnx_graphsurgeon-*.whl $dl/pytools-*.whl $dl/platformdirs-*.whl
       $dl/mako-*.whl $dl/siphash24-*.whl)
small_bytes=$(du -cb "${small[@]}" | tail -1 | cut -f1)
parts=($root/parts/*)
n=${#parts[@]}
last_bytes=$(stat -c %s "${parts[$((n - 1))]}")
groups=$n
[ $((last_bytes + small_bytes + 65536)) -gt $((group_mib * 1048576)) ] && groups=$((n + 1))
for i in $(seq 1 $groups); do mkdir -p "$root/g$i"; done
for i in $(seq 1 $n); do mv "${parts[$((i - 1))]}" "$root/g$i/"; done
cp "${small[@]}" "$root/g$groups/"
rmdir "$root/parts"
{
  echo "# onnxfuse GPU bundle: sha256 and name of every piece; checked by gpu/run.sh"
  echo "payload $(basename "$payload")"
  echo "commit $(git rev-parse HEAD)"
  (cd "$root" && sha256sum g*/* | sed 's#  g[0-9]*/#  #')
} > "$root/MANIFEST"
cp "$root/MANIFEST" "$root/g$groups/MANIFEST"

say "groups:"
for i in $(seq 1 $groups); do
  printf '  %s  %s MiB: %s\n' "$root/g$i" "$(( ($(du -cb "$root/g$i" | tail -1 | cut -f1) + 1048575) / 1048576 ))" \
    "$(ls "$root/g$i" | tr '\n' ' ')"
done
cat <<EOF

Device calls to make, back to back (the machine stays warm for only ~30 s between calls; if it
goes back, the staged parts are lost and gpu/run.sh says which are missing):
EOF
for i in $(seq 1 $((groups - 1))); do
  echo "  run(carry=[\"$root/g$i\"], command=\"bash gpu/stage.sh $root/g$i\", timeout_s=120)"
done
echo "  run(carry=[\"$root/g$groups\"], command=\"bash gpu/run.sh\", timeout_s=600)"
echo "then, if the first run stopped before the benchmarks:"
echo "  run(command=\"bash gpu/run.sh bench\", timeout_s=600)"
echo "Copy the returned files into bench/results/ and commit them."
