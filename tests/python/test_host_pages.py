"""HostPageIndex: the names radixkv's host tier holds for an engine that
names its blocks (the vLLM connector's scheduler side): exact LRU, pinned
pages never taken, dropped names' pages reused only once unpinned."""

import pytest
import torch

from radixkv.compat.host_pages import HostBlocks, HostPageIndex


def test_free_pages_first_then_the_least_recently_used():
    index = HostPageIndex(3)
    pages = [index.take(n) for n in "abc"]
    assert sorted(pages) == [0, 1, 2]
    index.unpin(pages)
    assert index.get("a") == pages[0]  # "a" is now the most recent: "b" goes first
    d = index.take("d")
    assert d == pages[1] and index.get("b") is None and index.evictions == 1
    index.unpin([d])
    assert index.run(["a", "c", "d", "b", "a"]) == 3


def test_a_name_it_holds_keeps_its_page():
    index = HostPageIndex(2)
    p = index.take("a")
    index.unpin([p])
    assert index.take("a") == p and len(index) == 1


def test_pinned_pages_are_never_taken():
    index = HostPageIndex(2)
    a, b = index.take("a"), index.take("b")
    assert index.take("c") is None  # both pinned
    index.unpin([a])
    assert index.take("c") == a and index.get("a") is None
    index.pin(b)
    index.unpin([b])
    assert index.take("d") is None  # b still pinned once, c pinned by its take
    index.unpin([b])
    assert index.take("d") == b


def test_a_dropped_page_is_reused_once_unpinned():
    index = HostPageIndex(2)
    a, b = index.take("a"), index.take("b")
    index.unpin([b])
    index.drop("a", a)  # pinned: its page waits
    assert index.get("a") is None
    assert index.take("c") == b  # the only page that is free to take
    index.unpin([a])
    assert index.take("d") == a
    index.drop("c", a)  # "c" is not on that page: nothing happens
    assert index.get("c") == b


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="num_pages"):
        HostPageIndex(0)
    with pytest.raises(TypeError, match="num_pages"):
        HostPageIndex(2.0)


# -- HostBlocks: the worker's copies between the layers' blocks and host pages ------------

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"
        ),
    ),
]


def _layers(device, blocks=6, layers=3, vllm_shape=True):
    """Layers shaped as vLLM's [2, blocks, block size, heads, head size] (or
    the blocks-first [blocks, 2, ...]), each holding distinct values."""
    shape = (2, blocks, 4, 2, 8) if vllm_shape else (blocks, 2, 4, 2, 8)
    n = 1
    for s in shape:
        n *= s
    return {
        f"layer.{i}": (torch.arange(n, dtype=torch.float32) + 10_000 * i).view(shape).to(device)
        for i in range(layers)
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vllm_shape", [True, False])
def test_blocks_go_to_host_pages_and_come_back_elsewhere(device, vllm_shape):
    caches = _layers(device, vllm_shape=vllm_shape)
    before = {k: v.clone() for k, v in caches.items()}
    hb = HostBlocks(caches, 6)
    assert hb.page_elems == 3 * 2 * 4 * 2 * 8 and hb.dtype == torch.float32
    hb.open_host(4)
    assert hb.rows.shape == (4, hb.page_elems) and hb.rows.device.type == "cpu"
    hb.to_host([1, 4], [3, 0])
    d = 1 if vllm_shape else 0
    hb.from_host([3, 0], [5, 2])  # block 1 -> 5, block 4 -> 2
    hb.rows.fill_(0)  # the host pages are free to reuse once from_host returned
    if device == "cuda":
        torch.cuda.synchronize()
    for name, t in caches.items():
        want = before[name].clone()
        want.select(d, 5).copy_(before[name].select(d, 1))
        want.select(d, 2).copy_(before[name].select(d, 4))
        assert torch.equal(t.cpu(), want.cpu()), name


@pytest.mark.parametrize("device", DEVICES)
def test_one_block_to_a_flat_page_and_back(device):
    caches = _layers(device)
    hb = HostBlocks(caches, 6)
    page = torch.empty(hb.page_elems, dtype=torch.float32)
    hb.copy_out(3, page)
    assert torch.equal(page[: 2 * 4 * 2 * 8].view(2, 4, 2, 8), caches["layer.0"][:, 3].cpu())
    hb.copy_in(page, 0)
    for t in caches.values():
        assert torch.equal(t[:, 0].cpu(), t[:, 3].cpu())


def test_layers_without_one_block_dimension_are_refused_by_name():
    with pytest.raises(ValueError, match="kv_caches.*layer.x"):
        HostBlocks({"layer.x": torch.zeros(4, 4, 2)}, 4)
    with pytest.raises(ValueError, match="kv_caches.*dtype"):
        HostBlocks({"a": torch.zeros(2, 4, 3), "b": torch.zeros(2, 4, 3, dtype=torch.half)}, 4)
    with pytest.raises(ValueError, match="kv_caches: no layer"):
        HostBlocks({}, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        HostBlocks({"a": torch.zeros(2, 4, 3)}, 0)
    hb = HostBlocks({"a": torch.zeros(2, 4, 3)}, 4)  # [2, blocks, ...]: dimension 1
    assert hb.layers[0][1] == 1 and hb.page_elems == 6
