"""The schedule: the ordered steps of one step of the model, with one text form.

The text form is deterministic and is what `explain()`, the CLI and the tests print
and compare: one line per step, `fwd blk3.sb1` for compute. Transfer steps
(`load`, `store`, `wait`) carry a tier and a byte count once the runtime moves data.
"""

from __future__ import annotations

import dataclasses

from slcompile.meta import format_tag

__all__ = ["Step", "Schedule"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step.

    Attributes:
        phase: "fwd" or "bwd".
        region: "prefix", "block" or "suffix".
        block: block index for region "block".
        subbatch: the sub-batch, or None for work shared by all sub-batches.
        kind: "compute" for now; transfers add "load", "store", "wait".
    """

    phase: str
    region: str
    block: int | None = None
    subbatch: int | None = None
    kind: str = "compute"

    @property
    def tag(self) -> str:
        return format_tag(self.region, self.block, self.subbatch)

    def text(self) -> str:
        if self.kind == "compute":
            return f"{self.phase} {self.tag}"
        return f"{self.phase} {self.kind} {self.tag}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """An ordered tuple of steps."""

    steps: tuple[Step, ...]

    def text(self) -> str:
        return "\n".join(step.text() for step in self.steps)

    def phase(self, phase: str) -> Schedule:
        return Schedule(tuple(s for s in self.steps if s.phase == phase))

    def tags(self) -> tuple[str, ...]:
        return tuple(s.tag for s in self.steps)

    def __len__(self) -> int:
        return len(self.steps)
