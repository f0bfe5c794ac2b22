"""Policies: functions that turn the block graph and a config into a Schedule, and
the schedule read back from compiled graphs."""

from slcompile.schedules.base import Policy, Schedule, ScheduleRequest, Step
from slcompile.schedules.derive import schedule_of
from slcompile.schedules.grad_accumulation import grad_accumulation_schedule
from slcompile.schedules.policies import POLICIES, plan_schedule, policy_for
from slcompile.schedules.speedloader import speedloader_schedule

__all__ = [
    "Schedule",
    "Step",
    "ScheduleRequest",
    "Policy",
    "POLICIES",
    "policy_for",
    "plan_schedule",
    "schedule_of",
    "speedloader_schedule",
    "grad_accumulation_schedule",
]
