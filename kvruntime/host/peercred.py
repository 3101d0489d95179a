"""Which process holds the other end of a side-channel connection on this host.

The same-node proof (samenode.py) reads a token out of the memory of the pid the prefill names.
That proves the pid's process is on this host and readable by us, not that it is the process we
shook hands with: a prefill that holds the secret could name another process (of the same user)
and have the decode read that process's memory. So the named pid must also hold the socket at
the other end of our TCP connection. ``SO_PEERCRED`` answers that for Unix sockets only; for TCP
over this host the kernel's socket table (``/proc/net/tcp``, ``tcp6``) gives the inode of the
socket whose local address is our peer address and whose peer address is ours, and the pid's
``/proc/<pid>/fd`` links name the sockets it holds. Another process cannot hold that socket
unless the prefill process handed it over (fd passing or fork): the process that holds it is
the one that answered our handshake, or one it chose to share its connection with.

The kernel is asked for that one socket by its four numbers (sock_diag's exact lookup over
netlink, what ``ss`` uses: ~20 µs), not by reading the tables: /proc/net/tcp walks every bucket
of the kernel's hash of connections, 2 ms on a 2-core VM with 48 sockets and more on a large
host, once for the decode's check before the handshake, once for the prefill's and once for the
same-node proof. Where sock_diag cannot answer (no tcp_diag in this kernel, a sandbox without
netlink) the tables are read.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _hex_endpoint(address: tuple) -> set[str]:
    """``(host, port)`` as /proc/net/tcp{,6} spell it: 32-bit words in host byte order, then
    the port; an IPv4 address also as IPv4-mapped IPv6 (a dual-stack socket lists it so)."""
    host, port = address[0], address[1]
    ip = ipaddress.ip_address(host.split("%")[0])
    forms = set()
    if ip.version == 4:
        forms.add("%08X:%04X" % (struct.unpack("=I", ip.packed)[0], port))
        ip = ipaddress.IPv6Address(f"::ffff:{ip}")
    elif ip.ipv4_mapped is not None:
        forms.add("%08X:%04X" % (struct.unpack("=I", ip.ipv4_mapped.packed)[0], port))
    raw = ip.packed
    forms.add("".join("%08X" % struct.unpack("=I", raw[i:i + 4])[0] for i in range(0, 16, 4))
              + ":%04X" % port)
    return forms


def _peer_entry(sock: socket.socket) -> list[str] | None:
    """The kernel's socket-table line (split) of the other end of ``sock``'s TCP connection,
    when that end is on this host (in our network namespace); None otherwise."""
    try:
        ours, theirs = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    their_local, their_remote = _hex_endpoint(theirs), _hex_endpoint(ours)
    for table in TABLES:
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if (len(fields) > 9 and fields[1] in their_local
                            and fields[2] in their_remote):
                        return fields
        except OSError:
            continue
    return None


# sock_diag (linux/sock_diag.h, linux/inet_diag.h)
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLMSG_ERROR, NLM_F_REQUEST = 4, 20, 2, 1
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
# inet_diag_req_v2: family, protocol, extensions, pad, states; then inet_diag_sockid: ports
# and addresses in network order, the interface, the cookie (all ones: "no cookie")
_REQ = struct.Struct("=BBBxI2s2s16s16sIII")
_MSG_IDS = struct.Struct("=IIIII")  # inet_diag_msg from offset 52: expires, rqueue, wqueue,
_MSG_IDS_AT = 52                    # uid, inode
_NO_COOKIE = 0xFFFFFFFF


def _diag_ids(family: int, local: tuple, remote: tuple) -> tuple[int, int] | None | bool:
    """(uid, inode) of the TCP socket of this host (our network namespace) whose local and
    remote addresses are ``local`` and ``remote``, asked of the kernel by sock_diag; None: no
    such socket; False: sock_diag cannot answer here."""
    def packed(address):
        raw = socket.inet_pton(family, address[0].split("%")[0])
        return raw.ljust(16, b"\0"), struct.pack("!H", address[1])

    (src, sport), (dst, dport) = packed(local), packed(remote)
    body = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF, sport, dport, src, dst, 0,
                     _NO_COOKIE, _NO_COOKIE)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(_NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST,
                                1, 0) + body)
            reply = nl.recv(65536)
    except OSError:
        return False
    if len(reply) < _NLMSG.size:
        return False
    kind = _NLMSG.unpack_from(reply)[1]
    if kind == NLMSG_ERROR:  # ENOENT: no such socket
        errno = -struct.unpack_from("=i", reply, _NLMSG.size)[0] if len(reply) >= 20 else 0
        return None if errno == 2 else False
    if kind != SOCK_DIAG_BY_FAMILY or len(reply) < _NLMSG.size + _MSG_IDS_AT + _MSG_IDS.size:
        return False
    _expires, _rq, _wq, uid, inode = _MSG_IDS.unpack_from(reply, _NLMSG.size + _MSG_IDS_AT)
    return uid, inode


def _peer_ids(sock: socket.socket) -> tuple[int, int] | None:
    """(uid, inode) of the socket at the other end of ``sock``'s TCP connection, when that
    end is on this host (in our network namespace); None otherwise."""
    try:
        ours, theirs = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    found = _diag_ids(sock.family, theirs, ours)
    if found is None and _diag_ids(sock.family, ours, theirs) is None:
        found = False  # not even our own end: sock_diag does not see this namespace's sockets
    if found is not False:
        return found
    entry = _peer_entry(sock)
    return None if entry is None else (int(entry[7]), int(entry[9]))


def peer_socket_inode(sock: socket.socket) -> int | None:
    """The inode of the socket at the other end of ``sock``'s TCP connection, when that end
    is on this host (in our network namespace); None otherwise."""
    ids = _peer_ids(sock)
    return None if ids is None else ids[1]


def peer_uid(sock: socket.socket) -> int | None:
    """The user that owns the socket at the other end of ``sock``'s TCP connection (the
    effective uid that made it), when that end is on this host; None otherwise."""
    ids = _peer_ids(sock)
    return None if ids is None else ids[0]


def holds_socket(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has socket ``inode`` open (its /proc/<pid>/fd links); raises
    OSError when its fds cannot be listed (another user, without the right to)."""
    want = f"socket:[{inode}]"
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{name}") == want:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def prove_peer(sock: socket.socket, pid: int) -> str | None:
    """None when ``pid`` holds the other end of ``sock``; else why that is not proved."""
    inode = peer_socket_inode(sock)
    if inode is None:
        return "the side channel's other end is not a socket of this host's"
    try:
        if holds_socket(pid, inode):
            return None
    except OSError as exc:
        return f"cannot list pid {pid}'s open files ({exc})"
    return (f"pid {pid} does not hold the side channel's other end: the prefill named another "
            f"process")


def owner_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
