"""Runs of consecutive activation transfers as one call (`coalesce_transfers`), and
their nvme I/O as one job of the I/O threads (`nvme_io.batched`), a run of slots
written or read by one I/O."""

from __future__ import annotations

import os
import queue
import threading

import pytest
import torch
import torch.fx
from devices import flip_bits

from slcompile.passes.coalesce_transfers import coalesce_transfers
from slcompile.runtime import Tier, TransferEngine, TransferKind, ops, runtime_stats
from slcompile.runtime.activations import ActivationStash
from slcompile.runtime.errors import CorruptDataError, OffloadFileMissingError, TransferFailedError
from slcompile.runtime.storage.nvme_io import JOB_BYTES, IoThreads, batched
from slcompile.runtime.stats import Recorder
from slcompile.runtime.weights import WeightStreamer
from slcompile.vocabulary import (
    FETCH_ISSUE,
    FETCH_ISSUE_MANY,
    STASH,
    STASH_MANY,
    UNSTASH,
    UNSTASH_MANY,
    UNSTASH_WAIT,
    UNSTASH_WAIT_MANY,
    WAIT,
    WAIT_MANY,
)

ACT, DEVICE, NVME = TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME
CPU = torch.device("cpu")
SHAPES = (((3, 5), torch.float32), ((7,), torch.float16), ((2, 3, 4), torch.float32))


def _offload_roundtrip(stash: ActivationStash) -> torch.fx.GraphModule:
    """x0..x2 -> each made, all stored, waited for, loaded and returned (doubled)."""
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(len(SHAPES))]
    made = [graph.call_function(torch.ops.aten.mul.Tensor, (x, 2)) for x in inputs]
    tokens = [graph.call_function(STASH, (value, stash.graph_key(f"blk0.sb0.v{i}")))
              for i, value in enumerate(made)]
    done = [graph.call_function(WAIT, (token, [value])) for token, value in zip(tokens, made)]
    loads = [graph.call_function(UNSTASH, (token,)) for token in tokens]
    loaded = [graph.call_function(UNSTASH_WAIT, (load, list(shape), dtype, CPU))
              for load, (shape, dtype) in zip(loads, SHAPES)]
    graph.output((*loaded, *done))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape, dtype in SHAPES]


@pytest.mark.usefixtures("without_collections")
def test_runs_become_one_call_each_with_the_same_results_and_bytes(global_engine):
    stash = ActivationStash(global_engine, "nvme")
    single = _offload_roundtrip(stash)
    grouped, done = coalesce_transfers(_offload_roundtrip(stash))
    n = len(SHAPES)
    assert (done.groups, done.members) == (4, 4 * n)
    targets = [node.target for node in grouped.graph.nodes if node.op == "call_function"]
    assert {t: targets.count(t) for t in (STASH, WAIT, UNSTASH, UNSTASH_WAIT)} == dict.fromkeys(
        (STASH, WAIT, UNSTASH, UNSTASH_WAIT), 0)
    assert {t: targets.count(t) for t in (STASH_MANY, WAIT_MANY, UNSTASH_MANY, UNSTASH_WAIT_MANY)} == dict.fromkeys(
        (STASH_MANY, WAIT_MANY, UNSTASH_MANY, UNSTASH_WAIT_MANY), 1)
    (wait_many,) = [node for node in grouped.graph.nodes if node.target is WAIT_MANY]
    assert wait_many.args[1] == [node for node in grouped.graph.nodes if node.target is torch.ops.aten.mul.Tensor]

    inputs = _inputs()
    nbytes = sum(x.numel() * x.element_size() for x in inputs)
    moved = {}
    for name, module in (("single", single), ("grouped", grouped)):
        before = dict(runtime_stats().cumulative.bytes_moved)
        out = module(*inputs)
        after = runtime_stats().cumulative.bytes_moved
        moved[name] = {key: after[key] - before.get(key, 0) for key in after}
        for got, x in zip(out[:n], inputs):
            assert got.dtype == x.dtype and torch.equal(got, x * 2)
        del out
    assert moved["grouped"] == moved["single"] == {(ACT, DEVICE, NVME): nbytes, (ACT, NVME, DEVICE): nbytes}
    assert ops.pending_tokens() == 0
    assert global_engine.keys() == []


def test_a_run_of_loads_onto_two_devices_is_cut_between_them(global_engine):
    stash = ActivationStash(global_engine, "nvme")
    module = _offload_roundtrip(stash)
    last = [node for node in module.graph.nodes if node.target is UNSTASH_WAIT][-1]
    last.args = (*last.args[:3], torch.device("meta"))
    _, done = coalesce_transfers(module)
    waits = [node for node in module.graph.nodes if node.target in (UNSTASH_WAIT, UNSTASH_WAIT_MANY)]
    assert [(node.target, len(node.args[0]) if node.target is UNSTASH_WAIT_MANY else 1) for node in waits] == [
        (UNSTASH_WAIT_MANY, 2), (UNSTASH_WAIT, 1)]
    assert done.groups == 4


class _CountingQueue(queue.SimpleQueue):
    def __init__(self):
        self.puts = []

    def put(self, item, block=True, timeout=None):
        self.puts.append(item)
        super().put(item, block, timeout)


def _counting_threads(count: int) -> tuple[IoThreads, list]:
    threads = IoThreads(count, "test-io")
    threads._queue = _CountingQueue()
    return threads, threads._queue.puts


def test_batched_submissions_wake_the_threads_once_per_job_in_order():
    threads, puts = _counting_threads(2)
    ran, finished = [], threading.Event()
    try:
        with batched():
            for i in range(5):
                threads.submit(ran.append, i, nbytes=4096)
            with batched():  # an inner batch joins the outer one
                threads.submit(ran.append, 5, nbytes=4096)
            assert ran == [] and puts == []
        threads.submit(finished.set)
        assert finished.wait(10)
        assert ran == [0, 1, 2, 3, 4, 5]
        assert len(puts) == 2  # the run's one job, then `finished.set`
    finally:
        threads.shutdown()


def test_batched_jobs_hold_about_job_bytes_and_a_large_transfer_alone():
    threads, puts = _counting_threads(1)
    done = threading.Event()
    ran = []
    try:
        with batched():
            for i, nbytes in enumerate((JOB_BYTES // 2, JOB_BYTES // 2, 1, JOB_BYTES, 1)):
                threads.submit(ran.append, i, nbytes=nbytes)
        threads.submit(done.set)
        assert done.wait(10)
        assert ran == [0, 1, 2, 3, 4]
        jobs = [item for item in puts if item[0] != done.set]
        sizes = [len(args[0]) if len(args) == 1 and isinstance(args[0], list) else 1 for _, args in jobs]
        # [half, half] reach JOB_BYTES; then [1]; the large one alone; then [1].
        assert sizes == [2, 1, 1, 1]
    finally:
        threads.shutdown()


def test_a_run_of_weight_issues_is_one_call_and_one_read(global_engine, monkeypatch):
    streamer = WeightStreamer(global_engine, "nvme", live_blocks=2, group_issues=True)
    values = {f"w{i}": torch.randn(16, 8 * (i + 1)) for i in range(3)}
    expected = {name: value.clone() for name, value in values.items()}
    keys = []
    for name, value in values.items():
        stored = streamer.stored_key_for(name, value)
        streamer.offload(stored, value)
        keys.append(streamer.graph_key(stored).format())
    graph = torch.fx.Graph()
    tokens = [graph.call_function(FETCH_ISSUE, (key,)) for key in keys]
    graph.output(tuple(tokens))
    module, done = coalesce_transfers(torch.fx.GraphModule(torch.nn.Module(), graph))
    (group,) = [node for node in module.graph.nodes if node.op == "call_function"]
    assert (group.target, group.args, done.members) == (FETCH_ISSUE_MANY, (keys,), 3)
    assert list(module.graph.output_node().args[0]) == [group] * 3
    calls = _recording_io(monkeypatch)
    module()
    # A visit's issues are held until its first fetch, which starts their loads together.
    assert sorted(streamer.queued) == sorted(keys) and streamer.pending == {}
    for (name, value), key in zip(values.items(), keys):
        assert torch.equal(torch.ops.slc.fetch_weight(value, key), expected[name])
    assert streamer.pending == {}
    # The three weights follow each other in the arena file: one vectored read.
    assert [(op, len(sizes)) for op, sizes in calls] == [("preadv", 3)]
    assert runtime_stats().cumulative.bytes_moved[TransferKind.WEIGHT, NVME, DEVICE] == sum(
        value.numel() * 4 for value in expected.values())


def _run_values() -> list[torch.Tensor]:
    """Tensors of a run, none page-aligned: odd sizes, several dtypes, a view."""
    base = torch.randn(4 * 1000 + 3)
    return ([base[3 + 1000 * i: 3 + 1000 * (i + 1)] for i in range(4)]
            + [torch.randn(5, 7).half(), torch.rand(33) > 0.5, torch.arange(3, dtype=torch.int64)])


def _recording_io(monkeypatch) -> list[tuple[str, list[int]]]:
    """Each nvme read or write the arena makes, as `(os call, its buffers' sizes)`."""
    calls = []
    for name in ("preadv", "pwritev"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, buffers, offset, name=name, real=real: (
            calls.append((name, [len(buffer) for buffer in buffers])), real(fd, buffers, offset))[1])
    return calls


@pytest.mark.usefixtures("without_collections")
def test_a_run_of_stores_is_one_write_and_loads_back_in_one_read_in_any_order(engine, monkeypatch):
    if engine.device.type == "cuda":
        pytest.skip("a run is written by one I/O on a CPU machine")
    calls = _recording_io(monkeypatch)
    values = _run_values()
    keys = [f"r{i}" for i in range(len(values))]
    before = runtime_stats().resident_bytes
    with batched():
        stores = engine.store_many(keys, values, NVME, ACT, forget_source=True)
    for handle in stores:
        engine.wait(handle)
    padded = [-(-value.numel() * value.element_size() // 4096) * 4096 for value in values]
    assert calls == [("pwritev", [sum(padded)])]
    offsets = [engine.nvme_location(key)[1] for key in keys]
    assert offsets == [offsets[0] + sum(padded[:i]) for i in range(len(values))]
    with batched():
        loads = engine.load_many(keys[::-1])
    loaded = [engine.wait(handle) for handle in loads][::-1]
    # The members follow each other in the file: one read into each member's memory.
    assert calls[1:] == [("preadv", padded)]
    assert all(torch.equal(got, value) and got.dtype == value.dtype for got, value in zip(loaded, values))
    nbytes = sum(value.numel() * value.element_size() for value in values)
    stats = runtime_stats()
    assert dict(stats.cumulative.bytes_moved) == {(ACT, DEVICE, NVME): nbytes, (ACT, NVME, DEVICE): nbytes}
    assert stats.cumulative.transfers[(ACT, DEVICE, NVME)] == len(values)
    assert stats.resident_bytes[NVME] - before[NVME] == nbytes
    assert stats.resident_bytes[DEVICE] - before[DEVICE] == nbytes
    # Each member is freed on its own; the run's range is whole again once all are.
    engine.free(keys[2])
    del loaded, loads
    for key in keys[:2] + keys[3:]:
        engine.free(key)
    after = runtime_stats().resident_bytes
    assert (after[NVME], after[DEVICE]) == (before[NVME], before[DEVICE])
    assert engine.arena.space.used_bytes == 0


def _stored_run(engine) -> tuple[list[torch.Tensor], list[str]]:
    values = _run_values()
    keys = [f"r{i}" for i in range(len(values))]
    with batched():
        stores = engine.store_many(keys, values, NVME, ACT)
    for handle in stores:
        engine.wait(handle)
    return values, keys


def test_loads_of_members_apart_in_the_file_are_read_apart(engine, monkeypatch):
    if engine.device.type == "cuda":
        pytest.skip("a run is read by one I/O on a CPU machine")
    values, keys = _stored_run(engine)
    calls = _recording_io(monkeypatch)
    chosen = [5, 0, 1, 3, 6]  # three groups in the file: 0-1, 3, 5-6
    with batched():
        loads = engine.load_many([keys[index] for index in chosen])
    for index, handle in zip(chosen, loads):
        assert torch.equal(engine.wait(handle), values[index])
    assert sorted((op, len(sizes)) for op, sizes in calls) == [("preadv", 1), ("preadv", 2), ("preadv", 2)]
    moved = runtime_stats().cumulative
    assert moved.transfers[(ACT, NVME, DEVICE)] == len(chosen)
    assert moved.bytes_moved[(ACT, NVME, DEVICE)] == sum(values[i].numel() * values[i].element_size() for i in chosen)


def test_a_run_read_from_a_removed_arena_file_fails_every_member_and_frees_its_memory(engine):
    if engine.device.type == "cuda":
        pytest.skip("a run is read by one I/O on a CPU machine")
    values, keys = _stored_run(engine)
    resident = runtime_stats().resident_bytes[DEVICE]
    idle = engine._ledger.buffers.idle_bytes
    os.unlink(engine.arena.file_path)
    with batched():
        loads = engine.load_many(keys)
    for key, handle in zip(keys, loads):
        with pytest.raises(OffloadFileMissingError):
            engine.wait(handle)
    assert runtime_stats().resident_bytes[DEVICE] == resident
    # The memory taken for the run went back to the cache, unused.
    assert engine._ledger.buffers.idle_bytes == idle + sum(-(-v.numel() * v.element_size() // 4096) * 4096 for v in values)


def test_a_corrupt_member_of_a_stored_run_is_named_and_the_others_load(engine):
    if engine.device.type == "cuda":
        pytest.skip("a run is written by one I/O on a CPU machine")
    values, keys = _stored_run(engine)
    path, offset, nbytes = engine.nvme_location(keys[3])
    flip_bits(path, offset + nbytes - 1)
    loads = engine.load_many(keys)
    with pytest.raises(CorruptDataError) as caught:
        engine.wait(loads[3])
    assert caught.value.key == keys[3] and offset <= caught.value.offset < offset + nbytes
    for index in (0, 1, 2, 4, 5, 6):
        assert torch.equal(engine.wait(loads[index]), values[index])


def test_a_run_over_run_bytes_is_written_slot_by_slot(engine, monkeypatch):
    if engine.device.type == "cuda":
        pytest.skip("a run is written by one I/O on a CPU machine")
    calls = _recording_io(monkeypatch)
    values = [torch.randn(100_000 + i) for i in range(3)]  # 1.2 MB together, each under 1 MiB
    with batched():
        stores = engine.store_many(["a", "b", "c"], values, NVME, ACT)
    for handle in stores:
        engine.wait(handle)
    assert sorted(calls) == sorted(("pwritev", [-(-value.numel() * 4 // 4096) * 4096]) for value in values)
    assert all(torch.equal(engine.wait(engine.load(key)), value) for key, value in zip("abc", values))
    assert runtime_stats().cumulative.bytes_moved[(ACT, DEVICE, NVME)] == sum(value.numel() * 4 for value in values)


def test_a_stored_run_fails_whole_when_the_arena_file_is_gone(tmp_path):
    # An engine counting alone: what other tests' engines still hold is not its own.
    recorder = Recorder()
    engine = TransferEngine(offload_dir=str(tmp_path), recorder=recorder)
    engine.wait(engine.store("first", torch.ones(10), NVME, ACT))  # makes the arena
    os.unlink(engine.arena.file_path)
    handles = engine.store_many(["x", "y"], [torch.ones(10), torch.zeros(20)], NVME, ACT)
    for key, handle in zip("xy", handles):
        with pytest.raises(OffloadFileMissingError) as caught:
            engine.wait(handle)
        assert caught.value.key in ("x", "y")
        with pytest.raises(TransferFailedError, match="failed"):
            engine.load(key)
    assert recorder.snapshot().resident_bytes[NVME] == 10 * 4
    engine.close()
