"""Checks a policy's schedule before anything compiles it.

The passes emit the graphs in a schedule's compute order and move what its transfer
steps name, so a schedule that leaves a step out, names a block or sub-batch that does
not exist or uses data before it arrives would compile into something else than what
the policy wrote (or into nothing that runs). `validate_schedule(schedule, request)`
raises `slcompile.PolicyError` naming the first offending step instead; `Policy`
calls it on every schedule it returns, and `check_agreement` compares the schedule
with the one read back from the compiled graphs.

What a valid schedule is, for a `ScheduleRequest`:

- a `Schedule` of `Step`s, each of phase "fwd" (and "bwd" when the request has a
  backward), region "prefix", "block" or "suffix" (a block of `request.blocks`, no
  block for the prefix and the suffix), kind "compute" or one of `TRANSFER_KINDS`,
  sub-batch None or in 0..K-1;
- compute: every unit (the prefix and the suffix when the request has them, each
  block; each for every sub-batch) exactly once per phase, each for one sub-batch;
- weights (`fetch.*`, only when `weights_streamed`): a block's compute comes after a
  `fetch.wait` of its weights in the same phase (one per block, or per (block,
  sub-batch) for every block when any is per sub-batch); an issue is waited for in
  the phase it serves (later, or, for the next step's visit, earlier); a wait needs
  no issue (the graph before issued it, or the wait loads the weights itself);
- activations (`stash.*`, `unstash.*`, only when `activations_offloaded` and the
  request has a backward): the prefix or a block, one sub-batch; `stash.issue` in the
  forward after that unit's forward compute, `stash.wait` after its issue,
  `unstash.issue` in the backward of a stashed unit, `unstash.wait` after its issue
  (where it waits is the policy's: the first backward reader of a stashed tensor
  may run in another unit than the one that owns it);
- boundary activations (`spill.*`, `fill.*`, only when `activations_offloaded`):
  the prefix or a block, one sub-batch, in the forward, whose output the sub-batch's
  next region reads (`next_region`); once per unit: `spill.issue` right after the
  unit's compute (no compute step between), `spill.wait` after it, `fill.issue`
  after the `spill.wait`, `fill.wait` after that, and the reader's compute after
  the `fill.wait`;
- gradients (`store_grad.*`, only when `gradients_offloaded`, weights streamed): a
  block in the backward, issued after that block's (or that (block, sub-batch)'s)
  last backward compute, waited for after the issue.
"""

from __future__ import annotations

from slcompile.errors import PolicyError
from slcompile.schedules.base import TRANSFER_KINDS, Schedule, ScheduleRequest, Step, next_region

__all__ = ["validate_schedule", "check_agreement"]


def validate_schedule(schedule: Schedule, request: ScheduleRequest, policy: str = "<unnamed>") -> Schedule:
    """Checks that `schedule` is one the passes can compile for `request`.

    Args:
        schedule: what the policy returned.
        request: what it was asked for.
        policy: the policy's name, for the message.

    Returns:
        the schedule, unchanged.

    Raises:
        PolicyError: naming the policy and the first offending step.
    """
    if not isinstance(schedule, Schedule):
        raise PolicyError(policy, f"build returned a {type(schedule).__name__}, not a "
                                  "slcompile.schedules.Schedule (wrap the steps: Schedule(tuple(steps)))")
    if not isinstance(schedule.steps, tuple) or not all(isinstance(s, Step) for s in schedule.steps):
        raise PolicyError(policy, "Schedule.steps must be a tuple of slcompile.schedules.Step")
    phases = ("fwd", "bwd") if request.backward else ("fwd",)
    for step in schedule.steps:
        problem = _malformed(step, request, phases)
        if problem:
            raise PolicyError(policy, problem, step.text())
    _check_compute(schedule, request, phases, policy)
    _check_transfers(schedule, request, policy)
    return schedule


def _malformed(step: Step, request: ScheduleRequest, phases: tuple[str, ...]) -> str | None:
    """What is wrong with one step on its own, or None."""
    if step.phase not in phases:
        return f"phase {step.phase!r} is not one of {', '.join(map(repr, phases))}"
    if step.kind != "compute" and step.kind not in TRANSFER_KINDS:
        return f"kind {step.kind!r} is neither 'compute' nor one of {', '.join(TRANSFER_KINDS)}"
    if step.region not in ("prefix", "block", "suffix"):
        return f"region {step.region!r} is not 'prefix', 'block' or 'suffix'"
    if step.region == "block" and step.block not in request.blocks:
        return f"block {step.block!r} does not exist (the blocks are {', '.join(map(str, request.blocks))})"
    if step.region != "block" and step.block is not None:
        return f"the {step.region} has no block index (got block={step.block!r})"
    if step.region == "prefix" and not request.has_prefix or step.region == "suffix" and not request.has_suffix:
        return f"this graph has no {step.region}"
    k = request.num_subbatches
    if step.subbatch is not None and not (isinstance(step.subbatch, int) and 0 <= step.subbatch < k):
        return f"sub-batch {step.subbatch!r} does not exist (K={k}: sub-batches 0..{k - 1})"
    if step.kind == "compute" and step.subbatch is None:
        return "a compute step runs one sub-batch (subbatch=None)"
    if step.serves is not None and (not step.kind.endswith(".issue") or step.serves not in phases):
        return f"serves={step.serves!r}: only an issue serves a phase, one of {', '.join(map(repr, phases))}"
    what = step.kind.split(".")[0]
    if what == "fetch":
        if not request.weights_streamed:
            return "fetches weights, but the block weights stay on the device (weights_streamed=False)"
        if step.region != "block":
            return "fetches the weights of a block only"
    elif what in ("stash", "unstash"):
        if not (request.activations_offloaded and request.backward):
            return "moves saved activations, but they stay on the device (activations_offloaded=False)"
        if step.region == "suffix" or step.subbatch is None:
            return "stashes the saved activations of the prefix or a block, for one sub-batch"
        if (what == "stash") != (step.phase == "fwd"):
            return f"a {what} runs in the {'forward' if what == 'stash' else 'backward'}"
    elif what in ("spill", "fill"):
        if not request.activations_offloaded:
            return "moves a boundary activation, but activations stay on the device (activations_offloaded=False)"
        if step.phase != "fwd" or step.region == "suffix" or step.subbatch is None:
            return f"{what}s the output of the prefix or a block, for one sub-batch, in the forward"
        if next_region(step.key, request) is None:
            return "nothing reads this unit's output after it: there is nothing to wait for"
    elif what == "store_grad":
        if not (request.gradients_offloaded and request.weights_streamed):
            return "stores weight gradients, but they stay on the device (gradients_offloaded=False)"
        if step.region != "block" or step.phase != "bwd":
            return "stores the weight gradients of a block, in the backward"
    return None


def _check_compute(schedule: Schedule, request: ScheduleRequest, phases: tuple[str, ...], policy: str) -> None:
    units = []
    if request.has_prefix:
        units.append(("prefix", None))
    units += [("block", block) for block in request.blocks]
    if request.has_suffix:
        units.append(("suffix", None))
    seen: set[Step] = set()
    for step in schedule.steps:
        if step.kind == "compute":
            if step in seen:
                raise PolicyError(policy, "computes the same unit twice in one phase", step.text())
            seen.add(step)
    for phase in phases:
        for region, block in units:
            for subbatch in range(request.num_subbatches):
                step = Step(phase, region, block, subbatch)
                if step not in seen:
                    raise PolicyError(policy, "a compute step is missing (each unit runs once per sub-batch "
                                              "in each phase)", step.text())


def _check_transfers(schedule: Schedule, request: ScheduleRequest, policy: str) -> None:
    steps = schedule.steps
    per_subbatch = schedule.fetches_per_subbatch()
    done: set[tuple] = set()  # (phase, kind, key) of every step so far
    computed: set[tuple] = set()  # (phase, key) of the compute steps so far
    filled_for = {next_region(s.key, request): s.key for s in steps if s.kind == "spill.issue"}
    last_compute = None
    for index, step in enumerate(steps):
        key = step.key
        if step.kind.startswith(("spill.", "fill.")):
            _check_spill(step, done, last_compute, policy)
        if step.kind == "compute":
            spilled = filled_for.get(key) if step.phase == "fwd" else None
            if spilled is not None and ("fwd", "spill.issue", spilled) in done \
                    and ("fwd", "fill.wait", spilled) not in done:
                raise PolicyError(policy, f"computes before its input arrives: no `fwd fill.wait "
                                          f"{Step('fwd', *spilled).tag}` before it", step.text())
            last_compute = step
            if step.region == "block" and request.weights_streamed:
                wait = Step(step.phase, "block", step.block, step.subbatch if per_subbatch else None, "fetch.wait")
                if (wait.phase, wait.kind, wait.key) not in done:
                    raise PolicyError(policy, f"computes before its weights arrive: no `{wait.text()}` before "
                                              "it (a streamed block's compute needs its fetch)", step.text())
            computed.add((step.phase, key))
        elif step.kind == "fetch.wait" and (step.subbatch is not None) != per_subbatch:
            raise PolicyError(policy, "mixes fetches per sub-batch with fetches per block", step.text())
        elif step.kind == "fetch.issue":
            # Visits form a cycle (forward, backward, the next step's forward): the
            # wait may be in another graph, or earlier in this one for the next step.
            serves = step.serves or step.phase
            if not any(s.kind == "fetch.wait" and s.phase == serves and s.key == key for s in steps):
                raise PolicyError(policy, f"issues a fetch no `{serves} fetch.wait {step.tag}` waits for",
                                  step.text())
        elif step.kind == "stash.issue" and ("fwd", key) not in computed:
            raise PolicyError(policy, f"stashes before `fwd {step.tag}` computes what it stores", step.text())
        elif step.kind == "stash.wait" and ("fwd", "stash.issue", key) not in done:
            raise PolicyError(policy, f"waits for a stash before its `fwd stash.issue {step.tag}`", step.text())
        elif step.kind == "unstash.issue" and ("fwd", "stash.issue", key) not in done:
            raise PolicyError(policy, f"unstashes what no `fwd stash.issue {step.tag}` stored", step.text())
        elif step.kind == "unstash.wait" and ("bwd", "unstash.issue", key) not in done:
            raise PolicyError(policy, f"waits for an unstash before its `bwd unstash.issue {step.tag}`",
                              step.text())
        elif step.kind == "store_grad.issue":
            if _gradients_pending(steps, index, step):
                raise PolicyError(policy, f"stores gradients before the backward of `{step.tag}` ends",
                                  step.text())
        elif step.kind == "store_grad.wait" and ("bwd", "store_grad.issue", key) not in done:
            raise PolicyError(policy, f"waits for a gradient store before its `bwd store_grad.issue {step.tag}`",
                              step.text())
        done.add((step.phase, step.kind, key))


_SPILL_ORDER = {"spill.wait": "spill.issue", "fill.issue": "spill.wait", "fill.wait": "fill.issue"}


def _check_spill(step: Step, done: set[tuple], last_compute: Step | None, policy: str) -> None:
    """One `spill.*` / `fill.*` step against the steps before it."""
    if (step.phase, step.kind, step.key) in done:
        raise PolicyError(policy, "spills or fills the same output twice", step.text())
    if step.kind == "spill.issue":
        if last_compute is None or last_compute.phase != "fwd" or last_compute.key != step.key:
            raise PolicyError(policy, f"a spill is issued right after `fwd {step.tag}` computes the output it "
                                      "stores (no compute step between)", step.text())
        return
    needed = _SPILL_ORDER[step.kind]
    if ("fwd", needed, step.key) not in done:
        raise PolicyError(policy, f"comes before its `fwd {needed} {step.tag}`", step.text())


def _gradients_pending(steps: tuple[Step, ...], index: int, store: Step) -> bool:
    """Whether a backward compute step of the store's block (of its sub-batch, when it
    names one) runs after the store's issue: its gradients are not complete yet."""
    return any(
        s.kind == "compute" and s.phase == "bwd" and s.region == "block" and s.block == store.block
        and (store.subbatch is None or s.subbatch == store.subbatch)
        for s in steps[index + 1:]
    )


def check_agreement(planned: Schedule, derived: Schedule, policy: str = "<unnamed>") -> None:
    """Checks that the compiled graphs (`derived`, `schedule_of`) make the transfers of
    the schedule the policy wrote (`planned`), in its order, phase by phase for the
    phases the graphs have.

    The transfer lines are compared (as text: an issue for its own phase reads back
    with `serves=None`), not the compute lines: `order_layer_major` emits the compute
    in the policy's order, but a unit's ops that depend only on work shared by the
    sub-batches may run apart from the rest of it, and the read-back then writes the
    unit in several runs. Inductor's decompositions do this to grad_accumulation's
    backward: the gradient of sub-batch 0's suffix, taken from the combined loss,
    runs at the start of the backward (`bwd suffix.sb1`, `bwd suffix.sb0`, `bwd
    suffix.sb1`, ...), and the prefix's backward alternates with block 0's. Where the
    compute runs is checked by `slcompile.analysis.order` (`layer_major_violations`,
    `sample_major_violations`). What the passes place themselves, whatever the policy
    wrote, is caught here: each weight load is issued `live_blocks - 1` block visits
    ahead of its wait (`place_prefetches`, as `add_fetches` writes it).

    Raises:
        PolicyError: naming the first transfer where they part.
    """
    phases = [p for p in ("fwd", "bwd") if any(s.phase == p for s in derived.steps)]
    for phase in phases:
        want, got = _transfer_lines(planned, phase), _transfer_lines(derived, phase)
        for position, (a, b) in enumerate(zip(want, got)):
            if a != b:
                raise PolicyError(
                    policy, f"the compiled graphs make `{b}` instead (transfer {position + 1} of the {phase} "
                            "phase; compare `report.planned_schedule.text()` with `report.schedule`)", a)
        if len(want) != len(got):
            extra = (want if len(want) > len(got) else got)[min(len(want), len(got))]
            side = "the policy wrote" if len(want) > len(got) else "the compiled graphs make"
            raise PolicyError(policy, f"{side} more transfers in the {phase} phase, from this one on", extra)


def _transfer_lines(schedule: Schedule, phase: str) -> list[str]:
    """The text lines of a phase's transfer steps, runs of one line collapsed."""
    lines: list[str] = []
    for step in schedule.phase(phase).steps:
        if step.kind != "compute" and (not lines or lines[-1] != step.text()):
            lines.append(step.text())
    return lines
