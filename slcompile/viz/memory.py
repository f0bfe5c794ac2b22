"""Resident bytes over a step: predicted from the compiled graphs, measured by the runtime.

Where it sits: the CLI records one training step with `ResidentSampler` running,
then `plots.plot_memory` draws both series; this module computes them.

Predicted (`predict_live_bytes`): the memory model (`analysis.memory`, from the
lifetimes of the compiled forward and backward graphs) gives the bytes live at each
node by kind; the plot draws fetched weights (`slc::fetch_weight`) apart from
everything else the graphs make (activations, saved values, gradients). Parameters
and the user's inputs are held by the caller and not counted. Symbolic sizes are
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

import torch
import torch.fx

from slcompile.analysis.memory import GraphMemory as PredictedMemory
from slcompile.analysis.memory import MemoryPrediction

__all__ = ["DeviceLayers", "PredictedMemory", "ResidentSample", "ResidentSampler", "device_layers", "predict_live_bytes"]

log = logging.getLogger(__name__)


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
    """Live bytes at each node of the compiled graphs: the memory model's per-node
    series (`slcompile.analysis.memory.predict_step_memory`).

    Args:
        graphs: the compiled graphs by kind (`CompileReport.graphs`): "forward" and
            "backward" are analysed as one training step; else the "inference" (or
            "forward") graph alone.

    Returns:
        one PredictedMemory per graph, in the order they run (`.weights`: fetched
        weights, `.other`: everything else the graph makes, per node).
    """
    from slcompile.analysis.memory import predict_step_memory

    prediction = predict_step_memory(graphs)
    return prediction.graphs if prediction is not None else ()


@dataclasses.dataclass(frozen=True)
class DeviceLayers:
    """A step's predicted device bytes per node, in three stacked layers.

    Attributes:
        graphs: per graph in the order they run, (kind, node names).
        held: what the caller holds through the step (resident parameters, buffers
            and inputs; in the backward also the forward's outputs), per node.
        weights: streamed weights on the device, fetched or loaded ahead, per node.
        other: everything else the graphs make (activations, saved values,
            gradients), per node.
    """

    graphs: tuple[tuple[str, tuple[str, ...]], ...]
    held: tuple[int, ...]
    weights: tuple[int, ...]
    other: tuple[int, ...]

    @property
    def peak(self) -> int:
        """The largest stacked total: `MemoryPrediction.peak_bytes["device"]`."""
        return max((h + w + o for h, w, o in zip(self.held, self.weights, self.other)), default=0)


def device_layers(prediction: MemoryPrediction) -> DeviceLayers:
    """The prediction's device bytes per node as the memory plot stacks them; their
    peak is the device peak `explain`, the report and `tune` give."""
    held: list[int] = []
    weights: list[int] = []
    other: list[int] = []
    for memory in prediction.graphs:
        zeros = (0,) * len(memory.nodes)
        caller = memory.live.get("outputs_held", zeros)
        ahead = memory.live.get("prefetched", zeros)
        held += [prediction.held_bytes + c for c in caller]
        weights += [w + a for w, a in zip(memory.weights, ahead)]
        other += list(memory.other)
    graphs = tuple((memory.kind, memory.nodes) for memory in prediction.graphs)
    return DeviceLayers(graphs, tuple(held), tuple(weights), tuple(other))


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
        from slcompile.runtime.ops import set_region_listener

        self._sample("start", time.perf_counter())
        set_region_listener(self._on_marker)
        if self.interval is not None:
            self._thread = threading.Thread(target=self._poll, name="slc-resident-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        from slcompile.runtime.ops import set_region_listener

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
