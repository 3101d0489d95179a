#!/usr/bin/env bash
# Build once, deploy many, proved on a GPU host (issue 30): build the pinned cuda stack with the
# installer from a source mirror, make its wheel, remove the build (prefix, builds, the installer's
# cache), pip install the wheel into a fresh venv, and run kvruntime's selftest from it.
#
#   bash ci/cuda-wheel-check.sh MIRROR [OUTDIR] [DEVICE_IDS...]     (default ids: 0 1, else 0 0)
#
# MIRROR holds every pinned archive (../shared/mirror). KVSTACK_BUILT_PREFIX names a cuda build
# already made on this host instead (it is removed like one made here). The python3 on PATH needs the installer's
# dependencies (.[installer]) and torch with CUDA; the host needs autotools and libtool (Debian's
# libtool .deb unpacks with dpkg -x where none is installed). CI has no GPU: this runs on a GPU
# host, its figures go to BENCHMARKS.md.
#
# The wheel requires numpy and nvidia-cuda-runtime==13.* (its libcudart.so.13, loaded by the
# wheel's preload from site-packages/nvidia/cu13/lib): pip installs it with its dependencies and no index
# (GPU hosts here are offline), so they must already be in the fresh venv's view — python3's
# site-packages, seen through a .pth (torch's cu13 wheels require the same nvidia-cuda-runtime) —
# or be wheels in KVSTACK_WHEELS (default: .whl/ of this checkout, where it exists). The script
# says which it took, and the wheel's tag and requirements. Making the wheel needs auditwheel
# (the installer extra's range) in python3: installed from KVSTACK_WHEELS where python3 lacks it
# (auditwheel, pyelftools and packaging wheels: pip download them on a connected host).
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

if [ -n "${KVSTACK_BUILT_PREFIX:-}" ]; then
  # a verified cuda build of this checkout already on the host (made the same way): taken as
  # the build, and removed with its builds and the installer's default cache like one made here
  prefix=$(realpath -s "$KVSTACK_BUILT_PREFIX") cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvstack
  step "build: the one at $prefix (KVSTACK_BUILT_PREFIX)"
  [ -e "$prefix/manifest.json" ] || { echo "$prefix holds no finished build"; exit 1; }
else
  step "build: python -m installer --platform cuda from $mirror"
  python3 -m installer --platform cuda --mirror "$mirror" --recipe-overlay "$mirror/asio-overlay.toml" \
    --prefix "$prefix" --cache-dir "$cache" --system-packages ignore >"$out/install.log" 2>&1
  rc=$?; tail -8 "$out/install.log"; ((rc == 0)) || { echo "install failed (exit $rc): $out/install.log"; exit "$rc"; }
fi
cp "$prefix/manifest.json" "$out/manifest.json"

step "wheel"
carried=${KVSTACK_WHEELS:-.whl}
links=(); [ -d "$carried" ] && links=(--find-links "$carried")
aw=$(python3 -c 'import tomllib; print(next(r for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["installer"] if r.startswith("auditwheel")))')
python3 -c 'import auditwheel' 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check --no-index "${links[@]}" "$aw" || {
  echo "python3 has no $aw and $carried holds none: pip download -d .whl '$aw' pyelftools packaging, and carry .whl/ here"; exit 1; }
python3 -m installer wheel --prefix "$prefix" -o "$wheels" || exit 1

step "the build removed: $prefix, its builds, the installer's cache"
rm -rf "$prefix" "$prefix.builds" "$cache"

step "pip install into a fresh venv (torch and what the wheel requires from python3's site-packages, by a .pth)"
whl=$(ls "$wheels"/*.whl)
cp "$whl" "$out/"  # kept: another GPU host installs it without building (its tests, its figures)
python3 - "$whl" <<'PY'
import os, sys, zipfile
whl = zipfile.ZipFile(sys.argv[1])
print("wheel:", os.path.basename(sys.argv[1]))
for name in whl.namelist():
    if name.endswith(".dist-info/WHEEL") or name.endswith(".dist-info/METADATA"):
        print("\n".join(l for l in whl.read(name).decode().splitlines() if l.startswith(("Tag: ", "Requires-Dist: "))))
PY
t=$SECONDS
python3 -m venv "$venv" || exit 1
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
"$venv/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/kvstack-torch.pth", "w").write(sys.argv[1])' "$site"
"$venv/bin/pip" install --disable-pip-version-check --no-index "${links[@]}" "$whl" >"$out/pip.log" 2>&1 || {
  tail -5 "$out/pip.log"
  echo "pip install failed: what the wheel requires is neither in $site nor in $carried; on a connected host:" \
       "pip download --no-deps -d .whl 'nvidia-cuda-runtime==13.*' numpy, and carry .whl/ here"; exit 1; }
grep -E '^(Requirement already|Processing|Successfully)' "$out/pip.log"
echo "pip install: $((SECONDS - t)) s"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
d = md.distribution("nvidia-cuda-runtime")
print(f"nvidia-cuda-runtime {d.version} from {d.locate_file('')}")
PY

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
# the module the selftest loaded (the recipe names a pattern, nixl_cu*: the wheel's is nixl_cu13)
module=$("$venv/bin/python" -c 'import json, os, sys; print(os.path.basename(os.path.dirname(json.load(open(sys.argv[1]))["nixl_module_file"])))' "$out/selftest.json")
"$venv/bin/python" - "$module" <<'PY'
import importlib, sys
importlib.import_module(f"{sys.argv[1]}._api")
maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line})
print("libcudart loaded from:", ", ".join(maps) or "nowhere")
PY
rm -rf "$work"
exit "$rc"
