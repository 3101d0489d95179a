#!/usr/bin/env bash
# What CI's cpu image is built from, since CI cannot reach the pinned GitHub sources: UCX from
# Debian's source package (ci/debian-sources.sh: apt-get source, dpkg-source -x with its patches,
# packed reproducibly) laid over the cpu recipe with NIXL disabled (ci/debian-ucx.toml), a wheelhouse
# for the image's venv: torch==2.13.0 with its dependencies, numpy, and NIXL from PyPI's
# nixl-cu12 wheel (no dependencies: it asks for torch, which is there). The same knobs serve a
# user with an offline mirror: `installer image --mirror DIR --recipe-overlay TOML --wheels DIR`.
# Usage: ci/image-inputs.sh OUT (needs deb-src lines, dpkg-dev; PY or .venv's python for pip).
# Writes OUT/mirror/, OUT/debian-ucx.toml, OUT/wheels/; prints one line per part.
set -euo pipefail
out=${1:?usage: ci/image-inputs.sh OUT}
py=${PY:-$(dirname "$0")/../.venv/bin/python}
pyver=${KVSTACK_IMAGE_PYTHON:-3.11}  # the base image's python3 (Debian 12)
rm -rf "$out" && mkdir -p "$out/wheels"
out=$(cd "$out" && pwd)

ucx=$(bash "$(dirname "$0")/debian-sources.sh" "$out" ucx)
# one overlay file for the image verb: where UCX comes from, then how it is built
cat "$out/debian-sources.toml" "$(dirname "$0")/debian-ucx.toml" > "$out/debian-ucx.toml"

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
echo "$ucx"
echo "nixl: $(cd "$out/wheels" && ls nixl_cu12-*.whl) (PyPI, no NIXL source reachable)"
echo "wheels: $(ls "$out/wheels" | wc -l) files, $(du -sh "$out/wheels" | cut -f1)"
