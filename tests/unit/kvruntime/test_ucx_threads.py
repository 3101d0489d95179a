"""agent.ucx_threads: NIXL's UCX threads for a side. A decode whose NIXL moves host memory
spreads a READ's cma copies over one thread a core (at most 4) where /dev/shm has room for
their workers; a prefill, device memory, a one-core host and a small /dev/shm (a container's
64 MiB) take none; the caller's number wins and a bad one is refused."""
import pytest

from kvruntime.errors import KVRuntimeError
from kvruntime.nixl.agent import UCX_READ_THREADS, UCX_THREADS_MIN_SHM, shm_free, ucx_threads

ROOM = 8 << 30  # a host's /dev/shm: half its memory


@pytest.fixture(autouse=True)
def _no_forced_threads(monkeypatch):
    """Each test says its KVRUNTIME_UCX_THREADS itself (a suite may run with it set)."""
    monkeypatch.delenv("KVRUNTIME_UCX_THREADS", raising=False)


@pytest.mark.parametrize("cpus,wanted", [(1, 0), (2, 2), (3, 3), (16, UCX_READ_THREADS)])
def test_a_host_memory_decode_takes_a_thread_a_core(cpus, wanted):
    n, why = ucx_threads(None, "decode", "cpu", cpus, ROOM)
    assert n == wanted and why


@pytest.mark.parametrize("role,memory", [("prefill", "cpu"), ("decode", "cuda"),
                                         ("decode", "xpu"), ("prefill", "cuda")])
def test_prefills_and_device_memory_take_none(role, memory):
    assert ucx_threads(None, role, memory, 16, ROOM)[0] == 0


def test_the_callers_number_wins():
    assert ucx_threads(0, "decode", "cpu", 16, ROOM) == (0, "yours")
    assert ucx_threads(6, "prefill", "cuda", 2, 0) == (6, "yours")


@pytest.mark.parametrize("bad", [-1, True, 2.0, "2"])
def test_a_bad_number_is_refused(bad):
    with pytest.raises(KVRuntimeError, match="ucx_threads must be"):
        ucx_threads(bad, "decode", "cpu", 2, ROOM)


@pytest.mark.parametrize("shm", [None, 0, 64 << 20, UCX_THREADS_MIN_SHM - 1])
def test_a_small_dev_shm_takes_none_and_says_why(shm):
    """Each thread's UCX worker takes ~4 MiB of /dev/shm: a container's 64 MiB held a TP
    group's decodes on threads no longer (UCX 1.22 crashed when it ran out)."""
    n, why = ucx_threads(None, "decode", "cpu", 16, shm)
    assert n == 0 and "/dev/shm" in why and "--shm-size" in why
    assert ucx_threads(None, "decode", "cpu", 16, UCX_THREADS_MIN_SHM)[0] == UCX_READ_THREADS


def test_shm_free_reads_the_filesystem(tmp_path):
    assert shm_free(str(tmp_path)) > 0
    assert shm_free(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("value,memory,wanted", [("0", "cpu", 0), ("3", "cpu", 3),
                                                 ("2", "cuda", 2)])
def test_kvruntime_ucx_threads_sets_a_decodes_whatever_the_choice(value, memory, wanted):
    env = {"KVRUNTIME_UCX_THREADS": value}
    assert ucx_threads(None, "decode", memory, 16, ROOM, env) == (wanted, "KVRUNTIME_UCX_THREADS")
    assert ucx_threads(1, "decode", memory, 16, ROOM, env) == (1, "yours")  # the caller's wins


def test_kvruntime_ucx_threads_leaves_a_prefill_without_threads():
    """NIXL 1.5.1 crashed in get_new_notifs with threads on both sides (agent.py): a prefill
    gets them only from its caller."""
    assert ucx_threads(None, "prefill", "cpu", 16, ROOM, {"KVRUNTIME_UCX_THREADS": "2"})[0] == 0


@pytest.mark.parametrize("bad", ["-1", "2.0", "x", "65", "1" * 5000, "\n"])
def test_a_bad_kvruntime_ucx_threads_is_refused_in_one_line(bad):
    with pytest.raises(KVRuntimeError, match="KVRUNTIME_UCX_THREADS must be a number of threads "
                       "from 0 to 64") as err:
        ucx_threads(None, "decode", "cpu", 16, ROOM, {"KVRUNTIME_UCX_THREADS": bad})
    assert "\n" not in str(err.value) and len(str(err.value)) < 200
