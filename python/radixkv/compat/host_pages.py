"""Which named pages radixkv's host tier holds, for an engine that names its
blocks itself (vLLM: a chain hash per block, so a name stands for its whole
prefix): exact LRU over the names, pages pinned while a step that reads or
writes them is being planned. The index lives where the engine schedules;
the memory (a `HostKVCache`) lives where the engine computes, and the two
agree through the page numbers the scheduler sends with each step."""

from __future__ import annotations

import collections
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from radixkv._checks import as_count


class HostPageIndex:
    """Names -> host pages [0, num_pages), least recently used first."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = as_count(num_pages, "num_pages")
        self._pages: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._free: List[int] = list(range(self.num_pages - 1, -1, -1))
        self._pins: Dict[int, int] = {}
        self._dropped: set = set()  # pages of forgotten names, free once unpinned
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, name: str) -> Optional[int]:
        """The page holding `name`, now the most recently used; None if none."""
        page = self._pages.get(name)
        if page is not None:
            self._pages.move_to_end(name)
        return page

    def run(self, names: List[str]) -> int:
        """How many of `names`, from the first, the host holds."""
        count = 0
        for name in names:
            if self.get(name) is None:
                break
            count += 1
        return count

    def take(self, name: str) -> Optional[int]:
        """A page for `name`, pinned: the one it has, a free one, or the least
        recently used unpinned one (its name forgotten). None when every page
        is pinned."""
        page = self.get(name)
        if page is None:
            page = self._free.pop() if self._free else self._evict()
            if page is None:
                return None
            self._pages[name] = page
        self.pin(page)
        return page

    def _evict(self) -> Optional[int]:
        for victim, page in self._pages.items():
            if not self._pins.get(page):
                del self._pages[victim]
                self.evictions += 1
                return page
        return None

    def pinned(self) -> int:
        """How many pages are pinned."""
        return len(self._pins)

    def pin(self, page: int) -> None:
        self._pins[page] = self._pins.get(page, 0) + 1

    def unpin(self, pages: Iterable[int]) -> None:
        for page in pages:
            left = self._pins[page] - 1
            if left:
                self._pins[page] = left
            else:
                del self._pins[page]
                if page in self._dropped:
                    self._dropped.discard(page)
                    self._free.append(page)

    def drop(self, name: str, page: int) -> None:
        """Forgets `name` if it is still on `page` (its bytes proved bad)."""
        if self._pages.get(name) == page:
            del self._pages[name]
            if self._pins.get(page):
                self._dropped.add(page)  # a step being planned still names it
            else:
                self._free.append(page)


class HostBlocks:
    """An engine's per-layer caches of blocks, and radixkv's host pages that
    each hold one whole block of every layer (the worker side): copies of
    blocks to and from host pages, and of one block to and from a flat page.

    `kv_caches` maps layer names to tensors with one dimension of
    `num_blocks` blocks (vLLM's `[2, blocks, ...]` takes dimension 1)."""

    def __init__(self, kv_caches: Dict[str, torch.Tensor], num_blocks: int) -> None:
        num_blocks = as_count(num_blocks, "num_blocks")
        layers, dtypes = [], set()
        for name, t in kv_caches.items():
            dims = [d for d in range(t.dim()) if t.shape[d] == num_blocks]
            if t.dim() >= 2 and t.shape[0] == 2 and 1 in dims:
                dims = [1]  # vLLM's [2 (K, V), blocks, ...]
            if len(dims) != 1:
                raise ValueError(
                    f"kv_caches: cannot find the block dimension of layer "
                    f"{name}'s cache {tuple(t.shape)} ({num_blocks} blocks)"
                )
            layers.append((t, dims[0]))
            dtypes.add(t.dtype)
        if not layers:
            raise ValueError("kv_caches: no layer")
        if len(dtypes) != 1:
            raise ValueError(f"kv_caches: needs one K/V dtype, got {dtypes}")
        self.layers: List[Tuple[torch.Tensor, int]] = layers
        self.dtype: torch.dtype = dtypes.pop()
        self.page_elems = sum(t.select(d, 0).numel() for t, d in layers)
        self.rows: Optional[torch.Tensor] = None  # [host pages, page elements]

    def open_host(self, num_pages: int) -> None:
        """Allocates `num_pages` host pages (pinned where CUDA is)."""
        num_pages = as_count(num_pages, "num_pages")
        # Lazy: kvcache pulls in the pools, which a scheduler-only import needs not.
        from radixkv.kvcache.host_pool import HostKVCache
        from radixkv.kvcache.mha_pool import MHAKVCache

        shape = MHAKVCache(
            1, 1, self.page_elems // 2, 1, self.dtype, page_size=1, device="cpu", tp_size=1
        )
        self.host = HostKVCache(shape, num_pages=num_pages, layout="page_first")
        self.rows = self.host.kv_buffer.view(num_pages, self.page_elems)

    def block(self, b: int) -> List[torch.Tensor]:
        """Block b of every layer, as views."""
        return [t.select(d, b) for t, d in self.layers]

    def _by_layer(self, block_ids: List[int], pages: List[int]):
        """Per layer: its cache, block dimension and columns of a host page,
        with the blocks and host pages as index tensors."""
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0][0].device)
        rows = torch.tensor(pages, dtype=torch.long)
        at = 0
        for t, d in self.layers:
            n = t.select(d, 0).numel()
            yield t, d, blocks, rows, slice(at, at + n)
            at += n

    def to_host(self, block_ids: List[int], pages: List[int]) -> None:
        """Blocks -> host pages, a layer at a time; done when it returns."""
        host = self.rows
        if host is None:
            raise RuntimeError("HostBlocks: no host pages (open_host makes them)")
        for t, d, blocks, rows, cols in self._by_layer(block_ids, pages):
            part = t.index_select(d, blocks).movedim(d, 0).reshape(len(pages), -1)
            host[rows, cols] = part.cpu()

    def from_host(self, pages: List[int], block_ids: List[int]) -> None:
        """Host pages -> blocks, a layer at a time. Each layer's pages are
        gathered into a fresh host tensor first, so the host pages may be
        reused as soon as it returns; on a GPU the copies are ordered on the
        current stream, before the forward pass that reads the blocks."""
        host = self.rows
        if host is None:
            raise RuntimeError("HostBlocks: no host pages (open_host makes them)")
        for t, d, blocks, rows, cols in self._by_layer(block_ids, pages):
            part = host[rows, cols].view(len(pages), *t.select(d, 0).shape)
            t.index_copy_(d, blocks, part.to(t.device, non_blocking=True).movedim(0, d))

    def copy_in(self, page: torch.Tensor, block: int) -> None:
        """A flat page -> block `block` of every layer."""
        at = 0
        for view in self.block(block):
            view.copy_(page[at : at + view.numel()].view(view.shape))
            at += view.numel()

    def copy_out(self, block: int, page: torch.Tensor) -> None:
        """Block `block` of every layer -> a flat page."""
        at = 0
        for view in self.block(block):
            page[at : at + view.numel()].view(view.shape).copy_(view)
            at += view.numel()
