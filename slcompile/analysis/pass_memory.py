"""The memory model of a generation pass: the device's peak of one prefill or
decode pass, walked in its lowered graph (`predict_pass_memory`).
`explain_generation`, `tune_generation` and `generate`'s records state a pass's
predicted memory from here; a training step's is `slcompile.analysis.memory`'s.

A generation pass runs compiled layer steps in turn from one FX graph
(`slcompile.inference.pass_graph.lower_pass`), whose nodes carry what they do: the
`slc::` ops of a weight fetch or a spilled state (by name in their `SlcMeta` role:
their targets are the ops' implementations), the KV store's `issue`/`store`
methods with their layer and sub-batch, each layer step with its own, and the
tails. The graph is read here, never run: at every layer step of every sub-batch
(and at each tail), what the device holds is summed by term, and the pass's peak
is the largest sum; a value the step no longer holds is one whose last use (its
FX users) came before it. The sizes of what the pass makes (the capture's tensors,
each layer step's and the tail's temporaries) are traced by the caller
(`slcompile.inference.memory`) and handed in as `TracedPass`; the rest follows from
the graph, the KV cache's segment rules (`slcompile.kv_segments`) and the
machine's facts. `pass_nodes` and `pass_role` read a pass graph's nodes for the
time model too (`slcompile.inference.explain`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from slcompile.analysis.machine import MachineFacts
from slcompile.kv_segments import KV_STORES_IN_FLIGHT, merged_segments, reads_in_place
from slcompile.meta import format_tag, get_slc_meta
from slcompile.units import format_bytes

__all__ = [
    "GenerationSizes",
    "PassMemory",
    "TracedPass",
    "pass_nodes",
    "pass_phase",
    "pass_role",
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


def pass_nodes(graph) -> list:
    """The nodes of a lowered generation pass (`slcompile.inference.pass_graph`: a
    `PassGraph` or its `torch.fx.Graph`) in graph order."""
    return list(getattr(graph, "graph", graph).nodes)


def pass_role(node) -> tuple[str, int | None, int | None] | None:
    """What a node of a pass graph does, read from the node: ("step", block,
    sub-batch) for a layer step, ("prefix", None, None) for the capture,
    ("suffix", None, sub-batch or None) for the tail of a sub-batch or of every
    one, (the `slc::` op's name, block, sub-batch) for a weight fetch or a spill or
    fill of hidden states, ("issue" or "store", block, sub-batch) for a load or a
    store of the KV cache (the store's methods, with their block and sub-batch as
    arguments); None for the rest."""
    if node.op == "call_method" and node.target in ("issue", "store"):
        return node.target, node.args[1], node.args[2]
    place = get_slc_meta(node) if node.op == "call_function" else None
    if place is None:
        return None
    if place.region == "block" and place.role == "compute":
        return "step", node.args[2], node.args[3]  # layer_step(run, phase, block, subbatch, ...)
    if place.region == "block":
        return place.role, place.block, place.subbatch
    return place.region, None, place.subbatch


def pass_phase(graph) -> str:
    """A pass graph's phase ("prefill" or "decode"), as its layer steps name it."""
    return next(node.args[1] for node in pass_nodes(graph) if (pass_role(node) or ("",))[0] == "step")


def _last_use(node, order: Mapping) -> int:
    """Where a value is last used in its graph (FX's generated code frees it after)."""
    return max((order[user] for user in node.users), default=order[node])


def spills_hidden(graph) -> bool:
    """Whether a generation pass keeps its hidden states between layers on a tier
    (its graph spills them, `slc::stash`): it then captures, and computes the logits
    of, one sub-batch at a time."""
    return any((pass_role(node) or ("",))[0] == "stash" for node in pass_nodes(graph))


def predict_pass_memory(graph, sizes: GenerationSizes, traced: TracedPass, past: int,
                        segments: Sequence[Sequence[int]] = ()) -> PassMemory:
    """The device memory of the generation pass that follows `past` positions,
    walked in its lowered graph (the one `generate` runs), node by node in order.

    At every moment of a pass the device holds:

    - the parameters and buffers that are not streamed (`parameters`);
    - what the capture made for all sub-batches (embeddings, rotary tables, masks),
      until the last layer step, and each sub-batch's hidden states between layers
      (`hidden`); in a prefill that offloads them, what the computing sub-batch's
      capture made but its hidden states, its hidden states, the next one's loading
      (an `slc::unstash` whose token is not yet waited for) and the sources of the
      stores in flight (an `slc::stash` whose source is still used after the step);
    - the streamed weights of the layer computing and of the layers after it
      whose `slc::fetch_issue` came before its step (`weights`: with
      `live_blocks=2`, the next one), each tensor padded as loads pad it, until
      the last use of the layer's weights;
    - the KV cache (`kv`): on a tier that copies nothing, every cache (the caches
      already computed by this pass at their new length); on one that copies, the
      cache of the (layer, sub-batch) computing and the loaded segments of those
      whose load (`kv.issue`) came before its step, and the stores still in flight
      (the positions they write), in the order of the `new_cache.store` nodes;
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
        graph: the pass's `PassGraph` (`lower_pass`) or its `torch.fx.Graph`, of
            every sub-batch.
        sizes: what the generation holds (`GenerationSizes`).
        traced: what the pass makes (`TracedPass`), traced for its sub-batches.
        past: positions each sequence has before the pass (0 for the prefill).
        segments: per layer, the positions of each stored segment the decode pass
            loads (on a tier that copies).
    """
    batch, n, kv_moves = sizes.batch, sizes.layers, sizes.kv_moves
    nodes = pass_nodes(graph)
    order = {node: position for position, node in enumerate(nodes)}
    roles = {node: role for node in nodes if (role := pass_role(node)) is not None}
    layer_steps = [node for node, role in roles.items() if role[0] == "step"]
    phase = pass_phase(graph)
    parts = sizes.prefill_subbatches if phase == "prefill" else sizes.num_subbatches
    size, decode_size = batch // parts, batch // sizes.num_subbatches
    query = sizes.length if phase == "prefill" else 1
    offloads = spills_hidden(graph)
    captured, other, steps, tail = traced.captured, traced.other, traced.steps, traced.tail
    part_hidden = traced.hidden if offloads else traced.hidden // parts
    # A layer's weights are freed after their last use (its last layer step).
    weights_of = {node.args[2]: node.args[4] for node in layer_steps}

    # The stores' sources in the order they are issued (the last
    # `kv_stores_in_flight` (layer, sub-batch)s' are alive), how many precede each
    # layer step, and the caches loading while it runs.
    issued, before, loading = [], {}, {}
    pending: set[tuple[int, int]] = set()
    # An offloading prefill: at each layer step, the spills whose sources are still
    # used after it (not yet waited for) and the fills not yet waited for.
    spilled, filled = [], []
    spills_alive, fills_loading = {}, {}
    fetching: set[int] = set()  # layers whose weights' loads were issued
    weights_at: dict[tuple[int, int], int] = {}
    for node, (kind, block, subbatch) in roles.items():
        at = order[node]
        if kind == "store" and kv_moves:
            if phase == "decode":
                written = merged_segments(segments[block], 1, sizes.kept(block, past + 1))[1]
                issued.append(sizes.cache_bytes(block, size, written))
            else:
                issued.append(sizes.cache_bytes(block, decode_size, sizes.kept(block, sizes.length)))
        elif kind == "issue":
            pending.add((block, subbatch))
        elif kind == "fetch_issue":
            fetching.add(block)
        elif kind == "stash":
            spilled.append(node.args[0])
        elif kind == "unstash":
            filled.append(node)
        elif kind == "step":
            where = (block, subbatch)
            weights_at[where] = sum(sizes.fetched(layer) for layer in fetching
                                    if layer not in weights_of or _last_use(weights_of[layer], order) >= at)
            before[where] = len(issued)
            pending.discard(where)
            loading[where] = tuple(pending)
            spills_alive[where] = sum(_last_use(source, order) > at for source in spilled)
            fills_loading[where] = sum(_last_use(token, order) > at for token in filled)

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

    def held_at(index: int, part: int) -> dict[str, int]:
        return {"parameters": sizes.resident, "weights": weights_at[index, part],
                "hidden": hidden_held(index, part) if offloads
                else captured + (parts if index else part) * part_hidden}

    def stored_after(index: int, part: int) -> int:
        """The stores issued before the next sub-batch's step of the layer (all of
        the pass's after its last sub-batch)."""
        return before[index, part + 1] if part + 1 < parts else len(issued)

    def rows_filling(index: int, part: int) -> int:
        """The rows of a decode sub-batch that earlier prefill parts began to fill."""
        whole = sizes.cache_bytes(index, decode_size, sizes.kept(index, sizes.length))
        return whole if size < decode_size and (part * size) % decode_size else 0

    # Every moment of the pass, in graph order.
    held = 0 if kv_moves else sum(sizes.cache_bytes(i, batch, sizes.kept(i, past)) for i in range(n))
    growth = [sizes.cache_bytes(i, size, sizes.kept(i, past + query)) - sizes.cache_bytes(
        i, size, sizes.kept(i, past)) for i in range(n)]
    moments: list[tuple[str, dict[str, int]]] = []
    grown = 0
    for node, (kind, index, part) in roles.items():
        if kind == "suffix" and part is not None and offloads and kv_moves and phase == "prefill":
            # The sub-batch's tail, once its caches are stored: its last output
            # instead of the step, and the forward again.
            common = held_at(n - 1, part)
            moments.append((f"tail sb{part}", {
                **common, "hidden": common["hidden"] + captured, "logits": logits,
                "kv": in_flight(stored_after(n - 1, part)) + rows_filling(n - 1, part + 1), "tail": tail}))
        elif kind == "suffix" and part is None:
            # Every sub-batch's last output, their concatenation, and the forward
            # again, holding what it computes before the layers as the capture did
            # (the capture's own is gone after the last layer step).
            moments.append(("tail", {"parameters": sizes.resident, "hidden": captured + 2 * traced.hidden,
                                     "kv": 0 if kv_moves else held + grown, "tail": tail}))
        if kind != "step":
            continue
        common = held_at(index, part)
        if not kv_moves:
            # Prefill parts smaller than a decode sub-batch wait as pieces: the same bytes.
            moments.append((format_tag("block", index, part), {**common, "kv": held + grown, "step": steps[index]}))
            grown += growth[index]
            continue
        stored = in_flight(before[index, part])
        if phase == "prefill":
            whole = sizes.cache_bytes(index, decode_size, sizes.kept(index, sizes.length))
            if offloads and index == n - 1 and part:
                common["logits"] = logits
            moments.append((format_tag("block", index, part), {**common, "kv": stored + rows_filling(index, part),
                                                               "step": steps[index]}))
            # Its stores: the step's output and new cache, the stores in flight,
            # and the rows of the decode sub-batch it fills (one per store where it
            # holds whole decode sub-batches, copied out).
            first, last = before[index, part], stored_after(index, part)
            made = sizes.cache_bytes(index, size, sizes.kept(index, sizes.length))
            hidden = common["hidden"] + part_hidden
            if size < decode_size:
                moments.append((f"store after {format_tag('block', index, part)}", {
                    **common, "hidden": hidden, "kv": in_flight(first) + made + whole}))
            else:
                moments += [(f"store after {format_tag('block', index, part)}", {
                    **common, "hidden": hidden, "kv": in_flight(count) + made + issued[count]})
                    for count in range(first, last)]
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
    moment, terms = max(moments, key=lambda item: sum(item[1].values()))
    return PassMemory(phase, sum(terms.values()), sizes.resident, moment, terms)
