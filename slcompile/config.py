"""The one configuration record of the speedloader backend.

`torch.compile(model, backend="speedloader", options={...})` hands `options` to
`SpeedLoaderConfig.from_options`, which rejects unknown keys and bad values with a
message naming the key. Every public option is documented here, once.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from slcompile.errors import OptionError

if TYPE_CHECKING:
    from slcompile.analysis.machine import MachineProfile

__all__ = ["SpeedLoaderConfig", "options", "check_names", "LOWERINGS", "SCHEDULES", "ON_REFUSAL", "TIERS", "RECOMPUTE", "SUFFIXES", "GRADIENTS", "TRAINABLE", "GENERATION_ONLY", "parse_bytes", "batch_divisors", "batch_split_problem", "resolve", "environment_variable", "option_values", "one_option_value", "single_options", "check_option_value"]

LOWERINGS = ("inductor", "aot_eager")
TIERS = ("device", "host", "nvme")
SCHEDULES = ("speedloader", "grad_accumulation", "no_offload", "lifetime_aware", "spilling", "zigzag_spilling")
ON_REFUSAL = ("fallback", "raise")
RECOMPUTE = ("auto", "none", "blocks")
SUFFIXES = ("auto", "whole", "subbatches")
GRADIENTS = ("auto",) + TIERS
TRAINABLE = ("auto", "stream", "device")
GENERATION_ONLY = ("kv_cache", "prefill_subbatches")
"""The options only `slcompile.generate` reads (a compiled step keeps no KV cache)."""
_UNITS = MappingProxyType({"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                           "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


@dataclasses.dataclass(frozen=True)
class SpeedLoaderConfig:
    """Options of the speedloader backend.

    Attributes:
        num_subbatches: K, the number of sub-batches the batch is split into along the
            batch dimension. Every block runs all K sub-batches before the next block
            starts. The batch size must be divisible by K. K=1 runs the model as one
            sub-batch (layer-major is then the plain order).
        lowering: what compiles the rewritten graph: "inductor" (default) or
            "aot_eager" (AOTAutograd without code generation; fast to compile).
        compile_regions: with Inductor, outline each (block, sub-batch) region of
            the step as a call of a subgraph (PyTorch's `invoke_subgraph`), one
            subgraph per distinct region, which Inductor lowers once wherever it
            runs (`slcompile.passes.outline_regions`): compile time then no longer
            grows with K x depth. The step, transfers, glue, embeddings, head and
            loss included, is still one Inductor program. False lowers every copy
            of every block (compile time grows with K x depth).
        trace_units_once: AOTAutograd traces, differentiates and partitions each
            distinct (block, sub-batch) unit once and records the others as calls
            of it (`slcompile.passes.trace_units`); the graphs the passes read are
            the same. A step whose units cannot be traced so, or whose schedule
            runs a block's sub-batches apart (sample-major), is traced flat
            (logged). False traces every op of every copy (compile time grows
            with K x depth). "auto" (the default) traces each unit once in a
            step of 8 blocks or more (`backends.lowering.UNITS_ONCE_MIN_BLOCKS`),
            where it saves time: on fewer, the calls, their check and their
            inlining cost what they save (`bench/README.md`, "Tracing each
            distinct unit once").
        cudagraphs: with Inductor on CUDA, replay the compute between transfers as
            CUDA graphs: Inductor partitions the step at every `slc::` op (its graph
            partition) and its cudagraph trees record each partition once per shape,
            so a region costs one graph launch instead of one launch per kernel.
            `torch.compile(model, backend="speedloader", mode="reduce-overhead")`
            sets it, as the mode does for Inductor. Elsewhere (the CPU, aot_eager)
            the step runs without CUDA graphs, and the report says why.
        schedule: the policy that orders compute and moves weights; every policy,
            built-in (`slcompile.schedules.policies.BUILTIN_POLICIES`, below) or
            registered, shares every pass and runtime op, so a comparison differs
            only in the schedule.
            "speedloader": layer-major over sub-batches: each block runs all K
            sub-batches before the next block starts, and a block's weights, when
            they rest off the device, are fetched once per pass for all K.
            "grad_accumulation": the usual baseline: K micro-batches, each runs
            every block before the next micro-batch starts (sample-major, forward
            and backward), and each block's weights are fetched once per
            micro-batch per pass, K times per forward and K times per backward:
            K times speedloader's weight traffic, with the same compute and the
            same results. Inside one graph the activations saved for the backward
            of all K micro-batches are alive at once (calling the model K times
            frees each micro-batch's before the next one starts), so it matches
            gradient accumulation in weight traffic and compute, not in activation
            memory.
            "no_offload": speedloader's order with every weight and activation
            resident on the device and no transfers, the ideal when the model fits;
            it requires `weights="device"` and `activations="device"` and equals
            "speedloader" with those settings.
            "lifetime_aware": speedloader's order, but the saved activations of a
            (block, sub-batch) whose reload could not hide behind other block steps
            stay on the device (`slcompile.schedules.examples.lifetime_aware`).
            "spilling": speedloader's order, and the output of a (block,
            sub-batch) that waits three steps or more for its next block rests on
            the activations' tier meanwhile; "zigzag_spilling": the same with the
            sub-batches of every other block in reverse, so fewer outputs wait
            (`slcompile.schedules.examples.spilling`); both need `activations` on
            a tier that copies.
            A `slcompile.schedules.Policy` object is accepted too, and the name of
            one registered with `slcompile.schedules.register_policy`.
        batch_dim: the dimension of the batched inputs that is the batch (0 for the
            usual (batch, seq, ...) layout).
        on_refusal: what happens when the model cannot be split into sub-batches
            without changing its results (BatchNorm in training, a batch not divisible
            by K, no batch dimension, ...): "fallback" compiles it with the plain
            lowering and logs one warning with the reason; "raise" raises
            `slcompile.RefusedError` with the reason. A graph without repeated blocks
            (a loss after a graph break, say) is not a refusal: it is compiled plainly
            either way, logged at info level.
        weights: where block weights rest between uses: "device" (resident),
            "host" (pinned RAM on a GPU machine; on a CPU machine host memory is the
            device's, so this is "device"), or "nvme" (O_DIRECT files). Off the
            device, each block's weights are loaded once per forward and once per
            backward, shared by all K sub-batches; parameters read outside one block
            (embeddings, the head, tied weights) stay resident. Read or update
            offloaded parameters inside `slcompile.gathered_weights(model)`.
        trainable: which trainable weights (`requires_grad`) of a block stay on
            the device when `weights` streams the block's weights. Frozen weights
            always stream: the backward loads them again only where the input
            gradients read them, and they have no gradient and no optimizer state.
            "auto" (default): a block's trainable weights stay on the device when
            the same block also holds frozen weights (adapters such as LoRA's over
            a frozen base, whose bytes are a small share of the block's), so any
            torch optimizer steps them as it steps the embeddings; a block whose
            weights all train (full training) streams them all, as "stream" does.
            "stream": every weight only one block reads streams, trainable or not
            (step them with `slcompile.offload_optimizer` or inside
            `slcompile.gathered_weights`). "device": every trainable weight stays,
            and only frozen ones stream. A block whose trainable weights are a
            large share of it (its attention frozen, its MLP trained) keeps them
            all under "auto": "stream" moves them too. The compile report
            (`CompileReport.weights`) and `slcompile.explain` list each resident
            weight with its reason.
        live_blocks: how many blocks' weights may be on the device at once: the one
            computing and `live_blocks - 1` prefetched ahead.
        offload_dir: directory for the nvme tier's private files (default: the
            system's temporary directory).
        activations: where the saved activations of the blocks rest between the
            forward and the backward: "device" (kept), "host" or "nvme". Off the
            device, each saved tensor of a (block, sub-batch) the schedule stashes
            is stored when it is made and loaded back one compute step ahead of its
            backward use; under `memory_budget`, the planner stashes only what the
            budget needs, longest idle first (`slcompile.schedules.planner`).
        min_offload_bytes: saved tensors smaller than this stay on the device
            (default 64 KiB; transfers that small cost more than they free). A
            graph with a symbolic batch or sequence compares each at its largest
            size (the range of its size symbols: unbounded unless
            `torch._dynamo.mark_dynamic(..., max=)` bounds it), so a saved tensor
            that grows with them leaves at every size.
        recompute: what the backward does with the activations inside a block:
            "none" keeps every saved tensor, "blocks" saves only each block's input
            (and random masks) and recomputes the block's internals from it during
            the backward (block-level checkpointing), "auto" keeps them unless the
            step would not fit `memory_budget` with the activations whose transfers
            hide behind compute stashed (then it recomputes; stashing everything,
            hidden or not, comes last).
        suffix: how the suffix of a compiled step (what runs after the last
            block: the final norm, the head and the loss) meets the sub-batches.
            "whole" runs it once on the whole batch, the last block's K outputs
            concatenated: the head's weight is read once and its kernels run
            once, where per sub-batch a step reads and runs them K times (on a
            small model that is most of a step's time). "subbatches" runs it per sub-batch, the loss combined from
            the K parts: the suffix's temporaries (the logits' float copies, their
            gradient) are then a sub-batch's, not the batch's. "auto" (default) is
            the policy's own choice (`Policy.suffix`: "whole" for the built-in
            layer-major policies, "subbatches" for grad_accumulation, whose
            micro-batches each run everything, and for a policy that does not
            say); under a `memory_budget` that no plan meets with the suffix
            whole, the step is planned again with it per sub-batch.
        memory_budget: the device tier's limit for one training step, in bytes or as
            a string ("2GiB", "512MB"); None means no limit. The peak is predicted
            from the compiled graphs before anything runs; when no plan fits,
            compiling raises `slcompile.BudgetError` naming the smallest budget that
            would. A graph with symbolic sizes is guarded to the sizes at which its
            plan fits: another size compiles again, planned at that size.
        gradients: where the gradients of streamed block weights go when the
            backward has summed them over the K sub-batches: "device" returns them
            as `.grad`; "host" or "nvme" stores each block's gradients there once
            per backward and returns no `.grad` for them, for an optimizer that
            steps off the device (`slcompile.offload_optimizer`; a backward with no
            such optimizer holding the parameters raises); "auto" (default) does
            that, to the optimizer's `gradients` tier, for the streamed weights an
            offloaded optimizer holds when the graph compiles, else "device". Only
            streamed weights (`weights` off the device) are concerned. On a CPU
            machine "host" moves no bytes (host memory is the device's).
        host_memory: the most pinned host memory the offload runtime may hold, in
            bytes or as a string ("24GiB"); None (default) sizes the pool from the
            compiled plan (streamed weights and offloaded activations on the host),
            pinned in chunks once. A plan that needs more than this raises
            `slcompile.runtime.HostPoolFullError` naming the bytes it needs. GPU
            machines only: on a CPU machine nothing is pinned.
        shard_weights: shard the streamed block weights across the ranks of
            `torch.distributed`'s default process group (initialize it first, e.g.
            `dist.init_process_group("gloo")` under torchrun): each rank keeps 1/W of
            every streamed weight on the `weights` tier, a block's fetch all-gathers
            the full weight once per pass for all K sub-batches, and its final
            gradient is reduce-scattered (averaged over the ranks) once per step, so
            the offloaded optimizer (`slcompile.offload_optimizer`, required) steps
            this rank's shard only; the resident parameters stay replicated and
            their gradients are averaged in `step()`. Each rank runs its own batch
            (the mean of a loss over an equal local batch makes the average the
            global batch's gradient). Needs `weights` off "device" (with it, "host"
            streams even on a CPU machine) and `gradients` not "device"
            (`slcompile.runtime.collectives`).
        machine_profile: the machine profile the activation planner decides by
            (`slcompile.profile.machine_profile`: "current" for this machine's
            measured one, a named profile such as "h100-pcie5-nvme", a profile's
            JSON file, or a `MachineProfile`). With one, a stash is kept on the
            device unless the compute around its store and its load covers their
            predicted time, and its transfers are placed where it does
            (`slcompile.schedules.planner`); None (default) decides by counting
            compute steps, the same on every machine. `slcompile.tune(...,
            profile=...)` sets it in the options it returns. (`explain`'s own
            `profile` argument is the machine its timeline is predicted for.)
        kv_cache: generation (`slcompile.generate`): where each (layer, decode
            sub-batch)'s keys and values rest between decode steps: "device",
            "host" or "nvme". A compiled training or evaluation step keeps no cache.
        prefill_subbatches: generation: K of the prefill (None: `num_subbatches`).
            Generation reads `num_subbatches` as the decode steps' K, `weights` and
            `offload_dir` as training does, and `live_blocks` as the layers whose
            weights are on the device at once: the one computing and the next
            `live_blocks - 1`, loading.
    """

    num_subbatches: int = 2
    lowering: str = "inductor"
    compile_regions: bool = True
    trace_units_once: bool | str = "auto"
    cudagraphs: bool = False
    schedule: str = "speedloader"
    batch_dim: int = 0
    on_refusal: str = "fallback"
    weights: str = "device"
    trainable: str = "auto"
    live_blocks: int = 2
    offload_dir: str | None = None
    activations: str = "device"
    min_offload_bytes: int = 64 * 1024
    recompute: str = "auto"
    suffix: str = "auto"
    memory_budget: int | str | None = None
    gradients: str = "auto"
    host_memory: int | str | None = None
    shard_weights: bool = False
    machine_profile: str | MachineProfile | None = None
    kv_cache: str = "device"
    prefill_subbatches: int | None = None

    def __post_init__(self) -> None:
        _check_int("num_subbatches", self.num_subbatches, minimum=1)
        _check_int("batch_dim", self.batch_dim, minimum=0)
        _check_choice("lowering", self.lowering, LOWERINGS)
        for key in ("compile_regions", "cudagraphs"):
            if not isinstance(getattr(self, key), bool):
                raise OptionError(f"speedloader option {key!r} must be True or False, got {getattr(self, key)!r}")
        if not isinstance(self.trace_units_once, bool) and self.trace_units_once != "auto":
            raise OptionError(f"speedloader option 'trace_units_once' must be True, False or 'auto', "
                              f"got {self.trace_units_once!r}")
        if not callable(getattr(self.schedule, "build", None)):  # else a Policy object
            from slcompile.schedules.policies import unknown_policy

            problem = unknown_policy(self.schedule)
            if problem:
                raise OptionError(problem)
        _check_choice("on_refusal", self.on_refusal, ON_REFUSAL)
        _check_choice("weights", self.weights, TIERS)
        _check_choice("trainable", self.trainable, TRAINABLE)
        _check_int("live_blocks", self.live_blocks, minimum=1)
        _check_choice("activations", self.activations, TIERS)
        _check_int("min_offload_bytes", self.min_offload_bytes, minimum=0)
        _check_choice("recompute", self.recompute, RECOMPUTE)
        _check_choice("suffix", self.suffix, SUFFIXES)
        _check_choice("gradients", self.gradients, GRADIENTS)
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget, "memory_budget"))
        if self.host_memory is not None:
            object.__setattr__(self, "host_memory", parse_bytes(self.host_memory, "host_memory"))
        if self.schedule == "no_offload":
            for key in ("weights", "activations"):
                if getattr(self, key) != "device":
                    raise OptionError(
                        f"speedloader options 'schedule' and {key!r} conflict: schedule='no_offload' keeps "
                        f"everything on the device, but {key}={getattr(self, key)!r}; use {key}='device' with it"
                    )
        if self.offload_dir is not None:
            _check_offload_dir(self.offload_dir)
        if self.shard_weights is not False:
            _check_sharding(self)
        if self.machine_profile is not None:
            _check_profile(self.machine_profile)
        _check_choice("kv_cache", self.kv_cache, TIERS)
        if self.prefill_subbatches is not None:
            _check_int("prefill_subbatches", self.prefill_subbatches, minimum=1)


    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> SpeedLoaderConfig:
        """Builds the config from `torch.compile(..., options=...)`; the options not
        given take their defaults from `slcompile.defaults` (set in code or by `SLC_*`
        environment variables), else this class's.

        Raises:
            ValueError: an unknown key (with the closest known one) or a bad value.
        """
        if isinstance(options, cls):
            return options
        values, _ = resolve(check_names(options or {}))
        return cls(**values)

    def cache_key(self) -> str:
        """A stable string of every option, for compile caches."""
        return repr(sorted(dataclasses.asdict(self).items()))


# torch.compile's modes that have a speedloader counterpart, as options (the rest of
# each from the defaults).
MODES = MappingProxyType({"default": {}, "reduce-overhead": {"cudagraphs": True}})


def options_of_mode(mode: str, instead: str) -> dict[str, Any]:
    """The speedloader options torch.compile's `mode` stands for.

    Raises:
        OptionError: a mode without a speedloader counterpart; `instead` (what to
            write instead) ends the message.
    """
    if mode not in MODES:
        raise OptionError(f"the speedloader backend takes mode='default' or mode='reduce-overhead' (its "
                          f"cudagraphs option), not mode={mode!r}: {instead}")
    return dict(MODES[mode])


def check_names(options: Mapping[str, Any]) -> Mapping[str, Any]:
    """Returns `options` once every key is known to be an option.

    Raises:
        OptionError: not a dict, or an unknown key (with the closest known one).
    """
    if not isinstance(options, Mapping):
        raise OptionError(f"speedloader options must be a dict, got {type(options).__name__}")
    known = {f.name for f in dataclasses.fields(SpeedLoaderConfig)}
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise OptionError(
                f"unknown speedloader option {key!r}{hint} "
                f"(known options: {', '.join(sorted(known))})"
            )
    return options


_SEQUENCES = (list, tuple, range)


def option_values(key: str, value: Any, caller: str) -> tuple:
    """The values an option is given as, one rule for `tune`, `explain` and
    `compare_policies`: a single value, or a sequence of them (a list, tuple or
    range), each kept once, in order. A string, a `Policy` or a profile is one value.

    Raises:
        OptionError: an empty sequence, naming the caller and the option.
    """
    if not isinstance(value, _SEQUENCES):
        return (value,)
    values: list = []
    for item in value:
        if not any(item is kept or (type(item) is type(kept) and item == kept) for kept in values):
            values.append(item)
    if not values:
        raise OptionError(f"{caller}: option {key!r} needs a value or a non-empty list of values, got {value!r}")
    return tuple(values)


def one_option_value(key: str, value: Any, caller: str) -> Any:
    """The one value of an option that takes a single value where `caller` plans
    one configuration: a value, or a sequence of one.

    Raises:
        OptionError: a sequence of several values or none, naming the option.
    """
    values = option_values(key, value, caller)
    if len(values) > 1:
        raise OptionError(f"{caller}: option {key!r} takes one value here, got {len(values)}: {value!r} "
                          f"(slcompile.tune searches several values of num_subbatches, live_blocks, weights, "
                          f"activations and schedule)")
    return values[0]


def single_options(options: Mapping[str, Any], caller: str) -> dict[str, Any]:
    """`options` with each value made one (`one_option_value`), keys unchecked."""
    return {key: one_option_value(key, value, caller) for key, value in options.items()}


def check_option_value(key: str, value: Any, caller: str) -> None:
    """Checks one value of one option on its own, as compiling would (the others at
    their defaults), before anything is captured.

    Raises:
        OptionError: the value is not one the option takes, naming the caller and
            the option.
    """
    try:
        SpeedLoaderConfig.from_options({key: value})
    except OptionError as err:
        raise OptionError(f"{caller}: {key}={value!r}: {err}") from None


def options(**values: Any) -> dict[str, Any]:
    """The options of `torch.compile(model, backend="speedloader", options=...)`,
    checked now rather than at the first call of the compiled model.

    Example: `torch.compile(model, backend="speedloader",
    options=slcompile.options(num_subbatches=4, weights="nvme"))`.

    Returns:
        `values` as a dict, unchanged.

    Raises:
        ValueError: an unknown option (with the closest known one) or a bad value.
    """
    SpeedLoaderConfig.from_options(values)
    return dict(values)


def _check_profile(profile: Any) -> None:
    import os

    from slcompile.analysis.machine import NAMED_PROFILES, MachineProfile

    if isinstance(profile, MachineProfile):
        return
    if isinstance(profile, str) and (profile == "current" or profile in NAMED_PROFILES or os.path.isfile(profile)):
        return
    raise OptionError(
        f"speedloader option 'machine_profile' must be 'current', a named profile ({', '.join(sorted(NAMED_PROFILES))}), "
        f"a profile's JSON file or a MachineProfile, got {profile!r}"
    )


def _check_offload_dir(path: Any) -> None:
    """Refuses an `offload_dir` that cannot work, naming the cause. What only an
    attempt can tell (permissions, a filesystem that takes no new files) is found
    when the nvme tier creates its private directory there."""
    import os

    if not isinstance(path, (str, os.PathLike)):
        raise OptionError(f"speedloader option 'offload_dir' must be a path string, got {path!r}")
    if not os.fspath(path):
        # abspath("") is the current directory, but the nvme tier would not go there.
        raise OptionError("speedloader option 'offload_dir': the empty path names no directory; leave it "
                          "unset for the temp dir, or name one ('.' for the current directory)")
    if "\0" in os.fspath(path):
        # os.path.exists answers False for it; the first system call on it would raise
        # a bare "embedded null byte" once the nvme tier makes its directory.
        raise OptionError(f"speedloader option 'offload_dir': {path!r} holds a null byte, which no path may hold")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise OptionError(f"speedloader option 'offload_dir': {path} is not a directory")
        return
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise OptionError(
            f"speedloader option 'offload_dir': {path} does not exist, nor does its parent {parent} "
            "(only the last folder is created); create it first or choose another directory"
        )


def parse_bytes(value: Any, key: str = "value") -> int:
    """Bytes from an int or a string with a unit: 2GiB, 512 MB, 1e9, 4096.

    Raises:
        ValueError: naming `key`, for anything else or a size below one byte.
    """
    if isinstance(value, bool):
        raise OptionError(f"speedloader option {key!r} must be bytes or a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise OptionError(
                f"speedloader option {key!r} must be bytes or a size like '2GiB' or '512MB', got {value!r}"
            )
        number = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise OptionError(f"speedloader option {key!r} must be bytes or a size like '2GiB', got {value!r}")
    if number < 1:
        raise OptionError(f"speedloader option {key!r} must be at least one byte, got {value!r}")
    return number


def batch_split_problem(batch_size: int, num_subbatches: int, where: str = "") -> str | None:
    """Why a batch of `batch_size` cannot be cut into `num_subbatches` equal, non-empty
    sub-batches, or None when it can (one sub-batch is the whole batch, whatever its
    size).

    Args:
        where: where the batch size was read, written after it: "(dim 0 of input x)".

    Returns:
        "batch size 6 is not divisible by num_subbatches=4", or None.
    """
    if num_subbatches == 1 or (batch_size >= num_subbatches and batch_size % num_subbatches == 0):
        return None
    size = f"{batch_size} {where}" if where else f"{batch_size}"
    return f"batch size {size} is not divisible by num_subbatches={num_subbatches}"


def batch_divisors(batch_size: int) -> list[int]:
    """The values of `num_subbatches` that cut a batch of `batch_size` evenly, ascending
    (those `batch_split_problem` finds nothing wrong with)."""
    return [k for k in range(1, batch_size + 1) if batch_split_problem(batch_size, k) is None]


def _check_int(key: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(
            f"speedloader option {key!r} must be an int, got {value!r}"
        )
    if value < minimum:
        raise OptionError(
            f"speedloader option {key!r} must be >= {minimum}, got {value}"
        )


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise OptionError(
            f"speedloader option {key!r} must be one of {', '.join(map(repr, choices))}, "
            f"got {value!r}"
        )


def _check_sharding(config: SpeedLoaderConfig) -> None:
    from slcompile.runtime.collectives import process_group_ready

    if not isinstance(config.shard_weights, bool):
        raise OptionError(f"speedloader option 'shard_weights' must be True or False, got {config.shard_weights!r}")
    if not process_group_ready():
        raise OptionError(
            "speedloader option 'shard_weights' needs torch.distributed's default process group, "
            "which is not initialized: call torch.distributed.init_process_group(...) (under torchrun, "
            "or in each spawned process) before the compiled model's first call"
        )
    if config.weights == "device":
        raise OptionError(
            "speedloader option 'shard_weights' shards the streamed weights, but weights='device' keeps "
            "every weight resident: use weights='host' or weights='nvme' with it"
        )
    if config.gradients == "device":
        raise OptionError(
            "speedloader option 'shard_weights' reduce-scatters the weight gradients to an offloaded "
            "optimizer, but gradients='device' keeps them: use gradients='auto' with "
            "slcompile.offload_optimizer(model, ...)"
        )


# The values each option takes when a graph compiles: the options given, else a value
# set in code through `slcompile.defaults` (kept here, with the fields they default),
# else the environment, else the field's default.
_PREFIX = "SLC_"
_FIELDS = MappingProxyType({field.name: field for field in dataclasses.fields(SpeedLoaderConfig)})
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_defaults_lock = threading.Lock()
_overrides: dict[str, Any] = {}  # values set in code: assignment or patch


def environment_variable(name: str) -> str:
    """The environment variable of an option: `SLC_NUM_SUBBATCHES` for `num_subbatches`."""
    return _PREFIX + name.upper()


def resolve(options: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Every option's value and where it came from, `options` (those given to
    `torch.compile`, already known to be names of options) taking precedence.

    Returns:
        (values, sources): the value of every option, and for those not at their
        field's default, "options", "slcompile.defaults" or the environment
        variable's name.

    Raises:
        OptionError: an environment variable whose value the option cannot take,
            naming the variable.
    """
    options = dict(options or {})
    with _defaults_lock:
        overrides = dict(_overrides)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, field in _FIELDS.items():
        if name in options:
            values[name], source = options[name], "options"
        elif name in overrides:
            values[name], source = overrides[name], "slcompile.defaults"
        elif (raw := os.environ.get(environment_variable(name))) is not None:
            values[name], source = _from_environment(name, raw), environment_variable(name)
        else:
            values[name], source = field.default, None
        if source is not None and values[name] != field.default:
            sources[name] = source
    return values, sources


def _check_default(name: str, value: Any) -> None:
    if name not in _FIELDS:
        close = difflib.get_close_matches(name, sorted(_FIELDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise AttributeError(f"slcompile.defaults has no option {name!r}{hint}")
    if name in GENERATION_ONLY:
        raise OptionError(f"{name!r} is an option of slcompile.generate alone, which takes no defaults from "
                          f"slcompile.defaults: pass {name}=... to its call")
    if name == "shard_weights":
        # Checked when a graph compiles: it needs a process group, which may come later.
        if not isinstance(value, bool):
            raise OptionError(f"speedloader option 'shard_weights' must be True or False, got {value!r}")
        return
    SpeedLoaderConfig(**{name: value})


def _from_environment(name: str, raw: str) -> Any:
    """An option's value from its environment variable's text, by the field's type."""
    kind = str(_FIELDS[name].type)
    text = raw.strip()
    try:
        if "None" in kind and text.lower() in ("", "none"):
            return None
        value: Any = text
        if kind == "bool":
            if text.lower() not in _TRUE + _FALSE:
                raise OptionError(f"expected one of {', '.join(_TRUE + _FALSE)}")
            value = text.lower() in _TRUE
        elif kind.startswith("int"):
            try:
                value = int(text)
            except ValueError:
                if kind == "int":
                    raise OptionError("expected an integer") from None
        _check_default(name, value)
        return value
    except OptionError as err:
        raise OptionError(f"environment variable {environment_variable(name)}={raw!r}: {err}") from None


_UNSET = object()
