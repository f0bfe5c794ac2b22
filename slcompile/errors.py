"""Errors raised by the compiler side of slcompile."""

from __future__ import annotations

__all__ = ["RefusedError", "BudgetError"]


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


class BudgetError(Exception):
    """No plan of the step fits the device's memory budget.

    Attributes:
        budget: the `memory_budget` asked for, in bytes.
        smallest: the smallest device peak any plan reaches, in bytes: the smallest
            budget that compiles with these options.
        tried: the MemoryPrediction of every plan tried.
    """

    def __init__(self, budget: int, smallest: int, tried: tuple = ()):
        self.budget = budget
        self.smallest = smallest
        self.tried = tried
        plans = "; ".join(f"recompute={p.recompute}: {p.peak_bytes['device']} bytes" for p in tried)
        plans = f" [{plans}]" if plans else ""
        super().__init__(
            f"the step needs at least {smallest} bytes ({smallest / 2**20:.2f} MiB) on the device, "
            f"over memory_budget={budget} ({budget / 2**20:.2f} MiB); set memory_budget >= {smallest}, "
            f"or lower it with more sub-batches, recompute='blocks', activations='nvme' or "
            f"weights='nvme'{plans}"
        )
