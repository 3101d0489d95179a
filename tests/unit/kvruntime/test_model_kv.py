"""The demo's model and its pages (tools/model_kv.py), in one process: the KV of a prompt written
into pages and read back continues the generation bit for bit, on both layouts and split over
TP ranks; a block missing changes the tokens (so the demo's comparison can fail)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvruntime.tools import model_kv  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return model_kv.build(0, "cpu")


def paged(past, kind, tp, blocks, tokens):
    ranks = []
    for rank in range(tp):
        layout = model_kv.kv_layout(kind, 16, tp)
        tensors = model_kv.page_tensors(layout, "cpu")
        heads = layout.num_kv_heads
        model_kv.write_kv(tensors, layout, past, blocks, (rank * heads, (rank + 1) * heads))
        ranks.append((tensors, layout, blocks))
    return ranks


@pytest.mark.parametrize("kind", ["cross_layer", "per_layer"])
@pytest.mark.parametrize("tp", [1, 2])
def test_pages_continue_the_generation_bit_for_bit(model, kind, tp):
    ids = model_kv.prompt(37, 3)
    past, first, _ = model_kv.run_prompt(model, ids)
    ranks = paged(past, kind, tp, [9, 2, 14], len(ids))
    rebuilt = model_kv.read_kv(ranks, len(ids))
    ref_tokens, ref_logits = model_kv.generate(model, model_kv.run_prompt(model, ids)[0],
                                               first, 8)
    tokens, logits = model_kv.generate(model, rebuilt, first, 8)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    # one block that never arrived (block 5: zeros): other tokens. (Blocks read in another
    # order would not do: attention sums over a set of keys, each carrying its position.)
    lost = [(t, lay, [9, 5, 14]) for t, lay, _ in ranks]
    other, _ = model_kv.generate(model, model_kv.read_kv(lost, len(ids)), first, 8)
    assert other != ref_tokens


def test_the_descriptor_tells_weights_apart(model):
    other = model_kv.build(1, "cpu")
    assert model.kv_descriptor["weights_sha256"] != other.kv_descriptor["weights_sha256"]
    assert {k: v for k, v in model.kv_descriptor.items() if k != "weights_sha256"} == {
        k: v for k, v in other.kv_descriptor.items() if k != "weights_sha256"}
    assert model_kv.build(0, "cpu").kv_descriptor == model.kv_descriptor


def test_the_allocators_hand_out_scattered_and_different_blocks():
    a, b = model_kv.BlockAllocator(64, 1), model_kv.BlockAllocator(64, 2)
    first = a.take(3)
    assert first != b.take(3) and first != sorted(first) and a.take(3) != first
    with pytest.raises(ValueError, match="59 blocks asked, 58 free"):
        a.take(59)
