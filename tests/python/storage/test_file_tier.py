"""The file store as a restart-safe, bounded disk tier: its index gives up the
least recently used page that no stored page extends (checked against a
model), the start-up scan indexes only pages whose headers check out, the
order of use survives a restart, and a restarted engine gets its hits back
within a smaller bound with no suffix left without its prefix."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_env import PAGE, Instance, fingerprint, host_pool, keys, prompt

from radixkv.storage import FileStorage
from radixkv.storage.file import HEADER, OLD_MAGICS
from radixkv.storage.page_index import PageIndex

# -- the index against a model ------------------------------------------------------


class Model:
    """The index's rule written plainly: pages with a use order and a
    parent; past the bound, the least recently used page no page extends
    goes (with no such page, a cycle: parents are forgotten, every page is
    one)."""

    def __init__(self, limit):
        self.limit, self.pages, self.clock = limit, {}, 0

    def _now(self):
        self.clock += 1
        return self.clock

    def add(self, key, size, parent):
        if key in self.pages:
            self.pages[key][0], self.pages[key][1] = self._now(), size
        else:
            self.pages[key] = [self._now(), size, None if parent == key else parent]
        return self.trim()

    def touch(self, key):
        if key in self.pages:
            self.pages[key][0] = self._now()

    def trim(self):
        gone = []
        while sum(p[1] for p in self.pages.values()) > self.limit and self.pages:
            extended = {p[2] for p in self.pages.values()}
            leaves = [k for k in self.pages if k not in extended]
            if not leaves:
                for p in self.pages.values():
                    p[2] = None
                continue
            victim = min(leaves, key=lambda k: self.pages[k][0])
            del self.pages[victim]
            gone.append(victim)
        return gone


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "touch", "discard"]),
        st.integers(0, 11),  # the key
        st.integers(0, 12),  # the parent (12: none)
        st.integers(1, 3),  # the size
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 12), ops=OPS)
def test_the_index_gives_up_what_the_model_does(limit, ops):
    index, model = PageIndex(limit), Model(limit)
    assert index.complete() == []
    names = [bytes([i]) * 32 for i in range(13)]
    for op, k, p, size in ops:
        key = names[k]
        parent = names[p] if p < 12 else None  # present, given up, or never seen
        if op == "add":
            gone = index.add(key, size, parent)
            assert gone == model.add(key, size, parent)
        elif op == "touch":
            index.touch(key)
            model.touch(key)
        else:
            index.discard(key)
            model.pages.pop(key, None)
        assert set(model.pages) == {n for n in names if n in index}
        assert index.total == sum(p[1] for p in model.pages.values()) <= max(limit, 0)


def test_a_prefix_outlives_its_suffixes_however_recently_it_was_used():
    index = PageIndex(4)
    index.complete()
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    assert index.add(a, 1) == [] and index.add(b, 1, a) == [] and index.add(c, 1, b) == []
    assert index.add(d, 1) == []
    index.touch(d)  # a is the least recently used page, c the least recent leaf
    assert index.add(bytes([9]) * 32, 1) == [c]
    assert index.leaves_first() == [b, a, d, bytes([9]) * 32]


def test_nothing_is_given_up_before_the_scan_has_found_every_page():
    index = PageIndex(1)
    a, b = bytes([1]) * 32, bytes([2]) * 32
    assert index.add(b, 1, a, tick=20, if_absent=True) == []  # the suffix is found first
    assert index.add(a, 1, None, tick=10, if_absent=True) == []  # over the bound, kept
    assert index.add(a, 5, None, tick=30, if_absent=True) == []  # known: left as it is
    assert index.total == 2
    assert index.complete() == [b]  # the older prefix stays, its suffix goes


# -- the file store -----------------------------------------------------------------

PAGE_FILE = HEADER.size + host_pool().kv_buffer.numel() * 2 // 8


def bounded(path, pages):
    fs = FileStorage(str(path), fingerprint(), max_bytes=pages * PAGE_FILE)
    fs.attach(host_pool())
    assert fs.wait_indexed(30)
    return fs


def on_disk(fs, ks):
    return [os.path.exists(fs.path(k)) for k in ks]


def test_suffixes_go_before_their_prefixes_and_the_order_survives_a_restart(tmp_path):
    fs = bounded(tmp_path, 4)
    chain, other = keys(3, "chain"), keys(2, "other")
    assert fs.batch_set(chain, [0, 1, 2], parents=[None, chain[0], chain[1]]) == [True] * 3
    assert fs.batch_set(other[:1], [3]) == [True]
    assert fs.batch_get(chain[:1], [7]) == [True]  # the prefix is the most recently used
    assert fs.batch_set(other[1:], [4]) == [True]  # one over: the chain's last page goes
    assert on_disk(fs, chain + other) == [True, True, False, True, True]
    assert fs.removed_pages == 1 and fs.stored_bytes == 4 * PAGE_FILE
    fs.close()
    # Restarted with room for two: the scan finds the headers' parents, and the
    # modification times the reads renewed.
    again = bounded(tmp_path, 2)
    assert on_disk(again, chain + other) == [True, False, False, False, True]
    assert again.stored_bytes == 2 * PAGE_FILE and again.index_seconds is not None


def test_the_scan_indexes_only_pages_whose_headers_check_out(tmp_path):
    fs = bounded(tmp_path, 100)
    good = keys(6, "good")
    assert fs.batch_set(good, list(range(6)), parents=[None, *good[:-1]]) == [True] * 6
    fs.close()
    with open(fs.path(good[1]), "r+b") as f:  # another configuration's fingerprint
        f.seek(8 + 32 + 32)
        f.write(bytes(32))
    with open(fs.path(good[2]), "r+b") as f:  # truncated
        f.truncate(HEADER.size + 3)
    with open(fs.path(good[3]), "r+b") as f:  # a page of an earlier version
        f.write(OLD_MAGICS[0])
    os.replace(fs.path(good[4]), fs.path(good[0])[:-7] + "00.page")  # under another name
    stray = os.path.join(os.path.dirname(fs.path(good[0])), "notes.txt")
    open(stray, "w").close()
    again = bounded(tmp_path, 100)
    assert again.stored_bytes == 2 * PAGE_FILE  # good[0] and good[5]
    assert on_disk(again, good) == [True, False, False, False, False, True]
    assert again.corrupt_pages == 3 and again.removed_pages == 1  # the old page is no fault
    assert os.path.exists(stray)  # not a page's name: not ours to remove
    assert again.batch_get(good[5:], [0]) == [True]


def test_a_store_serves_while_its_scan_runs(tmp_path):
    fs = bounded(tmp_path, 1000)
    ks = keys(40)
    for i in range(0, 40, 8):
        fs.batch_set(ks[i : i + 8], list(range(8)))
    fs.close()
    again = FileStorage(str(tmp_path), fingerprint(), max_bytes=10 * PAGE_FILE)
    again.attach(host_pool())
    assert again.batch_get(ks[-1:], [0]) == [True]  # at once, scan or not (the newest stays)
    assert again.wait_indexed(30)
    assert again.stored_bytes == 10 * PAGE_FILE and sum(on_disk(again, ks)) == 10


def test_a_suffix_is_kept_when_the_store_gave_its_prefix_up(tmp_path):
    """A prefix the device or host keeps is never read from the store, so
    the store gives it up first; the suffixes written after it are still
    stored, and a request that matches the prefix on the device prefetches
    them."""
    probe = FileStorage(str(tmp_path / "probe"), fingerprint())
    probe.attach(host_pool())
    fs = FileStorage(str(tmp_path / "store"), fingerprint(), max_bytes=10 * probe.file_bytes)
    inst = Instance(fs, pages=8, host_pages=8)
    assert fs.wait_indexed(30)
    tier = inst.cm._tiers.storage
    hot = prompt(1, 2, tail=0)
    ask_hot = torch.cat([hot, torch.tensor([7], dtype=torch.int32)])
    inst.serve(ask_hot)
    for i in range(6):  # other traffic, the hot prefix kept on the device
        inst.serve(prompt(100 + i, 2))
        inst.serve(ask_hot)
    assert on_disk(fs, tier.keys_of(hot)) == [False, False]  # given up: never read
    both = torch.cat([hot, prompt(2, 2, tail=0), torch.tensor([9], dtype=torch.int32)])
    inst.serve(both)
    assert all(on_disk(fs, tier.keys_of(both)[2:]))  # the suffix is stored all the same
    for i in range(4):  # the suffix leaves device and host, the prefix stays
        inst.serve(prompt(200 + i, 2))
        inst.serve(ask_hot)
    device, _, fetched = inst.serve(both)
    assert device == 2 * PAGE and fetched == 2 * PAGE
    assert tier.counters().write_failures == 0
    inst.close()


def test_the_scan_leaves_pages_of_a_store_with_another_secret(tmp_path):
    plain = bounded(tmp_path, 100)
    ks = keys(3, "plain")
    assert plain.batch_set(ks, [0, 1, 2]) == [True] * 3
    keyed = FileStorage(str(tmp_path), fingerprint(), max_bytes=10**6, secret=b"s" * 16)
    assert keyed.wait_indexed(30)
    assert keyed.corrupt_pages == 0 and keyed.stored_bytes == 0
    assert on_disk(plain, ks) == [True] * 3


def test_a_page_file_out_of_its_place_is_removed_by_the_scan(tmp_path):
    fs = bounded(tmp_path, 100)
    k = keys(2, "placed")
    assert fs.batch_set(k, [0, 1]) == [True, True]
    fs.close()
    wrong_dir = os.path.join(fs.directory, "zz")
    os.mkdir(wrong_dir)
    misplaced = os.path.join(wrong_dir, os.path.basename(fs.path(k[0])))
    os.replace(fs.path(k[0]), misplaced)
    upper = os.path.join(os.path.dirname(fs.path(k[1])), k[1].upper() + ".page")
    os.replace(fs.path(k[1]), upper)
    again = bounded(tmp_path, 100)
    assert not os.path.exists(misplaced) and not os.path.exists(upper)
    assert again.stored_bytes == 0 and again.corrupt_pages == 2


def test_stores_sharing_a_directory_share_its_bound(tmp_path):
    """Two stores bound to 4 pages on one directory (two processes, or two
    in one): the directory holds 4 pages, and what goes is the least
    recently used page of either, one the other read since staying."""
    a, b = bounded(tmp_path, 4), bounded(tmp_path, 4)
    ka, kb = keys(3, "a"), keys(3, "b")
    assert a.batch_set(ka, [0, 1, 2]) == [True] * 3
    assert a.batch_get(ka[:1], [7]) == [True]  # a's first page is used last of a's
    assert b.batch_set(kb, [3, 4, 5]) == [True] * 3
    assert on_disk(a, ka + kb) == [True, False, False, True, True, True]
    assert b.stored_bytes == 4 * PAGE_FILE and b.removed_pages == 2
    kc = keys(2, "c")
    assert a.batch_set(kc, [6, 7]) == [True] * 2  # a knows b's pages: ka[0], then kb[0] go
    assert on_disk(a, ka[:1] + kb + kc) == [False, False, True, True, True, True]
    assert a.stored_bytes == 4 * PAGE_FILE


def test_a_journal_that_is_not_one_is_never_trusted_or_written_through(tmp_path):
    """The bound's journal is a file at a name anyone can compute: a link
    there is removed, never written through (the index comes from the scan
    and the journal is written again), and a record cut short by a writer
    that died is cut off."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    fs = bounded(tmp_path / "s", 4)
    k = keys(3)
    assert fs.batch_set(k, [0, 1, 2]) == [True] * 3
    fs.close()
    journal = os.path.join(fs.directory, "pages.journal")
    os.unlink(journal)
    os.symlink(outside, journal)
    again = bounded(tmp_path / "s", 4)
    assert outside.read_bytes() == b"keep" and not os.path.islink(journal)
    assert again.stored_bytes == 3 * PAGE_FILE
    with open(journal, "ab") as f:
        f.write(b"+" + bytes(10))  # a record cut short
    more = keys(2, "more")
    assert again.batch_set(more, [3, 4]) == [True, True]  # one over the bound: one goes
    assert sum(on_disk(again, k + more)) == 4
    third = FileStorage(str(tmp_path / "s"), fingerprint(), max_bytes=4 * PAGE_FILE)
    with third._journal:  # what the journal alone names, before any scan
        assert len(third._index) == 4 and third._journal.read_whole


def test_parents_must_match_the_keys(tmp_path):
    fs = bounded(tmp_path, 4)
    with pytest.raises(ValueError, match="parents"):
        fs.batch_set(keys(2), [0, 1], parents=[None])
    assert fs.stored_bytes == 0


# -- an engine restarted on its disk tier ---------------------------------------------


def test_a_restarted_engine_gets_its_hits_back_within_a_smaller_bound(tmp_path):
    prompts = [prompt(700 + i, 5) for i in range(6)]
    a = Instance(FileStorage(str(tmp_path), fingerprint(), max_bytes=64 * PAGE_FILE))
    assert a.cm._tiers.storage.backend.wait_indexed(30)
    for ids in prompts:
        a.serve(ids)
    a.evict_everything()
    for ids in prompts[:2]:  # the first two are read back from the store, last
        assert a.serve(ids)[2] == 5 * PAGE
    a.close()
    b_store = FileStorage(str(tmp_path), fingerprint(), max_bytes=12 * PAGE_FILE)
    b = Instance(b_store)
    assert b_store.wait_indexed(30) and b_store.stored_bytes <= 12 * PAGE_FILE
    tier = b.cm._tiers.storage
    for ids in prompts:
        present = on_disk(b_store, tier.keys_of(ids))
        # What is left of each prompt is a prefix: no suffix lost its prefix.
        assert present == sorted(present, reverse=True), present
    for ids in prompts[:2]:  # the pages used last came back whole
        assert all(on_disk(b_store, tier.keys_of(ids)))
        device, host, fetched = b.serve(ids)
        assert device == 0 and fetched == 5 * PAGE  # every row checked by serve()
    b.close()


def test_an_unbounded_store_is_not_scanned(tmp_path):
    fs = FileStorage(str(tmp_path), fingerprint())
    assert fs.wait_indexed(0) and fs.index_seconds is None and fs.stored_bytes == 0
    fs.attach(host_pool())
    assert fs.batch_set(keys(1), [0], parents=[None]) == [True]
    assert torch.equal(torch.tensor(on_disk(fs, keys(1))), torch.tensor([True]))
