"""The policies the `schedule` option names, and the schedule of a compiled graph.

`policy_for(config.schedule)` returns the `Policy` of an option value (a registered
name, or a `Policy` object passed as the option); `plan_schedule(blocks, config, ...)`
asks it for the schedule of one graph. `register_policy(policy)` adds a name the
`schedule` option (and the CLI's `--schedule`) accepts. Which tiers a schedule allows is checked by
`SpeedLoaderConfig`, where the options are documented.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from slcompile.analysis.blocks import BlockGraph
from slcompile.errors import BudgetError, PolicyError
from slcompile.schedules.base import Schedule, ScheduleRequest
from slcompile.schedules.policy import Policy
from slcompile.schedules.examples.lifetime_aware import LIFETIME_AWARE
from slcompile.schedules.examples.spilling import SPILLING, ZIGZAG_SPILLING
from slcompile.schedules.generation import generation_pass
from slcompile.schedules.grad_accumulation import GRAD_ACCUMULATION
from slcompile.schedules.speedloader import NO_OFFLOAD, SPEEDLOADER

__all__ = ["POLICIES", "BUILTIN_POLICIES", "GENERATION", "policy_for", "plan_schedule", "register_policy",
           "unknown_policy", "suffix_choices", "suffix_plans", "plan_suffix"]

log = logging.getLogger(__name__)

POLICIES: dict[str, Policy] = {
    policy.name: policy
    for policy in (SPEEDLOADER, GRAD_ACCUMULATION, NO_OFFLOAD, LIFETIME_AWARE, SPILLING, ZIGZAG_SPILLING)
}


BUILTIN_POLICIES = tuple(POLICIES)
"""The names of the policies slcompile ships (`register_policy` cannot replace them)."""

GENERATION = Policy("speedloader", generation_pass)
"""A generation pass's policy (`slcompile.generate`'s default `schedule`): each layer
for every sub-batch before the next layer, its weights fetched once for all of them
(`slcompile.schedules.generation`). Its request is a `PassRequest`; its schedules
are validated by `validate_pass`."""


def register_policy(policy: Policy, *, replace: bool = False) -> Policy:
    """Makes `options={"schedule": policy.name}` (and `--schedule NAME` on the command
    line) select `policy`.

    Args:
        policy: the policy; its `name` is the option value.
        replace: replace a policy registered under the same name before.

    Returns:
        the policy, so a module can write `ZIGZAG = register_policy(Policy(...))`.

    Raises:
        PolicyError: the name is taken (and `replace` is False) or is a built-in
            policy's, or `policy` is not a `Policy`.
    """
    if not isinstance(policy, Policy):
        raise PolicyError(repr(policy), "register_policy takes a slcompile.schedules.Policy(name, build)")
    if not isinstance(policy.name, str) or not policy.name:
        raise PolicyError(repr(policy.name), "a registered policy needs a non-empty string name")
    if policy.name in BUILTIN_POLICIES and POLICIES[policy.name] is not policy:
        raise PolicyError(policy.name, "is a built-in policy's name; choose another")
    if policy.name in POLICIES and POLICIES[policy.name] is not policy and not replace:
        raise PolicyError(policy.name, "a policy of this name is registered already; pass replace=True to "
                                       "replace it")
    POLICIES[policy.name] = policy
    return policy


def unknown_policy(name) -> str | None:
    """Why `name` selects no policy, or None when it does (a registered name)."""
    if isinstance(name, str) and name in POLICIES:
        return None
    return (
        f"speedloader option 'schedule' must be a registered policy's name, one of "
        f"{', '.join(map(repr, POLICIES))}, or a slcompile.schedules.Policy object, got {name!r} "
        "(slcompile.schedules.register_policy(policy) registers a name)"
    )


def policy_for(schedule: str | Policy) -> Policy:
    """The Policy of a `schedule` option value (already validated by the config)."""
    if isinstance(schedule, Policy):
        return schedule
    return POLICIES[schedule]


def suffix_choices(config) -> tuple[bool, ...]:
    """Whether the suffix runs whole, for each plan of the `suffix` option to try in
    order: the option's own value, or under "auto" the policy's (`Policy.suffix`),
    then, when a `memory_budget` may refuse it, per sub-batch. One sub-batch is the
    whole batch either way."""
    if config.num_subbatches == 1:
        return (False,)
    choice = config.suffix if config.suffix != "auto" else policy_for(config.schedule).suffix
    if choice != "whole":
        return (False,)
    if config.suffix == "auto" and config.memory_budget is not None:
        return (True, False)
    return (True,)


def suffix_plans(config) -> list:
    """The configs to plan a graph with, in order (`suffix_choices`): `config`
    itself, or under "auto" with a `memory_budget`, the suffix "whole" and then, if
    no plan meets the budget that way, "subbatches"."""
    choices = suffix_choices(config)
    if len(choices) == 1:
        return [config]
    return [dataclasses.replace(config, suffix="whole" if whole else "subbatches") for whole in choices]


def plan_suffix(config, attempt: Callable[[Any], Any]) -> tuple[Any, Any]:
    """`(planned, attempt(planned))` for the first of `suffix_plans(config)` whose
    `attempt` raises no `BudgetError`; the last plan's `BudgetError` propagates."""
    *first, last = suffix_plans(config)
    for planned in first:
        try:
            return planned, attempt(planned)
        except BudgetError as err:
            log.info("speedloader: %s with the suffix run whole; planning it per sub-batch", err)
    return last, attempt(last)


def plan_schedule(
    blocks: BlockGraph,
    config,
    *,
    weights_streamed: bool = False,
    activations_offloaded: bool = False,
    backward: bool = True,
    gradients_offloaded: bool = False,
    stash_tiers: tuple[str, ...] | None = None,
    whole_suffix: bool = False,
) -> Schedule:
    """The schedule the configured policy writes for one graph's blocks.

    Args:
        blocks: the block graph.
        config: the backend's options (`SpeedLoaderConfig`).
        weights_streamed: block weights rest off the device (a tier that copies).
        activations_offloaded: saved activations rest off the device.
        backward: the graph is trained (a forward and a backward).
        gradients_offloaded: the streamed weights' gradients leave the device.
        stash_tiers: the tiers a unit's stash may name on this machine (None: any
            slower tier).
        whole_suffix: the suffix runs once on the whole batch (`BatchPlan.whole_suffix`).
    """
    request = ScheduleRequest(
        blocks=tuple(block.index for block in blocks.blocks),
        num_subbatches=config.num_subbatches,
        live_blocks=config.live_blocks,
        weights_streamed=weights_streamed,
        activations_offloaded=activations_offloaded,
        backward=backward,
        gradients_offloaded=gradients_offloaded,
        stash_tiers=stash_tiers,
        whole_suffix=whole_suffix,
    )
    return policy_for(config.schedule)(request)
