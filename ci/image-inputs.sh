#!/usr/bin/env bash
# What CI's cpu image is built from, since CI cannot reach the pinned GitHub sources: UCX from
# Debian's source package (apt-get source, dpkg-source -x with its patches, packed reproducibly
# into a mirror with SHA256SUMS) laid over the cpu recipe with NIXL disabled, and a wheelhouse
# for the image's venv: torch==2.13.0 with its dependencies, numpy, and NIXL from PyPI's
# nixl-cu12 wheel (no dependencies: it asks for torch, which is there). The same knobs serve a
# user with an offline mirror: `installer image --mirror DIR --recipe-overlay TOML --wheels DIR`.
# Usage: ci/image-inputs.sh OUT (needs deb-src lines, dpkg-dev; PY or .venv's python for pip).
# Writes OUT/mirror/, OUT/debian-ucx.toml, OUT/wheels/; prints one line per part.
set -euo pipefail
out=${1:?usage: ci/image-inputs.sh OUT}
py=${PY:-$(dirname "$0")/../.venv/bin/python}
pyver=${KVSTACK_IMAGE_PYTHON:-3.11}  # the base image's python3 (Debian 12)
rm -rf "$out" && mkdir -p "$out/mirror" "$out/wheels" "$out/src"
out=$(cd "$out" && pwd)

(cd "$out/src" && apt-get source -qq --download-only ucx >/dev/null 2>"$out/src/apt.log") ||
  { tail -3 "$out/src/apt.log" >&2; echo "error: apt-get source ucx failed (no deb-src lines? ci/test.sh adds them)" >&2; exit 1; }
dsc=$(cd "$out/src" && ls ucx_*.dsc)
version=${dsc#ucx_}; version=${version%.dsc}
top=ucx-$version
(cd "$out/src" && dpkg-source --no-check -x "$dsc" "$top" >/dev/null)
# reproducible: same bytes (and sha256) on every run, so image layers built from it are reused
name=$top-debian.tar.gz
tar -C "$out/src" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - "$top" | gzip -n > "$out/mirror/$name"
sum=$(sha256sum "$out/mirror/$name" | cut -d' ' -f1)
echo "$sum  $name" > "$out/mirror/SHA256SUMS"
rm -rf "$out/src"

cat > "$out/debian-ucx.toml" <<EOF
# UCX from Debian's source package ($dsc) instead of the pinned upstream release: CI cannot reach
# GitHub. NIXL (and Abseil, asio) off: NIXL >= 1.x does not compile against UCX 1.13; the image
# takes NIXL from PyPI's nixl-cu12 wheel instead (--wheels).
[sources.ucx-debian]
url = "https://debian.invalid/$dsc"
filename = "$name"
sha256 = "$sum"

[components.ucx]
source = "ucx-debian"
# UCX 1.13 has no config/ directory to install (no etc/ucx/ucx.conf yet)
install_dirs = ["src/ucm", "src/ucs", "src/uct", "src/ucp", "src/tools/info", "cmake"]

[components.abseil]
enabled = false
[components.asio]
enabled = false
[components.nixl]
enabled = false

[build_tools]
python = []
target = []
EOF

# the wheels for the image's python, whatever this host's is; pip's cache (or find-links) serves
# what the test step already downloaded
nixl=$("$py" -m pip show nixl-cu12 2>/dev/null | sed -n 's/^Version: //p')
pip_dl() {
  "$py" -m pip download -q --disable-pip-version-check -d "$out/wheels" --only-binary=:all: \
    --python-version "$pyver" --implementation cp --platform manylinux_2_28_x86_64 "$@" 2>&1 | grep -v 'is ignored' >&2 || true
}
pip_dl "torch==2.13.0" numpy
pip_dl --no-deps "nixl-cu12${nixl:+==$nixl}"
ls "$out/wheels"/torch-2.13.0*.whl "$out/wheels"/nixl_cu12-*.whl >/dev/null 2>&1 ||
  { echo "error: pip download of torch==2.13.0 / nixl-cu12 for python $pyver failed" >&2; exit 1; }
echo "ucx: $name from Debian's source package $dsc (sha256 $sum)"
echo "nixl: $(cd "$out/wheels" && ls nixl_cu12-*.whl) (PyPI, no NIXL source reachable)"
echo "wheels: $(ls "$out/wheels" | wc -l) files, $(du -sh "$out/wheels" | cut -f1)"
