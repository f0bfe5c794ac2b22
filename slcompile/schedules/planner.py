"""Where saved activations rest: kept on the device or stashed, from their lifetimes.

Lifetime-aware placement (the idea of TERAIO): a saved activation is worth moving
off the device when its idle interval (the compute steps between its last forward
use and its first backward use) is long enough for its store and its load to run
behind compute, and keeping it would take the step over the memory budget. The
planner works per stash unit, a forward (prefix or block, sub-batch) step and the
activations it saves:

- hidden: at least `MIN_HIDDEN_STEPS` compute steps separate every activation's last
  forward use from its first backward use (the store overlaps one, the load another);
- to fit a budget the step must shed `request.offload_at_least` bytes of saved
  activations: the planner stashes hidden units, longest idle first (they free their
  memory for longest, and their transfers hide best), until they add up to that;
- when the hidden units do not add up to it, it stashes no unit whose reload would
  not hide: the lowering then recomputes the blocks (a recomputed block costs
  compute the device has; a reload that does not hide stalls it), and stashes
  every unit only when recomputing does not fit either.

Without a budget (`offload_at_least` None) every unit the policy offers is stashed:
the `activations` option asked for them to leave. `describe` writes the decision,
per unit, for `explain()`.

With the time model's facts (`request.timing`, a `TransferTiming`: each compute
step's predicted seconds and the activation tier's rates, from the `profile`
option), "hidden" is decided by time instead of by counting steps, and the
transfers are placed by it (TERAIO's lifetime- and bandwidth-aware placement):

- a store is waited for once the compute after its issue covers its time
  (`store_wait_at`: the forward step after its last use at the earliest; the
  forward's end at the latest);
- a load is issued far enough ahead of its first backward use for the compute
  between to cover its time (`load_issue_at`: one step ahead at the least; the
  backward's start at the most);
- a unit is hidden when every one of its transfers is covered so.

Without it, a store is waited for just before the step after its last use and a
load issued one step ahead, as `MIN_HIDDEN_STEPS` assumes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from slcompile.meta import format_tag
from slcompile.schedules.base import SavedActivation, ScheduleRequest, Step

__all__ = [
    "MIN_HIDDEN_STEPS", "TransferTiming", "UnitLifetime", "unit_lifetimes", "choose_stashes", "kept_bytes",
    "describe", "store_wait_at", "load_issue_at", "without_kept",
]

MIN_HIDDEN_STEPS = 2


@dataclasses.dataclass(frozen=True)
class TransferTiming:
    """What the time model predicts, for placing stashes by time.

    Attributes:
        compute: ((phase, (region, block, sub-batch)), seconds) of each compute step
            (`slcompile.analysis.time.step_seconds`).
        profile: the `MachineProfile` whose rates time the transfers.
        tier: where the activations rest ("host" or "nvme").
    """

    compute: tuple[tuple[tuple[str, tuple], float], ...]
    profile: Any
    tier: str

    @functools.cached_property
    def _seconds(self) -> dict[tuple[str, tuple], float]:
        return dict(self.compute)

    def step(self, phase: str, key: tuple) -> float:
        """Seconds of one compute step (0 for a step the graphs have no work of)."""
        return self._seconds.get((phase, key), 0.0)

    def transfer(self, direction: str, nbytes: int) -> float:
        """Seconds of one store ("write") or load ("read") of `nbytes`."""
        return self.profile.transfer_seconds(self.tier, direction, nbytes)[1]


def store_wait_at(forward: list[tuple], owner: int, last: int, nbytes: int,
                  timing: TransferTiming | None) -> tuple[int, bool]:
    """Where the store of `nbytes`, issued after forward compute step `owner`, is
    waited for: before the forward compute step at the returned position
    (`len(forward)`: the forward's end), never before the step after `last`, its
    tensor's last forward use. With `timing`, the first position at which the
    compute since the issue covers the store's time.

    Returns:
        (position, whether the compute before it covers the store).
    """
    at = last + 1
    if timing is None:
        return at, True
    need = timing.transfer("write", nbytes)
    covered = sum(timing.step("fwd", forward[i]) for i in range(owner + 1, min(at, len(forward))))
    while covered < need and at < len(forward):
        covered += timing.step("fwd", forward[at])
        at += 1
    return min(at, len(forward)), covered >= need


def load_issue_at(backward: list[tuple], use: int, nbytes: int, timing: TransferTiming | None) -> tuple[int, bool]:
    """Where the load of `nbytes` waited for before backward compute step `use` is
    issued: before the backward compute step at the returned position, one step
    ahead at the least. With `timing`, the last position from which the compute up
    to `use` covers the load's time (the backward's start when none does).

    Returns:
        (position, whether the compute between covers the load).
    """
    at = max(use - 1, 0)
    if timing is None:
        return at, True
    need = timing.transfer("read", nbytes)
    covered = sum(timing.step("bwd", backward[i]) for i in range(at, use))
    while covered < need and at > 0:
        at -= 1
        covered += timing.step("bwd", backward[at])
    return at, covered >= need


@dataclasses.dataclass(frozen=True)
class UnitLifetime:
    """The saved activations of one forward step that may leave the device.

    Attributes:
        unit: (region, block, sub-batch) of the step that saves them.
        nbytes: their bytes.
        idle_steps: the fewest compute steps between one's last forward use and its
            first backward use.
        round_trip_seconds: with them, the predicted time of storing and loading
            all of them; else None.
        covered: with them, whether the compute around each transfer, placed by
            `store_wait_at` and `load_issue_at`, covers its time; else None.
    """

    unit: tuple[str, int | None, int]
    nbytes: int
    idle_steps: int
    round_trip_seconds: float | None = None
    covered: bool | None = None

    @property
    def hidden(self) -> bool:
        """Its store and load hide behind compute: by time when the time model's
        facts are known (`covered`), else by `MIN_HIDDEN_STEPS`."""
        if self.covered is not None:
            return self.covered
        return self.idle_steps >= MIN_HIDDEN_STEPS


def unit_lifetimes(steps: list[Step], saved: tuple[SavedActivation, ...],
                   timing: TransferTiming | None = None) -> dict[tuple, UnitLifetime]:
    """unit -> its lifetime, for every unit with an activation that may leave."""
    forward = [s.key for s in steps if s.phase == "fwd" and s.kind == "compute"]
    backward = [s.key for s in steps if s.phase == "bwd" and s.kind == "compute"]
    fwd = {key: i for i, key in enumerate(forward)}
    bwd = {key: i for i, key in enumerate(backward)}
    leaving = [a for a in saved if a.stays is None and a.owner in fwd]
    unit_bytes: dict[tuple, int] = {}
    for activation in leaving:
        unit_bytes[activation.owner] = unit_bytes.get(activation.owner, 0) + activation.nbytes
    units: dict[tuple, UnitLifetime] = {}
    for activation in leaving:
        owner = fwd[activation.owner]
        last = fwd.get(activation.last_forward_use, owner)
        first = bwd.get(activation.first_backward_use, 0)
        idle = (len(forward) - 1 - last) + first
        timed: dict = {}
        if timing is not None:
            nbytes = unit_bytes[activation.owner]
            _, stored = store_wait_at(forward, owner, last, nbytes, timing)
            _, loaded = load_issue_at(backward, first, activation.nbytes, timing)
            timed = dict(covered=stored and loaded,
                         round_trip_seconds=timing.transfer("write", nbytes) + timing.transfer("read", nbytes))
        known = units.get(activation.owner)
        if known is not None:
            idle = min(idle, known.idle_steps)
            if timing is not None:
                timed["covered"] = timed["covered"] and known.covered
        units[activation.owner] = UnitLifetime(activation.owner, unit_bytes[activation.owner], idle, **timed)
    return units


def choose_stashes(candidates: list[UnitLifetime], request: ScheduleRequest) -> set[tuple]:
    """The units to stash among `candidates` (see the module docstring)."""
    if request.offload_at_least is None or request.stash_everything:
        return {unit.unit for unit in candidates}
    chosen: set[tuple] = set()
    shed = 0
    for unit in sorted(candidates, key=lambda u: (-u.idle_steps, -u.nbytes)):
        if shed >= request.offload_at_least or not unit.hidden:
            break
        chosen.add(unit.unit)
        shed += unit.nbytes
    return chosen


def kept_bytes(schedule) -> int:
    """Bytes of the saved activations that may leave the device but that the
    schedule keeps: the most that stashing them could shed besides."""
    request = schedule.request
    if request is None or request.saved is None or not request.activations_offloaded:
        return 0
    stashed = schedule.stashes()
    units = unit_lifetimes(list(schedule.steps), without_kept(request.saved, schedule.kept_saved), request.timing)
    kept_saved = sum(a.nbytes for a in request.saved
                     if a.stays is None and a.owner in stashed and a.name in schedule.kept_saved)
    return kept_saved + sum(unit.nbytes for unit in units.values() if unit.unit not in stashed)


def without_kept(saved, kept_saved) -> tuple[SavedActivation, ...]:
    """The saved tensors but those a schedule keeps by name (`Schedule.kept_saved`)."""
    return tuple(a for a in saved if a.name not in kept_saved)


def describe(schedule) -> tuple[str, ...]:
    """One line per unit with activations that may leave: stashed or kept, and why."""
    request = schedule.request
    if request is None or request.saved is None or not request.activations_offloaded:
        return ()
    stashed, tiers = schedule.stashes(), schedule.stash_tiers()
    lines = []
    units = unit_lifetimes(list(schedule.steps), without_kept(request.saved, schedule.kept_saved), request.timing)
    for unit in sorted(units.values(), key=lambda u: (-u.idle_steps, -u.nbytes)):
        region, block, subbatch = unit.unit
        why = f"{unit.nbytes} B, idle {unit.idle_steps} steps"
        if unit.round_trip_seconds is not None:
            why += f", round trip {unit.round_trip_seconds * 1e3:.3f} ms"
        if unit.unit in stashed:
            decision = "stash" + (f" to {tiers[unit.unit]}" if unit.unit in tiers else "")
            kept = sorted(a.name for a in request.saved if a.owner == unit.unit and a.name in schedule.kept_saved)
            if kept:
                decision += f", keeping {', '.join(kept)}"
        elif not unit.hidden and request.offload_at_least:
            decision = "keep (its transfers would not hide)" if unit.covered is False else \
                "keep (its reload would not hide)"
        else:
            decision = "keep"
        lines.append(f"{format_tag(region, block, subbatch)}: {decision} ({why})")
    return tuple(lines)
