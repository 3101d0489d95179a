"""Fixtures: a prefill server in a spawned process (real NIXL, 127.0.0.1, port 0), always reaped."""

import contextlib
import multiprocessing as mp

import pytest


def pytest_configure(config):
    # pyproject registers these for the whole suite; repeated here so this directory runs alone
    config.addinivalue_line("markers", "integration: real NIXL agents, processes and sockets")
    config.addinivalue_line("markers", "gpu: needs a CUDA or XPU device")


def _have_nixl() -> bool:
    from kvruntime.errors import NixlNotFoundError
    from kvruntime.nixl.binding import load_nixl

    try:
        load_nixl()
        return True
    except NixlNotFoundError:
        return False


@pytest.fixture(scope="session", autouse=True)
def _require_nixl():
    if not _have_nixl():
        pytest.skip("no NIXL Python module installed (pip install --no-deps nixl-cu12)")


@pytest.fixture
def bench_descriptors():
    """``check_bench_descriptors``, for the CPU and the GPU bench tests alike."""
    return check_bench_descriptors


def check_bench_descriptors(row: dict, regions: int, pieces: int = 1) -> None:
    """A bench row's descriptors per request: a request that moved its runs as they lie
    (NIXL direct, a same-node copy, which reports its plan's count) has one a run and region,
    times its ``pieces`` a run (``split``); one that went through the staging pools
    (``coalesced``) has one a chunk READ, its runs merged: at least one, at most a piece's
    chunks (staging.MAX_CHUNKS; the bench's pools hold its largest request whole)."""
    from kvruntime.pools.staging import MAX_CHUNKS

    if row["coalesced"]:
        assert 1 <= row["descriptors"] <= max(MAX_CHUNKS.values()), row
    else:
        assert row["descriptors"] == row["runs"] * regions * pieces, row


@contextlib.contextmanager
def spawn_prefill(layouts, seed=1, **options):
    """Yield (process, ports). The process is stopped, then killed if need be, then joined."""
    with spawn_pushing_prefill(layouts, seed, **options) as (proc, ports, _push):
        yield proc, ports


@contextlib.contextmanager
def spawn_pushing_prefill(layouts, seed=1, **options):
    """Yield (process, ports, push): ``push(index, request, src, peer)`` has server ``index``
    start a push of ``request`` once decode agent ``peer`` has named its blocks
    (roles._serve_command) and returns the prefill's error, or None once it is posted."""
    ctx = mp.get_context("spawn")
    ready_q, control = ctx.Queue(), ctx.Queue()
    from kvruntime.tools.roles import prefill_main, push_command, reap

    proc = ctx.Process(
        target=prefill_main,
        daemon=True,
        args=(ready_q, control, [layout.to_dict() for layout in layouts], seed, options),
    )
    proc.start()

    def push(index, request, src, peer, timeout=30.0):
        return push_command(control, ready_q, index, request, src, peer, timeout)

    try:
        ready = ready_q.get(timeout=60)
        assert ready["ok"], ready
        yield proc, ready["ports"], push
    finally:
        reap(proc, control)
        ready_q.close(), control.close()


@pytest.fixture
def prefill():
    return spawn_prefill


@pytest.fixture
def pushing_prefill():
    return spawn_pushing_prefill


def _pair(engine: str, **options):
    from kvruntime.decode.client import DecodeClient
    from kvruntime.layout import CROSS_LAYER, KVLayout
    from kvruntime.memory import KVCache
    from kvruntime.prefill.server import PrefillServer

    layout = KVLayout(CROSS_LAYER, 2, 128, 16, 4, 32, "float16")
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(11)
    dst.fill_value(0)
    with PrefillServer(src) as server, DecodeClient(dst, engine=engine, **options) as client:
        peer = client.connect(*server.address)
        peer.pull([0], [0], timeout=20)
        yield server, client, peer, src, dst
    src.close(), dst.close()


@pytest.fixture
def pair():
    """(server, client, peer, src cache, dst cache): a prefill server in this process (host
    memory, random content) and a NIXL decode connected to it, endpoints already wired up."""
    yield from _pair("nixl")


@pytest.fixture
def samenode_pair():
    """``pair`` with the decode on the same-node engine (host memory, process_vm_readv)."""
    yield from _pair("samenode")


@pytest.fixture
def coalesced_pair():
    """``pair`` through both sides' staging pools (NIXL, coalesce="always")."""
    yield from _pair("nixl", coalesce="always")


@pytest.fixture(params=["nixl", "samenode", "coalesced"])
def either_pair(request):
    """``pair`` with the decode on each engine: NIXL, the same-node engine (host memory read
    with process_vm_readv), whose decode copies a push the prefill starts itself, and NIXL
    through both sides' staging pools (coalesce="always": a push the prefill starts is
    staged by it and READ by the decode, as a pull)."""
    if request.param == "coalesced":
        yield from _pair("nixl", coalesce="always")
    else:
        yield from _pair(request.param)


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: the signal reaches the
    threads one by one (about a millisecond on the 2-core host), and a thread still running
    could serve a request the test means to send to a stalled peer."""
    import glob
    import os
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = set()
        for path in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(path) as f:
                    states.add(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states <= {"T", "t"} and states:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop: thread states {states}")
        time.sleep(0.0005)


@pytest.fixture
def stall():
    """``stall(pid)``: stop a process and wait until every thread of it has stopped."""
    return stop_process
