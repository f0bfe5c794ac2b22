"""Policies: functions that turn the block graph and a config into a Schedule."""

from slcompile.schedules.base import Schedule, Step
from slcompile.schedules.grad_accumulation import grad_accumulation_schedule
from slcompile.schedules.policies import POLICIES, Policy, policy_for
from slcompile.schedules.speedloader import speedloader_schedule

__all__ = [
    "Schedule",
    "Step",
    "Policy",
    "POLICIES",
    "policy_for",
    "speedloader_schedule",
    "grad_accumulation_schedule",
]
