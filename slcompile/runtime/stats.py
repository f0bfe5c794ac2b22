"""Exact byte accounting and the transfer/compute timeline.

Where it sits: every transfer engine reports here; ``runtime_stats()`` is how
schedules, benchmarks and tests check the planner's predictions against facts,
and ``timeline()`` is what the visualizer turns into a Chrome trace.

Guarantees:
- ``bytes_moved`` counts the logical bytes of each finished transfer (the tensor's
  ``nbytes``, not the page padding on disk), keyed by
  ``(TransferKind, source Tier, destination Tier)``. A move that copies nothing
  (host tier on a CPU-only machine, device tier) adds nothing.
- ``stall_seconds`` is the wall time compute spent blocked in ``wait`` on a
  transfer that had not finished yet.
- ``busy_seconds[lane]`` is the wall time during which at least one transfer of
  that lane (``"load"``, ``"store"``) was doing I/O: overlapping transfers are
  counted once, so busy time never exceeds elapsed time.
- ``peak_bytes[tier]`` is the highest number of bytes resident on the tier at any
  moment of the window (see ``TransferEngine`` for what counts as resident).
- Figures exist for the last finished step (closed by ``mark_step()``), the step
  in progress, and cumulatively since the last ``reset_runtime_stats()``.
- Timeline events use ``time.perf_counter()`` seconds; recording one costs a lock
  and a deque append, cheap enough to leave on. The timeline keeps the most recent
  ``TIMELINE_CAPACITY`` events.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from ..units import format_bytes
from .storage.tiers import Tier, TransferKind

__all__ = [
    "TimelineEvent",
    "StepStats",
    "RuntimeStats",
    "TransferKey",
    "runtime_stats",
    "reset_runtime_stats",
    "mark_step",
    "compute_region",
    "timeline",
    "set_timeline_enabled",
    "RECORDER",
    "TIMELINE_CAPACITY",
]

log = logging.getLogger(__name__)

# About 6 MiB of events: the last few steps of a large model (a step records a few
# events per (block, sub-batch) region and transfer), what `record_step` and a trace
# need, without a long run's memory growing for tens of MiB before it is full.
TIMELINE_CAPACITY = 20_000

TransferKey = tuple[TransferKind, Tier, Tier]
"""(kind, source tier, destination tier): the key of the byte counters."""


@dataclass(frozen=True)
class TimelineEvent:
    """One interval on one lane of the timeline.

    Attributes:
        lane: ``"compute"``, ``"load"``, ``"store"``, ``"stall"`` or ``"step"``.
        start: ``time.perf_counter()`` seconds when the interval began.
        end: ``time.perf_counter()`` seconds when it ended.
        bytes: Bytes moved in the interval (0 for compute, stalls and steps).
        label: What ran, e.g. ``"weight blk3.w nvme->device"``.
    """

    lane: str
    start: float
    end: float
    bytes: int
    label: str


@dataclass(frozen=True)
class StepStats:
    """Figures for one window of time (a step, or everything since a reset).

    Attributes:
        bytes_moved: Logical bytes of finished transfers per
            ``(kind, source tier, destination tier)``.
        transfers: Number of finished transfers per the same key.
        stall_seconds: Wall time compute spent blocked waiting on transfers.
        busy_seconds: Wall time each I/O lane had at least one transfer running.
        peak_bytes: Highest resident bytes per tier during the window.
        local_copy_bytes: Bytes copied inside one tier on purpose: non-contiguous
            sources made contiguous, and copies made so a compiled graph owns the
            tensor a zero-copy tier handed out. Not tier traffic.
        seconds: Wall time of the window.
    """

    bytes_moved: Mapping[TransferKey, int] = field(default_factory=dict)
    transfers: Mapping[TransferKey, int] = field(default_factory=dict)
    stall_seconds: float = 0.0
    busy_seconds: Mapping[str, float] = field(default_factory=dict)
    peak_bytes: Mapping[Tier, int] = field(default_factory=dict)
    local_copy_bytes: int = 0
    seconds: float = 0.0

    def total_bytes(self, *, kind: TransferKind | None = None) -> int:
        """Sums ``bytes_moved``, optionally for one kind only."""
        return sum(n for (k, _, _), n in self.bytes_moved.items() if kind is None or k is kind)

    def __str__(self) -> str:
        """One line: bytes moved per kind and direction, stalls, peaks, e.g.
        ``weight nvme->device 1.70 MiB (16 loads), ...; stalled 0.002 s;
        peak device 3.20 MiB; 0.41 s``."""
        moved = [
            f"{kind.value} {source.value}->{destination.value} {format_bytes(n)} "
            f"({self.transfers.get((kind, source, destination), 0)})"
            for (kind, source, destination), n in sorted(
                self.bytes_moved.items(), key=lambda item: tuple(x.value for x in item[0])
            )
            if n
        ]
        peaks = [f"peak {tier.value} {format_bytes(n)}" for tier, n in self.peak_bytes.items() if n]
        parts = ["moved " + ", ".join(moved) if moved else "moved nothing",
                 f"stalled {self.stall_seconds:.3f} s", *peaks, f"{self.seconds:.2f} s"]
        return "; ".join(parts)


@dataclass(frozen=True)
class RuntimeStats:
    """Runtime figures: the last finished step, the step in progress, and totals.

    Attributes:
        last_step: The window closed by the most recent ``mark_step()`` (empty
            before the first one).
        current_step: The window since the most recent ``mark_step()``.
        cumulative: Everything since the last ``reset_runtime_stats()``.
        steps: How many steps ``mark_step()`` has closed.
        resident_bytes: Bytes resident per tier right now.
        pinned_host_bytes: Bytes of pinned host memory the engines' host pools
            hold (0 on a CPU-only machine, where nothing is pinned).
    """

    last_step: StepStats
    current_step: StepStats
    cumulative: StepStats
    steps: int
    resident_bytes: Mapping[Tier, int]
    pinned_host_bytes: int = 0

    def __str__(self) -> str:
        """Three short lines: the last step, the step in progress, the totals."""
        last = str(self.last_step) if self.steps else "none closed yet (slcompile.mark_step() closes one)"
        return (f"last step: {last}\ncurrent step: {self.current_step}\n"
                f"since reset ({self.steps} steps): {self.cumulative}")

    @property
    def bytes_moved(self) -> Mapping[TransferKey, int]:
        """Cumulative ``bytes_moved``."""
        return self.cumulative.bytes_moved

    @property
    def stall_seconds(self) -> float:
        """Cumulative ``stall_seconds``."""
        return self.cumulative.stall_seconds

    @property
    def busy_seconds(self) -> Mapping[str, float]:
        """Cumulative ``busy_seconds``."""
        return self.cumulative.busy_seconds

    @property
    def peak_bytes(self) -> Mapping[Tier, int]:
        """Cumulative ``peak_bytes``."""
        return self.cumulative.peak_bytes


class _Window:
    """Mutable counters behind one ``StepStats``."""

    def __init__(self, now: float, resident: Mapping[Tier, int]):
        self.started = now
        self.bytes_moved: dict[TransferKey, int] = collections.Counter()
        self.transfers: dict[TransferKey, int] = collections.Counter()
        self.stall_seconds = 0.0
        self.busy_seconds: dict[str, float] = collections.Counter()
        self.peak_bytes: dict[Tier, int] = dict(resident)
        self.local_copy_bytes = 0

    def freeze(self, now: float, open_busy: Mapping[str, float]) -> StepStats:
        busy = collections.Counter(self.busy_seconds)
        busy.update(open_busy)
        return StepStats(
            bytes_moved=MappingProxyType(dict(self.bytes_moved)),
            transfers=MappingProxyType(dict(self.transfers)),
            stall_seconds=self.stall_seconds,
            busy_seconds=MappingProxyType(dict(busy)),
            peak_bytes=MappingProxyType(dict(self.peak_bytes)),
            local_copy_bytes=self.local_copy_bytes,
            seconds=now - self.started,
        )


class Recorder:
    """Process-wide accounting that every engine reports into. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.timeline_enabled = True
        self._events: collections.deque[TimelineEvent] = collections.deque(
            maxlen=TIMELINE_CAPACITY
        )
        self._resident: dict[Tier, int] = {tier: 0 for tier in Tier}
        self._pinned_host = 0
        self._lane_active: dict[str, int] = collections.Counter()
        self._lane_since: dict[str, float] = {}
        # The latest end reported (busy time is counted up to it while idle): I/O
        # threads report a transfer's start and end after the fact and out of order,
        # and no moment is counted twice.
        self._lane_until: dict[str, float] = collections.defaultdict(float)
        self.reset()

    def reset(self) -> None:
        """Clears counters, steps and the timeline; residency is a fact and stays."""
        now = time.perf_counter()
        with self._lock:
            self._current = _Window(now, self._resident)
            self._cumulative = _Window(now, self._resident)
            self._last = StepStats(peak_bytes=MappingProxyType(dict(self._resident)))
            self._steps = 0
            self._events.clear()
            for lane in self._lane_since:
                self._lane_since[lane] = now
            for lane in self._lane_until:
                self._lane_until[lane] = now

    # -- transfers ---------------------------------------------------------

    def transfer_finished(
        self, key: TransferKey, nbytes: int, start: float, end: float, lane: str, label: str
    ) -> None:
        """Counts one finished transfer and records its timeline event."""
        with self._lock:
            for window in (self._current, self._cumulative):
                window.bytes_moved[key] += nbytes
                window.transfers[key] += 1
            if self.timeline_enabled:
                self._events.append(TimelineEvent(lane, start, end, nbytes, label))

    def transfers_finished(self, transfers: Sequence, source: Tier, destination: Tier, start: float, end: float,
                           lane: str) -> None:
        """`transfer_finished` of each of `transfers` (each with a `kind`, `nbytes` and
        `label`, as a `TransferHandle` has), moved from `source` to `destination` by one
        I/O from `start` to `end`."""
        with self._lock:
            for transfer in transfers:
                key = (transfer.kind, source, destination)
                for window in (self._current, self._cumulative):
                    window.bytes_moved[key] += transfer.nbytes
                    window.transfers[key] += 1
            if self.timeline_enabled:
                self._events.extend(TimelineEvent(lane, start, end, transfer.nbytes, transfer.label)
                                    for transfer in transfers)

    def lane_begin(self, lane: str, now: float, count: int = 1) -> None:
        """Marks ``count`` more transfers of ``lane`` as doing I/O."""
        with self._lock:
            if self._lane_active[lane] == 0:
                self._lane_since[lane] = self._lane_until[lane] = max(now, self._lane_until[lane])
            self._lane_active[lane] += count

    def lane_end(self, lane: str, now: float) -> None:
        """Marks one transfer of ``lane`` as done with its I/O."""
        with self._lock:
            self._lane_active[lane] -= 1
            until = self._lane_until[lane] = max(self._lane_until[lane], now)
            if self._lane_active[lane] == 0:
                busy = until - self._lane_since[lane]
                self._current.busy_seconds[lane] += busy
                self._cumulative.busy_seconds[lane] += busy

    def stalled(self, start: float, end: float, label: str) -> None:
        """Counts time compute spent blocked on a transfer."""
        with self._lock:
            self._current.stall_seconds += end - start
            self._cumulative.stall_seconds += end - start
            if self.timeline_enabled:
                self._events.append(TimelineEvent("stall", start, end, 0, label))

    def local_copy(self, nbytes: int) -> None:
        """Counts a copy made inside one tier on purpose."""
        with self._lock:
            self._current.local_copy_bytes += nbytes
            self._cumulative.local_copy_bytes += nbytes

    def host_pinned(self, nbytes: int) -> None:
        """Counts ``nbytes`` more pinned host memory (a host pool grew)."""
        with self._lock:
            self._pinned_host += nbytes

    def resident_change(self, tier: Tier, delta: int) -> None:
        """Adds ``delta`` bytes to what rests on ``tier`` and updates the peaks."""
        with self._lock:
            value = self._resident[tier] + delta
            self._resident[tier] = value
            for window in (self._current, self._cumulative):
                if value > window.peak_bytes.get(tier, 0):
                    window.peak_bytes[tier] = value

    def compute(self, start: float, end: float, label: str) -> None:
        """Records one compute region."""
        if self.timeline_enabled:
            with self._lock:
                self._events.append(TimelineEvent("compute", start, end, 0, label))

    # -- windows -----------------------------------------------------------

    def _open_busy(self, now: float) -> dict[str, float]:
        return {
            lane: now - self._lane_since[lane]
            for lane, active in self._lane_active.items()
            if active > 0
        }

    def mark_step(self) -> StepStats:
        """Closes the current step and returns its figures."""
        now = time.perf_counter()
        with self._lock:
            open_busy = self._open_busy(now)
            self._last = self._current.freeze(now, open_busy)
            for lane, busy in open_busy.items():
                # Busy time that spans the boundary is split between the two steps.
                self._cumulative.busy_seconds[lane] += busy
                self._lane_since[lane] = now
            for lane in self._lane_until:
                self._lane_until[lane] = now
            self._current = _Window(now, self._resident)
            self._steps += 1
            if self.timeline_enabled:
                self._events.append(TimelineEvent("step", now, now, 0, f"step {self._steps}"))
            return self._last

    def snapshot(self) -> RuntimeStats:
        """Returns the figures as of now."""
        now = time.perf_counter()
        with self._lock:
            open_busy = self._open_busy(now)
            return RuntimeStats(
                last_step=self._last,
                current_step=self._current.freeze(now, open_busy),
                cumulative=self._cumulative.freeze(now, open_busy),
                steps=self._steps,
                resident_bytes=MappingProxyType(dict(self._resident)),
                pinned_host_bytes=self._pinned_host,
            )

    def events(self) -> list[TimelineEvent]:
        """Returns the recorded timeline, oldest first."""
        with self._lock:
            return list(self._events)


RECORDER = Recorder()
"""The process-wide recorder; engines report into it."""


def runtime_stats() -> RuntimeStats:
    """Returns the runtime's byte, stall, busy and residency figures as of now."""
    return RECORDER.snapshot()


def reset_runtime_stats() -> None:
    """Clears all counters, step figures and the timeline (not residency)."""
    RECORDER.reset()


def mark_step() -> StepStats:
    """Closes the current step; its figures become ``runtime_stats().last_step``.

    Returns:
        The figures of the step just closed.
    """
    return RECORDER.mark_step()


def timeline() -> list[TimelineEvent]:
    """Returns the recorded timeline events, oldest first."""
    return RECORDER.events()


def set_timeline_enabled(enabled: bool) -> None:
    """Turns timeline recording on or off (counters are always kept)."""
    RECORDER.timeline_enabled = enabled


@contextlib.contextmanager
def compute_region(label: str) -> Iterator[None]:
    """Records the enclosed code as one ``compute`` interval on the timeline.

    Args:
        label: What the region computes, e.g. ``"blk3.sb1 fwd"``.
    """
    start = time.perf_counter()
    try:
        yield
    finally:
        RECORDER.compute(start, time.perf_counter(), label)
