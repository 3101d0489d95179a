# Sourced by the CI steps that use a pinned build (ci/test.sh, ci/containers.sh) while
# ci/pinned-builds.sh may still be making them in the background (its process id in
# _work/pinned/pid, written by ci/test.sh; absent when nothing is building).
# pinned_wait NAME: wait until env.sh names the build NAME (CPU, XPU, XPU_IPC: it does once the
# build is verified) or the builds have ended; true when the build is there.
pinned_wait() {
  local line="^export KVSTACK_PINNED_PREFIX_$1=" env=_work/pinned/env.sh pid
  pid=$(cat _work/pinned/pid 2>/dev/null || true)
  until grep -qs "$line" "$env" || [ -z "$pid" ] || ! pinned_running "$pid"; do sleep 5; done
  grep -qs "$line" "$env"
}
# a zombie (ended, not yet reaped by ci/test.sh) has ended
pinned_running() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [ "${s:0:1}" != Z ]; }
