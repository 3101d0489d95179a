#!/usr/bin/env bash
# Build once, deploy many, proved on a GPU host (issue 30): build the pinned cuda stack with the
# installer from a source mirror, make its wheel, remove the build (prefix, builds, the installer's
# cache), pip install the wheel into a fresh venv, and run kvruntime's selftest from it.
#
#   bash ci/cuda-wheel-check.sh MIRROR [OUTDIR] [DEVICE_IDS...]     (default ids: 0 1, else 0 0)
#
# MIRROR holds every pinned archive (../shared/mirror). The python3 on PATH needs the installer's
# dependencies (.[installer]) and torch with CUDA; the host needs autotools and libtool (Debian's
# libtool .deb unpacks with dpkg -x where none is installed). CI has no GPU: this runs on a GPU
# host, its figures go to BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
mirror=$(realpath "${1:?usage: bash ci/cuda-wheel-check.sh MIRROR [OUTDIR] [DEVICE_IDS...]}")
out=$(realpath -m "${2:-_work/cuda-wheel-check}"); shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/kvstack-cuda-wheel.XXXX")
prefix=$work/kvstack cache=$work/cache wheels=$work/wheels venv=$work/fresh
if (($#)); then ids=("$@"); elif [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then ids=(0 1); else ids=(0 0); fi
step() { printf '=== %s (+%ss)\n' "$1" "$SECONDS"; }
SECONDS=0

step "build: python -m installer --platform cuda from $mirror"
python3 -m installer --platform cuda --mirror "$mirror" --recipe-overlay "$mirror/asio-overlay.toml" \
  --prefix "$prefix" --cache-dir "$cache" --system-packages ignore >"$out/install.log" 2>&1
rc=$?; tail -8 "$out/install.log"; ((rc == 0)) || { echo "install failed (exit $rc): $out/install.log"; exit "$rc"; }
cp "$prefix/manifest.json" "$out/manifest.json"

step "wheel"
python3 -m installer wheel --prefix "$prefix" -o "$wheels" || exit 1

step "the build removed: $prefix, its builds, the installer's cache"
rm -rf "$prefix" "$prefix.builds" "$cache"

step "pip install into a fresh venv (torch from this python's site-packages, by a .pth)"
t=$SECONDS
python3 -m venv "$venv" || exit 1
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
"$venv/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/kvstack-torch.pth", "w").write(sys.argv[1])' "$site"
"$venv/bin/pip" install -q --no-index --no-deps "$wheels"/*.whl || exit 1
echo "pip install: $((SECONDS - t)) s"

step "selftest --device-ids ${ids[*]} from the wheel"
t=$SECONDS
"$venv/bin/python" -m kvruntime selftest --device-ids "${ids[@]}" --json >"$out/selftest.json" 2>"$out/selftest.err"
rc=$?
echo "selftest: exit $rc, $((SECONDS - t)) s"
"$venv/bin/python" - "$out/selftest.json" <<'PY'
import collections, json, sys
report = json.load(open(sys.argv[1]))
print("ok", report["ok"], "module", report["nixl_module_file"],
      dict(collections.Counter(m["status"] for m in report["modes"])))
PY
rm -rf "$work"
exit "$rc"
