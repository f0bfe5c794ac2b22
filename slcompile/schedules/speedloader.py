"""The speedloader policy: layer-major over sub-batches, forward and backward.

Forward: the prefix for each sub-batch, then every block for sub-batches 0..K-1 before
the next block, then the suffix per sub-batch and the loss combined over all of them.
Backward mirrors it: the loss, the suffix for sub-batches K-1..0, blocks from last to
first with sub-batches K-1..0 (the order in which the autograd engine runs ready work:
highest sequence number first), then the prefix. Streamed weights are fetched once per
block per pass, shared by the K sub-batches; saved activations, when they rest off the
device, are stashed for the (block, sub-batch) steps of the prefix and the blocks the
planner chooses (all of them without a memory budget; `add_stashes`); weight
gradients, when an offloaded optimizer takes them, leave once per block, after the
block's last sub-batch's backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from slcompile.errors import PolicyError
from slcompile.schedules.base import (
    STASH_TIERS,
    Schedule,
    ScheduleRequest,
    Step,
    add_fetches,
    add_gradient_stores,
    next_region,
)
from slcompile.schedules.policy import Policy
from slcompile.schedules.planner import choose_stashes, load_issue_at, store_wait_at, unit_lifetimes, without_kept
from slcompile.schedules.validate import UNNAMED_POLICY, stash_tier_problem

__all__ = [
    "speedloader_schedule", "layer_major_compute", "suffix_compute", "add_stashes", "add_spills", "add_stores", "SPEEDLOADER",
    "NO_OFFLOAD",
]


def suffix_compute(request: ScheduleRequest) -> list[Step]:
    """The forward's suffix steps: one on the whole batch when the request runs it
    whole, else one per sub-batch in order."""
    if request.whole_suffix:
        return [Step("fwd", "suffix")]
    return [Step("fwd", "suffix", subbatch=s) for s in range(request.num_subbatches)]


def layer_major_compute(request: ScheduleRequest) -> list[Step]:
    """The compute steps in layer-major order, forward then (if any) backward.

    Forward: the prefix for sub-batches 0..K-1, then each block for sub-batches
    0..K-1 before the next block, then the suffix for 0..K-1 (or once, on the whole
    batch, when `request.whole_suffix`: `suffix_compute`); the backward is the
    forward reversed. A policy that keeps this order and changes only the transfers
    starts here; one with its own order writes its compute steps itself (each unit
    once per sub-batch per phase: `validate_schedule`) and adds the transfers with
    `add_fetches`, `add_stashes` and `add_stores`.
    """
    k = request.num_subbatches
    forward: list[Step] = []
    if request.has_prefix:
        forward += [Step("fwd", "prefix", subbatch=s) for s in range(k)]
    for block in request.blocks:
        forward += [Step("fwd", "block", block, s) for s in range(k)]
    if request.has_suffix:
        forward += suffix_compute(request)
    if not request.backward:
        return forward
    return forward + [dataclasses.replace(step, phase="bwd") for step in reversed(forward)]


def add_stashes(steps: list[Step], request: ScheduleRequest, keep=lambda step: False, *,
                tier=lambda step: None, kept_saved: Collection[str] = frozenset()) -> list[Step]:
    """Stashes the saved activations of the forward (prefix or block, sub-batch)
    steps that `keep(step)` does not keep on the device and, once their lifetimes
    are known (`request.saved`), that the planner moves off the device under the
    memory budget (`slcompile.schedules.planner.choose_stashes`).

    `tier(step)` names the tier a step's stash goes to (`Step.tier`: "host" or
    "nvme"; None: the `activations` option's); a step whose tier copies nothing on
    this machine (not in `request.stash_tiers`: the host of a CPU machine) keeps its
    activations on the device, and any other name ("disk", "NVMe") raises a
    `PolicyError` naming it and the tiers allowed (`stash_tier_problem`), whatever
    the request moves. The saved tensors named in `kept_saved` stay on the
    device whatever their unit does: the policy writes the same names into its
    `Schedule(..., kept_saved=...)`, and the planner counts and places the others.

    The stash is issued after the step's compute. Once the saved activations are
    known (`request.saved`), their transfers are placed from their lifetimes: the
    store is waited for just before the compute step after the last forward use,
    the load waited for just before the first backward use and issued one compute
    step before that; with the time model's facts (`request.timing`) the store is
    waited for and the load issued where the compute between covers their time
    (`slcompile.schedules.planner.store_wait_at`, `load_issue_at`). A step none of
    whose activations may leave writes no step.
    Transfers that run before a compute step come after its weight fetches.
    """
    tiers = {s.key: tier(s) for s in steps if s.phase == "fwd" and s.kind == "compute" and s.region != "suffix"}
    for (region, block, subbatch), named in tiers.items():
        # Checked whatever the request moves: a mistyped tier is an error, never a unit left on the device.
        problem = None if named is None else stash_tier_problem(named)
        if problem:
            raise PolicyError(UNNAMED_POLICY, problem,
                              Step("fwd", region, block, subbatch, "stash.issue", tier=named).text())
    if not (request.activations_offloaded and request.backward):
        return steps
    allowed = STASH_TIERS if request.stash_tiers is None else request.stash_tiers
    units = [s.key for s in steps if s.phase == "fwd" and s.kind == "compute" and s.region != "suffix"
             and not keep(s) and (tiers[s.key] is None or tiers[s.key] in allowed)]
    if request.saved is None:
        leaving = []
    else:
        saved = without_kept(request.saved, kept_saved)
        lifetimes = unit_lifetimes(steps, saved, request.timing)
        chosen = choose_stashes([lifetimes[unit] for unit in units if unit in lifetimes], request)
        units = [unit for unit in units if unit in chosen]
        leaving = [a for a in saved if a.stays is None and a.owner in chosen]
    compute = {phase: [s.key for s in steps if s.phase == phase and s.kind == "compute"] for phase in ("fwd", "bwd")}
    position = {phase: {key: i for i, key in enumerate(keys)} for phase, keys in compute.items()}
    before: dict[tuple[str, int], list[Step]] = {}  # (phase, compute position) -> transfers

    def place(phase: str, at: int, step: Step) -> None:
        at = min(at, len(compute[phase]))  # past the last compute step: the end of the phase
        if step not in before.setdefault((phase, at), []):
            before[phase, at].append(step)

    unit_bytes: dict[tuple, int] = {}
    for activation in leaving:
        unit_bytes[activation.owner] = unit_bytes.get(activation.owner, 0) + activation.nbytes
    for activation in leaving:
        region, block, subbatch = activation.owner
        owner = position["fwd"][activation.owner]
        last = position["fwd"].get(activation.last_forward_use, owner)
        at, _ = store_wait_at(compute["fwd"], owner, last, unit_bytes[activation.owner], request.timing)
        place("fwd", at, Step("fwd", region, block, subbatch, "stash.wait"))
    loads: dict[tuple, list[tuple[int, int]]] = {}  # owner -> (wait position, issue position) per tensor
    for activation in leaving:
        use = position["bwd"].get(activation.first_backward_use)
        if use is None:
            continue
        at, _ = load_issue_at(compute["bwd"], use, activation.nbytes, request.timing)
        loads.setdefault(activation.owner, []).append((use, at))
    for (region, block, subbatch), owned in loads.items():
        for use, at in _shared_issues(owned):
            place("bwd", at, Step("bwd", region, block, subbatch, "unstash.issue"))
            place("bwd", use, Step("bwd", region, block, subbatch, "unstash.wait"))
    for transfers in before.values():  # stash waits, then issues, then waits, each in step order
        kinds = ("stash.wait", "unstash.issue", "unstash.wait")
        transfers.sort(key=lambda s: (kinds.index(s.kind), position["fwd"].get(s.key, 0)))

    out: list[Step] = []
    seen = {"fwd": 0, "bwd": 0}
    for index, step in enumerate(steps):
        if step.kind == "compute":
            out += before.get((step.phase, seen[step.phase]), [])
            seen[step.phase] += 1
        out.append(step)
        if step.kind == "compute" and step.phase == "fwd" and step.key in units:
            out.append(Step("fwd", step.region, step.block, step.subbatch, "stash.issue", tier=tiers[step.key]))
        ends_phase = index + 1 == len(steps) or steps[index + 1].phase != step.phase
        if ends_phase:
            out += before.get((step.phase, len(compute[step.phase])), [])
    return out


def _shared_issues(loads: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (wait, issue) positions of one owner's loads, each issue moved so that
    `offload_saved` finds it: it gives a tensor the owner's last `unstash.issue`
    before a compute step earlier than the tensor's wait. A load issued before an
    earlier wait of the same owner (a large tensor needs more compute to hide behind,
    `load_issue_at`) would be taken by that wait's tensors, and an issue written
    earlier for them by none: such loads share one issue, the earliest of them."""
    groups: list[tuple[int, list[int]]] = []  # (issue, waits), waits in order
    for use, at in sorted(loads):
        issue, waits = at, [use]
        # Merged with every earlier group whose last wait comes after this issue.
        while groups and issue < groups[-1][1][-1]:
            earlier, earlier_waits = groups.pop()
            issue, waits = min(issue, earlier), earlier_waits + waits
        groups.append((issue, waits))
    return [(wait, issue) for issue, waits in groups for wait in waits]


def add_spills(steps: list[Step], request: ScheduleRequest, keep=lambda step: False,
               min_wait: int = 3) -> list[Step]:
    """Spills the boundary activations that wait long: the output of a forward (prefix
    or block, sub-batch) step that `keep(step)` does not keep, whose reader (the same
    sub-batch's next region, `next_region`) runs at least `min_wait` compute steps
    later, rests on the activations' tier while the other steps run.

    Its store is issued right after the step (after the step's stash, whose store it
    shares when the output is also saved for the backward), waited for before the
    compute step after next (the store overlaps one step), its load issued one
    compute step before the reader and waited for just before it. With a wait of 2
    steps the output comes back as soon as it left, so the default spills waits of
    3 or more. A
    stashed output's `stash.wait` after its reader goes (its store is the spill's).
    Call it after `add_stashes` and before `add_stores`.

    Returns:
        the steps with `spill.*` and `fill.*` steps inserted (unchanged when
        activations stay on the device).
    """
    if not request.activations_offloaded:
        return list(steps)
    forward = [s for s in steps if s.phase == "fwd" and s.kind == "compute"]
    position = {s.key: i for i, s in enumerate(forward)}
    after: dict[int, list[Step]] = {}  # forward compute position -> transfers right after it
    before: dict[int, list[Step]] = {}  # ... right before it (after its fetches and stash steps)
    reader_of: dict[tuple, tuple] = {}
    for at, step in enumerate(forward):
        reader = next_region(step.key, request)
        if reader is None or reader not in position or keep(step):
            continue
        read = position[reader]
        if read - at - 1 < max(min_wait, 2):
            continue
        reader_of[step.key] = reader
        region, block, subbatch = step.key
        after.setdefault(at, []).append(Step("fwd", region, block, subbatch, "spill.issue"))
        before.setdefault(at + 2, []).append(Step("fwd", region, block, subbatch, "spill.wait"))
        before.setdefault(read - 1, []).append(Step("fwd", region, block, subbatch, "fill.issue"))
        before.setdefault(read, []).append(Step("fwd", region, block, subbatch, "fill.wait"))
    out: list[Step] = []
    pending: list[Step] = []
    seen, computing = 0, None
    for step in steps:
        if pending and not (step.kind == "stash.issue" and step.key == computing):
            out += pending
            pending = []
        if step.phase == "fwd" and step.kind == "compute":
            out += before.get(seen, [])
            out.append(step)
            pending = after.get(seen, [])
            seen, computing = seen + 1, step.key
        elif not (step.phase == "fwd" and step.kind == "stash.wait" and reader_of.get(step.key) == computing):
            out.append(step)
    return out + pending


def speedloader_schedule(request: ScheduleRequest) -> Schedule:
    """The speedloader schedule for a request."""
    steps = add_fetches(layer_major_compute(request), request, per_subbatch=False)
    return Schedule(tuple(add_stores(add_stashes(steps, request), request)))


def add_stores(steps: list[Step], request: ScheduleRequest) -> list[Step]:
    """Each block's weight gradients leave once, summed over its sub-batches, after
    its last sub-batch's backward (`add_gradient_stores`), when they leave at all
    (`request.gradients_offloaded` with streamed weights, in a backward); else the
    steps unchanged. Call it last, on steps with fetches and stashes placed."""
    if not (request.gradients_offloaded and request.weights_streamed and request.backward):
        return steps
    return add_gradient_stores(steps, per_subbatch=False)


SPEEDLOADER = Policy("speedloader", speedloader_schedule, suffix="whole")
NO_OFFLOAD = Policy("no_offload", speedloader_schedule, suffix="whole")
