"""agent.ucx_threads: NIXL's UCX threads for a side. A decode whose NIXL moves host memory
spreads a READ's cma copies over one thread a core (at most 4); a prefill, device memory and
a one-core host take none; the caller's number wins and a bad one is refused."""
import pytest

from kvruntime.agent import UCX_READ_THREADS, ucx_threads
from kvruntime.errors import KVRuntimeError


@pytest.mark.parametrize("cpus,wanted", [(1, 0), (2, 2), (3, 3), (16, UCX_READ_THREADS)])
def test_a_host_memory_decode_takes_a_thread_a_core(cpus, wanted):
    n, why = ucx_threads(None, "decode", "cpu", cpus)
    assert n == wanted and why


@pytest.mark.parametrize("role,memory", [("prefill", "cpu"), ("decode", "cuda"),
                                         ("decode", "xpu"), ("prefill", "cuda")])
def test_prefills_and_device_memory_take_none(role, memory):
    assert ucx_threads(None, role, memory, 16)[0] == 0


def test_the_callers_number_wins():
    assert ucx_threads(0, "decode", "cpu", 16) == (0, "yours")
    assert ucx_threads(6, "prefill", "cuda", 2) == (6, "yours")


@pytest.mark.parametrize("bad", [-1, True, 2.0, "2"])
def test_a_bad_number_is_refused(bad):
    with pytest.raises(KVRuntimeError, match="ucx_threads must be"):
        ucx_threads(bad, "decode", "cpu", 2)
