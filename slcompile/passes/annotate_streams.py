"""The stream each transfer node runs on, as a node annotation.

Runs in the compiled stage, on each AOTAutograd graph as it is handed to its
compiler (after every pass that places transfers, before `mark_regions`). Every
`slc::` transfer node, the issue and the wait of a pair alike, is annotated with
the name of the stream the runtime runs that transfer on; compute nodes keep no
annotation, which in PyTorch's convention means the default (compute) stream:

- `COPY` ("copy"): the transfer engine's (`slcompile.runtime.storage.engine`): on CUDA its
  one persistent copy stream, both directions; on CPU its nvme I/O threads. Weight
  fetches, activation stashes and unstashes, weight gradient stores.
- `COMM` ("comm"): the communication thread of the `ShardGroup`
  (`slcompile.runtime.collectives`) when the weights are sharded
  (`shard_weights=True`): the fetch of a sharded weight ends in its all-gather, the
  store of its gradient is a reduce-scatter.

`STREAM_LANES` says which lanes of the runtime's timeline each stream records
(`slcompile.viz.trace` groups them per stream); `transfer_stream(node)` reads the
annotation back (the DOT pictures colour transfers by it).

Where the annotation is stored. PyTorch's user stream annotation is
`node.meta["custom"]["stream"]` (`torch.fx.traceback.annotate({"stream": i})`,
Dynamo's `torch.cuda.stream(s)` contexts), and it is what this pass writes on the
graphs the aot_eager lowering runs: that lowering runs the graph module as it is
and never reads node metadata. On graphs Inductor compiles (the inductor lowering)
the same name goes under `node.meta["custom"]["slc_stream"]`, a key Inductor does
not read, because Inductor 2.13 acts on "stream":

- its value is taken as the index of a user stream object Dynamo registered for the
  frame (`torch._dynamo.graph_bytecode_inputs`); the scheduler gives each distinct
  value a side stream (`Scheduler._populate_stream_assignments`), the wrapper binds
  `stream1 = get_external_object_by_index(value)` inside the CUDA device guard and
  runs the node's kernel or extern call under `with stream1:`; lowering realizes
  the inputs of a node on another stream, the pattern matcher drops matches and the
  scheduler refuses fusions across two streams;
- on CPU there is no device guard, so nothing binds the stream names while the
  `with` blocks are still emitted: the graph compiles and its first call raises
  `NameError: name 'default_stream' is not defined` (so does a speedloader step
  with weights on nvme compiled whole, `compile_regions=False`, when its transfers
  carry "stream"; with "slc_stream" it matches eager);
- on CUDA no stream object of the engine's is registered in the frame's table (the
  table is rebuilt from Dynamo's bytecode at every call), and an extern call run
  under the copy stream would break the engine's ordering: the engine makes its
  copy stream wait for the *current* stream and hands results to it, which under
  `with stream1:` is the copy stream itself, not the compute stream.

So the annotation describes where the runtime runs each transfer (the engine picks
its stream itself); nothing compiles differently with it.
"""

from __future__ import annotations

import collections
import logging
from types import MappingProxyType

import torch
import torch.fx

from slcompile.vocabulary import transfer_kind

__all__ = [
    "COPY",
    "COMM",
    "STREAMS",
    "STREAM_LANES",
    "STREAM_KEY",
    "INDUCTOR_STREAM_KEY",
    "StreamAnnotations",
    "annotate_streams",
    "stream_key",
    "transfer_stream",
]

log = logging.getLogger(__name__)

COPY = "copy"
COMM = "comm"
STREAMS = MappingProxyType({
    COPY: "the transfer engine's copy stream (CUDA) or I/O threads (CPU)",
    COMM: "the collectives' communication thread (sharded weights)",
})
"""Stream name -> what it is."""
STREAM_LANES = MappingProxyType({COPY: ("load", "store"), COMM: ("collective",)})
"""Stream name -> the runtime timeline lanes its transfers are recorded on."""

STREAM_KEY = "stream"
"""PyTorch's user stream annotation: `node.meta["custom"]["stream"]`."""
INDUCTOR_STREAM_KEY = "slc_stream"
"""Where the stream goes on graphs Inductor compiles (see the module docstring)."""


class StreamAnnotations(dict):
    """The result of `annotate_streams`: stream name -> number of nodes annotated."""

    def text(self) -> str:
        return ", ".join(f"{stream}: {count} nodes" for stream, count in sorted(self.items())) or "no transfers"


def stream_key(lowering: str) -> str:
    """The `meta["custom"]` key the stream is written under for `lowering`."""
    return INDUCTOR_STREAM_KEY if lowering == "inductor" else STREAM_KEY


def annotate_streams(
    gm: torch.fx.GraphModule | torch.fx.Graph,
    *,
    key: str = STREAM_KEY,
    sharded_weights: bool = False,
    sharded_gradients: bool = False,
) -> StreamAnnotations:
    """Writes the stream of every transfer node of `gm` into `node.meta["custom"][key]`.

    Other `meta["custom"]` entries (the slc tag) are kept; compute nodes are left as
    they are.

    Args:
        gm: a graph (changed in place).
        key: `STREAM_KEY`, or `INDUCTOR_STREAM_KEY` for a graph Inductor compiles.
        sharded_weights: the weight fetches end in all-gathers (`COMM`).
        sharded_gradients: the weight gradient stores are reduce-scatters (`COMM`).

    Returns:
        the number of nodes annotated per stream.
    """
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    counts: collections.Counter = collections.Counter()
    for node in graph.nodes:
        stream = _stream_of(node, sharded_weights, sharded_gradients)
        if stream is None:
            continue
        custom = dict(node.meta.get("custom") or {})
        custom[key] = stream
        node.meta["custom"] = custom
        counts[stream] += 1
    log.debug("annotate_streams: %s", dict(counts))
    return StreamAnnotations(counts)


def transfer_stream(node: torch.fx.Node) -> str | None:
    """The stream `annotate_streams` gave `node` (either key), or None (the default stream)."""
    custom = node.meta.get("custom") or {}
    stream = custom.get(STREAM_KEY, custom.get(INDUCTOR_STREAM_KEY))
    return stream if isinstance(stream, str) else None


def _stream_of(node: torch.fx.Node, sharded_weights: bool, sharded_gradients: bool) -> str | None:
    kind = transfer_kind(node)
    if kind is None:
        return None
    what, _ = kind
    if (what == "fetch" and sharded_weights) or (what == "store_grad" and sharded_gradients):
        return COMM
    return COPY
