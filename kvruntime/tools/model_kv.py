"""The demo's model and its KV as kvruntime pages (needs torch and Hugging Face transformers).

A small Llama-style decoder (RoPE, GQA: 8 query heads over 4 KV heads) built from a config with a
fixed seed: real attention with deterministic weights, nothing downloaded. Its cache after a
prompt (``past_key_values``, per layer K and V of ``[batch, kv heads, tokens, head_dim]``) is
written into a paged ``KVCache`` at the blocks an allocator chose, and rebuilt from such pages
into the model's own cache type: per layer and K/V, block ``b`` holds ``[token][head][head_dim]``
(layout.py: region ``2 * layer + kv`` of a per_layer cache, or ``[layer][kv]`` inside each block
of a cross_layer one), so a rank's head slice is a range of the innermost-but-one dimension.
"""

from __future__ import annotations

import hashlib
import random

from ..layout import CROSS_LAYER, KVLayout

# The model's config: sizes chosen so that a CPU process builds it and runs a prompt in well
# under a second (data: the demo changes nothing else about the model). Weights drawn with
# transformers' default spread (0.02) make every step's argmax the same token whatever the
# context; at 0.1 the tokens follow the KV (a cache with two blocks swapped continues otherwise).
MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=16,
             max_position_embeddings=1024, initializer_range=0.1)
DTYPE = "float32"  # the weights' and the KV's: every byte of the cache is compared as it came


def build(seed: int, device: str):
    """The model with weights from ``seed`` (made on the CPU, so every device gets the same
    ones), in eval mode on ``device`` (e.g. "cpu", "cuda:1")."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).eval()
    model.kv_descriptor = descriptor(model)
    return model.to(device)


def descriptor(model) -> dict:
    """What a prefill and a decode must share (kvruntime's ``Options.app``): the config and a
    digest of the weights, so another seed is refused at the handshake as another config is."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return {"model": type(model).__name__, **{k: getattr(model.config, k) for k in MODEL},
            "dtype": DTYPE, "weights_sha256": digest.hexdigest()[:32]}


def prompt(tokens: int, seed: int) -> list[int]:
    """The prompt's token ids: fixed by ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(MODEL["vocab_size"]) for _ in range(tokens)]


def kv_layout(kind: str, num_blocks: int, tp_size: int = 1, tokens_per_block: int = 16
              ) -> KVLayout:
    """One TP rank's paged cache of the model's KV (its heads split evenly over ``tp_size``)."""
    return KVLayout(kind, MODEL["num_hidden_layers"], num_blocks, tokens_per_block,
                    MODEL["num_key_value_heads"] // tp_size, MODEL["head_dim"], DTYPE, tp_size)


class BlockAllocator:
    """A free list of block ids in an order fixed by ``seed``, as a busy engine's would be:
    the blocks a request gets are scattered, and two allocators of other seeds hand out other
    ids."""

    def __init__(self, num_blocks: int, seed: int):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, count: int) -> list[int]:
        if count > len(self.free):
            raise ValueError(f"{count} blocks asked, {len(self.free)} free")
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def page_tensors(layout: KVLayout, device: str) -> list:
    """One zeroed tensor per region of ``layout`` on ``device``, shaped as its pages
    (``KVCache.from_tensors`` registers them: host tensors as DRAM, device ones as VRAM)."""
    import torch

    t, h, d = layout.tokens_per_block, layout.num_kv_heads, layout.head_dim
    if layout.kind == CROSS_LAYER:
        shapes = [(layout.num_blocks, layout.num_layers, 2, t, h, d)]
    else:
        shapes = [(layout.num_blocks, t, h, d)] * layout.num_regions
    return [torch.zeros(s, dtype=getattr(torch, DTYPE), device=device) for s in shapes]


def pages(tensors: list, layout: KVLayout, layer: int, kv: int):
    """``[block][token][head][head_dim]`` of one layer's K (kv 0) or V (kv 1): a view."""
    if layout.kind == CROSS_LAYER:
        return tensors[0][:, layer, kv]
    return tensors[2 * layer + kv]


def write_kv(tensors: list, layout: KVLayout, past, blocks: list[int],
             heads: tuple[int, int]) -> None:
    """The model's cache ``past`` (heads ``heads`` of it: a TP rank's) into ``blocks``."""
    import torch

    tpb = layout.tokens_per_block
    index = torch.tensor(blocks, device=tensors[0].device)
    for layer, cached in enumerate(past.layers):
        for kv, full in enumerate((cached.keys, cached.values)):
            x = full[0, heads[0]:heads[1]].permute(1, 0, 2)  # [token][head][head_dim]
            padded = x.new_zeros((len(blocks) * tpb, *x.shape[1:]))
            padded[:x.shape[0]] = x
            pages(tensors, layout, layer, kv)[index] = padded.view(len(blocks), tpb,
                                                                   *x.shape[1:])


def read_kv(ranks: list, tokens: int):
    """The model's cache of ``tokens`` tokens from pages: ``ranks``, one ``(tensors, layout,
    blocks)`` a TP rank in head order, their heads side by side."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    layers = ranks[0][1].num_layers
    for layer in range(layers):
        kv = []
        for which in (0, 1):
            parts = []
            for tensors, layout, blocks in ranks:
                index = torch.tensor(blocks, device=tensors[0].device)
                got = pages(tensors, layout, layer, which)[index]
                parts.append(got.reshape(-1, *got.shape[2:])[:tokens])
            # [token][head][head_dim] -> [1][head][token][head_dim], strides as the model's own
            kv.append(torch.cat(parts, dim=1).permute(1, 0, 2).unsqueeze(0))
        cache.update(kv[0], kv[1], layer)
    return cache


def run_prompt(model, ids: list[int]):
    """The prefill: (the model's cache, the first generated token, its logits)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=True)
    logits = out.logits[0, -1]
    return out.past_key_values, int(logits.argmax()), logits


def generate(model, cache, first: int, steps: int):
    """Greedy decode of ``steps`` tokens after ``first`` on ``cache``: (tokens, each step's
    logits stacked, on the CPU)."""
    import torch

    tokens, logits, token = [], [], first
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[token]], device=model.device),
                        past_key_values=cache, use_cache=True)
            step = out.logits[0, -1]
            token = int(step.argmax())
            tokens.append(token)
            logits.append(step)
    return tokens, torch.stack(logits).cpu()
