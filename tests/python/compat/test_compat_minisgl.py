"""radixkv.compat.minisgl: mini-SGLang's prefix-cache interface (kvcache/base.py
of its current tree: MatchResult, InsertResult, handles with
get_matched_indices, create_prefix_cache), written from its documented
behaviour, and driven the way its scheduler's cache_req drives it."""

import pytest
import torch

from radixkv import OutOfCapacityError
from radixkv.compat.minisgl import (
    InsertResult,
    MatchResult,
    NaivePrefixCache,
    RadixPrefixCache,
    SizeInfo,
    create_prefix_cache,
)


@pytest.mark.parametrize("page", [1, 4])
def test_match_insert_lock_evict_as_documented(page):
    c = create_prefix_cache("cpu", "radix", page_size=page)
    assert isinstance(c, RadixPrefixCache)
    ids = torch.arange(10, dtype=torch.int32)
    m = c.match_prefix(ids)
    assert isinstance(m, MatchResult) and m.cuda_handle.cached_len == 0
    assert m.cuda_handle.get_matched_indices().numel() == 0
    r = c.insert_prefix(ids, torch.arange(100, 110, dtype=torch.int32))
    assert isinstance(r, InsertResult)
    whole = 10 - 10 % page
    assert r.cached_len == 0 and r.handle.cached_len == whole  # aligned down to pages
    assert c.size_info == SizeInfo(evictable_size=whole, protected_size=0)
    longer = torch.arange(14, dtype=torch.int32)
    r2 = c.insert_prefix(longer, torch.arange(200, 214, dtype=torch.int32))
    assert r2.cached_len == whole  # already cached: the caller frees its copies
    h = c.match_prefix(longer).cuda_handle
    assert h.get_matched_indices().tolist() == (
        list(range(100, 100 + whole)) + list(range(200 + whole, 214 - 14 % page))
    )
    c.lock_handle(h)
    assert c.size_info.protected_size == h.cached_len and c.size_info.evictable_size == 0
    assert c.evict(0).numel() == 0
    with pytest.raises(OutOfCapacityError):  # a RuntimeError, as documented
        c.evict(1)
    c.lock_handle(h, unlock=True)
    assert len(c.evict(h.cached_len)) == h.cached_len
    assert c.size_info.total_size == 0
    c.check_integrity()
    c.insert_prefix(ids, torch.arange(10, dtype=torch.int32))
    c.reset()
    assert c.size_info.total_size == 0


def test_the_schedulers_cache_req_frees_exactly_its_duplicates():
    """mini-SGLang's CacheManager.cache_req: free [old.cached_len, cached_len)
    and, when finished, [new.cached_len, :) -- nothing leaks, nothing twice."""
    page, pages = 4, 16
    c = create_prefix_cache("cpu", "radix", page_size=page)
    free = set(range(pages * page))

    def serve(ids):
        h = c.match_prefix(ids[:-1]).cuda_handle
        c.lock_handle(h)
        own = sorted(free)[: len(ids) - h.cached_len]
        free.difference_update(own)
        table = torch.cat([h.get_matched_indices(), torch.tensor(own, dtype=torch.int32)])
        cached_len, new = c.insert_prefix(ids, table)
        c.lock_handle(h, unlock=True)
        free.update(table[h.cached_len : cached_len].tolist())
        free.update(table[new.cached_len :].tolist())

    a = torch.arange(18, dtype=torch.int32)
    serve(a), serve(a), serve(torch.cat([a, torch.arange(50, 55, dtype=torch.int32)]))
    assert len(free) + c.size_info.total_size == pages * page
    c.check_integrity()


def test_naive_cache_and_errors():
    n = create_prefix_cache("cpu", "naive")
    assert isinstance(n, NaivePrefixCache)
    r = n.insert_prefix(torch.arange(8), torch.arange(8))
    assert r.cached_len == 0 and r.handle.cached_len == 0
    assert n.match_prefix(torch.arange(8)).cuda_handle.get_matched_indices().numel() == 0
    with pytest.raises(ValueError, match="type must be one of"):
        create_prefix_cache("cpu", "lru")
    c = create_prefix_cache("cpu", "radix")
    with pytest.raises(TypeError, match="handle"):
        c.lock_handle(object())
    with pytest.raises(ValueError, match="indices"):
        c.insert_prefix(torch.arange(4), torch.arange(3))
    assert c.size_info.total_size == 0
