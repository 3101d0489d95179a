"""Splitting a same-node host copy over several reader threads: how many (a policy table), and
every byte once, in order, ranges cut at piece boundaries, the groups about equal (pure numpy;
no second process)."""

import numpy as np
import pytest

from kvruntime.engines.samenode import host_copy_streams, split_ranges
from kvruntime.errors import KVRuntimeError


def _pieces(out):
    return [(int(a), int(b), int(c)) for group in out for a, b, c in zip(*group)]


def _expected(local, remote, lengths, piece):
    want = []
    for lo, re, n in zip(local, remote, lengths):
        for off in range(0, int(n), piece):
            want.append((int(lo) + off, int(re) + off, min(piece, int(n) - off)))
    return want


@pytest.mark.parametrize("seed", range(40))
def test_every_byte_once_in_order_and_the_groups_balanced(seed):
    rng = np.random.default_rng(seed)
    n, piece, parts = int(rng.integers(1, 30)), int(rng.integers(1, 64)), int(rng.integers(2, 7))
    lengths = rng.integers(1, 300, n).astype(np.uint64)
    local = (rng.integers(0, 10**6, n) * 4096).astype(np.uint64)
    remote = (rng.integers(0, 10**6, n) * 4096).astype(np.uint64)
    out = split_ranges(local, remote, lengths, parts, piece)
    assert 1 <= len(out) <= parts
    assert _pieces(out) == _expected(local, remote, lengths, piece)
    total = int(lengths.sum())
    for _l, _r, sizes in out:  # no group more than its share plus one piece
        assert int(sizes.sum()) <= total // parts + piece


def test_one_long_run_is_dealt_out_evenly():
    out = split_ranges([1 << 40], [1 << 41], [1 << 30], 4, 16 << 20)
    assert [int(s.sum()) for _l, _r, s in out] == [1 << 28] * 4
    assert [len(s) for _l, _r, s in out] == [16] * 4


def test_one_stream_keeps_the_ranges_whole():
    local, remote, lengths = [0, 100], [200, 300], [50, 60]
    (out,) = split_ranges(local, remote, lengths, 1, 8)
    assert [list(map(int, a)) for a in out] == [local, remote, lengths]


@pytest.mark.parametrize("cpus,requested,streams", [
    (16, None, 4),    # a many-core host: a request's bytes over 4 reader threads
    (8, None, 4),
    (7, None, 1),
    (2, None, 1),     # the CI host: the cores belong to the copies and the peer
    (16, 1, 1),       # the caller's number wins either way
    (2, 3, 3),
])
def test_host_copy_streams_policy_table(cpus, requested, streams):
    chosen, why = host_copy_streams(cpus, requested)
    assert chosen == streams and why
    if requested is not None:
        assert why == "yours"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4", True])
def test_host_copy_streams_refuses_what_is_not_a_count(bad):
    with pytest.raises(KVRuntimeError, match="host_streams must be a positive integer"):
        host_copy_streams(16, bad)
