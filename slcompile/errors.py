"""Errors raised by the compiler side of slcompile."""

from __future__ import annotations

__all__ = ["RefusedError"]


class RefusedError(Exception):
    """The pipeline cannot split this graph into sub-batches without changing results.

    Attributes:
        reason: one sentence a user understands, naming the node or input at fault.
        pass_name: the pass that refused.
        state: what the passes before it produced (a PipelineState), when raised by
            the pipeline.
    """

    def __init__(self, reason: str, pass_name: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.pass_name = pass_name
        self.state = None

    def __str__(self) -> str:
        where = f" [{self.pass_name}]" if self.pass_name else ""
        return f"{self.reason}{where}"
