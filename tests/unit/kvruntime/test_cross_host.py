"""The choice across hosts (transports.cross_host) on real ``ucx_info -d`` listings: the pinned
cpu build with RDMA on this host (no HCA), the same build under UCX's contrib/ibmock (two fake
EFA devices), and a public mlx5 excerpt. Each fixture's header says where its text comes from."""

import os
from pathlib import Path

import pytest

from kvruntime.errors import TransportError
from kvruntime.nixl.nics import Nic, Port, RdmaHost
from kvruntime.nixl.transports import cross_host, describe, parse_ucx_info, policy, ucx_settings

FIXTURES = Path(__file__).parent / "fixtures"
CPU_BUILD = parse_ucx_info((FIXTURES / "ucx_info_cpu_rdma_build.txt").read_text())
IBMOCK = parse_ucx_info((FIXTURES / "ucx_info_cpu_rdma_build_ibmock_efa.txt").read_text())
MLX5 = parse_ucx_info((FIXTURES / "ucx_info_mlx5_excerpt_openucx_7960.txt").read_text())
UP = Port(1, "ACTIVE", "InfiniBand", "200 Gb/sec (4X HDR)")
DOWN = Port(1, "DOWN", "InfiniBand", "")
INTERFACES = ("eth0", "lo")
# one host's settings for each memory kind (test_binding_transports.py): unchanged across hosts
SHM = {"UCX_POSIX_ERROR_HANDLING": "y", "UCX_POSIX_SHM_MIN_SIZE": "0"}
ONE_HOST = {"cpu": {**SHM, "UCX_CMA_SEG_SIZE": "4M"}, "xpu": {"UCX_MEMTYPE_CACHE": "n"},
            "cuda": {**SHM, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}}


def _efa_host(**facts) -> RdmaHost:
    """This host as ibmock shows it: two EFA devices, rdmap0 and rdmap1, port 1 of each."""
    rdmap = tuple(Nic(f"rdmap{i}", (UP,), None, None) for i in (0, 1))
    return RdmaHost(nics=rdmap, net_interfaces=INTERFACES, **facts)


def test_the_listings_are_read_with_their_devices():
    assert CPU_BUILD == {"self": {"memory"}, "tcp": {"eth0", "lo"}, "sysv": {"memory"},
                         "posix": {"memory"}, "cma": {"memory"}}
    assert IBMOCK == {**CPU_BUILD, "ud_verbs": {"rdmap0:1", "rdmap1:1"},
                      "srd": {"rdmap0:1", "rdmap1:1"}}
    assert MLX5 == {"rc_verbs": {"mlx5_0:1"}}  # the excerpt starts after tcp's Transport line


@pytest.mark.parametrize("kind", ["cpu", "cuda", "xpu"])
def test_one_host_without_rdma_keeps_its_settings_and_says_tcp(kind):
    host = RdmaHost(net_interfaces=INTERFACES)
    assert ucx_settings(kind, {}, CPU_BUILD, host) == ONE_HOST[kind]
    assert cross_host(kind, {}, CPU_BUILD, host).lines == (
        "across hosts: tcp: no RDMA device on this host",)
    down = RdmaHost(nics=(Nic("mlx5_0", (DOWN,), None, None),), net_interfaces=INTERFACES)
    assert cross_host(kind, {}, CPU_BUILD, down).lines == (
        "across hosts: tcp: no RDMA port is ACTIVE: mlx5_0 (port 1 DOWN InfiniBand) on this "
        "host",)


def test_ibmock_devices_sysfs_does_not_show_are_said_and_may_be_named():
    # ibmock fakes libibverbs, not /sys: UCX lists rdmap0:1 and rdmap1:1, sysfs nothing
    host = RdmaHost(net_interfaces=INTERFACES)
    assert cross_host("cpu", {}, IBMOCK, host).lines == (
        "across hosts: tcp: no RDMA device on this host (sysfs), though this UCX lists "
        "rdmap0:1, rdmap1:1 (a fake libibverbs such as UCX's ibmock, or a /sys without "
        "class/infiniband): UCX may use them",)
    # UCX's own EFA test sets UCX_NET_DEVICES=rdmap0:1 (contrib/test_efa.sh): UCX opens it
    assert ucx_settings("cpu", {"UCX_NET_DEVICES": "rdmap0:1"}, IBMOCK, host) == ONE_HOST["cpu"]
    with pytest.raises(TransportError, match="names rdmap0:1, not on this host"):
        ucx_settings("cpu", {"UCX_NET_DEVICES": "rdmap0:1"}, CPU_BUILD, host)


def test_a_build_that_offers_no_rdma_transport_on_an_active_port_says_so():
    # the real cpu build's listing beside an ACTIVE port: what a TCP-only UCX would show there
    host = RdmaHost(nics=(Nic("mlx5_0", (UP,), None, None),), net_interfaces=INTERFACES)
    cross = cross_host("cuda", {}, CPU_BUILD, host)
    assert cross.settings == {}
    assert cross.lines[0].startswith("across hosts: tcp although mlx5_0:1 is ACTIVE: this UCX "
                                     "offers no RDMA transport there")


def test_efa_under_ibmock_is_rdma_and_the_gpus_nearest_nic_is_pinned():
    host = _efa_host(nearest=(Nic("rdmap1", (UP,), None, None), "behind the same PCIe bridge"),
                     gpu="0000:18:00.0")
    cross = cross_host("cuda", ONE_HOST["cuda"], IBMOCK, host)
    # rdmap1 alone (no tcp): srd and ud_verbs carry NIXL's AM across hosts, posix on this one
    assert cross.settings == {"UCX_NET_DEVICES": "rdmap1:1"}
    assert cross.lines[0] == ("across hosts: RDMA (srd, ud_verbs on rdmap0:1, rdmap1:1), which "
                              "also carries NIXL's active messages with peer-failure handling")
    assert cross.lines[1] == ("UCX_NET_DEVICES=rdmap1:1: rdmap1:1 is the nearest of 2 NICs to "
                              "the GPU 0000:18:00.0 (behind the same PCIe bridge)")
    assert ucx_settings("cuda", {}, IBMOCK, host) == {**ONE_HOST["cuda"],
                                                      "UCX_NET_DEVICES": "rdmap1:1"}


def test_without_a_shared_memory_am_lane_lo_stays_in_the_list():
    # xpu keeps UCX's AM choice (no posix error handling): NIXL's endpoint to itself needs tcp
    # on lo once the list names RDMA ports only (SGLang #40641)
    host = _efa_host(nearest=(Nic("rdmap0", (UP,), None, None), "why"), gpu="0000:18:00.0")
    assert ucx_settings("xpu", {}, IBMOCK, host)["UCX_NET_DEVICES"] == "rdmap0:1,lo"
    # ...unless UCX_TLS leaves tcp out
    assert cross_host("xpu", {"UCX_TLS": "srd,ze_copy"}, IBMOCK, host).settings == {
        "UCX_NET_DEVICES": "rdmap0:1"}


def test_host_memory_and_unknown_gpus_leave_the_device_list_to_ucx():
    host = _efa_host()
    cpu = cross_host("cpu", {}, IBMOCK, host)
    assert cpu.settings == {} and cpu.lines[1] == (
        "UCX_NET_DEVICES unset: host memory is near every NIC alike; UCX uses all 2")
    cuda = cross_host("cuda", {}, IBMOCK, host)  # no GPU address: nearness unknown
    assert cuda.settings == {} and cuda.lines[1].startswith(
        "UCX_NET_DEVICES unset here: the GPU's PCI address is not known in this process")
    lost = cross_host("cuda", {}, IBMOCK, _efa_host(gpu="0000:18:00.0"))  # not in sysfs
    assert lost.settings == {} and lost.lines[1] == (
        "UCX_NET_DEVICES unset: the GPU 0000:18:00.0 is not in sysfs (bus/pci/devices), so its "
        "nearest of 2 NICs is unknown: UCX chooses")
    one = RdmaHost(nics=(Nic("rdmap0", (UP,), None, None),), net_interfaces=INTERFACES)
    assert cross_host("cuda", {}, IBMOCK, one).lines[1] == (
        "UCX_NET_DEVICES unset: rdmap0 is the only NIC with an ACTIVE port")


def test_a_public_mlx5_listing_is_rdma_over_rc_verbs():
    host = RdmaHost(nics=(Nic("mlx5_0", (UP,), None, None),), net_interfaces=INTERFACES)
    assert cross_host("cpu", {}, MLX5, host).lines[0].startswith(
        "across hosts: RDMA (rc_verbs on mlx5_0:1)")


def test_a_user_tls_without_rdma_is_said_and_one_without_am_still_refused():
    host = _efa_host()
    cross = cross_host("cuda", {"UCX_TLS": "tcp,cuda_ipc,cuda_copy"}, IBMOCK, host)
    assert cross.settings == {} and cross.lines[0] == (
        "across hosts: tcp although rdmap0:1, rdmap1:1 are ACTIVE: UCX_TLS=tcp,cuda_ipc,"
        "cuda_copy (yours) admits none of srd, ud_verbs")
    with pytest.raises(TransportError, match="no active-message transport"):
        ucx_settings("cpu", {"UCX_TLS": "cma"}, IBMOCK, host)
    # an RDMA-only UCX_TLS is fine: srd carries AM with peer-failure handling
    assert ucx_settings("cpu", {"UCX_TLS": "srd,cma"}, IBMOCK, host) == {"UCX_CMA_SEG_SIZE": "4M"}
    assert ucx_settings("cpu", {"UCX_TLS": "ud_v,cma"}, IBMOCK, host) == {"UCX_CMA_SEG_SIZE": "4M"}


def test_a_users_device_list_naming_an_absent_device_is_one_line():
    host = RdmaHost(net_interfaces=INTERFACES)
    with pytest.raises(TransportError) as exc:
        ucx_settings("cuda", {"UCX_NET_DEVICES": "mlx5_0:1"}, CPU_BUILD, host)
    assert str(exc.value) == (
        "UCX_NET_DEVICES=mlx5_0:1 names mlx5_0:1, not on this host (RDMA ports: none; network "
        "interfaces: eth0, lo): UCX would open no such device and NIXL fail with "
        "NIXL_ERR_BACKEND")
    with pytest.raises(TransportError, match=r"names mlx5_0, not on this host \(RDMA ports: "
                                             r"rdmap0:1, rdmap1:1;"):
        ucx_settings("cpu", {"UCX_NET_DEVICES": "mlx5_0"}, IBMOCK, _efa_host())  # no port
    # also when this UCX's transports are unknown (no ucx_info): sysfs alone says it
    assert policy("cpu", {"UCX_NET_DEVICES": "eth1"}, None, host)[0].startswith(
        "refused: UCX_NET_DEVICES=eth1 names eth1, not on this host")


def test_a_users_device_list_must_leave_an_am_lane_to_other_hosts():
    # prime-rl #3204: an RDMA port pinned while UCX offers nothing on it (the cpu build seeing
    # no HCA) leaves no transport: NIXL_ERR_BACKEND, said here first
    host = _efa_host()
    with pytest.raises(TransportError, match="UCX_NET_DEVICES=rdmap0:1 leaves NIXL no "
                                             "active-message transport to another host"):
        ucx_settings("cpu", {"UCX_NET_DEVICES": "rdmap0:1"}, CPU_BUILD, host)
    # RDMA ports only, where UCX offers srd/ud on them: fine, rc/ud/srd carry AM
    cross = cross_host("cpu", {"UCX_NET_DEVICES": "rdmap0:1"}, IBMOCK, host)
    assert cross.settings == {} and "UCX_NET_DEVICES=rdmap0:1: yours, kept" in cross.lines
    # a network interface alone: tcp on it, said as such where RDMA ports are up
    assert ucx_settings("cpu", {"UCX_NET_DEVICES": "eth0"}, CPU_BUILD, host) == ONE_HOST["cpu"]
    assert cross_host("cpu", {"UCX_NET_DEVICES": "eth0"}, IBMOCK, host).lines == (
        "across hosts: tcp although rdmap0:1, rdmap1:1 are ACTIVE: UCX_NET_DEVICES=eth0 (yours) "
        "names none of them",)
    assert cross_host("cpu", {"UCX_NET_DEVICES": "rdmap1:1"}, IBMOCK, host).lines[0].startswith(
        "across hosts: RDMA (srd, ud_verbs on rdmap1:1)")  # the ports the list keeps
    # a UCX_TLS that keeps no AM transport on the listed devices
    with pytest.raises(TransportError, match="leaves NIXL no active-message transport"):
        ucx_settings("cpu", {"UCX_NET_DEVICES": "rdmap0:1", "UCX_TLS": "tcp,posix,cma"},
                     IBMOCK, host)


@pytest.mark.parametrize("value", ["all", "^mlx5_7:1", "rdmap[0-1]:1", " rdmap0:1 , lo "])
def test_device_lists_ucx_accepts(value):
    cross_host("cpu", {"UCX_NET_DEVICES": value}, IBMOCK, _efa_host())


@pytest.mark.parametrize("value, error", [
    ("rdmap[0-2]:1", "names rdmap2:1, not on this host"),
    ("x[0-99999999]", "range x[0-99999999] is not one UCX expands"),
    ("x[5-1]", "range x[5-1] is not one UCX expands"),
])
def test_device_lists_refused(value, error):
    with pytest.raises(TransportError, match=error.replace("[", r"\[")):
        cross_host("cpu", {"UCX_NET_DEVICES": value}, IBMOCK, _efa_host())


@pytest.mark.parametrize("value", ["mlx5_0:1\nUCX ERROR forged", "\x1b[2Jeth0",
                                   "x[0-" + "9" * 5000 + "]", "eth0,,\x00"])
def test_a_hostile_device_list_is_refused_in_one_printable_line(value):
    with pytest.raises(TransportError) as exc:
        ucx_settings("cpu", {"UCX_NET_DEVICES": value}, CPU_BUILD, _efa_host())
    said = str(exc.value)
    assert said.startswith("UCX_NET_DEVICES=") and said.isprintable()


@pytest.mark.parametrize("kind, facts, said", [
    ("cuda", {"nvidia_peermem": True}, "GPUDirect RDMA: nvidia_peermem is loaded"),
    ("cuda", {"cuda_dmabuf": True, "verbs_dmabuf": True}, "GPUDirect RDMA through DMA-BUF"),
    ("cuda", {"cuda_dmabuf": True, "verbs_dmabuf": False},
     "no GPUDirect RDMA (nvidia_peermem not loaded; libibverbs has no ibv_reg_dmabuf_mr"),
    ("cuda", {}, "no GPUDirect RDMA (nvidia_peermem not loaded; the CUDA driver's DMA-BUF "
                 "support is unknown): UCX stages device memory through host memory"),
    ("xpu", {"xe_driver": True, "verbs_dmabuf": True}, "GPUDirect RDMA through DMA-BUF: the xe"),
    ("xpu", {"verbs_dmabuf": True}, "no GPUDirect RDMA (the xe driver is not loaded"),
])
def test_gpudirect_or_staging_is_said(kind, facts, said):
    lines = cross_host(kind, {}, IBMOCK, _efa_host(**facts)).lines
    assert lines[-1].startswith(f"across hosts, {kind} memory: {said}")
    assert not any("GPUDirect" in line for line in cross_host("cpu", {}, IBMOCK,
                                                              _efa_host(**facts)).lines)


def test_policy_and_describe_say_the_choice_once():
    host = _efa_host(nearest=(Nic("rdmap1", (UP,), None, None), "why"), gpu="0000:18:00.0")
    lines = policy("cuda", {}, IBMOCK, host)
    assert sum(line.startswith("UCX_NET_DEVICES=") for line in lines) == 1
    assert lines[-1].startswith("across hosts, cuda memory: no GPUDirect RDMA")
    cross = cross_host("cuda", ONE_HOST["cuda"], IBMOCK, host)
    assert describe({**ONE_HOST["cuda"], **cross.settings}, {}, "cuda", IBMOCK, cross)[-3:] == \
        list(cross.lines)
    assert policy("cuda", {}, IBMOCK, None) == policy("cuda", {}, None)  # host unread: one host


def test_selftest_and_bench_print_the_choice_across_hosts(monkeypatch, capfd):
    """The text output shows the choice across hosts beside the one-host transport choice
    (their runs stubbed: running them is the integration tests' job)."""
    import kvruntime.tools.bench as bench
    import kvruntime.tools.selftest as selftest
    from kvruntime.__main__ import main

    host = _efa_host(nearest=(Nic("rdmap1", (UP,), None, None), "why"), gpu="0000:18:00.0")
    said = {"cuda": policy("cuda", {}, IBMOCK, host)}
    monkeypatch.setattr(selftest, "run_selftest", lambda **_: {
        "ok": True, "modes": [], "ucx_policy": said, "seconds": 1.0, "nixl_module": "stub"})
    monkeypatch.setattr(bench, "run_bench", lambda cfg: {"ok": True, "ucx_policy": said})
    want = [f"UCX for cuda memory: {line}" for line in said["cuda"]
            if line.startswith(("across hosts", "UCX_NET_DEVICES"))]
    assert len(want) == 3  # the wire, the NIC and GPUDirect
    for argv in (["selftest", "--tp-pairs", "none"], ["bench", "--device", "cuda"]):
        assert main(argv) == 0
        printed = capfd.readouterr().out.splitlines()
        assert [line for line in printed if line in want] == want, printed
        assert not any("UCX_POSIX_ERROR_HANDLING" in line for line in printed)  # --json has it


def test_the_policy_command_says_every_line_and_exits_3_on_a_refusal(monkeypatch, capfd):
    """``python -m kvruntime policy`` on this host (no HCA): every setting and why, per memory
    kind; a device list naming a port no host here has is refused, exit 3."""
    import json

    from kvruntime.__main__ import main

    # a UCX_* an earlier test's agent set in this process would read as the user's ("yours, kept")
    for name in [k for k in os.environ if k.startswith("UCX_")] + ["KVRUNTIME_UCX_LOG"]:
        monkeypatch.delenv(name, raising=False)
    assert main(["policy"]) == 0
    printed = capfd.readouterr().out.splitlines()
    assert "UCX for host memory: UCX_CMA_SEG_SIZE=4M: host memory moves by cma in 4 MiB " \
           "segments (512 KiB: 2048 calls per GiB)" in printed
    assert sum(line.startswith("UCX for cuda memory: across hosts: ") for line in printed) == 1
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_77:1")
    assert main(["policy", "--json", "--compact"]) == 3
    report = json.loads(capfd.readouterr().out)
    assert report["ok"] is False and report["ucx_policy"]["cuda"][0].startswith(
        "refused: UCX_NET_DEVICES=mlx5_77:1 names mlx5_77:1, not on this host")
