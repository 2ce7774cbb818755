"""A request's inputs at the cache's request steps: their checks, their
shapes, and the split of a flat batch.

The native request steps (`cpp/include/radixkv/request_steps.h`) check a
request's end for the radix tree in C++; `check_request` and `check_batch`
are the same checks, with the same messages, for a prefix cache that has no
native tree (the naive cache). The rest shape what CacheManager hands a step
(`host_batch`, `host_flat`, `page_counts` of an allocation, `check_handle`
of a load) and split a flat batch's slots into its requests, which the tail
of a flat finish (KV events, write_through) reads per request. A request's
indices cover its tokens in order: its handle's `cached_len` slots (the
cache's, from its match), then its own, in whole pages."""

from __future__ import annotations

from typing import List, Tuple

import torch

from radixkv._checks import as_count, as_int, as_int32, int32_tensor, per_input, to_host
from radixkv.kvcache.base import BaseCacheHandle


def length(values) -> int:
    """len() of a checked 1-D input; a tensor's own len() is a Python call."""
    return values.shape[0] if isinstance(values, torch.Tensor) else len(values)


def page_counts(sizes, page_size: int) -> List[int]:
    """The pages each token count of `sizes` (a list or tuple) needs; a bad
    count raises, naming `sizes[i]`."""
    if not isinstance(sizes, (list, tuple)):
        raise TypeError(
            f"sizes must be a list or tuple of token counts, got {type(sizes).__name__}"
        )
    pages = []
    for i, x in enumerate(sizes):
        pages.append(-(-as_count(x, f"sizes[{i}]", minimum=0) // page_size))
    return pages


def whole_sizes(input_ids, page_size: int, pages: bool = False) -> List[int]:
    """Each request's slots: its input_ids (checked 1-D inputs) in whole
    pages; with `pages`, the count of those pages (its page ids)."""
    per = 1 if pages else page_size
    return [-(-length(x) // page_size) * per for x in input_ids]


def check_handle(cache, handle, name: str) -> None:
    """`handle` (the argument `name`) is a live handle of `cache`'s."""
    if not isinstance(handle, BaseCacheHandle):
        raise TypeError(f"{name} must be a cache handle, got {type(handle).__name__}")
    if not cache.is_valid(handle):
        raise ValueError(f"{name} is stale or belongs to another cache manager")


def check_request(
    cache, old_handle, input_ids, indices, pages
) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """Checks a request's end before anything changes: `indices` cover
    `input_ids` in whole pages, `old_handle` is one of `cache`'s and locked,
    its cached part is the cache's slots and the rest are pages the request
    holds (of `pages`, a PageAllocator). Returns (input_ids, indices, n,
    cached_len), both sequences as CPU int32 tensors."""
    ids = int32_tensor(input_ids, "input_ids", cache.device)
    idx = int32_tensor(indices, "indices", cache.device)
    n, m = ids.shape[0], idx.shape[0]
    whole = -(-n // cache.page_size) * cache.page_size
    if m != whole:
        raise ValueError(
            f"indices has length {m} but must cover input_ids (length {n}) in whole pages "
            f"of {cache.page_size}: expected {whole}"
        )
    check_handle(cache, old_handle, "old_handle")
    if getattr(old_handle, "lock_count", 0) < 1:
        raise ValueError("old_handle is not locked: lock it after match_req")
    cached = old_handle.cached_len
    if cached > n:
        raise ValueError(f"old_handle covers {cached} tokens but input_ids has only {n}")
    if cached and not torch.equal(idx[:cached], cache.handle_slots(old_handle).cpu()):
        # Anything else there would be stored (or freed) as if it were the
        # cache's: a page could end up both free and cached.
        raise ValueError(
            f"indices[:{cached}] must be the cache's slots that match_req returned with old_handle"
        )
    pages.check_owned(idx[cached:], "indices", cache.tree)
    return ids, idx, n, cached


def check_batch(cache, batch, priority, pages, what: str = "batch") -> List[int]:
    """Checks a batch of (old_handle, input_ids, indices): each request alone
    (`check_request`, its priority an int32), then together: no page held
    by two, no handle finished more often than it is locked. Errors name
    request i as `what[i]`. Returns each request's priority."""
    priorities = per_input(priority, len(batch), "priority") or [priority] * len(batch)
    uses: dict = {}
    held: dict = {}  # page -> the request holding it
    ps = cache.page_size
    for i, (handle, ids, indices) in enumerate(batch):
        try:
            _, idx, _, cached = check_request(cache, handle, ids, indices, pages)
            priorities[i] = as_int32(priorities[i], "priority")
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what}[{i}] {e}") from None
        uses[id(handle)] = uses.get(id(handle), 0) + 1
        if uses[id(handle)] > handle.lock_count:
            raise ValueError(
                f"{what}[{i}] old_handle appears {uses[id(handle)]} times in the batch but "
                f"holds {handle.lock_count} locks"
            )
        for page in (idx[cached::ps] // ps).tolist():
            j = held.setdefault(page, i)
            if j != i:
                raise ValueError(
                    f"{what}[{j}] indices and {what}[{i}] indices both hold page {page}"
                )
    return priorities


def host_batch(batch, device: torch.device, name: str = "indices") -> list:
    """A batch of (old_handle, input_ids, indices) with each sequence on the
    host (`to_host`), its shape checked (TypeError naming `batch[i]`).
    `name`: the third entry's (`page_ids` for the page forms)."""
    if not isinstance(batch, (list, tuple)):
        raise TypeError(
            f"batch must be a list or tuple of (old_handle, input_ids, {name}), got "
            f"{type(batch).__name__}"
        )
    for i, item in enumerate(batch):
        if not isinstance(item, tuple) or len(item) != 3:
            raise TypeError(
                f"batch[{i}] must be a tuple (old_handle, input_ids, {name}), got "
                f"{type(item).__name__}"
            )
    return [
        (
            handle,
            to_host(ids, f"batch[{i}] input_ids", device),
            to_host(indices, f"batch[{i}] {name}", device),
        )
        for i, (handle, ids, indices) in enumerate(batch)
    ]


def host_flat(handles, input_ids, indices, own, device: torch.device, name: str = "indices"):
    """A flat batch's (input_ids, indices, own) on the host, `handles` and
    `input_ids` checked to be lists or tuples of one length. `name`:
    `indices`' (`page_ids` for the page form)."""
    for arg, value in (("handles", handles), ("input_ids", input_ids)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{arg} must be a list or tuple, got {type(value).__name__}")
    if len(input_ids) != len(handles):
        raise ValueError(f"input_ids has {len(input_ids)} entries but handles has {len(handles)}")
    if device.type == "cpu":
        return input_ids, indices, own
    input_ids = [to_host(x, f"input_ids[{i}]", device) for i, x in enumerate(input_ids)]
    own = None if own is None else to_host(own, "own", device)
    return input_ids, to_host(indices, name, device), own


def flat_own_pages(handles, indices, own, page_size: int, pages: bool = False) -> int:
    """The pages a flat batch's requests held themselves (checked inputs):
    all of theirs but their handles' cached parts. `indices` and `own` hold
    slots, or with `pages` page ids."""
    cached = 0
    for handle in handles:
        cached += handle.cached_len
    entries = length(indices) + (0 if own is None else length(own))
    if pages:
        return entries - cached // page_size
    return (entries - cached) // page_size


def joined(parts: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Slot tensors back to back in one (an empty int32 one for none)."""
    if not parts:
        return torch.empty(0, dtype=torch.int32, device=device)
    return torch.cat(parts)


def split_flat(
    input_ids, indices, handles, page_size: int, device: torch.device, pages: bool = False
) -> list:
    """(handle, input_ids, indices) of each request of a flat batch: request
    i's indices are the next `input_ids[i]` in whole pages (with `pages`,
    page ids: one a page); the length is checked as the native flat finish
    checks it."""
    sizes = whole_sizes(input_ids, page_size, pages)
    name, unit = ("page_ids", "pages") if pages else ("indices", "slots")
    indices = int32_tensor(indices, name, device)
    n = length(indices)
    if n != sum(sizes):
        raise ValueError(
            f"{name} has length {n} but the requests' input_ids need {sum(sizes)} {unit} "
            f"(each in whole pages of {page_size})"
        )
    return list(zip(handles, input_ids, torch.split(indices, sizes) if sizes else []))


def join_parts(
    handles, input_ids, cached, own, page_size: int, device, pages: bool = False
) -> torch.Tensor:
    """The flat indices of requests whose cached parts are `cached` and whose
    own pages are `own` (both back to back; with `pages`, page ids), checked
    as the native flat finish checks them."""
    name, unit = ("page_ids", "pages") if pages else ("indices", "slots")
    cached = int32_tensor(cached, name, device)
    own = int32_tensor(own, "own", device)
    hits = [
        as_int(getattr(h, "cached_len", 0), f"handles[{i}].cached_len")
        for i, h in enumerate(handles)
    ]
    sizes = whole_sizes(input_ids, page_size)
    for i, (hit, size) in enumerate(zip(hits, sizes)):
        if not 0 <= hit <= size:
            raise ValueError(
                f"request[{i}] old_handle covers {hit} tokens but request[{i}] input_ids "
                f"has only {length(input_ids[i])}"
            )
    if pages:  # (a handle covers whole pages)
        hits, sizes = [h // page_size for h in hits], [s // page_size for s in sizes]
    rest = [size - hit for hit, size in zip(hits, sizes)]
    if length(cached) != sum(hits):
        raise ValueError(
            f"{name} has length {length(cached)} but with own it holds the requests' "
            f"cached parts: {sum(hits)} {unit}"
        )
    if length(own) != sum(rest):
        raise ValueError(
            f"own has length {length(own)} but the requests' input_ids need {sum(rest)} "
            f"more {unit} than their cached parts (each in whole pages of {page_size})"
        )
    parts: list = [None] * (2 * len(handles))
    parts[0::2] = torch.split(cached, hits) if hits else []
    parts[1::2] = torch.split(own, rest) if rest else []
    return joined(parts, device)
