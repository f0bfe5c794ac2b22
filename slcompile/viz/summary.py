"""Short text forms for the terminal: the schedule in one line per phase, byte counts.

Where it sits: the CLI prints these; the full schedule text (one line per step,
`fwd blk3.sb1`) stays the reference form, written next to the pictures.

Guarantees: `summarize_schedule` is a pure function of the schedule text, and
expanding its ranges gives back the steps in their order, except in a run whose
sub-batches alternate (the ops of a region that runs outside the compiled blocks,
such as the loss's backward, mixed across sub-batches by the partitioner): that run
is written with the sub-batches it covers and its step count.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from slcompile.viz.roles import format_bytes

__all__ = ["summarize_schedule", "summarize_bytes"]


def summarize_schedule(schedule: str) -> str:
    """`fwd prefix.sb0-3 blk0.sb0-3 ... suffix.sb0-3` and `bwd suffix.sb3-0 ...`.

    Args:
        schedule: the schedule text, one step per line (`fwd blk3.sb1`).

    Returns:
        one line per phase; runs of one region over consecutive sub-batches are
        written as a range (`blk0.sb0-3`, in the order they run); a run whose
        sub-batches alternate as `suffix.sb0-3 interleaved (8 steps)`.
    """
    runs: dict[str, list[tuple[str, list[int | None]]]] = collections.OrderedDict()
    for line in schedule.splitlines():
        words = line.split()
        if len(words) != 2 or words[0] == "recompute":
            continue  # a transfer step (`fwd fetch.wait blk3`), the units recomputed: the summary is compute
        phase, tag = words[0], words[-1]
        head, _, sub = tag.partition(".sb")
        subbatch = int(sub) if sub.isdigit() else None
        phase_runs = runs.setdefault(phase, [])
        if phase_runs and phase_runs[-1][0] == head and subbatch is not None and None not in phase_runs[-1][1]:
            phase_runs[-1][1].append(subbatch)
        else:
            phase_runs.append((head, [subbatch]))
    lines = []
    for phase, phase_runs in runs.items():
        lines.append(f"{phase} " + " ".join(_run_text(head, subs) for head, subs in phase_runs))
    return "\n".join(lines)


def _run_text(head: str, subbatches: list[int | None]) -> str:
    if subbatches == [None]:
        return head
    if len(subbatches) == 1:
        return f"{head}.sb{subbatches[0]}"
    step = subbatches[1] - subbatches[0]
    consecutive = step in (1, -1) and all(b - a == step for a, b in zip(subbatches, subbatches[1:]))
    if consecutive:
        return f"{head}.sb{subbatches[0]}-{subbatches[-1]}"
    covered = sorted(set(subbatches))
    if len(covered) == len(subbatches):
        return f"{head}.sb" + ",".join(str(s) for s in subbatches)
    span = (f"sb{covered[0]}-{covered[-1]}" if covered == list(range(covered[0], covered[-1] + 1))
            else "sb" + ",".join(map(str, covered)))
    return f"{head}.{span} interleaved ({len(subbatches)} steps)"


def summarize_bytes(bytes_moved: Mapping, transfers: Mapping) -> str:
    """`weight nvme->device 1.5 MB in 80 transfers`, one clause per (kind, tiers).

    Args:
        bytes_moved: `StepStats.bytes_moved`.
        transfers: `StepStats.transfers`.

    Returns:
        the clauses joined by "; ", or "nothing" when no bytes moved.
    """
    clauses = []
    for key in sorted(bytes_moved, key=lambda k: tuple(str(getattr(p, "value", p)) for p in k)):
        kind, source, destination = (getattr(part, "value", part) for part in key)
        clauses.append(f"{kind} {source}->{destination} {format_bytes(bytes_moved[key])} "
                       f"in {transfers.get(key, 0)} transfers")
    return "; ".join(clauses) or "nothing"
