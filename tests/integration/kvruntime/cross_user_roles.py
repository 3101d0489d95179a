"""A prefill and a decode for test_cross_user.py, each a process of its own:

    python cross_user_roles.py prefill UID   serve as user UID; print the port; stop at stdin EOF
    python cross_user_roles.py decode PORT   pull blocks 0-3 as ourselves; print one JSON line

The prefill imports everything it needs before it drops root: the interpreter's own files may
be readable by root alone (a home of mode 0700), as on this project's hosts.
"""

import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

from kvruntime import native  # noqa: E402
from kvruntime.layout import CROSS_LAYER, KVLayout  # noqa: E402
from kvruntime.memory import KVCache  # noqa: E402
from kvruntime.nixl.binding import load_nixl  # noqa: E402
from kvruntime.nixl.transports import apply_ucx_settings  # noqa: E402

LAYOUT = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
SEED = 11
PR_SET_DUMPABLE = 4


def prefill(uid: int) -> None:
    import sysconfig

    from kvruntime.prefill.server import PrefillServer

    load_nixl()
    native.status()
    sysconfig.get_config_vars()
    cache = KVCache.allocate_host(LAYOUT, False)
    cache.fill_random(SEED)  # numpy's generator loads its modules now
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # as a process started by uid is
    os.environ["HOME"] = "/tmp"  # NIXL reads ~/.nixl.cfg
    apply_ucx_settings("cpu")
    with PrefillServer(cache) as server:
        print(server.address[1], flush=True)
        sys.stdin.read()
        print(json.dumps({"refused": [why for _addr, why in server.stats.refused]}), flush=True)


def decode(port: int) -> None:
    from kvruntime.decode.client import DecodeClient

    apply_ucx_settings("cpu")
    src = KVCache.allocate_host(LAYOUT, False)
    src.fill_random(SEED)
    dst = KVCache.allocate_host(LAYOUT, False)
    dst.fill_value(0)
    try:
        with DecodeClient(dst, engine="nixl") as client:
            peer = client.connect("127.0.0.1", port)
            peer.pull([0, 1, 2, 3], [0, 1, 2, 3], timeout=20)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    differ = [b for b, (a, z) in enumerate(zip(src.block_digests(range(4)),
                                                 dst.block_digests(range(4)))) if a != z]
    print(json.dumps({"ok": True, "differ": differ}), flush=True)


if __name__ == "__main__":
    {"prefill": prefill, "decode": decode}[sys.argv[1]](int(sys.argv[2]))
