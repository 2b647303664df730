#!/usr/bin/env bash
# On the GPU host: move carried bundle groups out of the working tree into the staging folder
# (/tmp/onnxfuse-bundle, or $ONNXFUSE_BUNDLE_DIR), where gpu/run.sh reassembles them.
#
#   bash gpu/stage.sh .gpu-bundle/g1     one group (one device call per group)
#   bash gpu/stage.sh                    every group present in .gpu-bundle/
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${ONNXFUSE_BUNDLE_DIR:-/tmp/onnxfuse-bundle}
say() { printf '[stage] %s\n' "$*"; }
mkdir -p "$dest"
if [ $# -gt 0 ]; then groups=("$@"); else shopt -s nullglob; groups=(.gpu-bundle/g*); shopt -u nullglob; fi
moved=0
for g in "${groups[@]}"; do
  [ -d "$g" ] || { say "ERROR: $g is not here (was it named in carry?)" >&2; exit 1; }
  for f in "$g"/*; do
    [ -f "$f" ] || continue
    mv -f "$f" "$dest/" 2>/dev/null || cp -f "$f" "$dest/"
    say "staged $(basename "$f") ($(stat -c %s "$dest/$(basename "$f")") bytes)"
    moved=$((moved + 1))
  done
done
say "$moved file(s) staged; $dest now holds:"
ls -l "$dest" | sed 's/^/  /'
if [ -f "$dest/MANIFEST" ]; then
  missing=$(awk 'length($1) == 64 && $1 ~ /^[0-9a-f]+$/ {print $2}' "$dest/MANIFEST" | while read -r f; do [ -f "$dest/$f" ] || echo "$f"; done)
  if [ -n "$missing" ]; then say "still missing:"; echo "$missing" | sed 's/^/  /'; else say "every piece of the bundle is here"; fi
fi
df -h /tmp | tail -1 | awk '{print "[stage] /tmp free: " $4}'
