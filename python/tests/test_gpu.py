"""CUDA device memory through Mooncake's pointer calls, as vLLM's
MooncakeStoreConnector and SGLang's HiCache use them: the KV cache is a CUDA
tensor, registered with `register_buffer(tensor.data_ptr(), nbytes)`, put
from and read back into with `put_from` / `batch_put_from` / `get_into` /
`batch_get_into` (and the multi-buffer forms).

The device tests run where torch sees a CUDA device and skip with the reason
elsewhere; the host-memory test runs everywhere (with or without a CUDA
driver, host memory takes the host path and nothing it accepted is refused).
"""

import ctypes

import pytest

from kvpool.mooncake import MooncakeDistributedStore

MIB = 1 << 20
INVALID_PARAMS = -600

try:
    import torch

    CUDA = torch.cuda.is_available()
    WHY = "torch sees no CUDA device"
except ImportError:  # pragma: no cover - depends on the machine
    torch = None
    CUDA = False
    WHY = "torch is not installed"

gpu = pytest.mark.skipif(not CUDA, reason=f"needs a CUDA device: {WHY}")


@pytest.fixture
def store(pool):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr) == 0
    yield s
    s.close()


def pattern(n, seed):
    """`n` bytes on the device, different per seed and position."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


@gpu
def test_put_from_and_get_into_device_memory_round_trip_its_bytes(store, keys):
    src = pattern(3 * MIB + 17, 1)
    dst = torch.zeros_like(src)
    assert store.register_buffer(src.data_ptr(), src.numel()) == 0
    assert store.register_buffer(dst.data_ptr(), dst.numel()) == 0
    k = keys("one")
    assert store.put_from(k, src.data_ptr(), src.numel()) == 0
    # What the pool holds is the device's bytes (read back through host memory).
    assert store.get(k) == src.cpu().numpy().tobytes()
    assert store.get_into(k, dst.data_ptr(), dst.numel()) == src.numel()
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
    # Too small a device destination is -600 and writes nothing.
    small = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
    assert store.register_buffer(small.data_ptr(), small.numel()) == 0
    assert store.get_into(k, small.data_ptr(), small.numel()) == INVALID_PARAMS
    assert int(small.count_nonzero()) == 0


@gpu
def test_a_kv_cache_of_blocks_goes_to_the_pool_and_back_in_batches(store, keys):
    # vLLM's layout: one tensor of blocks, each block one object.
    blocks, block = 96, 256 * 1024
    cache = pattern(blocks * block, 2)
    out = torch.zeros_like(cache)
    assert store.register_buffer(cache.data_ptr(), cache.numel()) == 0
    assert store.register_buffer(out.data_ptr(), out.numel()) == 0
    ks = [keys(f"block{i}") for i in range(blocks)]
    ptrs = [cache.data_ptr() + i * block for i in range(blocks)]
    assert store.batch_put_from(ks, ptrs, [block] * blocks) == [0] * blocks
    optrs = [out.data_ptr() + i * block for i in range(blocks)]
    # Read back in reverse order: every block lands where it is asked for.
    got = store.batch_get_into(ks[::-1], optrs, [block] * blocks)
    assert got == [block] * blocks
    torch.cuda.synchronize()
    assert torch.equal(out.view(blocks, block), cache.view(blocks, block).flip(0))


@gpu
def test_multi_buffer_calls_gather_and_scatter_device_parts(store, keys):
    # SGLang's layout: a key's K and V halves in two tensors.
    layers, part = 4, 64 * 1024
    k_cache, v_cache = pattern(layers * part, 3), pattern(layers * part, 4)
    k_out, v_out = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t in (k_cache, v_cache, k_out, v_out):
        assert store.register_buffer(t.data_ptr(), t.numel()) == 0
    ks = [keys(f"layer{i}") for i in range(layers)]
    src = [[k_cache.data_ptr() + i * part, v_cache.data_ptr() + i * part] for i in range(layers)]
    dst = [[k_out.data_ptr() + i * part, v_out.data_ptr() + i * part] for i in range(layers)]
    sizes = [[part, part]] * layers
    assert store.batch_put_from_multi_buffers(ks, src, sizes) == [0] * layers
    assert store.batch_get_into_multi_buffers(ks, dst, sizes) == [2 * part] * layers
    torch.cuda.synchronize()
    assert torch.equal(k_out, k_cache) and torch.equal(v_out, v_cache)
    # One object is K then V.
    i = 2
    want = k_cache[i * part:(i + 1) * part].cpu().numpy().tobytes() + \
        v_cache[i * part:(i + 1) * part].cpu().numpy().tobytes()
    assert store.get(ks[i]) == want


@gpu
def test_one_batch_mixes_device_and_host_buffers(store, keys):
    dev = pattern(2 * MIB, 5)
    host = (ctypes.c_uint8 * (2 * MIB)).from_buffer_copy(bytes(range(256)) * (2 * MIB // 256))
    assert store.register_buffer(dev.data_ptr(), dev.numel()) == 0
    assert store.register_buffer(ctypes.addressof(host), 2 * MIB) == 0
    ks = [keys("dev"), keys("host")]
    assert store.batch_put_from(ks, [dev.data_ptr(), ctypes.addressof(host)], [2 * MIB] * 2) == [0, 0]
    assert store.get(ks[0]) == dev.cpu().numpy().tobytes()
    assert store.get(ks[1]) == bytes(host)
    # Read crosswise: the host value into device memory and back.
    dev_out = torch.zeros_like(dev)
    host_out = (ctypes.c_uint8 * (2 * MIB))()
    assert store.register_buffer(dev_out.data_ptr(), dev_out.numel()) == 0
    assert store.register_buffer(ctypes.addressof(host_out), 2 * MIB) == 0
    got = store.batch_get_into(ks, [ctypes.addressof(host_out), dev_out.data_ptr()], [2 * MIB] * 2)
    assert got == [2 * MIB] * 2
    torch.cuda.synchronize()
    assert bytes(host_out) == dev.cpu().numpy().tobytes()
    assert dev_out.cpu().numpy().tobytes() == bytes(host)


@gpu
def test_a_device_range_past_its_allocation_is_refused(store):
    t = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
    assert store.register_buffer(t.data_ptr(), 1 << 40) == INVALID_PARAMS


@gpu
def test_pinned_host_memory_takes_the_host_path(store, keys):
    # cudaHostAlloc memory is host memory the driver knows: sent in place.
    t = torch.arange(MIB, dtype=torch.int32).to(torch.uint8).pin_memory()
    assert store.register_buffer(t.data_ptr(), t.numel()) == 0
    k = keys("pinned")
    assert store.put_from(k, t.data_ptr(), t.numel()) == 0
    assert store.get(k) == t.numpy().tobytes()


def test_host_memory_round_trips_with_or_without_a_cuda_driver(store, keys):
    # The CPU path of the pointer calls refuses nothing it accepted before
    # device memory was told apart.
    n = 5 * MIB + 3
    src = (ctypes.c_uint8 * n).from_buffer_copy((bytes(range(251)) * (n // 251 + 1))[:n])
    dst = (ctypes.c_uint8 * n)()
    assert store.register_buffer(ctypes.addressof(src), n) == 0
    assert store.register_buffer(ctypes.addressof(dst), n) == 0
    k = keys("host")
    assert store.put_from(k, ctypes.addressof(src), n) == 0
    assert store.get_into(k, ctypes.addressof(dst), n) == n
    assert bytes(dst) == bytes(src)
    half = n // 2
    ks = [keys("h0"), keys("h1")]
    ptrs = [ctypes.addressof(src), ctypes.addressof(src) + half]
    assert store.batch_put_from(ks, ptrs, [half, n - half]) == [0, 0]
    ctypes.memset(dst, 0, n)
    assert store.batch_get_into(ks, [ctypes.addressof(dst), ctypes.addressof(dst) + half],
                                [half, n - half]) == [half, n - half]
    assert bytes(dst) == bytes(src)
