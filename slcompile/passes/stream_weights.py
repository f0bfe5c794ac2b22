"""Fetch each block's weights from their tier once per pass, shared by all sub-batches.

Runs after `interleave`, when the `weights` option names a tier that copies (nvme; on
a GPU machine also host). For every parameter that only one block reads, it inserts
`slc::fetch_weight(param, key)` before the block's first sub-batch and makes all K
sub-batches read the fetched tensor, so the block's weights are loaded once per
forward. The fetch is tagged for recomputation (`meta["recompute"]`, which AOTAutograd
carries to the joint graph), so the backward fetches again instead of keeping the
forward's copy alive: weight traffic per training step is 2·P whatever K is.
Parameters read by the prefix, the suffix or several blocks (tied embeddings) stay
resident, and so do trainable weights where the `trainable` option keeps them
(`resident_trainable`: by default those of a block that also holds frozen weights,
LoRA adapters over a frozen base). A frozen weight (no `requires_grad`) streams like
any other: the backward fetches it again only where the input gradients read it, and
it has no gradient to send anywhere. `weight_placement` names what streams and why
the rest stays, for the compile report and `explain`. `tag_fetch_views` finishes the
job on the joint graph: views of a fetched weight (`t` for a matmul) are recomputed
with it, else the partitioner would save the view and with it the whole weight.

When the schedule fetches per sub-batch (`Schedule.fetch_groups()`, the
grad_accumulation policy) each sub-batch gets its own fetch of the block's weights,
inserted before that sub-batch's first use and read by it alone, tagged with the
sub-batch: K fetches per block per pass, as gradient accumulation loads them; per run
of sub-batches, each run's sub-batches read one fetch, tagged with its first. Ops of
the block shared by all sub-batches run with sub-batch 0 and read its fetch. The
fetches' keys (`WeightKey`) differ by sub-batch (`...#sb1`): with equal keys,
Inductor's common-subexpression elimination merges the K fetches of a weight into one.

`place_prefetches` runs on the partitioned graphs (after `order_layer_major` and
`offload_saved`): it marks each fetch with the phase of its graph and puts
`slc::fetch_issue(key)` of every fetch `live_blocks - 1` block visits ahead of it, the
visits forming one cycle (forward, backward, the next step's forward): the end of the
forward issues the first fetches of the backward, the end of the backward those of the
next forward. The runtime pairs each issue with the fetch of the same key.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Mapping

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from slcompile.analysis.blocks import BlockGraph
from slcompile.analysis.inputs import GraphInput, parameter_name
from slcompile.meta import SlcMeta, get_slc_meta, set_slc_meta
from slcompile.units import format_bytes
from slcompile.vocabulary import (
    FETCH_ISSUE,
    FETCH_WEIGHT,
    WeightKey,
    fake_token,
    is_fetch,
    issued_visit,
    prefetch_ahead,
)

__all__ = ["StreamedWeights", "WeightPlacement", "PlacedPrefetches", "stream_weights", "resident_trainable",
           "weight_placement", "tag_fetch_views", "place_prefetches"]

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class StreamedWeights:
    """The result of `stream_weights`.

    Attributes:
        blocks: per block (forward order), the (placeholder name, stored key) of its
            streamed weights.
        resident: parameter placeholders that stay on the device, with the reason.
        streamed_bytes: bytes of all streamed weights (P).
        frozen_bytes: bytes of the streamed weights that need no gradient (part of P).
    """

    blocks: tuple[tuple[tuple[str, str], ...], ...]
    resident: tuple[tuple[str, str], ...]
    streamed_bytes: int
    frozen_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class WeightPlacement:
    """Where the parameters of a compiled graph rest and why (`weight_placement`):
    what `CompileReport.weights` holds and `slcompile.explain` prints.

    Attributes:
        tier: the tier the streamed weights rest on.
        streamed: per block, the names of its streamed parameters
            (`model.layers.0.mlp.up_proj.weight`).
        frozen: the names of the streamed parameters that need no gradient.
        resident: (parameter name, why it stays on the device) of the others.
        streamed_bytes: bytes of the streamed weights (P).
        frozen_bytes: bytes of the frozen ones among them.
    """

    tier: str
    streamed: tuple[tuple[str, ...], ...]
    frozen: frozenset[str]
    resident: tuple[tuple[str, str], ...]
    streamed_bytes: int
    frozen_bytes: int

    def lines(self) -> tuple[str, ...]:
        """One line for the streamed weights, then one per reason a weight stays,
        naming the first few."""
        count = sum(map(len, self.streamed))
        frozen = (f", {format_bytes(self.frozen_bytes)} of it frozen (no gradient)" if self.frozen_bytes
                  else "")
        lines = [f"weights: {count} streamed from {self.tier} in {len(self.streamed)} blocks "
                 f"(P = {format_bytes(self.streamed_bytes)}{frozen}); {len(self.resident)} on the device"]
        reasons: dict[str, list[str]] = defaultdict(list)
        for name, why in self.resident:
            reasons[why].append(name)
        for why, names in reasons.items():
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            lines.append(f"  {len(names)} {why}: {shown}")
        return tuple(lines)

    def __str__(self) -> str:
        return "\n".join(self.lines())


def weight_placement(streamed: StreamedWeights, inputs: tuple[GraphInput, ...], tier: str) -> WeightPlacement:
    """The `WeightPlacement` of a graph's streamed weights, named as the model names them.

    Args:
        streamed: what `stream_weights` streamed.
        inputs: the graph's classified placeholders.
        tier: the `weights` tier.
    """
    by_name = {i.name: i for i in inputs}

    def name(placeholder: str) -> str:
        graph_input = by_name.get(placeholder)
        return parameter_name(graph_input.source) if graph_input is not None and graph_input.source else placeholder

    frozen = frozenset(name(placeholder) for block in streamed.blocks for placeholder, _ in block
                       if not getattr(by_name[placeholder].value, "requires_grad", True))
    return WeightPlacement(
        tier=tier,
        streamed=tuple(tuple(name(placeholder) for placeholder, _ in block) for block in streamed.blocks),
        frozen=frozen,
        resident=tuple((name(placeholder), why) for placeholder, why in streamed.resident),
        streamed_bytes=streamed.streamed_bytes,
        frozen_bytes=streamed.frozen_bytes,
    )


def resident_trainable(trainable: str, block_values) -> dict[int, str]:
    """The trainable weights of one block that the `trainable` option keeps on the
    device (`SpeedLoaderConfig.trainable`), with the reason.

    Args:
        trainable: the option: "auto", "stream" or "device".
        block_values: the parameters only this block reads.

    Returns:
        id(parameter) -> why it stays, for each one kept.
    """
    values = list(block_values)
    if trainable == "stream":
        return {}
    if trainable == "device":
        why = "trainable (trainable='device')"
    elif any(not value.requires_grad for value in values):
        why = "trainable, in a block that also holds frozen weights (trainable='auto')"
    else:
        return {}  # every weight of the block trains: full training streams them all
    return {id(value): why for value in values if value.requires_grad}


def stream_weights(
    gm: torch.fx.GraphModule,
    blocks: BlockGraph,
    inputs: tuple[GraphInput, ...],
    key_for,
    graph_key_for,
    *,
    fetch_groups: Mapping[tuple[int, int], int | None] | None = None,
    trainable: str = "auto",
) -> tuple[torch.fx.GraphModule, StreamedWeights]:
    """Inserts the fetches into the interleaved graph `gm` (changed in place).

    Args:
        gm: the interleaved graph.
        blocks: the block graph.
        inputs: the classified placeholders (parameters carry their real values).
        key_for: `key_for(placeholder name, parameter) -> stored key`.
        graph_key_for: `graph_key_for(stored key) -> WeightKey` of the fetch op.
        fetch_groups: (block, sub-batch) -> the sub-batch naming the fetch it reads
            (`Schedule.fetch_groups()`); None, or None for a block: one fetch of
            each weight for all the block's sub-batches.
        trainable: which trainable weights of a block stay on the device
            (`resident_trainable`).

    Returns:
        (gm, what was streamed).
    """
    params = {i.name: i for i in inputs if i.kind == "param"}
    position = {block.index: pos for pos, block in enumerate(blocks.blocks)}
    per_block: dict[int, list[tuple[str, str]]] = defaultdict(list)
    resident = []
    streamed_bytes = frozen_bytes = 0
    order_of = _order_of(gm)
    candidates: list[tuple[torch.fx.Node, int]] = []
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or node.name not in params:
            continue
        readers = {_block_of(user) for user in node.users}
        if len(readers) != 1 or None in readers:
            where = "several blocks" if len(readers) > 1 else "the prefix or suffix"
            resident.append((node.name, f"read by {where}"))
            continue
        candidates.append((node, readers.pop()))
    of_block: dict[int, list[torch.Tensor]] = defaultdict(list)
    for node, block in candidates:
        of_block[block].append(params[node.name].value)
    kept = {}
    for values in of_block.values():
        kept.update(resident_trainable(trainable, values))
    for node, block in candidates:
        value = params[node.name].value
        if id(value) in kept:
            resident.append((node.name, kept[id(value)]))
            continue
        key = key_for(node.name, value)
        for subbatch, users in _user_groups(node, block, fetch_groups or {}, order_of):
            graph_key = dataclasses.replace(graph_key_for(key), subbatch=subbatch).format()
            with gm.graph.inserting_before(users[0]):
                fetch = gm.graph.call_function(FETCH_WEIGHT, (node, graph_key))
            for user in users:
                user.replace_input_with(node, fetch)
            set_slc_meta(fetch, SlcMeta(region="block", block=block, subbatch=subbatch, role="load"))
            fetch.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            fetch.meta["val"] = torch.empty_like(value, device="meta")
        per_block[position[block]].append((node.name, key))
        streamed_bytes += value.numel() * value.element_size()
        if not value.requires_grad:
            frozen_bytes += value.numel() * value.element_size()
    gm.graph.lint()
    gm.recompile()
    result = StreamedWeights(
        blocks=tuple(tuple(per_block[pos]) for pos in range(len(blocks.blocks))),
        resident=tuple(resident),
        streamed_bytes=streamed_bytes,
        frozen_bytes=frozen_bytes,
    )
    log.debug("streaming %d bytes of block weights; %d parameters stay resident", streamed_bytes, len(resident))
    return gm, result


def _user_groups(param: torch.fx.Node, block: int, fetch_groups, order_of) -> list[tuple[int | None, list]]:
    """(the sub-batch naming a fetch or None, the users that read it, first user first).
    Ops of the block shared by its sub-batches read sub-batch 0's."""
    users = sorted(param.users, key=order_of)
    if not any(group is not None for (b, _), group in fetch_groups.items() if b == block):
        return [(None, users)]
    groups: dict[int, list] = defaultdict(list)
    for user in users:
        meta = get_slc_meta(user)
        groups[fetch_groups.get((block, meta.subbatch if meta.subbatch is not None else 0))].append(user)
    return sorted(groups.items(), key=lambda group: order_of(group[1][0]))


def _block_of(node: torch.fx.Node) -> int | None:
    meta = get_slc_meta(node)
    return meta.block if meta is not None and meta.region == "block" else None


def _order_of(gm: torch.fx.GraphModule):
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    return index.__getitem__


def tag_fetch_views(graph: torch.fx.Graph) -> int:
    """On a joint graph: views of fetched weights are recomputed with the fetch.

    Returns:
        the number of nodes tagged.
    """
    tagged = 0
    frontier = [n for n in graph.nodes if is_fetch(n)]
    for node in frontier:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and getattr(user.target, "is_view", False):
                if user.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
                    user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    tagged += 1
                    frontier.append(user)
    return tagged


@dataclasses.dataclass(frozen=True)
class PlacedPrefetches:
    """The result of `place_prefetches`.

    Attributes:
        visits: the block visits, in cycle order: (phase, block, sub-batch or None).
        issues: `slc::fetch_issue` nodes inserted, per phase.
        ahead: how many visits ahead each load is issued (`live_blocks - 1`, at most
            the number of visits less one).
    """

    visits: tuple[tuple[str, int | None, int | None], ...] = ()
    issues: dict[str, int] = dataclasses.field(default_factory=dict)
    ahead: int = 0


def place_prefetches(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule | None, live_blocks: int
) -> PlacedPrefetches:
    """Marks each fetch with its phase and issues its load `live_blocks - 1` block
    visits earlier (the graphs change in place).

    A visit is one block's fetches (one (block, sub-batch)'s when fetches are per
    sub-batch), in the order the graphs first fetch them: forward, then backward, then
    around again. The issues of visit `v + ahead` go just before the first fetch of
    visit `v`; a visit's own issue may thus sit in the other graph (the end of the
    forward issues the first fetches of the backward) or, for the first `ahead`
    visits, in the previous step's backward.

    Args:
        forward: the forward (or inference) graph.
        backward: the backward graph, or None.
        live_blocks: blocks whose weights may be on the device at once.

    Returns:
        what was placed.
    """
    graphs = [("fwd", forward)] + ([("bwd", backward)] if backward is not None else [])
    visits: list[tuple[str, int | None, int | None]] = []
    fetches: dict[tuple[str, int | None, int | None], list[torch.fx.Node]] = {}
    for phase, gm in graphs:
        for node in gm.graph.nodes:
            if not is_fetch(node):
                continue
            key = dataclasses.replace(WeightKey.parse(node.args[1]), phase=phase)
            node.args = (node.args[0], key.format())
            meta = get_slc_meta(node)
            visit = (phase, meta.block if meta is not None else None, key.subbatch)
            if visit not in fetches:
                visits.append(visit)
                fetches[visit] = []
            fetches[visit].append(node)
    issues = {phase: 0 for phase, _ in graphs}
    for index, visit in enumerate(visits):
        issued = issued_visit(index, live_blocks, len(visits))
        if issued is None:
            break  # no prefetch
        target = visits[issued]
        first = fetches[visit][0]
        keys = list(dict.fromkeys(node.args[1] for node in fetches[target]))
        # Tagged as the visit they run in, so regions and pictures keep them there.
        where = SlcMeta(region="block", block=visit[1], subbatch=visit[2], role="load")
        with first.graph.inserting_before(first):
            for key in keys:
                issue = first.graph.call_function(FETCH_ISSUE, (key,))
                issue.meta["val"] = fake_token()
                set_slc_meta(issue, where)
        issues[visit[0]] += len(keys)
    for _, gm in graphs:
        gm.graph.lint()
        gm.recompile()
    return PlacedPrefetches(tuple(visits), issues, prefetch_ahead(live_blocks, len(visits)))
