#!/usr/bin/env bash
# README.md's set-up command: on a stock Debian/Ubuntu (the distribution's python3, PEP 668) or any
# other python3, make .venv in the checkout, install the installer's dependencies into it, then
# run `python -m installer "$@"` from the checkout with that environment's python, so the built
# NIXL module lands in .venv too.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/venv.sh
kvstack_venv
"$PY" -m pip install -q --disable-pip-version-check -e '.[installer]'
exec "$PY" -m installer "$@"
