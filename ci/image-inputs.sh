#!/usr/bin/env bash
# What a CI image is built from besides its wheels (ci/image-wheels.sh): a pinned build CI made
# (ci/pinned-builds.sh), published to a binary cache, so the image's build stage takes that build,
# verified there, instead of compiling it a second time (relocated by the installer's own
# patchelf: no build tool); the build's recipe overlays (the same recipe gives the same build id
# inside) and its mirror's build-tool wheels (a build, were the entry refused). The same knobs serve a user: `installer image --binary-cache DIR --mirror DIR
# --recipe-overlay TOML --wheels DIR`.
# Usage: ci/image-inputs.sh OUT PREFIX (PY or .venv's python runs the installer).
# Writes OUT/cache/, OUT/overlays/*.toml, OUT/mirror/ (SHA256SUMS, wheels/); prints one line per part.
set -euo pipefail
out=${1:?usage: ci/image-inputs.sh OUT PREFIX} prefix=${2:?usage: ci/image-inputs.sh OUT PREFIX}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
[ -e "$prefix/manifest.json" ] || { echo "error: $prefix holds no finished build (ci/pinned-builds.sh makes one)" >&2; exit 1; }
rm -rf "$out" && mkdir -p "$out/overlays" "$out/mirror"
out=$(cd "$out" && pwd)

(cd "$root" && "$py" -m installer publish "$out/cache" --prefix "$prefix" >/dev/null)
(cd "$root" && "$py" - "$prefix/manifest.json" "$out") <<'PY'
import json, os, shutil, sys
m, out = json.load(open(sys.argv[1])), sys.argv[2]
for i, f in enumerate(m["kvstack_plan"]["recipe_files"][2:]):  # after defaults.toml and the platform's file
    shutil.copy(f, f"{out}/overlays/{i:02d}-{os.path.basename(f)}")
PY
mirror=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["mirror"])' "$prefix/manifest.json")
case $mirror in /*) ;; *) mirror=$root/$mirror ;; esac  # the installer ran from the checkout
cp "$mirror/SHA256SUMS" "$out/mirror/" && cp -r "$mirror/wheels" "$out/mirror/wheels"
echo "binary cache: build $(ls "$out/cache") of $prefix"
echo "overlays: $(cd "$out/overlays" && ls | tr '\n' ' ')"
