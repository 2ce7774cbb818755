"""The storage tier: backends against the same bytes moved without radixkv, the
prefetch's latency, and the page keys' hashing.

Samples of radixkv and of the baseline alternate, and only the batch written
last is kept (older ones are removed untimed), so neither the directory nor
the store grows during the run.

Pages of a real model's K/V: 16 tokens x 8 KV heads x 128 x bfloat16 x K and
V x L layers (L = 4: 256 KiB a page; L = 32: 2 MiB); a host pool `page_first`
of 2 x 128 pages. Each sample moves one batch of 128 pages (MAX_BATCH), to
fresh keys for writes, and reads back the batch written last.
  file write   FileStorage.batch_set (header, CRC-32, temporary name, rename)
               against plain `open(path, "wb").write(page)` of the same bytes
               to the same directory layout (no header, checksum or rename)
  file read    FileStorage.batch_get (header and CRC-32 checked) against plain
               `readinto` of the plain files; both from the page cache
  file+key     the same with a deployment secret: every page tagged with
               HMAC-SHA-256 over its bytes (written and checked) instead of CRC-32C
  mooncake     MooncakeStorage.batch_set / batch_get against Mooncake's own
               client calling batch_put_from / batch_get_into with the same
               keys, buffers and sizes (a master on 127.0.0.1, TCP loopback)
  mooncake+key the same with a deployment secret: pages staged through the
               registered staging area (copied out of it before their
               HMAC-SHA-256 tag is checked, into it after it is made)
               against the same raw zero-copy calls
Then the prefetch as a request sees it: one instance writes a prompt's pages,
a second one (empty device and host) calls `prefetch` and `wait_prefetch`
(`wait_complete`), both on the file backend: microseconds per 1k tokens.
Then keys: `page_keys` (C++, radixkv's SHA-256) against hashlib over the same pages,
one `update` per token as SGLang's get_hash_str does, and one per page; and
keyed names (HMAC-SHA-256 of each page key under a secret) against Python's hmac.

python bench/python/bench_storage.py [--reps N] [--dir DIR] [--no-mooncake] [--keys-only]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Optional

import torch

from radixkv import _core
from radixkv.kvcache import MHAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.scheduler import CacheManager
from radixkv.storage import FileStorage, config_fingerprint, page_keys
from radixkv.storage.base import MAX_BATCH

HEADS, HEAD_DIM, DTYPE, PAGE = 8, 128, torch.bfloat16, 16


def fingerprint(layers: int) -> bytes:
    return config_fingerprint(
        model="bench",
        dtype=DTYPE,
        page_size=PAGE,
        layout="page_first",
        num_layers=layers,
        kv_heads=HEADS,
        head_dim=HEAD_DIM,
    )


def host_pool(layers: int, pages: int, seed: int = 0) -> HostKVCache:
    dev = MHAKVCache(HEADS, layers, HEAD_DIM, 4, DTYPE, page_size=PAGE)
    pool = HostKVCache(dev, pages, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.view(torch.int16).copy_(
        torch.randint(-(2**15), 2**15, pool.kv_buffer.shape, generator=g, dtype=torch.int16)
    )
    return pool


def same_halves(pool: HostKVCache) -> bool:
    """The pages read back (second half) hold the bytes written (first half)."""
    raw = pool.kv_buffer.view(torch.int16)
    return torch.equal(raw[:MAX_BATCH], raw[MAX_BATCH:])


def paired(ours, base, reps: int, after=None):
    """Median seconds of `ours(rep)` and `base(rep)` over `reps` samples each,
    taken alternately (the order flips every rep) after one warm-up each, so
    drift in the machine or the store's fill weighs on both alike; `after()`
    runs untimed after every sample."""
    s_ours, s_base = [], []
    ours(-1), base(-1)
    for rep in range(reps):
        for fn, out in ((ours, s_ours), (base, s_base))[:: 1 if rep % 2 == 0 else -1]:
            t0 = time.perf_counter()
            fn(rep)
            out.append(time.perf_counter() - t0)
            if after is not None:
                after()
    return statistics.median(s_ours), statistics.median(s_base)


def timed(fn, reps: int):
    """Median seconds of `fn(rep)` over `reps` samples, after one warm-up."""
    fn(-1)
    samples = []
    for rep in range(reps):
        t0 = time.perf_counter()
        fn(rep)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def keys_for(tag: str, rep: int):
    return [hashlib.sha256(f"{tag}/{rep}/{i}".encode()).hexdigest() for i in range(MAX_BATCH)]


def bench_file(layers: int, directory: str, reps: int, secret=None) -> list:
    pool = host_pool(layers, 2 * MAX_BATCH)
    name = "file" if secret is None else "file+key"
    fs = FileStorage(os.path.join(directory, name), fingerprint(layers), secret=secret)
    fs.attach(pool)
    plain_dir = os.path.join(directory, "plain")
    nbytes = fs.page_bytes * MAX_BATCH
    pages = list(range(MAX_BATCH))
    back = list(range(MAX_BATCH, 2 * MAX_BATCH))
    written = {}

    def plain_path(key):
        return os.path.join(plain_dir, key[:2], key + ".page")

    def ours_write(rep):
        keys = written["ours"] = keys_for("ours", rep)
        assert all(fs.batch_set(keys, pages))

    def plain_write(rep):
        keys = written["plain"] = keys_for("plain", rep)
        for k, p in zip(keys, pages):
            path = plain_path(k)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(memoryview(fs.page_view(p).numpy()))

    def ours_read(rep):
        assert all(fs.batch_get(written["ours"], back))

    def plain_read(rep):
        for k, p in zip(written["plain"], back):
            with open(plain_path(k), "rb") as f:
                f.readinto(memoryview(fs.page_view(p).numpy()))

    kept = {"ours": [], "plain": []}

    def drop_old():
        # Only the batch written last stays: the directory does not grow.
        for name, path in (("ours", fs.path), ("plain", plain_path)):
            if name in written and written[name] is not (kept[name] or [None])[-1]:
                for k in kept[name][-1] if kept[name] else []:
                    try:
                        os.unlink(path(k))
                    except OSError:
                        pass
                kept[name].append(written[name])

    rows = []
    s_ours, s_plain = paired(ours_write, plain_write, reps, after=drop_old)
    rows.append(row(name, "write", layers, fs.page_bytes, nbytes, s_ours, s_plain))
    s_ours, s_plain = paired(ours_read, plain_read, reps)
    rows.append(row(name, "read", layers, fs.page_bytes, nbytes, s_ours, s_plain))
    assert same_halves(pool), "file read back other bytes"
    return rows


def row(backend, op, layers, page_bytes, nbytes, s_ours, s_base):
    return {
        "backend": backend,
        "op": op,
        "layers": layers,
        "page_kib": page_bytes >> 10,
        "batch_mib": round(nbytes / 2**20, 1),
        "radixkv_gbps": round(nbytes / s_ours / 1e9, 2),
        "baseline_gbps": round(nbytes / s_base / 1e9, 2),
        "ratio": round(s_base / s_ours, 2),
    }


def bench_mooncake(layers: int, reps: int, secret: Optional[bytes] = None) -> list:
    from radixkv.storage import MooncakeMaster, MooncakeStorage

    name = "mooncake" if secret is None else "mooncake+key"

    pool = host_pool(layers, 2 * MAX_BATCH)
    rows = []
    with MooncakeMaster() as m:
        ms = MooncakeStorage(
            m.master_address,
            m.metadata_server,
            listen_on_all_interfaces=True,
            segment_bytes=2 * pool.nbytes + (64 << 20),
            buffer_bytes=64 << 20,
            secret=secret,
        )
        ms.attach(pool)
        raw = ms.store  # the same client, called as its own Python API is
        if secret is not None:  # the raw calls move the host pool's pages
            assert raw.register_buffer(pool.kv_buffer.data_ptr(), pool.nbytes) == 0
        nbytes = ms.page_bytes * MAX_BATCH
        pages = list(range(MAX_BATCH))
        back = list(range(MAX_BATCH, 2 * MAX_BATCH))
        sizes = [ms.page_bytes] * MAX_BATCH
        written = {}

        def ours_put(rep):
            keys = written["ours"] = keys_for("ours", rep)
            assert all(ms.batch_set(keys, pages))

        def raw_put(rep):
            keys = written["raw"] = ["radixkv/" + k for k in keys_for("raw", rep)]
            rc = raw.batch_put_from(keys, [ms.page_address(p) for p in pages], sizes)
            assert all(r == 0 for r in rc)

        def ours_get(rep):
            assert all(ms.batch_get(written["ours"], back))

        def raw_get(rep):
            got = raw.batch_get_into(written["raw"], [ms.page_address(p) for p in back], sizes)
            assert all(g == ms.page_bytes for g in got)

        previous = {}

        def drop_old():
            # Only the batch written last stays: the store never has to evict.
            for name in ("ours", "raw"):
                keys = written.get(name)
                if keys is None or previous.get(name) is keys:
                    continue
                old = previous.get(name)
                if old is not None:
                    raw.batch_remove(old if name == "raw" else ["radixkv/" + k for k in old])
                previous[name] = keys

        s_ours, s_base = paired(ours_put, raw_put, reps, after=drop_old)
        rows.append(row(name, "put", layers, ms.page_bytes, nbytes, s_ours, s_base))
        s_ours, s_base = paired(ours_get, raw_get, reps)
        rows.append(row(name, "get", layers, ms.page_bytes, nbytes, s_ours, s_base))
        assert same_halves(pool), "mooncake read back other bytes"
        ms.close()
    return rows


def bench_prefetch(directory: str, reps: int, layers: int = 4) -> list:
    rows = []
    for tokens in (1024, 8192, 32768):
        pages = tokens // PAGE + 2

        def instance(path):
            dev = MHAKVCache(HEADS, layers, HEAD_DIM, pages, DTYPE, page_size=PAGE)
            return CacheManager(
                pages,
                page_size=PAGE,
                host_num_pages=pages,
                kv_cache=dev,
                storage=FileStorage(path, fingerprint(layers)),
                storage_seed=fingerprint(layers),
                prefetch_policy="wait_complete",
            )

        path = os.path.join(directory, f"prefetch-{tokens}")
        g = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, 50_000, (tokens + 1,), generator=g, dtype=torch.int32)
        a = instance(path)
        h, idx = a.match_req(ids)
        a.lock(h)
        own = a.allocate(len(ids))
        a.free_and_cache_finished_req(h, ids, own)
        a.drain()
        a.close()
        samples = []
        for _ in range(reps):
            b = instance(path)
            t0 = time.perf_counter()
            op = b.prefetch(ids)
            got = b.wait_prefetch(op)
            samples.append(time.perf_counter() - t0)
            assert got == tokens, (got, tokens)
            b.close()
        us = statistics.median(samples) * 1e6
        rows.append(
            {
                "prefetch_tokens": tokens,
                "layers": layers,
                "mib": round(tokens * layers * 2 * HEADS * HEAD_DIM * 2 / 2**20, 1),
                "us": round(us),
                "us_per_1k_tokens": round(us * 1000 / tokens),
            }
        )
    return rows


def sglang_loop(ids, page):
    """One hashlib update per token, as SGLang's get_hash_str does."""
    keys, prior = [], None
    for s in range(0, len(ids) - len(ids) % page, page):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        for t in ids[s : s + page]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        keys.append(prior)
    return keys


def page_loop(raw: bytes, page):
    keys, prior = [], b""
    step = 4 * page
    for s in range(0, len(raw) - len(raw) % step, step):
        d = hashlib.sha256(prior + raw[s : s + step])
        prior = d.digest()
        keys.append(d.hexdigest())
    return keys


def bench_keys(reps: int) -> list:
    rows = []
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32)
    as_list = ids.tolist()
    raw = ids.numpy().astype("<u4").tobytes()
    for page in (16, 64, 512):
        ours = page_keys(ids, page)
        assert ours == sglang_loop(as_list, page) == page_loop(raw, page)
        s = {
            "radixkv": timed(lambda _: page_keys(ids, page), reps),
            "hashlib per token": timed(lambda _: sglang_loop(as_list, page), max(3, reps // 3)),
            "hashlib per page": timed(lambda _: page_loop(raw, page), reps),
        }
        row_ = {"page": page, "tokens": len(ids)}
        for k, v in s.items():
            row_[k + " GB/s"] = round(len(raw) / v / 1e9, 3)
        row_["vs per token"] = round(s["hashlib per token"] / s["radixkv"], 1)
        row_["vs per page"] = round(s["hashlib per page"] / s["radixkv"], 1)
        rows.append(row_)
    # Keyed names (a deployment secret): HMAC-SHA-256 of each page key.
    raw_keys = _core.page_keys(ids.numpy(), 16, None, True)
    secret = bytes(range(32))

    def python_hmac(_):
        return [
            hmac.new(secret, raw_keys[i : i + 32], hashlib.sha256).hexdigest()
            for i in range(0, len(raw_keys), 32)
        ]

    assert _core.keyed_page_keys(raw_keys, secret) == python_hmac(0)
    n = len(raw_keys) // 32
    ours = timed(lambda _: _core.keyed_page_keys(raw_keys, secret), reps)
    theirs = timed(python_hmac, reps)
    rows.append(
        {
            "keyed keys": n,
            "radixkv ns a key": round(ours / n * 1e9),
            "hmac ns a key": round(theirs / n * 1e9),
            "vs hmac": round(theirs / ours, 1),
        }
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dir", help="directory for the file backend (default: a temporary one)")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--keys-only", action="store_true", help="only the page keys' part")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.keys_only:
        for r in bench_keys(args.reps):
            print(json.dumps(r))
        return
    directory = tempfile.mkdtemp(prefix="bench_storage.", dir=args.dir)
    out = []
    try:
        print(
            f"{'backend':<13}{'op':<7}{'page KiB':>9}{'batch MiB':>10}"
            f"{'radixkv GB/s':>13}{'baseline GB/s':>14}{'ratio':>7}"
        )
        for layers in (4, 32):
            rows = bench_file(layers, directory, args.reps)
            # A deployment secret: HMAC-SHA-256 names and page tags instead of CRC-32C.
            rows += bench_file(layers, directory, args.reps, secret=b"bench secret of a deployment")
            if not args.no_mooncake:
                rows += bench_mooncake(layers, args.reps)
                rows += bench_mooncake(layers, args.reps, secret=b"a deployment secret")
            for r in rows:
                out.append(r)
                print(
                    f"{r['backend']:<13}{r['op']:<7}{r['page_kib']:>9}{r['batch_mib']:>10}"
                    f"{r['radixkv_gbps']:>13.2f}{r['baseline_gbps']:>14.2f}{r['ratio']:>7.2f}"
                )
        print("\nprefetch (file backend, wait_complete), into an empty instance:")
        for r in bench_prefetch(directory, args.reps):
            out.append(r)
            print(
                f"  {r['prefetch_tokens']:>6} tokens ({r['mib']:>6} MiB): {r['us']:>8} us, "
                f"{r['us_per_1k_tokens']:>6} us per 1k tokens"
            )
        print("\npage keys (GB/s of token bytes):")
        for r in bench_keys(args.reps):
            out.append(r)
            print("  " + ", ".join(f"{k} {v}" for k, v in r.items()))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for r in out:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
