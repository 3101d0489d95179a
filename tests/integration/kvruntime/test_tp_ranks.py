"""Mixed-TP groups as bench and selftest run them (kvruntime/tools/tp_group.py): every prefill
and decode rank a real process of its own (host memory here: no GPU; the same code places ranks
on GPUs, test_tp_gpus.py), real NIXL agents over loopback, every decode rank's heads compared with
the prefill ranks' own memory by digest."""

import os

import numpy as np
import pytest

from kvruntime.layout import CROSS_LAYER
from kvruntime.memory import KVCache
from kvruntime.tools.placement import Group, place
from kvruntime.tools.roles import head_digest
from kvruntime.tools.selftest import request_blocks, tp_layout
from kvruntime.tools.tp_group import RankGroup

pytestmark = pytest.mark.integration


def _group(group, references=False):
    options = {"secret": os.urandom(16), "timeout": 30.0, "staging_blocks": 32}
    layouts = (tp_layout(CROSS_LAYER, group.p), tp_layout(CROSS_LAYER, group.d))
    return RankGroup(group, place(group, [0]), layouts, ("device", "host_staged"), options,
                     seed=11, blocks=request_blocks(64, 3), references=references)


@pytest.mark.parametrize("group", [Group(2, 1), Group(1, 2)], ids=str)
def test_every_rank_a_process_of_its_own_gets_exactly_its_heads(group):
    with _group(group) as ranks:
        pids = {p.pid for p in ranks._prefills}
        for engine in ("nixl", "staged"):
            connected = ranks.connect(engine)
            assert all("error" not in c and "skipped" not in c for c in connected.values())
            decode_pids = {c["pid"] for c in connected.values()}
            assert len(decode_pids) == group.d and not decode_pids & (pids | {os.getpid()})
            for op in ("pull", "push") + (("prefill_push",) if engine == "nixl" else ()):
                moved = ranks.at_once(ranks.ranks, {"move": op, "check": True, "request": op})
                for (k, j), m in moved.items():
                    assert "error" not in m, m
                    assert m["bit_exact"], (engine, op, j, m.get("reason"))
                    heads = sum(b - a for _p, (a, b), _d in
                                [(s.prefill_rank, s.src, s.dst) for s in ranks.slices[k, j]])
                    assert m["bytes"] == len(ranks.blocks[0]) * \
                        ranks.decode_layout.block_bytes * heads // ranks.decode_layout.num_kv_heads
        assert len(pids) == group.p


def test_two_decode_instances_at_once_each_get_their_pushes():
    """2x1x2: both decode instances read both prefill ranks at the same moment, and each prefill
    rank starts two pushes of one request name into two decodes: every answer reaches its own
    decode (a reply queue per decode rank), every rank bit-exact."""
    with _group(Group(2, 1, 2), references=True) as ranks:
        ranks.connect("nixl")
        for op in ("pull", "prefill_push"):
            moved = ranks.at_once(ranks.ranks, {"move": op, "check": True, "request": op})
            assert sorted(moved) == [(0, 0), (1, 0)]
            assert all(m.get("bit_exact") for m in moved.values()), moved
        copies = ranks.at_once(ranks.ranks, {"copy": True})
        assert all(c["t1"] > c["t0"] and c["bytes"] > 0 for c in copies.values())


def test_the_head_digest_tells_heads_apart():
    """What the check compares: equal exactly when the heads' bytes are, block for block."""
    pre, dec = KVCache.allocate_host(tp_layout(CROSS_LAYER, 1)), \
        KVCache.allocate_host(tp_layout(CROSS_LAYER, 2))
    try:
        pre.fill_random(5)
        dec.fill_value(0)
        src, dst = [3, 9, 4], [0, 7, 8]
        d = dec.layout
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * d.region_bytes)
                                     .from_address(dec.regions[0].address))
        blocks = view.reshape(d.num_blocks, 2 * d.num_layers, d.tokens_per_block,
                              d.num_kv_heads, -1)
        blocks[dst] = pre.head_view()[src][:, :, :, 2:4]  # the prefill's heads 2-3
        assert head_digest(dec, dst, (0, 2)) == head_digest(pre, src, (2, 4))
        assert head_digest(dec, dst, (0, 2)) != head_digest(pre, src, (0, 2))
        assert head_digest(dec, dst[::-1], (0, 2)) != head_digest(pre, src, (2, 4))
        blocks[7, 1, 3, 1, 5] ^= 1
        assert head_digest(dec, dst, (0, 2)) != head_digest(pre, src, (2, 4))
    finally:
        pre.close()
        dec.close()
