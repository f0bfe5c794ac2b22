"""Read the schedule back from compiled graphs: what the forward and backward really do.

Needs: AOTAutograd forward/backward (or inference) graphs after the passes that place
transfers (`stream_weights`, `place_prefetches`, `offload_activations`), whose nodes
carry slc tags (`slcompile.meta`). Guarantees: a pure function of the graphs; the text
of the result follows the format of `slcompile.schedules.base`, so it can be compared
line by line with the schedule the policy wrote.

- compute: every op that computes for one sub-batch (`vocabulary.is_compute`, tagged
  with a sub-batch); a line when the (region, block, sub-batch) changes. Work shared
  by the sub-batches, combining work and untagged ops write no line, but for a
  suffix run on the whole batch (`whole_suffix`), whose ops write one `suffix` line.
- fetches: `slc::fetch_issue` / `slc::fetch_weight` of a `WeightKey`: the block whose
  weights they move (the block the fetches of that stored key are tagged with), the
  key's sub-batch, and, for an issue, the phase its fetch runs in.
- activations: `slc::stash` / `slc::wait` carry the (block, sub-batch) they store
  (gradients: `slc::offload_grad` and its `slc::wait`, the block they belong to);
  `slc::unstash` / `slc::unstash_wait` load what the stash token handed to the
  backward names (`StashKey`), whatever (block, sub-batch) they are issued in; a
  stash key naming a tier (`a2@host|...`) writes it on the `stash.issue`.
- boundary activations: a stash whose key says `spill` (`spill_boundaries`) is a
  `spill.issue` (also a `stash.issue` when the forward hands its token to the
  backward: one store serves both), its `slc::wait` a `spill.wait`; loads in the
  forward are `fill.issue` / `fill.wait`.
"""

from __future__ import annotations

import torch.fx

from slcompile.analysis.order import runs_suffix_whole, unit_key
from slcompile.meta import get_slc_meta, parse_tag
from slcompile.schedules.base import Schedule, Step
from slcompile.vocabulary import StashKey, WeightKey, is_compute, is_fetch, is_stash, transfer_kind

__all__ = ["schedule_of"]


def schedule_of(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule | None = None, *,
                whole_suffix: bool | None = None) -> Schedule:
    """The schedule the compiled graphs run, forward then backward.

    Args:
        forward: the forward (or inference) graph.
        backward: the backward graph of a training step, or None.
        whole_suffix: the graphs run the suffix once on the whole batch
            (`ScheduleRequest.whole_suffix`): its ops, tagged with no sub-batch,
            write one `suffix` line. None: read from the forward, whose suffix ops
            then all have no sub-batch.

    Returns:
        the Schedule, with compute and transfer steps.
    """
    graphs = [("fwd", forward)] + ([("bwd", backward)] if backward is not None else [])
    if whole_suffix is None:
        whole_suffix = runs_suffix_whole(forward)
    block_of: dict[str, int | None] = {}
    stashed: dict[str, tuple[str, int | None, int | None]] = {}
    for _, gm in graphs:
        for node in gm.graph.nodes:
            kind = transfer_kind(node)
            if kind is None:
                continue
            meta = get_slc_meta(node)
            if is_fetch(node) and meta is not None:
                block_of[WeightKey.parse(node.args[1]).stored] = meta.block
            elif kind == ("stash", "issue"):
                name = StashKey.parse(node.args[1]).name
                stashed[node.name] = parse_tag(".".join(name.split(".")[:2]))
    steps: list[Step] = []
    for phase, gm in graphs:
        steps += _steps(phase, gm, block_of, stashed, whole_suffix)
    return Schedule(tuple(steps))


def _steps(phase: str, gm: torch.fx.GraphModule, block_of, stashed, whole_suffix: bool) -> list[Step]:
    steps: list[Step] = []
    computing = None
    token_of: dict[str, str] = {}  # unstash node -> the stash token it loads
    output = gm.graph.output_node()
    handed = {v for v in output.args[0] if hasattr(v, "name")} if output.args else set()
    for node in gm.graph.nodes:
        kind = transfer_kind(node)
        if kind is None:
            meta = get_slc_meta(node) if is_compute(node) else None
            if unit_key(meta, whole_suffix) is None:
                continue
            step = Step(phase, meta.region, meta.block, meta.subbatch)
            if step.key != computing:
                computing = step.key
                steps.append(step)
            continue
        what, half = kind
        text = f"{what}.{half}"
        lines: list[Step] = []
        if what == "fetch":
            key = WeightKey.parse(node.args[0] if half == "issue" else node.args[1])
            serves = key.phase if key.phase != phase else None
            step = Step(phase, "block", block_of.get(key.stored), key.subbatch, text, serves=serves)
        elif what == "unstash":
            token = node.args[0].name if half == "issue" else token_of[node.args[0].name]
            if half == "issue":
                token_of[node.name] = token
            region, block, subbatch = stashed[token]
            if phase == "fwd":
                text = f"fill.{half}"
            step = Step(phase, region, block, subbatch, text)
        else:  # stores: tagged with the (block, sub-batch) whose data they move
            meta = get_slc_meta(node)
            if meta is None:
                continue
            store = node if half == "issue" else node.args[0]
            # A stash's key names the tier its unit's schedule step named, if any.
            tier = StashKey.parse(store.args[1]).tier if text == "stash.issue" and is_stash(store) else None
            step = Step(phase, meta.region, meta.block, meta.subbatch, text, tier=tier)
            if what == "stash" and is_stash(store) and StashKey.parse(store.args[1]).spills:
                if half == "issue" and node in handed:
                    lines.append(step)
                step = Step(phase, meta.region, meta.block, meta.subbatch, f"spill.{half}")
        for step in (*lines, step):
            if not steps or steps[-1] != step:
                steps.append(step)
    return steps

