"""Copying a request's blocks between two device caches with as few launches as possible.

Each region is a flat byte tensor of ``num_blocks`` chunks. A request is a list of runs
(plan.py). Few runs: one ``copy_`` (cudaMemcpy) per run and region, which moves contiguous
bytes at full speed. Many runs: one gather kernel per region over the expanded block lists —
Triton where present (each program copies one tile of one block, reading the source block and
writing the destination block once), else torch's ``index_select``+``index_copy_`` (twice the
traffic, but still one launch pair instead of one copy per block).

Across GPUs the work runs on the source's GPU (``work_device``), writing into the destination
over NVLink: memory opened by CUDA IPC handle is mapped into the context of the GPU it lives
on only. A kernel on the other GPU cannot address it, peer access or not (2 x H200: Triton
refuses the pointer; an address passed as an integer faults), while its stores into the
destination's ordinary allocation go through peer access (366 GB/s there against a 393 GB/s
peer copy for 4096 random 256 KiB blocks).
"""

from __future__ import annotations

import logging

from ..host import cudart
from ..host.cudart import enable_peer_access

log = logging.getLogger("kvruntime")

# Up to this many runs, per-run copy_ beats building index lists.
RUN_COPY_MAX = 8
# The block gather's shape, by where its stores go: (most words a program copies, warps).
# Within one GPU 8192 words (64 KiB of int64) with 16 warps: timed alone (ids already on the
# GPU, `ci/gpu-copy-engines.py --devices 0 0 --sweep`, one H200, 1 GiB as 4096 random
# 256 KiB blocks) every 8192-word shape ran at 0.884-0.900 of a device copy_ of the same
# bytes, the 2048-word ones at 0.808-0.894. In the request path (bench, interleaved with the
# old shape on one host) the difference is within its run-to-run spread (0.73-0.82). Across
# NVLink 2048 words with 8 warps: no shape was reliably better there (2 x H200, tenth
# session), and none larger was measured.
SHAPES = {"local": (8192, 16), "peer": (2048, 8)}
# Bytes of a head slice one program copies, and the warps that copy them: 8-128 KiB with 4-32
# warps ran within 3% of this across 2 x H100 (GPU time of the bench's slices)
HEAD_TILE_BYTES = 16384
HEAD_WARPS = 8

try:  # Triton is optional: CUDA builds of torch carry it
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_blocks(src, dst, ids, dst_at, words, TILE: tl.constexpr):
        i = tl.program_id(0)
        tile = tl.program_id(1)
        s = tl.load(ids + i).to(tl.int64)  # the source ids at 0, the destination's at dst_at
        d = tl.load(ids + dst_at + i).to(tl.int64)
        offs = tile * TILE + tl.arange(0, TILE)
        mask = offs < words
        v = tl.load(src + s * words + offs, mask=mask)
        tl.store(dst + d * words + offs, v, mask=mask)

    @triton.jit
    def _gather_heads(src, dst, ids, dst_at, src_block, dst_block, src_row, dst_row, s_off,
                      d_off, width, rows, ROWS: tl.constexpr, WIDTH: tl.constexpr):
        # one program: ROWS token rows x WIDTH words of one block's head slice, a row's words on
        # the inner axis (WIDTH: the slice's width padded to a power of 2, masked), so that no
        # index is divided per element and Triton sees the addresses contiguous: 16 bytes a
        # thread where the offsets and the width are divisible by 16 words. GPU time across
        # 2 x H100: 0.90-0.94 of a peer copy_ of the same bytes, as the 1-D kernel with its
        # e // width was (NVLink bounds it there, not the instructions); on one GPU 1-2% faster
        i = tl.program_id(0)
        s = tl.load(ids + i).to(tl.int64)
        d = tl.load(ids + dst_at + i).to(tl.int64)
        r = (tl.program_id(1) * ROWS + tl.arange(0, ROWS))[:, None]
        w = (tl.program_id(2) * WIDTH + tl.arange(0, WIDTH))[None, :]
        mask = (r < rows) & (w < width)
        v = tl.load(src + s * src_block + s_off + r * src_row + w, mask=mask)
        tl.store(dst + d * dst_block + d_off + r * dst_row + w, v, mask=mask)
except Exception:  # ImportError, or a Triton that cannot compile here
    triton = None


def _launch_hooks_set() -> bool:
    try:
        from triton import knobs
    except ImportError:
        return True  # a Triton without knobs: launch through the JIT only
    # a hook, or (Triton 3.5+) a chain of hooks, empty unless a profiler added one
    return any(h is not None and bool(getattr(h, "calls", True))
               for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


class _Launches:
    """Compiled kernels (``kernel``: the block gather by default, or the head-slice one, with
    ``warps`` warps a program) launched directly. A call through Triton's JIT binds the
    arguments, specializes them and looks the kernel up again every time (~40 µs a launch on
    the H100 VM's CPU, more than the GPU time of a 32 MiB gather). The kernel one JIT launch
    returns is kept per region, per what Triton specialized its arguments on
    (_specialization: between requests of a region that is the destination ids' offset
    divisible by 16 or not) and per the constexpr arguments' values (a compiled kernel has
    them built in: the head kernel's tile follows the head slice), and later launches go to
    it. Where launch hooks are set (a profiler), or this Triton's compiled kernels look
    otherwise, every launch goes through the JIT."""

    def __init__(self, kernel=None, warps: int = 8):
        self._jit = kernel if kernel is not None else _gather_blocks
        self._warps = warps
        self._kernels: dict = {}
        self.direct = 0  # launches that skipped the JIT (tests read it)

    def launch(self, region: int, grid: tuple, stream: int, args: tuple, consts: tuple) -> None:
        """``grid``: two or three axes; ``consts``: the kernel's constexpr arguments, in the
        kernel's order after ``args`` (a compiled kernel takes them positionally too)."""
        key = (region, _specialization(args), consts)
        kernel = self._kernels.get(key)
        if kernel is not None and not _launch_hooks_set():
            x, y, z = (*grid, 1)[:3]
            kernel.run(x, y, z, stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *args, *consts)
            self.direct += 1
            return
        compiled = self._jit[grid](*args, *consts, num_warps=self._warps)
        if (all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
                and compiled.function):
            self._kernels[key] = compiled


def _specialization(args: tuple) -> tuple:
    """What Triton's JIT specializes a kernel on, of each argument: an integer's being 1,
    divisible by 16, or wider than 32 bits; a tensor's address divisible by 16. Launches whose
    arguments agree on all of it run the same compiled kernel."""
    return tuple((a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31)) if isinstance(a, int)
                 else a.data_ptr() % 16 == 0 for a in args)


def _word_view(flat, chunk_bytes: int):
    """The widest integer view of a flat byte tensor whose element divides a chunk."""
    import torch

    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if chunk_bytes % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype), chunk_bytes // size
    return flat, chunk_bytes


def work_device(src_devices: set, dst_device):
    """The GPU whose stream a gather's work goes on: the source's (one device) where Triton
    runs the kernel, else the destination's (torch's fallback reads the source's rows there
    and copies them over)."""
    if triton is not None and len(src_devices) == 1:
        return next(iter(src_devices))
    return dst_device


class BlockGather:
    """Copies of requests' blocks queued on ``stream`` (a torch CUDA stream on
    ``work_device``'s GPU; the caller makes it current): runs by the CUDA runtime's copies,
    scattered blocks by one kernel a region."""

    def __init__(self, src_regions: list, dst_regions: list, chunk_bytes: int,
                 src_blocks: int, dst_blocks: int, stream):
        self.src = src_regions
        self.dst = dst_regions
        self.chunk = chunk_bytes
        self.src_blocks = src_blocks
        self.stream = stream
        self.device = stream.device
        self._ptrs = [(s.data_ptr(), d.data_ptr()) for s, d in zip(src_regions, dst_regions)]
        self.same_device = all(s.device == d.device for s, d in zip(src_regions, dst_regions))
        self.use_triton = triton is not None
        if not self.same_device:
            # Work on one GPU touches the other's memory (a kernel's stores, the runtime's
            # copies of runs) once peer access is enabled from the working GPU's context.
            for s, d in {(s.device, d.device) for s, d in zip(src_regions, dst_regions)}:
                other = d if self.device == s else s
                why = enable_peer_access(self.device, other)
                if why and self.use_triton:
                    log.info("no peer access %s -> %s (%s): gathers take torch's two steps",
                             self.device, other, why)
                    self.use_triton = False
        self._uploads = None
        self._kernels = None     # _Launches, made on the first kernel launch
        self._done_there = None  # the fallback's event on the destination GPU, made on use
        # what each request's launches need, made once: per region the word views, the words
        # of a block, the tile and the tiles per block (the grid's second axis)
        self._launches = []
        self._shape = "local" if self.same_device else "peer"
        for s, d in zip(src_regions, dst_regions):
            (sw, words), (dw, _) = (_word_view(s[: src_blocks * chunk_bytes], chunk_bytes),
                                    _word_view(d[: dst_blocks * chunk_bytes], chunk_bytes))
            tile = _tile(words, self._shape)
            self._launches.append((sw, dw, words, tile, -(-words // tile)))
        # the torch fallback's [block][bytes] views
        self._rows = [(s[: src_blocks * chunk_bytes].view(src_blocks, chunk_bytes),
                       d[: dst_blocks * chunk_bytes].view(dst_blocks, chunk_bytes))
                      for s, d in zip(src_regions, dst_regions)]

    def warm(self) -> None:
        """What a first request would pay, paid now (at connect): the block-id upload buffers
        made, and the gather kernel compiled (or loaded from Triton's per-host cache) and
        launched once for each of the specializations requests meet (the destination ids'
        offset divisible by 16 or not), into a scratch block: the first request then finds it
        in the JIT's cache (H100: a first pull of 16 MiB took ~1.3 s, later ones ~0.5 ms).
        Nothing of the caches is written."""
        import torch

        if self._uploads is None:
            self._uploads = cudart.IdUploads(self.device, self.stream)
        if not self.use_triton:
            return
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                ids = torch.zeros(64, dtype=torch.int64, device=self.device)
                # every region's launches kept (_Launches) as a request makes them, the
                # destination a scratch block: a first request skips Triton's JIT like the rest
                # (the kernel depends on the arguments' types and alignment, not their values)
                self._kernels = kernels = _Launches(warps=SHAPES[self._shape][1])
                scratch = {}
                stream = self.stream.cuda_stream
                for region, (sw, dw, words, tile, tiles) in enumerate(self._launches):
                    if (words, dw.dtype) not in scratch:
                        scratch[words, dw.dtype] = torch.empty(words, dtype=dw.dtype,
                                                               device=self.device)
                    for dst_at in (16, 18):
                        kernels.launch(region, (1, tiles), stream,
                                       (sw, scratch[words, dw.dtype], ids, dst_at, words), (tile,))
                self.stream.synchronize()
        except Exception as exc:  # the first request compiles it then, or falls back
            log.info("warming the Triton gather failed (%s): the first request compiles it", exc)
            self._kernels = None

    def into(self, dst_regions: list, dst_blocks: int) -> "BlockGather":
        """This gather writing into ``dst_regions`` (``dst_blocks`` blocks each) instead, its
        id uploads and compiled kernels shared: nothing allocated, nothing compiled (a
        same-node connect's rehearsal into scratch, samenode.py)."""
        other = BlockGather(self.src, dst_regions, self.chunk, self.src_blocks, dst_blocks,
                            self.stream)
        other._uploads, other._kernels = self._uploads, self._kernels
        return other

    def copy(self, plan) -> str:
        """Queue the copy of ``plan``'s blocks on the stream; returns the method."""
        c = self.chunk
        if plan.num_runs <= RUN_COPY_MAX:
            handle = self.stream.cuda_stream
            runs = plan.runs
            for src, dst in self._ptrs:
                for r in runs:
                    cudart.copy_async(dst + r.dst * c, src + r.src * c, r.count * c, handle)
            return "copy"
        if self._uploads is None:
            self._uploads = cudart.IdUploads(self.device, self.stream)
        src_ids, dst_ids = plan.block_ids()
        ids, (_, dst_at) = self._uploads.upload(src_ids, dst_ids)
        return self._launch(ids, len(src_ids), dst_at)

    def _launch(self, ids, n: int, dst_at: int) -> str:
        """Source ids ``ids[:n]``, destination ids ``ids[dst_at:dst_at + n]``."""
        if self.use_triton:
            try:
                if self._kernels is None:
                    self._kernels = _Launches(warps=SHAPES[self._shape][1])
                stream = self.stream.cuda_stream
                for region, (sw, dw, words, tile, tiles) in enumerate(self._launches):
                    self._kernels.launch(region, (n, tiles), stream,
                                         (sw, dw, ids, dst_at, words), (tile,))
                return "triton"
            except Exception as exc:  # e.g. a source on another device Triton refuses
                log.warning("Triton gather unavailable (%s); using torch index ops", exc)
                self.use_triton = False
        s_ids, d_ids = ids[:n], ids[dst_at:dst_at + n]
        device = self.dst[0].device
        for src_rows, dst_rows in self._rows:
            rows = src_rows.index_select(0, s_ids.to(src_rows.device))
            dst_rows.index_copy_(0, d_ids.to(device), rows.to(device, non_blocking=True))
        if device != self.device:
            # the index_copy_ went on the destination GPU's current stream: ours waits for it,
            # so that the request's completion event covers it
            import torch

            with torch.cuda.device(device):
                if self._done_there is None:
                    self._done_there = cudart.Event()
                self._done_there.record(torch.cuda.current_stream(device).cuda_stream)
            cudart.wait(self.stream.cuda_stream, self._done_there)
        return "torch"


class HeadGather:
    """Mixed TP on the same node: heads ``heads.src`` of the peer's blocks into heads
    ``heads.dst`` of ours, every region seen as [block][token row][head][bytes of a head]. One
    kernel a region reads each token row's head slice once and writes it once — across GPUs
    from the source's GPU into ours over NVLink (peer access), as BlockGather does for whole
    blocks, where torch's index ops would take three passes (gather, peer copy, scatter). The
    caller makes ``stream`` (on the GPU holding the peer's memory) current."""

    def __init__(self, src_regions: list, dst_regions: list, theirs, ours, stream):
        import torch

        self.device = stream.device
        de = theirs.head_dim * theirs.element_bytes
        self.rows = theirs.chunk_bytes // (theirs.num_kv_heads * de)
        size = next(n for n in (8, 4, 2, 1) if de % n == 0 and all(
            t.data_ptr() % n == 0 for t in (*src_regions, *dst_regions)))
        dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size]
        self.head_words = de // size
        self.tile_words = HEAD_TILE_BYTES // size
        self.src = [t[:theirs.region_bytes].view(dtype) for t in src_regions]
        self.dst = [t[:ours.region_bytes].view(dtype) for t in dst_regions]
        self.src_row = theirs.num_kv_heads * self.head_words
        self.dst_row = ours.num_kv_heads * self.head_words
        self.src_block = self.rows * self.src_row
        self.dst_block = self.rows * self.dst_row
        for other in {t.device for t in (*src_regions, *dst_regions)} - {self.device}:
            why = enable_peer_access(self.device, other)
            if why:
                raise RuntimeError(f"no peer access {self.device} -> {other}: {why}")
        self.stream = stream
        # block ids up as BlockGather's go (no allocation a request), and the kernel launched
        # without Triton's JIT after its first launch a region (_Launches)
        self._uploads = cudart.IdUploads(self.device, stream)
        self._kernels = _Launches(_gather_heads, HEAD_WARPS)

    def warm(self, heads) -> None:
        """The kernel compiled (or loaded) at connect, launched once a region into a scratch
        block, for both specializations of the destination ids' offset (as BlockGather's)."""
        import numpy as np

        scratch = self.dst[0].new_empty(self.dst_block)
        for n in (16, 17):  # the destination ids at 16 and at 18
            ids, (_, dst_at) = self._uploads.upload(np.zeros(n, dtype=np.int64),
                                                    np.zeros(n, dtype=np.int64))
            for region, src in enumerate(self.src):
                self._launch(region, src, scratch, ids, 1, dst_at, heads)
        self.stream.synchronize()

    def copy(self, src_ids, dst_ids, heads) -> None:
        """Queue the copy on the stream (the caller made it current)."""
        import numpy as np

        ids, (_, dst_at) = self._uploads.upload(np.asarray(src_ids, dtype=np.int64),
                                                np.asarray(dst_ids, dtype=np.int64))
        for region, (src, dst) in enumerate(zip(self.src, self.dst)):
            self._launch(region, src, dst, ids, len(src_ids), dst_at, heads)

    def _launch(self, region: int, src, dst, ids, n: int, dst_at: int, heads) -> None:
        (s0, s1), (d0, _) = heads.src, heads.dst
        width = (s1 - s0) * self.head_words
        rows, words = _head_tile(self.rows, width, self.tile_words)
        self._kernels.launch(region, (n, -(-self.rows // rows), -(-width // words)),
                             self.stream.cuda_stream,
                             (src, dst, ids, dst_at, self.src_block, self.dst_block, self.src_row,
                              self.dst_row, s0 * self.head_words, d0 * self.head_words, width,
                              self.rows), (rows, words))


def prewarm(cache) -> str:
    """At a decode client's start, what its first same-node connect would otherwise pay:
    the CUDA runtime loaded and the process's first pinned allocation made (the id uploads',
    cudart.prepare_uploads), Triton imported (~0.2 s) and the gather kernel compiled or
    loaded from Triton's per-host cache for this cache's blocks (~0.5 s on the H100 host,
    hashing Triton's own sources once per process), launched once into a scratch block on
    the cache's GPU. A connect then finds the kernel in the JIT's cache (H100: a first
    same-node connect took 727 ms, later ones 54). Returns what was done, for the log; never
    raises (the connect pays it then)."""
    try:
        cudart.prepare_uploads()
    except Exception as exc:
        log.info("preparing the id uploads failed (%s): a connect pays it", exc)
    if triton is None:
        return "no Triton: gathers take torch's index ops"
    try:
        import torch

        tensors = cache.tensors
        device = tensors[0].device
        chunk = cache.layout.chunk_bytes
        flat = tensors[0].reshape(-1).view(torch.uint8)
        sw, words = _word_view(flat[:chunk], chunk)
        _warm_on(device, sw, words, "local")  # a peer on this GPU is gathered here
        # a same-node peer's cache on another GPU of ours is gathered there (work_device): the
        # kernel loaded and peer access on where this process holds a context already (no
        # new context made; a first same-node connect across two H200 spent 7.5 of its 24 ms
        # loading the kernel on the peer's GPU)
        others = []
        for index in range(torch.cuda.device_count()):
            other = torch.device("cuda", index)
            if other == device or not cudart.context_active(index):
                continue
            if enable_peer_access(other, device) is None:
                _warm_on(other, torch.empty(words, dtype=sw.dtype, device=other), words, "peer")
                others.append(str(other))
        return f"gather kernel ready on {', '.join([str(device)] + others)}"
    except Exception as exc:
        log.info("prewarming the Triton gather failed (%s): a connect compiles it", exc)
        return f"not prewarmed: {exc}"


def _warm_on(device, source, words: int, shape: str) -> None:
    """The gather kernel of ``shape`` (SHAPES) compiled (or loaded) on ``device`` for both
    specializations requests meet (the destination ids' offset divisible by 16 or not),
    launched into scratch there."""
    import torch

    tile, warps = _tile(words, shape), SHAPES[shape][1]
    with torch.cuda.device(device):
        ids = torch.zeros(64, dtype=torch.int64, device=device)
        scratch = torch.empty(words, dtype=source.dtype, device=device)
        for dst_at in (16, 18):
            _gather_blocks[(1, -(-words // tile))](source, scratch, ids, dst_at, words,
                                                  TILE=tile, num_warps=warps)
        torch.cuda.synchronize(device)


def _tile(words: int, shape: str) -> int:
    """Words one program of ``shape`` (SHAPES) copies: the next power of 2, at most its
    tile."""
    return min(SHAPES[shape][0], _next_power_of_2(words))


def _head_tile(rows: int, width: int, tile_words: int) -> tuple:
    """(token rows, words of a row) one program of the head kernel copies: a row's slice
    whole, padded to a power of 2, up to ``tile_words``, and as many rows as fill the rest."""
    words = min(tile_words, _next_power_of_2(width))
    return min(max(1, tile_words // words), _next_power_of_2(rows)), words


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
