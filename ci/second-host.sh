#!/usr/bin/env bash
# A second host for a finished build: a container of the debootstrapped Debian 12 base
# (ci/base-image.sh), which never held the build's directory and gets nothing of it, receives
#  1. the wheel `python -m installer wheel` made from the build: pip install into a fresh venv of
#     Debian's own python3 (whose executable copies `environ`: where an RTLD_DEEPBIND'ed UCX
#     crashed), with torch and numpy from WHEELS, then `python -m kvruntime selftest`, every mode
#     moving bytes between two processes, bit-exact;
#  2. the binary cache the build is published to here: `python -m installer --binary-cache` into
#     another prefix (/opt/kvstack), relocated and verified there (built, loaded, moved) before it
#     switches.
# Usage: ci/second-host.sh BASE_TAG PREFIX WHEELS_DIR   (DOCKER_HOST names the daemon; the mirror's
# wheels/ and the build's recipe overlays are taken from where the build's manifest says)
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: ci/second-host.sh BASE_TAG PREFIX WHEELS_DIR} prefix=${2:?} wheels=${3:?}
. ci/venv.sh; kvstack_venv
out=_work/second-host
rm -rf "$out"; mkdir -p "$out/in/wheel" "$out/in/overlays" "$out/in/mirror"
"$PY" -m installer wheel --prefix "$prefix" -o "$out/in/wheel"
"$PY" -m installer publish "$out/in/cache" --prefix "$prefix"
# the same recipe gives the same build id there: the build's overlays, and its mirror's tool wheels
"$PY" - "$prefix/manifest.json" "$out/in" <<'EOF'
import json, os, shutil, sys
m, into = json.load(open(sys.argv[1])), sys.argv[2]
files = m["kvstack_plan"]["recipe_files"]
for i, f in enumerate(files[2:]):  # after defaults.toml and the platform's file
    shutil.copy(f, f"{into}/overlays/{i:02d}-{os.path.basename(f)}")
shutil.copytree(os.path.join(m["mirror"], "wheels"), f"{into}/mirror/wheels")
print(f"build {m['build_id']}: {len(files) - 2} overlay(s), python {m['python']['version']}")
EOF
ca=/etc/ssl/certs/ca-certificates.crt  # this host's bundle, with the intercepting proxy's CA
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | docker run --rm -i --network host \
  --cap-add SYS_PTRACE -v "$PWD/$out/in:/in:ro" -v "$(realpath "$wheels"):/torch:ro" -v "$ca:/host-ca.crt:ro" \
  -e PIP_CERT=/host-ca.crt \
  -e DEBIAN_FRONTEND=noninteractive "$base" bash -euo pipefail -c '
    mkdir /src && cd /src && tar -xf -
    apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
    for d in /work /root/.cache/kvstack; do [ ! -e "$d" ] || { echo "error: $d exists here" >&2; exit 1; }; done
    echo "second host: $(python3 --version), nothing of the build here"

    echo "--- the wheel, pip-installed into a fresh venv"
    start=$SECONDS
    python3 -m venv /opt/v
    /opt/v/bin/pip install -q --disable-pip-version-check --no-index --find-links /torch torch numpy /in/wheel/*.whl
    echo "installed: $(basename /in/wheel/*.whl) in $((SECONDS - start)) s"
    cd /tmp
    PYTHONPATH=/src /opt/v/bin/python -m kvruntime selftest > /tmp/wheel-selftest.txt ||
      { grep -v "^SKIP" /tmp/wheel-selftest.txt; exit 1; }
    grep -v "^SKIP" /tmp/wheel-selftest.txt
    echo "selftest from the wheel: $(grep -c "^PASS" /tmp/wheel-selftest.txt) modes passed, $((SECONDS - start)) s with the install"
    /opt/v/bin/pip uninstall -q -y "$(basename /in/wheel/*.whl | cut -d- -f1)"

    echo "--- the binary cache, into another prefix"
    cd /src
    set -- --platform cpu --prefix /opt/kvstack --python /opt/v/bin/python --mirror /in/mirror \
      --binary-cache /in/cache --system-packages ignore
    for f in /in/overlays/*.toml; do [ -e "$f" ] && set -- "$@" --recipe-overlay "$f"; done
    bash ci/setup.sh "$@" > /tmp/cache-install.txt 2>&1 || { tail -40 /tmp/cache-install.txt; exit 1; }
    grep -E "installed: |from binary cache|verification|^ +(ok|FAIL|skip)" /tmp/cache-install.txt | head -40
    grep -q "from binary cache" /tmp/cache-install.txt ||
      { echo "error: the install did not take the build from the binary cache" >&2; tail -40 /tmp/cache-install.txt; exit 1; }'
