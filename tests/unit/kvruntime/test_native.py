"""The native block-id reader (kvruntime/csrc/idscan.c, built by native.py): it reads what
``array('q')`` reads, says None for everything else, and is built, cached, refused and switched
off as native.py promises. Real compiler, real builds into a temporary cache."""

import os
import shutil
import stat
import sys
import sysconfig
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvruntime import native

HAVE_TOOLS = shutil.which("cc") is not None and os.path.isfile(
    os.path.join(sysconfig.get_paths()["include"], "Python.h"))
needs_tools = pytest.mark.skipif(not HAVE_TOOLS, reason="no cc or no Python.h on this host")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVRUNTIME_CACHE_DIR", str(folder))
    monkeypatch.delenv("KVRUNTIME_NATIVE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    return folder


@needs_tools
def test_built_once_then_loaded_from_the_cache(cache):
    mod, how = native._load()
    assert mod is not None and how.startswith("built ")
    (lib,) = cache.glob("_kvr_idscan-*.so")
    first = lib.stat().st_mtime_ns
    mod, how = native._load()
    assert mod is not None and how == f"loaded {lib}"
    assert lib.stat().st_mtime_ns == first
    assert stat.S_IMODE(cache.stat().st_mode) & 0o022 == 0


@needs_tools
def test_a_cached_library_needs_no_compiler(cache, monkeypatch):
    """How an image carries it: built where compilers are, loaded where they are not."""
    assert native._load()[0] is not None
    monkeypatch.setenv("CC", "/nonexistent/cc")
    mod, how = native._load()
    assert mod is not None and how.startswith(f"loaded {cache}/_kvr_idscan-")


@needs_tools
def test_another_source_is_another_library(cache, monkeypatch, tmp_path):
    assert native._load()[0] is not None
    changed = tmp_path / "csrc" / "idscan.c"
    changed.parent.mkdir()
    changed.write_text(native.SOURCE.read_text() + "\n/* a change */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    mod, how = native._load()
    assert mod is not None and how.startswith("built ")
    assert len(list(cache.glob("_kvr_idscan-*.so"))) == 2


@needs_tools
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_library_of_another_user_is_not_loaded(cache):
    assert native._load()[0] is not None
    (lib,) = cache.glob("_kvr_idscan-*.so")
    os.chown(lib, 12345, 12345)
    mod, how = native._load()
    assert mod is None
    assert how == f"off: {lib} belongs to uid 12345, neither this user (0) nor root"


def test_off_when_switched_off(cache, monkeypatch):
    monkeypatch.setenv("KVRUNTIME_NATIVE", "0")
    assert native._load() == (None, "off (KVRUNTIME_NATIVE=0): block-id lists are read by "
                                    "array('q')")


def test_off_without_a_compiler(cache, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    mod, how = native._load()
    assert mod is None and how.startswith("off: no C compiler (/nonexistent/cc)")
    assert not cache.exists() or not list(cache.iterdir())


def test_a_failed_build_says_why_and_keeps_its_log(cache, monkeypatch, tmp_path):
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\necho 'idscan.c:1: error: this compiler refuses everything' >&2\n"
                  "exit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    mod, how = native._load()
    assert mod is None
    assert "failed (idscan.c:1: error: this compiler refuses everything); log: " in how
    log = how.rsplit("log: ", 1)[1]
    assert "refuses everything" in open(log).read()
    assert not list(cache.glob("*.so")) and not list(cache.glob(".*.so"))  # nothing half-built


@needs_tools
def test_a_cache_others_can_write_is_not_used(cache):
    cache.mkdir(mode=0o700)
    cache.chmod(0o777)
    mod, how = native._load()
    assert mod is None and how == (f"off: {cache} is writable by others (mode 777); "
                                    f"chmod go-w it")
    cache.chmod(0o700)
    assert native._load()[0] is not None
    (lib,) = cache.glob("_kvr_idscan-*.so")
    lib.chmod(0o777)  # a library someone else could have replaced
    mod, how = native._load()
    assert mod is None and "is writable by others" in how


def loaded(getter):
    """A function of the native module, built or loaded here (skipped where it cannot be)."""
    if not HAVE_TOOLS:
        pytest.skip("no cc or no Python.h on this host")
    fn = getter()
    assert fn is not None, native.status()
    return fn


@pytest.fixture(scope="module")
def scan():
    return loaded(native.id_scan)


class Sub(int):
    pass


items = st.one_of(st.integers(-2 ** 63, 2 ** 63 - 1), st.integers(-10, 10),
                  st.integers(2 ** 63, 2 ** 70), st.booleans(), st.floats(0, 10),
                  st.integers(0, 9).map(Sub), st.integers(0, 9).map(np.int64))


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.lists(items, max_size=12),
                 st.integers(-5, 2 ** 63 - 20).flatmap(
                     lambda a: st.integers(1, 12).map(lambda n: list(range(a, a + n)))),
                 st.lists(st.integers(-3, 3), min_size=1, max_size=8)))
def test_scan_reads_what_array_reads_and_nothing_else(scan, ids):
    out = np.full(len(ids) + 1, 7, dtype=np.int64)
    got = scan(ids, out)
    plain = bool(ids) and all(type(v) is int and -2 ** 63 <= v < 2 ** 63 for v in ids)
    if not plain:
        assert got is None
        return
    assert out[:-1].tolist() == array("q", ids).tolist() and out[-1] == 7
    consecutive = all(b == a + 1 for a, b in zip(ids, ids[1:]))
    assert got == (min(ids), max(ids), consecutive)


def test_scan_refuses_a_short_or_odd_buffer(scan):
    with pytest.raises(ValueError, match="len\\(ids\\) 8-byte items"):
        scan([1, 2, 3], np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="8-byte items"):
        scan([1, 2], np.zeros(4, np.int32))
    with pytest.raises(BufferError):
        scan([1], bytes(8))  # read-only
    assert scan((1, 2), np.zeros(2, np.int64)) is None  # a tuple: the general reader's
    assert scan([], np.zeros(0, np.int64)) is None


def test_a_long_list_is_read_whole_and_its_items_left_as_they_were(scan):
    ids = list(range(10 ** 6, 10 ** 6 + 5000))
    out = np.empty(5000, np.int64)
    refs = [sys.getrefcount(ids[i]) for i in (0, 4999)]
    for _ in range(3):
        assert scan(ids, out) == (10 ** 6, 10 ** 6 + 4999, True)
    assert [sys.getrefcount(ids[i]) for i in (0, 4999)] == refs  # no reference taken or lost
    assert np.array_equal(out, np.arange(10 ** 6, 10 ** 6 + 5000))


@pytest.fixture(scope="module")
def scan_batch():
    return loaded(native.id_scan_batch)


def plain_list(ids) -> bool:
    return (type(ids) is list and bool(ids)
            and all(type(v) is int and -2 ** 63 <= v < 2 ** 63 for v in ids))


requests = st.tuples(
    st.one_of(st.lists(st.integers(-3, 50), max_size=6), st.lists(items, max_size=4),
              st.tuples(st.integers(0, 9))),
    st.one_of(st.none(), st.lists(st.integers(0, 50), max_size=6), st.just((1,))),
).map(lambda r: r if r[0] != [7] else list(r))  # now and then a 2-list, as plan_many may get


@settings(max_examples=500, deadline=None)
@given(st.lists(requests, max_size=5))
def test_scan_batch_reads_a_batch_as_scan_reads_each_request(scan_batch, batch):
    bounds = np.full(len(batch) + 1, -1, dtype=np.int64)
    got = scan_batch(batch, bounds)
    ok = bool(batch) and all(plain_list(src) and (dst is None or (
        plain_list(dst) and len(dst) == len(src))) for src, dst in batch)
    if not ok:
        assert got is None
        return
    ids = np.frombuffer(got, dtype=np.int64).reshape(2, -1)
    assert ids[0].tolist() == [v for src, _ in batch for v in src]
    assert ids[1].tolist() == [v for src, dst in batch for v in (src if dst is None else dst)]
    assert bounds.tolist() == np.cumsum([0] + [len(src) for src, _ in batch]).tolist()


def test_scan_batch_refuses_a_short_bounds_buffer(scan_batch):
    with pytest.raises(ValueError, match="len\\(requests\\)\\+1 int64"):
        scan_batch([([1], None), ([2], None)], np.zeros(2, np.int64))
    with pytest.raises(BufferError):
        scan_batch([([1], None)], bytes(16))  # read-only
    assert scan_batch(([([1], None)]), np.zeros(2, np.int64)) is not None
    assert scan_batch((([1], None),), np.zeros(2, np.int64)) is None  # a tuple of requests
    assert scan_batch([], np.zeros(1, np.int64)) is None
    assert scan_batch([([1], None, "id")], np.zeros(2, np.int64)) is None


@pytest.fixture(scope="module")
def runs():
    return loaded(native.id_runs)


def reference_runs(src, dst, bounds, ns, nd):
    """The runs of a batch and each request's first run, or 0 (an id twice: a source within a
    request, a destination in the batch) or -1 (an id out of range, met first)."""
    out, per, written = [], [], set()
    for a, b in zip(bounds, bounds[1:]):
        per.append(len(out))
        read = set()
        for i in range(a, b):
            s, d = src[i], dst[i]
            if not (0 <= s < ns and 0 <= d < nd):
                return -1, None, None
            if s in read or d in written:
                return 0, None, None
            read.add(s)
            written.add(d)
            if i > a and s == src[i - 1] + 1 and d == dst[i - 1] + 1:
                out[-1][2] += 1
            else:
                out.append([s, d, 1])
    per.append(len(out))
    return len(out), out, per


@st.composite
def batches(draw):
    ns, nd = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    sizes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    n = sum(sizes)
    ids = st.integers(-2, max(ns, nd) + 1)
    src = draw(st.lists(ids, min_size=n, max_size=n))
    dst = draw(st.lists(ids, min_size=n, max_size=n))
    return ns, nd, sizes, src, dst


@settings(max_examples=500, deadline=None)
@given(batches())
def test_runs_split_and_check_a_batch_as_the_reference_does(runs, batch):
    ns, nd, sizes, src, dst = batch
    n = len(src)
    if not n:
        return
    bounds = np.cumsum([0, *sizes]).astype(np.int64)
    seen = np.zeros(ns + nd, np.uint8)
    out, per = np.full((3, n), -7, np.int64), np.full(len(sizes) + 1, -7, np.int64)
    ids = np.array([src, dst], np.int64)
    got = runs(ids, bounds, seen, ns, nd, out, per)
    want, want_runs, want_per = reference_runs(src, dst, bounds.tolist(), ns, nd)
    if want <= 0 or got <= 0:  # which refusal: the first bad pair's, as the reference meets it
        assert got == want
    else:
        assert got == want and out[:, :got].T.tolist() == want_runs and per.tolist() == want_per
    assert not seen.any()  # clean again, whatever the answer: a planner keeps one buffer


def test_runs_refuses_buffers_that_do_not_fit(runs):
    ids, seen = np.zeros((2, 4), np.int64), np.zeros(8, np.uint8)
    out, per, bounds = np.zeros((3, 4), np.int64), np.zeros(2, np.int64), np.array([0, 4])
    with pytest.raises(ValueError, match="seen must hold 9 items"):
        runs(ids, bounds, seen, 4, 5, out, per)
    with pytest.raises(ValueError, match="ids must hold 10 items"):
        runs(ids, np.array([0, 5]), np.zeros(16, np.uint8), 4, 5, np.zeros((3, 5), np.int64), per)
    with pytest.raises(ValueError, match="out must hold 12 items"):
        runs(ids, bounds, seen, 4, 4, out[:, :3].copy(), per)
    with pytest.raises(ValueError, match="bounds must not decrease"):
        runs(ids, np.array([0, 3, 2, 4]), seen, 4, 4, out, np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="0 first"):
        runs(ids, np.array([1, 4]), seen, 4, 4, out, per)
    with pytest.raises(ValueError, match="block counts must be positive"):
        runs(ids, bounds, seen, 0, 4, out, per)
    with pytest.raises(ValueError, match="more pairs than memory can hold"):
        runs(ids, np.array([0, 2 ** 62]), seen, 4, 4, out, per)  # 3 x n x 8 bytes would wrap
    with pytest.raises(ValueError, match="fit memory"):
        runs(ids, bounds, seen, 2 ** 62, 2 ** 62, out, per)
    with pytest.raises(BufferError):
        runs(ids, bounds, bytes(8), 4, 4, out, per)  # read-only marks
    assert runs(ids, bounds, seen, 4, 4, out, per) == 0  # block 0 four times
