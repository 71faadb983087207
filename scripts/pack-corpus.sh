#!/usr/bin/env bash
# Packs a generated seed set into one gzipped tar, the form the conformance
# test reads for the large sets (tests/conformance.rs, `corpus`): every file
# under DIR, named DIR's base name/FILE, in byte order, with fixed owners,
# modes and times, so that the same files give the same archive.
# Usage: scripts/pack-corpus.sh DIR OUT.tar.gz
set -euo pipefail
[ $# = 2 ] && [ -d "$1" ] || { echo "usage: $0 DIR OUT.tar.gz" >&2; exit 2; }
src=$(cd "$1" && pwd)
out=$2
(cd "$(dirname "$src")" && find "$(basename "$src")" -type f | LC_ALL=C sort \
    | tar --owner=0 --group=0 --numeric-owner --mtime=@0 --mode=0644 --format=ustar -cf - -T -) \
    | gzip -9n > "$out"
