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


def peer_socket_inode(sock: socket.socket) -> int | None:
    """The inode of the socket at the other end of ``sock``'s TCP connection, when that end
    is on this host (in our network namespace); None otherwise."""
    entry = _peer_entry(sock)
    return None if entry is None else int(entry[9])


def peer_uid(sock: socket.socket) -> int | None:
    """The user that owns the socket at the other end of ``sock``'s TCP connection (the
    effective uid that made it), when that end is on this host; None otherwise."""
    entry = _peer_entry(sock)
    return None if entry is None else int(entry[7])


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
