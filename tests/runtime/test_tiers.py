"""Tiers, transfer kinds, devices, and the host pool's sizing, growth and errors
(checked exactly with a CPU stand-in for the pinned allocator)."""

from __future__ import annotations

import pytest
import torch

from slcompile.runtime import (
    HostPool,
    Tier,
    TransferEngine,
    TransferKind,
    compute_device,
    device_for,
    host_is_device,
    runtime_stats,
)
from slcompile.runtime.errors import HostPoolFullError


def test_enums_are_their_names():
    assert [tier.value for tier in Tier] == ["device", "host", "nvme"]
    assert [kind.value for kind in TransferKind] == [
        "weight", "activation", "gradient", "optimizer_state", "kv", "all_gather", "reduce_scatter", "all_reduce",
    ]
    assert Tier("nvme") is Tier.NVME and TransferKind("kv") is TransferKind.KV


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only layout")
def test_cpu_machine_host_is_device_memory():
    assert compute_device() == torch.device("cpu")
    assert host_is_device()
    assert device_for("device") == device_for(Tier.HOST) == torch.device("cpu")


def test_nvme_has_no_torch_device():
    with pytest.raises(ValueError, match="no torch device"):
        device_for(Tier.NVME)


PAGE = 4096


class RecordingAllocator:
    """A CPU stand-in for pinned allocation that records each request (and can fail)."""

    def __init__(self, fail_after: int | None = None):
        self.requests: list[int] = []
        self.fail_after = fail_after

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self.fail_after is not None and len(self.requests) >= self.fail_after:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        self.requests.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def test_host_pool_blocks_are_page_aligned_reused_and_capped():
    pool = HostPool(4 * PAGE, pin=False, limit_bytes=4 * PAGE)
    first = pool.allocate(100, key="a")
    second = pool.allocate(PAGE + 1, key="b")
    assert first.buffer.data_ptr() % PAGE == 0 and second.buffer.data_ptr() % PAGE == 0
    assert pool.used_bytes == 3 * PAGE
    with pytest.raises(HostPoolFullError, match="'c'") as caught:
        pool.allocate(2 * PAGE, key="c")
    assert "host_memory=16384" in str(caught.value) and "at least 24576" in str(caught.value)
    pool.release(second)
    again = pool.allocate(3 * PAGE, key="c")
    assert again.buffer.numel() == 3 * PAGE


def test_host_pool_reserves_the_plan_in_chunks_once():
    allocator = RecordingAllocator()
    pool = HostPool(chunk_bytes=4 * PAGE, allocate_chunk=allocator)
    assert pool.capacity_bytes == 0 and allocator.requests == []
    growth = pool.reserve(10 * PAGE - 100)  # rounded up to 10 pages: 4 + 4 + 2
    assert growth.chunk_bytes == (4 * PAGE, 4 * PAGE, 2 * PAGE) and growth.added_bytes == 10 * PAGE
    assert allocator.requests == [5 * PAGE, 5 * PAGE, 3 * PAGE]  # one spare page each, for alignment
    assert pool.capacity_bytes == growth.capacity_bytes == 10 * PAGE and pool.chunk_sizes == growth.chunk_bytes
    assert pool.reserve(10 * PAGE) is None and len(allocator.requests) == 3  # already free
    blocks = [pool.allocate(4 * PAGE), pool.allocate(4 * PAGE), pool.allocate(2 * PAGE)]
    assert [block.chunk for block in blocks] == [0, 1, 2] and pool.free_bytes == 0
    assert len(allocator.requests) == 3  # a plan that fits pins nothing per transfer
    assert pool.reserve(PAGE).chunk_bytes == (PAGE,)  # only what is missing
    assert pool.capacity_bytes == 11 * PAGE and [g.reason for g in pool.growths] == ["plan", "plan"]


def test_host_pool_chunks_hold_the_largest_tensor():
    allocator = RecordingAllocator()
    pool = HostPool(chunk_bytes=4 * PAGE, allocate_chunk=allocator)
    assert pool.reserve(3 * PAGE, largest=6 * PAGE).chunk_bytes == (6 * PAGE,)
    assert pool.reserve(13 * PAGE, largest=5 * PAGE).chunk_bytes == (5 * PAGE, 5 * PAGE)  # 3 pages were free
    assert pool.allocate(6 * PAGE).chunk == 0 and pool.capacity_bytes == 16 * PAGE


def test_host_pool_grows_by_whole_chunks_for_tensors_the_plan_missed():
    allocator = RecordingAllocator()
    grown = []
    pool = HostPool(4 * PAGE, chunk_bytes=4 * PAGE, allocate_chunk=allocator, on_growth=grown.append)
    pool.allocate(3 * PAGE)
    pool.allocate(2 * PAGE)  # does not fit the first chunk's last page: one more chunk
    pool.allocate(PAGE)  # fits the first chunk
    pool.allocate(9 * PAGE)  # larger than a chunk: a chunk of its own
    assert pool.chunk_sizes == (4 * PAGE, 4 * PAGE, 9 * PAGE)
    assert [(g.added_bytes, g.reason) for g in grown] == [(4 * PAGE, "plan"), (4 * PAGE, "demand"), (9 * PAGE, "demand")]
    assert pool.used_bytes == 15 * PAGE and pool.capacity_bytes == 17 * PAGE


def test_host_pool_over_host_memory_names_the_bytes_and_the_option():
    allocator = RecordingAllocator()
    pool = HostPool(chunk_bytes=4 * PAGE, limit_bytes=8 * PAGE, allocate_chunk=allocator)
    with pytest.raises(HostPoolFullError) as caught:
        pool.reserve(12 * PAGE, what="the compiled plan's host tier")
    message = str(caught.value)
    assert "the compiled plan's host tier needs 49152 bytes" in message
    assert "host_memory=32768" in message and "at least 49152" in message
    assert allocator.requests == [] and pool.capacity_bytes == 0  # nothing half-pinned


def test_host_pool_failed_pinning_is_reported_with_the_bytes_needed():
    pool = HostPool(chunk_bytes=4 * PAGE, allocate_chunk=RecordingAllocator(fail_after=1))
    with pytest.raises(HostPoolFullError) as caught:
        pool.reserve(8 * PAGE)
    message = str(caught.value)
    assert "allocating 16384 bytes" in message and "needs 32768 bytes" in message
    assert "host_memory" in message and "out of memory" in message
    assert pool.capacity_bytes == 0  # the chunk that succeeded is not kept half-counted


def test_engine_pins_nothing_where_host_is_device(engine):
    if not host_is_device():
        pytest.skip("CPU machines only")
    assert engine.reserve_host(1 << 30) is None
    assert engine.host_pool is None and runtime_stats().pinned_host_bytes == 0


@pytest.mark.cuda_check
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pins host memory: CUDA machines only")
def test_engine_reserve_pins_plan_bytes_and_counts_them(tmp_path):
    engine = TransferEngine(offload_dir=str(tmp_path), host_chunk_bytes=1 << 20)
    before = runtime_stats().pinned_host_bytes
    try:
        growth = engine.reserve_host(3 * (1 << 20) + 1, what="a test plan")
        assert growth.chunk_bytes == (1 << 20, 1 << 20, 1 << 20, PAGE)
        assert engine.host_pool.pinned and runtime_stats().pinned_host_bytes - before == 3 * (1 << 20) + PAGE
        with pytest.raises(HostPoolFullError, match="host_memory"):
            engine.reserve_host(8 << 20, host_memory=4 << 20)
    finally:
        engine.close()
