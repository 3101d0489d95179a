#!/usr/bin/env bash
# The bases of CI's second hosts, which run with no network (the wheel's host: docker run
# --network none, ci/second-host.sh; the images' builds: installer image --offline): the
# debootstrapped Debian 12 base (ci/base-image.sh) with the Debian packages the Containerfile's
# stages install (through ci/debian-packages.sh), put in once by apt, here, as debootstrap put in
# the rest: the hosts are made with the network, nothing is installed on them with it.
#   BUILD_TAG    the build stage's (and the wheel's second host's): python3 and its venv, the
#                compiler and headers kvruntime's block-id reader is built with, and what the
#                stack loads (its verification runs there)
#   RUNTIME_TAG  the runtime stage's: python3 and what the stack loads, no compiler
# What the stack loads: libnuma (UCX), rdma-core's libraries (every platform's UCX), Level Zero's
# loader (xpu's; installer/image.py RUNTIME_PACKAGES).
# Usage: ci/offline-base.sh BASE_TAG BUILD_TAG RUNTIME_TAG   (DOCKER_HOST names the daemon)
set -euo pipefail
usage="usage: ci/offline-base.sh BASE_TAG BUILD_TAG RUNTIME_TAG"
base=${1:?$usage} build=${2:?$usage} runtime=${3:?$usage}
loads="libnuma1 libibverbs1 librdmacm1 ibverbs-providers libze1"
name=kvstack-offline-base-$$
trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT
# commit_base TAG PACKAGE...: BASE with the packages, committed as TAG
commit_base() {
  local tag=$1; shift
  docker run --name "$name" --network host -e DEBIAN_FRONTEND=noninteractive "$base" \
    bash -euo pipefail -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends $* >/dev/null
      rm -rf /var/lib/apt/lists/*"
  docker commit "$name" "$tag" >/dev/null
  docker rm "$name" >/dev/null
  echo "offline base $tag: $base with $*"
}
commit_base "$build" python3 python3-venv ca-certificates gcc libc6-dev python3-dev $loads
commit_base "$runtime" python3 $loads
