#!/usr/bin/env bash
# On the GPU host: gather the pieces of the bundle gpu/prepare.sh built into the bundle folder
# gpu/run.sh reads (.gpu-bundle/bundle/ in this tree, or $ONNXFUSE_BUNDLE_DIR), for a bundle that
# arrives in several transfers, then list what its MANIFEST still misses.
#
#   bash gpu/stage.sh DIR...    move every file of each DIR into the bundle folder
#   bash gpu/stage.sh           only list what is there and what is missing
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${ONNXFUSE_BUNDLE_DIR:-.gpu-bundle/bundle}
say() { printf '[stage] %s\n' "$*"; }
mkdir -p "$dest"
moved=0
for dir in "$@"; do
  [ -d "$dir" ] || { say "ERROR: $dir is not a folder" >&2; exit 1; }
  for f in "$dir"/*; do
    [ -f "$f" ] || continue
    [ "$(cd "$(dirname "$f")" && pwd)" = "$(cd "$dest" && pwd)" ] && continue
    mv -f "$f" "$dest/"
    say "staged $(basename "$f") ($(stat -c %s "$dest/$(basename "$f")") bytes)"
    moved=$((moved + 1))
  done
done
say "$moved file(s) staged; $dest holds $(ls "$dest" | wc -l) file(s)"
if [ -f "$dest/MANIFEST" ]; then
  missing=$(awk 'length($1) == 64 && $1 ~ /^[0-9a-f]+$/ {print $2}' "$dest/MANIFEST" | while read -r f; do [ -f "$dest/$f" ] || echo "$f"; done)
  if [ -n "$missing" ]; then say "still missing:"; echo "$missing" | sed 's/^/  /'; else say "every piece of the bundle is here"; fi
else
  say "no MANIFEST yet (it comes with the bundle)"
fi
