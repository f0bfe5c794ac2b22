"""`slcompile.compare_policies(model, *inputs, policies=[...], **options)`: scheduling
policies side by side on one model, measured in one process.

Each policy compiles its own deep copy of the model (the model passed in is not
changed) with the same options but `schedule`, after `torch._dynamo.reset()`, and runs
training steps (forward, backward of the loss; no optimizer, so every step sees the
same weights):

1. the first step compiles; a second one reaches the steady state (the prefetch plan
   has gone round once);
2. two steps are measured with torch's CPU allocator through `torch.profiler`, with
   loads placed in allocator memory (`buffers_seen_by_profiler`, as
   bench/memory_bench.py measures), and the smaller peak is kept (a first profiled
   step can include one-time allocations);
3. one more step is recorded (`viz.record_step`): the bytes moved per kind and tiers,
   the number of transfers, the runtime ledger's peak per tier, the timeline.

After every backward the weights loaded ahead for the next step are waited for and
dropped (`drain_prefetches`), so the figures do not depend on how fast the disk
answered; the next step loads them again, and `PolicyRow.reloaded_bytes` says how
many bytes that adds to a step's weight loads. The copy and its compiled graphs are released before the next policy
starts: a policy's figures are the ones it gets compiled alone in a fresh process.

A policy that fails (its schedule refused, the graph compiled plainly, any error
while it compiles or runs) gets a row of its own with the error's type and message
(`PolicyRow.error`) and no figures; the other policies' rows are kept. When every
policy fails there is nothing to compare: the first one's error is raised.

With `run=False` nothing compiles to code and no step runs: each policy's row holds
what `explain` predicts for the same options (the plan's device peak and tier peaks,
the bytes each kind of transfer moves and the step time on the machine profile), so
a model on the meta device (no weights) can be compared, and `ranked()` orders the
policies by those predictions.

Guarantees: the rows follow `policies` in order; every figure is a plain number,
the same from one run to the next for the same model, inputs and options.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from slcompile.units import format_bytes

__all__ = ["PolicyRow", "PolicyComparison", "compare_policies", "loss_of", "predicted_bytes_moved"]

log = logging.getLogger(__name__)

TransferColumn = tuple[str, str, str]
"""(kind, source tier, destination tier): `("weight", "nvme", "device")`."""


@dataclasses.dataclass(frozen=True)
class PolicyRow:
    """One policy's figures on the model.

    Attributes:
        policy: the policy's name.
        schedule: the schedule read back from the compiled graphs (one line per step).
        loss: the loss of the measured step (equal across policies up to rounding).
        predicted_peak_bytes: the device bytes the step allocates at its peak, as the
            memory model predicts it for the step as measured here: loads in
            allocator memory, one page of alignment slack each
            (`MachineFacts.load_overhead` of a page).
        measured_peak_bytes: the same, measured: the peak of torch's CPU allocator over
            one step, relative to its start (`analysis.memory.measured_peak_bytes`).
        plan_peak_bytes: the plan's own prediction, without the measurement's slack
            (`CompileReport.memory.step_peak_bytes`, what `explain` prints as "step").
        predicted_tier_peaks: the plan's peak per tier (`MemoryPrediction.peak_bytes`).
        measured_tier_peaks: the runtime ledger's peak bytes resident per tier in the
            recorded step (`StepStats.peak_bytes`: what the transfer engine holds, not
            the graphs' activations), less what rested there before the policy's copy
            was made (other models of the process).
        bytes_moved: bytes per (kind, source tier, destination tier) in the recorded step.
        transfers: transfers per the same key.
        report: the `CompileReport` of the policy's graph (the last one compiled, for
            a model Dynamo captures in several).
        recorded: the recorded step (`viz.RecordedStep`), for the timeline.
        time: the time model's prediction of the step on the comparison's machine
            profile (`analysis.time.TimePrediction`), or None without a profile. Not
            among `figures()`: a profile measured on another run gives other times.
        error: why the policy has no figures ("PolicyError: schedule policy ..."),
            or None.
        ran: whether a step ran (False: `compare_policies(..., run=False)`; the
            measured figures and the predicted-as-measured peak are then None and
            the mappings of measured bytes empty).
        step_seconds: the wall time of each timed step (`slcompile.sweep` times
            some after the measured ones; `compare_policies` none).
        reloaded_bytes: weight bytes the recorded step loaded ahead for the next
            step, dropped after it (`drain_prefetches`, as after every measured
            step); the recorded step loaded as many again where the previous step's
            were dropped, so its weight loads less these are those of a step of
            training, which the time model predicts (`predicted_bytes_moved`'s
            "fetch").

    A failed row (`error` set) has None or empty figures and an empty schedule.
    """

    policy: str
    schedule: str = ""
    loss: float | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    plan_peak_bytes: int | None = None
    predicted_tier_peaks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    measured_tier_peaks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    bytes_moved: Mapping[TransferColumn, int] = dataclasses.field(default_factory=dict)
    transfers: Mapping[TransferColumn, int] = dataclasses.field(default_factory=dict)
    report: Any = dataclasses.field(default=None, repr=False, compare=False)
    recorded: Any = dataclasses.field(default=None, repr=False, compare=False)
    time: Any = dataclasses.field(default=None, repr=False, compare=False)
    error: str | None = None
    ran: bool = True
    step_seconds: tuple[float, ...] = ()
    reloaded_bytes: int = 0

    @classmethod
    def failed(cls, policy: str, error: BaseException, *, ran: bool = True) -> PolicyRow:
        """The row of a policy that raised `error`."""
        return cls(policy=policy, error=f"{type(error).__name__}: {error}", ran=ran)

    @property
    def predicted_bytes_moved(self) -> dict[str, int] | None:
        """Bytes per transfer kind ("fetch", "stash", "unstash", "store_grad", ...)
        the time model moves in the step (`predicted_bytes_moved`), or None without
        a prediction of time."""
        return None if self.time is None else predicted_bytes_moved(self.time)

    @property
    def predicted_step_seconds(self) -> float | None:
        return None if self.time is None else self.time.step_seconds

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_moved.values())

    @property
    def total_transfers(self) -> int:
        return sum(self.transfers.values())

    def bytes_of(self, kind: str) -> int:
        """Bytes moved of one kind ("weight", "activation", "gradient", ...), all tiers."""
        return sum(n for (k, _, _), n in self.bytes_moved.items() if k == kind)

    def figures(self) -> dict[str, Any]:
        """The row's numbers as plain data (no report, no timeline): what the tests
        compare between processes."""
        return {
            "policy": self.policy, "error": self.error, "loss": self.loss,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes, "plan_peak_bytes": self.plan_peak_bytes,
            "predicted_tier_peaks": dict(self.predicted_tier_peaks),
            "measured_tier_peaks": dict(self.measured_tier_peaks),
            "bytes_moved": {"{} {}->{}".format(*key): n for key, n in sorted(self.bytes_moved.items())},
            "transfers": {"{} {}->{}".format(*key): n for key, n in sorted(self.transfers.items())},
            "reloaded_bytes": self.reloaded_bytes,
        }


def predicted_bytes_moved(time) -> dict[str, int]:
    """Bytes per transfer kind in a predicted timeline (`TimePrediction`): what its
    transfer events move, summed by kind, sorted by kind."""
    moved: dict[str, int] = {}
    for event in time.events:
        if event.lane != "compute":
            moved[event.kind] = moved.get(event.kind, 0) + event.nbytes
    return dict(sorted(moved.items()))


@dataclasses.dataclass(frozen=True)
class PolicyComparison:
    """The rows of `compare_policies`, in the order the policies were given.

    `str(comparison)` is the table followed by the schedule diff of the first two
    policies; `write(out_dir)` writes them and the pictures.
    """

    rows: tuple[PolicyRow, ...]

    def __getitem__(self, policy: str) -> PolicyRow:
        for row in self.rows:
            if row.policy == policy:
                return row
        raise KeyError(f"no policy {policy!r} in this comparison (policies: {', '.join(self.policies)})")

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(row.policy for row in self.rows)

    def columns(self) -> tuple[TransferColumn, ...]:
        """Every (kind, source, destination) that moved bytes under some policy, sorted."""
        return tuple(sorted({key for row in self.rows for key, n in row.bytes_moved.items() if n}))

    def ranked(self) -> tuple[PolicyRow, ...]:
        """The rows from the best prediction to the worst: by the plan's device peak,
        then the bytes the time model moves, then the predicted step time (a figure
        not predicted counts as the worst); failed rows last, in their order."""
        def key(row: PolicyRow):
            moved = row.predicted_bytes_moved
            return (row.plan_peak_bytes if row.plan_peak_bytes is not None else float("inf"),
                    sum(moved.values()) if moved is not None else float("inf"),
                    row.predicted_step_seconds if row.predicted_step_seconds is not None else float("inf"))

        return tuple(sorted((r for r in self.rows if r.error is None), key=key)) + \
            tuple(r for r in self.rows if r.error is not None)

    def table(self) -> str:
        """One line per policy: peaks predicted and measured, bytes per kind and tiers,
        transfers, loss, and the predicted step time and its bound when a machine
        profile was given; the error of a policy that failed; fixed-width plain
        text. Without a step run (`run=False`): the plan's peaks, the bytes the time
        model moves per kind and the predicted time, ranked (`ranked()`)."""
        if not any(row.ran for row in self.rows):
            return self._predicted_table()
        header = ["policy", "peak predicted", "peak measured", "peak (plan)"]
        tiers = sorted({t for row in self.rows for t, n in {**row.predicted_tier_peaks, **row.measured_tier_peaks}.items()
                        if n and t != "device"})
        header += [f"{tier} held pred/meas" for tier in tiers]
        columns = self.columns()
        header += ["{} {}->{}".format(*key) for key in columns]
        timed = any(row.time is not None for row in self.rows)
        reloaded = any(row.reloaded_bytes for row in self.rows)
        header += ["transfers", "moved"] + (["reloaded"] if reloaded else []) + ["loss"]
        header += ["step predicted", "bound"] if timed else []
        failed = any(row.error is not None for row in self.rows)
        header += ["error"] if failed else []
        lines = []
        for row in self.rows:
            if row.error is not None:
                lines.append([row.policy] + ["-"] * (len(header) - 2) + [row.error])
                continue
            cells = [row.policy, format_bytes(row.predicted_peak_bytes), format_bytes(row.measured_peak_bytes),
                     format_bytes(row.plan_peak_bytes)]
            cells += [f"{format_bytes(row.predicted_tier_peaks.get(t, 0))} / {format_bytes(row.measured_tier_peaks.get(t, 0))}"
                      for t in tiers]
            cells += [f"{format_bytes(row.bytes_moved.get(key, 0))} ({row.transfers.get(key, 0)})" for key in columns]
            cells += [str(row.total_transfers), format_bytes(row.total_bytes)]
            cells += [format_bytes(row.reloaded_bytes)] if reloaded else []
            cells += ["-" if row.loss is None else f"{row.loss:.6f}"]
            if timed:
                cells += ["-", "-"] if row.time is None else [f"{row.time.step_seconds * 1e3:.2f} ms", row.time.bound]
            lines.append(cells + ([""] if failed else []))
        return _format_table(header, lines, left=(0, len(header) - 1) if failed else (0,))

    def _predicted_table(self) -> str:
        kinds = sorted({kind for row in self.rows for kind, n in (row.predicted_bytes_moved or {}).items() if n})
        tiers = sorted({t for row in self.rows for t, n in row.predicted_tier_peaks.items() if n and t != "device"})
        header = ["policy", "peak (plan)", *(f"{tier} held" for tier in tiers), *(f"{kind} moved" for kind in kinds),
                  "moved", "step predicted", "bound"]
        failed = any(row.error is not None for row in self.rows)
        header += ["error"] if failed else []
        lines = []
        for row in self.ranked():
            if row.error is not None:
                lines.append([row.policy] + ["-"] * (len(header) - 2) + [row.error])
                continue
            moved = row.predicted_bytes_moved
            cells = [row.policy, format_bytes(row.plan_peak_bytes),
                     *(format_bytes(row.predicted_tier_peaks.get(tier, 0)) for tier in tiers),
                     *("-" if moved is None else format_bytes(moved.get(kind, 0)) for kind in kinds),
                     "-" if moved is None else format_bytes(sum(moved.values()))]
            cells += ["-", "-"] if row.time is None else [f"{row.time.step_seconds * 1e3:.2f} ms", row.time.bound]
            lines.append(cells + ([""] if failed else []))
        return _format_table(header, lines, left=(0, len(header) - 1) if failed else (0,))

    def _compiled(self) -> tuple[PolicyRow, ...]:
        """The rows of the policies that did not fail."""
        return tuple(row for row in self.rows if row.error is None)

    def schedule_diff(self, first: str | None = None, second: str | None = None, context: int = 3) -> str:
        """Unified diff of two policies' schedules (default: the first two given that
        did not fail), one line per step; empty when they are the same."""
        compiled = self._compiled()
        if len(compiled) < 2 and (first is None or second is None):
            return ""
        a = self[first] if first is not None else compiled[0]
        b = self[second] if second is not None else compiled[1]
        return "\n".join(difflib.unified_diff(a.schedule.splitlines(), b.schedule.splitlines(),
                                              fromfile=a.policy, tofile=b.policy, n=context, lineterm=""))

    def dot(self, policy: str, kind: str = "forward", detail: str = "summary") -> str:
        """DOT text of one policy's compiled graph (`viz.dot.graph_to_dot`): sub-batch
        boxes in the order they run, the bytes of every transfer."""
        from slcompile.viz.dot import graph_to_dot

        report = self[policy].report
        return graph_to_dot(report.graphs[kind], f"{policy}: {kind} graph", detail, report.blocks)

    def write(self, out_dir: str | pathlib.Path, detail: str = "summary") -> dict[str, list[pathlib.Path]]:
        """Writes `table.txt`, `schedule.diff` (each policy against the first), one
        folder per policy with its pictures (`viz.write_pictures`: forward and
        backward DOT, schedule.txt, trace.json, timeline.png) and `timelines.png`,
        the policies' timelines one above the other, transfers coloured by kind.

        A failed policy has its line in the table, and no diff or pictures; a
        comparison without a step run (`run=False`) writes the table and the diffs.

        Returns:
            name -> paths written ("table", "diff", "timelines", and per policy
            `policy/forward`, `policy/backward`, ...).
        """
        from slcompile.viz.pictures import write_pictures
        from slcompile.viz.plots import plot_timelines
        from slcompile.viz.trace import chrome_trace

        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written: dict[str, list[pathlib.Path]] = {}
        (out / "table.txt").write_text(self.table() + "\n")
        written["table"] = [out / "table.txt"]
        compiled = self._compiled()
        diffs = [self.schedule_diff(compiled[0].policy, row.policy) for row in compiled[1:]]
        (out / "schedule.diff").write_text("".join(d + "\n" for d in diffs if d))
        written["diff"] = [out / "schedule.diff"]
        ran = [row for row in compiled if row.ran]
        for row in ran:
            folder = out / _folder_name(row.policy)
            for name, paths in write_pictures(folder, row.report, row.recorded, ("dot", "trace"), detail).items():
                written[f"{row.policy}/{name}"] = paths
        if ran:
            traces = {row.policy: chrome_trace(row.recorded.events, row.report.graphs) for row in ran}
            written["timelines"] = [plot_timelines(out / "timelines.png", traces)]
        return written

    def __str__(self) -> str:
        diff = self.schedule_diff()
        text = self.table()
        compiled = self._compiled()
        if len(compiled) > 1:
            text += "\n\n" + (diff if diff else f"the schedules of {compiled[0].policy} and {compiled[1].policy} "
                                                 "are the same")
        return text


def _format_table(header: list[str], lines: list[list[str]], left: tuple[int, ...]) -> str:
    """Fixed-width columns; those in `left` left-aligned, the others right-aligned."""
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]

    def format_line(cells):
        return "  ".join(cell.ljust(width) if i in left else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([format_line(header), format_line(["-" * w for w in widths]), *map(format_line, lines)])


def compare_policies(
    model: torch.nn.Module,
    *inputs: Any,
    policies: Any,
    kwargs: Mapping[str, Any] | None = None,
    profile: Any = "current",
    run: bool = True,
    **options: Any,
) -> PolicyComparison:
    """Compiles `model` once per policy and measures a training step of each (or,
    with `run=False`, predicts it as `explain` does).

    Args:
        model: the model; each policy compiles a deep copy of it.
        *inputs: its positional inputs.
        policies: a policy name (registered with `schedules.register_policy`, or
            built in) or `schedules.Policy` object, or a sequence of them, at least
            one; names must differ.
        kwargs: its keyword inputs.
        profile: the machine profile each step's time is predicted on
            (`slcompile.profile.machine_profile`: "current", a named profile, a
            path or a `MachineProfile`); None: no prediction of time.
        run: False: compile nothing to code and run no step; each row holds what
            `explain(model, *inputs, schedule=policy, profile=profile, **options)`
            predicts (`plan_peak_bytes`, `predicted_tier_peaks`, `time`, and from it
            `predicted_bytes_moved`), so the model may be on the meta device.
        **options: backend options shared by every policy (as in
            `torch.compile(..., options=...)`), without `schedule`; each takes one
            value, or a sequence of one (`slcompile.config.option_values`).

    Returns:
        the PolicyComparison, one row per policy. A policy that fails (its schedule
        refused: a `CompileError` around its `PolicyError`; its graph compiled
        without sub-batching: a `RefusedError`; any other error) has a row with the
        error's type and message (`PolicyRow.error`) and no figures.

    Raises:
        ValueError: no policy, two with one name, or `schedule` among the options.
        OptionError: an option (or a policy name) that no compile would accept.
        Exception: the first policy's error when every policy fails (a model the
            backend refuses: `RefusedError`; a lone policy's schedule refused:
            `CompileError` around its `PolicyError`).
    """
    from slcompile.config import SpeedLoaderConfig, single_options

    # One policy or a sequence of them (repeated names are refused below, not merged).
    policies = tuple(policies) if isinstance(policies, (list, tuple, range)) else (policies,)
    if not policies or policies == (None,):
        raise ValueError("compare_policies needs at least one policy (policies=['speedloader', ...])")
    if "schedule" in options:
        raise ValueError("compare_policies takes the policies as policies=[...], not the schedule option")
    options = single_options(options, "compare_policies")
    names = [_policy_name(p) for p in policies]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"compare_policies: each policy once, got {', '.join(map(repr, repeated))} more than once")
    for policy in policies:
        SpeedLoaderConfig.from_options({**options, "schedule": policy})  # every option checked before compiling
    machine = None
    if profile is not None:
        from slcompile.measure import machine_profile

        machine = machine_profile(profile, offload_dir=options.get("offload_dir"), refuse_untrusted=True)
    rows, errors = [], []
    for policy, name in zip(policies, names):
        try:
            if run:
                row = _with_time(_measure(model, inputs, dict(kwargs or {}), options, policy, name), inputs, machine)
            else:
                row = _predict(model, inputs, dict(kwargs or {}), options, policy, name, machine)
        except Exception as err:  # noqa: BLE001  (one policy's failure is its row, not the comparison's)
            log.info("compare_policies: policy %r failed: %s: %s", name, type(err).__name__, err)
            row = PolicyRow.failed(name, _cause(err), ran=run)
            errors.append(err)
        rows.append(row)
    if len(errors) == len(rows):
        raise errors[0]  # nothing to compare: the first policy's error, as compiling it alone would raise
    return PolicyComparison(tuple(rows))


def _predict(model, inputs, kwargs, options, policy, name, machine) -> PolicyRow:
    """The row of `explain`'s predictions for one policy (no step runs)."""
    from slcompile.errors import RefusedError
    from slcompile.explain import explain

    torch._dynamo.reset()
    explanation = explain(model, *inputs, kwargs=kwargs, profile=machine, **{**options, "schedule": policy})
    graph = next((g for g in explanation.graphs if g.fallback_reason is None and g.memory is not None), None)
    if graph is None:
        reason = explanation.graphs[0].fallback_reason if explanation.graphs else "Dynamo captured no graph"
        raise RefusedError(f"policy {name!r}: the graph would compile without sub-batching, so no schedule to "
                           f"compare ({reason or explanation.graphs[0].budget_error})")
    return PolicyRow(
        policy=name,
        schedule=graph.schedule,
        plan_peak_bytes=int(graph.memory.step_peak_bytes),
        predicted_tier_peaks=dict(graph.predicted_peak_bytes),
        time=graph.time,
        ran=False,
    )


def _cause(error: BaseException) -> BaseException:
    """The error `torch.compile` wrapped (a `PolicyError` inside a `CompileError`), or
    `error` itself."""
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception
    return error


def _policy_name(policy: Any) -> str:
    return policy if isinstance(policy, str) else getattr(policy, "name", repr(policy))


def _folder_name(policy: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in policy)


def loss_of(output: Any) -> torch.Tensor | None:
    """The value to backpropagate: a `.loss`, a scalar that needs a gradient, or the
    sum of the first output that needs one; None when nothing does (inference)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    values = output if isinstance(output, (tuple, list)) else (output.to_tuple() if hasattr(output, "to_tuple") else (output,))
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
    for tensor in tensors:
        if tensor.dim() == 0:
            return tensor
    return tensors[0].float().sum() if tensors else None


def _measure(model, inputs, kwargs, options, policy, name, warmup: int = 0, timed: int = 0) -> PolicyRow:
    """The measured row of one policy; with `timed`, that many more steps timed
    after `warmup` untimed ones (`PolicyRow.step_seconds`), loads issued ahead
    left to the next step as in training."""
    from slcompile.analysis.memory import measured_peak_bytes
    from slcompile.report import compile_reports
    from slcompile.runtime import collect_garbage
    from slcompile.runtime.storage.nvme import buffers_seen_by_profiler
    from slcompile.runtime.stats import runtime_stats
    from slcompile.runtime.weights import drain_prefetches, forget_weights
    from slcompile.viz.pictures import record_step

    torch._dynamo.reset()
    collect_garbage()  # runtime objects of graphs the reset dropped go now, not mid-measurement
    # What rests on the tiers before this copy exists (other models of the process)
    # is not this policy's.
    resident_before = dict(runtime_stats().resident_bytes)
    replica = copy.deepcopy(model)
    compiled = torch.compile(replica, backend="speedloader", options={**options, "schedule": policy})
    losses: list[float] = []

    def clear_gradients() -> None:
        for param in replica.parameters():
            param.grad = None

    dropped: list[int] = []

    def step() -> None:
        output = compiled(*inputs, **kwargs)
        loss = loss_of(output)
        if loss is not None:
            loss.backward()
            losses.append(float(loss.detach()))
        # Loads issued ahead for the next step are waited for here, not by the disk's pace.
        dropped.append(drain_prefetches())

    earlier = {id(report) for report in compile_reports()}  # a bounded history: not by position
    peaks = []
    try:
        with buffers_seen_by_profiler():
            for _ in range(2):
                clear_gradients()
                step()
            reports = [report for report in compile_reports() if id(report) not in earlier]
            for _ in range(2):
                # The last step's gradients are freed outside the window: a free inside it
                # would lower the running sum the peak is read from.
                clear_gradients()
                peaks.append(measured_peak_bytes(step))
            clear_gradients()
            recorded = record_step(step, allocations=True)
        step_seconds = []
        for i in range(warmup + timed):
            clear_gradients()
            start = time.perf_counter()
            output = compiled(*inputs, **kwargs)
            loss = loss_of(output)
            if loss is not None:
                loss.backward()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if i >= warmup:
                step_seconds.append(time.perf_counter() - start)
        drain_prefetches()
    finally:
        # The copy's stored weights go before the next policy starts, whatever happened.
        forget_weights(replica)
    if not reports:
        raise RuntimeError(f"policy {name!r}: the model compiled no graph with the speedloader backend")
    report = reports[-1]
    if report.fallback_reason is not None:
        from slcompile.errors import RefusedError

        raise RefusedError(f"policy {name!r}: the graph compiled without sub-batching, so no schedule to "
                           f"compare ({report.fallback_reason})")
    stats = recorded.stats
    row = PolicyRow(
        policy=name,
        schedule=report.schedule,
        loss=losses[-1] if losses else None,
        predicted_peak_bytes=_predicted_as_measured(report),
        measured_peak_bytes=int(min(peaks)),
        plan_peak_bytes=int(report.memory.step_peak_bytes) if report.memory is not None else 0,
        predicted_tier_peaks=dict(report.memory.peak_bytes) if report.memory is not None else {},
        measured_tier_peaks={tier.value: int(n - resident_before.get(tier, 0)) for tier, n in stats.peak_bytes.items()},
        bytes_moved={_column(key): int(n) for key, n in stats.bytes_moved.items() if n},
        transfers={_column(key): int(n) for key, n in stats.transfers.items() if n},
        report=report,
        recorded=recorded,
        step_seconds=tuple(step_seconds),
        reloaded_bytes=dropped[-1],
    )
    del compiled, replica
    torch._dynamo.reset()
    collect_garbage()
    return row


def _with_time(row: PolicyRow, inputs: Sequence[Any], machine) -> PolicyRow:
    """`row` with the predicted time of its step on `machine` (None: as it is)."""
    from slcompile.explain import report_time

    if machine is None or "forward" not in (row.report.partitioned or row.report.graphs):
        return row
    tokens = next((int(x.numel()) for x in inputs if isinstance(x, torch.Tensor) and not x.is_floating_point()), None)
    return dataclasses.replace(row, time=report_time(row.report, row.report.config, machine, tokens=tokens))


def _predicted_as_measured(report) -> int:
    """The memory model's step peak with loads placed as `buffers_seen_by_profiler`
    places them: whole pages, plus one page of slack each."""
    from slcompile.analysis.machine import MachineFacts
    from slcompile.analysis.memory import predict_step_memory
    from slcompile.runtime.storage.tiers import PAGE_BYTES

    live_blocks = report.config.live_blocks if report.streamed_bytes else 1
    prediction = predict_step_memory(report.graphs, live_blocks=live_blocks,
                                     machine=MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES))
    return int(prediction.step_peak_bytes) if prediction is not None else 0


def _column(key) -> TransferColumn:
    kind, source, destination = key
    return tuple(getattr(x, "value", x) for x in (kind, source, destination))
