"""Connect, pull and close a prefill and a decode in one process, many times: the reproducer of
a crash in the prefill's progress thread at the decode's departure (SIGSEGV in UCX's
``ucp_ep_set_lanes_failed``, run from ``ucp_worker_progress`` inside NIXL's ``getNotifs``: a
deferred "lanes failed" callback of an endpoint to the departed decode). Host memory, the
three pairings CI's tests make (NIXL through the pools, host-staged, NIXL direct), with the
PyPI nixl wheel's UCX. Beside a CI run on the 2-core host it crashed 4 times in ~1,470
iterations (ecf4fa5's kvruntime once in ~860, later commits' 3 times in ~610); with the host
idle, or beside three busy loops, 0 in 3,200 (with and without UCX_KEEPALIVE_INTERVAL=inf).
The installer's pinned cpu build (UCX 1.22.0 and NIXL 1.4.0, with debug info: ``. PREFIX/env.sh``
first, so that ``nixl_cpu`` is the binding) did not crash in 3,980 iterations beside a whole CI
run (``bash .ci/run`` in a clean clone) nor in 1,860 beside the unit and kvruntime tests; the
wheel's UCX did not in 1,580 beside kvruntime's integration tests (twelfth session). The crash
has been seen with the PyPI wheel's UCX only, and only beside a whole CI run.
Prints progress every 20 iterations; run it with ``ulimit -c unlimited`` to keep a core.

    python3 ci/teardown-stress.py [ITERATIONS]
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvruntime.decode.client import DecodeClient  # noqa: E402
from kvruntime.layout import CROSS_LAYER, KVLayout  # noqa: E402
from kvruntime.memory import KVCache  # noqa: E402
from kvruntime.prefill.server import PrefillServer  # noqa: E402

STAGED = {"kv_buffer": "host_staged", "staging_blocks": 8}
PAIRINGS = [({}, {"engine": "nixl", "coalesce": "always"}), (STAGED, STAGED),
            ({}, {"engine": "nixl"})]


def main() -> None:
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    start = time.monotonic()
    for i in range(n):
        src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
        src.fill_random(i)
        server_options, client_options = PAIRINGS[i % len(PAIRINGS)]
        with PrefillServer(src, **server_options) as server, \
                DecodeClient(dst, **client_options) as client:
            client.connect(*server.address).pull([1, 2], [3, 4], timeout=10)
        if dst.block_digests([3, 4]) != src.block_digests([1, 2]):
            raise SystemExit(f"iteration {i}: the pulled blocks differ")
        src.close(), dst.close()
        if i % 20 == 0:
            print(i, round(time.monotonic() - start, 1), flush=True)
    print("done", n)


if __name__ == "__main__":
    main()
