"""The storage tier's page keys: the SHA-256 chain against hashlib, against
SGLang's own page hash where SGLang is installed, and configurations that must
never share a key."""

import hashlib
import hmac
import importlib.util
import struct

import pytest
import torch

from radixkv.storage import config_fingerprint, page_keys


def chain(tokens, page, seed=None):
    prior, out = seed, []
    for p in range(len(tokens) // page):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(
            struct.pack(f"<{page}I", *[t & 0xFFFFFFFF for t in tokens[p * page : (p + 1) * page]])
        )
        prior = h.digest()
        out.append(prior.hex())
    return out


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("n_extra", [0, 1, 7])
def test_keys_are_the_sha256_chain(page, n_extra):
    g = torch.Generator().manual_seed(page + n_extra)
    tokens = torch.randint(0, 200_000, (page * 5 + n_extra,), generator=g, dtype=torch.int32)
    seed = hashlib.sha256(b"seed").digest()
    assert page_keys(tokens, page) == chain(tokens.tolist(), page)
    assert page_keys(tokens, page, seed) == chain(tokens.tolist(), page, seed)
    assert len(page_keys(tokens, page)) == len(tokens) // page


def test_every_message_length_around_the_blocks_is_sha256():
    """radixkv's own SHA-256 (the CPU's SHA instructions where it has them):
    pages of 1 to 40 tokens, with and without the 32-byte prior key, are
    messages of 4 to 192 bytes, across every padding case of one to four
    blocks."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(-(1 << 31), (1 << 31) - 1, (120,), generator=g, dtype=torch.int32)
    seed = hashlib.sha256(b"another seed").digest()
    for page in range(1, 41):
        assert page_keys(tokens, page) == chain(tokens.tolist(), page), page
        assert page_keys(tokens, page, seed) == chain(tokens.tolist(), page, seed), page


def test_every_message_length_is_sha256_inside_hmac():
    """Messages of 0 to 160 bytes (every padding case: the 0x80 byte at
    each offset of a block) and keys of 0 to 100 bytes (a key past 64 is
    hashed first), against Python's hmac."""
    from radixkv import _core

    data = bytes((i * 37 + 11) % 256 for i in range(160))
    for n in range(161):
        key = data[: n % 101]
        parts = [data[: n // 3], data[n // 3 : n]]
        assert _core.hmac_sha256(key, parts) == hmac.new(key, data[:n], hashlib.sha256).digest()


def test_keyed_keys_are_hmac_sha256_of_the_keys():
    from radixkv import _core

    raw = _core.page_keys(torch.arange(64, dtype=torch.int32).numpy(), 4, None, True)
    for secret in (bytes(32), bytes(range(32)), b"\xff" * 32):
        want = [
            hmac.new(secret, raw[i : i + 32], hashlib.sha256).hexdigest()
            for i in range(0, len(raw), 32)
        ]
        assert _core.keyed_page_keys(raw, secret) == want


def test_fixed_vectors():
    assert page_keys(list(range(8)), 4) == [
        "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
        "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052",
    ]


def test_large_inputs_hash_with_the_gil_released_and_agree():
    tokens = torch.randint(0, 1 << 20, (1 << 17,), dtype=torch.int32)
    assert page_keys(tokens, 512) == chain(tokens.tolist(), 512)


@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="SGLang is not installed (bench/PEERS.md has the recipe)",
)
@pytest.mark.parametrize("page", [1, 16, 64])
def test_without_a_seed_the_keys_are_sglangs(page):
    try:
        from sglang.srt.mem_cache.utils import get_hash_str

        ref = get_hash_str(list(range(3 * page)), None, page)
    except Exception as e:  # its hash is a C++ extension built on first use
        pytest.skip(f"SGLang's page hash could not be built here: {e}")
    g = torch.Generator().manual_seed(page)
    tokens = torch.randint(0, 150_000, (page * 6,), generator=g, dtype=torch.int32).tolist()
    assert page_keys(tokens, page) == get_hash_str(tokens, None, page)
    assert page_keys(list(range(3 * page)), page) == ref


BASE = dict(
    model="m",
    dtype=torch.bfloat16,
    page_size=16,
    layout="page_first",
    num_layers=4,
    kv_heads=8,
    head_dim=128,
)


@pytest.mark.parametrize(
    "change",
    [
        dict(dtype=torch.float16),
        dict(dtype="float8_e4m3fn"),
        dict(model="m2"),
        dict(namespace="tenant-a"),
        dict(namespace=""),
        dict(tp_rank=1, tp_size=2),
        dict(layout="layer_first"),
        dict(page_size=32),
        dict(num_layers=5),
        dict(kv_heads=4),
        dict(revision="3f2a9c1"),
    ],
)
def test_configurations_never_share_a_key(change):
    a = config_fingerprint(**BASE)
    b = config_fingerprint(**{**BASE, **change})
    assert len(a) == len(b) == 32 and a != b
    tokens = list(range(64))
    ka, kb = page_keys(tokens, 16, a), page_keys(tokens, 16, b)
    assert not set(ka) & set(kb)
    assert a == config_fingerprint(**BASE)  # deterministic


def test_a_revision_is_named_only_when_given():
    # Without one the keys are those of earlier versions (stores keep their pages).
    assert config_fingerprint(**BASE, revision=None) == config_fingerprint(**BASE)
    assert config_fingerprint(**BASE, revision="a") != config_fingerprint(**BASE, revision="b")
    for bad in ("", 3):
        with pytest.raises(ValueError, match="revision"):
            config_fingerprint(**BASE, revision=bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size"):
        page_keys([1, 2], 0)
    with pytest.raises(ValueError, match="seed"):
        page_keys([1, 2], 1, b"short")
    with pytest.raises(TypeError, match="seed"):
        page_keys([1, 2], 1, "not bytes")
    with pytest.raises(TypeError, match="input_ids"):
        page_keys([1.5], 1)


def test_crc32c_of_the_file_backend():
    import numpy as np

    from radixkv import _core

    assert _core.crc32c(b"123456789") == 0xE3069283
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
    whole = _core.crc32c(data)  # large: computed without the GIL
    assert _core.crc32c(memoryview(data)[1000:], _core.crc32c(memoryview(data)[:1000])) == whole
    data[123_456] ^= 1
    assert _core.crc32c(data) != whole
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        _core.crc32c(np.arange(10, dtype=np.uint8)[::2])
    with pytest.raises(TypeError):
        _core.crc32c("text")
