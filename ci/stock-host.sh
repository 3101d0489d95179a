#!/usr/bin/env bash
# README's set-up on a stock Debian 12 with the distribution's own python3 (PEP 668, no venv
# module until python3-venv): in a container of the debootstrapped base (ci/base-image.sh), from a
# fresh copy of the checkout, as root. The installer runs as far as its plan (--dry-run): the full
# build needs the pinned GitHub sources, which CI cannot reach. Usage: ci/stock-host.sh BASE_TAG
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: ci/stock-host.sh BASE_TAG}
ca=/etc/ssl/certs/ca-certificates.crt  # this host's bundle, with the intercepting proxy's CA
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | docker run --rm -i --network host \
  -v "$ca:/host-ca.crt:ro" -e PIP_CERT=/host-ca.crt -e DEBIAN_FRONTEND=noninteractive "$base" bash -euo pipefail -c '
    apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 >/dev/null
    mkdir /src && cd /src && tar -xf -
    echo "python3: $(command -v python3) $(python3 --version) externally managed: $(ls /usr/lib/python3*/EXTERNALLY-MANAGED)"
    bash ci/setup.sh --platform cpu --dry-run > /tmp/plan.txt && head -5 /tmp/plan.txt
    .venv/bin/python -m installer --platform cpu --dry-run --json | .venv/bin/python -c "import json,sys; print(\"plan ok:\", json.load(sys.stdin)[\"platform\"])"'
