"""The NIXL calls vLLM's NixlConnector makes on its workers, made by two processes over a real
build, through `import nixl` as vLLM imports it (test_vllm_calls.py says from which vLLM source).

    python vllm_calls_pair.py decode [DECODE_DEVICE PREFILL_DEVICE]
        # starts the prefill itself; prints one JSON line. Devices: cpu (the default: host
        # memory, NIXL's "DRAM") or cuda:N (VRAM on GPU N, NIXL's "VRAM" with device id N, as
        # vLLM registers kv_buffer_device=cuda)

The prefill registers its KV caches (two layers, K and V apart: four regions of NUM_BLOCKS
blocks, as vLLM lays out a non-MLA cache), prepares its own blocks under "NIXL_INIT_AGENT" and
hands its agent metadata over (vLLM: a zmq side channel; here the processes' pipes). The decode
does the same with its own caches, adds the prefill as a remote agent, prepares the prefill's
blocks under that name, READs a request's blocks (out of order, vLLM's descriptor ids: region *
num_blocks + block) with a notification, WRITEs others back with another, tells a full prefix
hit by send_notif, then releases everything and removes the remote agent, as vLLM's shutdown
does. Bytes are compared bit-exact on both sides; each side reports the UCX libraries it holds."""
from __future__ import annotations

import base64
import json
import sys
import time
import uuid

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config  # as vLLM imports it

LAYERS, NUM_BLOCKS, BLOCK_LEN = 2, 8, 64 << 10  # 4 regions x 8 blocks x 64 KiB
REGIONS = 2 * LAYERS
MARK = "VLLM "  # NIXL's logger writes to stdout too: our lines carry this mark
READ_LOCAL, READ_REMOTE = [3, 1, 4], [0, 5, 2]
WRITE_LOCAL, WRITE_REMOTE = [6, 0], [7, 6]
NOTIFS = {b"req-read:1", b"req-write:1", b"req-hit:1"}  # vLLM's f"{request_id}:{world_size}"
TIMEOUT = 60.0


def say(obj) -> None:
    print(MARK + json.dumps(obj), flush=True)


def hear(stream) -> dict:
    for line in stream:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit("the other process ended without answering")


def pattern(seed: int, region: int, block: int) -> np.ndarray:
    i = np.arange(BLOCK_LEN, dtype=np.uint32)
    return ((i * 131 + seed * 7 + region * 13 + block * 29 + (i >> 8)) & 0xFF).astype(np.uint8)


def caches(seed: int, device: str) -> list[torch.Tensor]:
    """One tensor a region (vLLM: K and V of each layer), filled with the side's pattern."""
    out = []
    for r in range(REGIONS):
        host = np.concatenate([pattern(seed, r, b) for b in range(NUM_BLOCKS)])
        out.append(torch.from_numpy(host).to(device))
    return out


def block(cache: list[torch.Tensor], region: int, b: int) -> np.ndarray:
    """A copy of one block, on the host."""
    return cache[region][b * BLOCK_LEN:(b + 1) * BLOCK_LEN].cpu().numpy()


def clear(cache: list[torch.Tensor], region: int, b: int) -> None:
    cache[region][b * BLOCK_LEN:(b + 1) * BLOCK_LEN] = 0


def memory(cache: list[torch.Tensor]) -> tuple[str, int]:
    """NIXL's memory type and device id for the caches, as vLLM's register_kv_caches gives them."""
    dev = cache[0].device
    return ("VRAM", dev.index) if dev.type == "cuda" else ("DRAM", 0)


def desc_ids(block_ids: list[int]) -> np.ndarray:
    """vLLM's _get_block_descs_ids: every region's copy of each block."""
    regions = np.arange(REGIONS)[:, None]
    return (regions * NUM_BLOCKS + np.array(block_ids)[None, :]).flatten()


def register(agent, cache):
    """vLLM's register_kv_caches + register_local_xfer_handler on host memory (DRAM)."""
    kind, dev = memory(cache)
    caches_data = [(t.data_ptr(), t.numel(), dev, "") for t in cache]
    reg = agent.get_reg_descs(caches_data, kind)
    agent.register_memory(reg, backends=["UCX"])
    blocks_data = [(t.data_ptr() + b * BLOCK_LEN, BLOCK_LEN, dev) for t in cache
                   for b in range(NUM_BLOCKS)]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks_data, kind))
    return reg, local, {"bases": [t.data_ptr() for t in cache], "kind": kind, "dev": dev}


def ucx_maps() -> list[str]:
    paths = {ln.split()[-1] for ln in open("/proc/self/maps") if "/" in ln.split()[-1]}
    return sorted(p for p in paths if "/libucp" in p or "/libucs" in p)


def wait_done(agent, handle) -> str:
    end = time.monotonic() + TIMEOUT
    while (state := agent.check_xfer_state(handle)) == "PROC" and time.monotonic() < end:
        time.sleep(0.001)
    return state


def prefill(device: str) -> None:
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True))
    cache = caches(1, device)
    reg, local, where = register(agent, cache)
    say({"metadata": base64.b64encode(agent.get_agent_metadata()).decode(), **where})
    got: dict[bytes, str] = {}
    end = time.monotonic() + TIMEOUT
    while set(got) != NOTIFS and time.monotonic() < end:
        for sender, notifs in agent.get_new_notifs().items():
            got.update({n: sender for n in notifs})
        time.sleep(0.001)
    written = all(np.array_equal(block(cache, r, rb), pattern(2, r, lb)) for r in range(REGIONS)
                  for lb, rb in zip(WRITE_LOCAL, WRITE_REMOTE))
    untouched = all(np.array_equal(block(cache, r, b), pattern(1, r, b)) for r in range(REGIONS)
                    for b in range(NUM_BLOCKS) if b not in WRITE_REMOTE)
    say({"notifs": sorted(n.decode() for n in got), "senders": sorted(set(got.values())),
         "written": written, "untouched": untouched, "maps": ucx_maps()})
    sys.stdin.readline()  # the decode removed us: vLLM's shutdown on this side too
    agent.release_dlist_handle(local)
    agent.deregister_memory(reg)


def decode(device: str, prefill_device: str) -> None:
    import subprocess

    peer = subprocess.Popen([sys.executable, __file__, "prefill", prefill_device],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        out = _decode(peer, device)
        peer.stdin.write("bye\n")
        peer.stdin.flush()
        out["prefill_rc"] = peer.wait(timeout=TIMEOUT)
    finally:
        peer.kill()
    say(out)


def _decode(peer, device: str) -> dict:
    name = str(uuid.uuid4())
    agent = nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=True))
    cache = caches(2, device)
    for r in range(REGIONS):  # the READ's landing blocks start empty
        for b in READ_LOCAL:
            clear(cache, r, b)
    reg, local, _ = register(agent, cache)
    meta = hear(peer.stdout)
    remote = agent.add_remote_agent(base64.b64decode(meta["metadata"]))
    blocks_data = [(base + b * BLOCK_LEN, BLOCK_LEN, meta["dev"]) for base in meta["bases"]
                   for b in range(NUM_BLOCKS)]
    dst = agent.prep_xfer_dlist(remote, agent.get_xfer_descs(blocks_data, meta["kind"]))
    states, telemetry = {}, {}
    for op, mine, theirs, notif in (("READ", READ_LOCAL, READ_REMOTE, b"req-read:1"),
                                    ("WRITE", WRITE_LOCAL, WRITE_REMOTE, b"req-write:1")):
        handle = agent.make_prepped_xfer(op, local, desc_ids(mine), dst, desc_ids(theirs),
                                         notif_msg=notif)
        agent.transfer(handle)
        states[op] = wait_done(agent, handle)
        if states[op] == "DONE":
            telemetry[op] = agent.get_xfer_telemetry(handle).totalBytes
        agent.release_xfer_handle(handle)
    agent.send_notif(remote, notif_msg=b"req-hit:1")  # vLLM: a full prefix cache hit
    read = all(np.array_equal(block(cache, r, lb), pattern(1, r, rb)) for r in range(REGIONS)
               for lb, rb in zip(READ_LOCAL, READ_REMOTE))
    report = hear(peer.stdout)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(dst)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    import nixl
    return {"states": states, "read": read, "telemetry_bytes": telemetry, "prefill": report,
            "decode_name": name, "maps": ucx_maps(), "nixl": nixl.__file__,
            "memory": [memory(cache)[0], meta["kind"]],
            "api": sys.modules["nixl._api"].__file__}


if __name__ == "__main__":
    role, devices = sys.argv[1], sys.argv[2:] or (["cpu", "cpu"] if sys.argv[1] == "decode"
                                                   else ["cpu"])
    {"decode": decode, "prefill": prefill}[role](*devices)
