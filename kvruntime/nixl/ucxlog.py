"""UCX's own log, read by kvruntime: its messages go through Python logging, and the transport
each protocol really uses is known.

UCX writes its log to stderr by default, unconditionally and unformatted: an engine cannot tell
a harmless line from a real error, and the lanes UCX chose for each transfer are never shown.
Before the first NIXL agent of a process exists, ``install`` points UCX at a log file in a
private directory of this process (``UCX_LOG_FILE=<dir>/ucx.%p.log``) and asks it to print its
protocol selections (``UCX_PROTO_INFO=y``). ``UcxLog`` opens that file once UCX has created
it, unlinks it (nothing stays on disk, however the process ends) and reads it:

- each UCX message becomes a record of the ``kvruntime.ucx`` logger at its own level (ERROR and
  WARN stay visible on stderr through Python's default handler); messages UCX prints in normal
  operation although nothing failed (``KNOWN_HARMLESS``) go to INFO with the reason.
- each protocol table UCX prints when it first selects a protocol (which operation, from which
  memory to which, over which transports) is kept as a ``Lane``; ``device_lanes_on_tcp`` names
  the device-memory transfers that went over TCP (a silent 1000x slowdown: DESIGN §4);
  ``inter_node_lanes_on_tcp`` the transfers to another host over TCP (with an ACTIVE RDMA
  port here, the NIC left unused: DESIGN §9).

A user who set ``UCX_LOG_FILE`` or ``UCX_PROTO_INFO`` keeps them: the lanes are then unknown,
and ``lanes_unknown_reason`` says why.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from typing import MutableMapping

log = logging.getLogger("kvruntime.ucx")

LOG_FILE, PROTO_INFO = "UCX_LOG_FILE", "UCX_PROTO_INFO"
MARK = "KVRUNTIME_UCX_LOG"  # "pid:directory" of the process that set UCX's log up
_LEVELS = {"FATAL": logging.CRITICAL, "ERROR": logging.ERROR, "WARN": logging.WARNING,
           "DIAG": logging.INFO, "INFO": logging.INFO, "DEBUG": logging.DEBUG,
           "TRACE": logging.DEBUG, "PRINT": logging.INFO}
# (pattern, why it is harmless): lines UCX prints while everything works.
KNOWN_HARMLESS = (
    (re.compile(r"no active messages transport to .*tcp/lo - not available"),
     "printed while UCX tries the AM transports for a same-host peer; another AM lane (posix, "
     "sysv) serves it, and a connection with none fails in NIXL with an error of its own"),
)
_MESSAGE = re.compile(r"\]\s+\S+:\d+\s+UCX\s+([A-Z]+)\s+(.*)$")
_ROW = re.compile(r"\]\s+\|(.*)\|\s*$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/[\w.:\-]+")
HOST_MEMORY = "host"
_READ = re.compile(r"\binto (\S+)(?: memory)? from (\S+)")
_WRITE = re.compile(r"\bfrom (\S+)(?: memory)? to (\S+)")
_TITLE = re.compile(r"\scfg#\d+\s*$")


@dataclass(frozen=True)
class Lane:
    """One protocol selection UCX printed: ``context`` (the NIXL agent), ``scope`` (self,
    intra-node, inter-node), the operation line and the transports of its Config column."""

    context: str
    scope: str
    operation: str
    transports: tuple[str, ...]

    @property
    def memories(self) -> tuple[str, str] | None:
        """(local, remote) memory kinds of a remote read or write: "host", "cuda", "ze"...
        UCX writes "read ... into <local> memory from <remote>" and "write ... from <local>
        memory to <remote>" (e.g. "cuda/dev[1]", "host")."""
        m = _READ.search(self.operation) or _WRITE.search(self.operation)
        if not m:
            return None
        return m.group(1).split("/")[0], m.group(2).split("/")[0]

    @property
    def device_memory(self) -> bool:
        """Either side of the operation is device memory."""
        return any(kind != HOST_MEMORY for kind in self.memories or ())

    @property
    def rma(self) -> bool:
        return self.operation.startswith("remote memory")

    def __str__(self) -> str:
        return f"{self.context} {self.scope}: {self.operation} -> {', '.join(self.transports)}"


def install(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Route UCX's log to a file in a private directory of this process and turn on protocol
    info, unless the user set either. Returns what was added. Runs before the first agent
    (UCX reads both when it starts). A child process that inherited a parent's settings gets
    its own directory."""
    env = os.environ if env is None else env
    mine = _ours(env)
    if mine is not None:
        return {}
    if (LOG_FILE in env or PROTO_INFO in env) and MARK not in env:
        return {}  # the user's
    directory = tempfile.mkdtemp(prefix="kvr-ucx-")
    atexit.register(_remove_empty, directory)  # no agent ever made UCX open the file
    added = {LOG_FILE: os.path.join(directory, "ucx.%p.log"), PROTO_INFO: "y",
             MARK: f"{os.getpid()}:{directory}"}
    env.update(added)
    return added


def _remove_empty(directory: str) -> None:
    try:
        os.rmdir(directory)
    except OSError:
        pass


def _ours(env) -> str | None:
    """This process's log directory, when kvruntime set UCX's log up here."""
    pid, _, directory = env.get(MARK, "").partition(":")
    if pid == str(os.getpid()) and env.get(LOG_FILE, "").startswith(directory + os.sep):
        return directory
    return None


def lanes_unknown_reason(env: MutableMapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    if _ours(env):
        return None
    return (f"{LOG_FILE}/{PROTO_INFO} were set by the user: kvruntime does not read UCX's "
            f"protocol selections")


class UcxLog:
    """Reads one process's UCX log file from where it left off; thread-safe."""

    def __init__(self, path: str, private_dir: str | None = None):
        self.path = path
        self.lanes: list[Lane] = []
        self._file = None
        self._private_dir = private_dir  # removed with the file once UCX has it open
        self._partial = ""
        self._rows: list[str] = []
        self._head: list[str] | None = None  # title and operation rows of the table being read
        self._header = False  # its Range/Description/Config row was read
        self._open_error: int | None = None  # errno of the last failed open (said once)
        self._lock = threading.Lock()

    def read(self) -> list[Lane]:
        """Take in what UCX wrote since the last read; return the lanes that appeared."""
        with self._lock:
            _flush_stdio()  # UCX's FILE* is buffered: what it printed may still sit in it
            if self._file is None and not self._open():
                return []
            text = self._file.read()
            text, self._partial = self._partial + text, ""
            lines = text.split("\n")
            self._partial = lines.pop()  # an unfinished last line waits for the next read
            before = len(self.lanes)
            for line in lines:
                self._line(line)
            return self.lanes[before:]

    def _open(self) -> bool:
        """Open UCX's file once it exists, then unlink it (and our private directory): UCX
        and we keep writing and reading the open file, and nothing is left on disk whatever
        way the process ends."""
        try:
            self._file = open(self.path, "r", errors="replace")
        except FileNotFoundError:
            return False
        except OSError as exc:  # EMFILE in a process out of fds: tried again at the next read
            if self._open_error != exc.errno:  # said once, not every half second
                self._open_error = exc.errno
                log.warning("cannot open UCX's log %s yet (%s); UCX's messages follow once it "
                            "opens", self.path, exc.strerror)
            return False
        if self._open_error is not None:
            log.warning("UCX's log %s is open now; its messages follow", self.path)
        if self._private_dir:
            try:
                os.unlink(self.path)
                os.rmdir(self._private_dir)
            except OSError:
                pass
        return True

    def _line(self, line: str) -> None:
        # A protocol table: +--+ / title, operation / +--+ / header / +--+ / data rows / +--+;
        # a table may have no data rows (its next table's border follows the header's).
        row = _ROW.search(line)
        if row:
            self._rows.append(row.group(1))
            return
        if "+--" in line:
            if self._rows:
                self._group(self._rows)
                self._rows = []
            return
        self._head, self._header = None, False  # anything else ends a table
        message = _MESSAGE.search(line)
        if message:
            emit(message.group(1), message.group(2))

    def _group(self, rows: list[str]) -> None:
        if _TITLE.search(rows[0]):  # a table starts (a previous one without data ends)
            if self._head is not None and self._header:
                self._table(self._head, [])
            self._head, self._header = rows, False
        elif self._head is not None and not self._header and "Config" in rows[0]:
            self._header = True
        elif self._head is not None and self._header:
            self._table(self._head, rows)
            self._head, self._header = None, False

    def _table(self, head: list[str], data: list[str]) -> None:
        title = head[0].split()
        if len(head) < 2 or len(title) < 2:
            return
        transports: list[str] = []
        for row in data:
            for name in _TRANSPORT.findall(row.rsplit("|", 1)[-1]):
                if name not in transports:
                    transports.append(name)
        self.lanes.append(Lane(title[0], title[1], head[1].strip(), tuple(transports)))


def _flush_stdio() -> None:
    """fflush(NULL): every stdio output stream of this process, UCX's log file among them."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None)
    _libc.fflush(None)


_libc = None


def emit(level: str, text: str) -> None:
    for pattern, why in KNOWN_HARMLESS:
        if pattern.search(text):
            log.info("UCX %s (harmless: %s): %s", level, why, text)
            return
    log.log(_LEVELS.get(level, logging.WARNING), "UCX %s: %s", level, text)


_UNNAMED = re.compile(r"^ucp_context_\d+$")


def lanes_of(lanes, agent: str) -> list[Lane]:
    """The lanes of NIXL agent ``agent``. NIXL 1.5 names UCX's context after the agent; NIXL
    1.4 (the pinned release) leaves UCX's default ``ucp_context_N``, which says nothing of the
    agent: then every unnamed lane of this process counts (one agent a process, as in a
    deployment; several agents of one process are judged together)."""
    named = [lane for lane in lanes if lane.context == agent]
    return named or [lane for lane in lanes if _UNNAMED.match(lane.context)]


def device_lanes_on_tcp(lanes, local_device: bool, remote_device: bool) -> list[Lane]:
    """Remote reads/writes between peers (not an agent's loopback to itself) of the memory
    kinds a KV transfer moves — local and remote device memory or not, one of them device —
    that UCX put on TCP: each moves a GPU's memory through host sockets, orders of magnitude
    below the device's copy speed. (UCX also prints selections it only considered, such as a
    put from host memory into a peer's registered cuda memory: those are not KV's lanes.)"""
    out = []
    for lane in lanes:
        kinds = lane.memories
        if lane.scope == "self" or kinds is None or "tcp" not in lane.transports:
            continue
        if ((kinds[0] != HOST_MEMORY, kinds[1] != HOST_MEMORY) == (local_device, remote_device)
                and (local_device or remote_device)):
            out.append(lane)
    return out


def inter_node_lanes_on_tcp(lanes) -> list[Lane]:
    """Remote reads/writes (the KV data, of any memory kind) to a peer on another host that UCX
    put on TCP: where this host has an ACTIVE RDMA port, the NIC's bandwidth goes unused
    (transports.cross_host says why UCX could have chosen it, or not)."""
    return [lane for lane in lanes if lane.scope == "inter-node" and lane.memories is not None
            and "tcp" in lane.transports]


def summary(lanes) -> dict[str, list[str]]:
    """Transports per kind of operation over connections to peers (not the agent's loopback
    to itself): {"rma": [...], "am": [...]} as UCX selected them."""
    out: dict[str, list[str]] = {"rma": [], "am": []}
    for lane in lanes:
        if lane.scope == "self":
            continue
        kind = "rma" if lane.rma else "am" if lane.operation.startswith("active message") else None
        if kind:
            out[kind] += [t for t in lane.transports if t not in out[kind]]
    return out


_reader: UcxLog | None = None
_reader_lock = threading.Lock()


def this_process(env: MutableMapping[str, str] | None = None) -> UcxLog | None:
    """The reader of this process's UCX log (started on first use, with a thread that keeps
    re-emitting UCX's messages), or None when the user routes UCX's log elsewhere."""
    global _reader
    env = os.environ if env is None else env
    directory = _ours(env)
    if directory is None:
        return None
    with _reader_lock:
        path = env[LOG_FILE].replace("%p", str(os.getpid()))
        if _reader is None or _reader.path != path:
            _reader = UcxLog(path, directory)
            stop = threading.Event()
            threading.Thread(target=_follow, args=(_reader, stop), name="kvr-ucx-log",
                             daemon=True).start()
            atexit.register(_finish, _reader, stop)
        return _reader


def _follow(reader: UcxLog, stop: threading.Event) -> None:
    """Re-emit UCX's messages every half second until the process ends; a read that fails
    (out of fds, a file gone) is tried again, never ends the thread."""
    while not stop.wait(0.5):
        try:
            reader.read()
        except Exception:
            log.exception("reading UCX's log %s; trying again", reader.path)


def _finish(reader: UcxLog, stop: threading.Event) -> None:
    stop.set()
    reader.read()  # UCX's last words, re-emitted
