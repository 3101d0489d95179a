"""A prefill of another user (uid 65534, dumpable) and a root decode on one host (issue 43,
item 2). With kvruntime's default posix lane (UCX_POSIX_ERROR_HANDLING=y) the root side's UCX
picks posix for the other user's process, which cannot open root's shared memory back: the
prefill died with SIGSEGV in NIXL's get_new_notifs. Now each side refuses such a peer in one
line before any NIXL metadata moves, and with the lane off in both processes the pull works.
Real processes, a real other uid: runs as root only."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a prefill as "
                                 "another user")]

ROLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cross_user_roles.py")
OTHER_UID = 65534


def _run(prefill_env: dict, decode_env: dict):
    """(decode's JSON line, prefill's exit status, prefill's refusals)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    base.pop("KVRUNTIME_UCX_LOG", None)
    prefill = subprocess.Popen([sys.executable, ROLES, "prefill", str(OTHER_UID)],
                               env={**base, **prefill_env}, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        port = prefill.stdout.readline().strip()
        assert port.isdigit(), f"the prefill did not start: {port!r}"
        decode = subprocess.run([sys.executable, ROLES, "decode", port], text=True,
                                env={**base, **decode_env}, capture_output=True, timeout=120)
        lines = decode.stdout.strip().splitlines()
        assert lines, f"the decode printed nothing (status {decode.returncode}): {decode.stderr}"
        said = json.loads(lines[-1])
        rest, _ = prefill.communicate("", timeout=60)
        refused = json.loads(rest.strip().splitlines()[-1])["refused"] if rest.strip() else None
        return said, prefill.returncode, refused
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()


def test_a_root_decode_refuses_another_users_prefill_and_the_prefill_lives():
    said, status, refused = _run({}, {})
    assert status == 0, f"the prefill ended with {status} (-11: SIGSEGV); the decode: {said}"
    assert said.get("error", "").startswith("IncompatiblePeerError: the prefill 127.0.0.1:")
    assert f"runs as uid {OTHER_UID} on this host and this process as uid 0" in said["error"]
    assert "UCX_POSIX_ERROR_HANDLING=n in both processes" in said["error"]


def test_the_prefill_refuses_a_root_decode_that_has_the_lane_off():
    """The decode keeps its posix lane off, so only the prefill (lane on) can refuse; it does
    so before its metadata goes, and says why to the decode."""
    said, status, refused = _run({}, {"UCX_POSIX_ERROR_HANDLING": "n"})
    assert status == 0, f"the prefill ended with {status}; the decode: {said}"
    assert "the decode runs as uid 0 on this host and this process as uid 65534" in said["error"]
    assert any("the decode runs as uid 0" in why for why in refused), refused


def test_with_the_lane_off_in_both_a_pull_across_users_is_bit_exact():
    off = {"UCX_POSIX_ERROR_HANDLING": "n"}
    said, status, refused = _run(off, off)
    assert said == {"ok": True, "differ": []}
    assert status == 0 and refused == []
