#!/usr/bin/env bash
# CI's pinned builds: the stacks the recipes pin, built by the installer and verified at all three
# levels: cpu, xpu (UCX v1.22.0, the release pin) and xpu variant ze-ipc (UCX at the head of
# upstream pull request 11218). The sources come from a mirror when there is one (KVSTACK_MIRROR,
# else ../shared/mirror beside the checkout: CI cannot reach the upstream hosts; the mirror's
# archives are byte-identical to the pins), else from the recipes' upstream URLs (a clone with
# network); either way each file is checked against its recipe's sha256. No Intel GPU here: the
# loaded level runs `ucx_info -d` under the Level Zero null driver (built from its pinned
# level-zero), the moved level moves host memory between two processes on each fresh build.
#
# The installer's own verification is the proof (all three levels, before each prefix switches):
# nothing runs it twice. Leaves the prefixes at _work/pinned/{cpu,xpu,xpu-ipc} (ignored paths;
# ci/containers.sh reads _work/pinned/cpu), the builds' venv _work/pinned/venv, and
# _work/pinned/env.sh, which exports their absolute paths for the steps that follow:
# KVSTACK_PINNED_PREFIX_CPU, _XPU, _XPU_IPC, and KVSTACK_WHEEL_PREFIX (the cpu one).
# The cache directory _work/pinned/cache serves every build of the run (sources, build tools,
# autoconf results; compiled objects through ccache, below); a re-run with nothing changed builds
# nothing. The installer removes each build's source and build trees once it is finished.
# Usage: ci/pinned-builds.sh [--fetch-only] [INSTALLER_ARGS...]: --fetch-only fetches and checks
# the three builds' sources into the cache and stops; INSTALLER_ARGS go to every installer call.
# PY: the installer's python.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PY:-$root/.venv/bin/python}
out=$root/_work/pinned
fetch_only=0
if [ "${1:-}" = --fetch-only ]; then fetch_only=1; shift; fi
extra=("$@")
if [ -n "${KVSTACK_MIRROR:-}" ] || [ -e ../shared/mirror ]; then
  mirror=${KVSTACK_MIRROR:-../shared/mirror}
  if [ ! -f "$mirror/SHA256SUMS" ]; then
    echo "error: $mirror is no source mirror (no SHA256SUMS);" \
      "fill it with: python -m installer mirror $mirror" >&2
    exit 1
  fi
  sources=(--mirror "$mirror")
  # kvstack's own mirror holds asio as its headers from a clone, pinned by this overlay (its README)
  if [ -f "$mirror/asio-overlay.toml" ]; then
    sources+=(--recipe-overlay "$mirror/asio-overlay.toml")
  fi
  where="the mirror $mirror"
else
  sources=()
  where="the recipes' upstream URLs (no KVSTACK_MIRROR, no ../shared/mirror)"
fi
# name, then the installer's platform arguments
builds=("cpu --platform cpu" "xpu --platform xpu" "xpu-ipc --platform xpu --variant ze-ipc")
# Every source of the three builds first: a pin that cannot be had shows now, not after a build.
for b in "${builds[@]}"; do
  read -r name args <<< "$b"
  echo "--- pinned $name: sources from $where"
  # shellcheck disable=SC2086  # $args is a list of words
  "$py" -m installer $args "${sources[@]}" "${extra[@]}" --cache-dir "$out/cache" --fetch-only
done
if [ "$fetch_only" = 1 ]; then exit 0; fi
mkdir -p "$out"
# The three builds compile much the same code (Abseil is the same source and flags in each: ~100 s a
# build on 2 cores; NIXL the same in all three but for the UCX headers its UCX plugin includes):
# with ccache (ci/test.sh installs it) a later build takes an identical compile's object from an
# earlier one. Each build compiles inside its own build directory (installer/plan.py: WORK), and
# ccache's base_dir hands the compiler paths under _work/pinned relative to its directory, so a
# dependency's headers are ../../../ucx/include in every build whatever its prefix and id:
# __FILE__ strings in these builds (UCX's, e.g. "../../src/ucx/src/ucs/async/async.c") are relative,
# so they are not byte for byte the build of an uncached install with the same build id (CI
# compares none).
if [ -d /usr/lib/ccache ] && command -v ccache >/dev/null; then
  export PATH=/usr/lib/ccache:$PATH CCACHE_DIR=$out/ccache CCACHE_BASEDIR=$out
fi

# The builds' own Python environment (CI runs the tests in .venv while these compile): each
# install links its NIXL module into its target Python (kvstack-nixl.pth, the last one wins) and
# the verification's moved level runs kvruntime's selftest there. It sees .venv's packages (torch,
# kvruntime) through a path hook, so nothing is installed twice, and .venv itself is left alone.
venv=$out/venv
if [ ! -x "$venv/bin/python" ]; then
  base=$("$py" -c "import sys; print(getattr(sys, '_base_executable', sys.executable))")
  "$base" -m venv --without-pip "$venv"
fi
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
own=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$site')" > "$own/kvstack-tests-venv.pth"

# env.sh names each build as soon as it is verified (the tests of the cpu build can start while
# the xpu ones compile), and only then
printf '# written by ci/pinned-builds.sh: the pinned builds of this checkout finished so far\n' > "$out/env.sh"
for b in "${builds[@]}"; do
  read -r name args <<< "$b"
  start=$SECONDS
  echo "--- pinned $name: python -m installer $args ${sources[*]} ${extra[*]}"
  # shellcheck disable=SC2086  # $args is a list of words
  "$py" -m installer $args "${sources[@]}" "${extra[@]}" \
    --prefix "$out/$name" --cache-dir "$out/cache" --python "$venv/bin/python"
  echo "--- pinned $name: $((SECONDS - start)) s"
  var=KVSTACK_PINNED_PREFIX_$(echo "$name" | tr a-z- A-Z_)
  echo "export $var='$out/$name'" >> "$out/env.sh"
  if [ "$name" = cpu ]; then echo "export KVSTACK_WHEEL_PREFIX='$out/$name'" >> "$out/env.sh"; fi
done
if [ -n "${CCACHE_DIR:-}" ]; then
  echo "--- ccache: $(ccache --print-stats | awk '$1 ~ /^(direct_cache_hit|preprocessed_cache_hit|cache_miss)$/ {printf "%s %s ", $1, $2}')"
fi
