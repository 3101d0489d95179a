"""NIXL discovery errors and UCX transport choice (no NIXL needed)."""

import pytest

from kvruntime.errors import NixlNotFoundError, TransportError
from kvruntime.nixl.binding import CANDIDATES, as_str, load_nixl
from kvruntime.nixl.transports import (
    admitted_am,
    apply_ucx_settings,
    shm_error_handling,
    ucx_environment,
    ucx_settings,
    usable_am,
)


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


# with posix in play, /dev/shm's floor for UCX's shared memory goes to 0 (transports.py)
SHM_MIN = {"UCX_POSIX_SHM_MIN_SIZE": "0"}


def test_ucx_settings():
    host = {"UCX_POSIX_ERROR_HANDLING": "y", "UCX_CMA_SEG_SIZE": "4M", **SHM_MIN}
    assert ucx_settings("cpu", {}) == host
    assert ucx_settings("xpu", {}) == {"UCX_MEMTYPE_CACHE": "n"}
    # CUDA memory: NIXL's active messages over posix too (measured: 2 x H100, transports.py)
    assert ucx_settings("cuda", {}) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
                                        "UCX_POSIX_ERROR_HANDLING": "y", **SHM_MIN}
    assert ucx_settings("cuda", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
                                 "UCX_POSIX_ERROR_HANDLING": "y", **SHM_MIN}) == {}
    # posix in play with the user's error handling: /dev/shm's floor still goes
    assert ucx_settings("cuda", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
                                 "UCX_POSIX_ERROR_HANDLING": "y"}) == SHM_MIN
    assert ucx_settings("cuda", {"UCX_TLS": "tcp,cuda_ipc,cuda_copy"}) == {
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}  # posix not in play: not set
    with pytest.raises(TransportError, match="no active-message transport"):
        ucx_settings("cpu", {"UCX_TLS": "cma"})
    with pytest.raises(TransportError):
        ucx_settings("xpu", {"UCX_TLS": "ze_copy"})
    # tcp only: posix is not in play, so its setting is not added (UCX would warn it unused)
    assert ucx_settings("cpu", {"UCX_TLS": "tcp,cma"}) == {"UCX_CMA_SEG_SIZE": "4M"}
    assert ucx_settings("cpu", {"UCX_TLS": "tcp"}) == {}
    assert ucx_settings("cpu", {"UCX_TLS": "^cma"}) == {"UCX_POSIX_ERROR_HANDLING": "y", **SHM_MIN}
    assert ucx_settings("cpu", {"UCX_TLS": "sm,tcp"}) == host  # sm includes cma
    assert ucx_settings("cpu", {"UCX_CMA_SEG_SIZE": "64M"}) == {"UCX_POSIX_ERROR_HANDLING": "y",
                                                                **SHM_MIN}
    # device memory: no host-memory settings
    assert "UCX_CMA_SEG_SIZE" not in ucx_settings("cuda", {})
    assert "UCX_CMA_SEG_SIZE" not in ucx_settings("xpu", {})


@pytest.mark.parametrize("tls, admitted", [
    (None, {"tcp", "posix", "sysv", "rc", "ud", "dc"}),
    ("tcp,cma", {"tcp"}),
    ("posix,cma", {"posix"}),
    ("sm,cma", {"posix", "sysv"}),
    ("shm", {"posix", "sysv"}),
    ("cma,cuda_ipc,cuda_copy", set()),
    ("^tcp", {"posix", "sysv", "rc", "ud", "dc"}),
    ("^sm", {"tcp", "rc", "ud", "dc"}),
    ("^ib,sm", {"tcp"}),
    ("all", {"tcp", "posix", "sysv", "rc", "ud", "dc"}),
    ("rc_x,cma", {"rc_x"}),
])
def test_admitted_am_transports(tls, admitted):
    env = {} if tls is None else {"UCX_TLS": tls}
    got = admitted_am(env)
    assert {t for t in got if t in {"tcp", "posix", "sysv"}} == \
        {t for t in admitted if t in {"tcp", "posix", "sysv"}}
    assert bool(got & {"rc", "rc_x"}) == bool(admitted & {"rc", "rc_x"})


@pytest.mark.parametrize("env, posix, sysv", [
    ({}, False, False),
    ({"UCX_POSIX_ERROR_HANDLING": "y"}, True, False),
    ({"UCX_MM_ERROR_HANDLING": "yes"}, True, True),
    ({"UCX_MM_ERROR_HANDLING": "y", "UCX_POSIX_ERROR_HANDLING": "n"}, False, True),
    ({"UCX_SYSV_ERROR_HANDLING": "on"}, False, True),
    ({"UCX_POSIX_ERROR_HANDLING": "N"}, False, False),
])
def test_shm_error_handling(env, posix, sysv):
    assert shm_error_handling(env, "posix") is posix
    assert shm_error_handling(env, "sysv") is sysv


def test_shared_memory_am_needs_error_handling():
    # NIXL's endpoints handle peer failure: posix/sysv count only with ERROR_HANDLING on
    assert usable_am({"UCX_TLS": "posix,cma"}) == set()
    assert usable_am({"UCX_TLS": "posix,cma", "UCX_POSIX_ERROR_HANDLING": "y"}) == {"posix"}
    assert usable_am({"UCX_TLS": "sm,cma", "UCX_MM_ERROR_HANDLING": "y"}) == {"posix", "sysv"}
    assert usable_am({"UCX_TLS": "tcp,posix"}) == {"tcp"}
    # host memory: kvruntime turns posix error handling on, so posix alone is enough
    assert ucx_settings("cpu", {"UCX_TLS": "posix,cma"}) == {"UCX_POSIX_ERROR_HANDLING": "y",
                                                              "UCX_CMA_SEG_SIZE": "4M", **SHM_MIN}
    # CUDA memory too; xpu keeps UCX's AM choice: shared memory alone is refused with the reason
    assert ucx_settings("cuda", {"UCX_TLS": "posix,cuda_ipc,cuda_copy"}) == {
        "UCX_POSIX_ERROR_HANDLING": "y", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on", **SHM_MIN}
    with pytest.raises(TransportError, match="UCX_POSIX_ERROR_HANDLING=y"):
        ucx_settings("xpu", {"UCX_TLS": "posix,ze_ipc,ze_copy"})
    with pytest.raises(TransportError, match="UCX_SYSV_ERROR_HANDLING=y"):
        ucx_settings("cpu", {"UCX_TLS": "sysv,cma"})
    assert ucx_settings("cpu", {"UCX_TLS": "sysv,tcp", "UCX_SYSV_ERROR_HANDLING": "y"}) == {}
    assert ucx_settings("xpu", {"UCX_TLS": "posix,ze_copy", "UCX_MM_ERROR_HANDLING": "y"}) == \
        {"UCX_MEMTYPE_CACHE": "n"}


def test_user_choices_are_kept():
    # an explicit "n" is the user's call: not overridden (tcp still carries AM)
    seg = {"UCX_CMA_SEG_SIZE": "4M", **SHM_MIN}  # posix is still in play: its floor goes
    assert ucx_settings("cpu", {"UCX_POSIX_ERROR_HANDLING": "n"}) == seg
    assert ucx_settings("cpu", {"UCX_MM_ERROR_HANDLING": "n"}) == seg
    # but an explicit "n" with no other AM transport is impossible, and said so
    with pytest.raises(TransportError, match="posix would need"):
        ucx_settings("cpu", {"UCX_TLS": "posix,cma", "UCX_POSIX_ERROR_HANDLING": "n"})


def test_apply_and_report():
    env = {"UCX_TLS": "tcp,posix,cma", "PATH": "/bin"}
    added = apply_ucx_settings("cpu", env)
    log_file = env["UCX_LOG_FILE"]  # UCX's log goes where kvruntime reads it (ucxlog.py)
    assert added == {"UCX_POSIX_ERROR_HANDLING": "y", "UCX_CMA_SEG_SIZE": "4M", **SHM_MIN,
                     "UCX_LOG_FILE": log_file, "UCX_PROTO_INFO": "y",
                     "KVRUNTIME_UCX_LOG": env["KVRUNTIME_UCX_LOG"]}
    assert apply_ucx_settings("cpu", env) == {}  # already there: nothing added twice
    assert ucx_environment(env) == {"UCX_CMA_SEG_SIZE": "4M", "UCX_POSIX_ERROR_HANDLING": "y",
                                    **SHM_MIN,
                                    "UCX_TLS": "tcp,posix,cma", "UCX_LOG_FILE": log_file,
                                    "UCX_PROTO_INFO": "y"}


@pytest.mark.parametrize("device, env, offered, want", [
    # single-node Intel GPUs without InfiniBand: ze_ipc + ze_copy + tcp (seed 001)
    ("xpu", {}, {"tcp", "posix", "ze_copy", "ze_ipc"},
     {"UCX_MEMTYPE_CACHE": "n", "UCX_TLS": "ze_ipc,ze_copy,tcp"}),
    # InfiniBand present: UCX's own choice (rc for the bulk across hosts)
    ("xpu", {}, {"tcp", "rc_mlx5", "ze_copy", "ze_ipc"}, {"UCX_MEMTYPE_CACHE": "n"}),
    # a UCX without ze_ipc (e5d9887 has none; PR 11218): nothing forced
    ("xpu", {}, {"tcp", "ze_copy"}, {"UCX_MEMTYPE_CACHE": "n"}),
    # unknown (no ucx_info): nothing that depends on it
    ("xpu", {}, None, {"UCX_MEMTYPE_CACHE": "n"}),
    # the user's UCX_TLS wins
    ("xpu", {"UCX_TLS": "ze_copy,tcp"}, {"tcp", "ze_copy", "ze_ipc"}, {"UCX_MEMTYPE_CACHE": "n"}),
    ("cuda", {}, {"tcp", "posix", "cuda_ipc", "cuda_copy"},
     {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on", "UCX_POSIX_ERROR_HANDLING": "y", **SHM_MIN}),
    ("cpu", {}, {"tcp", "posix", "cma"},
     {"UCX_POSIX_ERROR_HANDLING": "y", "UCX_CMA_SEG_SIZE": "4M", **SHM_MIN}),
])
def test_policy_table(device, env, offered, want):
    assert ucx_settings(device, env, offered) == want


def test_policy_says_why_and_keeps_the_users_settings():
    from kvruntime.nixl.transports import describe

    lines = describe({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}, {"UCX_TLS": "tcp,cuda_ipc"}, "cuda")
    assert lines[0].startswith("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on: a pull (READ)")
    assert "UCX_TLS=tcp,cuda_ipc: yours, kept" in lines


def test_xpu_says_why_it_falls_back_to_ze_copy():
    """Issue 28: the ze_copy fallback is said, not silent (the real ucx_info -d of both pinned xpu
    builds: tests/integration/installer/test_pinned_builds.py)."""
    from kvruntime.nixl.transports import REASONS, describe, xpu_tls

    release = {"tcp", "posix", "sysv", "cma", "self", "ze_copy"}
    assert xpu_tls({}, release | {"ze_ipc"}) == ("ze_ipc,ze_copy,tcp", REASONS["UCX_TLS"])
    tls, why = xpu_tls({}, release)
    assert tls is None and why.startswith("ze_copy fallback: this UCX offers no ze_ipc")
    assert xpu_tls({}, release | {"ze_ipc", "rc_mlx5"})[1].startswith("InfiniBand here (rc_mlx5)")
    assert xpu_tls({}, None)[1].startswith("ze_copy fallback: this UCX's transports are unknown")
    assert xpu_tls({"UCX_TLS": "ze_copy,tcp"}, release)[1] == "UCX_TLS=ze_copy,tcp: yours, kept"
    lines = describe(ucx_settings("xpu", {}, release), {}, "xpu", release)
    assert lines == [
        "UCX_MEMTYPE_CACHE=n: Intel GPU memory is not seen through UCX's memory-type cache",
        f"UCX_TLS unset: {why}",
    ]
    chosen = ucx_settings("xpu", {}, release | {"ze_ipc"})
    assert not any(
        line.startswith("UCX_TLS unset")
        for line in describe(chosen, {}, "xpu", release | {"ze_ipc"})
    )


def test_offered_transports_from_this_hosts_ucx_info_or_none():
    from kvruntime.nixl.transports import offered_transports

    got = offered_transports()
    assert got is None or "tcp" in got  # ucx_info lists tcp wherever it runs


def test_policy_says_the_xpu_choice_and_why_in_every_case():
    from kvruntime.nixl.transports import REASONS, policy

    release = {"cma", "posix", "self", "sysv", "tcp", "ze_copy"}
    assert "UCX_TLS=ze_ipc,ze_copy,tcp: " + REASONS["UCX_TLS"] in policy(
        "xpu", {}, release | {"ze_ipc"}
    )
    assert policy("xpu", {}, release)[-1].startswith(
        "UCX_TLS unset: ze_copy fallback: this UCX offers no ze_ipc"
    )
    assert policy("xpu", {}, None)[-1].startswith(
        "UCX_TLS unset: ze_copy fallback: this UCX's transports are unknown"
    )
    assert (
        policy("xpu", {"UCX_TLS": "ze_copy,tcp"}, release)[-1] == "UCX_TLS=ze_copy,tcp: yours, kept"
    )
    refused = policy("cpu", {"UCX_TLS": "cma"}, None)
    assert len(refused) == 1 and refused[0].startswith(
        "refused: UCX_TLS=cma has no active-message transport"
    )
    assert not any(line.startswith("UCX_TLS") for line in policy("cuda", {}, None))
