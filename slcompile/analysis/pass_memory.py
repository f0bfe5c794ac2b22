"""The memory model of a generation pass: the device's peak of one prefill or
decode pass, walked in its schedule (`predict_pass_memory`). `explain_generation`,
`tune_generation` and `generate`'s records state a pass's predicted memory from
here; a training step's is `slcompile.analysis.memory`'s.

A generation pass (`slcompile.schedules.generation`) runs compiled layer steps,
not one graph, so its device memory is walked in its schedule: at every layer
step of every sub-batch, what the device holds is summed by term, and the pass's
peak is the largest sum. The sizes of what the pass makes (the capture's tensors,
each layer step's and the tail's temporaries) are traced by the caller
(`slcompile.inference.memory`) and handed in as `TracedPass`; the rest follows from
the schedule, the KV cache's segment rules (`slcompile.kv_segments`) and the
machine's facts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from slcompile.analysis.machine import MachineFacts
from slcompile.kv_segments import KV_STORES_IN_FLIGHT, merged_segments, reads_in_place
from slcompile.meta import format_tag
from slcompile.units import format_bytes

__all__ = [
    "GenerationSizes",
    "PassMemory",
    "TracedPass",
    "predict_pass_memory",
    "spills_hidden",
]


@dataclasses.dataclass(frozen=True)
class PassMemory:
    """The device memory of one forward pass of a generation, predicted.

    Attributes:
        phase: "prefill" or "decode".
        peak_bytes: the device's peak during the pass.
        resident_bytes: the parameters and buffers the device holds for the whole
            generation (all but the streamed layer weights): the part of the peak
            that exists before `generate` is called.
        moment: where the peak is: ``blk1.sb0`` (the layer step of one
            (layer, sub-batch)), ``take blk1.sb0`` (its cache's segments joined),
            ``store after blk1.sb0`` (the prefill's caches it completes, stored),
            ``tail`` (final norm and head) or ``tail sb0`` (those of one sub-batch,
            in a prefill whose hidden states rest on the KV cache's tier).
        terms: the peak's parts, by name (they add up to `peak_bytes`).
    """

    phase: str
    peak_bytes: int
    resident_bytes: int
    moment: str
    terms: Mapping[str, int]

    def __str__(self) -> str:
        """One line, e.g. ``prefill peak 1.50 MiB at blk1.sb0: parameters 1.00 MiB, ...``."""
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.terms.items() if n)
        return f"{self.phase} peak {format_bytes(self.peak_bytes)} at {self.moment}: {parts}"


@dataclasses.dataclass(frozen=True)
class GenerationSizes:
    """What the passes of one generation hold that no pass traces.

    Attributes:
        batch: the sequences generated.
        length: the prompt's positions.
        num_subbatches: the decode passes' sub-batches.
        prefill_subbatches: the prefill's parts.
        resident: the bytes of the parameters and buffers that are not streamed.
        layer_loads: per layer, the bytes of each weight its pass fetches from a
            tier that copies (empty where it fetches none).
        key_bytes: per layer, one position of one sequence's keys (as many again
            for its values).
        caps: per layer, the positions its cache keeps (None: all of them).
        vocab: the logits of one sequence.
        kv_tier: where the KV cache rests between passes.
        machine: which tiers copy, and how loads pad what they read.
        kv_stores_in_flight: likewise for the stores of the KV cache.
    """

    batch: int
    length: int
    num_subbatches: int
    prefill_subbatches: int
    resident: int
    layer_loads: tuple[tuple[int, ...], ...]
    key_bytes: tuple[int, ...]
    caps: tuple[int | None, ...]
    vocab: int
    kv_tier: str
    machine: MachineFacts
    kv_stores_in_flight: int = KV_STORES_IN_FLIGHT

    @property
    def layers(self) -> int:
        return len(self.key_bytes)

    @property
    def kv_moves(self) -> bool:
        """Whether the KV cache leaves the device between passes."""
        return self.machine.copies(self.kv_tier)

    def fetched(self, index: int) -> int:
        """The device bytes of layer `index`'s fetched weights, each padded as loads pad it."""
        return sum(self.machine.loaded_bytes(nbytes) for nbytes in self.layer_loads[index])

    def kept(self, index: int, positions: int) -> int:
        """The positions of `positions` that layer `index`'s cache keeps."""
        cap = self.caps[index]
        return positions if cap is None else min(positions, cap)

    def cache_bytes(self, index: int, sequences: int, positions: int) -> int:
        """The keys and values of `positions` positions of `sequences` sequences."""
        return 2 * sequences * positions * self.key_bytes[index]

    def in_place(self, index: int, sequences: int) -> bool:
        """Whether a (layer, sub-batch)'s segments are read into one buffer."""
        return reads_in_place(self.cache_bytes(index, sequences, 1), self.machine.load_granularity)

    def loaded_cache(self, index: int, sequences: int, segments: Sequence[int]) -> int:
        """A cache of `segments` (their positions) loaded: one tensor per segment, or
        one buffer for all where they are read in place."""
        if len(segments) > 1 and self.in_place(index, sequences):
            return self.machine.loaded_bytes(self.cache_bytes(index, sequences, sum(segments)))
        return sum(self.machine.loaded_bytes(self.cache_bytes(index, sequences, size)) for size in segments)


@dataclasses.dataclass(frozen=True)
class TracedPass:
    """The sizes of what one pass makes, traced on fake tensors.

    Attributes:
        captured: the bytes the capture makes for the rows it captures at once
            (held through the pass, as the layers' arguments hold them).
        other: those bytes but the hidden states'.
        hidden: the hidden states of those rows.
        steps: per layer, the peak of the values its layer step makes for one
            sub-batch (new cache included).
        tail: the peak of the tail's values (the forward again, the final norm and
            the logits).
        inputs: the inputs made for the whole batch and held through the pass, where
            the pass captures one sub-batch at a time (0 otherwise).
    """

    captured: int
    other: int
    hidden: int
    steps: tuple[int, ...]
    tail: int
    inputs: int = 0


def spills_hidden(schedule) -> bool:
    """Whether a generation pass keeps its hidden states between layers on a tier
    (its schedule has spills): it then captures, and computes the logits of, one
    sub-batch at a time."""
    return any(step.kind == "spill.issue" for step in schedule.steps)


def predict_pass_memory(schedule, sizes: GenerationSizes, traced: TracedPass, past: int,
                        segments: Sequence[Sequence[int]] = ()) -> PassMemory:
    """The device memory of the generation pass that follows `past` positions,
    walked in its `schedule` (the one `generate` walks).

    At every moment of a pass the device holds:

    - the parameters and buffers that are not streamed (`parameters`);
    - what the capture made for all sub-batches (embeddings, rotary tables, masks),
      until the last layer step, and each sub-batch's hidden states between layers
      (`hidden`); in a prefill that offloads them, what the computing sub-batch's
      capture made but its hidden states, its hidden states, the next one's loading
      and the sources of the stores in flight;
    - the streamed weights of the layer computing and of the layers after it
      whose `fetch.issue` came before its step (`weights`: with `live_blocks=2`,
      the next one), each tensor padded as loads pad it;
    - the KV cache (`kv`): on a tier that copies nothing, every cache (the caches
      already computed by this pass at their new length); on one that copies, the
      cache of the (layer, sub-batch) computing and the loaded segments of those
      whose `load_kv.issue` came before its step, and the stores still in flight
      (the positions they write), in the order of the `store_kv.issue` steps;
    - the temporaries of the compiled layer step (`step`, traced);
    - at the tail, the last layer's outputs, their concatenation, and the forward
      run again (`tail`); in a prefill that offloads hidden states, one
      sub-batch's, after its last layer step;
    - when the prefill stores its caches: a sub-batch's output and new cache, the
      stores in flight, and the rows copied out for the store (those of a decode
      sub-batch that several prefill sub-batches fill, from the first one on).

    Not counted: the growing sequences and masks (a few bytes a token), the
    sampling warpers' temporaries, and the transients of the capture itself.

    Args:
        schedule: the pass's schedule (`generation_pass`), of every sub-batch.
        sizes: what the generation holds (`GenerationSizes`).
        traced: what the pass makes (`TracedPass`), traced for its sub-batches.
        past: positions each sequence has before the pass (0 for the prefill).
        segments: per layer, the positions of each stored segment the decode pass
            loads (on a tier that copies).
    """
    batch, n, kv_moves = sizes.batch, sizes.layers, sizes.kv_moves
    phase = schedule.steps[0].phase
    parts = sizes.prefill_subbatches if phase == "prefill" else sizes.num_subbatches
    size, decode_size = batch // parts, batch // sizes.num_subbatches
    query = sizes.length if phase == "prefill" else 1
    offloads = spills_hidden(schedule)
    captured, other, steps, tail = traced.captured, traced.other, traced.steps, traced.tail
    part_hidden = traced.hidden if offloads else traced.hidden // parts

    # The stores' sources in the order they are issued (the last
    # `kv_stores_in_flight` (layer, sub-batch)s' are alive), how many precede each
    # layer step, and the caches loading while it runs.
    issued, before, loading = [], {}, {}
    pending: set[tuple[int, int]] = set()
    # An offloading prefill: at each layer step, the spills not yet waited for
    # (their sources alive) and the fills issued but not yet waited for.
    spilling: set[tuple[int, int]] = set()
    filling: set[tuple[int, int]] = set()
    spills_alive, fills_loading = {}, {}
    fetching: set[int] = set()  # layers whose weights' loads were issued
    weights_at: dict[tuple[int, int], int] = {}
    for step in schedule.steps:
        where = (step.block, step.subbatch)
        if step.kind in ("spill.issue", "fill.issue"):
            (spilling if step.kind == "spill.issue" else filling).add(where)
        elif step.kind in ("spill.wait", "fill.wait"):
            (spilling if step.kind == "spill.wait" else filling).discard(where)
        if step.kind == "store_kv.issue" and kv_moves:
            if phase == "decode":
                written = merged_segments(segments[step.block], 1, sizes.kept(step.block, past + 1))[1]
                issued.append(sizes.cache_bytes(step.block, size, written))
            else:
                issued.append(sizes.cache_bytes(step.block, decode_size, sizes.kept(step.block, sizes.length)))
        elif step.kind == "load_kv.issue":
            pending.add((step.block, step.subbatch))
        elif step.kind == "fetch.issue":
            fetching.add(step.block)
        elif step.kind == "compute" and step.region == "block":
            weights_at[where] = sum(sizes.fetched(block) for block in fetching if block >= step.block)
            before[where] = len(issued)
            pending.discard(where)
            loading[where] = tuple(pending)
            spills_alive[where], fills_loading[where] = len(spilling), len(filling)

    def in_flight(count: int) -> int:
        return sum(issued[max(0, count - sizes.kv_stores_in_flight):count])

    # An offloading prefill fills every sequence's logits from its first tail on,
    # and holds the inputs made for the whole batch.
    logits = batch * sizes.vocab * 4 if offloads else 0

    def hidden_held(index: int, part: int) -> int:
        """The hidden states an offloading prefill holds at a layer step: what the
        step's capture keeps but its hidden states, the step's input, the next
        step's input loading, and the sources of the stores in flight."""
        loaded = sizes.machine.loaded_bytes(part_hidden)  # a load pads what it reads
        where = (index, part)
        return (traced.inputs + other + (part_hidden if index == 0 else loaded)
                + fills_loading[where] * loaded + spills_alive[where] * part_hidden)

    # Every moment of the pass.
    held = 0 if kv_moves else sum(sizes.cache_bytes(i, batch, sizes.kept(i, past)) for i in range(n))
    growth = [sizes.cache_bytes(i, size, sizes.kept(i, past + query)) - sizes.cache_bytes(
        i, size, sizes.kept(i, past)) for i in range(n)]
    moments: list[tuple[str, dict[str, int]]] = []
    grown = 0
    for index in range(n):
        for part in range(parts):
            common = {"parameters": sizes.resident, "weights": weights_at[index, part],
                      "hidden": hidden_held(index, part) if offloads
                      else captured + (parts if index else part) * part_hidden}
            if not kv_moves:
                # Prefill parts smaller than a decode sub-batch wait as pieces: the same bytes.
                moments.append((format_tag("block", index, part), {**common, "kv": held + grown, "step": steps[index]}))
                grown += growth[index]
                continue
            stored = in_flight(before[index, part])
            if phase == "prefill":
                whole = sizes.cache_bytes(index, decode_size, sizes.kept(index, sizes.length))

                def filling(part: int) -> int:
                    # The rows of a decode sub-batch that earlier parts began to fill.
                    return whole if size < decode_size and (part * size) % decode_size else 0

                if offloads and index == n - 1 and part:
                    common["logits"] = logits
                moments.append((format_tag("block", index, part), {**common, "kv": stored + filling(part),
                                                         "step": steps[index]}))
                # Its stores: the step's output and new cache, the stores in
                # flight, and the rows of the decode sub-batch it fills (one per
                # store where it holds whole decode sub-batches, copied out).
                first, last = before[index, part], (before[index, part + 1] if part + 1 < parts
                                                    else len(issued))
                made = sizes.cache_bytes(index, size, sizes.kept(index, sizes.length))
                hidden = common["hidden"] + part_hidden
                if size < decode_size:
                    moments.append((f"store after {format_tag('block', index, part)}", {
                        **common, "hidden": hidden, "kv": in_flight(first) + made + whole}))
                else:
                    moments += [(f"store after {format_tag('block', index, part)}", {
                        **common, "hidden": hidden, "kv": in_flight(count) + made + issued[count]})
                        for count in range(first, last)]
                if offloads and index == n - 1:
                    # The sub-batch's tail, once its caches are stored: its last
                    # output instead of the step, and the forward again.
                    after = before[index, part + 1] if part + 1 < parts else len(issued)
                    moments.append((f"tail sb{part}", {
                        **common, "hidden": common["hidden"] + captured, "logits": logits,
                        "kv": in_flight(after) + filling(part + 1), "tail": tail}))
                continue
            ahead = sum(sizes.loaded_cache(block, size, segments[block]) for block, _ in loading[index, part])
            own = segments[index]
            if len(own) > 1 and not sizes.in_place(index, size):
                joined = sizes.machine.loaded_bytes(sizes.cache_bytes(index, size, sum(own)))
                moments.append((f"take {format_tag('block', index, part)}", {
                    **common, "kv": stored + ahead + sizes.loaded_cache(index, size, own) + joined}))
            else:
                joined = sizes.loaded_cache(index, size, own)
            moments.append((format_tag("block", index, part), {**common, "kv": stored + ahead + joined,
                                                     "step": steps[index]}))
    # The tail: every sub-batch's last output, their concatenation, and the
    # forward again, holding what it computes before the layers as the capture did
    # (the capture's own is gone after the last layer step).
    if not offloads:
        moments.append(("tail", {"parameters": sizes.resident, "hidden": captured + 2 * traced.hidden,
                                 "kv": 0 if kv_moves else held + grown, "tail": tail}))
    moment, terms = max(moments, key=lambda item: sum(item[1].values()))
    return PassMemory(phase, sum(terms.values()), sizes.resident, moment, terms)
