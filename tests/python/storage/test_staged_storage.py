"""radixkv.storage.staged: the store the engine adapters share, staged
(StagedStorage) or over a host pool's own pages (HostPageIO)."""

import time

import pytest
import torch

from radixkv.storage import staged as staged_storage
from radixkv.kvcache.engine_pool import EngineKVPool
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.storage.staged import HostPageIO, StagedStorage, storage_options
from radixkv.storage import FileStorage, page_keys

FP = b"f" * 32


def _store(tmp_path, **options):
    return StagedStorage(
        {"backend": "file", "directory": str(tmp_path), **options}, FP, 64, torch.float32
    )


def test_pages_round_trip_and_exists_counts_from_the_first(tmp_path):
    s = _store(tmp_path)
    names = page_keys(list(range(4 * 40)), 4, b"s" * 32)  # 40 pages: two staging chunks
    assert s.write(names[:35], lambda i, page: page.fill_(i)) == [True] * 35
    assert s.exists(names) == 35 and s.exists(names[1:]) == 34 and s.exists([]) == 0
    got = {}

    def take(i, page):
        got[i] = None if page is None else page.clone()
        return page is not None

    s.read(names, take)
    assert sorted(got) == list(range(36))  # stops at the first miss
    assert got[35] is None and all(
        torch.equal(got[i], torch.full((64,), float(i))) for i in range(35)
    )
    s.close()


def test_bad_options_and_shapes_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="backend must be 'file' or 'mooncake'"):
        storage_options({"backend": "s3"})
    with pytest.raises(ValueError, match="directory"):
        storage_options({"backend": "file"})
    # The key's old name is refused, never read as the default file store.
    for old in ({"store": "mooncake", "directory": str(tmp_path)}, {"store": "none"}):
        with pytest.raises(ValueError, match="extra_config store: the key is 'backend' now"):
            storage_options(old)
    # Each option typed as it is meant, and kept to its own backend.
    d = str(tmp_path)
    for options, error, words in [
        ({"directory": d, "shared": "false"}, TypeError, "shared must be true or false"),
        ({"directory": d, "max_bytes": 1.9}, TypeError, "max_bytes"),
        ({"directory": d, "max_bytes": 0}, ValueError, "max_bytes must be >= 1"),
        ({"directory": d, "master_address": "h:1"}, ValueError, "master_address: options of"),
        ({"backend": "mooncake", "directory": d}, ValueError, "directory: options of"),
        ({"backend": "mooncake", "metadata_server": "x"}, ValueError, "master_address"),
        (
            {"backend": "mooncake", "master_address": "a", "metadata_server": "b",
             "listen_on_all_interfaces": "false"},
            TypeError,
            "listen_on_all_interfaces must be true or false",
        ),
    ]:  # fmt: skip
        with pytest.raises(error, match=words):
            storage_options(options)
    with pytest.raises(ValueError, match="page_elems"):
        StagedStorage({"backend": "file", "directory": str(tmp_path)}, FP, 63, torch.float32)
    with pytest.raises(ValueError, match="^retry_after_s must be"):
        _store(tmp_path, retry_after_s=-1)


def test_a_secret_file_is_read_once(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a deployment secret\n")
    o = storage_options(
        {"backend": "file", "directory": str(tmp_path / "d"), "secret_file": str(secret)}
    )
    secret.unlink()  # what was read stays: the store does not read it again
    s = StagedStorage(o, FP, 64, torch.float32)
    assert o["secret"] == b"a deployment secret" and s.name_key is not None
    s.close()


class _SlowQueries(FileStorage):
    """A file store whose existence queries take `delay` s (a remote store)."""

    delay = 2.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocking_queries = True

    def batch_exists(self, keys):
        time.sleep(self.delay)
        return super().batch_exists(keys)


def test_a_slow_store_is_waited_for_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(staged_storage, "FileStorage", _SlowQueries)
    s = _store(tmp_path, query_timeout_s=0.05)
    names = page_keys(list(range(8)), 4, b"s" * 32)
    s.write(names, lambda i, page: page.fill_(i))
    t0 = time.monotonic()
    assert s.exists(names, bounded=True) is None  # no answer in time: a miss
    assert s.exists(names, bounded=True) is None  # still unanswered: not asked again
    assert time.monotonic() - t0 < 1.5  # neither call waited for the 2 s answer
    assert s.counts()["query_timeouts"] == 1
    time.sleep(2.2)
    s.reads.succeeded()  # the back-off counted the timeout as a failed read
    monkeypatch.setattr(_SlowQueries, "delay", 0.0)
    assert s.exists(names, bounded=True) == 2
    assert s.exists(names) == 2  # unbounded: asked on the caller's thread
    s.close()


def _host_pool(pages=8):
    k = [torch.zeros(4, 2, 8) for _ in range(2)]
    return HostKVCache(
        EngineKVPool(k, [t.clone() for t in k], page_size=1),
        num_pages=pages,
        layout="page_first",
        pin_memory=False,
    )


def _done(io, ops):
    """The finished calls' flags by op, once `ops` calls have finished."""
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < ops and time.monotonic() < deadline:
        got.update(io.take_done())
        time.sleep(0.01)
    return got


def test_host_pages_are_written_and_read_in_place_in_order(tmp_path):
    host = _host_pool()
    pages = host.kv_buffer.view(8, -1)
    for p in range(8):
        pages[p].fill_(float(p + 1))
    options = {"backend": "file", "directory": str(tmp_path)}
    io = HostPageIO.open_for(options, FP, host)
    names = page_keys(list(range(12)), 4, b"s" * 32)  # three pages' names
    io.write(1, names[:2], [2, 5])
    io.read(2, names, [6, 7, 0])  # queued behind the write: the first two are there
    got = _done(io, 2)
    assert got == {1: [True, True], 2: [True, True, False]}
    assert torch.equal(pages[6], torch.full_like(pages[6], 3.0))
    assert torch.equal(pages[7], torch.full_like(pages[7], 6.0))
    assert torch.equal(pages[0], torch.full_like(pages[0], 1.0))  # a miss leaves it
    assert io.in_flight == 0 and io.exists(names) == 2
    with pytest.raises(ValueError, match="names .2. and pages .1. must pair up"):
        io.write(3, names[:2], [1])
    assert io.in_flight == 0
    io.close()
    # Another instance over the same directory, same fingerprint, reads them.
    other = HostPageIO.open_for(options, FP, _host_pool())
    assert other.exists(names) == 2
    other.close()
