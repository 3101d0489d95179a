"""Mixed tensor-parallel sizes through host staging, every rank a real process or agent: prefill
TP p serves decode TP d for (1,2), (2,1), (2,4), (4,2); each decode rank gets exactly its heads,
compared bit-exactly with a reference assembled independently from the prefill ranks' seeds.
The prefill ranks keep per_layer caches and the decode ranks cross_layer ones: kinds may differ
when staged."""

import numpy as np
import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import IncompatiblePeerError
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.tp import head_slices

pytestmark = pytest.mark.integration

HEADS, LAYERS, TOKENS, DIM = 4, 2, 8, 16


def rank_layout(kind, tp, blocks=32):
    return KVLayout(kind, LAYERS, blocks, TOKENS, HEADS // tp, DIM, "float16", tp)


def logical(cache):
    """[block][2 x layers][token][head][bytes of a head] of a host cache, as numpy."""
    lay = cache.layout
    de = lay.head_dim * lay.element_bytes
    regions = [np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * lay.region_bytes)
                                     .from_address(r.address)) for r in cache.regions]
    if lay.kind == CROSS_LAYER:
        return regions[0].reshape(lay.num_blocks, 2 * lay.num_layers, lay.tokens_per_block,
                                  lay.num_kv_heads, de).copy()
    return np.stack([r.reshape(lay.num_blocks, lay.tokens_per_block, lay.num_kv_heads, de)
                     for r in regions], axis=1)


# host-staged peers push nothing directly: a staged decode is told to pull (test_prefill_push.py)
@pytest.mark.parametrize("mode,op", [(m, o) for m in ("host_staged", "direct", "coalesced")
                                     for o in ("pull", "push", "prefill_push")
                                     if (m, o) != ("host_staged", "prefill_push")])
@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_each_decode_rank_gets_exactly_its_heads(pushing_prefill, p, d, op, mode):
    """Staged: prefill per_layer, decode cross_layer (kinds may differ through the pools).
    Direct: both per_layer for pulls and both cross_layer for pushes (a head slice is a row
    range inside each block, so the kinds must agree); NIXL moves one descriptor per token row,
    or (coalesced: NIXL forced, coalesce="always") one a chunk of the pools' head-major runs.
    prefill_push: each prefill rank the decode rank reads from starts its push of the request
    (direct: WRITEs of token rows; coalesced: staged by the prefill, READ by the decode)."""
    seed = 40 + p * 10 + d
    staged = mode == "host_staged"
    pkind = PER_LAYER if staged or op == "pull" else CROSS_LAYER
    dkind = CROSS_LAYER if staged or op != "pull" else PER_LAYER
    prefill_layouts = [rank_layout(pkind, p) for _ in range(p)]
    src = [3, 7, 8, 9, 30]
    dst = [0, 5, 6, 7, 31]
    # the reference: the full-head blocks, from the prefill ranks' own seeds
    full = []
    for i, lay in enumerate(prefill_layouts):
        c = KVCache.allocate_host(lay)
        c.fill_random(seed + i)
        full.append(logical(c))
        c.close()
    full = np.concatenate(full, axis=3)  # [block][regions][token][all heads][bytes]
    kw = dict(kv_buffer="host_staged", staging_blocks=16) if staged else {}
    client_kw = {"coalesced": dict(engine="nixl", coalesce="always"),
                 "direct": dict(coalesce="never")}.get(mode, {})
    with pushing_prefill(prefill_layouts, seed=seed, tp_ranks=list(range(p)), **kw) as (
            _proc, ports, push):
        for j in range(d):
            cache = KVCache.allocate_host(rank_layout(dkind, d))
            cache.fill_value(0)
            with DecodeClient(cache, tp_rank=j, **kw, **client_kw) as client:
                slices = head_slices(prefill_layouts[0], cache.layout, j)
                assert len(slices) == max(1, p // d)
                for s in slices:
                    peer = client.connect("127.0.0.1", ports[s.prefill_rank])
                    assert peer.head_slice == s
                    assert peer.engine == ("host_staged" if staged else "nixl")
                    assert peer.route is not None if mode == "coalesced" else True
                    if op == "prefill_push":
                        handle = peer.expect_push(dst, request_id=f"r{j}", timeout=20)
                        assert push(s.prefill_rank, f"r{j}", src, client.agent.name) is None
                        res = handle.wait(20)
                    else:
                        res = getattr(peer, op)(src, dst, timeout=20)
                    assert res.nbytes == len(src) * cache.layout.block_bytes * s.count \
                        // cache.layout.num_kv_heads
                    assert res.coalesced == (mode == "coalesced")
                    if mode == "direct":  # a descriptor a token row of each block's regions
                        assert res.descriptors == len(src) * 2 * LAYERS * TOKENS
                got = logical(cache)
                hd = HEADS // d
                want = full[src][:, :, :, j * hd:(j + 1) * hd, :]
                assert np.array_equal(got[dst], want), f"decode rank {j} of TP {d} from TP {p}"
                others = [b for b in range(32) if b not in dst]
                assert not got[others].any()  # nothing else written
            cache.close()


def test_layouts_that_cannot_pair_are_named(prefill):
    pre = KVLayout(PER_LAYER, LAYERS, 32, TOKENS, 2, DIM, "float16", 2)  # 4 heads in all
    with prefill([pre], seed=1, kv_buffer="host_staged", staging_blocks=8) as (_proc, ports):
        bad = KVLayout(CROSS_LAYER, LAYERS, 32, TOKENS, 3, DIM, "float16", 2)  # 6 heads
        cache = KVCache.allocate_host(bad)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=8) as client:
            with pytest.raises(IncompatiblePeerError, match="num_kv_heads x tp_size"):
                client.connect("127.0.0.1", ports[0])
        cache.close()
        # decode rank 1 of TP 4 owns global head 1, held by prefill rank 0, not rank... 0 only
        ok = KVLayout(CROSS_LAYER, LAYERS, 32, TOKENS, 1, DIM, "float16", 4)
        cache = KVCache.allocate_host(ok)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=8, tp_rank=3) as client:
            with pytest.raises(IncompatiblePeerError, match="holds none of the heads"):
                client.connect("127.0.0.1", ports[0])  # prefill rank 0 holds heads 0-1
        cache.close()


def test_direct_mixed_tp_refuses_what_it_cannot_do_by_name(prefill):
    """Direct mixed TP needs one block kind on both sides, and the same-node engine (whole
    blocks) cannot serve it: both refused at connect with the way out named."""
    from kvruntime.engines.samenode import SameNodeUnavailable

    with prefill([rank_layout(PER_LAYER, 2)], seed=3, tp_ranks=[0]) as (_proc, ports):
        cache = KVCache.allocate_host(rank_layout(CROSS_LAYER, 1))
        with DecodeClient(cache) as client:
            with pytest.raises(IncompatiblePeerError, match="kind: .*one block kind.*host_staged"):
                client.connect("127.0.0.1", ports[0])
        cache.close()
        cache = KVCache.allocate_host(rank_layout(PER_LAYER, 1))
        with DecodeClient(cache, engine="samenode") as client:
            with pytest.raises(SameNodeUnavailable, match="head slices"):
                client.connect("127.0.0.1", ports[0])
        cache.close()
