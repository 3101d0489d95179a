"""``python -m kvruntime bench --inflight PEERS REQUESTS``: many requests in flight on one prefill.

``REQUESTS`` pulls of random blocks (together the bench's largest size) are kept in flight by
``PEERS`` decode peers, measured three ways beside one request of all the same bytes from one
peer, in the same iteration:

- ``aggregate``: the peers are clients in this one process, every request started before any
  is waited on;
- ``batched``: the same, each peer starting its share as one batch (``start_pulls``, an engine
  step's worth);
- ``processes``: each peer is a decode process of its own, as deployments run them (a decode
  instance or TP rank is a process), each starting its requests one at a time;
- ``processes_batched``: the same processes, each starting its share as one batch;
- ``processes_copy``: what bounds them: each process copies its share's bytes at the same
  moment with the bench's reference copy (a device copy on the decode's device, or a peer
  copy from the prefill's; memmove on the host), no kvruntime in it. On one H100, without
  MPS, four processes' copies of 256 MiB each end ~0.70 of one copy of the GiB: the GPU runs
  one CUDA context at a time.

The processes start together: the bench names a moment a few milliseconds ahead and each
waits for it (telling them in turn over pipes would start the last ~0.1 ms after the first,
a tenth of what a GiB takes on one H100). Their rate counts from the first process's first
request to the last one's end, on the host's monotonic clock, which ``time.perf_counter``
reads in every process.

In one process the peers' host work (planning, launching, polling) runs one request after
another; in processes it runs side by side, and what is shared is the prefill and the device.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

from .references import DeviceReference, HostReference
from .workload import spread

START_TIMEOUT = 300.0  # a decode process: import, NIXL agent, cache, handshake, warm-up
ROUND_TIMEOUT = 120.0
START_AHEAD = 0.005  # seconds between naming the processes' start and the start


def run_inflight(cfg, binding, layout, port, decode_options, engine, rnd) -> dict:
    from ..decode.client import DecodeClient
    from .roles import allocate_cache

    n_peers, n_requests = cfg.inflight
    total_blocks = min(layout.num_blocks, max(cfg.sizes_mib) * 1024 // cfg.block_kib)
    n_requests = max(1, min(n_requests, total_blocks))
    per_request = max(1, total_blocks // n_requests)
    clients, caches, peers = [], [], []
    workers = None
    try:
        for _ in range(n_peers):
            cache = allocate_cache(layout, decode_options)
            caches.append(cache)
            client = DecodeClient(cache, binding=binding, ucx_threads=cfg.ucx_threads,
                                  host_streams=cfg.host_streams,
                                  device_kind=cfg.device, engine=engine)
            clients.append(client)
            peers.append(client.connect("127.0.0.1", port))
        blocks = rnd.sample(range(layout.num_blocks), per_request * n_requests)
        requests = [blocks[i * per_request:(i + 1) * per_request] for i in range(n_requests)]
        for r in requests[:n_peers]:  # warm-up, every peer
            peers[requests.index(r) % n_peers].pull(r, timeout=120)
        workers = DecodeProcesses(layout, port, decode_options, cfg, engine,
                                  [requests[p::n_peers] for p in range(n_peers)],
                                  per_request * layout.block_bytes)
        nbytes = per_request * n_requests * layout.block_bytes
        agg, batched, one, procs, procs_batched, copies = [], [], [], [], [], []
        for _ in range(cfg.iters):
            t = time.perf_counter()
            handles = [peers[i % n_peers].start_pull(r, timeout=120)
                       for i, r in enumerate(requests)]
            for h in handles:
                h.wait()
            agg.append(nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            handles = [h for p, peer in enumerate(peers) for h in peer.start_pulls(
                [(r, None, None) for r in requests[p::n_peers]], timeout=120)]
            for h in handles:
                h.wait()
            batched.append(nbytes / (time.perf_counter() - t) / 1e9)
            one.append(peers[0].pull(blocks, timeout=120).gbps)
            procs.append(nbytes / workers.round("one") / 1e9)
            procs_batched.append(nbytes / workers.round("batch") / 1e9)
            copies.append(nbytes / workers.round("copy") / 1e9)
        a, b, o, s, sb, c = (statistics.median(v)
                             for v in (agg, batched, one, procs, procs_batched, copies))
        return {"layout": layout.kind, "engine": peers[0].engine, "decode_peers": n_peers,
                "requests_in_flight": n_requests, "blocks_per_request": per_request,
                "bytes_total": nbytes,
                "aggregate_gbps": round(a, 3), "one_request_gbps": round(o, 3),
                "ratio": round(a / o, 3), "batched_gbps": round(b, 3),
                "ratio_batched": round(b / o, 3),
                "processes_gbps": round(s, 3), "ratio_processes": round(s / o, 3),
                "processes_batched_gbps": round(sb, 3),
                "ratio_processes_batched": round(sb / o, 3),
                "processes_copy_gbps": round(c, 3), "processes_copy": workers.reference,
                "ratio_processes_batched_to_copy": round(sb / c, 3),
                "processes_engines": workers.engines,
                "spread": {"aggregate": spread(agg), "batched": spread(batched),
                           "one": spread(one), "processes": spread(procs),
                           "processes_batched": spread(procs_batched),
                           "processes_copy": spread(copies)}}
    finally:
        if workers is not None:
            workers.close()
        for client in clients:
            client.close()
        for cache in caches:
            cache.close()


class DecodeProcesses:
    """One spawned decode process per share of the requests, each with its own cache, client
    and connection to the prefill at ``port``; ``round()`` starts them all at one moment and
    returns the seconds from the first request started to the last one finished."""

    def __init__(self, layout, port, options, cfg, engine, shares, request_bytes: int):
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        try:
            for i, share in enumerate(shares):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=decode_worker, name=f"decode{i}", daemon=True,
                                   args=(theirs, layout.to_dict(), port, options, engine,
                                         cfg.ucx_threads, cfg.host_streams, share,
                                         (cfg.device, cfg.device_ids, cfg.huge_pages,
                                          len(share) * request_bytes)))
                proc.start()
                theirs.close()
                self.pipes.append(ours)
                self.procs.append(proc)
            ready = [self._recv(i, START_TIMEOUT) for i in range(len(self.pipes))]
        except BaseException:
            self.close()
            raise
        self.engines = sorted({r["engine"] for r in ready})
        self.reference = ready[0]["reference"]

    def _recv(self, i: int, timeout: float):
        pipe = self.pipes[i]
        if not pipe.poll(timeout):
            raise TimeoutError(f"decode process {i} sent nothing in {timeout:.0f} s")
        try:
            msg = pipe.recv()
        except EOFError:
            code = self.procs[i].exitcode
            raise RuntimeError(f"decode process {i} exited (code {code})") from None
        if isinstance(msg, dict) and not msg.get("ok", True):
            raise RuntimeError(f"decode process {i}: {msg['error']}")
        return msg

    def round(self, how: str) -> float:
        """``how``: "one" (requests started one at a time), "batch" (one start_pulls), or
        "copy" (the reference copy of the process's share of bytes)."""
        at = time.perf_counter() + START_AHEAD
        for pipe in self.pipes:
            pipe.send(("go", at, how))
        spans = [self._recv(i, ROUND_TIMEOUT) for i in range(len(self.pipes))]
        return max(end for _, end in spans) - min(start for start, _ in spans)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send("stop")
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for pipe in self.pipes:
            pipe.close()


def decode_worker(pipe, layout_spec: dict, port: int, options: dict, engine: str,
                  ucx_threads: int | None, host_streams, requests: list, reference) -> None:
    """A decode process of ``run_inflight``: connects, pulls its first request once (warm-up),
    makes its reference copy (``reference``: the bench's device, device ids, page setting,
    and the bytes of its share) and says ready; then per ``("go", at, how)`` waits for the
    moment ``at``, keeps all its requests in flight (started one at a time, or as one batch)
    or copies its share's bytes, and answers with its (first start, last end) on the monotonic
    clock; anything else ("stop") ends it."""
    client = cache = copier = None
    try:
        from .roles import _log_from_env, allocate_cache, prepare_process

        _log_from_env()
        prepare_process(options)  # UCX settings before NIXL is imported
        from ..decode.client import DecodeClient
        from ..layout import KVLayout
        from ..nixl.binding import load_nixl

        binding = load_nixl(options.get("nixl_module"))
        cache = allocate_cache(KVLayout.from_dict(layout_spec), options)
        client = DecodeClient(cache, binding=binding, ucx_threads=ucx_threads,
                              host_streams=host_streams, device_kind=options.get("device", "cpu"),
                              engine=engine)
        peer = client.connect("127.0.0.1", port)
        peer.pull(requests[0], timeout=120)
        device, device_ids, huge, nbytes = reference
        copier = (HostReference(nbytes, huge) if device == "cpu" else
                  DeviceReference(nbytes, device, device_ids))
        copier.gbps(nbytes)  # warm-up
        pipe.send({"ok": True, "engine": peer.engine, "reference": copier.label})
        batch = [(r, None, None) for r in requests]
        while isinstance(order := pipe.recv(), tuple) and order[0] == "go":
            _, at, how = order
            _until(at)
            start = time.perf_counter()
            if how == "copy":
                copier.gbps(nbytes)
            else:
                handles = (peer.start_pulls(batch, timeout=120) if how == "batch" else
                           [peer.start_pull(r, timeout=120) for r in requests])
                for h in handles:
                    h.wait()
            pipe.send((start, time.perf_counter()))
    except EOFError:  # the bench went away
        pass
    except BaseException as exc:  # report, don't print
        try:
            pipe.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
    finally:
        if copier is not None:
            copier.close()
        if client is not None:
            client.close()
        if cache is not None:
            cache.close()


def _until(moment: float) -> None:
    """Return at ``moment`` on the monotonic clock: asleep until the last half millisecond
    (the scheduler's wake-up is late by tens of µs), then reading the clock."""
    ahead = moment - time.perf_counter()
    if ahead > 0.0005:
        time.sleep(ahead - 0.0005)
    while time.perf_counter() < moment:
        pass
