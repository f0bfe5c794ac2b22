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
"""

from __future__ import annotations

import dataclasses

from slcompile.meta import format_tag
from slcompile.schedules.base import SavedActivation, ScheduleRequest, Step

__all__ = ["MIN_HIDDEN_STEPS", "UnitLifetime", "unit_lifetimes", "choose_stashes", "kept_bytes", "describe"]

MIN_HIDDEN_STEPS = 2


@dataclasses.dataclass(frozen=True)
class UnitLifetime:
    """The saved activations of one forward step that may leave the device.

    Attributes:
        unit: (region, block, sub-batch) of the step that saves them.
        nbytes: their bytes.
        idle_steps: the fewest compute steps between one's last forward use and its
            first backward use.
    """

    unit: tuple[str, int | None, int]
    nbytes: int
    idle_steps: int

    @property
    def hidden(self) -> bool:
        return self.idle_steps >= MIN_HIDDEN_STEPS


def unit_lifetimes(steps: list[Step], saved: tuple[SavedActivation, ...]) -> dict[tuple, UnitLifetime]:
    """unit -> its lifetime, for every unit with an activation that may leave."""
    forward = [s.key for s in steps if s.phase == "fwd" and s.kind == "compute"]
    backward = [s.key for s in steps if s.phase == "bwd" and s.kind == "compute"]
    fwd = {key: i for i, key in enumerate(forward)}
    bwd = {key: i for i, key in enumerate(backward)}
    units: dict[tuple, UnitLifetime] = {}
    for activation in saved:
        if activation.stays is not None or activation.owner not in fwd:
            continue
        last = fwd.get(activation.last_forward_use, fwd[activation.owner])
        first = bwd.get(activation.first_backward_use, 0)
        idle = (len(forward) - 1 - last) + first
        known = units.get(activation.owner)
        units[activation.owner] = UnitLifetime(
            activation.owner,
            activation.nbytes + (known.nbytes if known else 0),
            min(idle, known.idle_steps) if known else idle,
        )
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
    units = unit_lifetimes(list(schedule.steps), request.saved)
    return sum(unit.nbytes for unit in units.values() if unit.unit not in stashed)


def describe(schedule) -> tuple[str, ...]:
    """One line per unit with activations that may leave: stashed or kept, and why."""
    request = schedule.request
    if request is None or request.saved is None or not request.activations_offloaded:
        return ()
    stashed = schedule.stashes()
    lines = []
    units = unit_lifetimes(list(schedule.steps), request.saved)
    for unit in sorted(units.values(), key=lambda u: (-u.idle_steps, -u.nbytes)):
        region, block, subbatch = unit.unit
        why = f"{unit.nbytes} B, idle {unit.idle_steps} steps"
        if unit.unit in stashed:
            decision = "stash"
        elif not unit.hidden and request.offload_at_least:
            decision = "keep (its reload would not hide)"
        else:
            decision = "keep"
        lines.append(f"{format_tag(region, block, subbatch)}: {decision} ({why})")
    return tuple(lines)
