"""What a compiled step dispatches on the host, read from one `torch.profiler` trace.

A step compiled by Inductor should run its compute inside the compiled programs
(`## Call CompiledFxGraph ...` in the trace) and call out only for transfers (the
`slc::` ops). `profile_step` runs a step under the profiler and sorts the operators it
dispatched: those inside a compiled program or a transfer op (their own kernels and
copies), and those outside every one of them, which ran op by op in Python (eager).
Autograd's own accumulation of `.grad` (`AccumulateGrad`) is counted apart: every
compiled model pays it.

Used by the tests (nothing of a step runs eagerly), `bench/overhead_bench.py`
(eager ops and host microseconds per transfer op, per row) and the machine profile
(`slcompile.profile`: the host cost of each kind of transfer op as a step runs it).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Callable

import torch

__all__ = ["StepOps", "profile_step", "classify_events"]

_COMPILED = "## Call CompiledFxGraph"
_AUTOGRAD_ACCUMULATE = "torch::autograd::AccumulateGrad"
# Operators that allocate tensor memory (a view allocates none).
_ALLOCATIONS = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zeros_like",
                          "aten::ones", "aten::full", "aten::clone"})
# The CUDA API calls that launch work: kernels (the runtime's and the driver's) and
# CUDA graphs. The profiler sees them with CUDA activity on.
_LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                       "cudaGraphLaunch"})


@dataclasses.dataclass(frozen=True)
class StepOps:
    """The operators one step dispatched, by where they ran.

    Attributes:
        eager: operator name -> calls outside compiled code and transfer ops.
        slc_host_us: `slc::` op name -> the host microseconds of each call, its own
            time plus that of the operators it dispatched (the profiler's total CPU
            time of the op: what the step waits on the host).
        compiled_calls: calls of compiled programs.
        accumulate_grad: operators dispatched by autograd's `.grad` accumulation.
        launches: CUDA API call name -> calls that launched a kernel or a CUDA graph
            (seen only by a profile with CUDA activity: `profile_step(cuda=True)`).
        slc_allocations: `slc::` op name -> tensor allocations dispatched inside its
            calls (a loaded weight's memory, a token), outermost op counted.
    """

    eager: dict[str, int]
    slc_host_us: dict[str, list[float]]
    compiled_calls: int
    accumulate_grad: int
    launches: dict[str, int] = dataclasses.field(default_factory=dict)
    slc_allocations: dict[str, int] = dataclasses.field(default_factory=dict)

    def eager_count(self, namespace: str) -> int:
        """Eager calls of operators of `namespace` ("prims", "aten")."""
        return sum(n for name, n in self.eager.items() if name.startswith(namespace + "::"))

    def slc_median_us(self) -> dict[str, float]:
        """Median host microseconds per call of each `slc::` op."""
        return {name: statistics.median(times) for name, times in self.slc_host_us.items()}


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def classify_events(events) -> StepOps:
    """Sorts the profiler's `FunctionEvent`s of one step (see `StepOps`)."""
    eager: collections.Counter = collections.Counter()
    slc: dict[str, list[float]] = collections.defaultdict(list)
    launches: collections.Counter = collections.Counter()
    allocations: collections.Counter = collections.Counter()
    compiled = accumulate = 0
    for event in events:
        name = event.name
        if name in _LAUNCHES:
            launches[name] += 1
            continue
        if name.startswith(_COMPILED):
            compiled += 1
            continue
        if name.startswith("slc::"):
            if not any(a.name.startswith("slc::") for a in _ancestors(event)):
                slc[name].append(event.cpu_time_total)
            continue
        if not name.startswith(("aten::", "prims::")):
            continue
        outer = [a.name for a in _ancestors(event)]
        ops = [a for a in outer if a.startswith("slc::")]
        if ops:  # (a compiled program calls the transfer ops)
            if name in _ALLOCATIONS and not any(a in _ALLOCATIONS for a in outer):  # a clone's own empty is its
                allocations[ops[-1]] += 1
            continue
        if any(a.startswith(_COMPILED) for a in outer):
            continue
        if _AUTOGRAD_ACCUMULATE in outer:
            accumulate += 1
            continue
        if any(a.startswith(("aten::", "prims::")) for a in outer):
            continue  # counted as its outermost operator
        eager[name] += 1
    return StepOps(dict(eager), dict(slc), compiled, accumulate, dict(launches), dict(allocations))


def profile_step(step: Callable[[], object], *, cuda: bool = False) -> StepOps:
    """Runs `step()` once under `torch.profiler` (CPU activity, and CUDA's with
    `cuda`, which adds the launches) and sorts what it dispatched (`classify_events`)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
    return classify_events(prof.events())
