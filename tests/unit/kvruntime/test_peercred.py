"""Which user and socket hold the other end of a TCP connection on this host
(kvruntime/host/peercred.py): the kernel asked by sock_diag, the tables read where it cannot
answer; both must name the same socket, ours or another user's."""

import os
import socket
import subprocess
import sys

import pytest

from kvruntime.host import peercred


def _pair(family, host):
    srv = socket.socket(family)
    srv.bind((host, 0))
    srv.listen()
    client = socket.create_connection(srv.getsockname()[:2])
    accepted, _ = srv.accept()
    srv.close()
    return client, accepted


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"),
                                         (socket.AF_INET6, "::1")])
def test_sock_diag_and_the_tables_name_the_other_end(family, host):
    try:
        client, accepted = _pair(family, host)
    except OSError as exc:
        pytest.skip(f"no {host} here: {exc}")
    with client, accepted:
        inode = os.fstat(accepted.fileno()).st_ino
        assert peercred._diag_ids(family, accepted.getsockname(), client.getsockname()) == (
            os.geteuid(), inode)
        entry = peercred._peer_entry(client)
        assert (int(entry[7]), int(entry[9])) == (os.geteuid(), inode)
        assert peercred.peer_socket_inode(client) == inode
        assert peercred.peer_uid(client) == os.geteuid()
        assert peercred.prove_peer(client, os.getpid()) is None


def test_a_closed_peer_is_no_socket_of_this_host():
    client, accepted = _pair(socket.AF_INET, "127.0.0.1")
    with client:
        ours, theirs = client.getsockname(), client.getpeername()
        accepted.close()
        # the other end gone (its socket in the tables at most as TIME_WAIT, owned by no one)
        ids = peercred._diag_ids(socket.AF_INET, theirs, ours)
        assert ids is None or ids[1] == 0


def test_where_sock_diag_cannot_answer_the_tables_are_read(monkeypatch):
    client, accepted = _pair(socket.AF_INET, "127.0.0.1")
    with client, accepted:
        monkeypatch.setattr(peercred, "_diag_ids", lambda *a: False)
        assert peercred.peer_socket_inode(client) == os.fstat(accepted.fileno()).st_ino


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_the_other_end_of_another_users_process_is_named_with_its_uid():
    """A listener run as uid 65534 (nobody): the decode's check must see that user."""
    script = ("import os, socket, sys; os.setgid(65534); os.setuid(65534); s = socket.socket();"
              " s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True);"
              " c, _ = s.accept(); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as client:
            assert peercred.peer_uid(client) == 65534
    finally:
        proc.stdin.close()
        proc.wait(10)
