"""Mixed-TP arithmetic: which heads a decode rank takes, and the row descriptors of a direct
mixed-TP transfer, checked against byte offsets computed from the layout by hand."""

import pytest

from kvruntime.errors import IncompatiblePeerError
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.tp import HeadSlice, head_rows, head_slices, rows_per_chunk
from kvruntime.wire.handshake import check_compat


def lay(kind, heads, tp, layers=2, tokens=4, dim=8, blocks=10):
    return KVLayout(kind, layers, blocks, tokens, heads, dim, "float16", tp)


@pytest.mark.parametrize("p,d,want", [
    (1, 2, [[HeadSlice(0, (0, 2), (0, 2))], [HeadSlice(0, (2, 4), (0, 2))]]),
    (2, 1, [[HeadSlice(0, (0, 2), (0, 2)), HeadSlice(1, (0, 2), (2, 4))]]),
])
def test_head_slices(p, d, want):
    pre, dec = lay(PER_LAYER, 4 // p, p), lay(PER_LAYER, 4 // d, d)
    assert [head_slices(pre, dec, j) for j in range(d)] == want


@pytest.mark.parametrize("kind", [PER_LAYER, CROSS_LAYER])
def test_head_rows_address_every_token_row_of_the_slice(kind):
    layout = lay(kind, heads=4, tp=1)
    regions = [(1 << 20 + i, layout.region_bytes, 7) for i in range(layout.num_regions)]
    rows = head_rows(layout, regions, [5, 2], (1, 3))
    per = rows_per_chunk(layout)
    assert per == (layout.tokens_per_block if kind == PER_LAYER else
                   2 * layout.num_layers * layout.tokens_per_block)
    assert rows.shape == (layout.num_regions * 2 * per, 3)
    head = layout.head_dim * 2
    want = [(base + b * layout.chunk_bytes + r * 4 * head + 1 * head, 2 * head, 7)
            for base, _n, _d in regions for b in (5, 2) for r in range(per)]
    assert [tuple(int(x) for x in row) for row in rows] == want
    assert rows[:, 1].sum() == 2 * layout.chunk_bytes * layout.num_regions // 2  # half the heads


def test_compat_lets_tp_differ_only_with_the_same_model_heads():
    check_compat(lay(PER_LAYER, 4, 1), lay(PER_LAYER, 2, 2))
    check_compat(lay(PER_LAYER, 1, 4), lay(PER_LAYER, 2, 2))
    with pytest.raises(IncompatiblePeerError, match="num_kv_heads x tp_size"):
        check_compat(lay(PER_LAYER, 4, 1), lay(PER_LAYER, 3, 2))
    with pytest.raises(IncompatiblePeerError, match="head_dim"):
        check_compat(lay(PER_LAYER, 4, 1), lay(PER_LAYER, 2, 2, dim=16))
