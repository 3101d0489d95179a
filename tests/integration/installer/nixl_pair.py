"""Two NIXL agents in two processes move real bytes (a READ of 8 MiB) with a UCX of another
version loaded into each process first.

    python nixl_pair.py MODULE FOREIGN_LIBUCP local     # the initiator; starts the target itself
    python nixl_pair.py MODULE FOREIGN_LIBUCP global    # one process: is NIXL's UCX plugin refused?

`local`: FOREIGN_LIBUCP loaded RTLD_LOCAL, as Python loads another extension's UCX (ucxx's, an
upstream nixl wheel's): each process imports MODULE (the wheel's NIXL), creates its agent, and
reports the UCX libraries in its /proc/self/maps; the initiator prints one JSON line: bytes
moved, whether they match, and both processes' maps.
`global`: FOREIGN_LIBUCP loaded RTLD_GLOBAL (LD_PRELOAD does the same): without RTLD_DEEPBIND,
which the wheel never uses, its symbols would come first for the wheel's UCX too, so importing
MODULE must stop with one line; one JSON line says what importing and creating the agent raised.
Run with the environment's python only: no env.sh, no LD_LIBRARY_PATH."""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import subprocess
import sys
import time

N = 8 << 20
MARK = "PAIR "  # NIXL's Python logger writes to stdout too: our lines carry this mark


def _say(obj) -> None:
    print(MARK + json.dumps(obj), flush=True)


def _hear(stream) -> dict:
    for line in stream:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit("the other process ended without answering")


def _ucx_maps() -> list[str]:
    paths = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line.split()[-1]}
    return sorted(p for p in paths if "/libuc" in p)


def _agent(module: str, name: str):
    api = importlib.import_module(f"{module}._api")
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    return agent


def _buffer(fill: int):
    import numpy as np
    buf = np.full(N, fill, dtype=np.uint8)
    if fill:
        buf[:] = np.arange(N, dtype=np.uint64).astype(np.uint8) ^ fill
    return buf


def target(module: str) -> None:
    agent = _agent(module, "target")
    buf = _buffer(0x5A)
    agent.register_memory([(buf.ctypes.data, N, 0, "")], "DRAM")
    _say({"meta": agent.get_agent_metadata().hex(), "addr": buf.ctypes.data})
    peer = _hear(sys.stdin)
    agent.add_remote_agent(bytes.fromhex(peer["meta"]))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(b"done" in msgs for msgs in agent.get_new_notifs().values()):
            break
        time.sleep(0.001)
    else:
        raise SystemExit("no notification from the initiator in 60 s")
    _say({"maps": _ucx_maps()})


def initiator(module: str, foreign: str) -> dict:
    t = subprocess.Popen(
        [sys.executable, __file__, module, foreign, "local", "--target"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        remote = _hear(t.stdout)
        agent = _agent(module, "initiator")
        buf = _buffer(0)
        agent.register_memory([(buf.ctypes.data, N, 0, "")], "DRAM")
        name = agent.add_remote_agent(bytes.fromhex(remote["meta"]))
        t.stdin.write(MARK + json.dumps({"meta": agent.get_agent_metadata().hex()}) + "\n")
        t.stdin.flush()
        local = agent.get_xfer_descs([(buf.ctypes.data, N, 0)], "DRAM")
        far = agent.get_xfer_descs([(remote["addr"], N, 0)], "DRAM")
        deadline = time.monotonic() + 60
        handle = None
        while handle is None:  # the target's connection may still be coming up
            try:
                handle = agent.initialize_xfer("READ", local, far, name, b"done")
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        start = time.monotonic()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        seconds = time.monotonic() - start
        same = bool((buf == _buffer(0x5A)).all())
        other = _hear(t.stdout)
        t.wait(timeout=60)
        return {
            "state": state,
            "bytes": N,
            "match": same,
            "gbps": N / seconds / 1e9,
            "target_rc": t.returncode,
            "maps": {"initiator": _ucx_maps(), "target": other["maps"]},
        }
    finally:
        if t.poll() is None:
            t.kill()


def main() -> None:
    module, foreign, scope = sys.argv[1:4]
    ctypes.CDLL(
        foreign, mode=os.RTLD_NOW | (os.RTLD_GLOBAL if scope == "global" else os.RTLD_LOCAL)
    )  # there first
    if scope == "global":
        try:
            _agent(module, "refused")
            _say({"refused": None, "maps": _ucx_maps()})
        except Exception as e:  # NIXL's own error type, from the module under test
            _say({"refused": f"{type(e).__name__}: {e}", "maps": _ucx_maps()})
    elif sys.argv[4:] == ["--target"]:
        target(module)
    else:
        _say(initiator(module, foreign))


if __name__ == "__main__":
    main()
