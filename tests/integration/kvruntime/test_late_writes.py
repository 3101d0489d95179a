"""Nothing lands after a request is reported failed and settled, on tcp and on cma: real NIXL
agents in two processes, deadlines shorter than the transfer, a prefill stopped (SIGSTOP) in
the middle of its WRITE and resumed, a prefill killed, and churn of many short-deadline
requests in flight.

The rule under test (docs/kvruntime.md, "Failed requests"): a failed request's destination blocks
are untouched unless the failure says its copy may still be in flight (``settled`` False); such
blocks are reused only once ``settled`` is True, and from then on nothing writes into them. The
tests reuse every failed request's blocks exactly when the rule allows it — painting a canary
into them — and then keep both processes progressing: a canary that changes is a late write.

Before the fix, a 32 MiB pull over tcp released at its 2 ms deadline ("aborted", settled) was
written whole into its blocks by the decode's next progress in 6 trials of 6: UCX cannot cancel
a posted READ or WRITE (transfer.py).
"""

import contextlib
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import KVRuntimeError
from kvruntime.layout import CROSS_LAYER, KVLayout
from kvruntime.memory import KVCache

pytestmark = pytest.mark.integration

# 512 KiB blocks: 64 of them (32 MiB) take ~10-40 ms over tcp loopback, far past 2 ms
BIG = KVLayout(CROSS_LAYER, 2, 128, 64, 8, 128, "float16")
TRANSPORTS = ["tcp", "cma,tcp"]  # the bulk lane: tcp alone, or cma beside tcp's messages


@pytest.fixture(params=TRANSPORTS)
def tls(request, monkeypatch):
    """UCX_TLS for both processes (the prefill is spawned with this environment)."""
    monkeypatch.setenv("UCX_TLS", request.param)
    return request.param


def paint(cache: KVCache, blocks, value: int) -> None:
    for block in blocks:
        for region, offset, length in cache.layout.block_extents(block):
            ctypes.memset(cache.regions[region].address + offset, value, length)


def painted(cache: KVCache, block: int, value: int) -> bool:
    want = bytes([value]) * 4096
    for region, offset, length in cache.layout.block_extents(block):
        data = ctypes.string_at(cache.regions[region].address + offset, length)
        if data != want * (length // 4096) + want[:length % 4096]:
            return False
    return True


def keep_progressing(client: DecodeClient, seconds: float) -> None:
    """Drive our UCX worker (a late tcp WRITE or READ reply lands as it progresses)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        client.get_finished()
        client.get_settled()
        time.sleep(0.001)


class Canaries:
    """Blocks reused under the rule: painted once their request settled, checked at the end."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.blocks: dict[int, int] = {}

    def reuse(self, handle, dst, value: int) -> None:
        assert handle.state == "failed"
        if not handle.settled:  # the failure said so: it may still be written
            assert "settled" in str(handle.error), handle.error
            assert handle.wait_settled(30), f"{handle} never settled: {handle.error}"
        paint(self.cache, dst, value)
        self.blocks.update((b, value) for b in dst)

    def check(self) -> None:
        late = [b for b, v in self.blocks.items() if not painted(self.cache, b, v)]
        assert not late, f"{len(late)} block(s) written after their request settled: {late[:8]}"


@contextlib.contextmanager
def decode_beside(prefill, layout, seed, device="cpu"):
    """A prefill process and a NIXL decode connected to it (endpoints wired up), its cache
    zeroed: yields (prefill process, cache, canaries, client, peer)."""
    options = {} if device == "cpu" else {"device": device, "device_id": 0}
    with prefill([layout], seed=seed, **options) as (proc, ports):
        cache = (KVCache.allocate_host(layout) if device == "cpu" else
                 KVCache.allocate_device(layout, device, 0))
        cache.fill_value(0)
        try:
            with DecodeClient(cache, engine="nixl", device_kind=device) as client:
                peer = client.connect("127.0.0.1", ports[0])
                peer.pull([0], [0], timeout=20)
                yield proc, cache, Canaries(cache), client, peer
        finally:
            cache.close()


@pytest.mark.parametrize("op", ["pull", "push"])
def test_deadline_shorter_than_the_transfer(prefill, tls, op):
    with decode_beside(prefill, BIG, 5) as (_proc, cache, canaries, client, peer):
        start = peer.start_pull if op == "pull" else peer.start_push
        failed = 0
        for trial in range(6):
            dst = list(range(64, 128))
            handle = start(list(range(64)), dst, request_id=f"{op}{trial}", timeout=0.002)
            try:
                handle.wait()
                continue  # it made its deadline: nothing to reuse under the rule
            except KVRuntimeError:
                failed += 1
            canaries.reuse(handle, dst, 0x40 + trial)
            keep_progressing(client, 0.2)
            canaries.check()  # before the next trial writes the same blocks
        if tls == "tcp":  # cma copies a READ whole as it is posted: it cannot miss
            assert failed >= 3, f"only {failed} of 6 requests missed a 2 ms deadline"


def test_churn_of_short_deadlines(prefill, stall, tls):
    """Many requests in flight, pulls and pushes mixed, deadlines from 0.5 to 8 ms: the ones
    that made it hold the prefill's bytes, the failed ones' reused blocks keep their canary.
    Each round forces both ends, whatever the host's speed: requests with a 30 s deadline that
    are done, and pushes sent while the prefill is stopped (SIGSTOP), which miss theirs and
    are refused once it resumes; the short-deadline ones race between them."""
    layout = KVLayout(CROSS_LAYER, 2, 128, 16, 8, 128, "float16")  # 128 KiB blocks
    rnd = random.Random(7)
    with decode_beside(prefill, layout, 6) as (proc, cache, canaries, client, peer):
        outcomes = {"done": 0, "failed": 0}
        for round_ in range(4):
            dsts = list(range(128))
            rnd.shuffle(dsts)
            handles, forced = {}, {}
            for i in range(32):
                dst = dsts[4 * i:4 * i + 4]
                src = rnd.sample(range(128), 4)
                if i == 24:  # the last 8: pushes to a stopped prefill
                    stall(proc.pid)
                start = peer.start_pull if i % 2 and i < 24 else peer.start_push
                timeout = 30.0 if i < 4 else rnd.uniform(0.0005, 0.008)
                h = start(src, dst, request_id=f"c{round_}-{i}", timeout=timeout)
                handles[id(h)] = (h, src, dst)
                if i < 4 or i >= 24:
                    forced[id(h)] = i < 4  # done, or failed
            stopped = [h for h, _s, _d in handles.values() if not forced.get(id(h), True)]
            try:
                for h in stopped:
                    with pytest.raises(KVRuntimeError, match="deadline"):
                        h.wait()
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            finished = list(stopped)
            until = time.monotonic() + 60
            while len(finished) < len(handles) and time.monotonic() < until:
                finished += client.get_finished()
            assert len(finished) == len(handles)
            good = []
            for h in finished:
                _h, src, dst = handles[id(h)]
                assert forced.get(id(h), h.ok) == h.ok, (h.request_id, h.error)
                if h.ok:
                    outcomes["done"] += 1
                    good.append((src, dst))
                    canaries.blocks = {b: v for b, v in canaries.blocks.items()
                                       if b not in dst}
                else:
                    outcomes["failed"] += 1
                    canaries.reuse(h, dst, 0x80 + round_)
            keep_progressing(client, 0.1)
            canaries.check()
            for src, dst in good:
                assert peer.digests(src) == cache.block_digests(dst)
        assert outcomes["failed"] >= 32 and outcomes["done"] >= 16, outcomes


def test_push_to_a_prefill_stopped_in_its_write(prefill, stall, tls):
    """The prefill is stopped while its WRITE runs and resumed after the decode gave up: the
    push fails at its deadline unsettled (the WRITE may go on), settles when the resumed
    prefill answers, and the blocks reused from then on keep their canary."""
    with decode_beside(prefill, BIG, 8) as (proc, cache, canaries, client, peer):
        for trial in range(3):
            dst = list(range(64, 128))
            handle = peer.start_push(list(range(64)), dst, request_id=f"s{trial}",
                                     timeout=0.5)
            time.sleep(0.003)  # the prefill has read it and posted its WRITE
            stall(proc.pid)
            try:
                handle.wait()
                continue  # it landed before the stop (cma copies as it posts)
            except KVRuntimeError:
                pass
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            canaries.reuse(handle, dst, 0x20 + trial)
            keep_progressing(client, 0.3)
            canaries.check()


def test_pull_from_a_killed_prefill(prefill, tls):
    """A prefill killed during a READ: the READ ends in error (UCX notices the peer's end),
    the request settles, and its reused blocks stay as painted."""
    with decode_beside(prefill, BIG, 9) as (proc, cache, canaries, client, peer):
        stop_at = time.monotonic() + 0.002
        handle = peer.start_pull(list(range(64)), list(range(64, 128)), timeout=10)
        while time.monotonic() < stop_at:
            handle.done()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        try:
            handle.wait()
        except KVRuntimeError:
            canaries.reuse(handle, list(range(64, 128)), 0x33)
        keep_progressing(client, 0.3)
        canaries.check()


def test_push_to_a_killed_prefill_stays_unsettled(prefill):
    """A push whose prefill dies before answering: the prefill never said its WRITE ended, so
    the request stays unsettled and says what the caller must know before reusing the blocks."""
    with decode_beside(prefill, BIG, 10) as (proc, _cache, _canaries, _client, peer):
        os.kill(proc.pid, signal.SIGSTOP)
        handle = peer.start_push(list(range(64)), list(range(64, 128)), timeout=5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(KVRuntimeError) as info:
            handle.wait()
        assert handle.settled is False
        assert "exited" in str(info.value)


@pytest.mark.gpu
def test_cuda_ipc_pulls_and_pushes_never_land_after_settled(prefill, monkeypatch):
    """The same rule over CUDA IPC (UCX_TLS=cuda_ipc,cuda_copy,tcp), VRAM on one GPU, 0.2 ms
    deadlines for 128 MiB: run by the lead on the device host; skips without a GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("UCX_TLS", "cuda_ipc,cuda_copy,tcp")
    layout = KVLayout(CROSS_LAYER, 8, 128, 64, 8, 128, "float16")  # 2 MiB blocks, 256 MiB

    def blocks(cache, dst):
        view = cache._byte_views()[0]  # cross_layer: one region
        return [view[o:o + n] for b in dst for _r, o, n in layout.block_extents(b)]

    with decode_beside(prefill, layout, 11, "cuda") as (_proc, cache, _c, client, peer):
        reused = []
        for trial in range(8):
            start = peer.start_pull if trial % 2 else peer.start_push
            dst = list(range(64, 128))
            handle = start(list(range(64)), dst, request_id=f"g{trial}", timeout=0.0002)
            try:
                handle.wait()
                continue
            except KVRuntimeError:
                pass
            assert handle.wait_settled(30), handle.error
            for piece in blocks(cache, dst):  # reused under the rule
                piece.fill_(0x50 + trial)
            cache.synchronize()
            keep_progressing(client, 0.2)
            assert all(bool((piece == 0x50 + trial).all()) for piece in blocks(cache, dst))
            reused.append(trial)
        assert reused, "no request missed a 0.2 ms deadline for 128 MiB"


def test_a_closed_peers_agent_outlives_its_reads_in_flight(prefill, stall, monkeypatch):
    """A pull from a stopped prefill fails unsettled; closing the peer keeps the prefill's
    agent (NIXL's remote metadata, which the READ in flight uses) until the READ ends, and the
    request settles once the resumed prefill lets it end."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with decode_beside(prefill, BIG, 12) as (proc, cache, canaries, client, peer):
        stall(proc.pid)
        try:
            handle = peer.start_pull(list(range(64)), list(range(64, 128)), timeout=0.2)
            with pytest.raises(KVRuntimeError, match="settled"):
                handle.wait()
            assert handle.settled is False
            agent = peer.agent
            peer.close()
            client.get_finished()
            assert agent in client.registration.peers  # kept while its READ is in flight
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        canaries.reuse(handle, list(range(64, 128)), 0x61)  # waits for it to settle
        keep_progressing(client, 0.2)
        assert agent not in client.registration.peers
        canaries.check()


# A decode process: pulls once, stops the prefill, has a pull fail in flight, closes its
# client (drain 1 s) and frees its cache, resumes the prefill and lives on a moment.
CLOSED_WITH_A_READ_IN_FLIGHT = """
import json, os, signal, sys, time
from kvruntime.decode.client import DecodeClient
from kvruntime.errors import TransferError
from kvruntime.layout import KVLayout
from kvruntime.memory import KVCache
layout, port, pid = KVLayout.from_dict(json.loads(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
cache = KVCache.allocate_host(layout)
client = DecodeClient(cache, engine="nixl", timeout=1.0)
peer = client.connect("127.0.0.1", port)
peer.pull([0], [0], timeout=20)
os.kill(pid, signal.SIGSTOP)
try:
    peer.pull(list(range(64)), list(range(64, 128)), timeout=0.2)
    sys.exit("the pull from a stopped prefill ended")
except TransferError:
    pass
client.close()
cache.close()  # the caller frees what it gave the client
os.kill(pid, signal.SIGCONT)
time.sleep(2)  # the resumed prefill answers the READ still in flight, if anyone listens
print("alive")
"""


def test_a_client_closed_with_a_read_in_flight_lets_nothing_land_after(prefill, monkeypatch):
    """A decode that closes while a READ from a stalled prefill is still in flight (tcp: the
    READ waits for the prefill's process) gives up at its drain's deadline, and its caller
    then frees the cache. Before: the READ's handle kept NIXL's agent and its UCX threads
    alive, the resumed prefill's bytes landed in the freed memory, and the decode died of
    SIGSEGV in ucp_get_rep_handler (exit -11, every run). The decode runs in its own process:
    a crash is its exit status, not the test run's."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with prefill([BIG], seed=13) as (proc, ports):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
        env = {**os.environ, "PYTHONPATH": root}
        try:
            done = subprocess.run(
                [sys.executable, "-c", CLOSED_WITH_A_READ_IN_FLIGHT, json.dumps(BIG.to_dict()),
                 str(ports[0]), str(proc.pid)], env=env, capture_output=True, text=True,
                timeout=120)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    assert done.returncode == 0 and "alive" in done.stdout, (done.returncode,
                                                            done.stderr[-2000:])
