"""Generation's passes as schedules: the prefill and each decode pass of
`slcompile.generate`, layer-major over sub-batches.

`generation_pass(request)` writes one pass's `Schedule` from a `PassRequest` (plain
data: the layers, the sub-batches, what the tiers copy). `generate` lowers that
schedule to a pass graph (`slcompile.inference.pass_graph`) and runs it, and
`explain_generation` writes the same schedules from the same requests, lowers them
the same way and predicts their memory and time from those graphs, so what is
explained is what runs.

The steps are training's (`slcompile.schedules.base`), with phase "prefill" or
"decode":

    prefill prefix               the inputs of every layer, captured for all sub-batches
    prefill fetch.issue blk1     start loading layer 1's weights
    prefill fetch.wait blk1      layer 1's weights are needed now
    decode load_kv.issue blk1.sb0  start loading the cache of (layer 1, sub-batch 0)
    decode blk1.sb0              layer 1 for sub-batch 0 (it waits for its cache and its
                                 input itself)
    decode store_kv.issue blk1.sb0  store the new cache of (1, 0) (in the prefill, the
                                 sub-batch is the decode sub-batch that owns the rows)
    prefill spill.issue blk1.sb2   store layer 1's output for sub-batch 2 until layer 2
    prefill spill.wait blk1.sb2    that store is done (the output's memory may go)
    prefill fill.issue blk1.sb2    start loading it back
    prefill fill.wait blk1.sb2     it is needed now (by layer 2, sub-batch 2)
    prefill suffix               the last position's logits of every sub-batch (with
                                 spilled hidden states: `suffix.sb2`, one per sub-batch)

A transfer step is written only where its tier copies (`fetched`, `kv_moves`,
`spill_hidden`); a cache kept on the device is still "stored" (`store_kv.issue`:
the pass's new positions join it) wherever a later pass reads it. A spilled output
stays alive until its `spill.wait`, `HIDDEN_STORES_IN_FLIGHT` spills later or just
after its `fill.wait` (loaded back, it is stored), whichever comes first; the
pass's end waits for every KV store issued.
"""

from __future__ import annotations

import dataclasses

from slcompile.schedules.base import Schedule, Step

__all__ = ["PassRequest", "generation_pass", "KV_AHEAD", "HIDDEN_STORES_IN_FLIGHT", "offloads_hidden"]

KV_AHEAD = 2
"""Decode: the caches of the next `KV_AHEAD` (layer, sub-batch) steps load while one runs."""

HIDDEN_STORES_IN_FLIGHT = 2
"""An offloading prefill: the spills whose stores are not yet waited for (their
sources alive) when the next is issued."""


def offloads_hidden(kv_moves: bool, parts: int, layers: int) -> bool:
    """Whether a prefill of `parts` sub-batches keeps its hidden states between
    layers on the KV cache's tier: where that tier copies, and with at least 3
    sub-batches (with 2, one computes while the other's is loaded: nothing is saved)."""
    return kv_moves and parts >= 3 and layers >= 2


@dataclasses.dataclass(frozen=True)
class PassRequest:
    """What one generation pass is asked to do.

    Attributes:
        phase: "prefill" or "decode".
        subbatches: the sub-batches computed, in order (a decode pass skips the
            finished ones; the prefill's are its parts 0..K-1).
        fetched: per layer, whether its weights are copied onto the device (they rest
            on a tier that copies).
        kv_moves: whether the cache rests on a tier that copies.
        stores: whether the pass keeps its cache (every pass but the last).
        rows: the prefill: rows per prefill sub-batch and per decode sub-batch, so the
            cache of a decode sub-batch is stored after the prefill part holding its
            last row. Unused by decode passes.
        spill_hidden: the prefill keeps its hidden states between layers on the
            cache's tier (`offloads_hidden`).
        live_blocks: the layers whose fetched weights are on the device at once:
            the one computing and the next `live_blocks - 1`, loading
            (`SpeedLoaderConfig.live_blocks`).
    """

    phase: str
    subbatches: tuple[int, ...]
    fetched: tuple[bool, ...]
    kv_moves: bool
    stores: bool
    rows: tuple[int, int] = (1, 1)
    spill_hidden: bool = False
    live_blocks: int = 2

    @property
    def layers(self) -> int:
        return len(self.fetched)


def generation_pass(request: PassRequest) -> Schedule:
    """The schedule of one pass: each layer's weights fetched once for every
    sub-batch (issued `live_blocks - 1` layers ahead: with 2, the next layer's
    before the layer runs), each (layer,
    sub-batch) computed in layer-major order, its cache stored just after it, and
    in a decode pass each step's cache loaded `KV_AHEAD` steps ahead. A prefill
    that spills its hidden states stores each layer's output after the step, loads
    it back while the step before its next one runs, and waits for it just before
    that step."""
    phase, n, parts = request.phase, request.layers, request.subbatches
    steps: list[Step] = []
    storing: list[tuple[int, int]] = []  # the spills not yet waited for, oldest first

    def add(kind: str, block: int | None, subbatch: int | None = None, region: str = "block") -> None:
        steps.append(Step(phase, region, block, subbatch, kind))

    def fetch_issue(block: int) -> None:
        if block < n and request.fetched[block]:
            add("fetch.issue", block)

    lead = request.live_blocks - 1
    if not request.spill_hidden:
        add("compute", None, region="prefix")
    for block in range(max(lead, 1)):
        fetch_issue(block)
    if phase == "decode" and request.kv_moves:
        add("load_kv.issue", 0, parts[0])
    for block in range(n):
        if block and not lead:
            fetch_issue(block)
        if request.fetched[block]:
            add("fetch.wait", block)
        if lead:
            fetch_issue(block + lead)
        for position, subbatch in enumerate(parts):
            at = block * len(parts) + position
            if request.spill_hidden:
                later, after = divmod(at + 1, len(parts))
                if 1 <= later < n:
                    add("fill.issue", later - 1, parts[after])
            if phase == "decode" and request.kv_moves:
                first = at + KV_AHEAD if at else 1  # those not issued before
                for ahead in range(first, min(at + 1 + KV_AHEAD, n * len(parts))):
                    add("load_kv.issue", ahead // len(parts), parts[ahead % len(parts)])
            if request.spill_hidden and block:
                add("fill.wait", block - 1, subbatch)
                if (block - 1, subbatch) in storing:  # loaded back: its store is done
                    storing.remove((block - 1, subbatch))
                    add("spill.wait", block - 1, subbatch)
            add("compute", block, subbatch)
            if request.stores:
                for owner in _owners(request, position, subbatch):
                    add("store_kv.issue", block, owner)
            if request.spill_hidden:
                if block < n - 1:
                    add("spill.issue", block, subbatch)
                    storing.append((block, subbatch))
                    if len(storing) > HIDDEN_STORES_IN_FLIGHT:
                        add("spill.wait", *storing.pop(0))
                else:
                    add("compute", None, subbatch, region="suffix")
    if not request.spill_hidden:
        add("compute", None, region="suffix")
    return Schedule(tuple(steps))


def _owners(request: PassRequest, position: int, subbatch: int) -> list[int]:
    """The decode sub-batches whose cache is complete once this step has run: the
    step's own in a decode pass; in the prefill, those whose last row is in the part."""
    if request.phase == "decode":
        return [subbatch]
    part, owner = request.rows
    total = part * len(request.subbatches)
    return [d for d in range(total // owner) if position * part < (d + 1) * owner <= (position + 1) * part]
