"""Checks a policy's schedule before anything compiles it (a generation pass's too:
`validate_pass`, below).

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
  may run in another unit than the one that owns it); only a `stash.issue` names a
  tier (`Step.tier`), one of `STASH_TIERS` that copies on this machine
  (`request.stash_tiers`);
- kept saved tensors (`Schedule.kept_saved`): each the name of a saved tensor of the
  graph (`request.saved`; not checked before the saved tensors are known);
- boundary activations (`spill.*`, `fill.*`, only when `activations_offloaded`):
  the prefix or a block, one sub-batch, in the forward, whose output the sub-batch's
  next region reads (`next_region`); once per unit: `spill.issue` right after the
  unit's compute (no compute step between), `spill.wait` after it, `fill.issue`
  after the `spill.wait`, `fill.wait` after that, and the reader's compute after
  the `fill.wait`;
- gradients (`store_grad.*`, only when `gradients_offloaded`, weights streamed): a
  block in the backward, issued after that block's (or that (block, sub-batch)'s)
  last backward compute, waited for after the issue;
- recomputation (`Schedule.recompute`, when the schedule chooses): a set of (block,
  sub-batch) pairs, each a block of `request.blocks` and a sub-batch in 0..K-1.
"""

from __future__ import annotations

from types import MappingProxyType

from slcompile.errors import PolicyError
from slcompile.schedules.base import (
    STASH_TIERS, TRANSFER_KINDS, Schedule, ScheduleRequest, Step, next_region, recompute_text,
)
from slcompile.schedules.generation import PassRequest

__all__ = ["validate_schedule", "validate_pass", "check_agreement", "stash_tier_problem", "UNNAMED_POLICY"]

UNNAMED_POLICY = "<unnamed>"
"""The policy a `PolicyError` names when what raised it does not know the policy (a
helper such as `add_stashes`); `Policy` names itself in it instead."""


def validate_schedule(schedule: Schedule, request: ScheduleRequest | PassRequest,
                      policy: str = UNNAMED_POLICY) -> Schedule:
    """Checks that `schedule` is one the passes can compile for `request` (a training
    or evaluation step's), or one a generation pass runs (`validate_pass`, for a
    `PassRequest`).

    Args:
        schedule: what the policy returned.
        request: what it was asked for.
        policy: the policy's name, for the message.

    Returns:
        the schedule, unchanged.

    Raises:
        PolicyError: naming the policy and the first offending step.
    """
    if isinstance(request, PassRequest):
        return validate_pass(schedule, request, policy)
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
    _check_kept_saved(schedule, request, policy)
    _check_recompute(schedule, request, policy)
    return schedule


def _check_kept_saved(schedule: Schedule, request: ScheduleRequest, policy: str) -> None:
    """Each name a schedule keeps on the device is a saved tensor of the request's graph."""
    if not schedule.kept_saved or request.saved is None:
        return
    names = {activation.name for activation in request.saved}
    for name in sorted(schedule.kept_saved):
        if not isinstance(name, str) or name not in names:
            raise PolicyError(policy, f"keeps {name!r} on the device, which is not a saved tensor of this graph "
                                      "(`request.saved` names them: `SavedActivation.name`)", f"keep {name}")


def _check_recompute(schedule: Schedule, request: ScheduleRequest, policy: str) -> None:
    """The units a schedule recomputes exist: (block, sub-batch) pairs of the request."""
    units = schedule.recompute
    if units is None:
        return
    if not isinstance(units, frozenset):
        raise PolicyError(policy, f"Schedule.recompute must be a set of (block, sub-batch) pairs or None, got "
                                  f"{type(units).__name__} {units!r}")
    k = request.num_subbatches
    for unit in sorted(units, key=repr):
        if not (isinstance(unit, tuple) and len(unit) == 2 and all(type(i) is int for i in unit)):
            raise PolicyError(policy, f"recomputes {unit!r}, which is not a (block, sub-batch) pair of integers")
        block, subbatch = unit
        if block not in request.blocks:
            raise PolicyError(policy, f"recomputes block {block}, which does not exist (the blocks are "
                                      f"{', '.join(map(str, request.blocks))})", recompute_text({unit}))
        if not 0 <= subbatch < k:
            raise PolicyError(policy, f"recomputes sub-batch {subbatch}, which does not exist (K={k}: "
                                      f"sub-batches 0..{k - 1})", recompute_text({unit}))


def stash_tier_problem(tier) -> str | None:
    """What is wrong with `tier` as the tier a unit's stash goes to (`Step.tier`), or
    None when it is one of `STASH_TIERS`. Whether that tier copies on this machine
    (`request.stash_tiers`) is another question: `add_stashes` keeps such a unit on
    the device, and `validate_schedule` refuses a step that names it."""
    if tier in STASH_TIERS:
        return None
    hint = ""
    if isinstance(tier, str) and tier.strip().lower() in STASH_TIERS:
        hint = f"; did you mean {tier.strip().lower()!r}?"
    return f"tier {tier!r} is not a slower tier (a stash goes to one of {', '.join(STASH_TIERS)}){hint}"


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
    if step.kind == "compute" and step.region == "suffix" and request.whole_suffix:
        if step.subbatch is not None:
            return (f"this graph runs the suffix once on the whole batch (suffix='whole'): write one "
                    f"`{step.phase} suffix` step, not one per sub-batch")
    elif step.kind == "compute" and step.subbatch is None:
        if step.region == "suffix":
            return ("this graph runs the suffix per sub-batch: one suffix step on the whole batch needs a "
                    "request with whole_suffix (a Policy(..., suffix='whole'), or the suffix='whole' option)")
        return "a compute step runs one sub-batch (subbatch=None)"
    if step.serves is not None and (not step.kind.endswith(".issue") or step.serves not in phases):
        return f"serves={step.serves!r}: only an issue serves a phase, one of {', '.join(map(repr, phases))}"
    if step.tier is not None:
        if step.kind != "stash.issue":
            return f"tier {step.tier!r}: only a `stash.issue` names the tier its unit's activations go to"
        problem = stash_tier_problem(step.tier)
        if problem:
            return problem
        allowed = STASH_TIERS if request.stash_tiers is None else request.stash_tiers
        if step.tier not in allowed:
            return (f"tier {step.tier!r} is the device's own memory on this machine: a stash moves nothing "
                    f"there (it may go to {', '.join(allowed) or 'no tier'})")
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
            whole = region == "suffix" and request.whole_suffix
            for subbatch in [None] if whole else range(request.num_subbatches):
                step = Step(phase, region, block, subbatch)
                if step not in seen:
                    raise PolicyError(policy, "a compute step is missing (each unit runs once per sub-batch "
                                              "in each phase)", step.text())


def _check_transfers(schedule: Schedule, request: ScheduleRequest, policy: str) -> None:
    steps = schedule.steps
    groups = schedule.fetch_groups()
    per_subbatch = {s.block: s.subbatch is not None for s in steps if s.kind == "fetch.wait"}
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
                wait = Step(step.phase, "block", step.block, groups.get((step.block, step.subbatch)), "fetch.wait")
                if (wait.phase, wait.kind, wait.key) not in done:
                    raise PolicyError(policy, f"computes before its weights arrive: no `{wait.text()}` before "
                                              "it (a streamed block's compute needs its fetch)", step.text())
            computed.add((step.phase, key))
        elif step.kind == "fetch.wait" and (step.subbatch is not None) != per_subbatch[step.block]:
            raise PolicyError(policy, "mixes fetches per sub-batch (or run) with one fetch per block in a block",
                              step.text())
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


_SPILL_ORDER = MappingProxyType({"spill.wait": "spill.issue", "fill.issue": "spill.wait", "fill.wait": "fill.issue"})


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


def check_agreement(planned: Schedule, derived: Schedule, policy: str = UNNAMED_POLICY) -> None:
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


_PASS_KINDS = ("compute", "fetch.issue", "fetch.wait", "load_kv.issue", "store_kv.issue",
               "spill.issue", "spill.wait", "fill.issue", "fill.wait")


def validate_pass(schedule: Schedule, request: PassRequest, policy: str = UNNAMED_POLICY) -> Schedule:
    """Checks that `schedule` is a generation pass `lower_pass` runs for `request`
    (`slcompile.schedules.generation`).

    What a valid pass is:

    - every step of the request's phase, of kind "compute" or one of a pass's
      transfers (`fetch.*`, `load_kv.issue`, `store_kv.issue`, `spill.*`, `fill.*`),
      region "prefix", "block" (a layer, 0..layers-1) or "suffix";
    - compute: each (layer, sub-batch) of `request.subbatches` once; the prefix once
      for every sub-batch and the suffix once, or, where the prefill spills its
      hidden states, no prefix and the suffix once per sub-batch after its last layer;
    - weights: a layer whose weights are fetched (`request.fetched`) has one
      `fetch.wait` before its first compute, after its `fetch.issue` when it has one;
      other layers have no fetch steps;
    - KV cache: where a decode pass's cache moves, each (layer, sub-batch) has one
      `load_kv.issue` before its compute, and none elsewhere; `store_kv.issue` of a
      layer only where the pass stores its cache, after that layer computed (in a
      decode pass, that (layer, sub-batch)); in a prefill it names the decode
      sub-batch whose rows it completes;
    - hidden states (only where the prefill spills them): a (layer, sub-batch) but the
      last layer's; `spill.issue` after the unit's compute and before the sub-batch's
      next layer, then `spill.wait` and `fill.issue` each after it, `fill.wait` after
      the `fill.issue`, and the next layer's compute after the `fill.wait`.

    Raises:
        PolicyError: naming the policy and the first offending step.
    """
    if not isinstance(schedule, Schedule):
        raise PolicyError(policy, f"build returned a {type(schedule).__name__}, not a "
                                  "slcompile.schedules.Schedule (wrap the steps: Schedule(tuple(steps)))")
    steps = schedule.steps
    layers, parts = request.layers, set(request.subbatches)
    owners = range(request.rows[0] * len(request.subbatches) // request.rows[1]) \
        if request.phase == "prefill" else request.subbatches
    moves_kv = request.phase == "decode" and request.kv_moves
    done: set[tuple] = set()  # (kind, region, block, sub-batch) of every step so far
    for step in steps:
        where = (step.region, step.block, step.subbatch)
        problem = _malformed_pass_step(step, request, layers, parts, owners)
        if problem is None and step.kind == "compute":
            problem = _pass_compute_problem(step, request, done, moves_kv)
        elif problem is None:
            problem = _pass_transfer_problem(step, request, done, moves_kv)
        if problem is None and (step.kind, *where) in done:
            problem = "the same step twice in one pass"
        if problem:
            raise PolicyError(policy, problem, step.text())
        done.add((step.kind, *where))
    missing = [Step(request.phase, "block", layer, sb) for layer in range(layers) for sb in request.subbatches]
    if request.spill_hidden:
        missing += [Step(request.phase, "suffix", None, sb) for sb in request.subbatches]
        missing += [Step(request.phase, "block", layer, sb, kind) for layer in range(layers - 1)
                    for sb in request.subbatches for kind in _SPILL_STEPS]
    else:
        missing = [Step(request.phase, "prefix", None, None), *missing, Step(request.phase, "suffix", None, None)]
    for step in missing:
        if (step.kind, step.region, step.block, step.subbatch) not in done:
            raise PolicyError(policy, "a step of the pass is missing", step.text())
    return schedule


_SPILL_STEPS = ("spill.issue", "spill.wait", "fill.issue", "fill.wait")


def _malformed_pass_step(step: Step, request: PassRequest, layers: int, parts: set, owners) -> str | None:
    if step.phase != request.phase:
        return f"phase {step.phase!r}: a {request.phase} pass has steps of phase {request.phase!r} only"
    if step.kind not in _PASS_KINDS:
        return f"kind {step.kind!r} is not one of a generation pass's: {', '.join(_PASS_KINDS)}"
    if step.region not in ("prefix", "block", "suffix"):
        return f"region {step.region!r} is not 'prefix', 'block' or 'suffix'"
    if step.region == "block" and not (isinstance(step.block, int) and 0 <= step.block < layers):
        return f"layer {step.block!r} does not exist (layers 0..{layers - 1})"
    if step.region != "block" and (step.block is not None or step.kind != "compute"):
        return f"the {step.region} is computed, with no layer index"
    if step.kind == "store_kv.issue":
        if step.subbatch not in owners:
            return f"stores the cache of decode sub-batch {step.subbatch!r}, which does not exist"
    elif step.kind == "fetch.issue" or step.kind == "fetch.wait":
        if step.subbatch is not None:
            return "fetches a layer's weights once for every sub-batch of the pass (subbatch=None)"
    elif step.subbatch is not None and step.subbatch not in parts or step.subbatch is None and (
            step.region == "block" or step.region == "suffix" and request.spill_hidden):
        return f"sub-batch {step.subbatch!r} is not one the pass computes ({', '.join(map(str, sorted(parts)))})"
    return None


def _pass_compute_problem(step: Step, request: PassRequest, done: set, moves_kv: bool) -> str | None:
    if step.region == "prefix":
        return "a prefill that spills its hidden states captures each layer's arguments at its step (no prefix)" \
            if request.spill_hidden else None
    if step.region == "suffix":
        if request.spill_hidden:
            if step.subbatch is None:
                return "a prefill that spills its hidden states computes the suffix per sub-batch"
            last = ("compute", "block", request.layers - 1, step.subbatch)
            return None if last in done else "computes the suffix of a sub-batch before its last layer"
        if step.subbatch is not None:
            return "the suffix is computed once for every sub-batch of the pass (subbatch=None)"
        pending = [sb for sb in request.subbatches if ("compute", "block", request.layers - 1, sb) not in done]
        return f"computes the suffix before sub-batch {pending[0]} ran the last layer" if pending else None
    layer, sb = step.block, step.subbatch
    if not request.spill_hidden and ("compute", "prefix", None, None) not in done:
        return "computes a layer before the prefix captured its arguments"
    if layer and ("compute", "block", layer - 1, sb) not in done:
        return f"computes layer {layer} of a sub-batch before layer {layer - 1}"
    if request.fetched[layer] and ("fetch.wait", "block", layer, None) not in done:
        return (f"computes before its weights arrive: no "
                f"`{Step(request.phase, 'block', layer, None, 'fetch.wait').text()}` before it")
    if moves_kv and ("load_kv.issue", "block", layer, sb) not in done:
        return "computes before its cache's load was issued (a `load_kv.issue` of the same step before it)"
    if request.spill_hidden and layer and ("fill.wait", "block", layer - 1, sb) not in done:
        return f"computes before its input arrives: no `fill.wait` of layer {layer - 1}, the same sub-batch"
    return None


def _pass_transfer_problem(step: Step, request: PassRequest, done: set, moves_kv: bool) -> str | None:
    kind, layer, sb = step.kind, step.block, step.subbatch
    if kind.startswith("fetch."):
        if not request.fetched[layer]:
            return "fetches the weights of a layer whose weights are not copied onto the device"
        if kind == "fetch.wait" and ("compute", "block", layer, sb) in done:
            return "waits for a layer's weights after the layer computed"
        return None
    if kind == "load_kv.issue":
        if not moves_kv:
            return "loads a cache that does not move (a decode pass whose cache rests on a tier that copies)"
        return "loads the cache of a step that already computed" if ("compute", "block", layer, sb) in done \
            else None
    if kind == "store_kv.issue":
        if not request.stores:
            return "stores the cache of a pass whose cache no later pass reads (stores=False)"
        computed = [part for part in request.subbatches if ("compute", "block", layer, part) in done]
        if request.phase == "decode" and sb not in computed or not computed:
            return f"stores the cache of layer {layer} before it computed"
        return None
    if not request.spill_hidden:
        return "spills a hidden state, but this pass keeps them on the device (spill_hidden=False)"
    if layer == request.layers - 1:
        return "spills the last layer's output, which the suffix reads next"
    if kind == "spill.issue":
        if ("compute", "block", layer, sb) not in done:
            return "spills an output before its layer computed it"
        if ("compute", "block", layer + 1, sb) in done:
            return "spills an output its next layer already read"
        return None
    needed = {"spill.wait": "spill.issue", "fill.issue": "spill.issue", "fill.wait": "fill.issue"}[kind]
    return None if (needed, "block", layer, sb) in done else f"comes before its `{needed}` of the same step"
