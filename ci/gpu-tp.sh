#!/usr/bin/env bash
# Mixed tensor-parallel transfers with every rank a process of its own on its own GPU (issue 29),
# on a GPU host, from this checkout and an installer-built cuda stack already there:
#
#   bash ci/gpu-tp.sh STACK [OUTDIR]          (STACK: the prefix whose env.sh to source, e.g. /tmp/kvp)
#
# Runs `bench --device cuda --scenario tp-4gpu` (four GPUs or more; else tp-2gpu on two) and then
# `selftest` with the mixed-TP groups on device memory laid on the same GPUs, each under a time
# limit so that the whole fits one 10-minute call. Writes OUTDIR/{topology.txt, bench-tp.json,
# bench-tp.txt, selftest.json} and prints the bench's rows (GB/s per decode rank and in total
# beside torch copies of the same bytes between the same GPUs, descriptors, UCX lanes, bit-exact)
# and the selftest's counts. PYTHON (default python3) needs torch with CUDA and numpy. Exit: the
# first failing step's status (124: it ran out of time), else 0. CI has no GPU: BENCHMARKS.md
# takes the figures.
set -uo pipefail
cd "$(dirname "$0")/.."
stack=${1:?usage: bash ci/gpu-tp.sh STACK [OUTDIR]}
out=$(realpath -m "${2:-_work/gpu-tp}")
py=${PYTHON:-python3}
[ -f "$stack/env.sh" ] || { echo "error: no env.sh in $stack: give the prefix of an installer-built cuda stack" >&2; exit 2; }
# shellcheck disable=SC1091
. "$stack/env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if ((gpus >= 4)); then scenario=tp-4gpu ids=(0 1 2 3)
elif ((gpus >= 2)); then scenario=tp-2gpu ids=(0 1)
else echo "error: $gpus GPU(s) here; the scenarios need 2 or 4" >&2; exit 2; fi
step() { printf '=== %s (+%ss)\n' "$1" "$SECONDS"; }
SECONDS=0
rc=0

step "topology ($gpus GPUs; NV# = NVLink)"
nvidia-smi topo -m 2>&1 | tee "$out/topology.txt" | head -"$((gpus + 1))"

step "bench --device cuda --scenario $scenario"
timeout 330 "$py" -m kvruntime bench --device cuda --scenario "$scenario" --json --compact \
  >"$out/bench-tp.json" 2>"$out/bench-tp.err"
brc=$?; ((brc)) && rc=$brc
"$py" - "$out/bench-tp.json" <<'PY' | tee "$out/bench-tp.txt"
import json, sys
from kvruntime.__main__ import _tp_lines
try:
    report = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("no JSON report: see bench-tp.err")
print(report.get("device"), "| NIXL module:", report.get("nixl_module"))
for row in report.get("tp", []):
    print(*_tp_lines(row), sep="\n")
print("ok:", report.get("ok"), "| error:", report.get("error"))
PY
echo "bench: exit $brc"; ((brc)) && tail -5 "$out/bench-tp.err"

step "selftest --device-ids ${ids[*]} (mixed-TP groups on device memory, a rank a process)"
timeout 180 "$py" -m kvruntime selftest --device-ids "${ids[@]}" --json --compact \
  --tp-pairs 2x2,2x1x2,1x2,2x4,4x2 >"$out/selftest.json" 2>"$out/selftest.err"
src=$?; ((rc == 0 && src)) && rc=$src
"$py" - "$out/selftest.json" <<'PY'
import collections, json, sys
try:
    report = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("no JSON report: see selftest.err")
modes = report["modes"]
print("ok", report["ok"], dict(collections.Counter(m["status"] for m in modes)), "in",
      report["seconds"], "s")
tp = [m for m in modes if m["mode"].startswith("cuda/tp")]
print("cuda tp modes:", dict(collections.Counter(m["status"] for m in tp)))
for m in modes:
    if m["status"] == "failed":
        print("FAIL", m["mode"], m.get("reason"))
PY
echo "selftest: exit $src"
step "done: $out"
exit "$rc"
