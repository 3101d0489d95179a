"""How long a message over 127.0.0.1 takes to reach a Python thread blocked in ``recv``, beside
the same message read by a thread that polls without sleeping: the cost of one thread wake-up,
which a push the decode asks for pays where a pull does not (issue 46).

A decode-asked push is a frame to the prefill, whose connection thread sleeps in ``recv``
between frames; the decode's own waits spin (decode/inflight.py) and a pull has no frame on its
path. On a host whose idle cores sleep deeply (a VM), waking the prefill's thread costs more
than the frame's bytes: this measures that part alone, in the same run as its reference.

One process sends a small message every ``--gap-ms`` (the receiver goes idle between them, as
the prefill does between a decode's requests); each carries its send time (CLOCK_MONOTONIC, one
clock for every process of a host), and the receiver notes the time it read it. Modes:
- ``blocked``: the receiver's thread sleeps in ``recv`` (the prefill's connection thread);
- ``blocked_beside_naps``: the same, while another thread of its process naps 1 ms at a time
  and polls (the prefill's progress loop when idle);
- ``spinning`` (the reference): the receiver polls its socket without sleeping.

Prints one JSON object: each mode's median and 90th percentile one-way µs, the sender's own
``sendall`` (median µs: where the kernel wakes the receiver in the sender's call, a sleeping
receiver costs the sender too), and the wake-up's cost (blocked median minus spinning median).
It measures; it asserts nothing.

    python3 ci/wake-latency.py [--messages 400] [--gap-ms 2]
"""
import argparse
import json
import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time

MSG = struct.Struct("<qq")  # send time (ns), sequence


def _sender(port: int, n: int, gap: float, sends) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    took = []
    for i in range(n):
        time.sleep(gap)
        t = time.perf_counter_ns()
        sock.sendall(MSG.pack(t, i))
        took.append((time.perf_counter_ns() - t) / 1e3)
    sock.close()
    sends.put(took)


def _recv_exact(sock, n: int) -> bytes:
    """``n`` bytes: a non-blocking socket is polled until they are there."""
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def measure(mode: str, n: int, gap: float) -> list:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ctx = mp.get_context("spawn")
    sends = ctx.Queue()
    child = ctx.Process(target=_sender, args=(port, n, gap, sends))
    child.start()
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(mode != "spinning")
    stop = threading.Event()
    napper = None
    if mode == "blocked_beside_naps":
        def naps():
            while not stop.is_set():
                stop.wait(0.001)
                sum(range(50))  # a pass's little Python work
        napper = threading.Thread(target=naps, daemon=True)
        napper.start()
    out = []
    try:
        for _ in range(n):
            sent, _seq = MSG.unpack(_recv_exact(sock, MSG.size))
            out.append((time.perf_counter_ns() - sent) / 1e3)
    finally:
        stop.set()
        sock.close()
        listener.close()
        took = sends.get(timeout=30)
        child.join()
    return out[n // 10:], took[n // 10:]  # the first tenth: connection and caches settling


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    args = ap.parse_args()
    if args.messages < 20 or not args.gap_ms > 0:
        ap.error("--messages must be at least 20 and --gap-ms positive")
    report = {"tool": "wake-latency", "messages": args.messages, "gap_ms": args.gap_ms,
              "modes": {}}
    for mode in ("spinning", "blocked", "blocked_beside_naps"):
        us, took = measure(mode, args.messages, args.gap_ms / 1e3)
        us = sorted(us)
        report["modes"][mode] = {"median_us": round(statistics.median(us), 1),
                                 "p90_us": round(us[int(0.9 * (len(us) - 1))], 1),
                                 "send_median_us": round(statistics.median(took), 1)}
    m = report["modes"]
    report["wake_cost_us"] = round(m["blocked"]["median_us"] - m["spinning"]["median_us"], 1)
    report["wake_cost_beside_naps_us"] = round(
        m["blocked_beside_naps"]["median_us"] - m["spinning"]["median_us"], 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
