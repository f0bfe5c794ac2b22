"""Accounting: steps, busy lanes, stalls, compute regions, timeline events."""

from __future__ import annotations

import time

import torch

from slcompile.runtime import (
    Tier,
    TransferKind,
    compute_region,
    mark_step,
    reset_runtime_stats,
    runtime_stats,
    timeline,
)
from slcompile.runtime.stats import Recorder

NVME, DEVICE, WEIGHT = Tier.NVME, Tier.DEVICE, TransferKind.WEIGHT


def test_steps_split_the_counters(engine):
    engine.wait(engine.store("a", torch.zeros(100), NVME, WEIGHT))
    closed = mark_step()
    engine.wait(engine.store("b", torch.zeros(25), NVME, TransferKind.KV))
    stats = runtime_stats()
    assert stats.steps == 1
    assert closed == stats.last_step
    assert dict(stats.last_step.bytes_moved) == {(WEIGHT, DEVICE, NVME): 400}
    assert dict(stats.current_step.bytes_moved) == {(TransferKind.KV, DEVICE, NVME): 100}
    assert dict(stats.cumulative.bytes_moved) == {
        (WEIGHT, DEVICE, NVME): 400,
        (TransferKind.KV, DEVICE, NVME): 100,
    }
    reset_runtime_stats()
    cleared = runtime_stats()
    assert cleared.steps == 0 and dict(cleared.bytes_moved) == {} and timeline() == []


def test_timeline_records_each_transfer_and_compute_region(engine):
    engine.wait(engine.store("blk0.w", torch.ones(3 << 18), NVME, WEIGHT))  # 3 MiB, 3 chunks
    with compute_region("blk0.sb0 fwd"):
        torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    engine.wait(engine.load("blk0.w"))
    events = timeline()
    by_lane = {event.lane: event for event in events if event.lane != "stall"}
    assert set(by_lane) == {"store", "compute", "load"}
    assert by_lane["store"].label == "weight blk0.w device->nvme"
    assert by_lane["load"].label == "weight blk0.w nvme->device"
    assert by_lane["store"].bytes == by_lane["load"].bytes == 3 << 20
    assert by_lane["compute"].label == "blk0.sb0 fwd" and by_lane["compute"].bytes == 0
    for event in events:
        assert event.start <= event.end
    assert by_lane["store"].end <= by_lane["compute"].start <= by_lane["load"].start


def test_busy_time_is_counted_once_for_overlapping_transfers(engine):
    started = time.perf_counter()
    handles = [engine.store(f"k{index}", torch.ones(1 << 18), NVME, WEIGHT) for index in range(8)]
    for handle in handles:
        engine.wait(handle)
    elapsed = time.perf_counter() - started
    stats = runtime_stats().cumulative
    store_events = [event for event in timeline() if event.lane == "store"]
    assert len(store_events) == 8
    assert 0 < stats.busy_seconds["store"] <= elapsed
    assert stats.busy_seconds["store"] >= max(event.end - event.start for event in store_events)


def test_busy_time_is_their_union_when_threads_report_out_of_order():
    # I/O threads stamp a transfer's start and end when they happen and report them
    # later, in any order: a start reported after an earlier end is counted from there.
    recorder = Recorder()
    zero = time.perf_counter() + 1.0
    recorder.lane_begin("store", zero)
    recorder.lane_end("store", zero + 1.0)
    recorder.lane_begin("store", zero + 0.5)  # began inside the first, reported after it
    recorder.lane_end("store", zero + 2.0)
    assert recorder.snapshot().cumulative.busy_seconds["store"] == 2.0
    recorder.lane_begin("store", zero + 4.0)
    recorder.lane_begin("store", zero + 4.5)
    recorder.lane_end("store", zero + 7.0)
    recorder.lane_end("store", zero + 5.0)  # ended first, reported last
    assert recorder.snapshot().cumulative.busy_seconds["store"] == 5.0


def test_stall_is_the_time_spent_blocked_in_wait(engine, monkeypatch):
    # The load's completion is held back for BLOCKED seconds after the read: the
    # waiting thread is blocked at least that long, and only that is stall.
    blocked = 0.2
    engine.wait(engine.store("big", torch.ones(1 << 18), NVME, WEIGHT))  # 1 MiB
    reset_runtime_stats()
    arena = engine.arena
    read = arena.read_new

    def slow_read(slot, make_destination, on_done, **kwargs):
        def late(outcome):
            time.sleep(blocked)
            on_done(outcome)

        return read(slot, make_destination, late, **kwargs)

    monkeypatch.setattr(arena, "read_new", slow_read)
    handle = engine.load("big")
    started = time.perf_counter()
    engine.wait(handle)
    waited = time.perf_counter() - started
    engine.wait(handle)  # already done: no stall added
    stalls = [event for event in timeline() if event.lane == "stall"]
    stats = runtime_stats().cumulative
    assert len(stalls) == 1
    assert stalls[0].label == "wait weight big nvme->device"
    assert abs(stats.stall_seconds - (stalls[0].end - stalls[0].start)) < 1e-9
    # Blocked from the wait's start to the delayed completion: the sleep less the
    # moments between issuing the load and waiting, never more than the wait took.
    assert 0.5 * blocked <= stats.stall_seconds <= waited


def test_step_peak_starts_from_what_is_resident(engine):
    engine.wait(engine.store("a", torch.zeros(1 << 18), NVME, WEIGHT))
    resident = runtime_stats().resident_bytes[NVME]
    mark_step()
    assert runtime_stats().current_step.peak_bytes[NVME] == resident
    engine.free("a")
    assert runtime_stats().current_step.peak_bytes[NVME] == resident
    mark_step()
    assert runtime_stats().current_step.peak_bytes[NVME] == resident - (1 << 20)


def test_step_figures_read_as_one_line_in_mib(engine):
    reset_runtime_stats()
    engine.wait(engine.store("s", torch.zeros(3 * 2**18), NVME, WEIGHT))  # 3 MiB
    line = str(mark_step())
    assert "\n" not in line
    assert line.startswith("moved weight device->nvme 3.00 MiB (1); stalled ")
    assert str(runtime_stats()).splitlines()[0] == f"last step: {line}"
