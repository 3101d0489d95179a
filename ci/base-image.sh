#!/usr/bin/env bash
# Makes a Debian 12 base image without a registry: debootstrap (minbase) from the apt mirror this
# host uses, packed once into a cached tarball, then `docker import`. Usage: ci/base-image.sh TAG
# (DOCKER_HOST must name the daemon; KVSTACK_CACHE overrides the tarball's folder).
set -euo pipefail
tag=${1:?usage: ci/base-image.sh TAG}
mirror=${KVSTACK_DEBIAN_MIRROR:-$(grep -rhE '^(URIs:|deb) ' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
  grep -oE 'https?://[^ ]+/debian/?$|https?://[^ ]+/debian/? ' | head -1 | tr -d ' ' || true)}
mirror=${mirror:-http://deb.debian.org/debian}
cache=${KVSTACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstack}
tarball=$cache/debian-bookworm-minbase.tar
if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || { echo "error: no debootstrap; run: sudo apt-get install debootstrap" >&2; exit 1; }
  root=$(mktemp -d); mkdir -p "$cache"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 ||
    { tail -20 "$root.log" >&2; echo "error: debootstrap from $mirror failed (log $root.log)" >&2; exit 1; }
  # the image's apt uses the same mirror and the security suite, like a stock Debian 12
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" > "$root/etc/apt/sources.list"
  tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$root"
fi
docker import "$tarball" "$tag" >/dev/null
echo "base image $tag from $tarball ($(du -h "$tarball" | cut -f1))"
