"""Device memory choices that need no device: the UCX setting each role applies first, and the
reasons device modes are skipped where torch or the device is missing (never 'passed')."""

import os

import pytest

from kvruntime.errors import KVRuntimeError
from kvruntime.layout import CROSS_LAYER, KVLayout
from kvruntime.memory import KVCache, device_unavailable
from kvruntime.tools.roles import allocate_cache, device_of, prepare_process
from kvruntime.tools.selftest import skipped_modes

LAYOUT = KVLayout(CROSS_LAYER, 2, 8, 16, 2, 64, "float16")


def test_cuda_role_gets_cuda_ipc_get_zcopy_before_nixl(monkeypatch):
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    prepare_process({"device": "cpu"})
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ
    prepare_process({"device": "cuda"})
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"


def test_a_users_own_setting_is_kept(monkeypatch):
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "off")
    prepare_process({"device": "cuda"})
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "off"


def test_host_roles_stay_on_host_memory():
    assert device_of({}) == device_of({"device": None}) == "cpu"
    assert device_unavailable("cpu") is None
    cache = allocate_cache(LAYOUT, {"huge": False})
    try:
        assert cache.mem_type == "DRAM" and cache.tensors is None
    finally:
        cache.close()


@pytest.mark.parametrize("device", ["cuda", "xpu"])
def test_missing_device_gives_a_reason_and_skipped_modes(device):
    reason = device_unavailable(device)
    if reason is None:
        pytest.skip(f"this host has {device} memory")
    assert device in reason
    with pytest.raises(KVRuntimeError, match=device):
        KVCache.allocate_device(LAYOUT, device, 0)
    modes = skipped_modes(device, reason)
    # 2 layouts x (nixl and samenode: pull, push, prefill_push; staged: pull, push)
    assert len(modes) == 16
    assert sum(m["op"] == "prefill_push" for m in modes) == 4
    assert {m['engine'] for m in modes} == {'nixl', 'samenode', 'staged'}
    assert all(m["status"] == "skipped" and m["reason"] == reason for m in modes)
    assert all(m["mode"].startswith(f"{device}/") for m in modes)


def test_kv_buffer_default_comes_from_the_environment(monkeypatch):
    from kvruntime.pools.staging import resolve_kv_buffer

    monkeypatch.delenv("KVRUNTIME_KV_BUFFER", raising=False)
    assert resolve_kv_buffer(None) == "device"
    monkeypatch.setenv("KVRUNTIME_KV_BUFFER", "host_staged")  # what tpu's env.sh sets
    assert resolve_kv_buffer(None) == "host_staged"
    assert resolve_kv_buffer("device") == "device"  # an explicit choice wins
    monkeypatch.setenv("KVRUNTIME_KV_BUFFER", "gpu")
    with pytest.raises(KVRuntimeError, match="KVRUNTIME_KV_BUFFER must be one of"):
        resolve_kv_buffer(None)


def test_xpu_goes_direct_only_with_a_ze_capable_ucx(monkeypatch, caplog):
    import logging

    from kvruntime.pools.staging import resolve_kv_buffer

    monkeypatch.delenv("KVRUNTIME_KV_BUFFER", raising=False)
    assert resolve_kv_buffer(None, "xpu", lambda: {"tcp", "ze_copy"}) == "device"
    with caplog.at_level(logging.WARNING, logger="kvruntime"):
        assert resolve_kv_buffer(None, "xpu", lambda: {"tcp", "cma"}) == "host_staged"
        assert resolve_kv_buffer(None, "xpu", lambda: None) == "host_staged"
    assert "offers no Level Zero transport" in caplog.text and "no ucx_info" in caplog.text
    assert resolve_kv_buffer("device", "xpu", lambda: None) == "device"  # asked for: kept
    assert resolve_kv_buffer(None, "cuda", lambda: None) == "device"
