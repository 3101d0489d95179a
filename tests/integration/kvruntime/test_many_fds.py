"""A decode whose side-channel socket gets an fd number above 1024 (engines hold thousands of
fds): pulls, pushes and the same-node engine work, and a connect never hands back a closed
peer. Real NIXL agents, a prefill process, 1100 fds held open in the test process.

Before: ``select.select`` raised "filedescriptor out of range in select()", NIXL pushes failed
and ``connect`` with ``engine="auto"`` returned a peer that was already closed."""

import gc
import os
import resource

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.layout import CROSS_LAYER, KVLayout
from kvruntime.memory import KVCache

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
HELD = 1100


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = HELD + 512
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    # no fd below HELD left free: earlier tests' objects collected now, not mid-test (a
    # socket closed by the collector frees a low number for ours), and every hole filled
    gc.collect()
    gc.disable()
    fds = []
    while not fds or fds[-1] < HELD:
        fds.append(os.open(os.devnull, os.O_RDONLY))
    try:
        yield fds
    finally:
        gc.enable()
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("engine", ["auto", "nixl"])
def test_a_decode_with_fds_above_1024(prefill, many_fds, engine):
    with prefill([LAYOUT], seed=4) as (_proc, ports):
        cache = KVCache.allocate_host(LAYOUT)
        cache.fill_value(0)
        with DecodeClient(cache, engine=engine) as client:
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.channel.sock.fileno() >= 1024 and not peer.closed
            assert peer.engine == ("nixl" if engine == "nixl" else "samenode:process_vm_readv")
            peer.pull([1, 2, 3], [10, 11, 12], timeout=20)
            peer.push([4, 5], [20, 21], timeout=20)
            handles = [peer.start_pull([b], [30 + b], timeout=20) for b in range(8)]
            client.wait_all(handles, timeout=30)
            assert peer.digests([1, 2, 3, 4, 5]) == cache.block_digests([10, 11, 12, 20, 21])
            assert peer.digests(list(range(8))) == cache.block_digests(list(range(30, 38)))
        cache.close()
