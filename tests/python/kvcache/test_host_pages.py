"""HostPageIndex: the names radixkv's host tier holds for an engine that
names its blocks (the vLLM connector's scheduler side): pages pending until
their fill lands, exact LRU (or FIFO, LFU) over ready pages, pinned pages
never taken, dropped names' pages reused only once unpinned, per-group
bounds."""

import pytest

from radixkv.kvcache.host_pages import HostPageIndex


def _ready(index, *names, group=None):
    """Takes and fills a page for each name; returns the pages, unpinned."""
    pages = []
    for name in names:
        page = index.take(name, group)
        assert page is not None, name
        index.filled(page, True)
        index.unpin([page])
        pages.append(page)
    return pages


def test_free_pages_first_then_the_least_recently_used():
    index = HostPageIndex(3)
    pages = _ready(index, "a", "b", "c")
    assert sorted(pages) == [0, 1, 2]
    assert index.get("a") == pages[0]  # "a" is now the most recent: "b" goes first
    (d,) = _ready(index, "d")
    assert d == pages[1] and index.get("b") is None and index.evictions == 1
    assert index.take_evicted() == [pages[1]] and index.take_evicted() == []
    assert index.run(["a", "c", "d", "b", "a"]) == 3


def test_a_chain_is_given_up_from_its_tail():
    index = HostPageIndex(4)
    chain = _ready(index, "c0", "c1", "c2")  # taken head first
    index.used_chain(["c0", "c1", "c2"])
    x, y = _ready(index, "x", "y")
    assert y == chain[2] and index.run(["c0", "c1", "c2"]) == 2  # c2 went, its head stays
    index.used_chain(["c0", "c1"])
    (z,) = _ready(index, "z")
    assert z == x and index.run(["c0", "c1"]) == 2 and index.get("y") == y


def test_fifo_gives_up_the_oldest_whatever_was_used():
    index = HostPageIndex(2, policy="fifo")
    a, b = _ready(index, "a", "b")
    assert index.get("a") == a
    _ready(index, "c")
    assert index.page("a") is None and index.get("b") == b


def test_lfu_gives_up_the_least_used():
    index = HostPageIndex(3, policy="lfu")
    a, b, c = _ready(index, "a", "b", "c")
    for _ in range(3):
        index.get("a")
    index.get("c")
    (d,) = _ready(index, "d")
    assert d == b and index.get("b") is None
    (e,) = _ready(index, "e")  # d (0 uses) before c (1)
    assert e == d and index.get("c") == c and index.get("a") == a


def test_a_pending_page_is_no_hit_until_its_fill_lands():
    index = HostPageIndex(2)
    p = index.take("a")
    assert index.page("a") == p and index.get("a") is None and index.run(["a"]) == 0
    assert index.take("a") is None  # already has a page
    assert index.ready_pages == 0 and index.used == 1
    index.filled(p, True)
    assert index.get("a") == p and index.ready(p) and index.ready_pages == 1
    q = index.take("b")
    index.filled(q, False)  # its copy failed: the name is forgotten
    assert index.page("b") is None
    index.unpin([q])
    index.unpin([p])
    assert index.take("c") == q  # the failed page is free again; "a" stays
    assert index.get("a") == p


def test_pending_pages_are_never_given_up():
    index = HostPageIndex(1)
    p = index.take("a")
    index.unpin([p])  # unpinned, but its fill has not landed
    assert index.take("b") is None and index.page("a") == p


def test_pinned_pages_are_never_taken():
    index = HostPageIndex(2)
    a, b = _ready(index, "a", "b")
    index.pin(a)
    index.pin(b)
    assert index.take("c") is None and index.pinned() == 2
    index.unpin([a])
    c = index.take("c")
    assert c == a and index.get("a") is None
    index.pin(b)
    index.unpin([b])
    index.filled(c, True)
    index.unpin([c])
    index.get("c")  # b is now the least recent, but pinned once still
    assert index.take("d") == c
    index.unpin([b])


def test_a_dropped_page_is_reused_once_unpinned():
    index = HostPageIndex(2)
    a, b = _ready(index, "a", "b")
    index.pin(a)
    assert index.drop("a", a)  # pinned: its page waits
    assert index.get("a") is None and index.page("a") is None
    assert index.take("c") == b  # the only page that is free to take
    index.filled(b, True)
    index.unpin([b])
    index.unpin([a])
    assert index.take("d") == a
    assert not index.drop("c", a)  # "c" is not on that page: nothing happens
    assert index.get("c") == b


def test_a_group_at_its_bound_gives_up_its_own_pages():
    index = HostPageIndex(4, quotas={"t": 2})
    t1, t2 = _ready(index, "t1", "t2", group="t")
    (o1,) = _ready(index, "o1")
    (t3,) = _ready(index, "t3", group="t")  # a free page is left, but "t" is at 2
    assert t3 == t1 and index.page("o1") == o1 and index.used == 3
    index.pin(t2)
    index.pin(t3)
    assert index.take("t4", "t") is None  # its own pages are pinned: none for it
    assert index.page("o1") == o1
    index.unpin([t2, t3])


def test_clear_forgets_everything_and_returns_the_ready_pages():
    index = HostPageIndex(3)
    a, b = _ready(index, "a", "b")
    pending = index.take("c")
    assert sorted(index.clear()) == sorted([a, b])
    assert len(index) == 0 and index.get("a") is None
    index.unpin([pending])  # the fill that was running ends: its page comes back
    assert sorted(p for p in (index.take(n) for n in "xyz")) == [0, 1, 2]


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="num_pages"):
        HostPageIndex(0)
    with pytest.raises(TypeError, match="num_pages"):
        HostPageIndex(2.0)
    with pytest.raises(ValueError, match="policy must be one of lru, fifo, lfu"):
        HostPageIndex(2, policy="mru")
    with pytest.raises(ValueError, match=r"quotas\['t'\]"):
        HostPageIndex(2, quotas={"t": 0})
