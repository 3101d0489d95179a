"""A mixed tensor-parallel group run as deployments run it: every rank a process of its own.

Each prefill rank is a ``roles.prefill_main`` process serving one cache on its device; each rank
of each decode instance is a ``decode_rank_main`` process with its own cache on its device,
connected to the prefill ranks that hold its heads (``tp.head_slices``). The parent (bench or
selftest) drives the decode ranks by commands — connect with an engine, move (pull, push, or
a push the prefill ranks start) at a given moment, copy the same bytes as a reference at a
given moment — and gets back times on the host's monotonic clock, which all processes share, so
ranks started at one moment are timed together. A move may check its bytes: the decode rank asks
each prefill rank it read from for a digest of the heads it sent (``roles.head_digest``) and
compares it with the heads it holds, and checks that no other block was written.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback

from ..layout import KVLayout
from .roles import (
    allocate_cache,
    answer,
    device_of,
    digest_command,
    head_digest,
    last_word,
    prefill_main,
    prefill_pushes,
    prepare_process,
    reap,
)

# What moves a group's bytes, by name: the decode clients' options and the prefill's KV buffer.
# Open by design: a row for another option (coalesced NIXL, issue 31) is one more entry.
ENGINES = {
    "samenode": {"kv_buffer": "device", "client": {"engine": "samenode"}},
    "nixl": {"kv_buffer": "device", "client": {"engine": "nixl", "coalesce": "never"}},
    # NIXL through both sides' staging pools (coalesce.py): each rank's head slice gathered
    # head-major, one descriptor a chunk; bench rows only (selftest's modes stay as they were)
    "coalesced": {"kv_buffer": "device", "client": {"engine": "nixl", "coalesce": "always"},
                  "bench_only": True},
    # host-staged: pool to pool by the same-node readers where the prefill is proved to be on
    # this host, else NIXL (``peer.staged_copy`` says which)
    "staged": {"kv_buffer": "host_staged", "client": {}},
}
# A staged decode is told to pull or push; the prefill starts no push into a staging pool.
STAGED_OPS = ("pull", "push")


def kv_buffer_sets(device: str) -> list[tuple[str, ...]]:
    """Which KV buffers one group's processes serve together. A process's UCX settings follow
    the memory NIXL moves (roles.prepare_process): staged moves host memory whatever the
    caches are in, so on a device direct and staged need processes of their own, while on host
    memory one set of processes serves both (half the processes to start)."""
    kinds = tuple(dict.fromkeys(e["kv_buffer"] for e in ENGINES.values()))
    return [kinds] if device == "cpu" else [(k,) for k in kinds]


class RankGroup:
    """The processes of one group (``placement.Group``) on ``placement`` (a
    ``placement.Placement``); a context manager that always reaps them.

    ``layouts``: (prefill rank's, decode rank's) KVLayout; ``kv_buffers``: a prefill server
    on each rank for each (``kv_buffer_sets``); ``options``: the roles' options (device,
    nixl_module, secret, staging_blocks, huge, timeout); ``blocks``: (src, dst) every request
    moves; ``references``: each decode rank also makes its ``RankReference``."""

    def __init__(self, group, placement, layouts, kv_buffers, options: dict, seed: int, blocks,
                 references: bool = False, start_timeout: float = 300.0):
        from ..tp import head_slices

        self.group, self.placement, self.timeout = group, placement, start_timeout
        self.prefill_layout, self.decode_layout = layouts
        ctx = _context()
        self._ctx, self._prefills, self._decodes = ctx, [], []
        self.results = ctx.Queue()
        # every decode rank: its heads' slices, and a reply queue at each prefill rank it reads
        self.ranks = [(k, j) for k in range(group.instances) for j in range(group.d)]
        self.slices = {r: head_slices(self.prefill_layout, self.decode_layout, r[1])
                       for r in self.ranks}
        self._replies = {i: [] for i in range(group.p)}  # per prefill rank, in order
        self._reply_to = {}  # (decode rank, prefill rank): (that queue, its number there)
        for r in self.ranks:
            for s in self.slices[r]:
                q = ctx.Queue()
                self._replies[s.prefill_rank].append(q)
                # the prefill's own report queue is number 0 (roles.prefill_main)
                self._reply_to[r, s.prefill_rank] = (q, len(self._replies[s.prefill_rank]))
        # processes prepare UCX for the first (roles.prepare_process): all agree (kv_buffer_sets)
        self.kv_buffers = list(kv_buffers)
        options = {**options, "kv_buffer": kv_buffers[0], "kv_buffers": self.kv_buffers}
        self._controls = [ctx.Queue() for _ in range(group.p)]
        self._ready = [ctx.Queue() for _ in range(group.p)]
        self.options, self.seed, self.blocks, self.references = options, seed, blocks, references
        self._commands = {r: ctx.Queue() for r in self.ranks}

    def __enter__(self) -> "RankGroup":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        ctx, group, options = self._ctx, self.group, self.options
        for i in range(group.p):
            proc = ctx.Process(
                target=prefill_main, name=f"prefill rank {i}", daemon=True,
                args=(self._ready[i], self._controls[i],
                      [self.prefill_layout.to_dict()] * len(self.kv_buffers),
                      self.seed + i, {**options, "tp_ranks": [i] * len(self.kv_buffers),
                                      "device_id": self.placement.prefill[i],
                                      "replies": self._replies[i]}))
            proc.start()
            self._prefills.append(proc)
        for r in self.ranks:  # started beside the prefill ranks: their ports come with "connect"
            k, j = r
            spec = {"instance": k, "rank": j, "layout": self.decode_layout.to_dict(),
                    "options": {**options, "device_id": self.placement.decode[k][j]},
                    "slices": [(s.prefill_rank, s.src, s.dst) for s in self.slices[r]],
                    "sources": [self.placement.prefill[s.prefill_rank] for s in self.slices[r]],
                    "blocks": [list(map(int, b)) for b in self.blocks],
                    "references": self.references}
            pushers = {s.prefill_rank: (self._controls[s.prefill_rank],
                                        *self._reply_to[r, s.prefill_rank])
                       for s in self.slices[r]}
            proc = ctx.Process(target=decode_rank_main, name=f"decode {k} rank {j}", daemon=True,
                               args=(self._commands[r], self.results, spec, pushers))
            proc.start()
            self._decodes.append(proc)
        self.ports = []
        for i, proc in enumerate(self._prefills):
            ready = answer(self._ready[i], self.timeout, f"prefill rank {i}", [proc])
            if not ready.get("ok"):
                raise RankError(f"prefill rank {i}: {ready.get('error')}")
            self.ports.append(ready["ports"])
        self.module = ready.get("module")
        for reply in self._answers(self.ranks, self.timeout).values():  # each one's "ready"
            if not reply.get("ok"):
                raise RankError(reply.get("error"))

    def connect(self, engine: str, timeout: float = 300.0) -> dict:
        """Every decode rank a client with ``engine``'s options, connected to its prefill ranks;
        their answers (the engine used and why, or "skipped" with the reason, or "error")."""
        server = self.kv_buffers.index(ENGINES[engine]["kv_buffer"])
        return self.ask(self.ranks, {"connect": engine, "server": server,
                                     "ports": [p[server] for p in self.ports]}, timeout)

    def ask(self, ranks, command: dict, timeout: float = 300.0) -> dict:
        """Send ``command`` to decode ``ranks`` ((instance, rank) each); their answers by rank.
        A rank process that dies or stays silent past ``timeout`` raises RankError."""
        for r in ranks:
            self._commands[r].put(command)
        return self._answers(ranks, timeout)

    def _answers(self, ranks, timeout: float) -> dict:
        out = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(ranks):
            try:
                reply = self.results.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [p for p in self._decodes + self._prefills if not p.is_alive()]
                reply = last_word(self.results) if dead else None
                if reply is not None:
                    out[tuple(reply["at"])] = reply
                    continue
                if dead or time.monotonic() > deadline:
                    raise RankError(f"{dead[0].name} exited with code {dead[0].exitcode}" if dead
                                    else f"no answer from the decode ranks within {timeout:.0f}s")
                continue
            out[tuple(reply["at"])] = reply
        return out

    def at_once(self, ranks, command: dict, lead: float = 0.05) -> dict:
        """``command`` for ``ranks``, started by each at one moment ``lead`` s from now."""
        return self.ask(ranks, {**command, "start": time.monotonic() + lead})

    def close(self) -> None:
        for r, proc in zip(self.ranks, self._decodes):
            reap(proc, self._commands[r])
        for proc, control in zip(self._prefills, self._controls):
            reap(proc, control)


def _context():
    """Rank processes come from a fork server that has imported torch and numpy and nothing of
    NIXL or UCX: each starts as clean as a spawned one (UCX is set up and NIXL loaded in it,
    roles.prepare_process; CUDA is not initialized before the fork) without paying torch's
    import again — ~2.5 s of CPU a process on a 2-core host, where a group has up to 8."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "torch", __name__])  # a module missing is skipped
    return ctx


class RankError(RuntimeError):
    """A rank process failed to start, died, or stopped answering."""


def decode_rank_main(commands, results, spec: dict, pushers: dict) -> None:
    """One decode rank: its cache on its device, then commands until "stop" (see ``_Rank``).
    Every answer carries ``at`` = [instance, rank]; nothing is printed."""
    from .roles import _log_from_env

    rank = None
    at = [spec["instance"], spec["rank"]]
    try:
        _log_from_env()
        rank = _Rank(spec, pushers)
        results.put({"at": at, "ok": True})
    except BaseException as exc:
        results.put({"at": at, "ok": False, "error": f"decode {at[0]} rank {at[1]}: "
                     f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    try:
        while rank is not None:
            command = commands.get()
            if not isinstance(command, dict):
                break
            try:
                reply = rank.do(command)
            except Exception as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            results.put({**reply, "at": at})
    finally:
        if rank is not None:
            rank.close()


class _Rank:
    """A decode rank's state. Commands: ``{"connect": engine, "server": i, "ports": [...]}``
    (a client with that engine's options, connected to server ``i`` of each prefill rank it
    reads, at its port); ``{"move": op, "start": t, "check": bool,
    "request": id}``; ``{"copy": True, "start": t}`` (the rank's ``RankReference``)."""

    def __init__(self, spec: dict, pushers: dict):
        self.spec, self.pushers = spec, pushers
        self.options = options = spec["options"]
        prepare_process(options)
        from ..nixl.binding import load_nixl

        self.binding = load_nixl(options.get("nixl_module"))
        self.cache = allocate_cache(KVLayout.from_dict(spec["layout"]), options)
        self.client, self.peers, self.reference, self.server = None, [], None, 0
        self.src, self.dst = spec["blocks"]
        if spec["references"]:
            from .references import RankReference

            heads, block = self.cache.layout.num_kv_heads, self.cache.layout.block_bytes
            parts = [(device, len(self.src) * block * (s[1][1] - s[1][0]) // heads)
                     for device, s in zip(spec["sources"], spec["slices"])]
            self.reference = RankReference(parts, device_of(options), options["device_id"],
                                           options.get("huge", True))

    def do(self, command: dict) -> dict:
        if "connect" in command:
            self.server = command["server"]  # which of each prefill rank's servers it reads
            return self._connect(command["connect"], command["ports"])
        _wait_until(command["start"])
        if "copy" in command:
            t0, t1 = self.reference.copy()
            return {"t0": t0, "t1": t1, "bytes": self.reference.nbytes,
                    "ref": self.reference.label}
        return self._move(command)

    def _connect(self, engine: str, ports) -> dict:
        from ..decode.client import DecodeClient
        from ..engines.samenode import SameNodeUnavailable

        self._close_client()
        options, kv_buffer = self.options, ENGINES[engine]["kv_buffer"]
        self.client = DecodeClient(self.cache, binding=self.binding,
                                   secret=options.get("secret"), device_kind=device_of(options),
                                   kv_buffer=kv_buffer, tp_rank=self.spec["rank"],
                                   staging_blocks=options.get("staging_blocks", 0),
                                   **ENGINES[engine]["client"])
        try:
            self.peers = [self.client.connect("127.0.0.1", ports[p])
                          for p, _src, _dst in self.spec["slices"]]
        except SameNodeUnavailable as exc:
            self._close_client()
            return {"skipped": str(exc)}
        peer = self.peers[0]
        return {"engine": peer.engine, "reason": peer.engine_reason, "pid": os.getpid(),
                "staged_copy": peer.staged_copy,
                "prefill_ranks": [p for p, _src, _dst in self.spec["slices"]]}

    def _move(self, command: dict) -> dict:
        op, check = command["move"], command.get("check", False)
        if check:
            self.cache.fill_value(0)
        t0 = time.monotonic()
        if op == "prefill_push":
            results = prefill_pushes(
                [(peer, *self.pushers[p][:2], self.server, self.pushers[p][2])
                 for peer, (p, _src, _dst) in zip(self.peers, self.spec["slices"])],
                f"{command['request']}/{self.spec['instance']}.{self.spec['rank']}", self.src,
                self.dst, self.options.get("timeout", 30.0))
        else:
            # every prefill rank's part at once, as an engine's step would ask for them
            results = self.client.wait_all([
                getattr(peer, f"start_{op}")(self.src, self.dst,
                                             timeout=self.options.get("timeout", 30.0))
                for peer in self.peers])
        t1 = time.monotonic()
        if op == "prefill_push":  # timed from the prefill's start_push, as the pair bench
            # times it (each result's own seconds): the command this harness sends the
            # prefill process through a queue (~1 ms) is no part of a push
            t0 = t1 - max(r.seconds for r in results)
        reply = {"t0": t0, "t1": t1, "bytes": sum(r.nbytes for r in results),
                 "descriptors": sum(r.descriptors for r in results),
                 "engine": results[0].engine}
        if check:
            reply.update(self._check())
            # UCX's lanes where UCX moved the bytes (a same-node engine's copies take none)
            lanes = self.client.agent.lanes() if self.peers[0].mover.over_nixl else None
            reply["transports"] = self.client.agent.transports() if lanes is not None else None
            if self.cache.mem_type == "VRAM" and lanes:
                from ..nixl.ucxlog import device_lanes_on_tcp

                reply["tcp_for_device_memory"] = [str(lane) for lane in
                                                  device_lanes_on_tcp(lanes, True, True)]
        return reply

    def _check(self) -> dict:
        """Every head this rank got equals the prefill rank's it came from; no other block
        was written."""
        import numpy as np

        bad = []
        for (p, src_heads, dst_heads) in self.spec["slices"]:
            control, replies, to = self.pushers[p]
            want = digest_command(control, replies, self.server, self.src, src_heads, to)
            if head_digest(self.cache, self.dst, dst_heads) != want:
                bad.append(f"heads {dst_heads[0]}..{dst_heads[1] - 1} from prefill rank {p}")
        others = np.delete(self.cache.head_view(), np.asarray(self.dst, dtype=np.int64), axis=0)
        if others.any():
            bad.append("blocks outside the request were written")
        return {"bit_exact": not bad, "checked_blocks": len(self.dst),
                **({"reason": "; ".join(bad)} if bad else {})}

    def _close_client(self) -> None:
        if self.client is not None:
            self.client.close()
        self.client, self.peers = None, []

    def close(self) -> None:
        self._close_client()
        if self.reference is not None:
            self.reference.close()
        self.cache.close()


def _wait_until(moment: float) -> None:
    """Sleep to ``moment`` on the monotonic clock, the last stretch spinning (a shared start)."""
    while True:
        left = moment - time.monotonic()
        if left <= 0:
            return
        time.sleep(left - 0.002 if left > 0.003 else 0)
