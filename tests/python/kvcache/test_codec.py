"""The float8 page codec of the storage tier: bit for bit torch's own float8
conversion (scales, codes and decoded rows), side rows kept as they are, keys
and directories apart from a store without it, half the bytes on disk, and a
CacheManager whose pages come back from storage within the codec's error."""

import os

import pytest
import torch
from float8_reference import page_codec_reference as reference
from storage_env import KV, PAGE, Instance, fingerprint, keys, prompt

import radixkv
from radixkv.kvcache import MHAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.scheduler.storage_tier import storage_seed_of
from radixkv.storage import FileStorage
from radixkv.kvcache.page_codec import Float8PageCodec, codec_seed

F8 = torch.float8_e4m3fn


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where NaN (its payload aside)."""
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    if not torch.equal(nan_a, nan_b):
        return False
    return torch.equal(
        a[~nan_a].view(torch.uint8 if a.dtype == torch.uint8 else a.dtype), b[~nan_b]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_the_codec_is_torchs_float8_bit_for_bit(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    planes, rows, heads, dim = 4, 8, 3, 16
    kv = (torch.randn(planes, rows, heads, dim, generator=g) * 10 ** (seed - 2)).to(dtype)
    flat = kv.view(-1)
    picks = torch.randint(0, flat.numel(), (12,), generator=g)
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30, 65504.0]
    for i, v in zip(picks.tolist(), specials):
        flat[i] = v
    kv[1, :, 2, :] = 0  # a head of zeros: scale 1
    if dtype != torch.float16:  # a head whose largest value divided by 448 underflows
        kv[2, :, 1, :] = 0
        kv[2, 0, 1, 0] = 1e-43 if dtype == torch.float32 else 9.2e-41
    rest = torch.randint(0, 256, (40,), generator=g, dtype=torch.uint8)
    page = torch.cat([kv.view(-1).view(torch.uint8), rest])
    shape = (planes, rows, heads, dim, str(dtype).removeprefix("torch."), 40)
    out = torch.zeros(radixkv._core.float8_page_bytes(*shape), dtype=torch.uint8)
    radixkv._core.encode_float8_page(page.numpy(), out.numpy(), *shape)
    scale, codes, back = reference(kv)
    assert torch.equal(out[: planes * heads * 4].view(torch.float32).view(planes, heads), scale)
    got_codes = out[planes * heads * 4 : -40].view(planes, rows, heads, dim)
    assert same(got_codes.view(F8).float(), codes.view(F8).float())
    assert torch.equal(out[-40:], rest)
    decoded = torch.zeros_like(page)
    radixkv._core.decode_float8_page(out.numpy(), decoded.numpy(), *shape)
    assert same(decoded[:-40].view(dtype).view_as(kv), back)
    assert torch.equal(decoded[-40:], rest)


def test_bad_buffers_are_refused_by_name():
    shape = (1, 2, 1, 4, "float32", 0)
    page, out = bytearray(32), bytearray(radixkv._core.float8_page_bytes(*shape))
    with pytest.raises(ValueError, match="^page has 31 bytes"):
        radixkv._core.encode_float8_page(bytearray(31), out, *shape)
    with pytest.raises(ValueError, match="^out has"):
        radixkv._core.encode_float8_page(page, bytearray(3), *shape)
    with pytest.raises(TypeError, match="^out must be a contiguous writable buffer"):
        radixkv._core.encode_float8_page(page, bytes(len(out)), *shape)
    with pytest.raises(ValueError, match="^dtype must be"):
        radixkv._core.encode_float8_page(page, out, 1, 2, 1, 4, "int8", 0)
    with pytest.raises(ValueError, match="^shape"):
        radixkv._core.float8_page_bytes(0, 2, 1, 4, "float32")
    whole = bytearray(64)
    view = memoryview(whole)
    with pytest.raises(ValueError, match="overlaps"):
        radixkv._core.decode_float8_page(view[:12], view[8:40], *shape)
    assert page == bytearray(32) and whole == bytearray(64)  # nothing written


def pool(dtype=KV.dtype, pages=8, side=False):
    dev = MHAKVCache(KV.num_kv_heads, KV.num_layers, KV.head_dim, 4, dtype, page_size=PAGE)
    if side:
        dev.register_side_buffer("bias", (3,), torch.int32)
    host = HostKVCache(dev, pages, pin_memory=False)
    g = torch.Generator().manual_seed(5)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    if dtype != torch.float32 or not side:  # finite K/V where it is K/V
        for layer in range(KV.num_layers):
            for cache in (host.k_cache(layer), host.v_cache(layer)):
                cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    return host


@pytest.mark.parametrize("side", [False, True])
def test_a_file_store_with_the_codec_writes_half_and_reads_back_torchs_rounding(tmp_path, side):
    host = pool(side=side)
    fs = FileStorage(str(tmp_path), fingerprint(), codec="float8")
    fs.attach(host)
    plain = FileStorage(str(tmp_path), fingerprint())
    plain.attach(host)
    codec = Float8PageCodec(host)
    sides = 2 * KV.num_layers
    kv_bytes = sides * PAGE * KV.num_kv_heads * KV.head_dim * 2
    scales = sides * KV.num_kv_heads * 4
    assert fs.page_bytes == codec.encoded_bytes == plain.page_bytes - kv_bytes // 2 + scales
    assert fs.directory != plain.directory  # encoded pages never meet plain ones
    k = keys(3)
    before = host.kv_buffer.view(torch.uint8).reshape(8, -1).clone()
    assert fs.batch_set(k, [0, 1, 2]) == [True] * 3
    assert os.path.getsize(fs.path(k[0])) == fs.file_bytes
    assert fs.batch_get(k, [5, 6, 7]) == [True] * 3
    after = host.kv_buffer.view(torch.uint8).reshape(8, -1)
    assert torch.equal(after[:5], before[:5])  # what was written is untouched
    for src, dst in ((0, 5), (1, 6), (2, 7)):
        kv = before[src, :kv_bytes].view(KV.dtype).view(sides, PAGE, KV.num_kv_heads, -1)
        _, _, back = reference(kv)
        assert torch.equal(after[dst, :kv_bytes].view(KV.dtype), back.view(-1))
        assert torch.equal(after[dst, kv_bytes:], before[src, kv_bytes:])  # side rows as they are
        assert not torch.equal(after[dst], before[src])  # lossy: something rounded
    assert plain.batch_exists(k) == 0  # the plain store never sees them


def test_a_failed_read_leaves_the_host_page_as_it_was(tmp_path):
    host = pool()
    fs = FileStorage(str(tmp_path), fingerprint(), codec="float8")
    fs.attach(host)
    k = keys(1)
    assert fs.batch_set(k, [0]) == [True]
    with open(fs.path(k[0]), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    before = host.kv_buffer.clone()
    assert fs.batch_get(k, [3]) == [False] and fs.corrupt_pages == 1
    assert torch.equal(host.kv_buffer.view(torch.uint8), before.view(torch.uint8))


def test_the_codec_refuses_float8_pools_and_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="codec must be"):
        FileStorage(str(tmp_path), fingerprint(), codec="fp4")
    fs = FileStorage(str(tmp_path), fingerprint(), codec="float8")
    with pytest.raises(ValueError, match="float8 encodes"):
        fs.attach(pool(dtype=torch.float8_e4m3fn))
    assert fs.page_bytes == 0  # not attached


def test_the_codec_is_in_the_keys(tmp_path):
    seed = fingerprint()
    fs = FileStorage(str(tmp_path), seed, codec="float8")
    plain = FileStorage(str(tmp_path), seed)
    assert storage_seed_of(plain, seed) == seed
    assert storage_seed_of(fs, seed) == codec_seed(seed, "float8") != seed
    assert storage_seed_of(fs, None) == fs.fingerprint == codec_seed(seed, "float8")
    assert storage_seed_of(fs, b"") not in (b"", seed)  # SGLang's chain is plain pages' only


def test_an_engine_gets_its_pages_back_from_storage_within_the_codecs_error(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint(), codec="float8"))
    prompts = [prompt(900 + i, 4) for i in range(4)]
    for ids in prompts:
        a.serve(ids)
    a.close()
    b = Instance(FileStorage(str(tmp_path), fingerprint(), codec="float8"))
    cm = b.cm
    for ids in prompts:
        ids = torch.as_tensor(ids, dtype=torch.int32)
        op = cm.prefetch(ids)
        assert cm.wait_prefetch(op) == 4 * PAGE
        h, _ = cm.match_req(ids)
        h, idx = cm.load_back(h)
        assert h.cached_len == 4 * PAGE
        for layer in range(KV.num_layers):
            for side, cache in ((0, b.pool.k_cache(layer)), (1, b.pool.v_cache(layer))):
                got = cache.reshape(-1, KV.num_kv_heads, KV.head_dim)[idx.long()].float()
                want = KV.rows(ids[: h.cached_len], 0, layer, side).float()
                assert not torch.equal(got, want)  # it did go through the codec
                assert ((got - want).abs() <= want.abs() / 16 + want.abs().max() / 448).all()
        own = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
    b.close()


@pytest.mark.parametrize("given_seed", [True, False])
def test_with_kv_events_on_a_second_engine_reads_what_the_first_wrote(tmp_path, given_seed):
    """The events and the storage tier name pages with one seed, the codec
    mixed in once: what the first engine wrote, the second one finds."""
    from radixkv.events import EventPublisher
    from radixkv.scheduler import CacheManager

    def engine(tag):
        dev = MHAKVCache(KV.num_kv_heads, KV.num_layers, KV.head_dim, 12, KV.dtype, page_size=PAGE)
        pub = EventPublisher(f"inproc://codec-{tag}-{given_seed}")
        cm = CacheManager(
            12,
            page_size=PAGE,
            host_num_pages=24,
            kv_cache=dev,
            storage=FileStorage(str(tmp_path), fingerprint(), codec="float8"),
            storage_seed=fingerprint() if given_seed else None,
            kv_events=pub,
            prefetch_policy="wait_complete",
        )
        return cm, pub

    ids = torch.as_tensor(prompt(6, 2), dtype=torch.int32)
    a, pa = engine("a")
    h, _ = a.match_req(ids)
    a.lock(h)
    a.free_and_cache_finished_req(h, ids, a.allocate(len(ids)))
    a.drain()
    a.close(), pa.close()
    b, pb = engine("b")
    op = b.prefetch(ids)
    assert op is not None and b.wait_prefetch(op) == 2 * PAGE
    b.close(), pb.close()
