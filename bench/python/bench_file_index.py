"""The file store's start-up scan: how long a bounded FileStorage takes to
index the pages a previous run left (every header read and checked), against
a bare `scandir` + `stat` of the same files in the same run (what the store
did before it read headers: sizes and times only, no parent keys, nothing
checked), and what the index holds in memory.

The pages are written once, straight in the store's format (a header and a
small payload), as chains of `--chain` pages (each page names the one it
extends), in a directory laid out as the store's. Then, per sample: the
constructor's own time (the scan runs on a thread; the store serves at
once), the scan to its end (`wait_indexed`), and the baseline walk. With
`--cold` (root only) the page cache is dropped before each walk, as after a
reboot; otherwise both read from memory.

Then what the bound costs a write: batches of 128 pages of 256 KiB (16
tokens x 8 heads x 128 x bfloat16 x K and V x 4 layers) to fresh keys,
bounded (a parent key each, the index, and the file's time stamped) against
unbounded, alternating; the batch before is removed untimed.

python bench/python/bench_file_index.py [--files N] [--chain C] [--reps R] [--cold] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
import tracemalloc

import torch

import radixkv
from radixkv.kvcache import MHAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.storage import FileStorage, config_fingerprint
from radixkv.storage.file import HEADER, MAGIC, NO_PARENT

PAYLOAD = 64  # bytes of each page: the scan reads headers only


def fingerprint() -> bytes:
    return config_fingerprint(
        model="bench",
        dtype="bfloat16",
        page_size=16,
        layout="page_first",
        num_layers=1,
        kv_heads=1,
        head_dim=2,
    )


def write_pages(root: str, n: int, chain: int) -> str:
    """`n` page files under `root` in the store's layout: their directory."""
    top = os.path.join(root, fingerprint().hex()[:16])
    os.makedirs(top, mode=0o700, exist_ok=True)
    payload = bytes(PAYLOAD)
    check = radixkv._core.crc32c(payload)
    parent = NO_PARENT
    made: set = set()
    for i in range(n):
        key = struct.pack("<Q", i).ljust(32, b"\x07")
        up = NO_PARENT if i % chain == 0 else parent
        hexed = key.hex()
        sub = os.path.join(top, hexed[:2])
        if sub not in made:
            os.makedirs(sub, mode=0o700, exist_ok=True)
            made.add(sub)
        fd = os.open(os.path.join(sub, hexed + ".page"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, HEADER.pack(MAGIC, key, up, fingerprint(), PAYLOAD, check) + payload)
        os.close(fd)
        parent = key
    return top


def drop_caches(cold: bool) -> None:
    if cold:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def bare_walk(top: str) -> int:
    """The baseline: every page file's size and time, nothing read."""
    found = 0
    for sub in os.scandir(top):
        if not sub.is_dir(follow_symlinks=False):
            continue  # the bound's journal
        for entry in os.scandir(sub.path):
            if entry.name.endswith(".page"):
                entry.stat(follow_symlinks=False)
                found += 1
    return found


def write_cost(root: str, reps: int) -> dict:
    """Microseconds a page written, bounded and not (medians), and their ratio."""
    dev = MHAKVCache(8, 4, 128, 4, torch.bfloat16, page_size=16)
    pool = HostKVCache(dev, 128, pin_memory=False)
    pool.kv_buffer.view(torch.int16).random_()
    fp = config_fingerprint(
        model="bench",
        dtype=torch.bfloat16,
        page_size=16,
        layout="page_first",
        num_layers=4,
        kv_heads=8,
        head_dim=128,
    )
    stores = {
        "bounded": FileStorage(os.path.join(root, "b"), fp, max_bytes=1 << 40),
        "unbounded": FileStorage(os.path.join(root, "u"), fp),
    }
    times: dict = {name: [] for name in stores}
    for rep in range(reps + 1):
        for name, fs in stores.items():
            fs.attach(pool)
            fs.wait_indexed()
            keys = [struct.pack("<QQ", rep, i).ljust(32, b"\x01").hex() for i in range(128)]
            parents = [None, *keys[:-1]]
            t = time.perf_counter()
            ok = fs.batch_set(keys, list(range(128)), parents=parents)
            took = time.perf_counter() - t
            if not all(ok):
                raise SystemExit(f"{name}: a write failed")
            if rep:  # the first is a warm-up
                times[name].append(took / 128 * 1e6)
            for k in keys:
                os.unlink(fs.path(k))
    bounded, unbounded = (statistics.median(times[n]) for n in ("bounded", "unbounded"))
    return {
        "write_us_bounded": round(bounded, 1),
        "write_us_unbounded": round(unbounded, 1),
        "write_bounded_over_unbounded": round(bounded / unbounded, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--chain", type=int, default=32, help="pages per chain")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each walk")
    ap.add_argument("--dir", help="where to write the pages (default: a temporary directory)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="radixkv-scan-")
    try:
        t = time.perf_counter()
        top = write_pages(root, args.files, args.chain)
        print(f"wrote {args.files:,} page files in {time.perf_counter() - t:.1f} s", flush=True)
        bound = (HEADER.size + PAYLOAD) * args.files  # everything fits: nothing removed
        start, scan, walk = [], [], []
        for _ in range(args.reps):
            drop_caches(args.cold)
            t = time.perf_counter()
            fs = FileStorage(root, fingerprint(), max_bytes=bound)
            start.append(time.perf_counter() - t)
            fs.wait_indexed()
            scan.append(time.perf_counter() - t)
            if fs.stored_bytes != bound:
                raise SystemExit(f"indexed {fs.stored_bytes} bytes of {bound}")
            fs.close()
            del fs  # (its index freed here, not inside the next sample)
            drop_caches(args.cold)
            t = time.perf_counter()
            if bare_walk(top) != args.files:
                raise SystemExit("the walk missed files")
            walk.append(time.perf_counter() - t)
        tracemalloc.start()
        fs = FileStorage(root, fingerprint(), max_bytes=bound)
        fs.wait_indexed()
        index_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        fs.close()
        result = {
            "files": args.files,
            "cold": args.cold,
            "constructor_ms": round(statistics.median(start) * 1e3, 2),
            "scan_s": round(statistics.median(scan), 2),
            "bare_walk_s": round(statistics.median(walk), 2),
            "scan_over_walk": round(statistics.median(scan) / statistics.median(walk), 2),
            "files_per_s": round(args.files / statistics.median(scan)),
            "index_bytes_per_page": round(index_bytes / args.files),
            **write_cost(root, args.reps * 3),
        }
        print(json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
