"""`explain_generation`: each pass's schedule, bytes, device memory and (with a
profile) time, predicted from the same pass requests `generate` runs, without
running the model: each pass's schedule is lowered to the graph `generate` runs
(`lower_pass`, with placeholder weights), and the memory and time models read that
graph's nodes in order."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.pass_memory import PassMemory
from slcompile.config import SpeedLoaderConfig
from slcompile.inference.capture import _cache_windows
from slcompile.inference.executor import _fetched, _streamed_parameters
from slcompile.inference.memory import _hidden_row_bytes, _kv_row_bytes, _MemoryModel
from slcompile.inference.options import generation_config, generation_plan
from slcompile.inference.pass_graph import PassGraph, PassLayout, lower_pass
from slcompile.inference.records import GenerationStep
from slcompile.runtime.stats import TransferKey
from slcompile.runtime.storage.tiers import Tier, TransferKind
from slcompile.schedules.base import Schedule
from slcompile.schedules.generation import PassRequest, offloads_hidden

__all__ = ["GenerationExplanation", "explain_generation", "explain_generation_config"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerationExplanation:
    """What `generate` would do, predicted from the model's config and the options,
    for every sequence generating all `max_new_tokens` (no early EOS).

    Attributes:
        model: the model's class name.
        layers_name: where its decoder layers are (`model.layers`).
        num_layers: how many there are.
        batch, prompt_length, max_new_tokens: the generation's sizes.
        prefill_subbatches, num_subbatches: K of the prefill and of the decode steps.
        weights, kv_cache: the tiers.
        weight_store_bytes: bytes of layer weights stored on their tier before the prefill.
        steps: one `GenerationStep` per pass, as `generate(...,
            return_dict_in_generate=True)` measures them.
        prefill_memory: the device memory of the prefill (`PassMemory`; None, with a
            logged warning, for a model whose forward cannot be traced on fake tensors).
        decode_memory: that of the decode pass with the highest peak (the last, but
            for sliding-window caches); None with one new token.
        prefill_time: with `profile=`, the prefill's predicted timeline
            (`slcompile.analysis.time.TimePrediction`), else None.
        decode_time: with `profile=`, that of the middle decode pass (whose cache
            length is the mean of all decode passes'); None with one new token.
    """

    model: str
    layers_name: str
    num_layers: int
    batch: int
    prompt_length: int
    max_new_tokens: int
    prefill_subbatches: int
    num_subbatches: int
    weights: str
    kv_cache: str
    weight_store_bytes: int
    steps: tuple[GenerationStep, ...]
    prefill_memory: PassMemory | None = None
    decode_memory: PassMemory | None = None
    prefill_time: Any = None
    decode_time: Any = None

    @property
    def seconds(self) -> float | None:
        """The predicted time of the whole generation: the prefill and
        `max_new_tokens - 1` decode passes (None without a profile)."""
        if self.prefill_time is None:
            return None
        decode = self.decode_time.step_seconds if self.decode_time is not None else 0.0
        return self.prefill_time.step_seconds + (len(self.steps) - 1) * decode

    @property
    def peak_bytes(self) -> int | None:
        """The device's peak over the whole generation (None when not predicted)."""
        return max((m.peak_bytes for m in (self.prefill_memory, self.decode_memory) if m is not None), default=None)

    @property
    def prefill_schedule(self) -> str:
        """The prefill's schedule text, one step per line."""
        return self.steps[0].schedule.text()

    @property
    def decode_schedule(self) -> str:
        """The first decode pass's schedule text ("" with one new token)."""
        return self.steps[1].schedule.text() if len(self.steps) > 1 else ""

    def __str__(self) -> str:
        from slcompile.units import format_bytes

        kv = (TransferKind.KV, Tier.DEVICE, Tier(self.kv_cache))
        kv_back = (TransferKind.KV, Tier(self.kv_cache), Tier.DEVICE)
        hidden = (TransferKind.ACTIVATION, Tier.DEVICE, Tier(self.kv_cache))

        def weight_bytes(step):
            return sum(n for (kind, _, destination), n in step.bytes_moved.items()
                       if kind is TransferKind.WEIGHT and destination is Tier.DEVICE)

        lines = [
            f"generate {self.model} ({self.num_layers} layers, {self.layers_name}): batch {self.batch}, "
            f"prompts of {self.prompt_length} tokens, {self.max_new_tokens} new tokens",
            f"  prefill: {self.prefill_subbatches} sub-batches of {self.batch // self.prefill_subbatches}; "
            f"decode: {self.num_subbatches} sub-batches of {self.batch // self.num_subbatches}",
            f"  weights on {self.weights} ({format_bytes(self.weight_store_bytes)} stored before the prefill), "
            f"kv cache on {self.kv_cache}",
            f"  prefill schedule: {_schedule_summary(self.steps[0].schedule)}",
        ]
        if len(self.steps) > 1:
            lines.append(f"  decode schedule:  {_schedule_summary(self.steps[1].schedule)}")
        for memory in (self.prefill_memory, self.decode_memory):
            if memory is not None:
                lines.append(f"  {memory}")
        for name, timeline in (("prefill", self.prefill_time), ("middle decode pass", self.decode_time)):
            if timeline is not None:
                lines.append(f"  {name}: " + str(timeline).replace("\n", "\n  "))
        if self.seconds is not None:
            tokens = self.batch * self.max_new_tokens
            lines.append(f"  predicted generation: {self.seconds:.3f} s, {tokens / self.seconds:,.0f} tokens/s")
        if self.steps[0].bytes_of(*hidden):
            lines.append(f"  prefill hidden states between layers on {self.kv_cache}: "
                         f"{format_bytes(self.steps[0].bytes_of(*hidden))} stored and loaded")
        lines.append(f"  {'pass':<10} {'weights loaded':>15} {'kv stored':>12} {'kv loaded':>12}")
        names = ["prefill"] + [f"decode {t}" for t in range(1, len(self.steps))]
        shown = range(len(self.steps)) if len(self.steps) <= 8 else [0, 1, 2, len(self.steps) - 1]
        for row in shown:
            if row == len(self.steps) - 1 and row not in (0, 1, 2) and len(self.steps) > 8:
                lines.append(f"  {'...':<10}")
            step = self.steps[row]
            lines.append(f"  {names[row]:<10} {format_bytes(weight_bytes(step)):>15} "
                         f"{format_bytes(step.bytes_of(*kv)):>12} {format_bytes(step.bytes_of(*kv_back)):>12}")
        lines.append(f"  {'total':<10} {format_bytes(sum(map(weight_bytes, self.steps))):>15} "
                     f"{format_bytes(sum(step.bytes_of(*kv) for step in self.steps)):>12} "
                     f"{format_bytes(sum(step.bytes_of(*kv_back) for step in self.steps)):>12}")
        return "\n".join(lines)


def _schedule_summary(schedule: Schedule) -> str:
    """`prefix blk0.sb0-3 ... suffix (14 steps; fetch.issue 2, store_kv.issue 4)`:
    the compute order and how many transfers of each kind."""
    import collections

    from slcompile.viz.summary import summarize_schedule

    kinds = collections.Counter(step.kind for step in schedule.steps if step.kind != "compute")
    compute = summarize_schedule(schedule.compute().text()).partition(" ")[2]
    transfers = ", ".join(f"{kind} {count}" for kind, count in kinds.items())
    return f"{compute} ({len(schedule)} steps{'; ' + transfers if transfers else ''})"


def explain_generation(
    model: nn.Module,
    input_shape: Sequence[int],
    max_new_tokens: int = 20,
    *,
    num_subbatches: int = 1,
    prefill_subbatches: int | None = None,
    weights: str = "device",
    kv_cache: str = "device",
    live_blocks: int = 2,
    offload_dir: str | None = None,
    schedule: Any = "speedloader",
    machine: MachineFacts | None = None,
    padded: bool = False,
    profile: Any = None,
    backend: str = "inductor",
) -> GenerationExplanation:
    """The schedules, bytes and device memory per pass of `generate(model,
    input_ids, ...)` with these options, without running the model (the memory of
    a layer step and of the tail comes from their graphs traced on fake tensors);
    `print` it for a summary.

    Args:
        model, max_new_tokens, num_subbatches, prefill_subbatches, weights, kv_cache,
            live_blocks, offload_dir, schedule: as for `generate`; the problem's size (the shape and
            `max_new_tokens`) may be given by position, the options by keyword only.
        input_shape: `input_ids.shape`, `(batch, length)`.
        machine: the machine's facts the memory is predicted with (`MachineFacts`:
            which tiers copy, how a loaded tensor is padded); default: this
            machine's (`slcompile.facts.machine_facts(offload_dir)`).
        padded: predict the memory for left-padded prompts, every sequence padded
            (the masks the model then builds for each sub-batch are counted); the
            bound for any `attention_mask`.
        profile: the machine to predict the passes' time on: "current" (this
            machine's measured profile), a named profile ("h100-pcie5-nvme") or a
            `MachineProfile`; None (default) predicts no time.
        backend: the layer steps' lowering, as `generate`'s (the time model fuses
            elementwise ops under "inductor").

    Returns:
        The prediction; its `steps` equal those `generate(...,
        return_dict_in_generate=True)` measures when no sequence stops early, and
        `prefill_memory`/`decode_memory` give the device peak of the prefill and of
        the largest decode pass, for greedy decoding of prompts without padding
        (with `padded`: every prompt padded).

    Raises:
        OptionError, RefusedError: as `generate` raises them.
    """
    rates = None
    if profile is not None:
        from slcompile.measure import machine_profile

        rates = machine_profile(profile, offload_dir=offload_dir, refuse_untrusted=True)
    config = generation_config(num_subbatches, prefill_subbatches, weights, kv_cache, live_blocks, offload_dir,
                               schedule)
    return explain_generation_config(model, input_shape, max_new_tokens, config, machine, {}, padded, rates, backend)


def explain_generation_config(model, input_shape, max_new_tokens, config: SpeedLoaderConfig,
                              machine: MachineFacts | None, memo: dict, padded: bool = False, rates=None,
                              backend: str = "inductor") -> GenerationExplanation:
    """`explain_generation`; `memo` keeps the traced memory of the capture, the layer
    steps and the tail between calls for one model and input shape (they do not
    depend on the tiers)."""
    from slcompile.kv_segments import forgettable_segments, merged_segments
    from slcompile.facts import machine_facts
    from slcompile.runtime.weights import weight_home

    weights, kv_cache = config.weights, config.kv_cache
    if machine is None:
        machine = machine_facts(config.offload_dir)
    plan = generation_plan(model, tuple(input_shape), None, config, max_new_tokens=max_new_tokens, eos_token_id=[])
    batch, length = tuple(input_shape)
    layers = plan.layers
    streamed = _streamed_parameters(model, plan, machine.copies(weights))
    weight_loads: dict[TransferKey, int] = {}
    weight_store_bytes = 0
    layer_loads = []  # per layer, the bytes of each parameter a fetch copies onto the device
    for params in streamed:
        sizes = []
        for _, param in params:
            home = weight_home(param)
            tier = home[2] if home is not None else Tier(weights)
            if not machine.copies(tier.value):
                continue
            nbytes = param.numel() * param.element_size()
            weight_store_bytes += nbytes if home is None else 0
            key = (TransferKind.WEIGHT, tier, Tier.DEVICE)
            weight_loads[key] = weight_loads.get(key, 0) + nbytes
            sizes.append(nbytes)
        layer_loads.append(tuple(sizes))
    weights_move = bool(weight_loads)
    kv_moves = machine.copies(kv_cache)
    windows = _cache_windows(model, len(layers))
    caps = [length + max_new_tokens if window is None else window - 1 for window in windows]
    position_bytes = [2 * batch * per_row for per_row in _kv_row_bytes(model, layers)]
    store_key, load_key = (TransferKind.KV, Tier.DEVICE, Tier(kv_cache)), (TransferKind.KV, Tier(kv_cache), Tier.DEVICE)
    n, kp, kd = len(layers), plan.prefill_subbatches, plan.num_subbatches
    size_p, size_d = batch // kp, batch // kd
    offloads = offloads_hidden(kv_moves, kp, n)

    fetched = _fetched(weights_move, [bool(params) for params in streamed])
    streamed_counts = [len(params) for params in streamed]

    def schedule(phase: str, stores: bool) -> Schedule:
        subbatches = kp if phase == "prefill" else kd
        return plan.policy(PassRequest(phase, tuple(range(subbatches)), fetched, kv_moves, stores,
                                           (size_p, size_d), phase == "prefill" and offloads, plan.live_blocks))

    graphs: dict[Schedule, PassGraph] = {}

    def lowered(schedule: Schedule) -> PassGraph:
        """The pass graph `generate` runs for `schedule`, lowered once, to be read."""
        if schedule not in graphs:
            prefill = schedule.steps[0].phase == "prefill"
            size = size_p if prefill else size_d
            parts = tuple((sb, sb * size, size) for sb in range(batch // size))
            graphs[schedule] = lower_pass(schedule, PassLayout.placeholders(parts, streamed_counts,
                                                                            prefill and offloads))
        return graphs[schedule]

    def moved(stored: int, loaded: int, hidden: int = 0) -> dict[TransferKey, int]:
        kv = {store_key: stored, load_key: loaded} if kv_moves else {}
        stashed = {(TransferKind.ACTIVATION, Tier.DEVICE, Tier(kv_cache)): hidden,
                   (TransferKind.ACTIVATION, Tier(kv_cache), Tier.DEVICE): hidden}
        return {key: v for key, v in {**weight_loads, **kv, **stashed}.items() if v}

    # The last pass stores no cache: no pass reads it.
    segments = [[min(length, cap)] for cap in caps]
    last = max_new_tokens == 1
    hidden = (n - 1) * batch * length * _hidden_row_bytes(model, layers) if offloads else 0
    steps = [GenerationStep("prefill", tuple(range(kp)), schedule("prefill", not last),
                            moved(0 if last else sum(b * s[0] for b, s in zip(position_bytes, segments)), 0,
                                  hidden))]
    # A decode step: each (layer, sub-batch) loads the segments it keeps and stores
    # its one new position merged with the last segments (`merged_segments`).
    loaded_segments, written_positions = {}, {}
    for step in range(1, max_new_tokens):
        last = step == max_new_tokens - 1
        loaded_segments[step] = [tuple(s) for s in segments]
        loaded = sum(b * sum(s) for b, s in zip(position_bytes, segments))
        stored = 0
        for layer, cap in enumerate(caps):
            kept = min(length + step, cap)
            replaced, written = merged_segments(segments[layer], 1, kept)
            segments[layer][len(segments[layer]) - replaced:] = [written]
            del segments[layer][:forgettable_segments(segments[layer], kept)]
            stored += position_bytes[layer] * written
            written_positions.setdefault(step, []).append(written)
        steps.append(GenerationStep("decode", tuple(range(kd)), schedule("decode", not last),
                                    moved(0 if last else stored, loaded)))
    try:
        memory = _MemoryModel(model, plan, batch, length, layer_loads, machine,
                              memo.setdefault("padded", {}) if padded else memo, padded)
        prefill_memory = memory.pass_memory(lowered(steps[0].schedule), 0)
        # Every decode pass's layer steps are traced with the last one's cache length:
        # the longest, so no step's temporaries are underestimated.
        longest = length + max_new_tokens - 2
        decode_memory = max((memory.pass_memory(lowered(steps[step].schedule), length + step - 1,
                                                loaded_segments[step], longest)
                             for step in range(1, max_new_tokens)), key=lambda m: m.peak_bytes, default=None)
    except Exception as error:  # noqa: BLE001 - the schedules and bytes stand without the memory
        log.warning("explain_generation: the device memory of %s's passes is not predicted: tracing its forward "
                    "on fake tensors failed (%s: %s)", type(model).__name__, type(error).__name__, error)
        prefill_memory = decode_memory = memory = None
    prefill_time = decode_time = None
    if rates is not None and memory is not None:
        hidden_part = size_p * length * _hidden_row_bytes(model, layers)
        row_bytes = _kv_row_bytes(model, layers)

        def pass_time(step: int) -> Any:
            phase = "prefill" if step == 0 else "decode"
            past = 0 if step == 0 else length + step - 1

            def kv_bytes(index: int, positions: int) -> int:
                return 2 * size_d * positions * row_bytes[index]  # keys and values, one tensor

            def moves(direction: str, what: str, index: int, subbatch: int | None) -> tuple[str, tuple[int, ...]]:
                if what == "w":
                    return weights, layer_loads[index]
                if what == "h":
                    return kv_cache, (hidden_part,)
                if step == 0:
                    return kv_cache, (kv_bytes(index, min(length, caps[index])),) if direction == "store" else ()
                if direction == "load":
                    return kv_cache, tuple(kv_bytes(index, seg) for seg in loaded_segments[step][index])
                return kv_cache, (kv_bytes(index, written_positions[step][index]),)

            costs, tail = memory.pass_costs(phase, past)
            return predict_pass_time(lowered(steps[step].schedule), moves=moves, costs=costs, tail=tail,
                                     profile=rates, phase=phase, lowering=backend,
                                     tokens=batch * (length if step == 0 else 1))

        from slcompile.analysis.time import predict_pass_time

        try:
            prefill_time = pass_time(0)
            decode_time = pass_time(max(1, max_new_tokens // 2)) if max_new_tokens > 1 else None
        except Exception as error:  # noqa: BLE001 - the rest of the explanation stands without the time
            log.warning("explain_generation: the time of %s's passes is not predicted (%s: %s)",
                        type(model).__name__, type(error).__name__, error)
    return GenerationExplanation(type(model).__name__, plan.layers_name, n, batch, length, max_new_tokens, kp, kd,
                                 weights, kv_cache, weight_store_bytes, tuple(steps), prefill_memory, decode_memory,
                                 prefill_time, decode_time)
