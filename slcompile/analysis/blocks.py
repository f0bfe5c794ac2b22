"""The block graph: a Dynamo graph's repeated blocks and the region of each node.

`slcompile.passes.find_blocks` finds them; the passes after it and the schedule's
policies (`slcompile.schedules.policies.plan_schedule`) read them. Plain data.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Block", "BlockGraph"]


@dataclasses.dataclass(frozen=True)
class Block:
    """One block.

    Attributes:
        index: its position in the container (`layers.3` -> 3); with several stacks,
            its position in execution order across them (`decoder.block.0` after two
            encoder blocks -> 2).
        path: the module path, as the user names it (`model.layers.3`).
        nodes: names of its call nodes, in graph order.
        params: names of the parameter placeholders it reads.
        group: index of its structural-identity group.
    """

    index: int
    path: str
    nodes: tuple[str, ...]
    params: tuple[str, ...]
    group: int


@dataclasses.dataclass(frozen=True)
class BlockGraph:
    """The result of `find_blocks`.

    Attributes:
        container: the module list holding the blocks (`model.layers`); with several
            stacks, the one holding the most block nodes.
        blocks: the blocks in execution order.
        regions: node name -> "prefix", "block" or "suffix", for every non-placeholder.
        block_of: node name -> block position in `blocks`, for block nodes.
        groups: block positions grouped by structural identity.
        stacks: per stack, in execution order, its container and its block positions
            (one stack: `(("layers", (0, 1, ...)),)`).
    """

    container: str
    blocks: tuple[Block, ...]
    regions: dict[str, str]
    block_of: dict[str, int]
    groups: tuple[tuple[int, ...], ...]
    stacks: tuple[tuple[str, tuple[int, ...]], ...] = ()
