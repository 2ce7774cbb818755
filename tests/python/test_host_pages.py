"""HostPageIndex: the names radixkv's host tier holds for an engine that
names its blocks (the vLLM connector's scheduler side): exact LRU, pinned
pages never taken, dropped names' pages reused only once unpinned."""

import pytest

from radixkv.compat.host_pages import HostPageIndex


def test_free_pages_first_then_the_least_recently_used():
    index = HostPageIndex(3)
    pages = [index.take(n) for n in "abc"]
    assert sorted(pages) == [0, 1, 2]
    index.unpin(pages)
    assert index.get("a") == pages[0]  # "a" is now the most recent: "b" goes first
    d = index.take("d")
    assert d == pages[1] and index.get("b") is None and index.evictions == 1
    index.unpin([d])
    assert index.run(["a", "c", "d", "b", "a"]) == 3


def test_a_name_it_holds_keeps_its_page():
    index = HostPageIndex(2)
    p = index.take("a")
    index.unpin([p])
    assert index.take("a") == p and len(index) == 1


def test_pinned_pages_are_never_taken():
    index = HostPageIndex(2)
    a, b = index.take("a"), index.take("b")
    assert index.take("c") is None  # both pinned
    index.unpin([a])
    assert index.take("c") == a and index.get("a") is None
    index.pin(b)
    index.unpin([b])
    assert index.take("d") is None  # b still pinned once, c pinned by its take
    index.unpin([b])
    assert index.take("d") == b


def test_a_dropped_page_is_reused_once_unpinned():
    index = HostPageIndex(2)
    a, b = index.take("a"), index.take("b")
    index.unpin([b])
    index.drop("a", a)  # pinned: its page waits
    assert index.get("a") is None
    assert index.take("c") == b  # the only page that is free to take
    index.unpin([a])
    assert index.take("d") == a
    index.drop("c", a)  # "c" is not on that page: nothing happens
    assert index.get("c") == b


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="num_pages"):
        HostPageIndex(0)
    with pytest.raises(TypeError, match="num_pages"):
        HostPageIndex(2.0)
