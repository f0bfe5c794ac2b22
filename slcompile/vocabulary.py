"""The `slc::` op vocabulary: op schemas, fake implementations, node predicates and keys.

Where it sits: passes emit these ops, analyses and pictures recognise them, and the
runtime (`slcompile.runtime`) registers what they do when a compiled graph runs
(`torch.library.impl(..., "CompositeExplicitAutograd")`). Importing this module
defines every op with its fake implementation, so graphs can be built, traced,
partitioned and analysed without the runtime; running one needs the runtime imported.

The ops (issue + wait pairs, so a schedule can move the two apart):

    slc::fetch_issue(str key) -> Tensor                   # issue a weight load
    slc::fetch_weight(Tensor param, str key) -> Tensor    # the weight (waits for it)
    slc::stash(Tensor x, str key) -> Tensor               # issue an activation store
    slc::wait(Tensor token, Tensor[] keepalive) -> Tensor # the store is done
    slc::unstash(Tensor stash_token) -> Tensor            # issue its load
    slc::unstash_wait(Tensor load_token, SymInt[] size, ScalarType dtype,
                      Device device) -> Tensor            # the activation
    slc::mark(str label, bool begin) -> ()                # a compute region boundary
    slc::offload_grad(Tensor grad, str key) -> Tensor     # issue a weight gradient's store

Consecutive transfer calls of one kind go to the runtime as one call each
(`passes/coalesce_transfers.py`, the last rewrite before Inductor; no analysis reads
them), with the arguments of each member in order:

    slc::fetch_issue_many(str[] keys) -> Tensor
    slc::fetch_weight_many(Tensor[] params, str[] keys) -> Tensor[]  # a visit's weights,
                                                      # packed: one tensor per dtype
    slc::stash_many(Tensor[] xs, str[] keys) -> Tensor[]  # their stash tokens
    slc::wait_many(Tensor[] tokens, Tensor[] keepalive) -> Tensor
    slc::unstash_many(Tensor[] stash_tokens) -> Tensor[]  # their load tokens
    slc::unstash_wait_many(Tensor[] load_tokens, SymInt[] sizes, int[] ranks,
                           str[] dtypes, Device device) -> Tensor[]

(`unstash_wait_many` names its dtypes, "float32": torch 2.11 hands a `ScalarType[]` to
a Python kernel as integers.)

`fetch_weight_many` returns a block visit's weights packed (`weight_layout`): one flat
tensor per dtype, in the order the dtypes first appear among its members, each member
at the next 16-byte boundary of its dtype's tensor, in the members' order; the graph
reads each weight as a slice of it (`coalesce_transfers` writes the views). A custom
op's outputs must not alias one another, so the members cannot be returned as views
of one buffer; packed, a visit is one allocation and one copy per dtype.

`fetch_weight` is a pure function of its key (the compiler may re-run it; AOTAutograd
recomputes it in the backward) and its gradient flows to `param` unchanged. Every other
op is an ORDERED effect: AOTAutograd threads effect tokens through it, Inductor keeps it
as an extern call in program order, never removes it and never merges two of them.
Tokens are 0-dim int64 CPU tensors naming a transfer (`fetch_issue` returns a
dependency token, value 0, which nothing needs to read: an op without a tensor output
lets Inductor fuse kernels across it and free a graph input too early, as `mark` does).
Nothing aliases its input, so the ops pass functionalization.

Weight loads are issued ahead by one rule, which the policies' schedules, the
prefetch pass and the memory model share: the block visits (each block's fetches in
a graph, or each (block, sub-batch)'s) form one cycle, forward, backward, the next
step's forward; while a visit runs, the loads of the `live_blocks - 1` visits after
it are in flight, and the visit issues the last of them (`issued_visit`,
`prefetched_visits`).

A compute region is labelled `"blk3.sb1 fwd"` (its tag and phase) in `slc::mark` and
on the runtime's timeline: `region_label` writes it, `parse_region_label` reads it.

Keys are strings in the graph (they appear verbatim in generated code) with one format
and one parser each: `WeightKey` (`w3|w0:layers_0_fc_weight#sb1@bwd`), `StashKey`
(`a2|blk3.sb1.mul_4`, `a2@host|blk3.sb1.mul_4`) and `GradientKey` (`g1|w0:layers_0_fc_weight`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from types import MappingProxyType

import torch
import torch.fx
from torch._library.effects import EffectType

__all__ = [
    "stash_key_of",
    "FETCH_ISSUE",
    "FETCH_WEIGHT",
    "STASH",
    "SPILL_MARK",
    "WAIT",
    "UNSTASH",
    "UNSTASH_WAIT",
    "MARK",
    "OFFLOAD_GRAD",
    "STASH_MANY",
    "WAIT_MANY",
    "UNSTASH_MANY",
    "UNSTASH_WAIT_MANY",
    "FETCH_ISSUE_MANY",
    "FETCH_WEIGHT_MANY",
    "WeightLayout",
    "WEIGHT_ALIGNMENT",
    "weight_layout",
    "packing_order",
    "SLC_OPS",
    "COALESCED",
    "split_sizes",
    "dtype_name",
    "dtype_of",
    "WeightKey",
    "StashKey",
    "GradientKey",
    "fake_token",
    "is_slc_op",
    "is_fetch",
    "is_fetch_issue",
    "is_stash",
    "is_stash_wait",
    "is_unstash",
    "is_unstash_wait",
    "is_load",
    "is_store",
    "is_wait",
    "is_issue",
    "is_mark",
    "is_gradient_store",
    "is_bookkeeping",
    "is_compute",
    "transfer_kind",
    "region_label",
    "parse_region_label",
    "prefetch_ahead",
    "issued_visit",
    "prefetched_visits",
]

_LIB = torch.library.Library("slc", "DEF")

_SCHEMAS = MappingProxyType({
    "fetch_issue": "(str key) -> Tensor",
    "fetch_weight": "(Tensor param, str key) -> Tensor",
    "stash": "(Tensor x, str key) -> Tensor",
    "wait": "(Tensor token, Tensor[] keepalive) -> Tensor",
    "unstash": "(Tensor stash_token) -> Tensor",
    "unstash_wait": "(Tensor load_token, SymInt[] size, ScalarType dtype, Device device) -> Tensor",
    "mark": "(str label, bool begin) -> Tensor",
    "offload_grad": "(Tensor grad, str key) -> Tensor",
    "stash_many": "(Tensor[] xs, str[] keys) -> Tensor[]",
    "wait_many": "(Tensor[] tokens, Tensor[] keepalive) -> Tensor",
    "unstash_many": "(Tensor[] stash_tokens) -> Tensor[]",
    "unstash_wait_many": "(Tensor[] load_tokens, SymInt[] sizes, int[] ranks, str[] dtypes, "
                         "Device device) -> Tensor[]",
    "fetch_issue_many": "(str[] keys) -> Tensor",
    "fetch_weight_many": "(Tensor[] params, str[] keys) -> Tensor[]",
})
_ORDERED = ("fetch_issue", "stash", "wait", "unstash", "unstash_wait", "mark", "offload_grad",
            "stash_many", "wait_many", "unstash_many", "unstash_wait_many", "fetch_issue_many")

# Every op reaches the transfer engine from the host (it moves bytes, records events or
# reads a clock), so none may be captured into a CUDA graph: with `cudagraphs`,
# Inductor partitions the step at each of them and replays the compute between.
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema, tags=(torch.Tag.cudagraph_unsafe,))
for _name in _ORDERED:
    _LIB._register_effectful_op(f"slc::{_name}", EffectType.ORDERED)


def fake_token() -> torch.Tensor:
    """A tensor shaped like a token, for `node.meta["val"]` of inserted nodes."""
    return torch.empty((), dtype=torch.int64)


@torch.library.register_fake("slc::fetch_issue", lib=_LIB)
def _(key):
    return fake_token()


@torch.library.register_fake("slc::fetch_weight", lib=_LIB)
def _(param, key):
    return torch.empty_like(param)


@torch.library.register_fake("slc::stash", lib=_LIB)
def _(x, key):
    return fake_token()


@torch.library.register_fake("slc::wait", lib=_LIB)
def _(token, keepalive):
    return fake_token()


@torch.library.register_fake("slc::unstash", lib=_LIB)
def _(stash_token):
    return fake_token()


@torch.library.register_fake("slc::unstash_wait", lib=_LIB)
def _(load_token, size, dtype, device):
    return torch.empty(size, dtype=dtype, device=device)


@torch.library.register_fake("slc::mark", lib=_LIB)
def _(label, begin):
    return fake_token()


@torch.library.register_fake("slc::offload_grad", lib=_LIB)
def _(grad, key):
    return fake_token()


@torch.library.register_fake("slc::stash_many", lib=_LIB)
def _(xs, keys):
    return [fake_token() for _ in xs]


@torch.library.register_fake("slc::wait_many", lib=_LIB)
def _(tokens, keepalive):
    return fake_token()


@torch.library.register_fake("slc::fetch_issue_many", lib=_LIB)
def _(keys):
    return fake_token()


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How `fetch_weight_many` packs a visit's weights (`weight_layout`).

    Attributes:
        sections: (dtype, elements) of each packed tensor, in the order the dtypes
            first appear among the members.
        places: per member, (its section, its first element there).
    """

    sections: tuple[tuple[torch.dtype, int], ...]
    places: tuple[tuple[int, int], ...]


WEIGHT_ALIGNMENT = 16
"""Bytes each packed weight starts on, from its tensor's start: what Triton kernels
assume of a tensor's address (FSDP pads the parameters it flattens the same way)."""


def weight_layout(members) -> WeightLayout:
    """The packing of weights of (shape, dtype) `members`, in their order (see the
    module docstring)."""
    index: dict[torch.dtype, int] = {}
    ends: list[int] = []
    places = []
    for shape, dtype in members:
        if dtype not in index:
            index[dtype] = len(ends)
            ends.append(0)
        section = index[dtype]
        step = max(WEIGHT_ALIGNMENT // dtype.itemsize, 1)
        offset = -(-ends[section] // step) * step
        places.append((section, offset))
        ends[section] = offset + math.prod(shape)
    return WeightLayout(tuple(zip(index, ends)), tuple(places))


def packing_order(members) -> list[int]:
    """The order `fetch_weight_many` takes a visit's weights in, and a block's host
    group holds them: the indices of (stored key, dtype) `members`, by key, those of
    the first dtype among them first (so that each dtype's weights follow each other)."""
    by_key = sorted(range(len(members)), key=lambda i: members[i][0])
    dtypes = list(dict.fromkeys(members[i][1] for i in by_key))
    return sorted(by_key, key=lambda i: dtypes.index(members[i][1]))


@torch.library.register_fake("slc::fetch_weight_many", lib=_LIB)
def _(params, keys):
    layout = weight_layout([(p.shape, p.dtype) for p in params])
    return [torch.empty(n, dtype=dtype, device=params[0].device) for dtype, n in layout.sections]


@torch.library.register_fake("slc::unstash_many", lib=_LIB)
def _(stash_tokens):
    return [fake_token() for _ in stash_tokens]


@torch.library.register_fake("slc::unstash_wait_many", lib=_LIB)
def _(load_tokens, sizes, ranks, dtypes, device):
    return [torch.empty(size, dtype=dtype_of(name), device=device)
            for size, name in zip(split_sizes(sizes, ranks), dtypes)]


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as `unstash_wait_many` takes it: `torch.float32` -> "float32"."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The dtype `dtype_name` named."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dtype


def split_sizes(sizes, ranks) -> list:
    """The sizes of `unstash_wait_many`'s tensors: `sizes` cut after each one's rank."""
    out, start = [], 0
    for rank in ranks:
        out.append(list(sizes[start:start + rank]))
        start += rank
    return out


def _fetch_backward(ctx, grad: torch.Tensor):
    return grad, None


torch.library.register_autograd("slc::fetch_weight", _fetch_backward, lib=_LIB)

FETCH_ISSUE = torch.ops.slc.fetch_issue.default
FETCH_WEIGHT = torch.ops.slc.fetch_weight.default
STASH = torch.ops.slc.stash.default
WAIT = torch.ops.slc.wait.default
UNSTASH = torch.ops.slc.unstash.default
UNSTASH_WAIT = torch.ops.slc.unstash_wait.default
MARK = torch.ops.slc.mark.default
OFFLOAD_GRAD = torch.ops.slc.offload_grad.default
STASH_MANY = torch.ops.slc.stash_many.default
WAIT_MANY = torch.ops.slc.wait_many.default
UNSTASH_MANY = torch.ops.slc.unstash_many.default
UNSTASH_WAIT_MANY = torch.ops.slc.unstash_wait_many.default
FETCH_ISSUE_MANY = torch.ops.slc.fetch_issue_many.default
FETCH_WEIGHT_MANY = torch.ops.slc.fetch_weight_many.default
SLC_OPS = (FETCH_ISSUE, FETCH_WEIGHT, STASH, WAIT, UNSTASH, UNSTASH_WAIT, MARK, OFFLOAD_GRAD,
           STASH_MANY, WAIT_MANY, UNSTASH_MANY, UNSTASH_WAIT_MANY, FETCH_ISSUE_MANY, FETCH_WEIGHT_MANY)
"""Every op of the vocabulary."""
COALESCED = MappingProxyType({STASH: STASH_MANY, WAIT: WAIT_MANY, UNSTASH: UNSTASH_MANY,
                              UNSTASH_WAIT: UNSTASH_WAIT_MANY, FETCH_ISSUE: FETCH_ISSUE_MANY,
                              FETCH_WEIGHT: FETCH_WEIGHT_MANY})
"""The op that runs a run of consecutive calls of each op as one (`coalesce_transfers`)."""

# What moves, and which half of its issue + wait pair a node is.
_TRANSFERS = MappingProxyType({
    FETCH_ISSUE: ("fetch", "issue"),
    FETCH_WEIGHT: ("fetch", "wait"),
    STASH: ("stash", "issue"),
    WAIT: ("stash", "wait"),
    UNSTASH: ("unstash", "issue"),
    UNSTASH_WAIT: ("unstash", "wait"),
    OFFLOAD_GRAD: ("store_grad", "issue"),
})


def _calls(node: torch.fx.Node, *targets) -> bool:
    return node.op == "call_function" and node.target in targets


def is_slc_op(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "slc"


def is_fetch(node: torch.fx.Node) -> bool:
    """A weight fetch: `slc::fetch_weight`, the node whose value is the weight."""
    return _calls(node, FETCH_WEIGHT)


def is_fetch_issue(node: torch.fx.Node) -> bool:
    return _calls(node, FETCH_ISSUE)


def is_stash(node: torch.fx.Node) -> bool:
    """The issue of an activation store (`slc::stash`)."""
    return _calls(node, STASH)


def is_stash_wait(node: torch.fx.Node) -> bool:
    return _calls(node, WAIT)


def is_unstash(node: torch.fx.Node) -> bool:
    """The issue of an activation load (`slc::unstash`)."""
    return _calls(node, UNSTASH)


def is_unstash_wait(node: torch.fx.Node) -> bool:
    return _calls(node, UNSTASH_WAIT)


def is_load(node: torch.fx.Node) -> bool:
    """A node whose value is a tensor loaded from a tier (a fetched weight or an
    unstashed activation): memory it allocates on the device."""
    return _calls(node, FETCH_WEIGHT, UNSTASH_WAIT)


def is_store(node: torch.fx.Node) -> bool:
    """The issue of a store to a tier: an activation's stash or a weight gradient's."""
    return transfer_kind(node) in (("stash", "issue"), ("store_grad", "issue"))


def is_issue(node: torch.fx.Node) -> bool:
    """The first half of a transfer pair: the transfer starts here."""
    kind = transfer_kind(node)
    return kind is not None and kind[1] == "issue"


def is_wait(node: torch.fx.Node) -> bool:
    """The second half of a transfer pair: the graph blocks here until it is done."""
    kind = transfer_kind(node)
    return kind is not None and kind[1] == "wait"


def is_mark(node: torch.fx.Node) -> bool:
    return _calls(node, MARK)


def is_gradient_store(node: torch.fx.Node) -> bool:
    """The issue of a weight gradient's store to the optimizer's tier (`slc::offload_grad`)."""
    return _calls(node, OFFLOAD_GRAD)


def transfer_kind(node: torch.fx.Node) -> tuple[str, str] | None:
    """("fetch" | "stash" | "unstash" | "store_grad", "issue" | "wait") of a transfer
    node, else None."""
    if node.op != "call_function":
        return None
    if node.target is WAIT and node.args and _calls(node.args[0], OFFLOAD_GRAD):
        return "store_grad", "wait"  # `slc::wait` ends gradient stores too
    return _TRANSFERS.get(node.target)


def is_bookkeeping(node: torch.fx.Node) -> bool:
    """An op call that computes nothing of its own: a getitem, a view or a detach (it
    never opens a compute region; it joins the one that is open)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or getattr(target, "is_view", False):
        return True
    return isinstance(target, torch._ops.OpOverload) and target.overloadpacket is torch.ops.aten.detach


def is_compute(node: torch.fx.Node) -> bool:
    """Whether the node computes tensor data of the model: an op call that is not a
    `slc::` op, not bookkeeping (`is_bookkeeping`), and not size arithmetic."""
    if node.op != "call_function" or is_slc_op(node) or is_bookkeeping(node):
        return False
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return value is None or isinstance(value, torch.Tensor)


def region_label(tag: str, phase: str) -> str:
    """The label of a compute region (`slc::mark`, the timeline): `"blk3.sb1 fwd"`.

    Args:
        tag: the (block, sub-batch) tag, `"blk3.sb1"` (`SlcMeta.tag`).
        phase: "fwd" or "bwd" (generation: "prefill" or "decode").
    """
    return f"{tag} {phase}"


def parse_region_label(label: str) -> tuple[str, str]:
    """(tag, phase) of a region label; the phase is "" when the label names none."""
    tag, _, phase = label.partition(" ")
    return tag, phase


def prefetch_ahead(live_blocks: int, num_visits: int) -> int:
    """How many block visits ahead a weight load is issued: `live_blocks - 1`, at
    most the other visits of the cycle; 0: no prefetch (each fetch loads its own)."""
    return max(min(live_blocks - 1, num_visits - 1), 0)


def issued_visit(visit: int, live_blocks: int, num_visits: int) -> int | None:
    """The visit whose weight loads visit `visit` issues (just before its own
    first fetch), or None without prefetch."""
    ahead = prefetch_ahead(live_blocks, num_visits)
    return (visit + ahead) % num_visits if ahead else None


def prefetched_visits(visit: int, live_blocks: int, num_visits: int) -> tuple[int, ...]:
    """The visits whose weights are loaded ahead while visit `visit` runs (issued,
    not yet fetched): the `prefetch_ahead` visits after it, around the cycle. Visit -1
    is the one before the first."""
    ahead = prefetch_ahead(live_blocks, num_visits)
    return tuple((visit + step) % num_visits for step in range(1, ahead + 1))


_WEIGHT_KEY = re.compile(r"^(?P<streamer>[^|]+)\|(?P<stored>[^#@]+)(?:#sb(?P<subbatch>\d+))?(?:@(?P<phase>fwd|bwd))?$")


@dataclasses.dataclass(frozen=True)
class WeightKey:
    """The key a weight fetch carries: `w3|w0:layers_0_fc_weight#sb1@bwd`.

    Attributes:
        streamer: the weight streamer of the compiled graph (`w3`).
        stored: the key the weight is stored under on its tier (`w0:name`; a weight
            shared by two compiled graphs keeps the first graph's key).
        subbatch: the sub-batch this fetch serves alone, or None when it serves all.
            Fetches of one weight for different sub-batches then carry different keys,
            so common-subexpression elimination never merges them.
        phase: "fwd" or "bwd": which compiled graph fetches.
    """

    streamer: str
    stored: str
    subbatch: int | None = None
    phase: str = "fwd"

    def format(self) -> str:
        copy = "" if self.subbatch is None else f"#sb{self.subbatch}"
        return f"{self.streamer}|{self.stored}{copy}@{self.phase}"

    @classmethod
    def parse(cls, key: str) -> WeightKey:
        match = _WEIGHT_KEY.match(key)
        if match is None:
            raise ValueError(f"not a weight key: {key!r}")
        subbatch = match.group("subbatch")
        return cls(
            match.group("streamer"), match.group("stored"),
            None if subbatch is None else int(subbatch), match.group("phase") or "fwd",
        )


SPILL_MARK = "spill"
"""The name part after the tag in the stash key of a boundary activation's spill."""


@dataclasses.dataclass(frozen=True)
class StashKey:
    """The key a `slc::stash` carries: `a2|blk3.sb1.mul_4`, or `a2@host|blk3.sb1.mul_4`
    for a unit whose schedule names its stash's tier (`Step.tier`).

    Attributes:
        stash: the activation stash of the compiled graph (engine and tier), `a2`.
        name: the saved tensor: its (block, sub-batch) tag and forward node name.
        tier: the tier the tensor goes to, or None: the stash's own.
    """

    stash: str
    name: str
    tier: str | None = None

    def format(self) -> str:
        tier = f"@{self.tier}" if self.tier is not None else ""
        return f"{self.stash}{tier}|{self.name}"

    @property
    def spills(self) -> bool:
        """Whether it stores a boundary activation while it waits (`a2|blk3.sb1.spill.add_7`)
        rather than a saved activation for the backward."""
        return self.name.split(".")[2:3] == [SPILL_MARK]

    @classmethod
    def parse(cls, key: str) -> StashKey:
        stash, bar, name = key.partition("|")
        stash, at, tier = stash.partition("@")
        if not bar or not stash or not name or at and not tier:
            raise ValueError(f"not a stash key: {key!r}")
        return cls(stash, name, tier or None)


def stash_key_of(node: torch.fx.Node) -> StashKey | None:
    """The parsed key of the stash an activation transfer node belongs to (the
    stash, its wait, the load or the load's wait, each reaching the stash through
    its first argument), or None for another node or a key that is not a stash's."""
    if not (is_stash(node) or is_stash_wait(node) or is_unstash(node) or is_unstash_wait(node)):
        return None
    stash = node
    while not is_stash(stash):
        if not stash.args or not isinstance(stash.args[0], torch.fx.Node):
            return None
        stash = stash.args[0]
    key = stash.args[1] if len(stash.args) > 1 and isinstance(stash.args[1], str) else None
    try:
        return StashKey.parse(key) if key is not None else None
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class GradientKey:
    """The key a `slc::offload_grad` carries: `g1|w0:layers_0_fc_weight`.

    Attributes:
        sink: the gradient sink of the compiled graph (engine, tier, optimizer), `g1`.
        stored: the stored key of the weight whose gradient this is.
    """

    sink: str
    stored: str

    def format(self) -> str:
        return f"{self.sink}|{self.stored}"

    @classmethod
    def parse(cls, key: str) -> GradientKey:
        sink, bar, stored = key.partition("|")
        if not bar or not sink or not stored:
            raise ValueError(f"not a gradient key: {key!r}")
        return cls(sink, stored)
