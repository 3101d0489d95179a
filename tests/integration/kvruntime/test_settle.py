"""An agent that saw a transfer fail progresses every UCX worker before it is destroyed
(kvruntime/nixl/settle.py): real NIXL agents, a real prefill process, SIGKILLed.

What it prevents, UCX aborting the process when a worker that a UCX thread no longer progresses
is destroyed with a copy still queued to the dead peer, hangs on an ordering inside UCX that
no test can force from outside (seen in 1 of 3 CI runs of the killed-prefill test, ~1 in 10
local runs); these tests check what can be forced: that the close settles, on this NIXL, with
its loopback READs done on every round, and only where a transfer failed."""

import os
import signal

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import TransferError
from kvruntime.layout import CROSS_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.nixl import agent as agent_module
from kvruntime.nixl import settle as settle_module

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 64, "float16")


def _recorded(monkeypatch):
    """Each settle's result, and the NIXL calls it made."""
    settled, calls = [], []
    real = settle_module.settle

    def recording(agent):
        call = agent.call

        def counted(what, fn, *args, **kwargs):
            calls.append(what)
            return call(what, fn, *args, **kwargs)

        agent.call = counted
        try:
            settled.append(real(agent))
        finally:
            del agent.call
        return settled[-1]

    monkeypatch.setattr(agent_module, "settle", recording)
    return settled, calls


@pytest.mark.parametrize("threads", [0, 2])
def test_an_agent_whose_read_failed_settles_every_worker_before_it_goes(prefill, monkeypatch,
                                                                       threads):
    settled, calls = _recorded(monkeypatch)
    cache = KVCache.allocate_host(LAYOUT)
    try:
        with prefill([LAYOUT]) as (proc, ports):
            client = DecodeClient(cache, engine="nixl", ucx_threads=threads)
            peer = client.connect("127.0.0.1", ports[0])
            peer.pull(list(range(64)), timeout=30)
            assert client.agent.failed_transfers == 0
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            with pytest.raises(TransferError):
                for _ in range(100):  # UCX sees the peer gone at the first copy or soon after
                    peer.pull(list(range(64)), timeout=5)
            assert client.agent.failed_transfers >= 1
            client.close()
        assert settled == [True]
        assert calls.count("get_new_notifs") == 3
        assert calls.count("transfer (settle)") == (settle_module.ROUNDS if threads else 0)
    finally:
        cache.close()


def test_an_agent_whose_transfers_all_ended_well_closes_without_settling(prefill, monkeypatch):
    settled, _calls = _recorded(monkeypatch)
    cache = KVCache.allocate_host(LAYOUT)
    try:
        with prefill([LAYOUT]) as (_proc, ports):
            with DecodeClient(cache, engine="nixl", ucx_threads=2) as client:
                client.connect("127.0.0.1", ports[0]).pull(list(range(64)), timeout=30)
        assert settled == []
    finally:
        cache.close()
