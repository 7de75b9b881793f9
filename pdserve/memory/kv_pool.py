"""Paged K/V storage for the full-attention layers."""

from __future__ import annotations

import heapq

import torch

from pdserve.config import ModelConfig


class KvPagePool:
    """`kv`: [num_attn_layers, 2, num_pages, page_size, Hkv, D], one tensor for every layer.

    Pages are handed out lowest first (a heap), so a request's block table tends to be runs of
    consecutive pages: a transfer then moves one block per run instead of one per page. A page
    is reference-counted: the prefix cache and the requests reusing a cached prefix share it,
    and it returns to the free heap when its last holder frees it.
    """

    def __init__(
        self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if num_pages <= 0:
            raise ValueError("a KV pool needs at least one page")
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (len(cfg.attn_layer_ids), 2, num_pages, *cfg.kv_page_shape(page_size))
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_pages))  # a heap
        self._refs = [0] * num_pages

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        per_layer = 2 * page_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
        return len(cfg.attn_layer_ids) * per_layer

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool has {len(self._free)} free pages, {n} requested")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of `pages` (all must be allocated)."""
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"KV page {page} is not allocated; it cannot be shared")
            self._refs[page] += 1

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page `src` into page `dst` (every layer, K and V): copy-on-write of a shared
        page that its new holder will write into."""
        self.kv[:, :, dst].copy_(self.kv[:, :, src])

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def free(self, pages: list[int]) -> None:
        """One holder fewer for each page; a page nobody holds goes back to the free heap."""
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"KV page {page} freed twice")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                heapq.heappush(self._free, page)
