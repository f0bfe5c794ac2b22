"""TransferEngine: bit-exact round trips, concurrency, zero-copy tiers, exact counters,
residency, refusals."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import pytest
import torch
from devices import device_under_test, on_cuda, same_bits

from slcompile.runtime import (
    Tier,
    TransferEngine,
    TransferKind,
    UnknownKeyError,
    UnsupportedTensorError,
    collect_garbage,
    runtime_stats,
)
from slcompile.runtime.stats import Recorder

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)
SIZES = (0, 1, 4097, 3 * (1 << 20) + 5)  # empty, one element, odd, several MiB
NVME = Tier.NVME
DEVICE = Tier.DEVICE
HOST = Tier.HOST
WEIGHT = TransferKind.WEIGHT
DEV = device_under_test()
pytestmark = pytest.mark.cuda_check  # round trips on the device under test: real copies on CUDA


def sample(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """Random values covering every bit pattern region of the dtype, on the test device."""
    generator = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        values = torch.randint(0, 2, (numel,), generator=generator).bool()
    elif dtype is torch.int64:
        values = torch.randint(-(2**62), 2**62, (numel,), generator=generator)
    else:
        values = (torch.randn(numel, generator=generator) * 1e3).to(dtype)
    return values.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvme_round_trip_is_bit_exact(engine, dtype):
    for index, numel in enumerate(SIZES):
        original = sample(dtype, numel, seed=index)
        engine.wait(engine.store(f"t{index}", original, "nvme", "weight"))
        loaded = engine.wait(engine.load(f"t{index}"))
        assert loaded.dtype == dtype and loaded.shape == original.shape
        assert same_bits(loaded, original)


def test_special_float_values_survive(engine):
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45], device=DEV)
    engine.wait(engine.store("special", special, NVME, WEIGHT))
    assert same_bits(engine.wait(engine.load("special")), special)


def test_shapes_and_zero_dim_tensors_keep_their_shape(engine):
    for key, original in {
        "scalar": torch.tensor(3.5, device=DEV),
        "matrix": sample(torch.float16, 6 * 7).view(6, 7),
        "empty": torch.empty(0, 5, dtype=torch.bfloat16, device=DEV),
    }.items():
        engine.wait(engine.store(key, original, NVME, WEIGHT))
        loaded = engine.wait(engine.load(key))
        assert loaded.shape == original.shape and same_bits(loaded, original)


@pytest.mark.skipif(on_cuda(), reason="nvme loads land in page-aligned host memory on CPU machines only")
def test_loaded_tensors_are_page_aligned_and_not_views(engine):
    engine.wait(engine.store("w", sample(torch.float32, 5000), NVME, WEIGHT))
    loaded = engine.wait(engine.load("w"))
    assert loaded.data_ptr() % 4096 == 0
    assert not loaded._is_view() and loaded.is_contiguous()


def test_many_concurrent_transfers_in_flight(engine):
    originals = {
        f"blk{index}.w": sample(DTYPES[index % len(DTYPES)], 1 + 37_813 * index, seed=index)
        for index in range(48)
    }
    stores = [engine.store(key, value, NVME, WEIGHT) for key, value in originals.items()]
    # Loads issued before their stores finished must read what the stores wrote.
    loads = {key: engine.load(key) for key in originals}
    for key in reversed(list(originals)):
        assert same_bits(engine.wait(loads[key]), originals[key]), key
    for handle in stores:
        assert handle.done()


def test_threads_issuing_at_once(engine):
    failures = []

    def worker(worker_index: int) -> None:
        for round_index in range(10):
            key = f"w{worker_index}.{round_index}"
            original = sample(torch.float32, 10_000 + round_index, seed=worker_index)
            engine.wait(engine.store(key, original, NVME, WEIGHT))
            if not same_bits(engine.wait(engine.load(key)), original):
                failures.append(key)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_store_replaces_and_loads_see_the_latest_value(engine):
    engine.wait(engine.store("k", torch.zeros(3000, device=DEV), NVME, WEIGHT))
    first_load = engine.load("k")
    engine.store("k", torch.ones(5000, device=DEV), NVME, WEIGHT)  # not waited: the load must chain
    assert same_bits(engine.wait(engine.load("k")), torch.ones(5000, device=DEV))
    assert same_bits(engine.wait(first_load), torch.zeros(3000, device=DEV))


def test_exact_bytes_per_kind_and_direction(engine):
    weight = torch.randn(1000, device=DEV)  # 4000 bytes
    activation = torch.randn(3, 5, dtype=torch.float16, device=DEV)  # 30 bytes
    engine.wait(engine.store("w", weight, "nvme", "weight"))
    engine.wait(engine.store("a", activation, "nvme", "activation"))
    engine.wait(engine.load("w"))
    engine.wait(engine.load("w"))
    engine.wait(engine.load("a", "gradient"))
    stats = runtime_stats()
    assert dict(stats.bytes_moved) == {
        (TransferKind.WEIGHT, DEVICE, NVME): 4000,
        (TransferKind.ACTIVATION, DEVICE, NVME): 30,
        (TransferKind.WEIGHT, NVME, DEVICE): 8000,
        (TransferKind.GRADIENT, NVME, DEVICE): 30,
    }
    assert stats.cumulative.transfers[(TransferKind.WEIGHT, NVME, DEVICE)] == 2
    assert stats.cumulative.total_bytes() == 12060
    assert stats.cumulative.local_copy_bytes == 0


@pytest.mark.skipif(on_cuda(), reason="host is device only on CPU machines")
def test_host_and_device_tiers_copy_nothing_on_cpu(engine):
    original = torch.randn(2048, device=DEV)
    for tier in (HOST, DEVICE):
        handle = engine.store(f"k{tier.value}", original, tier, WEIGHT)
        assert handle.done() and handle.zero_copy
        loaded = engine.wait(engine.load(f"k{tier.value}"))
        assert loaded.data_ptr() == original.data_ptr()
    assert dict(runtime_stats().bytes_moved) == {}
    assert not engine.has_arena  # no file was ever created


def test_non_contiguous_source_is_made_contiguous_and_counted(engine):
    original = torch.arange(64 * 48, dtype=torch.float32, device=DEV).view(64, 48).t()
    engine.wait(engine.store("t", original, NVME, WEIGHT))
    loaded = engine.wait(engine.load("t"))
    assert loaded.is_contiguous() and same_bits(loaded, original)
    stats = runtime_stats().cumulative
    assert stats.local_copy_bytes == 64 * 48 * 4
    assert stats.bytes_moved[(WEIGHT, DEVICE, NVME)] == 64 * 48 * 4


def test_view_of_a_larger_tensor_stores_only_its_values(engine):
    base = torch.arange(10_000, dtype=torch.int64, device=DEV)
    engine.wait(engine.store("v", base[4000:4100], NVME, WEIGHT))
    base.zero_()
    assert same_bits(engine.wait(engine.load("v")), torch.arange(4000, 4100, device=DEV))
    assert runtime_stats().bytes_moved[(WEIGHT, DEVICE, NVME)] == 800


def test_requires_grad_and_parameters_are_stored_as_values(engine):
    parameter = torch.nn.Parameter(torch.randn(300, device=DEV))
    engine.wait(engine.store("p", parameter, NVME, WEIGHT))
    loaded = engine.wait(engine.load("p"))
    assert not loaded.requires_grad and same_bits(loaded, parameter.detach())


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: torch.eye(3).to_sparse(), "layout"),
        (lambda: torch.empty(3, device="meta"), "meta"),
        (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "nested"),
        (lambda: [1.0, 2.0], "expected a torch.Tensor"),
    ],
    ids=["sparse", "meta", "quantized", "nested", "list"],
)
def test_unsupported_tensors_are_refused_with_the_reason(engine, make, reason):
    with pytest.raises(UnsupportedTensorError, match=reason) as caught:
        engine.store("bad", make(), NVME, WEIGHT)
    assert caught.value.key == "bad" and "'bad'" in str(caught.value)
    assert "bad" not in engine


def test_unknown_keys_are_named(engine):
    with pytest.raises(UnknownKeyError, match="'nope'"):
        engine.load("nope")
    with pytest.raises(UnknownKeyError, match="'nope'"):
        engine.free("nope")


def test_int_keys_mean_their_string(engine):
    engine.wait(engine.store(7, torch.ones(3, device=DEV), NVME, WEIGHT))
    assert "7" in engine and 7 in engine
    assert same_bits(engine.wait(engine.load("7")), torch.ones(3, device=DEV))
    with pytest.raises(TypeError):
        engine.store(True, torch.ones(3, device=DEV), NVME, WEIGHT)


@pytest.mark.usefixtures("without_collections")
def test_residency_tracks_slots_and_delivered_tensors(engine):
    # On CUDA a delivered tensor's residency ends with the tensor object: what earlier
    # tests left in reference cycles goes now, not while this test counts.
    collect_garbage()
    before = runtime_stats().resident_bytes
    engine.wait(engine.store("a", torch.zeros(1 << 18, device=DEV), NVME, WEIGHT))  # 1 MiB
    engine.wait(engine.store("b", torch.zeros(1 << 18, device=DEV), NVME, WEIGHT))
    loaded = engine.wait(engine.load("a"))
    during = runtime_stats()
    assert during.resident_bytes[NVME] - before[NVME] == 2 << 20
    assert during.resident_bytes[DEVICE] - before[DEVICE] == 1 << 20
    assert during.peak_bytes[NVME] >= before[NVME] + (2 << 20)
    del loaded
    engine.free("a")
    engine.free("b")
    after = runtime_stats()
    assert after.resident_bytes[NVME] == before[NVME]
    assert after.resident_bytes[DEVICE] == before[DEVICE]
    assert after.peak_bytes[NVME] >= before[NVME] + (2 << 20)


def test_thousands_of_small_tensors_share_one_file_and_reuse_space(engine):
    handles = [engine.store(f"s{index}", torch.full((10,), float(index), device=DEV), NVME, WEIGHT)
               for index in range(2000)]
    for handle in handles:
        engine.wait(handle)
    arena = engine.arena
    assert sorted(os.listdir(arena.path)) == ["arena.bin", "lock"]
    assert same_bits(engine.wait(engine.load("s1234")), torch.full((10,), 1234.0, device=DEV))
    file_bytes = arena.space.file_bytes
    for index in range(2000):
        engine.free(f"s{index}")
    assert arena.space.used_bytes == 0
    for index in range(2000):
        engine.store(f"r{index}", torch.ones(10, device=DEV), NVME, WEIGHT)
    assert arena.space.file_bytes == file_bytes


def test_closing_an_engine_finishes_every_store_in_flight(tmp_path, caplog):
    recorder = Recorder()
    engine = TransferEngine(offload_dir=str(tmp_path), recorder=recorder)
    handles = [engine.store(f"s{index}", torch.full((10,), float(index), device=DEV), NVME, WEIGHT)
               for index in range(2000)]
    engine.close()
    assert all(handle.done() for handle in handles)  # a wait on any of them returns
    busy = recorder.snapshot().cumulative.busy_seconds["store"]
    time.sleep(0.05)
    assert recorder.snapshot().cumulative.busy_seconds["store"] == busy  # the store lane is closed
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


def test_loads_issued_behind_their_stores_finish_with_hundreds_in_flight(tmp_path):
    """A load of a key whose store is in flight is issued when the store completes,
    on the I/O thread that wrote it: it must not wait there for a thread that only
    the queue behind it would free."""
    engine = TransferEngine(offload_dir=str(tmp_path))
    sources = [torch.full((256,), float(index), device=DEV) for index in range(512)]
    loaded = []

    def store_and_load():
        loads = []
        for index, source in enumerate(sources):
            engine.store(f"k{index}", source, NVME, TransferKind.ACTIVATION)
            loads.append(engine.load(f"k{index}"))
        loaded.extend(engine.wait(load) for load in loads)

    worker = threading.Thread(target=store_and_load, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "a transfer never completed"  # (closing would wait for it too)
    engine.close()
    assert len(loaded) == len(sources) and all(torch.equal(a, b) for a, b in zip(loaded, sources))


def test_free_waits_for_transfers_in_flight(engine):
    original = sample(torch.float32, 3 << 20)
    engine.store("big", original, NVME, WEIGHT)
    load = engine.load("big")
    engine.free("big")
    assert "big" not in engine
    assert same_bits(engine.wait(load), original)
    assert engine.arena.space.used_bytes == 0


@pytest.mark.skipif(on_cuda(), reason="torch's CPU allocator and its profiler")
def test_a_store_that_forgets_its_source_leaves_the_free_to_the_waiting_thread(engine, monkeypatch):
    """The graph drops a stashed activation right after waiting for its store; the
    memory must be freed there, on the graph's thread, even when the I/O thread is
    still finishing the store: freed on an I/O thread, it outlives the graph's
    reference and torch.profiler (which sees the graph's thread) never sees it go."""
    from torch.profiler import profile

    release = threading.Event()
    finish = engine._ledger.release_if_unused

    def lingering(entry):  # the I/O thread, after waking the waiter, is held up here
        if threading.current_thread() is not threading.main_thread():
            release.wait(10)
        finish(entry)

    monkeypatch.setattr(engine._ledger, "release_if_unused", lingering)
    with profile(profile_memory=True) as prof:
        source = torch.ones(1 << 16)
        handle = engine.store("stash", source, NVME, TransferKind.ACTIVATION, forget_source=True)
        assert engine.wait(handle) is None
        del source
        release.set()
    engine.free("stash")
    changes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert 4 * (1 << 16) in changes
    assert sum(changes) == 0, changes


@pytest.mark.skipif(on_cuda(), reason="the load buffer cache is the CPU path's")
@pytest.mark.usefixtures("without_collections")
def test_load_buffers_are_reused_after_the_tensor_dies(tmp_path):
    engine = TransferEngine(offload_dir=str(tmp_path), buffer_cache_bytes=1 << 20)
    try:
        engine.wait(engine.store("a", torch.full((5000,), 1.0, device=DEV), NVME, WEIGHT))
        engine.wait(engine.store("b", torch.full((5000,), 2.0, device=DEV), NVME, WEIGHT))
        first = engine.wait(engine.load("a"))
        address = first.data_ptr()
        del first
        second = engine.wait(engine.load("b"))
        assert second.data_ptr() == address  # same size: the idle buffer came back
        assert same_bits(second, torch.full((5000,), 2.0, device=DEV))
    finally:
        engine.close()


@pytest.mark.usefixtures("without_collections")
def test_no_idle_buffers_kept_without_a_cache(tmp_path):
    engine = TransferEngine(offload_dir=str(tmp_path), buffer_cache_bytes=0)
    try:
        engine.wait(engine.store("a", torch.ones(5000, device=DEV), NVME, WEIGHT))
        loaded = engine.wait(engine.load("a"))
        del loaded
        assert engine._ledger.buffers.idle_bytes == 0
    finally:
        engine.close()


def _live(kind) -> int:
    collect_garbage()
    return sum(1 for obj in gc.get_objects() if type(obj) is kind)


@pytest.mark.skipif(on_cuda(), reason="the memory of a CPU tensor, watched through numpy")
@pytest.mark.usefixtures("without_collections")
def test_a_stored_source_is_not_kept_once_it_is_written(engine):
    import weakref

    import numpy

    memory = numpy.ones(5000, dtype=numpy.float32)
    alive = weakref.ref(memory)  # dies with the last storage using this memory
    source = torch.from_numpy(memory)
    del memory
    engine.wait(engine.store("a", source, NVME, WEIGHT))
    del source
    assert alive() is None  # the key rests in the file, not in memory as well
    assert same_bits(engine.wait(engine.load("a")), torch.ones(5000))


@pytest.mark.usefixtures("without_collections")
def test_loaded_tensors_stored_again_keep_no_earlier_generation(engine):
    """The offloaded optimizer's pattern: load a state, update it in place, store it
    under a fresh key, free the old one. Nothing of an earlier generation may stay."""
    import weakref

    from slcompile.runtime.storage.engine import TransferHandle, _Entry

    # What other engines of the process still hold (a test before this one in the same worker) is not this one's.
    entries_before, handles_before = _live(_Entry), _live(TransferHandle)
    engine.wait(engine.store("state#0", torch.zeros(5000, device=DEV), NVME, TransferKind.OPTIMIZER_STATE))
    generations = []
    for generation in range(1, 9):
        state = engine.wait(engine.load(f"state#{generation - 1}"))
        state.add_(1)
        engine.wait(engine.store(f"state#{generation}", state, NVME, TransferKind.OPTIMIZER_STATE))
        engine.free(f"state#{generation - 1}")
        generations.append(weakref.ref(state))
        if generation == 4:
            kept = state  # a caller may hold a loaded tensor after its key is freed
        del state
    assert [ref() is not None for ref in generations] == [False] * 3 + [True] + [False] * 4
    assert engine.keys() == ["state#8"]
    assert _live(_Entry) - entries_before == 1 and _live(TransferHandle) - handles_before == 0
    assert same_bits(engine.wait(engine.load("state#8")), torch.full((5000,), 8.0, device=DEV))
    assert same_bits(kept, torch.full((5000,), 4.0, device=DEV))
