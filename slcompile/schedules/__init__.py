"""Policies: functions that turn the block graph and a config into a Schedule, and
the schedule read back from compiled graphs.

The kit for writing a policy: the vocabulary (`Step`, `Schedule`, whose `recompute`
names the (block, sub-batch) units the backward recomputes, `ScheduleRequest`,
`SavedActivation`, `Policy`, `TRANSFER_KINDS`, `STASH_TIERS`), the helpers the built-in policies are made of
(`layer_major_compute` writes the compute steps in speedloader's order, `suffix_compute`
the suffix's, once on the whole batch or per sub-batch as the request says; `add_fetches`,
`add_stashes`, `add_spills`, `add_stores` and `add_gradient_stores` add the transfers a request
needs around any compute order), `validate_schedule` (what every schedule a `Policy`
returns must pass), `register_policy`, which makes a policy's name a value of the
`schedule` option, and `replay(schedule)`, the policy that writes one given schedule
(read with `Schedule.from_json` or `Schedule.from_text`).
"""

from slcompile.schedules.base import (
    REQUEST_FIELDS,
    STASH_TIERS,
    TRANSFER_KINDS,
    SavedActivation,
    Schedule,
    ScheduleRequest,
    Step,
    add_fetches,
    add_gradient_stores,
    next_region,
)
from slcompile.schedules.policy import Policy
from slcompile.schedules.derive import schedule_of
from slcompile.schedules.grad_accumulation import grad_accumulation_schedule
from slcompile.schedules.policies import POLICIES, plan_schedule, policy_for, register_policy
from slcompile.schedules.replay import replay
from slcompile.schedules.speedloader import (
    add_spills,
    add_stashes,
    add_stores,
    layer_major_compute,
    speedloader_schedule,
    suffix_compute,
)
from slcompile.schedules.validate import check_agreement, validate_schedule

__all__ = [
    "Schedule",
    "Step",
    "ScheduleRequest",
    "SavedActivation",
    "Policy",
    "TRANSFER_KINDS",
    "REQUEST_FIELDS",
    "STASH_TIERS",
    "replay",
    "layer_major_compute",
    "suffix_compute",
    "add_fetches",
    "add_stashes",
    "add_spills",
    "next_region",
    "add_stores",
    "add_gradient_stores",
    "validate_schedule",
    "check_agreement",
    "register_policy",
    "POLICIES",
    "policy_for",
    "plan_schedule",
    "schedule_of",
    "speedloader_schedule",
    "grad_accumulation_schedule",
]
