"""`Policy`: a named way to write a schedule, whose every schedule is validated.

Its own module: a policy's schedule passes `validate_schedule`
(`slcompile.schedules.validate`), which reads the schedule's words from
`slcompile.schedules.base`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from slcompile.errors import PolicyError
from slcompile.schedules.base import Schedule, ScheduleRequest
from slcompile.schedules.validate import UNNAMED_POLICY, validate_schedule

__all__ = ["Policy"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """A named way to write a schedule.

    Attributes:
        name: the value of the `schedule` option that selects it.
        build: `build(request) -> Schedule`.
        suffix: how the suffix meets the sub-batches under the `suffix` option's
            "auto": "whole" (once, on the whole batch: one `fwd suffix` step) or
            "subbatches" (per sub-batch, the default: a policy that writes its
            suffix steps itself, one per sub-batch, keeps working). The request
            says which the graph does (`ScheduleRequest.whole_suffix`), and the
            schedule must write it so; `layer_major_compute` and `suffix_compute`
            follow it.
    """

    name: str
    build: Callable[[ScheduleRequest], Schedule]
    suffix: str = "subbatches"

    def __call__(self, request: ScheduleRequest) -> Schedule:
        """The schedule `build` writes for `request`, checked
        (`slcompile.schedules.validate_schedule`) and carrying this policy and the
        request (`Schedule.replan`).

        Raises:
            PolicyError: the schedule is not one the passes can compile as written,
                or a helper `build` called refused what it was asked (a stash tier
                that is not a slower tier), named as this policy's.
        """
        try:
            built = self.build(request)
        except PolicyError as err:
            if err.policy != UNNAMED_POLICY:
                raise
            # A helper (`add_stashes`) refused what the policy asked of it: the policy is this one.
            raise PolicyError(self.name, err.problem, err.step) from None
        schedule = validate_schedule(built, request, self.name)
        return dataclasses.replace(schedule, policy=self, request=request)
