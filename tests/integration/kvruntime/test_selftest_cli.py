"""`python -m kvruntime selftest` as a user runs it, in real processes: every host mode, a mixed
TP pair direct and staged, the transports UCX selected printed per mode, and no UCX ERROR line
on stderr in normal operation (UCX's log is read by kvruntime: ucxlog.py)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_selftest_reports_tp_pairs_and_transports_and_no_ucx_errors():
    """Its four process pairs (host, host staged, TP direct, TP staged) two at a time, as a
    many-core host runs them by default; the modes come back in the same order."""
    r = subprocess.run([sys.executable, "-m", "kvruntime", "selftest", "--json", "--compact",
                        "--tp-pairs", "2x1,1x2", "--pairs-at-once", "2"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["pairs_at_once"] == 2
    groups = [2 if "tp" in m else int(m.get("engine") == "host_staged") for m in report["modes"]
              if m["status"] != "skipped"]
    assert groups == sorted(groups) and set(groups) == {0, 1, 2}, groups  # host, host staged, then TP
    ran = [m for m in report["modes"] if m["status"] != "skipped"]
    assert ran and all(m["status"] == "passed" for m in ran)
    tp = [m for m in ran if "tp" in m]
    assert {(tuple(m["tp"]), m["mode"].rsplit("/", 1)[1]) for m in tp} == {
        ((2, 1), "direct"), ((2, 1), "staged"), ((1, 2), "direct"), ((1, 2), "staged")}
    assert {tuple(m["prefill_ranks"]) for m in tp if m["tp"] == [2, 1]} == {(0, 1)}
    for m in ran:  # host memory between two processes of one host: cma (process_vm_readv)
        if m.get("engine") not in ("nixl", "host_staged"):
            assert m["transports"] is None, m  # the same-node engine's copies take no UCX lane
            continue
        assert "cma" in m["transports"]["rma"], m
        assert m["transports"]["am"], m
    assert "UCX  ERROR" not in r.stderr and "UCX ERROR" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_bad_pairs_at_once_is_one_line(bad):
    r = subprocess.run([sys.executable, "-m", "kvruntime", "selftest", "--pairs-at-once", bad],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 64
    assert "is not a whole number of at least 1" in r.stderr


def test_an_option_is_never_taken_for_a_longer_one():
    """selftest has --device-ids, not --device: a bench option given to selftest is refused as
    what it is, not read as the start of --device-ids and refused for its ids."""
    r = subprocess.run([sys.executable, "-m", "kvruntime", "selftest", "--device", "cuda"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 64
    assert "unrecognized arguments: --device cuda" in r.stderr and "expected 2" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", ["2", "0x1", "ax2", "1x2,"])
def test_bad_tp_pairs_are_one_line(bad):
    r = subprocess.run([sys.executable, "-m", "kvruntime", "selftest", "--tp-pairs", bad],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 64
    assert "PxD" in r.stderr or "1x2,2x1" in r.stderr


def test_bench_tp_pairs_rows_direct_coalesced_and_staged():
    r = subprocess.run([sys.executable, "-m", "kvruntime", "bench", "--json", "--compact",
                        "--sizes", "4", "--layouts", "cross_layer", "--ops", "pull",
                        "--patterns", "contiguous", "--engines", "nixl", "--inflight", "0", "0",
                        "--iters", "1", "--handshakes", "1", "--no-bare", "--tp-pairs", "2x1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["kv_buffer"]: row for row in json.loads(r.stdout)["tp"]}
    assert set(rows) == {"direct", "coalesced", "host_staged"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["prefill_ranks"] == [0, 1] and row["gbps"] > 0 and row["ref_gbps"] > 0
    # one descriptor per token row of each block's head slice, against one run (a chunk) per rank
    for mode in ("coalesced", "host_staged"):
        assert rows["direct"]["descriptors"] > 100 * rows[mode]["descriptors"]
        assert "vs_direct" in rows[mode]
    assert rows["coalesced"]["coalesced"] and not rows["direct"]["coalesced"]
