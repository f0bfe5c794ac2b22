"""`slcompile.tune(model, *args, memory_budget=...)`: the options that fit a budget.

The model's graph is captured once (its forward runs once, eagerly, under Dynamo);
every candidate plan is then rewritten and partitioned on that graph and its peak
memory predicted from the lifetimes of its forward and backward (nothing is compiled
to code, no weight moves, no step runs). Candidates are tried in the order of what
runs fastest when it fits: fewer sub-batches first (bigger matrix products, fewer
per-sub-batch overheads), then more blocks' weights live (more prefetch ahead), with
`recompute="auto"` keeping saved activations before recomputing blocks. The first
plan that fits is the answer.

The budget covers the whole step: with an optimizer (the offloaded optimizer
attached to the model, or `optimizer=`, as in `slcompile.explain`), a plan whose
forward and backward fit but whose `optimizer.step()` would not (the resident
parameters' state, their gradients and the step's temporaries) is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from slcompile.config import SpeedLoaderConfig, parse_bytes
from slcompile.errors import BudgetError, RefusedError

__all__ = ["TuneResult", "tune"]


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What `tune` chose.

    Attributes:
        options: the backend options to compile with (`torch.compile(...,
            options=result.options)`), the budget included.
        memory: the chosen plan's MemoryPrediction.
        tried: (num_subbatches, live_blocks, device peak bytes or None when refused)
            of every candidate evaluated, in order.
    """

    options: dict[str, Any]
    memory: Any
    tried: tuple[tuple[int, int, int | None], ...]


def tune(
    model: torch.nn.Module,
    *args: Any,
    memory_budget: int | str,
    kwargs: Mapping[str, Any] | None = None,
    num_subbatches: Sequence[int] | None = None,
    live_blocks: Sequence[int] = (2, 1),
    optimizer: Any = None,
    optimizer_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> TuneResult:
    """Chooses K, live_blocks and recomputation for `model(*args)` under a budget.

    Args:
        model: the model; `args`/`kwargs` a full batch, as in training.
        memory_budget: the device's limit for one step (bytes or "2GiB").
        num_subbatches: the K to consider (default: every divisor of the batch).
        live_blocks: the windows to consider, preferred first.
        optimizer, optimizer_options: the optimizer whose step the budget covers,
            as in `slcompile.explain` (default: the offloaded optimizer attached to
            the model, if any).
        **options: other backend options, fixed (`weights="nvme"`, ...).

    Raises:
        BudgetError: no candidate fits; names the smallest budget any would need.
        RefusedError: the graph cannot be split into sub-batches at all.
    """
    from slcompile.backends.lowering import lower
    from slcompile.explain import check_optimizer, plan_with_optimizer
    from slcompile.pipeline import run_pipeline
    from slcompile.report import CompileReport

    budget = parse_bytes(memory_budget, "memory_budget")
    check_optimizer(optimizer, optimizer_options, "tune")
    captured = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(*args, **dict(kwargs or {}))
    gm, example_inputs = captured[0]
    if num_subbatches is None:
        probe = run_pipeline(gm, example_inputs, SpeedLoaderConfig.from_options({**options, "num_subbatches": 1}))
        batch = probe.batch.batch_size
        num_subbatches = [k for k in range(1, batch + 1) if batch % k == 0]

    tried, smallest = [], None
    for k in sorted(num_subbatches):
        for window in live_blocks:
            chosen = {**options, "num_subbatches": k, "live_blocks": window, "memory_budget": budget}
            config = SpeedLoaderConfig.from_options(chosen)
            try:
                state = run_pipeline(gm, example_inputs, config)
                report = CompileReport(config=config)
                lower(state.gm, example_inputs, "aot_eager", report,
                      plan_with_optimizer(state, optimizer, optimizer_options))
            except RefusedError:
                tried.append((k, window, None))
                continue
            except BudgetError as err:
                tried.append((k, window, err.smallest))
                smallest = err.smallest if smallest is None else min(smallest, err.smallest)
                continue
            tried.append((k, window, report.memory.peak_bytes["device"]))
            return TuneResult(chosen, report.memory, tuple(tried))
    if smallest is None:
        raise RefusedError("no candidate number of sub-batches can split this model's batch", "tune")
    raise BudgetError(budget, smallest)
