"""Resident bytes over a step: predicted from the compiled graphs, measured by the runtime.

Where it sits: the CLI records one training step with `ResidentSampler` running,
then `plots.plot_memory` draws both series; this module computes them.

Predicted (`predict_live_bytes`): the lifetime analysis of the compiled forward and
backward graphs (`analysis.lifetimes.analyze_training_step`) gives every value's
bytes and first and last use in node order; summing the values live at each node
gives the bytes the step holds there, with fetched weights (`slc::fetch_weight`)
apart from everything else (activations, saved values, gradients). Parameters and
the user's inputs are held by the caller and not counted. Symbolic sizes are
evaluated at the sizes the graph was compiled with.

Measured (`ResidentSampler`): the runtime's resident bytes per tier
(`runtime_stats().resident_bytes`: what the transfer engine holds or delivered on
each tier), sampled at every compute-region boundary (`slc::mark`) and at the start
and end of the recording. It does not include activations, which the runtime does
not allocate.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping

import sympy
import torch
import torch.fx

__all__ = ["PredictedMemory", "ResidentSample", "ResidentSampler", "predict_live_bytes"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PredictedMemory:
    """Live bytes after each node of one graph.

    Attributes:
        kind: the graph: "forward", "backward" or "inference".
        phase: "fwd" or "bwd".
        nodes: the node names, in program order.
        weights: bytes of fetched weights live after each node.
        other: bytes of all other counted values (activations, gradients) live after
            each node.
    """

    kind: str
    phase: str
    nodes: tuple[str, ...]
    weights: tuple[int, ...]
    other: tuple[int, ...]

    @property
    def peak(self) -> int:
        return max((w + o for w, o in zip(self.weights, self.other)), default=0)


@dataclasses.dataclass(frozen=True)
class ResidentSample:
    """Resident bytes per tier at one moment.

    Attributes:
        time: `time.perf_counter()` seconds.
        resident: tier name -> bytes.
        label: the region marker that triggered the sample, or "start"/"end".
    """

    time: float
    resident: dict[str, int]
    label: str


def predict_live_bytes(graphs: Mapping[str, torch.fx.GraphModule]) -> tuple[PredictedMemory, ...]:
    """Live bytes after each node of the compiled graphs, from their lifetimes.

    Args:
        graphs: the compiled graphs by kind (`CompileReport.graphs`): "forward" and
            "backward" are analysed as one training step; else the "inference" (or
            "forward") graph alone.

    Returns:
        one PredictedMemory per graph, in the order they run.
    """
    from slcompile.analysis.lifetimes import analyze_lifetimes, analyze_training_step

    if "forward" in graphs and "backward" in graphs:
        step = analyze_training_step(graphs["forward"], graphs["backward"])
        tables = (("forward", step.forward), ("backward", step.backward))
    else:
        kind = "inference" if "inference" in graphs else "forward"
        if kind not in graphs:
            return ()
        tables = ((kind, analyze_lifetimes(graphs[kind], kind)),)
    return tuple(_sweep(kind, graphs[kind], table) for kind, table in tables)


def _sweep(kind: str, gm: torch.fx.GraphModule, table) -> PredictedMemory:
    names = tuple(node.name for node in gm.graph.nodes)
    sizes = _size_hints(gm)
    weights_delta = [0] * (len(names) + 1)
    other_delta = [0] * (len(names) + 1)
    for value in table.values:
        size = int(sympy.sympify(value.bytes).subs(sizes))
        deltas = weights_delta if value.kind == "weight" else other_delta
        deltas[value.first_use] += size
        deltas[min(value.last_use + 1, len(names))] -= size
    weights, other, live_weights, live_other = [], [], 0, 0
    for index in range(len(names)):
        live_weights += weights_delta[index]
        live_other += other_delta[index]
        weights.append(live_weights)
        other.append(live_other)
    phase = "bwd" if kind == "backward" else "fwd"
    return PredictedMemory(kind, phase, names, tuple(weights), tuple(other))


def _size_hints(gm: torch.fx.GraphModule) -> dict:
    """Size symbol -> the value it had when the graph was compiled."""
    hints = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        shape = value.shape if isinstance(value, torch.Tensor) else (value,) if isinstance(value, torch.SymInt) else ()
        for dim in shape:
            if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol) and dim.node.hint is not None:
                hints[dim.node.expr] = int(dim.node.hint)
    return hints


class ResidentSampler:
    """Samples the runtime's resident bytes per tier at every region boundary.

    Use as a context manager around the step to record; `samples` holds the result.
    A sample costs a snapshot of the runtime's figures (about 10 µs), taken only while
    the sampler is active.

    Args:
        interval: also sample every `interval` seconds from a background thread, for
            graphs without region markers (Inductor); None: only at markers.
    """

    def __init__(self, interval: float | None = None):
        self.samples: list[ResidentSample] = []
        self.interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ResidentSampler:
        from slcompile.passes.mark_regions import set_region_listener

        self._sample("start", time.perf_counter())
        set_region_listener(self._on_marker)
        if self.interval is not None:
            self._thread = threading.Thread(target=self._poll, name="slc-resident-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        from slcompile.passes.mark_regions import set_region_listener

        set_region_listener(None)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample("end", time.perf_counter())
        self.samples.sort(key=lambda sample: sample.time)  # timer and markers interleave

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample("timer", time.perf_counter())

    def _on_marker(self, label: str, begin: bool, now: float) -> None:
        self._sample(label, now)

    def _sample(self, label: str, now: float) -> None:
        from slcompile.runtime.stats import runtime_stats

        resident = {tier.value: count for tier, count in runtime_stats().resident_bytes.items()}
        with self._lock:
            self.samples.append(ResidentSample(now, resident, label))
