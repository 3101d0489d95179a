"""What authenticating the side channel's frames (frames.Session: a keyed BLAKE2b tag and a
frame count on every frame after the handshake) costs a request, beside the frames' own
encoding and parsing measured in the same run.

A push the decode asks for is a frame and a notification (protocol 13): its "push" (block
ids, packed) out, and its WRITE's "pushed" NIXL notification back, sealed with the session's
notification key; a pull's release is a share of one frame, so the push is the larger case.
Each is sealed by its sender and checked by its reader: the MAC's cost per request is those
four calls, timed without sockets (a socket's round trip is ~10x longer and its noise would
hide them); the reference is the same two messages encoded and parsed without a session.
Rounds alternate, so the host's noise falls on both alike; medians of the rounds, and their
minimums (the quietest round).

    python3 -m kvruntime.tools.bench_frames [--ids 1 64 4096] [--requests 2000] [--rounds 7]

Prints one JSON object per id count."""

from __future__ import annotations

import json
import os
import statistics
import time

from .cli import Parser


def _per_request(frame, notif, sessions, requests: int) -> float:
    """Seconds per request: the frame and the notification sealed and checked
    (``sessions``), or encoded and parsed (None)."""
    from ..wire import frames

    t0 = time.perf_counter()
    if sessions is None:
        for _ in range(requests):
            for message in (frame, notif):
                frames.parse_payload(frames._payload(message))
    else:
        sender, reader = sessions
        out, back = frames._payload(frame), frames._payload(notif)
        t0 = time.perf_counter()
        for _ in range(requests):
            reader.check(sender.seal(out))
            sender.check_notif(reader.seal_notif(back))
    return (time.perf_counter() - t0) / requests


def measure(n_ids: int, requests: int, rounds: int) -> dict:
    import numpy as np

    from ..wire import frames, messages

    packed = frames.pack_ids(np.arange(n_ids, dtype=np.int64))
    frame = messages.PUSH.build(request="1234-56", src=packed, dst=packed, number=4321,
                                timeout=5.0, deadline=1764150000.123456, split=1)
    notif = messages.PUSHED.build(request="1234-56", number=4321, descriptors=1)
    sent = [frame, notif]
    plain, mac = [], []
    for _ in range(rounds):
        key = os.urandom(32)
        mac.append(_per_request(frame, notif, (frames.Session(key, key),
                                               frames.Session(key, key)), requests))
        plain.append(_per_request(frame, notif, None, requests))
    p, m = statistics.median(plain) * 1e6, statistics.median(mac) * 1e6
    return {"ids": n_ids, "messages_per_request": len(sent),
            "frame_bytes": [len(frames._payload(x)) for x in sent],
            "mac_us_per_request": round(m, 2), "encode_parse_us_per_request": round(p, 2),
            # the quietest round: what the calls cost when no other process takes the core
            "mac_us_per_request_min": round(min(mac) * 1e6, 2),
            "encode_parse_us_per_request_min": round(min(plain) * 1e6, 2),
            "ratio_mac_to_encode_parse": round(m / p, 3), "requests": requests,
            "rounds": rounds}


def main(argv=None) -> int:
    ap = Parser(prog="python -m kvruntime.tools.bench_frames", description=__doc__)
    ap.add_argument("--ids", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    bad = [v for v in (*args.ids, args.requests, args.rounds) if v < 1]
    if bad:
        ap.error(f"--ids, --requests and --rounds must be positive integers, got {bad[0]}")
    for n in args.ids:
        print(json.dumps(measure(n, args.requests, args.rounds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
