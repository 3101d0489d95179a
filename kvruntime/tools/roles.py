"""Process entry points for the prefill and decode sides of selftest and bench.

They run in child processes started with the ``spawn`` method (a clean interpreter: no
inherited NIXL or UCX state), report through a queue, and never print.
"""

from __future__ import annotations

import queue as queue_mod
import time
import traceback

from ..layout import KVLayout


def device_of(options: dict) -> str:
    """The memory a role allocates its caches in: "cpu" (host DRAM), "cuda" or "xpu" (VRAM)."""
    return options.get("device") or "cpu"


def prepare_process(options: dict) -> dict:
    """First thing a role process does: UCX settings for its memory kind, before NIXL (and
    with it UCX) is imported, so that e.g. cuda pull gets CUDA IPC rather than TCP."""
    from ..nixl.transports import apply_ucx_settings

    # host-staged: NIXL moves only the host staging pools, whatever memory the caches are in
    staged = options.get("kv_buffer") == "host_staged"
    return apply_ucx_settings("cpu" if staged else device_of(options))


def allocate_cache(layout: KVLayout, options: dict):
    """A cache for ``layout`` in the role's memory: huge-page host buffers, or device tensors on
    the explicit ``device_id``."""
    from ..memory import KVCache

    device = device_of(options)
    if device == "cpu":
        return KVCache.allocate_host(layout, options.get("huge", True))
    return KVCache.allocate_device(layout, device, int(options.get("device_id", 0)))


def prefill_main(queue, control, layouts: list[dict], seed: int, options: dict) -> None:
    """Serve one PrefillServer per layout until ``control`` says stop (``kv_buffers``: each
    server's KV buffer, where they differ; else ``kv_buffer`` for all)."""
    servers, caches = [], []
    try:
        _log_from_env()
        prepare_process(options)
        from ..nixl.binding import load_nixl
        from ..prefill.server import PrefillServer

        binding = load_nixl(options.get("nixl_module"))
        ports = []
        for i, spec in enumerate(layouts):
            cache = allocate_cache(KVLayout.from_dict(spec), options)
            caches.append(cache)
            cache.fill_random(seed + i)
            fixed = options.get("ports") or []
            server = PrefillServer(cache, binding=binding, secret=options.get("secret"),
                                   ucx_threads=options.get("ucx_threads"),
                                   device_kind=device_of(options),
                                   port=fixed[i] if i < len(fixed) else 0,
                                   kv_buffer=(options.get("kv_buffers")
                                              or [options.get("kv_buffer")] * len(layouts))[i],
                                   staging_blocks=options.get("staging_blocks", 0),
                                   tp_rank=(options.get("tp_ranks") or [0] * len(layouts))[i],
                                   coalesce=options.get("coalesce", "auto"))
            servers.append(server)
            ports.append(server.address[1])
        queue.put({"ok": True, "ports": ports, "module": binding.module_name,
                   "module_file": getattr(binding.api, "__file__", None)})
        # a command's answer goes to ``queue``, or to the reply queue it names (``replies``:
        # one per decode process that commands this prefill, so concurrent answers don't mix)
        replies = [queue, *options.get("replies", [])]
        while _serve_command(control.get(), servers, replies):  # until the parent's stop
            pass
    except BaseException as exc:  # report, don't print
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "trace": traceback.format_exc()})
    finally:
        for server in servers:
            server.close()
        for cache in caches:
            cache.close()


def push_command(control, replies, index: int, request: str, src, peer: str,
                 timeout: float = 30.0) -> str | None:
    """Have server ``index`` of a ``prefill_main`` process push ``request`` (its blocks
    ``src``) to decode agent ``peer``, as ``_serve_command`` does; the prefill's error, or None
    once the push is posted. ``control``/``replies``: the process's command and report queues."""
    _send_push(control, index, request, src, peer, timeout)
    return _push_reply(replies, request, timeout)


def prefill_push(peer, control, replies, index: int, request: str, src, dst,
                 timeout: float = 30.0):
    """A push the prefill process starts, as bench and selftest run it: ``dst`` named through
    ``peer`` (``expect_push``), the prefill told to push, the result once the notification is
    in. The handle is waited on before the prefill's report is read, so the notification is
    seen as it comes and the push's time is its own."""
    return prefill_pushes([(peer, control, replies, index, 0)], request, src, dst, timeout)[0]


def prefill_pushes(pushers, request: str, src, dst, timeout: float = 30.0) -> list:
    """The pushes of one request by several prefill processes at once (a decode rank fed by
    several prefill ranks): each ``(peer, control, replies, index, reply_to)`` — the peer, that
    process's command queue, the queue its answers to this decode come on (``reply_to``: that
    queue's place in its replies, 0 its own report queue), its server's index. Every block list
    is named first, then every prefill told, then the handles waited on; the results in order."""
    from ..errors import KVRuntimeError

    handles = [peer.expect_push(dst, request_id=request, timeout=timeout)
               for peer, *_ in pushers]
    for (peer, control, _replies, index, reply_to) in pushers:
        _send_push(control, index, request, src, peer.client.agent.name, timeout, reply_to)
    results = []
    for handle, (_peer, _control, replies, _index, _to) in zip(handles, pushers):
        try:
            results.append(handle.wait())
        except KVRuntimeError as exc:
            raise KVRuntimeError(f"{exc} (the prefill's start_push: "
                                 f"{_push_reply(replies, request, timeout) or 'posted'})") from exc
    for _peer, _control, replies, _index, _to in pushers:
        error = _push_reply(replies, request, timeout)
        if error:
            raise KVRuntimeError(f"the prefill's start_push of {request}: {error}")
    return results


def head_digest(cache, blocks, heads) -> str:
    """blake2b of heads ``heads`` (local [first, end)) of ``blocks``, in block order: what a
    mixed-TP decode rank compares with the prefill rank it read them from, whatever the memory."""
    import hashlib

    import numpy as np

    view = cache.head_view()[np.asarray(blocks, dtype=np.int64)][:, :, :, heads[0]:heads[1]]
    return hashlib.blake2b(np.ascontiguousarray(view).tobytes(), digest_size=16).hexdigest()


def digest_command(control, replies, index: int, blocks, heads, reply_to: int,
                   timeout: float = 60.0) -> str:
    """Ask server ``index`` of a ``prefill_main`` process for ``head_digest`` of its cache."""
    from ..errors import KVRuntimeError

    control.put({"digest": index, "blocks": [int(b) for b in blocks], "heads": list(heads),
                 "reply": reply_to})
    reply = replies.get(timeout=timeout)
    if "digest" not in reply:
        raise KVRuntimeError(f"the prefill process answered a digest with {reply}")
    return reply["digest"]


def _send_push(control, index, request, src, peer, timeout, reply_to: int = 0) -> None:
    control.put({"push": index, "request": request, "src": [int(b) for b in src],
                 "peer": peer, "timeout": timeout, "reply": reply_to})


def _push_reply(replies, request: str, timeout: float) -> str | None:
    from ..errors import KVRuntimeError

    reply = replies.get(timeout=timeout)
    if reply.get("pushed") != request:  # the process failed instead (prefill_main's report)
        raise KVRuntimeError(f"the prefill process answered push {request} with {reply}")
    return reply["error"]


def _serve_command(command, servers, replies) -> bool:
    """One command from the parent (or a decode process); False for "stop". The answer goes on
    ``replies[command["reply"]]`` (default 0: the process's report queue).

    ``{"push": i, "request": r, "src": ids, "peer": agent, "timeout": s}`` (``push_command``):
    server ``i`` pushes ``r`` as an engine would once its KV is computed, i.e. after the decode
    named its blocks (waited for here, at most 10 s, so that the push is timed from its start,
    not from the decode's frame). ``{"digest": i, "blocks": ids, "heads": [a, b]}``:
    ``head_digest`` of server ``i``'s cache (what a decode rank's bytes must equal)."""
    if not isinstance(command, dict):
        return False
    queue = replies[command.get("reply", 0)]
    if "digest" in command:
        try:
            queue.put({"digest": head_digest(servers[command["digest"]].cache,
                                             command["blocks"], command["heads"])})
        except Exception as exc:  # the decode raises it
            queue.put({"error": f"{type(exc).__name__}: {exc}"})
        return True
    server, request = servers[command["push"]], command["request"]
    reply = {"pushed": request, "error": None}
    try:
        until = time.monotonic() + 10
        while not server.expects(request, command.get("peer")) and time.monotonic() < until:
            time.sleep(0.0001)
        server.start_push(request, command["src"], command.get("peer"),
                          command.get("timeout", 30.0))
    except Exception as exc:  # the parent raises it
        reply["error"] = f"{type(exc).__name__}: {exc}"
    queue.put(reply)
    return True


def _log_from_env() -> None:
    """Role processes log at KVRUNTIME_LOG_LEVEL (e.g. INFO) to stderr when it is set."""
    import logging

    from ..options import environment

    level = environment("KVRUNTIME_LOG_LEVEL")
    if level:
        logging.basicConfig(level=level.upper(), format="%(processName)s %(levelname)s "
                            "%(name)s: %(message)s")


def answer(q, timeout: float, what: str, procs) -> dict:
    """The next report on ``q``; a failed report naming ``what`` when one of ``procs`` has
    exited or ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.2)
        except queue_mod.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                last = last_word(q)
                if last is not None:
                    return last
                why = (f"{dead[0].name} exited with code {dead[0].exitcode}" if dead
                       else f"no answer within {timeout:.0f}s")
                return {"ok": False, "error": f"{what}: {why}"}


def last_word(q, wait: float = 1.0):
    """What a process that has just exited put on ``q`` before it did, or None. Its queue's
    feeder wrote everything into the pipe before the exit, but a wait that ended just before
    the bytes came, then found the process gone, would report the exit instead of its report
    (CI: "prefill exited with code 0" where the prefill had reported why it failed)."""
    try:
        return q.get(timeout=wait)
    except queue_mod.Empty:
        return None


def reap(proc, control=None, grace: float = 10.0) -> None:
    """Ask a role process to stop (``control``), then kill it if it lingers; always join."""
    if control is not None:
        try:
            control.put("stop")
        except Exception:  # the queue's feeder may be gone with a dead child
            pass
    proc.join(grace)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
