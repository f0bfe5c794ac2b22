"""The records of a generation's passes: `GenerationStep` (one pass, predicted or
measured) and `GenerationOutput` (what `generate(..., return_dict_in_generate=True)`
returns)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from slcompile.runtime.stats import TransferKey
from slcompile.runtime.storage.tiers import Tier, TransferKind
from slcompile.schedules.base import Schedule

__all__ = ["GenerationStep", "GenerationOutput"]


@dataclasses.dataclass(frozen=True)
class GenerationStep:
    """One forward pass of a generation: predicted (`explain_generation`) or
    measured (`generate(..., return_dict_in_generate=True)`).

    Attributes:
        phase: "prefill" or "decode".
        subbatches: the sub-batches computed (a decode step skips finished ones).
        schedule: the pass's `Schedule` (`slcompile.schedules.generation`), which
            `generate` lowered and ran; its text is training's, e.g. ``decode fetch.issue
            blk0``, ``decode blk0.sb1``, ``decode store_kv.issue blk0.sb1``.
        bytes_moved: bytes per ``(kind, source tier, destination tier)``, nonzero only.
        seconds: the pass's wall time, measured (None in a prediction; not compared:
            a measured step equals its prediction when schedule and bytes do).
    """

    phase: str
    subbatches: tuple[int, ...]
    schedule: Schedule
    bytes_moved: Mapping[TransferKey, int]
    seconds: float | None = dataclasses.field(default=None, compare=False)

    def bytes_of(self, kind: TransferKind, source: Tier, destination: Tier) -> int:
        return self.bytes_moved.get((kind, source, destination), 0)

    def __str__(self) -> str:
        """``decode of sub-batches 0, 1: kv device->nvme 4.00 KiB, ...``, then the
        schedule, one step per line."""
        from slcompile.units import format_bytes

        moved = ", ".join(f"{kind.value} {source.value}->{destination.value} {format_bytes(n)}"
                          for (kind, source, destination), n in sorted(
                              self.bytes_moved.items(), key=lambda item: tuple(x.value for x in item[0])))
        return (f"{self.phase} of sub-batches {', '.join(map(str, self.subbatches))}: "
                f"{moved or 'no bytes moved'}\n" + "\n".join(f"  {step.text()}" for step in self.schedule.steps))


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """What `generate(..., return_dict_in_generate=True)` returns.

    Attributes:
        sequences: what `generate` returns otherwise.
        steps: every forward pass that ran, in order, as measured.
    """

    sequences: torch.Tensor
    steps: tuple[GenerationStep, ...]

    @property
    def subbatch_steps(self) -> int:
        """(sub-batch, pass) pairs computed."""
        return sum(len(step.subbatches) for step in self.steps)
