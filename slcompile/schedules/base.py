"""The schedule: the ordered compute and transfer steps of one step of the model.

A policy (`Policy.build(request) -> Schedule`) writes the schedule from the block graph
and the options (`ScheduleRequest`); the passes emit the graphs in its order
(`Schedule.order` orders compute, `fetches_per_subbatch`, `stashes` and
`gradient_stores` say what to move, `Schedule.recompute` which units the backward
recomputes). It is asked twice: at the Dynamo stage for the order and the units
recomputed, and once the forward and backward are partitioned with the saved
activations' lifetimes (`Schedule.replan(saved=...)`), which place the stash and
unstash steps (`offload_saved` emits each where its step is). `schedule_of(forward,
backward)` (`slcompile.schedules.derive`) reads the same steps back from the
compiled graphs, so the plan and what was compiled can be compared.

Text form (deterministic; `explain()`, the CLI and the tests print and compare it), one
line per step:

    fwd blk3.sb1                 compute of block 3, sub-batch 1, in the forward
    fwd prefix.sb0               compute before the first block (suffix: after the last)
    fwd suffix                   the suffix, once on the whole batch (`whole_suffix`)
    fwd fetch.issue blk4         start loading block 4's weights
    fwd fetch.issue blk0@bwd     ... for the fetch of the other phase's graph (issued at
                                 the end of this graph, waited for in the next one)
    fwd fetch.wait blk4          block 4's weights are needed now
    fwd fetch.wait blk4.sb1      a fetch for sub-batch 1 alone (grad_accumulation)
    fwd stash.issue blk2.sb0     start storing the saved activations of (2, 0)
    fwd stash.issue blk2.sb0 host  ... onto the host tier (without a tier: the
                                 `activations` option's)
    fwd stash.wait blk2.sb0      their store is done (their memory may go)
    bwd unstash.issue blk2.sb0   start loading them back
    bwd unstash.wait blk2.sb0    they are needed now
    bwd store_grad.issue blk2    start storing block 2's weight gradients (summed over
                                 the sub-batches) to the optimizer's tier
    bwd store_grad.issue blk2.sb1  ... sub-batch 1's share of them alone
    bwd store_grad.wait blk2     their store is done (their memory may go)
    fwd spill.issue blk2.sb0     start storing the output of (2, 0) while it waits for
                                 its sub-batch's next block (its boundary activation)
    fwd spill.wait blk2.sb0      that store is done (the output's memory may go)
    fwd fill.issue blk2.sb0      start loading it back
    fwd fill.wait blk2.sb0       it is needed now (by block 3, sub-batch 0)
    decode load_kv.issue blk2.sb0   a generation pass: start loading the KV cache of
                                 (2, 0) (`slcompile.schedules.generation`)
    decode store_kv.issue blk2.sb0  store its new positions

`<phase> <kind> <tag>`, where the tag names whose data moves (`blk4`: the weights of
block 4 for all sub-batches; `blk2.sb0`: what (block 2, sub-batch 0) owns); a
`stash.issue` may end with the tier its unit's saved activations go to (`Step.tier`:
"host" or "nvme"). A saved tensor the schedule keeps on the device although its unit
stashes (`Schedule.kept_saved`, by its `SavedActivation.name`) is one line after the
steps:

    keep mul_4                   the saved tensor `mul_4` stays on the device

In the
schedule read back from graphs (`schedule_of`), runs of the same line collapse into
one, and transfer lines do not interrupt a compute run: a compute line is written when
the computing (block, sub-batch) changes.

A schedule that chooses which forward units the backward recomputes
(`Schedule.recompute`) opens with one more line, naming them in block and sub-batch
order (`recompute none` when it recomputes none of them):

    recompute blk1.sb0 blk1.sb1 blk3.sb0

A schedule is data: `Schedule.from_text(schedule.text())` and
`Schedule.from_json(schedule.to_json())` give back an equal schedule (steps compare
equal; an issue serving its own phase is the same step with `serves=None`), so a
schedule written elsewhere (an external solver's) can be read, validated and replayed
(`slcompile.schedules.replay`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from slcompile.meta import format_tag, parse_tag
from slcompile.vocabulary import issued_visit

__all__ = [
    "Step", "Schedule", "SavedActivation", "PhaseOrder", "ScheduleRequest", "TRANSFER_KINDS", "add_fetches",
    "add_gradient_stores", "next_region", "recompute_text", "REQUEST_FIELDS", "SCHEDULE_FORMAT", "STASH_TIERS",
]

SCHEDULE_FORMAT = "slcompile.schedule/1"
"""The `format` of `Schedule.to_json()`'s text."""

REQUEST_FIELDS = (
    "blocks", "num_subbatches", "live_blocks", "weights_streamed", "activations_offloaded", "backward",
    "has_prefix", "has_suffix", "gradients_offloaded", "whole_suffix",
)
"""The `ScheduleRequest` fields a schedule is written for and `to_json` keeps: what
the compiled graph is (its blocks, K, its tiers), not what the planner learnt on the
way (`saved`, `offload_at_least`, `stash_everything`, `stash_tiers`, `timing`)."""

_STEP_FIELDS = ("phase", "region", "block", "subbatch", "kind", "serves", "tier")

STASH_TIERS = ("host", "nvme")
"""The slower tiers a unit's saved activations may be stashed to (`Step.tier`)."""

TRANSFER_KINDS = (
    "fetch.issue", "fetch.wait", "stash.issue", "stash.wait", "unstash.issue", "unstash.wait",
    "store_grad.issue", "store_grad.wait", "spill.issue", "spill.wait", "fill.issue", "fill.wait",
    "load_kv.issue", "store_kv.issue",
)
"""Transfer step kinds: what moves (weights fetched, activations stashed and unstashed,
gradients stored, boundary activations spilled and filled, a generation's KV cache
loaded and stored), and which half of its issue + wait pair the step is (a
generation pass's layer step waits for its own cache, and the pass's end for every
store: `slcompile.schedules.generation`)."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One step.

    Attributes:
        phase: "fwd" or "bwd": the graph the step runs in.
        region: "prefix", "block" or "suffix".
        block: block index for region "block".
        subbatch: the sub-batch, or None for work or data shared by all sub-batches.
        kind: "compute" or one of `TRANSFER_KINDS`.
        serves: for an issue, the phase of the wait it serves when that is the other
            graph's (issued at the end of the forward for the backward), else None.
        tier: for a `stash.issue`, the tier (one of `STASH_TIERS`) the unit's saved
            activations go to; None: the `activations` option's.
    """

    phase: str
    region: str
    block: int | None = None
    subbatch: int | None = None
    kind: str = "compute"
    serves: str | None = None
    tier: str | None = None

    def __post_init__(self) -> None:
        # An issue serving its own phase is written without `@phase`: one step, one text.
        if self.serves is not None and self.serves == self.phase and self.kind.endswith(".issue"):
            object.__setattr__(self, "serves", None)

    @classmethod
    def from_text(cls, line: str) -> Step:
        """The step of one text line (`Step.text()`'s inverse): `fwd blk3.sb1`,
        `fwd fetch.issue blk0@bwd`, `fwd stash.issue blk2.sb0 host`, `prefill prefix`.

        Raises:
            ValueError: the line is not a step's text.
        """
        words = line.split()
        if len(words) not in (2, 3, 4):
            raise ValueError(f"not a schedule step: {line!r} (`<phase> <tag>`, `<phase> <kind> <tag>` or "
                             "`<phase> stash.issue <tag> <tier>`)")
        tier = words.pop() if len(words) == 4 else None
        phase, tag = words[0], words[-1]
        kind = "compute" if len(words) == 2 else words[1]
        if kind != "compute" and kind not in TRANSFER_KINDS:
            raise ValueError(f"not a schedule step: {line!r}: kind {kind!r} is not one of {', '.join(TRANSFER_KINDS)}")
        serves = None
        if "@" in tag and kind != "compute":
            tag, serves = tag.split("@", 1)
        region, block, subbatch = parse_tag(tag)
        return cls(phase, region, block, subbatch, kind, serves, tier)

    @property
    def tag(self) -> str:
        return format_tag(self.region, self.block, self.subbatch)

    @property
    def key(self) -> tuple[str, int | None, int | None]:
        """(region, block, sub-batch): what the step computes or moves."""
        return self.region, self.block, self.subbatch

    def text(self) -> str:
        if self.kind == "compute":
            return f"{self.phase} {self.tag}"
        serves = f"@{self.serves}" if self.serves is not None and self.serves != self.phase else ""
        tier = f" {self.tier}" if self.tier is not None else ""
        return f"{self.phase} {self.kind} {self.tag}{serves}{tier}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """An ordered tuple of steps.

    Attributes:
        steps: the steps.
        policy, request: what wrote it (None for a schedule read from graphs), so
            a later stage can ask the policy again with what it learnt
            (`replan`); not compared.
        kept_saved: names (`SavedActivation.name`) of saved tensors that stay on
            the device although their unit stashes (any collection of names; kept
            as a frozenset). Only a schedule written with the saved tensors known
            (`request.saved`) can name them.
        recompute: the (block, sub-batch) units whose forward the backward
            recomputes from the unit's input, saving only what leaves the unit (and
            its random masks); every other unit saves its activations. None: the
            schedule does not say, and the `recompute` option decides for every unit
            ("blocks": all of them; "none": none; "auto": the budget search). A set,
            empty or not, is the choice, whatever the option says. It is read from
            the Dynamo stage's schedule (`request.saved` is None then): the joint
            graph is tagged before the saved activations are known, so the schedule
            asked again with them must name the same units. A step without a
            backward recomputes nothing; the schedule read back from the graphs
            (`schedule_of`) does not say.
    """

    steps: tuple[Step, ...]
    # The `Policy` (`slcompile.schedules.policy`) that wrote it: request -> schedule.
    policy: Callable[[ScheduleRequest], Schedule] | None = dataclasses.field(default=None, compare=False, repr=False)
    request: ScheduleRequest | None = dataclasses.field(default=None, compare=False, repr=False)
    kept_saved: frozenset[str] = frozenset()
    recompute: frozenset[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kept_saved, frozenset):
            kept = self.kept_saved
            object.__setattr__(self, "kept_saved", frozenset([kept] if isinstance(kept, str) else kept))
        # Any collection of pairs is the same choice; `validate_schedule` names a unit
        # that is not a (block, sub-batch) pair.
        if self.recompute is not None and not isinstance(self.recompute, frozenset):
            try:
                units = frozenset(tuple(unit) if isinstance(unit, list) else unit for unit in self.recompute)
            except TypeError:
                return
            object.__setattr__(self, "recompute", units)

    def replan(self, **changes) -> Schedule:
        """The policy's schedule for the same request with `changes` (its fields),
        or this schedule when no policy wrote it."""
        if self.policy is None or self.request is None:
            return self
        return self.policy(dataclasses.replace(self.request, **changes))

    def text(self) -> str:
        """A `recompute` line when the schedule chooses, one line per step, then a
        `keep <name>` line per kept saved tensor (sorted)."""
        lines = [step.text() for step in self.steps]
        if self.recompute is not None:
            lines.insert(0, recompute_text(self.recompute))
        return "\n".join([*lines, *(f"keep {name}" for name in sorted(self.kept_saved))])

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """The schedule of `text()`, one step or `keep <name>` per line (blank lines
        skipped), and the units it recomputes from a `recompute` line; it carries no
        policy and no request.

        Raises:
            ValueError: naming the line that is not a step.
        """
        steps, kept, recompute = [], [], None
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if words[:1] == ["keep"]:
                if len(words) != 2:
                    raise ValueError(f"schedule line {number}: not a kept saved tensor: {line!r} (`keep <name>`)")
                kept.append(words[1])
            elif words:
                try:
                    if words[0] == "recompute":
                        if recompute is not None:
                            raise ValueError("a second `recompute` line")
                        recompute = _recompute_of_text(line)
                    else:
                        steps.append(Step.from_text(line))
                except ValueError as err:
                    raise ValueError(f"schedule line {number}: {err}") from None
        return cls(tuple(steps), kept_saved=frozenset(kept), recompute=recompute)

    def to_json(self) -> str:
        """The schedule as JSON text: `format` (`SCHEDULE_FORMAT`), `policy` (the
        writer's name, or null), `request` (its `REQUEST_FIELDS`, or null),
        `recompute` (only when the schedule chooses: its units as [block,
        sub-batch] pairs, sorted), `kept_saved` (sorted names) when the schedule keeps
        saved tensors, and `steps`, one object a line with every `Step` field (null
        where None; `tier` only where a step names one); a generation pass's request
        (`PassRequest`) is not written."""
        request = None
        if isinstance(self.request, ScheduleRequest):
            request = {name: getattr(self.request, name) for name in REQUEST_FIELDS}
            request["blocks"] = list(request["blocks"])
        head = [
            f'  "format": {json.dumps(SCHEDULE_FORMAT)}',
            f'  "policy": {json.dumps(self.policy.name if self.policy is not None else None)}',
            f'  "request": {json.dumps(request)}',
        ]
        if self.recompute is not None:
            head.append(f'  "recompute": {json.dumps([list(unit) for unit in sorted(self.recompute)])}')
        if self.kept_saved:
            head.append(f'  "kept_saved": {json.dumps(sorted(self.kept_saved))}')
        steps = ",\n".join(
            "    " + json.dumps({name: getattr(step, name) for name in _STEP_FIELDS
                             if name != "tier" or step.tier is not None}) for step in self.steps
        )
        return "{\n" + ",\n".join(head) + ',\n  "steps": [\n' + steps + "\n  ]\n}\n"

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """The schedule of `to_json()`'s text (or any JSON of that shape: a step's
        `block`, `subbatch`, `serves` and `tier` may be left out for None, its `kind`
        for "compute"; `kept_saved` for none; `recompute` for a schedule that does
        not choose). Its `request` (the `REQUEST_FIELDS`; the others at their
        defaults) says what it was written for; its policy is not kept.

        Raises:
            ValueError: not that format, naming the step or field at fault.
        """
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != SCHEDULE_FORMAT:
            raise ValueError(f"not a schedule's JSON: its \"format\" must be {SCHEDULE_FORMAT!r}")
        if not isinstance(data.get("steps"), list):
            raise ValueError("a schedule's JSON needs \"steps\": a list of steps")
        steps = []
        for number, fields in enumerate(data["steps"]):
            if not isinstance(fields, dict) or set(fields) - set(_STEP_FIELDS) or not {"phase", "region"} <= set(fields):
                raise ValueError(f"step {number}: {fields!r} is not a step (fields: {', '.join(_STEP_FIELDS)}; "
                                 "phase and region required)")
            steps.append(Step(**fields))
        request = data.get("request")
        if request is not None:
            # A schedule written before the suffix could run whole has no `whole_suffix`: False.
            if not isinstance(request, dict) or set(request) - set(REQUEST_FIELDS) \
                    or set(REQUEST_FIELDS) - set(request) - {"whole_suffix"}:
                raise ValueError(f"\"request\" must have exactly the fields {', '.join(REQUEST_FIELDS)}")
            request = ScheduleRequest(**{**request, "blocks": tuple(request["blocks"])})
        kept = data.get("kept_saved", [])
        if not isinstance(kept, list) or not all(isinstance(name, str) for name in kept):
            raise ValueError("\"kept_saved\" must be a list of saved tensors' names")
        recompute = data.get("recompute")
        if recompute is not None:
            if not isinstance(recompute, list) or not all(
                    isinstance(unit, list) and len(unit) == 2 and all(type(i) is int for i in unit)
                    for unit in recompute):
                raise ValueError(f"\"recompute\" must be a list of [block, sub-batch] pairs of integers, "
                                 f"got {recompute!r}")
            recompute = frozenset(map(tuple, recompute))
        return cls(tuple(steps), request=request, kept_saved=frozenset(kept), recompute=recompute)

    def phase(self, phase: str) -> Schedule:
        return Schedule(tuple(s for s in self.steps if s.phase == phase))

    def compute(self) -> Schedule:
        """The compute steps alone."""
        return Schedule(tuple(s for s in self.steps if s.kind == "compute"))

    def without(self, *kinds: str) -> Schedule:
        """The schedule without the steps whose kind starts with one of `kinds`
        (`without("stash.wait", "unstash")`), runs of equal steps collapsed again."""
        steps: list[Step] = []
        for step in self.steps:
            if not step.kind.startswith(kinds) and (not steps or steps[-1] != step):
                steps.append(step)
        return Schedule(tuple(steps))

    def tags(self) -> tuple[str, ...]:
        return tuple(s.tag for s in self.steps)

    def order(self, phase: str) -> PhaseOrder:
        """The compute order of one phase: what the passes emit and sort graphs by."""
        position: dict[tuple[str, int | None, int | None], int] = {}
        for step in self.steps:
            if step.phase == phase and step.kind == "compute":
                position.setdefault(step.key, len(position))
        return PhaseOrder(position)

    def fetches_per_subbatch(self) -> bool:
        """Whether a block's weights are fetched more than once a pass: a
        `fetch.wait` names a sub-batch (per sub-batch, or per run of sub-batches)."""
        return any(s.kind == "fetch.wait" and s.subbatch is not None for s in self.steps)

    def fetch_groups(self) -> dict[tuple[int, int], int | None]:
        """(block, sub-batch) -> the sub-batch naming the fetch of the block's weights
        it computes with: the one of the forward's last `fetch.wait` of the block
        before its compute step (None: one fetch for every sub-batch). A `fetch.wait
        blk3.sb2` serves sub-batch 2 and those after it, up to the block's next
        wait: per sub-batch, or per run of a block's sub-batches. The backward
        computes with the fetch of the same group (the graphs recompute each forward
        fetch for its readers)."""
        phase = "fwd" if any(s.phase == "fwd" for s in self.steps) else None
        groups: dict[tuple[int, int], int | None] = {}
        current: dict[int, int | None] = {}
        for step in self.steps:
            if phase is not None and step.phase != phase or step.region != "block":
                continue
            if step.kind == "fetch.wait":
                current[step.block] = step.subbatch
            elif step.kind == "compute" and step.block in current:
                groups[step.block, step.subbatch] = current[step.block]
        return groups

    def stashes(self) -> frozenset[tuple[str, int | None, int]]:
        """(region, block, sub-batch) whose saved activations the schedule stores
        off the device between the forward and the backward."""
        return frozenset(s.key for s in self.steps if s.kind == "stash.issue")

    def stash_tiers(self) -> dict[tuple[str, int | None, int], str]:
        """(region, block, sub-batch) -> the tier its stash goes to, for the units
        whose `stash.issue` names one (the others' go to the `activations` option's)."""
        return {s.key: s.tier for s in self.steps if s.kind == "stash.issue" and s.tier is not None}

    def spills(self) -> tuple[tuple[str, int | None, int], ...]:
        """(region, block, sub-batch) whose output the forward stores off the device
        while it waits for the sub-batch's next region, in the forward's order."""
        return tuple(s.key for s in self.steps if s.kind == "spill.issue")

    def gradient_stores(self) -> tuple[tuple[int, int | None], ...]:
        """(block, sub-batch) of each gradient store, in the backward's order: a
        sub-batch of None stores the block's gradients summed over its sub-batches."""
        return tuple((s.block, s.subbatch) for s in self.steps if s.kind == "store_grad.issue")

    def __len__(self) -> int:
        return len(self.steps)


def recompute_text(units) -> str:
    """The `recompute` line of a schedule's text: `recompute blk1.sb0 blk3.sb1`
    (sorted), or `recompute none`."""
    if not units:
        return "recompute none"
    return "recompute " + " ".join(format_tag("block", block, subbatch) for block, subbatch in sorted(units))


def _recompute_of_text(line: str) -> frozenset[tuple[int, int]]:
    """The units of a `recompute` line (`recompute_text`'s inverse)."""
    tags = line.split()[1:]
    if tags == ["none"]:
        return frozenset()
    units = set()
    for tag in tags:
        region, block, subbatch = parse_tag(tag)
        if region != "block" or subbatch is None:
            raise ValueError(f"`recompute` names (block, sub-batch) units (`blk1.sb0`), got {tag!r}")
        units.add((block, subbatch))
    if not units:
        raise ValueError("a `recompute` line names its units, or `none`")
    return frozenset(units)


@dataclasses.dataclass(frozen=True)
class PhaseOrder:
    """Positions of the compute steps of one phase, and of their regions.

    A region is the prefix, the suffix or one block: `(region, block)`.

    Attributes:
        position: (region, block, sub-batch) -> position among the phase's compute steps.
    """

    position: dict[tuple[str, int | None, int | None], int]
    regions: dict[tuple[str, int | None], list[int]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regions: dict[tuple[str, int | None], list[int]] = {}
        for (region, block, _), position in sorted(self.position.items(), key=lambda item: item[1]):
            regions.setdefault((region, block), []).append(position)
        object.__setattr__(self, "regions", regions)

    def _of_region(self, region: str, block: int | None) -> list[int]:
        return self.regions.get((region, block if region == "block" else None), [])

    def step(self, region: str, block: int | None, subbatch: int) -> int | None:
        """The position of a (region, block, sub-batch) step, None if the schedule has none."""
        return self.position.get((region, block if region == "block" else None, subbatch))

    def first(self, region: str, block: int | None) -> int | None:
        """The position of the region's first step."""
        found = self._of_region(region, block)
        return found[0] if found else None

    def last(self, region: str, block: int | None) -> int | None:
        """The position of the region's last step."""
        found = self._of_region(region, block)
        return found[-1] if found else None

    def contiguous(self, region: str, block: int | None) -> bool:
        """Whether the region's sub-batches run one after the other (layer-major),
        rather than apart (each sub-batch through every region: sample-major). Work a
        region shares among its sub-batches then runs before the first of them."""
        found = self._of_region(region, block)
        return bool(found) and found[-1] - found[0] == len(found) - 1


@dataclasses.dataclass(frozen=True)
class SavedActivation:
    """A tensor the forward saves for the backward, and its lifetime in steps.

    Steps are (region, block, sub-batch) keys of the schedule's compute steps.

    Attributes:
        name: the forward node.
        owner: the step that makes it: whose stash would store it.
        nbytes: its size (a size hint for a symbolic one).
        last_forward_use: the step its last forward reader runs in.
        first_backward_use: the step its first backward reader runs in.
        stays: why it cannot leave the device (a graph input, a model output,
            smaller than `min_offload_bytes`, ...), or None.
        op: the op that made it, as torch writes it (`aten.mm.default`; the
            multi-output op for one of its outputs), or None for a graph input.
        module_path: the module whose forward made it, as the model names it
            (`model.layers.3.self_attn`, from the node's `nn_module_stack`; the
            compiled module itself is ``), or None when unknown: what a policy
            picks saved tensors by across models whose node names differ.
    """

    name: str
    owner: tuple[str, int | None, int]
    nbytes: int
    last_forward_use: tuple[str, int | None, int]
    first_backward_use: tuple[str, int | None, int]
    stays: str | None = None
    op: str | None = None
    module_path: str | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleRequest:
    """What a policy writes a schedule for.

    Attributes:
        blocks: the block indices, in forward order.
        num_subbatches: K.
        live_blocks: how many blocks' weights may be on the device at once.
        weights_streamed: block weights rest off the device and are fetched.
        activations_offloaded: saved activations may rest off the device.
        backward: the step has a backward (training), not only a forward.
        has_prefix, has_suffix: whether work runs before the first block / after the last.
        whole_suffix: the suffix runs once on the whole batch (one compute step per
            phase, `fwd suffix`, sub-batch None), not once per sub-batch.
        gradients_offloaded: the streamed weights' gradients leave the device in the
            backward (an offloaded optimizer takes them).
        saved: the saved activations and their lifetimes, once the forward and
            backward are partitioned (None before: the policy then writes which
            steps stash, not yet where their transfers wait).
        offload_at_least: bytes of saved activations that must leave the device
            for the step to fit `memory_budget`, or None without a budget
            (`slcompile.schedules.planner`).
        stash_everything: stash every activation that may leave, hidden or not
            (the lowering's last resort under a budget).
        stash_tiers: the tiers a unit's stash may name (`Step.tier`): those of
            `STASH_TIERS` that copy on this machine (on a CPU machine the host's
            memory is the device's: "nvme" alone); None: all of `STASH_TIERS`.
        timing: the time model's facts (`slcompile.schedules.planner.TransferTiming`)
            when a machine profile is given: the planner then decides which
            transfers hide, and places them, by time; None: by counting steps.
    """

    blocks: tuple[int, ...]
    num_subbatches: int
    live_blocks: int = 1
    weights_streamed: bool = False
    activations_offloaded: bool = False
    backward: bool = True
    has_prefix: bool = True
    has_suffix: bool = True
    gradients_offloaded: bool = False
    whole_suffix: bool = False
    saved: tuple[SavedActivation, ...] | None = None
    offload_at_least: int | None = None
    stash_everything: bool = False
    stash_tiers: tuple[str, ...] | None = None
    timing: Any = None


def next_region(key: tuple[str, int | None, int], request: ScheduleRequest) -> tuple[str, int | None, int] | None:
    """The (region, block, sub-batch) that reads a forward unit's output: the same
    sub-batch's next region (the next block, or the suffix after the last block), or
    None when nothing follows (the suffix; the last block of a graph without one)."""
    region, block, subbatch = key
    if region == "suffix":
        return None
    blocks = list(request.blocks)
    following = blocks if region == "prefix" else blocks[blocks.index(block) + 1:]
    if following:
        return "block", following[0], subbatch
    if not request.has_suffix:
        return None
    return "suffix", None, None if request.whole_suffix else subbatch


def add_fetches(compute: list[Step], request: ScheduleRequest, *, per_subbatch: bool,
                per_run: bool = False) -> list[Step]:
    """Compute steps with the weight fetches a streamed plan needs around them.

    Each visit of a block (each block once, each (block, sub-batch) when
    `per_subbatch`, or, `per_run`, each run of the forward's consecutive compute
    steps of the block, named by its first sub-batch, the backward fetching for the
    same runs) waits for its weights just before its first compute step and,
    `live_blocks - 1` visits earlier, issues their load. Visits form a cycle (forward,
    backward, the next step's forward), so the last visits of a graph issue the first
    ones of the next graph; the first `live_blocks - 1` visits of a graph are issued
    by the graph before it.

    Args:
        compute: the compute steps, forward then backward.
        request: the request (live blocks, whether weights are streamed).
        per_subbatch: one visit per (block, sub-batch) instead of one per block.
        per_run: one visit per run of a block's sub-batches.

    Returns:
        the steps with `fetch.issue` and `fetch.wait` steps inserted.
    """
    if not request.weights_streamed:
        return list(compute)
    run: dict[tuple[int, int], int] = {}  # (block, sub-batch) -> the first sub-batch of its forward run
    previous = None
    for step in compute if per_run else ():
        if step.phase == "fwd" and step.kind == "compute":
            if step.region == "block":
                same = previous is not None and previous.region == "block" and previous.block == step.block
                run[step.block, step.subbatch] = run[previous.block, previous.subbatch] if same else step.subbatch
            previous = step
    visits: list[tuple[int, Step]] = []  # (position of the first compute step, wait)
    seen = set()
    for position, step in enumerate(compute):
        if step.region != "block":
            continue
        group = step.subbatch if per_subbatch else run.get((step.block, step.subbatch)) if per_run else None
        visit = (step.phase, step.block, group)
        if visit not in seen:
            seen.add(visit)
            visits.append((position, Step(step.phase, "block", step.block, visit[2], "fetch.wait")))
    before: dict[int, list[Step]] = {}
    for index, (position, wait) in enumerate(visits):
        issued = issued_visit(index, request.live_blocks, len(visits))
        if issued is not None:
            target = visits[issued][1]
            before.setdefault(position, []).append(
                Step(wait.phase, "block", target.block, target.subbatch, "fetch.issue", serves=target.phase)
            )
        before.setdefault(position, []).append(wait)
    steps: list[Step] = []
    for position, step in enumerate(compute):
        steps += before.get(position, [])
        steps.append(step)
    return steps


def add_gradient_stores(steps: list[Step], *, per_subbatch: bool) -> list[Step]:
    """Steps with the weight-gradient stores of a backward whose gradients leave.

    Each store unit (a block, or a (block, sub-batch) when `per_subbatch`: each
    sub-batch's share leaves on its own and the optimizer's tier sums them) issues
    its store right after its last backward compute step, and waits for it just
    before the next unit's store is issued (the last unit: at the end of the
    backward), so the store overlaps the next unit's backward and at most two
    units' gradients are on the device. The backward's loads for the next forward
    (`fetch.issue` serving "fwd") go: the weights change in the optimizer step, and
    the optimizer issues those loads after it.

    Args:
        steps: the steps, forward then backward, fetches placed.
        per_subbatch: one store per (block, sub-batch) instead of one per block.

    Returns:
        the steps with `store_grad.issue` and `store_grad.wait` steps inserted.
    """
    steps = [s for s in steps if not (s.phase == "bwd" and s.kind == "fetch.issue" and s.serves == "fwd")]
    last: dict[tuple[int, int | None], int] = {}  # unit -> position of its last compute step
    for position, step in enumerate(steps):
        if step.phase == "bwd" and step.kind == "compute" and step.region == "block":
            last[step.block, step.subbatch if per_subbatch else None] = position
    units = sorted(last, key=last.__getitem__)
    after: dict[int, list[Step]] = {}
    for number, (block, subbatch) in enumerate(units):
        issue = Step("bwd", "block", block, subbatch, "store_grad.issue")
        if number > 0:
            previous = units[number - 1]
            after.setdefault(last[block, subbatch], []).append(
                Step("bwd", "block", previous[0], previous[1], "store_grad.wait")
            )
        after.setdefault(last[block, subbatch], []).append(issue)
    out: list[Step] = []
    for position, step in enumerate(steps):
        out.append(step)
        out += after.get(position, [])
    if units:
        block, subbatch = units[-1]
        end = max((i for i, s in enumerate(out) if s.phase == "bwd"), default=len(out) - 1) + 1
        out.insert(end, Step("bwd", "block", block, subbatch, "store_grad.wait"))
    return out
