"""A request's KV blocks out of, and into, an engine's paged KV cache (torch only, no vLLM import).

vLLM (>= 0.32) hands a KV connector one tensor per attention layer, viewed as
`[kernel_blocks, kv_heads, block_tokens, content]` (block axis first whatever the physical layout;
on CPU a head's `[block_tokens, 2 * head_dim]` slab is K transposed, then V). A scheduler block may
span several kernel blocks when the attention kernel wants smaller blocks than the scheduler; block
id `b` then covers kernel blocks `[b * k, (b + 1) * k)`.

A transfer buffer holds all layers of a set of blocks, layer-major:
`[layers, blocks * k, kv_heads, block_tokens, content]`, contiguous, so it can be sent as one message
and written back on an engine with the same `KVLayout` (checked by the migration handshake).
Migration stages use the block-major form `[blocks, layers, k, kv_heads, block_tokens, content]`
(`copy_out_block_major` / `copy_in_block_major`): each block's bytes (all layers) are contiguous, so
the destination can stage blocks one by one and a re-sent tail block replaces exactly its own bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

LOAD_CHUNK_BYTES = 128 << 20
"""Staged blocks go to the cache's device in chunks of at most this much (one block at least): a
bounded scratch, never a second copy of a whole request's KV on the device."""


@dataclasses.dataclass(frozen=True)
class KVLayout:
    layer_names: tuple[str, ...]
    num_blocks: int
    kernel_blocks_per_block: int
    # Shape of one kernel block of one layer: (kv_heads, block_tokens, content).
    page_shape: tuple[int, ...]
    dtype: str

    @property
    def bytes_per_block(self) -> int:
        """All layers of one scheduler block."""
        page = 1
        for dim in self.page_shape:
            page *= dim
        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return len(self.layer_names) * self.kernel_blocks_per_block * page * element

    def to_record(self) -> dict[str, object]:
        record = dataclasses.asdict(self)
        record["layer_names"] = list(self.layer_names)
        record["page_shape"] = list(self.page_shape)
        record["bytes_per_block"] = self.bytes_per_block
        return record


class KVBlockCopier:
    """Copies blocks between the engine's per-layer cache tensors and one contiguous buffer."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors to copy from")
        self._layers = tuple(kv_caches.values())
        first = self._layers[0]
        for name, tensor in kv_caches.items():
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise ValueError(
                    f"layer {name} has shape {tuple(tensor.shape)} {tensor.dtype}, the first layer "
                    f"{tuple(first.shape)} {first.dtype}: mixed layouts are not supported"
                )
        if num_blocks <= 0 or first.shape[0] % num_blocks:
            raise ValueError(
                f"{first.shape[0]} kernel blocks per layer is not a multiple of {num_blocks} blocks"
            )
        self.layout = KVLayout(
            layer_names=tuple(kv_caches),
            num_blocks=num_blocks,
            kernel_blocks_per_block=first.shape[0] // num_blocks,
            page_shape=tuple(first.shape[1:]),
            dtype=str(first.dtype).removeprefix("torch."),
        )

    def _kernel_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self._layers[0].device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_blocks):
            raise IndexError(f"block ids must lie in [0, {self.layout.num_blocks})")
        k = self.layout.kernel_blocks_per_block
        if k == 1:
            return ids
        return (ids[:, None] * k + torch.arange(k, device=ids.device)).reshape(-1)

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        layout = self.layout
        return (len(layout.layer_names), num_blocks * layout.kernel_blocks_per_block, *layout.page_shape)

    def copy_out(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks, in the order given, as one contiguous `buffer_shape(len(block_ids))` tensor."""
        index = self._kernel_index(block_ids)
        shape = self.buffer_shape(len(block_ids))
        if out is None:
            out = torch.empty(shape, dtype=self._layers[0].dtype, device=self._layers[0].device)
        elif tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {shape} tensor, not {tuple(out.shape)}")
        for layer, dst in zip(self._layers, out, strict=True):
            torch.index_select(layer, 0, index, out=dst)
        return out

    def copy_in(self, block_ids: Sequence[int], buffer: torch.Tensor) -> None:
        """Writes a `copy_out` buffer into the blocks given (same count, possibly other ids)."""
        index = self._kernel_index(block_ids)
        shape = self.buffer_shape(len(block_ids))
        if tuple(buffer.shape) != shape:
            raise ValueError(f"buffer is {tuple(buffer.shape)}, {len(block_ids)} blocks need {shape}")
        for layer, src in zip(self._layers, buffer, strict=True):
            layer.index_copy_(0, index, src.to(device=layer.device, dtype=layer.dtype))

    def block_major_shape(self, num_blocks: int) -> tuple[int, ...]:
        layout = self.layout
        return (num_blocks, len(layout.layer_names), layout.kernel_blocks_per_block, *layout.page_shape)

    def copy_out_block_major(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks, in the order given, as one contiguous `block_major_shape(len(block_ids))` tensor."""
        index = self._kernel_index(block_ids)
        shape = self.block_major_shape(len(block_ids))
        out = torch.empty(shape, dtype=self._layers[0].dtype, device=self._layers[0].device)
        for position, layer in enumerate(self._layers):
            out[:, position] = torch.index_select(layer, 0, index).view(shape[0], *shape[2:])
        return out

    def copy_in_block_major(self, block_ids: Sequence[int], buffer: torch.Tensor) -> None:
        """Writes a `copy_out_block_major` buffer into the blocks given (same count, possibly other ids)."""
        index = self._kernel_index(block_ids)
        shape = self.block_major_shape(len(block_ids))
        if tuple(buffer.shape) != shape:
            raise ValueError(f"buffer is {tuple(buffer.shape)}, {len(block_ids)} blocks need {shape}")
        kernel_blocks = shape[0] * shape[2]
        for position, layer in enumerate(self._layers):
            source = buffer[:, position].reshape(kernel_blocks, *shape[3:])
            layer.index_copy_(0, index, source.to(device=layer.device, dtype=layer.dtype))

    def copy_in_parts(self, block_ids: Sequence[int], parts: Sequence[Any]) -> None:
        """Writes staged blocks (one bytes-like or flat uint8 tensor per block id, block-major) into the
        blocks given. Each chunk of blocks is copied whole into a scratch on the cache's device, and
        only there split into layers: slicing layers out of a host buffer meant a strided host copy and
        a device transfer per layer (6.4 s for 8k tokens of LLaMA-7B KV on an H200 host, docs/gpu.md)."""
        if len(parts) != len(block_ids):
            raise ValueError(f"{len(parts)} staged blocks for {len(block_ids)} block ids")
        if not parts:
            return
        layout = self.layout
        per_chunk = min(len(parts), max(1, LOAD_CHUNK_BYTES // layout.bytes_per_block))
        scratch = torch.empty((per_chunk, layout.bytes_per_block), dtype=torch.uint8,
                              device=self._layers[0].device)
        for start in range(0, len(parts), per_chunk):
            chunk = parts[start:start + per_chunk]
            for row, part in zip(scratch, chunk, strict=False):
                if not isinstance(part, torch.Tensor):
                    part = torch.frombuffer(part, dtype=torch.uint8)
                if part.numel() != layout.bytes_per_block:
                    raise ValueError(f"a staged block has {part.numel()} bytes, not {layout.bytes_per_block}")
                row.copy_(part)
            buffer = scratch[:len(chunk)].view(getattr(torch, layout.dtype))
            self.copy_in_block_major(block_ids[start:start + len(chunk)],
                                     buffer.reshape(self.block_major_shape(len(chunk))))
