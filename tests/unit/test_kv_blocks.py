import pytest
import torch

from llumnix.engine.kv_blocks import KVBlockCopier


def make_caches(num_layers: int = 3, kernel_blocks: int = 16, page=(2, 32, 64), dtype=torch.float32,
                strided: bool = False) -> dict[str, torch.Tensor]:
    """Per-layer `[blocks, kv_heads, block_tokens, content]` views, as vLLM hands them to a connector.
    `strided` lays the layers out block-major in one buffer (vLLM's BLHNC), so each view is strided."""
    generator = torch.Generator().manual_seed(0)
    if strided:
        backing = torch.randn((kernel_blocks, num_layers, *page), generator=generator).to(dtype)
        return {f"layer.{i}": backing[:, i] for i in range(num_layers)}
    return {f"layer.{i}": torch.randn((kernel_blocks, *page), generator=generator).to(dtype)
            for i in range(num_layers)}


@pytest.mark.parametrize("strided", [False, True])
def test_copy_out_gathers_blocks_in_order_layer_major(strided):
    caches = make_caches(strided=strided)
    copier = KVBlockCopier(caches, num_blocks=16)
    out = copier.copy_out([5, 2, 9])
    assert out.shape == (3, 3, 2, 32, 64) and out.is_contiguous()
    for layer_index, cache in enumerate(caches.values()):
        assert torch.equal(out[layer_index, 0], cache[5])
        assert torch.equal(out[layer_index, 1], cache[2])
        assert torch.equal(out[layer_index, 2], cache[9])


@pytest.mark.parametrize("strided", [False, True])
def test_round_trip_into_other_blocks_of_another_cache(strided):
    source = make_caches(strided=strided)
    destination = {name: torch.zeros_like(t) for name, t in make_caches(strided=strided).items()}
    buffer = KVBlockCopier(source, 16).copy_out([1, 2, 3])
    dst_copier = KVBlockCopier(destination, 16)
    dst_copier.copy_in([10, 4, 7], buffer)
    for name in source:
        assert torch.equal(destination[name][10], source[name][1])
        assert torch.equal(destination[name][4], source[name][2])
        assert torch.equal(destination[name][7], source[name][3])
        untouched = [b for b in range(16) if b not in (10, 4, 7)]
        assert not destination[name][untouched].any()
    assert torch.equal(dst_copier.copy_out([10, 4, 7]), buffer)


def test_scheduler_block_spanning_two_kernel_blocks():
    caches = make_caches(num_layers=2, kernel_blocks=16, page=(2, 16, 64))
    copier = KVBlockCopier(caches, num_blocks=8)
    assert copier.layout.kernel_blocks_per_block == 2
    out = copier.copy_out([3])
    assert out.shape == (2, 2, 2, 16, 64)
    assert torch.equal(out[0, 0], caches["layer.0"][6]) and torch.equal(out[0, 1], caches["layer.0"][7])


def test_bf16_layout_and_bytes_per_block():
    copier = KVBlockCopier(make_caches(num_layers=4, dtype=torch.bfloat16), num_blocks=16)
    layout = copier.layout
    assert layout.dtype == "bfloat16" and layout.page_shape == (2, 32, 64)
    assert layout.bytes_per_block == 4 * 2 * 32 * 64 * 2
    assert copier.copy_out([0]).dtype == torch.bfloat16


def test_preallocated_out_buffer_is_filled_in_place():
    caches = make_caches()
    copier = KVBlockCopier(caches, 16)
    staging = torch.empty(copier.buffer_shape(2))
    result = copier.copy_out([0, 15], out=staging)
    assert result.data_ptr() == staging.data_ptr()
    assert torch.equal(staging[2, 1], caches["layer.2"][15])


def test_bad_inputs_raise_clear_errors():
    copier = KVBlockCopier(make_caches(), 16)
    with pytest.raises(IndexError, match=r"\[0, 16\)"):
        copier.copy_out([16])
    with pytest.raises(ValueError, match="blocks need"):
        copier.copy_in([1, 2], torch.zeros(copier.buffer_shape(1)))
    with pytest.raises(ValueError, match="not a multiple"):
        KVBlockCopier(make_caches(), 5)
    mixed = make_caches()
    mixed["layer.1"] = mixed["layer.1"].to(torch.bfloat16)
    with pytest.raises(ValueError, match="mixed layouts"):
        KVBlockCopier(mixed, 16)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("chunk_blocks", [1, 2, 64])
def test_staged_parts_load_into_other_blocks_chunk_by_chunk(monkeypatch, device, strided, chunk_blocks):
    """Staged blocks (bytes as tcp stages them, uint8 tensors as gloo/NCCL do) land in the blocks given,
    whatever the chunking, on the cache's device; nothing else is touched."""
    source = {name: t.to(device) for name, t in make_caches(strided=strided, kernel_blocks=8).items()}
    destination = {name: torch.zeros_like(t) for name, t in source.items()}
    source_copier, dst_copier = KVBlockCopier(source, 8), KVBlockCopier(destination, 8)
    bytes_per_block = dst_copier.layout.bytes_per_block
    monkeypatch.setattr("llumnix.engine.kv_blocks.LOAD_CHUNK_BYTES", chunk_blocks * bytes_per_block)
    staged = source_copier.copy_out_block_major([1, 2, 3, 6, 0]).view(torch.uint8).cpu().reshape(5, -1)
    parts = [memoryview(bytearray(staged[0].numpy().tobytes())), staged[1].clone(), staged[2].to(device),
             bytearray(staged[3].numpy().tobytes()), staged[4].clone()]
    dst_copier.copy_in_parts([7, 4, 5, 0, 2], parts)
    for name in source:
        for target, origin in ((7, 1), (4, 2), (5, 3), (0, 6), (2, 0)):
            assert torch.equal(destination[name][target], source[name][origin])
        assert not destination[name][[1, 3, 6]].any()


def test_staged_parts_must_match_the_blocks_and_their_size():
    copier = KVBlockCopier(make_caches(kernel_blocks=8), 8)
    block = bytearray(copier.layout.bytes_per_block)
    with pytest.raises(ValueError, match="2 staged blocks for 1 block ids"):
        copier.copy_in_parts([0], [block, block])
    with pytest.raises(ValueError, match="a staged block has 3 bytes"):
        copier.copy_in_parts([0], [bytearray(3)])
