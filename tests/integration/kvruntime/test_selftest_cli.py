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
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvruntime",
            "selftest",
            "--json",
            "--compact",
            "--tp-pairs",
            "2x1,1x2",
            "--pairs-at-once",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["pairs_at_once"] == 2
    groups = [2 if "tp" in m else int(m.get("engine") == "host_staged") for m in report["modes"]
              if m["status"] != "skipped"]
    assert groups == sorted(groups) and set(groups) == {0, 1, 2}, (
        groups
    )  # host, host staged, then TP
    ran = [m for m in report["modes"] if m["status"] != "skipped"]
    assert ran and all(m["status"] == "passed" for m in ran)
    tp = [m for m in ran if "tp" in m]
    assert {(tuple(m["tp"]), m["mode"].rsplit("/", 1)[1]) for m in tp} == {
        ((2, 1), "nixl"), ((2, 1), "staged"), ((1, 2), "nixl"), ((1, 2), "staged")}
    assert {tuple(m["prefill_ranks"]) for m in tp if m["tp"] == [2, 1]} == {(0, 1)}
    assert {(m["rank"], m["op"]) for m in tp if m["tp"] == [1, 2]} == {
        (0, "pull"), (1, "pull"), (0, "push"), (1, "push")}
    # host memory's same-node engine copies whole blocks only: said, never passed
    same = [m for m in report["modes"] if "tp" in m and m["mode"].endswith("/samenode")]
    assert same and all(m["status"] == "skipped" and "head slices" in m["reason"] for m in same)
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
    assert r.returncode == 2
    assert "is not a whole number of at least 1" in r.stderr


def test_an_option_is_never_taken_for_a_longer_one():
    """selftest has --device-ids, not --device: a bench option given to selftest is refused as
    what it is, not read as the start of --device-ids and refused for its ids."""
    r = subprocess.run([sys.executable, "-m", "kvruntime", "selftest", "--device", "cuda"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "unrecognized arguments: --device cuda" in r.stderr and "expected 2" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", ["2", "0x1", "ax2", "1x2,"])
def test_bad_tp_pairs_are_one_line(bad):
    r = subprocess.run([sys.executable, "-m", "kvruntime", "selftest", "--tp-pairs", bad],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "PxD" in r.stderr or "1x2,2x1" in r.stderr


def test_bench_tp_rows_per_engine_with_every_rank_checked():
    """A mixed-TP group in bench: a row per engine and op, each decode rank a process of its own
    rated against its own reference copy, the total against all ranks' copies at once; NIXL
    direct (a descriptor a token row) and coalesced (through the pools, a descriptor a chunk)."""
    r = subprocess.run([sys.executable, "-m", "kvruntime", "bench", "--json", "--compact",
                        "--sizes", "4", "--iters", "1", "--tp-pairs", "2x1", "--tp-only",
                        "--tp-ops", "pull"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert not report["results"]  # --tp-only: the TP rows alone
    rows = {row["engine"]: row for row in report["tp"]}
    assert set(rows) == {"samenode", "nixl", "coalesced", "staged"}
    assert "head slices" in rows["samenode"]["skipped"]  # host memory: whole blocks only
    for name in ("nixl", "coalesced", "staged"):
        row = rows[name]
        assert "error" not in row and row["bit_exact"] and row["memory"] == "DRAM", row
        rank = row["ranks"][0]
        assert rank["prefill_ranks"] == [0, 1] and rank["gbps"] > 0 and rank["ref_gbps"] > 0
        assert row["total"]["gbps"] > 0 and row["total"]["bytes"] == rank["bytes"]
        assert "cma" in rank["transports"]["rma"]
    # one descriptor per token row of each block's head slice, against one run (a chunk) per rank
    for name in ("coalesced", "staged"):
        assert rows["nixl"]["ranks"][0]["descriptors"] > 100 * rows[name]["ranks"][0]["descriptors"]
