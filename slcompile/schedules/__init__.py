"""Policies: functions that turn the block graph and a config into a Schedule."""

from slcompile.schedules.base import Schedule, Step
from slcompile.schedules.speedloader import speedloader_schedule

__all__ = ["Schedule", "Step", "speedloader_schedule"]
