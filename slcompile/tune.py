"""`slcompile.tune(model, *args, memory_budget=...)`: the options that fit a budget.

The model's graph is captured once (its forward runs once, eagerly, under Dynamo);
every candidate plan is then rewritten and partitioned on that graph and its peak
memory predicted from the lifetimes of its forward and backward (nothing is compiled
to code, no weight moves, no step runs). Candidates are tried in the order of what
runs fastest when it fits: the tiers in the order given (`weights=["device",
"nvme"]`: nothing fetched before fetching), then fewer sub-batches (bigger matrix
products, fewer per-sub-batch overheads), then more blocks' weights live (more
prefetch ahead), with `recompute="auto"` keeping saved activations before
recomputing blocks. The first plan that fits is the answer; with `profile=` (a
machine profile), every plan that fits is timed by the time model
(`slcompile.analysis.time`) and the fastest wins, its saved activations placed by
the same profile (the `machine_profile` option: stashed only where their transfers
hide, else kept or recomputed). Every candidate is in `TuneResult.tried`, with its
options, peak, recomputation and predicted time, or why it was refused (a policy
whose schedule the passes refuse for one plan is still tried with the others).

`schedule=[...]` (policy names or `Policy` objects, preferred first) makes the policy
one of the searched options: every policy is tried with every tier, K and window, in
that order (a policy first, then the next). Without a profile the first plan that
fits wins, so the first policy is preferred; with one, the plan of any policy that
the time model predicts fastest. The chosen policy is `TuneResult.options["schedule"]`;
a plan a policy cannot take (`no_offload` with weights off the device) is refused for
that policy alone.

The budget covers the whole step: with an optimizer (the offloaded optimizer
attached to the model, or `optimizer=`, as in `slcompile.explain`), a plan whose
forward and backward fit but whose `optimizer.step()` would not (the resident
parameters' state, their gradients and the step's temporaries) is refused. With
`shard_weights=True` a plan's peak holds each fetch's loaded shard and padded
all-gather buffer, `live_blocks - 1` blocks ahead (`slcompile.analysis.memory`): a
window that whole weights would fit but the all-gathers' would not is passed over
for the next candidate, and `BudgetError.smallest` counts them too.

`slcompile.tune_generation(model, input_shape, max_new_tokens, memory_budget=...)`
does the same for `slcompile.generate`, from `explain_generation`'s device peaks of
the prefill and of the decode passes (the layer step and the tail traced once on
fake tensors; nothing runs): weights on the device before host before nvme (fewer
weight bytes loaded per token), then the KV cache likewise, then for each phase the
fewest sub-batches that fit (the decode loads each layer's weights once per pass
whatever K, and fewer, larger sub-batches make bigger matrix products).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from slcompile.backends.dumps import drawing_dumps
from slcompile.config import (
    SpeedLoaderConfig, batch_divisors, check_names, check_option_value, one_option_value, option_values,
    parse_bytes,
)
from slcompile.errors import BudgetError, OptionError, PolicyError, RefusedError

__all__ = ["Candidate", "TuneResult", "tune", "GenerationTuneResult", "GenerationBudgetError", "tune_generation"]

SEARCHED = frozenset({"weights", "activations", "schedule"})
"""The backend options `tune` searches given a sequence of values (with its own
`num_subbatches` and `live_blocks`); every other option takes one value."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan `tune` evaluated.

    Attributes:
        options: the backend options it was evaluated with (the budget included):
            compiling with them builds this plan.
        peak_bytes: its predicted device peak when it fits; the least it would need
            when it does not; None when the graph cannot be split so.
        recompute: the recomputation it fits with ("none", "blocks", or "policy":
            the units its schedule names), or None when it does not fit.
        seconds: its predicted step time with `profile=`, else None.
        refused: why it was not compiled, when it was not (the graph cannot be
            split so, or the policy's schedule is refused: a `PolicyError`'s
            message), else None.
    """

    options: dict[str, Any]
    peak_bytes: int | None
    recompute: str | None = None
    seconds: float | None = None
    refused: str | None = None

    @property
    def fits(self) -> bool:
        return self.recompute is not None

    @property
    def num_subbatches(self) -> int:
        return self.options["num_subbatches"]

    @property
    def live_blocks(self) -> int:
        return self.options["live_blocks"]

    @property
    def policy(self) -> str:
        """The name of the schedule policy it was evaluated with."""
        return _policy_name(self.options.get("schedule", _default("schedule")))

    @property
    def weights(self) -> str:
        return self.options.get("weights", "device")

    @property
    def activations(self) -> str:
        return self.options.get("activations", "device")

    def describe(self) -> str:
        """One line: the plan, and its peak (and time) or why it does not fit."""
        from slcompile.units import format_bytes

        head = (f"K={self.num_subbatches} live_blocks={self.live_blocks} weights={self.weights} "
                f"activations={self.activations} schedule={self.policy}")
        if self.peak_bytes is None:
            return f"{head}: refused" + (f" ({self.refused})" if self.refused else "")
        if not self.fits:
            return f"{head}: needs {format_bytes(self.peak_bytes)}"
        tail = f", {self.seconds * 1e3:.3f} ms a step" if self.seconds is not None else ""
        return f"{head}: {format_bytes(self.peak_bytes)}, recompute={self.recompute}{tail}"


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What `tune` chose.

    Attributes:
        options: the backend options to compile with (`torch.compile(...,
            options=result.options)`), the budget included (and, with `profile=`,
            the profile as `machine_profile`, so that the planner decides as it did).
        memory: the chosen plan's MemoryPrediction.
        tried: every `Candidate` evaluated, in order.
        time: with `profile=`, the chosen plan's predicted timeline
            (`slcompile.analysis.time.TimePrediction`), else None.
        why: why this plan was chosen, in words.
    """

    options: dict[str, Any]
    memory: Any
    tried: tuple[Candidate, ...]
    time: Any = None
    why: str = ""

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        """The candidates that fit the budget, in the order evaluated."""
        return tuple(c for c in self.tried if c.fits)


def tune(
    model: torch.nn.Module,
    *args: Any,
    memory_budget: int | str,
    kwargs: Mapping[str, Any] | None = None,
    num_subbatches: int | Sequence[int] | None = None,
    live_blocks: int | Sequence[int] = (2, 1),
    optimizer: Any = None,
    optimizer_options: Mapping[str, Any] | None = None,
    profile: Any = None,
    **options: Any,
) -> TuneResult:
    """Chooses K, live_blocks, recomputation and tiers for `model(*args)` under a budget.

    Args:
        model: the model; `args`/`kwargs` a full batch, as in training.
        memory_budget: the device's limit for one step (bytes or "2GiB").
        num_subbatches: the K to consider, one or a sequence (default: every
            divisor of the batch).
        live_blocks: the window or windows to consider, preferred first (with
            weights on the device, the first alone: nothing is fetched).
        optimizer, optimizer_options: the optimizer whose step the budget covers,
            as in `slcompile.explain` (default: the offloaded optimizer attached to
            the model, if any).
        profile: a machine profile, as `explain`'s (`"current"`, a named profile or a
            `MachineProfile`): every candidate that fits is then evaluated and the
            one the time model predicts fastest is chosen (`TuneResult.why` says
            by how much), the activation planner deciding by the same profile
            (the `machine_profile` option); without, the first that fits, in the
            order above.
        **options: other backend options, fixed (`lowering="aot_eager"`, ...);
            `weights` and `activations` may each be a list of tiers to choose from,
            preferred first (`weights=["device", "nvme"]`): every K and window is
            tried with the first tiers before the next. `schedule` may be a list of
            policies (names or `Policy` objects), preferred first
            (`schedule=["speedloader", "grad_accumulation"]`): each is tried with
            every tier, K and window before the next, and the result's
            `options["schedule"]` is the one chosen. Every other option takes one
            value (or a sequence of one), as `explain` and `compare_policies` do
            (`slcompile.config.option_values`).

    Raises:
        BudgetError: no candidate fits; names the smallest budget any would need.
        RefusedError: the graph cannot be split into sub-batches at all.
        OptionError: a bad option (a tier or policy list among them), raised
            before the model is captured; with a list of policies, options that conflict with one policy (`no_offload` and
            weights off the device) refuse its candidates alone, and the error is
            raised when they conflict with every policy.
        PolicyError: the `schedule` policy's schedule is refused for every
            candidate; a candidate it is refused for is skipped, and its
            `Candidate.refused` says why.
    """
    from slcompile.compat import capture_graphs
    from slcompile.explain import check_optimizer
    from slcompile.runtime.gathering import loading_released_weights

    budget = parse_bytes(memory_budget, "memory_budget")
    check_optimizer(optimizer, optimizer_options, "tune")
    # Every option checked before the capture: a single value or a sequence of them.
    options = {key: value if key in SEARCHED else one_option_value(key, value, "tune")
               for key, value in check_names(options).items()}
    live_blocks = option_values("live_blocks", live_blocks, "tune")
    if num_subbatches is not None:
        num_subbatches = option_values("num_subbatches", num_subbatches, "tune")
    for key, values in (("live_blocks", live_blocks), ("num_subbatches", num_subbatches or ())):
        for value in values:
            check_option_value(key, value, "tune")
    tiers = [(w, a) for w in _choices(options, "weights") for a in _choices(options, "activations")]
    policies = _policies(options)
    _check_combinations(options, tiers, policies, num_subbatches, live_blocks)
    captured = []
    capture_graphs(model, args, dict(kwargs or {}), lambda gm, example_inputs: captured.append((gm, example_inputs)),
                   fullgraph=True, run_as=loading_released_weights)
    gm, example_inputs = captured[0]
    machine = None
    if profile is not None:
        from slcompile.measure import machine_profile

        machine = machine_profile(profile, offload_dir=options.get("offload_dir"), refuse_untrusted=True)
        options = {**options, "machine_profile": machine}
    return _tune_graph(gm, example_inputs, budget, num_subbatches, live_blocks, optimizer, optimizer_options,
                       options, machine, tiers, policies)


def _default(key: str) -> Any:
    """An option's value when not given (`slcompile.defaults`, else the config's)."""
    return getattr(SpeedLoaderConfig.from_options({}), key)


def _policy_name(schedule: Any) -> str:
    return schedule if isinstance(schedule, str) else getattr(schedule, "name", repr(schedule))


def _policies(options: Mapping[str, Any]) -> list | None:
    """The policies `options["schedule"]` lists, preferred first; None when it names
    one policy (or none), which the config checks as for compiling."""
    from slcompile.schedules.policies import unknown_policy

    value = options.get("schedule")
    if not isinstance(value, (list, tuple, range)):
        return None
    value = option_values("schedule", value, "tune") if value else value
    problems = [unknown_policy(v) for v in value if not callable(getattr(v, "build", None))]
    if not value or any(problems):
        raise OptionError(f"tune: schedule must be a policy or a list of policies (registered names or "
                          f"slcompile.schedules.Policy objects), got {value!r}"
                          + (f": {next(p for p in problems if p)}" if any(problems) else ""))
    chosen: dict[str, Any] = {}
    for policy in value:
        chosen.setdefault(_policy_name(policy), policy)
    return list(chosen.values())


def _choices(options: Mapping[str, Any], key: str) -> list[str]:
    """The tiers `options[key]` allows, preferred first."""
    from slcompile.config import TIERS

    value = options.get(key, SpeedLoaderConfig.__dataclass_fields__[key].default)
    values = list(value) if isinstance(value, (list, tuple, range)) else [value]
    if not values or any(not isinstance(v, str) or v not in TIERS for v in values):
        raise OptionError(f"tune: {key} must be a tier or a list of tiers of {', '.join(TIERS)}, got {value!r}")
    return list(option_values(key, values, "tune"))


def _check_combinations(options, tiers, policies, num_subbatches, live_blocks) -> None:
    """Raises, before anything is captured, the `OptionError` of the first plan when
    no policy and tiers searched make options a compile would take (the fixed
    options conflict with every one); those that conflict with some are refused
    for those alone, when they are tried."""
    first: OptionError | None = None
    for policy in policies or [None]:
        for weights, activations in tiers:
            chosen = {**options, "weights": weights, "activations": activations, "live_blocks": live_blocks[0]}
            if num_subbatches:
                chosen["num_subbatches"] = num_subbatches[0]
            if policy is not None:
                chosen["schedule"] = policy
            try:
                SpeedLoaderConfig.from_options(chosen)
                return
            except OptionError as err:
                first = first or err
    if first is not None:
        raise first


@drawing_dumps()
def _tune_graph(gm, example_inputs, budget, num_subbatches, live_blocks, optimizer, optimizer_options, options,
                machine=None, tiers=None, policies=None):
    from slcompile.backends.lowering import lower
    from slcompile.explain import plan_with_optimizer
    from slcompile.pipeline import run_pipeline
    from slcompile.report import CompileReport
    from slcompile.facts import process_facts
    from slcompile.schedules.policies import plan_suffix

    def attempt(planned: SpeedLoaderConfig):
        state = run_pipeline(gm, example_inputs, planned, facts=process_facts(planned, example_inputs))
        report = CompileReport(config=planned)
        lower(state.gm, example_inputs, "aot_eager", report, plan_with_optimizer(state, optimizer, optimizer_options))
        return state, report

    tiers = tiers or [(options.get("weights", "device"), options.get("activations", "device"))]
    if num_subbatches is None:
        weights, activations = tiers[0]
        # The batch's size alone is read: any policy that takes these tiers will do.
        probe_schedule = {"schedule": "speedloader"} if policies else {}
        probe_config = SpeedLoaderConfig.from_options(
            {**options, "num_subbatches": 1, "weights": weights, "activations": activations, **probe_schedule})
        probe = run_pipeline(gm, example_inputs, probe_config, facts=process_facts(probe_config, example_inputs))
        batch = probe.batch.batch_size
        num_subbatches = batch_divisors(batch)

    tried, smallest, fitting, policy_errors, option_errors = [], None, [], [], []
    plans = [(policy, weights, activations) for policy in (policies or [None]) for weights, activations in tiers]
    for policy, weights, activations in plans:
        windows = list(live_blocks) if weights != "device" else list(live_blocks)[:1]
        for k in sorted(num_subbatches):
            for window in windows:
                chosen = {**options, "weights": weights, "activations": activations, "num_subbatches": k,
                          "live_blocks": window, "memory_budget": budget}
                if policy is not None:
                    chosen["schedule"] = policy
                    try:
                        config = SpeedLoaderConfig.from_options(chosen)
                    except OptionError as err:
                        # Options one policy cannot take (no_offload, weights on nvme)
                        # leave the other policies to try.
                        tried.append(Candidate(chosen, None, refused=str(err)))
                        option_errors.append(err)
                        continue
                else:
                    config = SpeedLoaderConfig.from_options(chosen)
                try:
                    # As the backend plans it: the suffix whole, else (under "auto") per sub-batch.
                    planned, (state, report) = plan_suffix(config, attempt)
                    if planned.suffix == "subbatches" and config.suffix == "auto":
                        chosen["suffix"] = "subbatches"
                except (RefusedError, PolicyError) as err:
                    # A policy's schedule may be compilable for one plan and not for
                    # another (a fetch placed by hand, say): the others are still tried.
                    tried.append(Candidate(chosen, None, refused=str(err)))
                    policy_errors += [err] if isinstance(err, PolicyError) else []
                    continue
                except BudgetError as err:
                    tried.append(Candidate(chosen, err.smallest))
                    smallest = err.smallest if smallest is None else min(smallest, err.smallest)
                    continue
                peak, recompute = report.memory.peak_bytes["device"], report.memory.recompute
                if machine is None:
                    tried.append(Candidate(chosen, peak, recompute))
                    return TuneResult(chosen, report.memory, tuple(tried),
                                      why="the first candidate that fits: "
                                          + ("policies in the order given, then " if policies else "")
                                          + "tiers in the order given, then fewest sub-batches, then most live "
                                            "blocks")
                from slcompile.explain import predict_step_time, transfer_tiers

                timeline = predict_step_time(report, state, example_inputs, machine,
                                             transfer_tiers(config, optimizer_options))
                tried.append(Candidate(chosen, peak, recompute, timeline.step_seconds))
                fitting.append((timeline.step_seconds, len(fitting), tried[-1], report.memory, timeline))
    if fitting:
        seconds, _, best, memory, timeline = min(fitting, key=lambda item: item[:2])
        others = sorted(f[0] for f in fitting if f[2] is not best)
        why = (f"predicted fastest on {machine.name} of {len(fitting)} plans that fit"
               + (f" (policies {', '.join(_policy_name(p) for p in policies)})" if policies else "")
               + f": {seconds * 1e3:.3f} ms a step, bound by {timeline.bound}")
        if others:
            why += f"; the next {others[0] * 1e3:.3f} ms ({others[0] / seconds - 1:+.1%})"
        return TuneResult(best.options, memory, tuple(tried), time=timeline, why=why)
    if smallest is None and option_errors and len(option_errors) == len(tried):
        raise option_errors[0]  # the fixed options conflict with every policy listed
    if smallest is None and policy_errors and len(policy_errors) == len(tried):
        raise policy_errors[0]  # the policy's schedule is refused for every plan: its fault, not the graph's
    if smallest is None:
        raise RefusedError("no candidate number of sub-batches can split this model's batch", "tune")
    raise BudgetError(budget, smallest)


@dataclasses.dataclass(frozen=True)
class GenerationTuneResult:
    """What `tune_generation` chose.

    Attributes:
        options: `slcompile.generate`'s options (`num_subbatches`,
            `prefill_subbatches`, `weights`, `kv_cache`, `live_blocks`):
            `generate(model, input_ids, max_new_tokens=..., **result.options)`.
        memory: the chosen options' `GenerationExplanation`; its `peak_bytes` is
            at most the budget.
        tried: (weights, kv_cache, phase, K, device peak bytes) of every pass
            evaluated, in order.
    """

    options: dict[str, Any]
    memory: Any
    tried: tuple[tuple[str, str, str, int, int], ...]


class GenerationBudgetError(BudgetError):
    """No options of `slcompile.generate` fit the budget (a `BudgetError`; `smallest`
    is the smallest budget any would fit)."""

    def __init__(self, budget: int, smallest: int, tiers: str):
        from slcompile.units import format_bytes

        self.budget, self.smallest, self.tried = budget, smallest, ()
        Exception.__init__(
            self, f"generation needs at least {smallest} bytes ({format_bytes(smallest)}) on the device, over "
            f"memory_budget={budget} ({format_bytes(budget)}) with {tiers} and every number of sub-batches; set "
            f"memory_budget >= {smallest}, or shorten the prompts or max_new_tokens")


def tune_generation(
    model: torch.nn.Module,
    input_shape: Sequence[int],
    max_new_tokens: int,
    *,
    memory_budget: int | str,
    weights: str | None = None,
    kv_cache: str | None = None,
    live_blocks: int = 2,
    offload_dir: str | None = None,
    machine=None,
    padded: bool = False,
) -> GenerationTuneResult:
    """Chooses `slcompile.generate`'s sub-batches and tiers under a device budget.

    Args:
        model: as for `slcompile.generate`.
        input_shape: the prompts' `(batch, length)`.
        max_new_tokens: tokens to generate.
        memory_budget: the device's limit for the whole generation (bytes or "2GiB").
        weights, kv_cache: the tier, fixed; None: the first that fits of "device",
            "host" (where it is not the device's own memory) and "nvme".
        live_blocks, offload_dir: as for `generate`.
        machine, padded: as for `explain_generation` (pass
            `padded=True` for left-padded prompts).

    Returns:
        The options and their prediction.

    Raises:
        GenerationBudgetError: nothing fits; names the smallest budget that would.
        OptionError, RefusedError: as `generate` raises them.
    """
    from slcompile.config import TIERS
    from slcompile.facts import machine_facts
    from slcompile.inference.explain import explain_generation_config
    from slcompile.inference.options import generation_config, generation_plan

    budget = parse_bytes(memory_budget, "memory_budget")
    # The checks of `generate`, before anything is traced.
    generation_plan(model, input_shape, None,
                    generation_config(1, None, weights or "device", kv_cache or "device", live_blocks, offload_dir),
                    max_new_tokens=max_new_tokens, eos_token_id=[])
    batch = tuple(input_shape)[0]
    here = machine_facts(offload_dir)
    divisors = batch_divisors(batch)

    def tiers(fixed: str | None) -> list[str]:
        if fixed is not None:
            return [fixed]
        # A tier that is the device's own memory (the host of a CPU machine) saves nothing.
        return [t for t in TIERS if t == "device" or here.copies(t)]

    memo: dict = {}
    tried: list[tuple[str, str, str, int, int]] = []
    peaks: dict[tuple, int] = {}

    def peak(w: str, kv: str, phase: str, prefill_k: int, decode_k: int) -> int:
        # The decode passes depend on the decode K alone.
        key = (w, kv, phase, prefill_k if phase == "prefill" else None, decode_k)
        if key not in peaks:
            explained = explain_generation_config(
                model, input_shape, max_new_tokens,
                generation_config(decode_k, prefill_k, w, kv, live_blocks, offload_dir), machine, memo, padded)
            memory = getattr(explained, f"{phase}_memory")
            if memory is None:
                raise RefusedError(f"the device memory of {type(model).__name__}'s generation cannot be predicted "
                                   "(see the warning logged); choose num_subbatches and the tiers by hand", "tune")
            peaks[key] = memory.peak_bytes
            tried.append((w, kv, phase, prefill_k if phase == "prefill" else decode_k, peaks[key]))
        return peaks[key]

    def choose(w: str, kv: str, limit: int) -> tuple[int, int] | None:
        """(prefill K, decode K): the fewest sub-batches that fit, decode first (the
        prefill fills the rows of each decode sub-batch's cache of a layer before
        storing them, so a decode K that fits may leave no prefill that does)."""
        for decode_k in divisors:
            if max_new_tokens > 1 and peak(w, kv, "decode", decode_k, decode_k) > limit:
                continue
            prefill_k = next((k for k in divisors if peak(w, kv, "prefill", k, decode_k) <= limit), None)
            if prefill_k is not None:
                return prefill_k, decode_k
        return None

    combinations = [(w, kv) for w in tiers(weights) for kv in tiers(kv_cache)]
    for w, kv in combinations:
        chosen = choose(w, kv, budget)
        if chosen is not None:
            prefill_k, decode_k = chosen
            explanation = explain_generation_config(
                model, input_shape, max_new_tokens,
                generation_config(decode_k, prefill_k, w, kv, live_blocks, offload_dir), machine, memo, padded)
            options = {"num_subbatches": decode_k, "prefill_subbatches": prefill_k, "weights": w, "kv_cache": kv,
                       "live_blocks": live_blocks}
            return GenerationTuneResult(options, explanation, tuple(tried))
    # The smallest budget: the least peak of any pass at which the choice succeeds.
    smallest = None
    for w, kv in combinations:
        for decode_k in divisors:
            if max_new_tokens > 1:
                peak(w, kv, "decode", decode_k, decode_k)
            for prefill_k in divisors:
                peak(w, kv, "prefill", prefill_k, decode_k)
        candidates = sorted({n for (tw, tkv, *_), n in peaks.items() if (tw, tkv) == (w, kv)})
        need = next(n for n in candidates if choose(w, kv, n) is not None)
        smallest = need if smallest is None else min(smallest, need)
    described = f"weights={weights!r}" if weights else "weights on any tier"
    described += f", kv_cache={kv_cache!r}" if kv_cache else ", the KV cache on any tier"
    raise GenerationBudgetError(budget, smallest, described)
