"""`slcompile.sweep(model, *inputs, policies=[...], options={...})`: every policy under
every combination of option values, each compiled alone, measured and predicted, in
one table that writes CSV and JSON.

Each configuration (a policy and one value of each option of the grid) starts from
`torch._dynamo.reset()` and compiles a deep copy of the model, as
`compare_policies` does for one policy (so Dynamo's recompile limit never turns a
later configuration into an eager run); after the steps `compare_policies` measures
(the compile, the steady state, the peak under the profiler, the recorded step),
`warmup` more steps run untimed and `steps` are timed (wall time; on CUDA up to a
synchronize). No optimizer runs: every step sees the same weights.

Each row holds the measurement (the median, fastest and spread of the timed steps;
the device peak of torch's allocator; the runtime's peak and bytes moved per tier)
and the prediction of the same configuration (the plan's device peak, the step time
on the machine profile with its interval, the bytes the time model moves). A
configuration that fails, or whose graph compiles without sub-batching, has a row
that says so (`compiled` False, `error`) and no figures.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import logging
import pathlib
import statistics
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SweepRow", "SweepTable", "sweep"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One configuration's figures.

    Attributes:
        policy: the policy's name.
        options: the grid's value of each swept option in this configuration.
        compiled: whether the configuration compiled with sub-batching and ran.
        error: why not ("RefusedError: ..."), or None.
        step_seconds: the wall time of each timed step.
        measured_peak_bytes: the device peak of one step (torch's allocator).
        measured_tier_peaks: the runtime's peak bytes resident per tier.
        measured_tier_bytes: bytes moved to and from each tier other than the
            device in one step (the runtime's counters).
        reloaded_bytes: of those, the weight bytes only the measurement loads (its
            prefetches dropped between steps: `PolicyRow.reloaded_bytes`).
        predicted_peak_bytes: the plan's device peak (`CompileReport.memory`).
        predicted_tier_peaks: the plan's peak per tier.
        predicted_step_seconds: the step time on the profile, or None without one.
        predicted_slow_step_seconds: the slow end of its interval
            (`TimePrediction.slow_step_seconds`), or None.
        predicted_bytes: bytes the time model moves per transfer kind.
        predicted_bound: what bounds the predicted step ("compute", "disk", ...).
        loss: the loss of the measured step.
    """

    policy: str
    options: Mapping[str, Any]
    compiled: bool
    error: str | None = None
    step_seconds: tuple[float, ...] = ()
    measured_peak_bytes: int | None = None
    measured_tier_peaks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    measured_tier_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reloaded_bytes: int = 0
    predicted_peak_bytes: int | None = None
    predicted_tier_peaks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    predicted_step_seconds: float | None = None
    predicted_slow_step_seconds: float | None = None
    predicted_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    predicted_bound: str | None = None
    loss: float | None = None

    @property
    def median_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    @property
    def min_seconds(self) -> float | None:
        return min(self.step_seconds) if self.step_seconds else None

    @property
    def spread(self) -> float | None:
        """How far the median step lies beyond the fastest, as a fraction."""
        if not self.step_seconds:
            return None
        return self.median_seconds / self.min_seconds - 1.0

    @property
    def prediction_error(self) -> float | None:
        """The predicted step time over the measured median, less 1."""
        if self.predicted_step_seconds is None or not self.step_seconds:
            return None
        return self.predicted_step_seconds / self.median_seconds - 1.0

    def record(self) -> dict[str, Any]:
        """The row as flat plain data: one key per column of the CSV."""
        record: dict[str, Any] = {"policy": self.policy}
        record.update({f"option.{name}": _plain(value) for name, value in self.options.items()})
        record.update({
            "compiled": self.compiled, "error": self.error, "steps": len(self.step_seconds),
            "median_seconds": self.median_seconds, "min_seconds": self.min_seconds, "spread": self.spread,
            "measured_peak_bytes": self.measured_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_seconds": self.predicted_step_seconds,
            "predicted_slow_step_seconds": self.predicted_slow_step_seconds,
            "prediction_error": self.prediction_error, "predicted_bound": self.predicted_bound,
            "loss": self.loss,
        })
        for tier, n in sorted(self.measured_tier_peaks.items()):
            record[f"measured_peak.{tier}"] = n
        for tier, n in sorted(self.predicted_tier_peaks.items()):
            record[f"predicted_peak.{tier}"] = n
        for tier, n in sorted(self.measured_tier_bytes.items()):
            record[f"measured_moved.{tier}"] = n
        if self.compiled:
            record["reloaded_bytes"] = self.reloaded_bytes
        for kind, n in sorted(self.predicted_bytes.items()):
            record[f"predicted_moved.{kind}"] = n
        return record


def _plain(value: Any) -> Any:
    """An option's value as JSON and CSV hold it: a policy by its name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "name", None) or str(value)


@dataclasses.dataclass(frozen=True)
class SweepTable:
    """The rows of `sweep`, policies outermost, then the grid in the order given.

    Attributes:
        rows: one per configuration.
        profile: the machine profile's `source` the predictions used, or None.
        profile_load: the cores other processes kept busy while it was measured
            (`MachineProfile.load`), or None.
    """

    rows: tuple[SweepRow, ...]
    profile: str | None = None
    profile_load: float | None = None

    def records(self) -> list[dict[str, Any]]:
        return [row.record() for row in self.rows]

    def columns(self) -> list[str]:
        """Every record's keys, in the order they first appear."""
        return list(dict.fromkeys(key for record in self.records() for key in record))

    def best(self) -> SweepRow:
        """The compiled configuration with the fastest median step."""
        timed = [row for row in self.rows if row.compiled and row.step_seconds]
        if not timed:
            raise ValueError("no configuration of this sweep compiled and ran")
        return min(timed, key=lambda row: row.median_seconds)

    def write_csv(self, path: str | pathlib.Path) -> pathlib.Path:
        """One line per configuration, one column per figure (`columns()`); a figure a
        row lacks is empty."""
        path = pathlib.Path(path)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns(), restval="")
            writer.writeheader()
            for record in self.records():
                writer.writerow({key: "" if value is None else value for key, value in record.items()})
        return path

    def write_json(self, path: str | pathlib.Path) -> pathlib.Path:
        """The profile and every row, each with its timed steps."""
        path = pathlib.Path(path)
        rows = [{**row.record(), "step_seconds": list(row.step_seconds)} for row in self.rows]
        path.write_text(json.dumps({"profile": self.profile, "profile_load": self.profile_load, "rows": rows},
                                   indent=1) + "\n")
        return path

    def __str__(self) -> str:
        from slcompile.compare import _format_table
        from slcompile.units import format_bytes

        names = list(dict.fromkeys(name for row in self.rows for name in row.options))
        header = ["policy", *names, "median ms", "min ms", "spread", "predicted ms", "error", "peak", "peak (plan)",
                  "moved", "note"]
        lines = []
        for row in self.rows:
            cells = [row.policy, *(str(_plain(row.options.get(name, "-"))) for name in names)]
            if not row.compiled:
                lines.append(cells + ["-"] * (len(header) - len(cells) - 1) + [f"not compiled: {row.error}"])
                continue
            predicted = "-" if row.predicted_step_seconds is None else f"{row.predicted_step_seconds * 1e3:.2f}"
            if row.predicted_slow_step_seconds is not None:
                predicted += f"-{row.predicted_slow_step_seconds * 1e3:.2f}"
            cells += [f"{row.median_seconds * 1e3:.2f}", f"{row.min_seconds * 1e3:.2f}", f"{row.spread:.0%}",
                      predicted, "-" if row.prediction_error is None else f"{row.prediction_error:+.0%}",
                      format_bytes(row.measured_peak_bytes), format_bytes(row.predicted_peak_bytes),
                      format_bytes(sum(row.measured_tier_bytes.values())), ""]
            lines.append(cells)
        title = f"profile: {self.profile}" if self.profile else "no profile: nothing predicted"
        return title + "\n" + _format_table(header, lines, left=(0, *range(1, len(names) + 1), len(header) - 1))


def sweep(
    model: torch.nn.Module,
    *inputs: Any,
    policies: Any = "speedloader",
    options: Mapping[str, Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    steps: int = 5,
    warmup: int = 1,
    profile: Any = "current",
    **fixed: Any,
) -> SweepTable:
    """Measures and predicts `model(*inputs, **kwargs)`'s training step under every
    policy and every combination of `options`' values.

    Args:
        model: the model; each configuration compiles a deep copy of it.
        *inputs: its positional inputs.
        policies: a policy (a name or a `schedules.Policy`) or a sequence of them.
        options: the grid: each option's value, or a sequence of values
            (`slcompile.config.option_values`); every combination is one configuration.
        kwargs: the model's keyword inputs.
        steps: timed steps per configuration (at least 1).
        warmup: untimed steps before them, after those `compare_policies` measures.
        profile: the machine profile predictions are made on, as `explain`'s
            (a profile measured under load is refused); None: no time predicted.
        **fixed: backend options every configuration shares, one value each.

    Returns:
        the SweepTable: one row per configuration, a failed one saying why.

    Raises:
        ValueError: no policy, `steps` below 1, `schedule` among the options (the
            policies are `policies=`), or an option in both `options` and `fixed`.
        OptionError: a value no compile would accept, before anything is compiled.
        ProfileError: a profile measured under load.
    """
    from slcompile.compare import _cause, _measure, _policy_name, _with_time, predicted_bytes_moved
    from slcompile.config import SpeedLoaderConfig, option_values, single_options

    if steps < 1:
        raise ValueError(f"sweep: steps={steps}: time at least one step")
    grid = dict(options or {})
    if "schedule" in grid or "schedule" in fixed:
        raise ValueError("sweep takes the policies as policies=[...], not the schedule option")
    both = sorted(set(grid) & set(fixed))
    if both:
        raise ValueError(f"sweep: {', '.join(both)} given both in options= (swept) and as a fixed option")
    fixed = single_options(fixed, "sweep")
    policies = tuple(option_values("policies", policies, "sweep"))
    names = [_policy_name(policy) for policy in policies]
    values = {name: option_values(name, value, "sweep") for name, value in grid.items()}
    configurations = [dict(zip(values, combination)) for combination in itertools.product(*values.values())]
    for policy in policies:  # every value checked before anything compiles
        for configuration in configurations:
            SpeedLoaderConfig.from_options({**fixed, **configuration, "schedule": policy})
    machine = None
    if profile is not None:
        from slcompile.measure import machine_profile

        machine = machine_profile(profile, offload_dir=fixed.get("offload_dir"), refuse_untrusted=True)
    rows = []
    for policy, name in zip(policies, names):
        for configuration in configurations:
            options_here = {**fixed, **configuration}
            try:
                measured = _measure(model, inputs, dict(kwargs or {}), options_here, policy, name,
                                    warmup=warmup, timed=steps)
                measured = _with_time(measured, inputs, machine)
            except Exception as err:  # noqa: BLE001  (one configuration's failure is its row)
                cause = _cause(err)
                log.info("sweep: %s %s failed: %s: %s", name, configuration, type(cause).__name__, cause)
                rows.append(SweepRow(name, configuration, compiled=False, error=f"{type(cause).__name__}: {cause}"))
                continue
            time = measured.time
            rows.append(SweepRow(
                policy=name, options=configuration, compiled=True, step_seconds=measured.step_seconds,
                measured_peak_bytes=measured.measured_peak_bytes,
                measured_tier_peaks=dict(measured.measured_tier_peaks),
                measured_tier_bytes=_bytes_by_tier(measured.bytes_moved),
                reloaded_bytes=measured.reloaded_bytes,
                predicted_peak_bytes=measured.plan_peak_bytes,
                predicted_tier_peaks=dict(measured.predicted_tier_peaks),
                predicted_step_seconds=None if time is None else time.step_seconds,
                predicted_slow_step_seconds=None if time is None else time.slow_step_seconds,
                predicted_bytes={} if time is None else predicted_bytes_moved(time),
                predicted_bound=None if time is None else time.bound,
                loss=measured.loss,
            ))
    return SweepTable(tuple(rows), profile=None if machine is None else (machine.source or machine.name),
                      profile_load=None if machine is None else machine.load)


def _bytes_by_tier(moved: Mapping[tuple[str, str, str], int]) -> dict[str, int]:
    """Bytes moved to or from each tier other than the device, per (kind, source,
    destination) summed by the tier that is not the device."""
    tiers: dict[str, int] = {}
    for (_, source, destination), n in moved.items():
        tier = source if destination == "device" else destination
        tiers[tier] = tiers.get(tier, 0) + n
    return dict(sorted(tiers.items()))

