"""NIXL discovery errors and UCX transport choice (no NIXL needed)."""

import pytest

from kvruntime.binding import CANDIDATES, as_str, load_nixl
from kvruntime.errors import NixlNotFoundError, TransportError
from kvruntime.transports import ucx_settings


def test_missing_module_names_what_was_tried(monkeypatch):
    monkeypatch.setenv("KVRUNTIME_NIXL_MODULE", "nixl_does_not_exist")
    with pytest.raises(NixlNotFoundError, match="nixl_does_not_exist") as exc:
        load_nixl()
    assert "KVRUNTIME_NIXL_MODULE" in str(exc.value)


def test_argument_beats_env(monkeypatch):
    monkeypatch.setenv("KVRUNTIME_NIXL_MODULE", "json")
    with pytest.raises(NixlNotFoundError, match="no_such_nixl"):
        load_nixl("no_such_nixl")


def test_module_without_agent_is_refused():
    with pytest.raises(NixlNotFoundError, match="has no nixl_agent"):
        load_nixl("json")


def test_default_search_order():
    assert CANDIDATES == ("nixl_cpu", "nixl_xpu", "nixl_cu13", "nixl_cu12", "nixl")


def test_agent_names_as_str():
    assert as_str(b"agent") == "agent" and as_str("agent") == "agent"


def test_ucx_settings():
    assert ucx_settings("cpu", {}) == {}
    assert ucx_settings("xpu", {}) == {"UCX_MEMTYPE_CACHE": "n"}
    assert ucx_settings("cuda", {}) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert ucx_settings("cuda", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}) == {}
    with pytest.raises(TransportError, match="no active-message transport"):
        ucx_settings("cpu", {"UCX_TLS": "cma"})
    with pytest.raises(TransportError):
        ucx_settings("xpu", {"UCX_TLS": "ze_copy"})
    assert ucx_settings("cpu", {"UCX_TLS": "tcp,cma"}) == {}
