#!/usr/bin/env bash
# Debian source packages as installer sources, for hosts that cannot reach the pinned upstream
# ones (CI): for each PACKAGE, apt-get source + dpkg-source -x (its debian/ dir and quilt patches
# applied, as its autogen needs), packed reproducibly (same bytes and sha256 on every run, so
# image layers built from it are reused) into OUT/mirror with SHA256SUMS, and a recipe overlay
# OUT/debian-sources.toml naming each as source "PACKAGE-debian". Lay ci/debian-ucx.toml over it
# to build UCX from it.
# Usage: ci/debian-sources.sh OUT PACKAGE... (needs deb-src lines and dpkg-dev; ci/test.sh adds
# both). Exits 3 when apt-get source fails (no deb-src lines), 1 on any other error.
set -euo pipefail
out=${1:?usage: ci/debian-sources.sh OUT PACKAGE...}
shift
[ $# -gt 0 ] || { echo "usage: ci/debian-sources.sh OUT PACKAGE..." >&2; exit 1; }
mkdir -p "$out/mirror"
out=$(cd "$out" && pwd)
: > "$out/debian-sources.toml"
for pkg in "$@"; do
  src=$(mktemp -d "$out/src.XXXXXX")
  (cd "$src" && apt-get source -qq --download-only "$pkg" >/dev/null 2>"$src/apt.log") || {
    echo "error: apt-get source $pkg failed (no deb-src lines? ci/test.sh adds them): $(tail -1 "$src/apt.log")" >&2
    rm -rf "$src"; exit 3; }
  dsc=$(cd "$src" && ls "${pkg}"_*.dsc)
  version=${dsc#"${pkg}"_}; version=${version%.dsc}
  top=$pkg-$version
  (cd "$src" && dpkg-source --no-check -x "$dsc" "$top" >/dev/null)
  name=$top-debian.tar.gz
  tar -C "$src" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - "$top" | gzip -n > "$out/mirror/$name"
  rm -rf "$src"
  sum=$(sha256sum "$out/mirror/$name" | cut -d' ' -f1)
  sums=$out/mirror/SHA256SUMS  # this file's line replaced, any other kept
  { grep -v "  $name\$" "$sums" 2>/dev/null || true; echo "$sum  $name"; } > "$sums.new" && mv "$sums.new" "$sums"
  cat >> "$out/debian-sources.toml" <<TOML
# $pkg from Debian's source package $dsc, packed by ci/debian-sources.sh
[sources.$pkg-debian]
url = "https://debian.invalid/$dsc"
filename = "$name"
sha256 = "$sum"

TOML
  echo "$pkg: $name from Debian's source package $dsc (sha256 $sum)"
done
