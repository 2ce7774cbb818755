"""A host tier that holds its pages encoded (`host_codec="float8"`): backups
encode and loads decode in the copy engine, bit for bit torch's float8
conversion with a scale per (page, side, layer, head); a page takes the bytes
the storage codec writes, and a store with that codec keeps them as they are
and shares them with engines whose host pages are plain."""

from __future__ import annotations

import pytest
import torch
from storage_env import needs_mooncake
from float8_reference import page_codec_reference as reference

from radixkv import _core
from radixkv.kvcache import MHAKVCache, MLAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.kvcache.page_codec import Float8PageCodec
from radixkv.scheduler import CacheManager
from radixkv.storage import FileStorage, MooncakeMaster, MooncakeStorage, pool_fingerprint
from devices import EXT_CUDA as CUDA

LAYERS, PS, HEADS, DIM = 2, 4, 2, 8
F8 = torch.float8_e4m3fn




def device_pool(kind="mha", dtype=torch.bfloat16, pages=8, side=False, device="cpu"):
    if kind == "mha":
        pool = MHAKVCache(HEADS, LAYERS, DIM, pages, dtype, page_size=PS, device=device)
    else:
        pool = MLAKVCache(12, 4, LAYERS, pages, dtype, page_size=PS, device=device)
    if side:
        pool.register_side_buffer("scale", (2,), torch.float32)
        pool.register_side_buffer("label", (3,), torch.int8)
    return pool


def write(pool, idx, seed):
    """Random K/V (a head of zeros, one far larger than the rest) and side rows."""
    g = torch.Generator().manual_seed(seed)
    n = len(idx)
    for layer in range(LAYERS):
        if isinstance(pool, MHAKVCache):
            k = torch.randn(n, HEADS, DIM, generator=g)
            k[:, 1] *= 1000
            v = torch.randn(n, HEADS, DIM, generator=g)
            v[:, 0] = 0
        else:
            k = torch.randn(n, 1, 12, generator=g) * 3
            v = torch.randn(n, 1, 4, generator=g)
        side = None
        if pool.side_buffer_specs():
            side = {
                "scale": torch.randn(n, 2, generator=g),
                "label": torch.randint(-100, 100, (n, 3), generator=g, dtype=torch.int8),
            }
        dev = pool.device
        if side is not None:
            side = {name: rows.to(dev) for name, rows in side.items()}
        pool.store_kv(k.to(dev, pool.dtype), v.to(dev, pool.dtype), idx.to(dev), layer, side=side)


def planes(pool, slots):
    """The device rows of whole pages `slots`, per (side, layer): a list of
    `[pages, S, H, D]` tensors."""
    out = []
    for side in range(pool.sides):
        for layer in range(LAYERS):
            # (an MLA pool has one side: k_cache is its whole latent row)
            cache = pool.k_cache(layer) if side == 0 else pool.v_cache(layer)
            rows = cache.reshape(-1, *cache.shape[2:])[slots.long().to(cache.device)]
            out.append(rows.reshape(-1, PS, *rows.shape[1:]).cpu())
    return out


def controller(dev, host):
    """A manual CPU controller between `dev` and `host` (side planes and the
    host's codec included), as the host tier makes one."""
    sides = [
        (d, list(dl), h, list(hl), rb)
        for (d, dl, rb), (h, hl, _) in zip(dev.side_copy_layouts(), host.side_copy_layouts())
    ]
    return _core.CacheController(
        dev.kv_buffer,
        list(dev.copy_layout()),
        host.copy_buffer,
        list(host.copy_layout()),
        host.row_bytes,
        LAYERS,
        True,
        sides,
        None,
        host.codec_copy(),
    )


def serve(cm, pool, ids, seed):
    h, _ = cm.match_req(ids)
    cm.lock(h)
    idx = cm.allocate(len(ids))
    write(pool, idx, seed)
    cm.free_and_cache_finished_req(h, ids, idx)
    cm.drain()
    return idx[: len(ids) // PS * PS]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_come_back_from_an_encoded_host_as_torch_rounds_them(kind, dtype, device):
    pool = device_pool(kind, dtype, side=True, device=device)
    cm = CacheManager(8, PS, device=device, host_num_pages=16, kv_cache=pool, host_codec="float8")
    host = cm._tiers.host.pool
    assert host.codec == "float8"
    prompts = [list(range(100 * r, 100 * r + 2 * PS + 1)) for r in range(5)]
    want, sides = [], []
    for r, ids in enumerate(prompts):
        idx = serve(cm, pool, ids, r)
        want.append(planes(pool, idx))
        sides.append([pool.side_buffer("scale", 0).reshape(-1, 2)[idx.long()].cpu()])
    h, _ = cm.match_req(prompts[0])
    assert h.cached_len == 0 and h.host_hit_len == 2 * PS  # on the host only
    loaded, idx = cm.load_back(h)
    cm.drain()
    got = planes(pool, idx)
    for plane_got, plane_want in zip(got, want[0]):
        for page in range(2):
            _, _, back = reference(plane_want[page][None])
            assert torch.equal(plane_got[page], back[0])
    # Lossy, and only by rounding: never equal to a random 16-bit row.
    assert any(not torch.equal(a, b) for a, b in zip(got, want[0]))
    # Side rows are moved as they are.
    assert torch.equal(pool.side_buffer("scale", 0).reshape(-1, 2)[idx.long()].cpu(), sides[0][0])
    cm.unlock(loaded)
    cm.check_integrity()


def test_the_host_page_is_what_the_storage_codec_writes():
    """Backed up into an encoded host pool, a page's bytes are exactly the
    float8 encoding of the same page backed up into a plain one."""
    dev = device_pool(side=True)
    idx = torch.arange(2 * PS, dtype=torch.int32)
    write(dev, idx, 7)
    plain = HostKVCache(dev, 4, pin_memory=False)
    packed = HostKVCache(dev, 4, pin_memory=False, codec="float8")
    codec = Float8PageCodec(plain)
    assert packed.page_bytes == codec.encoded_bytes < plain.page_bytes
    for host in (plain, packed):
        ctl = controller(dev, host)
        ctl.backup(idx, idx + PS)  # device pages 0, 1 -> host pages 1, 2
        ctl.drain()
        assert ctl.take_backup_acks()[0][1]
    for page in (1, 2):
        out = torch.zeros(codec.encoded_bytes, dtype=torch.uint8)
        codec.encode(plain.page(page).numpy().data, out.numpy().data)
        assert torch.equal(packed.page(page), out)
    # The scales, as views: device page 0's keys of layer 1 went to host page 1.
    scale, _, _ = reference(planes(dev, idx[:PS])[1])
    assert packed.k_scale(1).shape == (4, HEADS)
    assert torch.equal(packed.k_scale(1)[1], scale[0])


def test_a_copy_of_part_of_a_page_fails_and_writes_nothing():
    dev = device_pool()
    idx = torch.arange(2 * PS, dtype=torch.int32)
    write(dev, idx, 3)
    host = HostKVCache(dev, 4, pin_memory=False, codec="float8")
    ctl = controller(dev, host)
    before = host.kv_buffer.clone()
    for src, dst in ((idx[1:3], idx[1:3]), (idx[:PS], idx[1 : PS + 1]), (idx[:3], idx[:3])):
        ctl.backup(src, dst)
        ctl.drain()
        assert ctl.take_backup_acks()[0][1] is False
    assert torch.equal(host.kv_buffer, before)


def test_an_encoded_host_holds_two_to_four_times_the_pages_in_the_same_bytes():
    for dtype, ratio in ((torch.float32, 4), (torch.bfloat16, 2)):
        dev = MHAKVCache(8, 4, 128, 2, dtype, page_size=16)
        plain = HostKVCache(dev, 8, pin_memory=False)
        packed = HostKVCache(dev, 8, pin_memory=False, codec="float8")
        # The scales cost 4 bytes per (side, layer, head) per page.
        assert plain.nbytes / packed.nbytes == pytest.approx(ratio, rel=0.02)
        assert packed.page_bytes == 2 * 4 * 8 * (16 * 128 + 4)


def test_bad_codec_arguments_are_refused_before_anything_is_made(tmp_path):
    dev = device_pool()
    with pytest.raises(ValueError, match="codec must be None or one of float8"):
        CacheManager(8, PS, host_num_pages=16, kv_cache=dev, host_codec="fp4")
    with pytest.raises(ValueError, match="host_codec='float8' needs a host tier"):
        CacheManager(8, PS, host_num_pages=16, host_codec="float8")
    with pytest.raises(ValueError, match="host_codec='float8' needs a host tier"):
        CacheManager(8, PS, kv_cache=dev, host_codec="float8")
    with pytest.raises(ValueError, match="host_codec='float8' needs a host tier"):
        CacheManager(
            8, PS, host_num_pages=16, kv_cache=dev, host_layout="layer_first", host_codec="float8"
        )
    f8 = MHAKVCache(HEADS, LAYERS, DIM, 8, torch.float8_e4m3fn, page_size=PS)
    with pytest.raises(ValueError, match="encodes float32, float16 or bfloat16"):
        CacheManager(8, PS, host_num_pages=16, kv_cache=f8, host_codec="float8")
    seed = pool_fingerprint(device_pool(), model="m")
    with pytest.raises(ValueError, match="must take the same codec"):
        CacheManager(
            8,
            PS,
            host_num_pages=16,
            kv_cache=dev,
            host_codec="float8",
            storage=FileStorage(str(tmp_path), seed),
        )
    assert not dev.backs_host_tier
    with pytest.raises(ValueError, match="codec float8 needs layout='page_first'"):
        HostKVCache(dev, 4, layout="layer_first", codec="float8")
    with pytest.raises(ValueError, match="need a pool with a codec"):
        HostKVCache(dev, 4).k_scale(0)
    fs = FileStorage(str(tmp_path), seed)
    with pytest.raises(ValueError, match="give the storage backend codec='float8'"):
        fs.attach(HostKVCache(dev, 4, codec="float8"))
    assert fs.page_bytes == 0


def read_back_as_torch_rounds(cm, pool, ids, want):
    """Prefetches `ids`' two pages from storage, loads them back and checks
    every row is torch's float8 rounding of `want` (planes of the writer)."""
    ids = torch.as_tensor(ids, dtype=torch.int32)
    op = cm.prefetch(ids)
    assert op is not None and cm.wait_prefetch(op) == 2 * PS
    h, _ = cm.match_req(ids)
    h, idx = cm.load_back(h)
    cm.drain()
    for plane_got, plane_want in zip(planes(pool, idx), want):
        for page in range(2):
            assert torch.equal(plane_got[page], reference(plane_want[page][None])[2][0])
    cm.unlock(h)


@pytest.mark.parametrize("writer_codec", [None, "float8"])
def test_a_store_with_the_codec_shares_pages_between_plain_and_encoded_hosts(
    tmp_path, writer_codec
):
    """Engine A writes (its host plain, the store encoding; or its host
    encoded, the store keeping its pages as they are); engine B, with the
    other kind of host, reads the same pages and gets the same rows."""
    seed = pool_fingerprint(device_pool(), model="m")
    reader_codec = "float8" if writer_codec is None else None

    def engine(host_codec):
        pool = device_pool(pages=8)
        cm = CacheManager(
            8,
            PS,
            host_num_pages=16,
            kv_cache=pool,
            host_codec=host_codec,
            storage=FileStorage(str(tmp_path), seed, codec="float8"),
            prefetch_policy="wait_complete",
        )
        return cm, pool

    a, pa = engine(writer_codec)
    ids = list(range(50, 50 + 2 * PS + 1))
    idx = serve(a, pa, ids, 11)
    want = planes(pa, idx)
    a.close()
    b, pb = engine(reader_codec)
    read_back_as_torch_rounds(b, pb, ids, want)
    b.close()


@needs_mooncake
def test_mooncake_moves_encoded_host_pages_zero_copy_between_engines():
    """Mooncake moves pages from the registered host pool as they are: with
    the codec the host holds them encoded, and another engine with the same
    codec gets torch's rounding back; one without the codec never sees them,
    and a plain host pool is refused up front."""
    seed = pool_fingerprint(device_pool(), model="m")
    with MooncakeMaster() as master:

        def engine(codec, host_codec):
            pool = device_pool()
            store = MooncakeStorage(
                master.master_address,
                master.metadata_server,
                listen_on_all_interfaces=True,
                segment_bytes=16 << 20,
                buffer_bytes=8 << 20,
                codec=codec,
            )
            cm = CacheManager(
                8,
                PS,
                host_num_pages=16,
                kv_cache=pool,
                host_codec=host_codec,
                storage=store,
                storage_seed=seed,
                prefetch_policy="wait_complete",
            )
            return cm, pool, store

        a, pa, sa = engine("float8", "float8")
        assert sa.page_bytes == a._tiers.host.pool.page_bytes
        ids = list(range(70, 70 + 2 * PS + 1))
        want = planes(pa, serve(a, pa, ids, 13))
        assert a.storage_counters.written_pages == 2
        b, pb, _ = engine("float8", "float8")
        read_back_as_torch_rounds(b, pb, ids, want)
        ids_t = torch.as_tensor(ids, dtype=torch.int32)
        c, _, _ = engine(None, None)
        assert c.prefetch(ids_t) is None  # plain pages' keys: nothing there
        with pytest.raises(ValueError, match="give host_codec='float8'"):
            engine("float8", None)
        a.close(), b.close(), c.close()
