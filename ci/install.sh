#!/usr/bin/env bash
# README's first command: build and verify the stack for this host (arguments go to
# `python -m installer`, e.g. --platform xpu --dry-run). Works with a stock Debian/Ubuntu
# python3: everything goes into the virtual environment .venv, which also receives NIXL's module.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/venv.sh
kvstack_venv
"$VENV_PY" -m pip install -q --disable-pip-version-check -e '.[installer]'
exec "$VENV_PY" -m installer "$@"
