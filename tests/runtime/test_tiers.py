"""Tiers, transfer kinds, devices, the host pool's sizing, growth and errors
(checked exactly with a CPU stand-in for the pinned allocator), and the memory
limits it checks a growth against."""

from __future__ import annotations

import ctypes
import gc
import threading

import pytest
import torch

from slcompile.runtime import (
    HostPool,
    Tier,
    TransferEngine,
    TransferKind,
    compute_device,
    device_for,
    finalizing,
    host_is_device,
    runtime_stats,
)
from slcompile.runtime.errors import HostPoolFullError
from slcompile.runtime.storage.memory_limits import AvailableMemory, available_host_memory
from slcompile.runtime.storage.tiers import pageable_chunk, pinned_chunk


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
    """A CPU stand-in for pinned allocation, page-aligned as the pinned allocator is,
    that records each request (and can fail)."""

    def __init__(self, fail_after: int | None = None):
        self.requests: list[int] = []
        self.fail_after = fail_after

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self.fail_after is not None and len(self.requests) >= self.fail_after:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        self.requests.append(nbytes)
        return pageable_chunk(nbytes)


class UnalignedAllocator(RecordingAllocator):
    """Returns memory 64 bytes past a page boundary, as torch's CPU allocator may."""

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.requests.append(nbytes)
        base = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
        start = -base.data_ptr() % PAGE + 64
        return base[start : start + nbytes]


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
    assert allocator.requests == [4 * PAGE, 4 * PAGE, 2 * PAGE]  # page-aligned: no spare page
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


def test_host_pool_books_exactly_the_bytes_it_pins():
    allocator = RecordingAllocator()
    grown = []
    pool = HostPool(chunk_bytes=4 * PAGE, pin=True, allocate_chunk=allocator, on_growth=grown.append,
                    available_memory=lambda: None)
    pool.reserve(10 * PAGE - 100)
    pool.allocate(9 * PAGE)  # on demand: a chunk of its own
    assert allocator.requests == [4 * PAGE, 4 * PAGE, 2 * PAGE, 9 * PAGE]  # no spare page
    assert [g.pinned_bytes for g in grown] == [g.added_bytes for g in grown] == [10 * PAGE, 9 * PAGE]
    assert pool.pinned_bytes == pool.capacity_bytes == sum(allocator.requests)
    pageable = HostPool(4 * PAGE, pin=False)
    assert pageable.pinned_bytes == 0 and pageable.growths[0].pinned_bytes == 0 and pageable.capacity_bytes == 4 * PAGE


def test_host_pool_aligns_memory_off_a_page_in_a_spare_page():
    allocator = UnalignedAllocator()
    pool = HostPool(chunk_bytes=4 * PAGE, pin=True, allocate_chunk=allocator, available_memory=lambda: None)
    growth = pool.reserve(4 * PAGE)
    assert allocator.requests == [4 * PAGE, 5 * PAGE]  # asked again, a page more
    assert growth.added_bytes == 4 * PAGE and growth.pinned_bytes == pool.pinned_bytes == 5 * PAGE
    block = pool.allocate(4 * PAGE)
    assert block.buffer.data_ptr() % PAGE == 0 and block.buffer.numel() == 4 * PAGE


def test_host_pool_refuses_to_pin_more_than_is_available_before_pinning():
    allocator = RecordingAllocator()
    available = AvailableMemory(8 * PAGE, "the cgroup's limit: cg/memory.max minus cg/memory.current")
    pool = HostPool(chunk_bytes=4 * PAGE, pin=True, allocate_chunk=allocator, available_memory=lambda: available)
    with pytest.raises(HostPoolFullError) as caught:
        pool.reserve(9 * PAGE - 100, what="the compiled plan's host tier")
    message = str(caught.value)
    assert "the compiled plan's host tier needs 36764 bytes of pinned host memory" in message
    assert ("would pin 36864 more, over the 32768 bytes available "
            "(the cgroup's limit: cg/memory.max minus cg/memory.current)") in message
    assert "host_memory option" in message
    assert allocator.requests == [] and pool.capacity_bytes == pool.pinned_bytes == 0 and pool.growths == []
    with pytest.raises(HostPoolFullError, match=r"over the 32768 bytes available.*'big'"):
        pool.allocate(9 * PAGE, key="big")
    assert allocator.requests == []
    assert pool.reserve(8 * PAGE).pinned_bytes == 8 * PAGE  # within the figure: pinned
    assert allocator.requests == [4 * PAGE, 4 * PAGE]


def test_a_pinning_pool_checks_the_machine_by_default():
    allocator = RecordingAllocator()
    pool = HostPool(pin=True, allocate_chunk=allocator)
    with pytest.raises(HostPoolFullError, match=r"over the \d+ bytes available \((MemAvailable|the cgroup's)"):
        pool.reserve(1 << 50, largest=1 << 50)  # a petabyte: more than any machine here has
    assert allocator.requests == []


def _is_mapped(address: int, nbytes: int) -> bool:
    """Whether the pages at `address` are mapped (msync fails with ENOMEM where not)."""
    return ctypes.CDLL(None).msync(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), 1) == 0  # MS_ASYNC


class FakeCudart:
    """`torch.cuda.cudart()` as `pinned_chunk` uses it: records what is registered,
    and, as it unregisters memory, its first byte if it is still mapped (False if
    not); `fail` refuses every registration. An unregistering deferred to another
    thread waits for `collected`, as it may when the thread runs late."""

    class cudaError:  # noqa: N801 - torch's name
        success = 0

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.unregistered: list[bytes | bool] = []
        self.collected = threading.Event()
        self._thread = threading.get_ident()

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802
        if self.fail:
            return 2
        assert address % PAGE == 0 and flags == 0
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        if threading.get_ident() != self._thread:
            self.collected.wait(30)
        nbytes = self.registered.pop(address)
        self.unregistered.append(_is_mapped(address, nbytes) and ctypes.string_at(address, 1))
        return 0

    def cudaGetErrorString(self, status: int) -> str:  # noqa: N802
        return "out of memory"


def test_pinned_chunk_registers_exactly_its_pages_until_the_last_view_dies(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    chunk = pinned_chunk(3 * PAGE)
    assert cudart.registered == {chunk.data_ptr(): 3 * PAGE} and chunk.numel() == 3 * PAGE
    chunk[0] = 7
    view = chunk[PAGE:]
    del chunk
    assert len(cudart.registered) == 1  # a view still uses the memory
    del view
    assert cudart.registered == {} and cudart.unregistered == [b"\x07"]  # unpinned, then unmapped
    ring = [pinned_chunk(PAGE)]  # dies in a garbage collection: unpinned on the finalizing thread
    ring[0][0] = 9
    ring.append(ring)
    del ring
    gc.collect()
    cudart.collected.set()
    assert finalizing.settle(30)
    assert cudart.registered == {} and cudart.unregistered == [b"\x07", b"\x09"]


def test_a_refused_registration_is_a_host_pool_full_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(fail=True))
    pool = HostPool(chunk_bytes=4 * PAGE, pin=True, available_memory=lambda: None)
    with pytest.raises(HostPoolFullError, match="cudaHostRegister of 16384 bytes failed: out of memory"):
        pool.reserve(4 * PAGE)
    assert pool.pinned_bytes == pool.capacity_bytes == 0


MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\nBuffers: 1 kB\n"
MEM_AVAILABLE = 8000000 * 1024
GIB = 1 << 30
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for "no limit"


def _fake_machine(directory, *, meminfo=MEMINFO, v2=None, v1=None) -> dict:
    """Writes a /proc/meminfo and cgroup files ((limit, usage) for v2 or v1) under
    `directory`; returns `available_host_memory`'s arguments for them."""
    cgroup = directory / "cgroup"
    cgroup.mkdir(parents=True)
    if meminfo is not None:
        (directory / "meminfo").write_text(meminfo)
    if v2 is not None:
        (cgroup / "memory.max").write_text(f"{v2[0]}\n")
        (cgroup / "memory.current").write_text(f"{v2[1]}\n")
    if v1 is not None:
        (cgroup / "memory").mkdir()
        (cgroup / "memory" / "memory.limit_in_bytes").write_text(f"{v1[0]}\n")
        (cgroup / "memory" / "memory.usage_in_bytes").write_text(f"{v1[1]}\n")
    return {"meminfo_path": str(directory / "meminfo"), "cgroup_dir": str(cgroup)}


@pytest.mark.parametrize("cgroup", [{}, {"v2": ("max", GIB)}, {"v1": (V1_UNLIMITED, GIB)},
                                    {"v2": (16 * GIB, GIB)}], ids=["none", "v2-max", "v1-unlimited", "v2-above"])
def test_available_memory_is_memavailable_where_the_cgroup_allows_more(tmp_path, cgroup):
    paths = _fake_machine(tmp_path, **cgroup)
    assert available_host_memory(**paths) == AvailableMemory(MEM_AVAILABLE, f"MemAvailable in {tmp_path}/meminfo")


def test_available_memory_is_the_cgroup_limit_minus_usage_where_smaller(tmp_path):
    v2 = available_host_memory(**_fake_machine(tmp_path / "a", v2=(4 * GIB, GIB)))
    assert v2 == AvailableMemory(3 * GIB, f"the cgroup's limit: {tmp_path}/a/cgroup/memory.max "
                                          f"minus {tmp_path}/a/cgroup/memory.current")
    v1 = available_host_memory(**_fake_machine(tmp_path / "b", v1=(2 * GIB, GIB // 2)))
    assert v1 == AvailableMemory(3 * GIB // 2, f"the cgroup's limit: {tmp_path}/b/cgroup/memory/memory.limit_in_bytes "
                                               f"minus {tmp_path}/b/cgroup/memory/memory.usage_in_bytes")
    over = available_host_memory(**_fake_machine(tmp_path / "c", v2=(GIB, GIB + PAGE)))
    assert over.available_bytes == 0  # usage can pass the limit for a moment


def test_available_memory_without_files_is_what_remains_or_none(tmp_path):
    assert available_host_memory(**_fake_machine(tmp_path / "a", meminfo=None)) is None
    assert available_host_memory(**_fake_machine(tmp_path / "b", meminfo="MemTotal: 1 kB\n")) is None
    cgroup_only = available_host_memory(**_fake_machine(tmp_path / "c", meminfo=None, v2=(4 * GIB, GIB)))
    assert cgroup_only.available_bytes == 3 * GIB
    no_usage = _fake_machine(tmp_path / "d", v2=(GIB, 0))
    (tmp_path / "d" / "cgroup" / "memory.current").unlink()
    assert available_host_memory(**no_usage).available_bytes == MEM_AVAILABLE


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


@pytest.mark.cuda_check
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pins host memory: CUDA machines only")
def test_host_pool_pins_exactly_what_it_books_on_cuda():
    pool = HostPool(chunk_bytes=1 << 20)
    growth = pool.reserve(3 * (1 << 20) + 1)
    assert pool.pinned and growth.chunk_bytes == (1 << 20, 1 << 20, 1 << 20, PAGE)
    assert pool.pinned_bytes == growth.pinned_bytes == growth.added_bytes == pool.capacity_bytes == 3 * (1 << 20) + PAGE
    block = pool.allocate(1 << 20)
    assert block.buffer.is_pinned() and block.buffer.data_ptr() % PAGE == 0
    values = torch.arange(1 << 20, dtype=torch.int32).to(torch.uint8)
    block.buffer.copy_(values)
    on_device = block.buffer.to(compute_device(), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), values)
    chunk = pinned_chunk(2 * PAGE)  # a size torch's pinned allocator would round up
    assert chunk.is_pinned() and chunk.numel() == 2 * PAGE and chunk.data_ptr() % PAGE == 0
