"""radixkv.compat.staged_storage: the store the engine adapters share."""

import time

import pytest
import torch

from radixkv.compat import staged_storage
from radixkv.compat.staged_storage import StagedStorage, storage_options
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
