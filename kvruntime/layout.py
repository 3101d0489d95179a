"""KV cache layouts: where each block of each layer lives, in bytes.

Pure arithmetic (no NIXL, no torch). Two kinds:

* ``per_layer``: what engines allocate today, one region per (layer, K/V); region
  ``2 * layer + kv`` holds ``num_blocks`` pages of ``page_bytes`` each. One block of a request is
  therefore spread over ``2 * num_layers`` regions.
* ``cross_layer``: one region where each block holds all layers (vLLM's cross-layer layout,
  seed 002): block ``b`` is ``[layer][kv][token][head][head_dim]`` at ``b * block_bytes``, so a
  run of consecutive blocks is one contiguous byte range.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property

from .errors import LayoutError

PER_LAYER = "per_layer"
CROSS_LAYER = "cross_layer"
KINDS = (PER_LAYER, CROSS_LAYER)

# Element sizes by dtype name (torch's spelling, without the "torch." prefix).
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# Fields two peers must agree on (num_blocks may differ: each side sizes its own pool).
COMPAT_FIELDS = (
    "kind",
    "dtype",
    "tokens_per_block",
    "num_kv_heads",
    "head_dim",
    "num_layers",
    "tp_size",
)


@dataclass(frozen=True)
class Region:
    """A byte range of the cache: ``index`` names it inside its layout."""

    index: int
    nbytes: int


@dataclass(frozen=True)
class KVLayout:
    kind: str
    num_layers: int
    num_blocks: int
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"layout kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(
                f"dtype {self.dtype!r} is not one of {', '.join(sorted(DTYPE_BYTES))}"
            )
        for name in ("num_layers", "num_blocks", "tokens_per_block", "num_kv_heads",
                     "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")

    # -- sizes (computed once: a request's plan and handles read them many times) ---------------
    @cached_property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @cached_property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.tokens_per_block * self.num_kv_heads * self.head_dim * self.element_bytes

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return 2 * self.num_layers * self.page_bytes

    @cached_property
    def num_regions(self) -> int:
        return 2 * self.num_layers if self.kind == PER_LAYER else 1

    @cached_property
    def chunk_bytes(self) -> int:
        """Bytes one block occupies inside one region."""
        return self.page_bytes if self.kind == PER_LAYER else self.block_bytes

    @cached_property
    def region_bytes(self) -> int:
        return self.num_blocks * self.chunk_bytes

    @cached_property
    def total_bytes(self) -> int:
        return self.num_regions * self.region_bytes

    def regions(self) -> list[Region]:
        return [Region(i, self.region_bytes) for i in range(self.num_regions)]

    def block_extents(self, block: int) -> list[tuple[int, int, int]]:
        """(region, offset, length) of every byte range that holds ``block``."""
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"block {block} is outside 0..{self.num_blocks - 1}")
        off = block * self.chunk_bytes
        return [(r, off, self.chunk_bytes) for r in range(self.num_regions)]

    # -- (de)serialisation for the side channel ----------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVLayout":
        if not isinstance(data, dict):
            raise LayoutError(f"a layout must be a mapping, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise LayoutError(f"unknown layout field(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:  # a missing field
            raise LayoutError(f"incomplete layout: {exc}") from None


def layout_differences(ours: KVLayout, theirs: KVLayout) -> list[str]:
    """Every compatibility field that differs, as 'field: ours=X peer=Y'."""
    out = []
    for name in COMPAT_FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            out.append(f"{name}: ours={a!r} peer={b!r}")
    return out
