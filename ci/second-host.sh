#!/usr/bin/env bash
# A second host for a finished build's wheel: a container with no network (--network none: anything
# that reaches out fails) of the debootstrapped Debian 12 base with Debian's python3 in it
# (ci/offline-base.sh), which never held the build's directory and gets nothing of it, receives the
# wheel `python -m installer wheel` made from the build: pip install, with no index, into a fresh
# venv of Debian's own python3 (whose executable copies `environ`: where an RTLD_DEEPBIND'ed UCX
# crashed), with torch and numpy from WHEELS, then `python -m kvruntime selftest`, every mode moving bytes between
# two processes, bit-exact. (The build's binary cache goes to a second host too: the cpu image's
# build stage installs from it, with no network either, relocated and verified at all three levels;
# ci/containers.sh.)
# Usage: ci/second-host.sh OFFLINE_BASE_TAG PREFIX WHEELS_DIR   (DOCKER_HOST names the daemon)
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: ci/second-host.sh OFFLINE_BASE_TAG PREFIX WHEELS_DIR} prefix=${2:?} wheels=${3:?}
. ci/venv.sh; kvstack_venv
out=_work/second-host
rm -rf "$out"; mkdir -p "$out/in/wheel"
"$PY" -m installer wheel --prefix "$prefix" -o "$out/in/wheel"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - |
  docker run --rm -i --network none --cap-add SYS_PTRACE -v "$PWD/$out/in:/in:ro" \
  -v "$(realpath "$wheels"):/torch:ro" "$base" bash -euo pipefail -c '
    mkdir /src && cd /src && tar -xf -
    probe="import socket; socket.create_connection((\"pypi.org\", 443), 5)"
    if python3 -c "$probe" 2>/dev/null; then
      echo "error: the second host reaches the network" >&2; exit 1; fi
    for d in /work /root/.cache/kvstack; do [ ! -e "$d" ] || { echo "error: $d exists here" >&2; exit 1; }; done
    echo "second host: $(python3 --version), no network, nothing of the build here"

    echo "--- the wheel, pip-installed into a fresh venv"
    start=$SECONDS
    python3 -m venv /opt/v
    /opt/v/bin/pip install -q --disable-pip-version-check --no-index --find-links /torch torch numpy /in/wheel/*.whl
    echo "installed: $(basename /in/wheel/*.whl) in $((SECONDS - start)) s"
    cd /tmp
    PYTHONPATH=/src /opt/v/bin/python -m kvruntime selftest > /tmp/wheel-selftest.txt ||
      { grep -v "^SKIP" /tmp/wheel-selftest.txt; exit 1; }
    grep -v "^SKIP" /tmp/wheel-selftest.txt
    echo "selftest from the wheel: $(grep -c "^PASS" /tmp/wheel-selftest.txt) modes passed, $((SECONDS - start)) s with the install"'
