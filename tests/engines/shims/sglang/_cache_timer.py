"""Test and benchmark only: with RADIXKV_CACHE_TIMER=PATH in the
environment, the scheduler's prefix cache has each of the calls SGLang's
scheduler makes on it timed (the scheduler thread's CPU time, not the wall
clock) and the totals written to PATH as JSON, at most every second, on the
next call after it: {method: [calls, cpu seconds]}, and under "all" the
outermost calls' (a call one of these makes itself counts once there);
"overhead" is what the timing itself adds to one call (the median over an
empty call timed the same way, measured at start): subtract it per call.
With RADIXKV_CACHE_PROFILE=PATH as well, the outermost calls also run
under cProfile (thread CPU time), its stats dumped to PATH alongside.
An SGLang plug-in (this venv's only); without the variable it changes
nothing."""

import json
import os
import time

TIMED = (
    "match_prefix",
    "init_load_back",
    "ready_to_load_host_cache",
    "check_hicache_events",
    "flush_pending_backups",
    "checkpoint",
    "free_kv_row",
    "evict",
    "evict_for_alloc",
    "inc_lock_ref",
    "dec_lock_ref",
    "lock",
    "unlock",
    "path_device_indices",
    "prefix_device_indices",
    "evictable_size",
    "protected_size",
    "prefetch_from_storage",
    "check_prefetch_progress",
    "on_release",
)


def _wrap(cache, path):
    totals = {"all": [0, 0.0]}
    last = [0.0]
    depth = [0]
    profile = None
    if os.environ.get("RADIXKV_CACHE_PROFILE"):
        import cProfile

        profile = cProfile.Profile(time.thread_time)

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.thread_time()
            depth[0] += 1
            if profile is not None and depth[0] == 1:
                profile.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                if profile is not None and depth[0] == 1:
                    profile.disable()
                depth[0] -= 1
                spent = time.thread_time() - t0
                for key in (name, "all") if depth[0] == 0 else (name,):
                    entry = totals.setdefault(key, [0, 0.0])
                    entry[0] += 1
                    entry[1] += spent
                now = time.monotonic()
                if now - last[0] > 1.0:
                    last[0] = now
                    with open(path + ".tmp", "w") as f:
                        json.dump(totals, f)
                    os.replace(path + ".tmp", path)
                    if profile is not None:
                        profile.dump_stats(os.environ["RADIXKV_CACHE_PROFILE"])

        return call

    for name in TIMED:
        fn = getattr(cache, name, None)
        if callable(fn):
            setattr(cache, name, timed(name, fn))
    totals["overhead"] = [0, _overhead()]


def _overhead() -> float:
    """Seconds the timing adds to what it measures of one call: the median
    of an empty call measured as `call` measures one."""
    samples = []
    for _ in range(2001):
        t0 = time.thread_time()
        try:
            (lambda: None)()
        finally:
            samples.append(time.thread_time() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def install() -> None:
    path = os.environ.get("RADIXKV_CACHE_TIMER")
    if not path:
        return
    from sglang.srt.mem_cache import kv_cache_builder

    build = kv_cache_builder.build_kv_cache
    if getattr(build, "_radixkv_timed", False):
        return

    def timed_build(*args, **kwargs):
        result = build(*args, **kwargs)
        _wrap(result.tree_cache, path)
        return result

    timed_build._radixkv_timed = True
    kv_cache_builder.build_kv_cache = timed_build
