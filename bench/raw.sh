#!/usr/bin/env bash
# The raw outputs of GPU runs (the files the published results in bench/results/
# cite and the merges rebuild them from) are kept in one archive, bench/raw.tar.gz,
# not as a thousand tracked files; bench/raw/ is their unpacked, ignored copy.
#   bench/raw.sh           unpack the archive into bench/raw/ (only where the
#                          archive changed since the last unpack; files of new runs
#                          already there are left alone)
#   bench/raw.sh pack      pack bench/raw/ into the archive again (after a run's
#                          files were added): byte-identical files stored once
#                          (as hard links), names sorted, times and owners fixed,
#                          so the same files give the same archive
set -euo pipefail
B=$(cd "$(dirname "$0")" && pwd)
A=$B/raw.tar.gz
D=$B/raw
case "${1:-unpack}" in
  unpack)
    sum=$(sha256sum "$A" | cut -d' ' -f1)
    [ -f "$D/.unpacked" ] && [ "$(cat "$D/.unpacked")" = "$sum" ] && exit 0
    mkdir -p "$D"
    # Over what is there: the archive's files replaced, a new run's left alone;
    # the stamp last, so an unpack cut short is done again.
    tar -xzf "$A" -C "$D"
    echo "$sum" > "$D/.unpacked"
    ;;
  pack)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    (cd "$D" && find . -type f ! -name .unpacked -print0 | sort -z | while IFS= read -r -d '' f; do
      h=$(sha256sum "$f" | cut -d' ' -f1)
      mkdir -p "$tmp/t/$(dirname "$f")"
      if [ -e "$tmp/h/$h" ]; then ln "$tmp/h/$h" "$tmp/t/$f"; else mkdir -p "$tmp/h"; cp "$f" "$tmp/h/$h"; ln "$tmp/h/$h" "$tmp/t/$f"; fi
    done)
    tar --sort=name --mtime=2026-01-01 --owner=0 --group=0 --numeric-owner -C "$tmp/t" -cf - . | gzip -n -9 > "$A.new"
    mv "$A.new" "$A"
    sha256sum "$A" | cut -d' ' -f1 > "$D/.unpacked"
    echo "packed $(tar -tzf "$A" | grep -vc '/$') files into $A ($(du -h "$A" | cut -f1))"
    ;;
  *) echo "usage: bench/raw.sh [unpack|pack]" >&2; exit 2 ;;
esac
