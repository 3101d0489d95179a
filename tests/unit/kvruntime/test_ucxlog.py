"""UCX's log as kvruntime reads it: protocol tables -> lanes, messages -> log records.

The host-memory table below is copied from a real run here (UCX of nixl-cu12, UCX_PROTO_INFO=y);
the cuda ones are as UCX printed them on an H100 (nixl-cu13's UCX), where a table may also come
with no data rows at all."""

import logging

import pytest

from kvruntime.nixl import ucxlog
from kvruntime.nixl.ucxlog import UcxLog, device_lanes_on_tcp

P = "[1795428300.092621] [vm:16521:0]   "
HOST_TABLE = f"""{P}+--------+-------------+-------------------------------------------+
{P}| kvr-decode-1-aa intra-node cfg#1                                   |
{P}| remote memory read by ucp_get*(multi) into host memory from host |
{P}+--------+-------------+-------------------------------------------+
{P}| Range  | Description |                  Config                   |
{P}+--------+-------------+-------------------------------------------+
{P}| 0..inf | zero-copy   | cma/memory                                |
{P}+--------+-------------+-------------------------------------------+
"""
CUDA_TCP_TABLE = f"""{P}+---------+-------------+------------------------------------+
{P}| kvr-decode-1-aa intra-node cfg#2                                 |
{P}| remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
{P}+---------+-------------+------------------------------------+
{P}| Range   | Description | Config                             |
{P}+---------+-------------+------------------------------------+
{P}|  0..8K  | copy-out    | tcp/lo                             |
{P}| 8K..inf | zero-copy   | 50% on tcp/lo and 50% on tcp/eth0  |
{P}+---------+-------------+------------------------------------+
"""


def read(tmp_path, text):
    path = tmp_path / "ucx.log"
    path.write_text(text)
    return UcxLog(str(path))  # no private directory: the file stays


def test_tables_become_lanes_and_only_device_memory_on_tcp_is_flagged(tmp_path):
    log = read(tmp_path, HOST_TABLE + CUDA_TCP_TABLE)
    lanes = log.read()
    assert [(lane.context, lane.scope, lane.transports) for lane in lanes] == [
        ("kvr-decode-1-aa", "intra-node", ("cma",)), ("kvr-decode-1-aa", "intra-node", ("tcp",))]
    assert not lanes[0].device_memory and lanes[1].device_memory
    assert lanes[1].memories == ("cuda", "cuda")
    assert device_lanes_on_tcp(lanes, True, True) == [lanes[1]]
    assert device_lanes_on_tcp(lanes, False, False) == []  # host memory may take tcp


def test_selections_ucx_only_considered_are_not_kv_lanes():
    """Seen on an H100: UCX printed these for the decode's agent (its loopback, and a put from
    host memory into the peer's registered cuda memory) while KV moved cuda to cuda."""
    lanes = [ucxlog.Lane("d", scope, "remote memory write by ucp_put* from host memory to "
                         "cuda/dev[1]", ("tcp",)) for scope in ("self", "intra-node")]
    assert lanes[1].memories == ("host", "cuda")
    assert device_lanes_on_tcp(lanes, True, True) == []
    assert device_lanes_on_tcp(lanes, False, True) == [lanes[1]]  # a host->VRAM pair would


EMPTY_TABLE = f"""{P}+-------+-------------+---------------------------+
{P}| kvr-decode-1-aa self cfg#0                      |
{P}| active message by ucp_am_send* from host memory |
{P}+-------+-------------+---------------------------+
{P}| Range | Description |          Config           |
{P}+-------+-------------+---------------------------+
"""


def test_a_table_without_data_rows_does_not_derail_the_next(tmp_path):
    lanes = read(tmp_path, EMPTY_TABLE + EMPTY_TABLE + CUDA_TCP_TABLE + HOST_TABLE).read()
    assert [(lane.scope, lane.transports) for lane in lanes] == [
        ("self", ()), ("self", ()), ("intra-node", ("tcp",)), ("intra-node", ("cma",))]


def test_a_table_written_in_two_pieces_is_read_once_whole(tmp_path):
    path = tmp_path / "ucx.log"
    half = len(HOST_TABLE) // 2
    path.write_text(HOST_TABLE[:half])
    log = UcxLog(str(path))
    assert log.read() == []
    with open(path, "a") as f:
        f.write(HOST_TABLE[half:])
    assert [lane.transports for lane in log.read()] == [("cma",)]
    assert log.read() == []  # nothing new


def test_messages_keep_their_level_and_known_harmless_ones_are_info(tmp_path, caplog):
    text = (f"{P}ucp_worker.c:1234 UCX  ERROR   no active messages transport to <no debug data>: "
            f"self/memory - Destination is unreachable, tcp/lo - not available\n"
            f"{P}ucp_ep.c:77 UCX  ERROR   failed to connect to peer: Connection refused\n"
            f"{P}ucs_sys.c:5 UCX  WARN  something to look at\n")
    with caplog.at_level(logging.DEBUG, logger="kvruntime.ucx"):
        read(tmp_path, text).read()
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels[0][0] == logging.INFO and "harmless" in levels[0][1]
    assert levels[1] == (logging.ERROR, "UCX ERROR: failed to connect to peer: Connection refused")
    assert levels[2] == (logging.WARNING, "UCX WARN: something to look at")


def test_install_keeps_the_users_settings_and_gives_a_child_its_own_directory(tmp_path):
    env = {}
    added = ucxlog.install(env)
    assert added["UCX_PROTO_INFO"] == "y" and added["UCX_LOG_FILE"].endswith("ucx.%p.log")
    assert ucxlog.lanes_unknown_reason(env) is None
    assert ucxlog.install(env) == {}  # this process's already
    inherited = {**env, "KVRUNTIME_UCX_LOG": "1:" + env["KVRUNTIME_UCX_LOG"].split(":", 1)[1]}
    again = ucxlog.install(inherited)  # a child of the process that set it up: its own
    assert again["UCX_LOG_FILE"] != added["UCX_LOG_FILE"]
    user = {"UCX_LOG_FILE": str(tmp_path / "mine.log")}
    assert ucxlog.install(user) == {}
    assert "set by the user" in ucxlog.lanes_unknown_reason(user)


def test_the_file_leaves_the_disk_once_open_and_is_still_read(tmp_path):
    private = tmp_path / "kvr-ucx-x"
    private.mkdir()
    path = private / "ucx.1.log"
    path.write_text(HOST_TABLE[:100])
    log = UcxLog(str(path), str(private))
    assert log.read() == [] and not private.exists()  # UCX keeps writing the open file
    with open(f"/proc/self/fd/{log._file.fileno()}", "a") as f:
        f.write(HOST_TABLE[100:])
    assert [lane.transports for lane in log.read()] == [("cma",)]


@pytest.mark.parametrize("operation,device", [
    ("remote memory write by ucp_put* from cuda/GPU1 memory to cuda", True),
    ("remote memory write by ucp_put* from host memory to cuda/dev[1]", True),
    ("remote memory read by ucp_get* into host memory from host", False),
    ("remote memory write by ucp_put* from ze/GPU0 memory to host", True),
])
def test_device_memory_is_read_from_the_operation(operation, device):
    assert ucxlog.Lane("a", "intra-node", operation, ("tcp",)).device_memory is device


def test_lanes_of_an_agent_whose_nixl_leaves_ucx_contexts_unnamed(tmp_path):
    """NIXL 1.4 built from the pinned source: UCX's contexts are 'ucp_context_N' (seen on this
    host); NIXL 1.5's wheel names them after the agent."""
    unnamed = HOST_TABLE.replace("kvr-decode-1-aa", "ucp_context_0")
    lanes = read(tmp_path, unnamed + CUDA_TCP_TABLE).read()
    assert [lane.transports for lane in ucxlog.lanes_of(lanes, "kvr-decode-1-aa")] == [("tcp",)]
    assert [lane.transports for lane in ucxlog.lanes_of(lanes, "kvr-prefill-2-bb")] == [("cma",)]


def test_the_reader_thread_survives_emfile(tmp_path):
    """A process out of fds when UCX's log first appears: the follower thread (real, started
    by this_process) says so once and reads the messages once fds are back. Before, the
    thread died on EMFILE and UCX's messages never reached logging again. In a child process:
    it lowers its own fd limit."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f'''
        import logging, os, resource, sys, time
        from kvruntime.nixl import ucxlog
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("kvruntime.ucx").addHandler(Keep())
        env = {{}}
        ucxlog.install(env)
        os.environ.update(env)
        reader = ucxlog.this_process()
        path = reader.path
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        held = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        with open(path, "w") as f:  # what UCX writes, before we are out of fds
            f.write({P!r} + "ucs_sys.c:5 UCX  WARN  first words\\n")
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        time.sleep(1.2)  # the follower tries (EMFILE) at least twice
        for fd in held:
            os.close(fd)
        deadline = time.time() + 5
        while not any("first words" in r for r in records) and time.time() < deadline:
            time.sleep(0.1)
        print(sum("cannot open UCX's log" in r for r in records),
              sum("first words" in r for r in records))
    ''')
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1"], (r.stdout, r.stderr)


# a host-memory READ from a peer on another host, as UCX prints it, over tcp
INTER_NODE_TCP_TABLE = HOST_TABLE.replace("intra-node cfg#1", "inter-node cfg#3").replace(
    "cma/memory                               ", "tcp/eth0                                 ")


def test_data_to_another_host_over_tcp_is_named_while_rdma_is_active(tmp_path, monkeypatch):
    from kvruntime.errors import TransportError
    from kvruntime.nixl.agent import Agent, lane_faults

    lanes = read(tmp_path, HOST_TABLE + INTER_NODE_TCP_TABLE).read()
    assert [(lane.scope, lane.transports) for lane in lanes] == [
        ("intra-node", ("cma",)), ("inter-node", ("tcp",))]
    assert ucxlog.inter_node_lanes_on_tcp(lanes) == [lanes[1]]
    assert lane_faults(lanes, False, False, ()) == []  # no RDMA port here: tcp is the wire
    (fault,) = lane_faults(lanes, False, False, ("mlx5_0:1",))
    assert fault.lanes == (lanes[1],) and "mlx5_0:1 is ACTIVE" in fault.text
    # the agent's check raises it, naming the lane and the port, unless the user forced it
    agent = Agent.__new__(Agent)  # no NIXL: only what the check reads
    agent.lanes, agent.rdma_ports, agent.ucx_env = (lambda: lanes), ("mlx5_0:1",), {}
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    with pytest.raises(TransportError) as exc:
        agent.check_device_lanes("peer p", False, False)
    assert str(exc.value).startswith(
        "peer p: UCX moves data to a peer on another host over TCP (kvr-decode-1-aa inter-node: "
        "remote memory read by ucp_get*(multi) into host memory from host -> tcp) while this "
        "host's RDMA port mlx5_0:1 is ACTIVE; expect ~1 GB/s instead of the NIC's speed: check "
        "that ucx_info -d lists rc/ud/dc/srd on mlx5_0:1")
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    assert agent.check_device_lanes("peer p", False, False) == [lanes[1]]  # a warning: theirs


def test_a_device_lane_to_another_host_is_named_once_as_the_nic_it_missed(tmp_path):
    from kvruntime.nixl.agent import lane_faults

    lanes = read(tmp_path, CUDA_TCP_TABLE.replace("intra-node", "inter-node")).read()
    (fault,) = lane_faults(lanes, True, True, ("mlx5_0:1", "mlx5_1:1"))
    assert "another host" in fault.text and "mlx5_0:1, mlx5_1:1 are ACTIVE" in fault.text
    assert fault.forced_by == ("UCX_TLS", "UCX_NET_DEVICES")
    (fault,) = lane_faults(lanes, True, True, ())  # no RDMA here: device memory over TCP
    assert fault.text.startswith("UCX moves device memory over TCP") and \
        fault.forced_by == ("UCX_TLS",)
