"""What the `_many` forms of the transfer ops do: a run of consecutive calls of one op
as one call (`slcompile.passes.coalesce_transfers` writes them; their schemas are in
`slcompile.vocabulary`).

Each does what the single op does for each member, in order, and returns the members'
results in order (the waits and the weight issues one dependency token). The nvme I/O
a run issues reaches the arena together when the run's issues are done
(`nvme_io.batched`): one job of one I/O thread, where one per tensor would wake a
thread per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slcompile.vocabulary import dtype_of, split_sizes

from . import activations, ops, weights
from .storage.nvme_io import batched

__all__ = ["stash_many", "wait_many", "unstash_many", "unstash_wait_many", "fetch_issue_many"]


def stash_many(xs: Sequence[torch.Tensor], keys: Sequence[str]) -> list[torch.Tensor]:
    """`stash` of each (x, key); their stash tokens."""
    with batched():
        return activations.stash_many(xs, keys)


def wait_many(tokens: Sequence[torch.Tensor], keepalive: Sequence[torch.Tensor]) -> torch.Tensor:
    """Blocks until every token's transfer is done; a dependency token."""
    for token in tokens:
        engine, handle = ops._lookup(token)
        engine.wait(handle)
    return ops._dependency_token()


def unstash_many(stash_tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`unstash` of each stash token; their load tokens."""
    with batched():
        return activations.unstash_many(stash_tokens)


def unstash_wait_many(
    load_tokens: Sequence[torch.Tensor], sizes: Sequence[int], ranks: Sequence[int],
    dtypes: Sequence[str], device: torch.device,
) -> list[torch.Tensor]:
    """`unstash_wait` of each load token (its size the next `rank` numbers of `sizes`,
    its dtype named in `dtypes`)."""
    return [activations.unstash_wait(token, size, dtype_of(dtype), device)
            for token, size, dtype in zip(load_tokens, split_sizes(sizes, ranks), dtypes)]


def fetch_issue_many(keys: Sequence[str]) -> torch.Tensor:
    """`fetch_issue` of each weight key (`weights.fetch_issue_many`); a dependency token."""
    with batched():
        weights.fetch_issue_many(list(keys))
    return ops._dependency_token()


ops.implement("stash_many", stash_many)
ops.implement("wait_many", wait_many)
ops.implement("unstash_many", unstash_many)
ops.implement("unstash_wait_many", unstash_wait_many)
ops.implement("fetch_issue_many", fetch_issue_many)
