"""Record one step and write every picture of a compiled model into one folder.

Where it sits: the CLI (`slcompile demo`, `slcompile explain --dot/--plot/--trace`)
calls `record_step` around one training step and `write_pictures` afterwards; both
work from the newest `CompileReport` and the runtime's figures, nothing else.

Guarantees:
- `record_step` leaves the runtime's counters alone (no reset): it closes a step
  window before and after (`mark_step`), so the figures it returns are exactly the
  step's, and it keeps the timeline events that finished inside the step.
- `write_pictures` writes only what was asked for and returns the paths it wrote,
  by picture: `forward.dot` (+ `.svg`, `.png` when `dot` exists), `backward.*`,
  `schedule.txt`, `trace.json` (Chrome trace), `timeline.png`, `memory.png`.
- `write_predicted_timeline` needs no step: it writes the time model's timeline
  (`explain(..., profile=...).time`) as `predicted_trace.json` (Chrome trace) and
  `predicted_timeline.png`, beside the measured ones when both are asked for.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence

from slcompile.analysis.memory import allocation_series
from slcompile.runtime.stats import StepStats, TimelineEvent, mark_step, timeline
from slcompile.viz.memory import ResidentSample, ResidentSampler

__all__ = ["RecordedStep", "record_step", "write_pictures", "write_predicted_timeline", "timeline_title", "PICTURES"]

log = logging.getLogger(__name__)

PICTURES = ("dot", "trace", "plot")
"""What `write_pictures` can draw: graphs (DOT), timeline (trace), memory (plot)."""


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """What the runtime recorded during one step.

    Attributes:
        events: timeline events that finished during the step, oldest first.
        samples: resident bytes per tier, sampled at region boundaries.
        stats: the step's byte, transfer, stall and peak figures.
        allocations: with `record_step(..., allocations=True)`, the bytes torch's
            allocator of the step's device held above the step's start, after each
            allocation and free torch.profiler recorded: (`time.perf_counter()`
            seconds, bytes), oldest first. Activations, saved values, gradients and
            everything else the graphs allocate, which the runtime's per-tier
            accounting does not see.
    """

    events: tuple[TimelineEvent, ...]
    samples: tuple[ResidentSample, ...]
    stats: StepStats
    allocations: tuple[tuple[float, int], ...] = ()

    @property
    def allocated_peak_bytes(self) -> int:
        """The most bytes of `allocations` (0 when none were recorded)."""
        return max((n for _, n in self.allocations), default=0)


def record_step(step: Callable[[], object], sample_interval: float | None = None,
                allocations: bool = False) -> RecordedStep:
    """Runs `step()` once while recording the timeline and resident bytes.

    Args:
        step: one training step (forward, backward; an optimizer step if wanted).
        sample_interval: seconds between resident-bytes samples taken on a timer, for
            graphs without region markers (Inductor); None: at the markers only.
        allocations: also record the device allocator's bytes over the step
            (`RecordedStep.allocations`), running it under torch.profiler with
            `profile_memory` (slower).

    Returns:
        what was recorded.
    """
    mark_step()
    started = time.perf_counter()
    with ResidentSampler(sample_interval) as sampler:
        if allocations:
            series = allocation_series(step)
        else:
            series = ()
            step()
    stats = mark_step()
    finished = time.perf_counter()
    events = tuple(e for e in timeline() if started <= e.end <= finished and e.lane != "step")
    return RecordedStep(events, tuple(sampler.samples), stats, series)


def timeline_title(report) -> str:
    """`timeline of one training step, policy zigzag, K=2`: the title of
    `timeline.png`, naming the schedule's policy and its number of sub-batches."""
    config = report.config
    policy = getattr(config, "schedule", None)
    policy = getattr(policy, "name", policy)
    subbatches = getattr(config, "num_subbatches", None)
    return "timeline of one training step" + "".join(
        part for part, value in ((f", policy {policy}", policy), (f", K={subbatches}", subbatches)) if value)


def write_pictures(
    out_dir: str | pathlib.Path,
    report,
    recorded: RecordedStep | None = None,
    pictures: Sequence[str] = PICTURES,
    detail: str = "auto",
) -> dict[str, list[pathlib.Path]]:
    """Writes the pictures of `report` (a CompileReport) into `out_dir`.

    Args:
        out_dir: the folder (created if missing).
        report: the CompileReport of the compiled graph.
        recorded: a recorded step, needed for "trace" and "plot" (without it the memory
            plot shows the prediction only).
        pictures: which of `PICTURES` to write.
        detail: DOT detail, "auto", "ops" or "summary".

    Returns:
        picture name ("forward", "backward", "schedule", "trace", "timeline",
        "memory") -> the paths written.
    """
    from slcompile.viz.dot import graph_digraph, render
    from slcompile.viz.plots import plot_memory, plot_timeline
    from slcompile.viz.trace import chrome_trace, write_chrome_trace

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[pathlib.Path]] = {}
    if report.schedule:
        path = out / "schedule.txt"
        path.write_text(report.schedule + "\n")
        written["schedule"] = [path]
    graphs: Mapping = report.graphs
    if "dot" in pictures:
        for kind, gm in graphs.items():
            title = f"{kind} graph, as compiled"
            if report.fallback_reason:  # the first clause; the whole reason is in `explain`
                title += f" (fallback: {report.fallback_reason.split(':')[0][:80]})"
            written[kind] = render(graph_digraph(gm, title, detail, report.blocks), out / kind)
    if "trace" in pictures and recorded is not None:
        trace = chrome_trace(recorded.events, graphs)
        written["trace"] = [write_chrome_trace(out / "trace.json", recorded.events, graphs)]
        written["timeline"] = [plot_timeline(out / "timeline.png", trace, timeline_title(report))]
    if "plot" in pictures and graphs:
        samples = recorded.samples if recorded is not None else ()
        events = recorded.events if recorded is not None else ()
        allocations = recorded.allocations if recorded is not None else ()
        written["memory"] = [plot_memory(out / "memory.png", graphs, samples, events, memory=report.memory,
                                         allocations=allocations)]
    return written


def write_predicted_timeline(
    out_dir: str | pathlib.Path, prediction, title: str | None = None
) -> dict[str, list[pathlib.Path]]:
    """Writes a predicted timeline into `out_dir`: `predicted_trace.json` (open in
    Perfetto or chrome://tracing) and `predicted_timeline.png`.

    Args:
        out_dir: the folder (created if missing).
        prediction: a `slcompile.analysis.time.TimePrediction` (`explain(...,
            profile=...).time`, `tune(..., profile=...).time`).
        title: the picture's title; default: the policy, K, the profile, the step
            time and its bound.

    Returns:
        "predicted_trace" and "predicted_timeline" -> the paths written.
    """
    from slcompile.viz.plots import plot_timeline
    from slcompile.viz.trace import predicted_chrome_trace, write_predicted_trace

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = title or (f"predicted step, {prediction.title}: {prediction.step_seconds * 1e3:.3f} ms, "
                      f"bound by {prediction.bound}")
    return {
        "predicted_trace": [write_predicted_trace(out / "predicted_trace.json", prediction)],
        "predicted_timeline": [plot_timeline(out / "predicted_timeline.png", predicted_chrome_trace(prediction),
                                             title)],
    }
