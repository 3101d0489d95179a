"""This host's RDMA NICs from sysfs, and the one nearest a GPU (kvruntime/nixl/nics.py), on fake
sysfs trees: no machine here has an HCA."""

import os

import pytest

from kvruntime.nixl import nics

# One host, two sockets. Socket 0's root complex pci0000:00 has a PCIe switch (upstream port
# 0000:01:00.0, downstream ports 0000:02:00.0 and 0000:02:04.0) with the GPU behind one port
# and mlx5_0 behind the other; mlx5_1 hangs off another root port of the same root complex;
# mlx5_2 is on socket 1 (pci0000:80). The GPU is on NUMA node 0.
SWITCH = "pci0000:00/0000:00:01.0/0000:01:00.0"
GPU = "0000:03:00.0"
PCI = {
    GPU: (f"{SWITCH}/0000:02:00.0/{GPU}", 0),
    "0000:04:00.0": (f"{SWITCH}/0000:02:04.0/0000:04:00.0", 0),  # mlx5_0
    "0000:05:00.0": ("pci0000:00/0000:00:02.0/0000:05:00.0", 0),  # mlx5_1
    "0000:81:00.0": ("pci0000:80/0000:80:01.0/0000:81:00.0", 1),  # mlx5_2
}
HDR = {"state": "4: ACTIVE", "link_layer": "InfiniBand", "rate": "200 Gb/sec (4X HDR)"}


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(text if isinstance(text, bytes) else (text + "\n").encode())


@pytest.fixture
def sysfs(tmp_path):
    """A sysfs tree as the Linux kernel lays it out (Documentation/ABI/stable/
    sysfs-class-infiniband: class/infiniband/<dev>/ports/<n>/{state,link_layer,rate} and the
    <dev>/device link to its PCI function; bus/pci/devices/<address> links to the function's
    directory under devices/, whose path names every bridge above it; numa_node beside it).
    Built here because no HCA exists on any machine of this project. Returns (root, add):
    add(name, pci_address, ports={n: {attribute: text}}) registers an RDMA device."""
    root = tmp_path / "sys"
    for address, (path, numa) in PCI.items():
        _write(str(root / "devices" / path / "numa_node"), str(numa))
        link = root / "bus" / "pci" / "devices" / address
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(root / "devices" / path, link.parent))
    for interface in ("eth0", "lo", "ib0"):
        (root / "class" / "net" / interface).mkdir(parents=True)

    def add(name, address, ports):
        function = root / "devices" / PCI[address][0]
        device_dir = function / "infiniband" / name
        for number, attributes in ports.items():
            for attribute, text in attributes.items():
                _write(str(device_dir / "ports" / str(number) / attribute), text)
        (device_dir / "device").symlink_to("../../../" + function.name)
        (root / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
        (root / "class" / "infiniband" / name).symlink_to(device_dir)

    return str(root), add


def test_devices_ports_pci_path_and_numa_node_are_read(sysfs):
    root, add = sysfs
    add("mlx5_0", "0000:04:00.0", {1: HDR, 2: {**HDR, "state": "1: DOWN"}})
    add("mlx5_2", "0000:81:00.0", {1: {**HDR, "link_layer": "Ethernet"}})
    got = nics.rdma_devices(root)
    assert [n.name for n in got] == ["mlx5_0", "mlx5_2"]
    first = got[0]
    assert first.ports == (nics.Port(1, "ACTIVE", "InfiniBand", "200 Gb/sec (4X HDR)"),
                           nics.Port(2, "DOWN", "InfiniBand", "200 Gb/sec (4X HDR)"))
    assert first.pci_path.endswith(f"{SWITCH}/0000:02:04.0/0000:04:00.0")
    assert first.numa_node == 0 and got[1].numa_node == 1
    assert first.net_device() == "mlx5_0:1" and [p.number for p in first.active_ports] == [1]
    assert got[1].ports[0].link_layer == "Ethernet"  # RoCE
    assert str(first) == ("mlx5_0 (port 1 ACTIVE InfiniBand 200 Gb/sec (4X HDR), "
                          "port 2 DOWN InfiniBand 200 Gb/sec (4X HDR))")


def test_missing_or_garbage_sysfs_text_is_unknown_never_an_error(sysfs):
    root, add = sysfs
    add("mlx5_0", "0000:04:00.0", {1: {"state": b"\xff\xfe\x00", "rate": "x"},  # no link_layer
                                   2: {"state": "4: ACT!VE"}})
    _write(os.path.join(root, "devices", PCI["0000:04:00.0"][0], "numa_node"), "-1")
    os.makedirs(os.path.join(root, "class", "infiniband", "mlx5_0", "ports", "not-a-port"))
    (nic,) = nics.rdma_devices(root)
    assert [(p.number, p.state, p.link_layer) for p in nic.ports] == [(1, "", ""), (2, "", "")]
    assert nic.numa_node is None and nic.net_device() is None  # no port is ACTIVE
    assert "port 1 state unknown" in str(nic)


def test_a_device_without_a_pci_function_has_no_path(tmp_path):
    port = tmp_path / "class" / "infiniband" / "rxe0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (nic,) = nics.rdma_devices(str(tmp_path))
    assert nic.pci_path is None and nic.numa_node is None and nic.net_device() == "rxe0:1"


def test_no_infiniband_class_is_no_devices(tmp_path):
    assert nics.rdma_devices(str(tmp_path)) == [] and nics.net_interfaces(str(tmp_path)) == []


def test_the_same_pcie_switch_beats_the_same_root_complex_and_another_socket(sysfs):
    root, add = sysfs
    # names ordered against nearness: the name alone would pick the farthest
    add("mlx5_2", "0000:05:00.0", {1: HDR})  # same root complex
    add("mlx5_1", "0000:81:00.0", {1: HDR})  # another socket
    nic, why = nics.nearest(nics.rdma_devices(root), GPU, root)
    assert nic.name == "mlx5_2" and why.startswith("under the same PCI root complex pci0000:00")
    add("mlx5_3", "0000:04:00.0", {1: HDR})  # behind the GPU's PCIe switch
    nic, why = nics.nearest(nics.rdma_devices(root), GPU, root)
    assert nic.name == "mlx5_3"
    assert why == ("behind the same PCIe bridge 0000:01:00.0 as the GPU, nearer than mlx5_2")


def test_numa_node_then_name_break_ties(sysfs, tmp_path):
    root, add = sysfs
    # two NICs equally far on PCIe (other root complexes than the GPU's): NUMA decides
    add("mlx5_9", "0000:81:00.0", {1: HDR})
    add("mlx5_8", "0000:05:00.0", {1: HDR})
    for name, node in (("mlx5_9", "0"), ("mlx5_8", "1")):
        _write(os.path.join(root, "class", "infiniband", name, "device", "numa_node"), node)
    gpu_path = os.path.join(root, "devices", PCI[GPU][0])
    os.rename(gpu_path, gpu_path + ".moved")  # the GPU alone under a root complex of its own
    alone = os.path.join(root, "devices", "pci0000:40", GPU)
    os.makedirs(os.path.dirname(alone))
    os.rename(gpu_path + ".moved", alone)
    link = os.path.join(root, "bus", "pci", "devices", GPU)
    os.remove(link)
    os.symlink(alone, link)
    nic, why = nics.nearest(nics.rdma_devices(root), GPU, root)
    assert nic.name == "mlx5_9" and why == ("as near on PCIe as mlx5_8 (on no PCI path the GPU "
                                            "shares), and on the GPU's NUMA node 0")
    _write(os.path.join(root, "class", "infiniband", "mlx5_8", "device", "numa_node"), "0")
    nic, why = nics.nearest(nics.rdma_devices(root), GPU, root)
    assert nic.name == "mlx5_8" and why == ("as near on PCIe and NUMA as mlx5_9 (on no PCI "
                                            "path the GPU shares): first by name")


def test_only_active_ports_count(sysfs):
    root, add = sysfs
    add("mlx5_0", "0000:04:00.0", {1: {**HDR, "state": "1: DOWN"}})  # nearest, but down
    add("mlx5_2", "0000:81:00.0", {1: HDR})
    nic, why = nics.nearest(nics.rdma_devices(root), GPU, root)
    assert nic.name == "mlx5_2" and why.startswith("the only NIC with an ACTIVE port")
    add("mlx5_1", "0000:05:00.0", {1: {**HDR, "state": "2: INIT"}})
    assert nics.nearest(nics.rdma_devices(root), GPU, root)[0].name == "mlx5_2"


def test_a_gpu_sysfs_does_not_know_has_no_nearest_nic(sysfs):
    root, add = sysfs
    add("mlx5_0", "0000:04:00.0", {1: HDR})
    assert nics.nearest(nics.rdma_devices(root), "0000:99:00.0", root) is None
    assert nics.nearest([], GPU, root) is None


@pytest.mark.parametrize("text, address", [
    ("0000:18:00.0", "0000:18:00.0"), ("18:00.0", "0000:18:00.0"),
    ("00000000:1A:00.1", "0000:1a:00.1"),  # nvidia-smi's 8-digit domain
    ("10000:e1:00.0", "10000:e1:00.0"),  # a VMD domain
])
def test_pci_addresses_in_sysfs_form(text, address):
    assert nics.pci_address(text) == address


@pytest.mark.parametrize("text", ["", "18:00", "0000:18:00.8", "gpu0", "0000:18:00.0/x", None])
def test_a_bad_pci_address_is_one_line(text):
    with pytest.raises(ValueError, match="is not a PCI address") as exc:
        nics.pci_address(text)
    assert "\n" not in str(exc.value)


def test_host_facts_read_modules_and_interfaces(sysfs):
    root, add = sysfs
    os.makedirs(os.path.join(root, "module", "nvidia_peermem"))
    host = nics.read_host("cpu", None, root)
    assert host.nics == () and host.nvidia_peermem and not host.xe_driver
    assert sorted(host.net_interfaces) == ["eth0", "ib0", "lo"]
    add("mlx5_0", "0000:04:00.0", {1: HDR, 2: {**HDR, "state": "1: DOWN"}})
    host = nics.read_host("cpu", None, root)
    assert host.ports() == ["mlx5_0:1", "mlx5_0:2"] and [n.name for n in host.active()] == [
        "mlx5_0"]
    assert host.gpu is None and host.nearest is None  # host memory: no GPU to be near


def test_cuda_address_is_none_where_cuda_is_not_initialized():
    # asking torch would initialize CUDA in a process that may fork afterwards
    assert nics.cuda_pci_address(0) is None
