"""What the bench tools move: the bench's layouts, the blocks a request names, and how a row
reports a spread of figures."""

from __future__ import annotations

import random

from ..layout import KVLayout

BENCH_HEADS = 8  # KV heads of the bench's model (its TP pairs split them)


def bench_layout(kind: str, block_kib: int, max_mib: int) -> KVLayout:
    """4 layers, 16 tokens, 8 heads, fp16; head_dim sized so a block is ``block_kib`` KiB."""
    page = block_kib * 1024 // 8
    head_dim = max(1, page // (16 * BENCH_HEADS * 2))
    blocks_needed = -(-max_mib * 1024 // block_kib)
    return KVLayout(kind, 4, blocks_needed + blocks_needed // 4 + 1, 16, BENCH_HEADS, head_dim,
                    "float16")


def pick_blocks(pattern: str, count: int, num_blocks: int, rnd: random.Random):
    if pattern == "contiguous":
        s0, d0 = rnd.randint(0, num_blocks - count), rnd.randint(0, num_blocks - count)
        return list(range(s0, s0 + count)), list(range(d0, d0 + count))
    return rnd.sample(range(num_blocks), count), rnd.sample(range(num_blocks), count)


def spread(values) -> list:
    """[min, max] of ``values``, rounded like the report's other figures."""
    return [round(min(values), 3), round(max(values), 3)]
