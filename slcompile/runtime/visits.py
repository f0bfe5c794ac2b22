"""A weight streamer's block visits loaded packed: what `slc::fetch_weight_many`
returns where whole weights rest on a host tier that copies.

Where it sits: held by a `WeightStreamer` (`slcompile.runtime.weights`), which asks it
for a visit's weights when the visit's issues run (`slc::fetch_issue_many`) and
takes them at its fetch; it loads through the streamer's transfer engine.

Guarantees:
- A visit's weights come as `vocabulary.weight_layout` packs them, in packing order
  (`vocabulary.packing_order`): one tensor per dtype, allocated when the loads are
  issued, each weight loaded straight into its place as one transfer
  (`TransferEngine.load_packed`: one record, one copy per run of the block's host
  group, one event for the visit; `load_many` with `into` where a weight rests
  elsewhere).
- A visit is named by the set of its graph keys: the issues and the fetch of one
  visit name the same weights (`place_prefetches`), whatever their order.
- Nothing here locks: the streamer calls it under its own lock where its records change.
"""

from __future__ import annotations

import torch

from slcompile.vocabulary import WeightKey, WeightLayout, packing_order, weight_layout

from .storage.engine import TransferEngine, TransferHandle
from .storage.tiers import TransferKind

__all__ = ["PackedVisits", "Loading"]

Loading = tuple[list[torch.Tensor], list[TransferHandle]]
"""A visit's packed tensors, and the loads filling them."""


class PackedVisits:
    """The packed visits of one streamer.

    Args:
        engine: the streamer's transfer engine.
        shapes, dtypes: stored key -> the weight's shape, dtype (the streamer's records).
    """

    def __init__(self, engine: TransferEngine, shapes: dict, dtypes: dict):
        self.engine = engine
        self.shapes = shapes
        self.dtypes = dtypes
        self.loading: dict[frozenset[str], Loading] = {}  # a visit's graph keys -> its loads in flight
        self.orders: dict[frozenset[str], list[WeightKey]] = {}  # a visit's graph keys -> its keys, packing order
        self.plans: dict[tuple[WeightKey, ...], tuple[list[str], WeightLayout]] = {}  # see `_plan`

    def ordered(self, keys: list[WeightKey]) -> list[WeightKey]:
        """`keys` in packing order."""
        return [keys[i] for i in packing_order([(key.stored, self.dtypes[key.stored]) for key in keys])]

    def load(self, keys: list[WeightKey]) -> Loading:
        """Loads of `keys` (in packing order) into a visit's packed tensors, allocated now."""
        stored, layout = self._plan(keys)
        packed = [torch.empty(n, dtype=dtype, device=self.engine.device) for dtype, n in layout.sections]
        packed_load = self.engine.load_packed(stored, layout.places, packed, TransferKind.WEIGHT)
        if packed_load is not None:
            return packed, [packed_load]
        places = [packed[section][offset:offset + self.shapes[key].numel()].view(self.shapes[key])
                  for key, (section, offset) in zip(stored, layout.places)]
        return packed, self.engine.load_many(stored, TransferKind.WEIGHT, into=places)

    def _plan(self, keys: list[WeightKey]) -> tuple[list[str], WeightLayout]:
        """The stored keys and the packing of a visit (in packing order), worked out
        once: a step visits each block with the same keys."""
        plan = self.plans.get(tuple(keys))
        if plan is None:
            layout = weight_layout([(self.shapes[key.stored], self.dtypes[key.stored]) for key in keys])
            plan = self.plans[tuple(keys)] = ([key.stored for key in keys], layout)
        return plan

    def issue(self, keys: list[WeightKey], graph_keys: list[str]) -> None:
        """Starts loading a visit's weights, unless they are loading already."""
        visit = frozenset(graph_keys)
        if visit not in self.loading:
            order = self.orders.get(visit)
            if order is None:
                order = self.orders[visit] = self.ordered(keys)
            self.loading[visit] = self.load(order)

    def take(self, graph_keys: list[str]) -> Loading | None:
        """The loads of a visit issued before, now its fetch's; None if none was."""
        return self.loading.pop(frozenset(graph_keys), None)

    def wait(self, loading: Loading) -> list[torch.Tensor]:
        """A visit's packed tensors, once loaded (the compute stream waits once per
        copy event)."""
        packed, handles = loading
        self.engine.wait_many(handles)
        return packed

    def pack(self, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """Weights fetched another way (in packing order), packed by copies."""
        layout = weight_layout([(weight.shape, weight.dtype) for weight in weights])
        packed = [torch.empty(n, dtype=dtype, device=weights[0].device) for dtype, n in layout.sections]
        for weight, (section, offset) in zip(weights, layout.places):
            packed[section][offset:offset + weight.numel()].copy_(weight.reshape(-1))
        return packed

    def drop(self) -> int:
        """Waits for and drops the visits loading (their weights are about to change);
        returns the bytes they had loaded."""
        loading, self.loading = self.loading, {}
        for _, handles in loading.values():
            self.engine.wait_many(handles)
        return sum(handle.nbytes for _, handles in loading.values() for handle in handles)

    def reload(self, stored_key: str) -> int:
        """Loads again the visits loading `stored_key` (after new values were stored
        under it); returns how many were stale."""
        stale = [visit for visit in self.loading if any(WeightKey.parse(k).stored == stored_key for k in visit)]
        for visit in stale:
            self.engine.wait_many(self.loading.pop(visit)[1])
            self.loading[visit] = self.load(self.ordered([WeightKey.parse(k) for k in visit]))
        return len(stale)
