"""`replay(schedule)`: a policy that writes one given schedule, so a schedule written
elsewhere (by an external solver, read with `Schedule.from_json` or
`Schedule.from_text`, or kept from an earlier compile's `report.planned_schedule`)
compiles as it is.

The policy is asked for each graph as any policy is (`Policy.__call__`, which
validates what it returns), and answers every request with the same steps and the
same units recomputed (`Schedule.recompute`), once it has checked that the request
is the one the schedule was written for: the
`REQUEST_FIELDS` of the schedule's request when it carries one (a schedule from
`to_json` or from a policy), else what its steps fix (the blocks in their forward
order, K, whether it has a backward, a prefix and a suffix, whether weights are
fetched, and that activations or gradients leave the device when it moves them).
What the planner learns on the way (`saved`, `timing`, ...) is not compared: the
replayed schedule has placed its transfers already. As for any policy, the schedule
read back from the compiled graphs must then be the replayed one
(`check_agreement`).
"""

from __future__ import annotations

import dataclasses

from slcompile.errors import PolicyError
from slcompile.schedules.base import REQUEST_FIELDS, Schedule, ScheduleRequest, Step
from slcompile.schedules.policy import Policy

__all__ = ["replay", "written_for"]


def replay(schedule: Schedule, name: str = "replay") -> Policy:
    """A policy that writes `schedule` for the request it was written for.

    Args:
        schedule: the schedule to replay.
        name: the policy's name (the `schedule` option's value once registered, and
            the name its errors and `compare_policies`' rows carry).

    Returns:
        the Policy; usable as `options={"schedule": replay(schedule)}`.

    Raises:
        PolicyError: (when the policy is asked) the request is not the one the
            schedule was written for, naming every field that differs; or the
            schedule is not valid for it (`validate_schedule`).
    """
    if not isinstance(schedule, Schedule):
        raise PolicyError(name, f"replay takes a slcompile.schedules.Schedule, got a {type(schedule).__name__} "
                                "(Schedule.from_json(text) or Schedule.from_text(text) reads one)")
    written = written_for(schedule)
    return Policy(name, _Replay(name, schedule.steps, tuple(written.items()), schedule.kept_saved,
                                schedule.recompute),
                  suffix="whole" if written.get("whole_suffix") else "subbatches")


@dataclasses.dataclass(frozen=True)
class _Replay:
    """A replay's `build`: a module-level class, so that the options holding the
    policy pickle (Inductor's cache hashes them). Its repr is its name: the steps
    would fill a line of `explain`'s options."""

    name: str
    steps: tuple[Step, ...] = dataclasses.field(repr=False)
    wanted: tuple[tuple[str, object], ...] = dataclasses.field(repr=False)
    kept_saved: frozenset[str] = dataclasses.field(default=frozenset(), repr=False)
    recompute: frozenset[tuple[int, int]] | None = dataclasses.field(default=None, repr=False)

    def __call__(self, request: ScheduleRequest) -> Schedule:
        differences = [
            f"{field}={value!r} (the request has {getattr(request, field)!r})"
            for field, value in self.wanted if getattr(request, field) != value
        ]
        if differences:
            raise PolicyError(self.name, "replays a schedule written for another request: " + ", ".join(differences))
        return Schedule(self.steps, kept_saved=self.kept_saved, recompute=self.recompute)


def written_for(schedule: Schedule) -> dict[str, object]:
    """The request fields (`REQUEST_FIELDS`) `schedule` was written for: its
    request's, or those its steps fix when it carries none."""
    if schedule.request is not None:
        return {field: getattr(schedule.request, field) for field in REQUEST_FIELDS}
    steps = schedule.steps
    compute = [s for s in steps if s.kind == "compute"]
    first_phase = compute[0].phase if compute else None
    kinds = {s.kind.split(".")[0] for s in steps}
    fixed: dict[str, object] = {
        "blocks": tuple(dict.fromkeys(s.block for s in compute if s.phase == first_phase and s.region == "block")),
        "num_subbatches": 1 + max((s.subbatch for s in steps if s.subbatch is not None), default=0),
        "backward": any(s.phase == "bwd" for s in steps),
        "has_prefix": any(s.region == "prefix" for s in compute),
        "has_suffix": any(s.region == "suffix" for s in compute),
        "whole_suffix": any(s.region == "suffix" and s.subbatch is None for s in compute),
        "weights_streamed": "fetch" in kinds,
    }
    # Nothing moved does not say the tier copies nothing (every activation may be kept).
    if kinds & {"stash", "unstash", "spill", "fill"}:
        fixed["activations_offloaded"] = True
    if "store_grad" in kinds:
        fixed["gradients_offloaded"] = True
    return fixed
