"""Fixtures: a prefill server in a spawned process (real NIXL, 127.0.0.1, port 0), always reaped."""

import contextlib
import multiprocessing as mp

import pytest



def pytest_configure(config):
    # pyproject registers these for the whole suite; repeated here so this directory runs alone
    config.addinivalue_line("markers", "integration: real NIXL agents, processes and sockets")
    config.addinivalue_line("markers", "gpu: needs a CUDA or XPU device")


def _have_nixl() -> bool:
    from kvruntime.binding import load_nixl
    from kvruntime.errors import NixlNotFoundError

    try:
        load_nixl()
        return True
    except NixlNotFoundError:
        return False


@pytest.fixture(scope="session", autouse=True)
def _require_nixl():
    if not _have_nixl():
        pytest.skip("no NIXL Python module installed (pip install --no-deps nixl-cu12)")


@contextlib.contextmanager
def spawn_prefill(layouts, seed=1, **options):
    """Yield (process, ports). The process is stopped, then killed if need be, then joined."""
    ctx = mp.get_context("spawn")
    ready_q, control = ctx.Queue(), ctx.Queue()
    from kvruntime.roles import prefill_main, reap

    proc = ctx.Process(target=prefill_main, daemon=True,
                       args=(ready_q, control, [l.to_dict() for l in layouts], seed, options))
    proc.start()
    try:
        ready = ready_q.get(timeout=60)
        assert ready["ok"], ready
        yield proc, ready["ports"]
    finally:
        reap(proc, control)
        ready_q.close(), control.close()


@pytest.fixture
def prefill():
    return spawn_prefill
