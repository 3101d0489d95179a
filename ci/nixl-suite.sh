#!/usr/bin/env bash
# NIXL's own Python tests (test/python) and examples (examples/python), extracted from the pinned
# archive each build was made from, run against the build through `import nixl`, host memory only,
# the two-peer examples as two processes (ci/nixl_suite.py). Prints passed/skipped/failed per
# build; a skip names the plugin or device it needs. ~30 s a build on 2 cores.
# Usage: ci/nixl-suite.sh [PREFIX...]; none given: the pinned builds KVSTACK_PINNED_PREFIX_CPU,
# _XPU, _XPU_IPC that are set (_work/pinned/env.sh). PY: the Python that runs it (the repo's
# .venv); KVSTACK_MIRROR: where else the archives are (../shared/mirror).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
mirror=${KVSTACK_MIRROR:-../shared/mirror}
prefixes=("$@")
if [ ${#prefixes[@]} = 0 ]; then
  for v in CPU XPU XPU_IPC; do
    var=KVSTACK_PINNED_PREFIX_$v
    if [ -n "${!var:-}" ]; then prefixes+=("${!var}"); fi
  done
fi
if [ ${#prefixes[@]} = 0 ]; then
  echo "error: no build: give prefixes, or set KVSTACK_PINNED_PREFIX_CPU (ci/pinned-builds.sh)" >&2
  exit 1
fi
failed=()
for p in "${prefixes[@]}"; do
  "$py" ci/nixl_suite.py "$p" --name "$(basename "$p")" --mirror "$mirror" --timeout 120 \
    || failed+=("$p")
done
if ((${#failed[@]})); then echo "error: NIXL's suite failed on ${failed[*]}" >&2; exit 1; fi
