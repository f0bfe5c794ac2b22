"""The one namespaced node annotation of slcompile, behind accessors.

`set_slc_meta(node, SlcMeta(...))` stores under `node.meta["slc"]`. A compact tag is
mirrored into `node.meta["custom"]["slc"]` because AOTAutograd copies `meta["custom"]`
from forward nodes to the backward nodes it derives from them; that is how the
partitioned forward and backward graphs keep the block and sub-batch of each op.
"""

from __future__ import annotations

import dataclasses
import re

import torch.fx

__all__ = ["SlcMeta", "set_slc_meta", "get_slc_meta", "format_tag", "parse_tag", "module_path"]

_KEY = "slc"
_TAG = re.compile(r"^(prefix|suffix|blk(\d+))(?:\.sb(\d+))?$")
# The Dynamo source of the compiled module that starts an `nn_module_stack` path:
# `L['self']`, or `L['args'][0]` when the module's forward is wrapped by a decorator
# taking `*args` (transformers' `deprecate_kwarg`).
_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\](?:\[\d+\])*\.?")


@dataclasses.dataclass(frozen=True)
class SlcMeta:
    """Where a node sits in the layer-major schedule.

    Attributes:
        region: "prefix", "block" or "suffix".
        block: the block index when region is "block", else None.
        subbatch: the sub-batch this node computes, or None for a node shared by all
            sub-batches (batch-free values, reductions that combine sub-batches).
        role: what the node is for: "compute" (copied from the model), "split" (takes
            a sub-batch out of a full-batch value), "combine" (joins sub-batches); in
            a generation pass's graph, a transfer's `slc::` op by name
            ("fetch_issue", "stash", ...: the node's target is the op's
            implementation) or "transfer" (a method of the KV cache's store).
    """

    region: str
    block: int | None = None
    subbatch: int | None = None
    role: str = "compute"

    @property
    def tag(self) -> str:
        return format_tag(self.region, self.block, self.subbatch)


def format_tag(region: str, block: int | None, subbatch: int | None) -> str:
    """`blk3.sb1`, `prefix.sb0`, `suffix` (no sub-batch: shared)."""
    head = f"blk{block}" if region == "block" else region
    return head if subbatch is None else f"{head}.sb{subbatch}"


def parse_tag(tag: str) -> tuple[str, int | None, int | None]:
    """Inverse of `format_tag`: (region, block, subbatch)."""
    match = _TAG.match(tag)
    if match is None:
        raise ValueError(f"not an slc tag: {tag!r}")
    region = "block" if match.group(2) is not None else match.group(1)
    block = int(match.group(2)) if match.group(2) is not None else None
    subbatch = int(match.group(3)) if match.group(3) is not None else None
    return region, block, subbatch


def module_path(dynamo_path: str) -> str:
    """The module path as the user names it: `L['self'].model.layers.3` and
    `L['args'][0].model.layers.3` -> `model.layers.3`; the root itself -> ``."""
    return _DYNAMO_ROOT.sub("", dynamo_path, count=1)


def set_slc_meta(node: torch.fx.Node, meta: SlcMeta) -> None:
    node.meta[_KEY] = meta
    custom = dict(node.meta.get("custom") or {})
    custom[_KEY] = meta.tag
    node.meta["custom"] = custom


def get_slc_meta(node: torch.fx.Node) -> SlcMeta | None:
    """The node's annotation; on AOTAutograd graphs, rebuilt from the mirrored tag."""
    meta = node.meta.get(_KEY)
    if meta is not None:
        return meta
    tag = (node.meta.get("custom") or {}).get(_KEY)
    if tag is None:
        return None
    region, block, subbatch = parse_tag(tag)
    return SlcMeta(region=region, block=block, subbatch=subbatch)
