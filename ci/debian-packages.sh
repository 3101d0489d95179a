#!/usr/bin/env bash
# How the Containerfile's stages install Debian packages: only those the base lacks (a base that
# has them all needs no network), or, with --unless-libraries "LIB...", all of them unless every
# library is known to ldconfig. OFFLINE=1 (installer image --offline: a build with no network)
# installs nothing: a base that lacks a package stops the build, naming what it lacks.
# Usage: debian-packages.sh [--unless-libraries "LIB..."] PACKAGE...
set -euo pipefail
libs=
if [ "${1:-}" = --unless-libraries ]; then libs=$2; shift 2; fi
[ $# -gt 0 ] || exit 0
missing=()
if [ -n "$libs" ]; then
  # grep reads all of ldconfig's output: with -q, ldconfig could die of SIGPIPE (pipefail)
  for lib in $libs; do ldconfig -p | grep -F "$lib" >/dev/null || { missing=("$@"); break; }; done
else
  for p in "$@"; do
    dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep '^ii' >/dev/null || missing+=("$p")
  done
fi
((${#missing[@]})) || exit 0
if [ "${OFFLINE:-0}" = 1 ]; then
  echo "error: offline build: the base image lacks ${missing[*]}${libs:+ (for $libs)};" \
    "use a base that has them (ci/offline-base.sh makes one)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
rm -rf /var/lib/apt/lists/*
