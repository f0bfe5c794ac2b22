"""Host time of a training step where compute is small: speedloader against plain
Inductor on a launch-bound model, the CPU counterpart of the GPU's host-bound step.

Usage:
    python bench/overhead_bench.py [--steps 30] [--out bench/results/overhead_bench.json]
    python bench/overhead_bench.py --quick        # 5 steps a row, results in a temp dir
    python bench/overhead_bench.py --wrapper      # Inductor's Python against its C++ wrapper
    python bench/overhead_bench.py --launch-bound # host items per block visit, the GPU's host time predicted

Model: a Hugging Face Llama from a config (2 layers, hidden 64, intermediate 128, 4
heads, vocabulary 32000), batch 8 x 32, float32, Inductor, one compute thread: the
step is milliseconds, most of it the head and the loss over the real vocabulary, so
every piece the backend adds on the host shows.

Rows, compiled in one process and timed round-robin (one step of each a round, so
that a burst of load falls on all of them alike): plain `torch.compile`
(Inductor); speedloader K=1 and K=4 with everything on the device;
K=4 with the block weights on host (the device's own memory on a CPU machine: no
transfer) and on nvme; K=4 with every saved activation on nvme, and the same step
with every saved activation left on the device.

Per row: the median (and the least) over `--steps` rounds of the compute thread's
CPU time (`time.thread_time`, what the host spends whatever else runs) and the
median wall time;
from `PROFILED_STEPS` steps under `torch.profiler` (`slcompile.step_profile`), the
operators run outside compiled code by namespace (eager prims and aten ops; autograd's
`.grad` accumulation apart), the median host microseconds of each `slc::` op over
their calls, and the host microseconds per activation stored or loaded (its issue and
its wait) and per weight loaded (its issue), the median of the steps'; and, for
speedloader rows, the step the time model predicts (`predict_time`, lowering
"inductor", on a profile measured first in the parent process with one thread and
`steps=True`), and its error against the least step (`prediction_error`: the
profile's rates are best-of, as in time_bench, so the model predicts a step that no
other process slowed) and against the median (`prediction_error_to_median`).

With `--wrapper` (results in overhead_bench_wrapper.json) the rows are plain
Inductor and speedloader K=4 compiled flat (`compile_regions=False`), each with
Inductor's Python wrapper and with its C++ wrapper (`cpp_wrapper`, set while the
step compiles), and K=4 with outlined regions: how much of K=4's extra host time is
the wrapper's per-kernel calls. Outlined regions cannot take the C++ wrapper
(Inductor has no `invoke_subgraph` for it).

With `--launch-bound` (results in overhead_bench_launch_bound.json) the model is the
GPU check's layout at a size where the host is the whole step (4 layers, hidden 64,
vocabulary 256: a 32,000-word head would make the CPU step compute-bound and hide
what the GPU's host pays, 1.08x here against 4.7x on an H200), the host tier is memory
of its own that transfers copy (`SLC_SEPARATE_HOST=1`: the GPU's host path, without
streams and pinning), and compute markers are off (the backend drops them on a GPU).
Rows: plain Inductor; K=4 with everything on the device; K=4 and K=8 with the block
weights on host; K=4 with one transfer op per weight (`coalesce_transfers` off: the op
structure a visit had before); K=4 with the weights on nvme. Each row counts, for one
step: the Python and C calls (`sys.setprofile`), the `slc::` op calls and the tensor
allocations inside them (`torch.profiler`), the copy-stream switches and copy events
the host tier issued (on a GPU each switch is one `wait_stream`, each event one record
and one wait), the ops outside compiled code, the (block, sub-batch) units and block
visits of the step; per visit, the host items a visit costs outside compiled kernels
(`slc::` op calls and their allocations); and the GPU's host time predicted as
GPU_HOST_US_PER_C_CALL microseconds a C call (the constant that predicted the H200's
host time within -2% to +20% from this machine's counts).

Goals (ratios within the run): K=1 within 1.15x plain Inductor's CPU time, K=4 on any
tier within 1.3x; no prims op outside compiled code; every transfer op within 20 us
of host time (median); predicted step within 25% of the least measured. With
`--launch-bound`: at most 3 host items per block visit with the weights on host, and
the host items of a step the same at K=4 and K=8.

Writes the JSON record and a plot beside it (.png); prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHAPE = dict(layers=2, hidden=64, intermediate=128, heads=4, vocab=32000, batch=8, seq=32)
ROWS = (  # (name, speedloader options or None for plain Inductor)
    ("plain_inductor", None),
    ("k1_device", {"num_subbatches": 1}),
    ("k4_device", {"num_subbatches": 4}),
    ("k4_weights_host", {"num_subbatches": 4, "weights": "host"}),
    ("k4_weights_nvme", {"num_subbatches": 4, "weights": "nvme"}),
    ("k4_activations_nvme", {"num_subbatches": 4, "activations": "nvme", "min_offload_bytes": 0,
                             "recompute": "none"}),
    # The activations row's step with every saved tensor kept on the device: what
    # that row adds over it is the moves alone.
    ("k4_device_no_recompute", {"num_subbatches": 4, "recompute": "none"}),
)
WRAPPER_ROWS = (  # (name, options, Inductor's C++ wrapper)
    ("plain_inductor", None, False),
    ("plain_cpp_wrapper", None, True),
    ("k4_device", {"num_subbatches": 4}, False),
    ("k4_flat", {"num_subbatches": 4, "compile_regions": False}, False),
    ("k4_flat_cpp_wrapper", {"num_subbatches": 4, "compile_regions": False}, True),
)
LAUNCH_BOUND_SHAPE = dict(layers=4, hidden=64, intermediate=128, heads=4, vocab=256, batch=8, seq=32)
LAUNCH_BOUND_ROWS = (  # (name, options, passes off while it compiles)
    ("plain_inductor", None, ""),
    ("k4_device", {"num_subbatches": 4}, ""),
    ("k4_weights_host", {"num_subbatches": 4, "weights": "host"}, ""),
    ("k8_weights_host", {"num_subbatches": 8, "weights": "host"}, ""),
    ("k4_weights_host_per_weight", {"num_subbatches": 4, "weights": "host"}, "coalesce_transfers"),
    ("k4_weights_nvme", {"num_subbatches": 4, "weights": "nvme"}, ""),
)
GOALS = {"k1_ratio": 1.15, "k4_ratio": 1.3, "transfer_op_us": 20.0, "prediction_error": 0.25, "items_per_visit": 3}
# Host microseconds of the GPU machine per C call counted here: plain Inductor's 8.0 ms
# a step on the H200 over its 1,493 C calls here, and the H200's 1.40 ms per (block,
# sub-batch) unit over 267 C calls a unit here, agree (../shared/measurements).
GPU_HOST_US_PER_C_CALL = 5.3


def build(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = spec.get("shape", SHAPE)
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=shape["layers"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["heads"], vocab_size=shape["vocab"],
                         max_position_embeddings=shape["seq"], use_cache=False)
    # A class of the row's own: Dynamo's cached graphs of an equal compile (the same
    # backend and options, another wrapper) would otherwise serve it.
    # (Hugging Face reads the loss from the class name's "ForCausalLM".)
    name = "".join(part.title() for part in spec["row"].split("_")) + "LlamaForCausalLM"
    model = type(name, (LlamaForCausalLM,), {})(config)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(1))
    options = spec["options"]
    if options is None:
        compiled = torch.compile(model)
    else:
        options = {"lowering": "inductor", "on_refusal": "raise", "offload_dir": spec["offload_dir"], **options}
        compiled = torch.compile(model, backend="speedloader", options=options)

    disable = spec.get("disable", "")
    if not disable:
        def step():
            compiled(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    def step_without_passes():
        # Whenever it runs: Dynamo may compile a row again at any step (a guard on a
        # registry of Hugging Face's that grows with each model class made here).
        before = os.environ.get("SLC_DISABLE", "")
        os.environ["SLC_DISABLE"] = ",".join(filter(None, (before, disable)))
        try:
            compiled(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        finally:
            os.environ["SLC_DISABLE"] = before

    return step_without_passes


def run_rows(specs: list[dict], steps: int, profile_path: str) -> list[dict]:
    """Every row in this process: each compiled and warmed up, then their steps timed
    round-robin, one step of every row a round, so that a burst of load from another
    process falls on all of them alike."""
    import torch
    import torch._inductor.config
    from tqdm import tqdm

    import slcompile
    from slcompile.analysis.time import predict_time
    from slcompile.profile import machine_profile
    from slcompile.step_profile import profile_step

    torch.set_num_threads(1)
    # Every row compiles in this process, each model of a class of its own: Dynamo
    # recompiles the shared inner code once per row.
    torch._dynamo.config.recompile_limit = 64
    profile = machine_profile(profile_path) if profile_path is not None else None
    built = []
    for spec in tqdm(specs, desc="compiling"):
        step = build(spec)
        start = time.perf_counter()
        with torch._inductor.config.patch(cpp_wrapper=spec.get("cpp_wrapper", False)):
            step()  # compiles
        first = time.perf_counter() - start
        report = slcompile.compile_reports()[-1] if spec["options"] is not None else None
        for _ in range(3):
            step()
        built.append((spec, step, first, report))
    cpu: list[list[float]] = [[] for _ in built]
    wall: list[list[float]] = [[] for _ in built]
    for _ in tqdm(range(steps), desc="rounds"):
        for i, (_, step, _, _) in enumerate(built):
            start, thread_start = time.perf_counter(), time.thread_time()
            step()
            cpu[i].append(time.thread_time() - thread_start)
            wall[i].append(time.perf_counter() - start)
    records = []
    for (spec, step, first, report), row_cpu, row_wall in zip(built, cpu, wall):
        profiled = []
        for _ in range(PROFILED_STEPS):
            before = dict(slcompile.runtime_stats().cumulative.transfers)
            ops = profile_step(step)
            after = slcompile.runtime_stats().cumulative.transfers
            moved = {key: count - before.get(key, 0) for key, count in after.items() if count > before.get(key, 0)}
            profiled.append((ops, moved))
        calls = {name: [us for ops, _ in profiled for us in ops.slc_host_us.get(name, [])]
                 for name in ops.slc_host_us}
        per_step = [transfer_host_us(ops.slc_host_us, moved) for ops, moved in profiled]
        record = {
            "row": spec["row"], "options": spec["options"], "first_step_seconds": first,
            "cpu_seconds": statistics.median(row_cpu), "min_cpu_seconds": min(row_cpu),
            "wall_seconds": statistics.median(row_wall), "all_cpu_seconds": row_cpu,
            "eager_ops": ops.eager, "eager_prims": ops.eager_count("prims"), "eager_aten": ops.eager_count("aten"),
            "accumulate_grad_ops": ops.accumulate_grad, "compiled_calls": ops.compiled_calls,
            "slc_op_host_us": {name: statistics.median(times) for name, times in calls.items()},
            "slc_op_calls": {name: len(times) for name, times in ops.slc_host_us.items()},
            "slc_transfer_host_us": {family: statistics.median(step[family] for step in per_step)
                                     for family in per_step[0]},
        }
        if spec.get("shape") is not None:
            record.update(host_items(step, report, spec["shape"], ops.slc_allocations))
        if report is not None and profile is not None:
            options = spec["options"]
            tiers = {"fetch": options.get("weights", "device"), "stash": options.get("activations", "device"),
                     "unstash": options.get("activations", "device"), "store_grad": "device"}
            graphs = report.partitioned
            prediction = predict_time(graphs["forward"], graphs["backward"], profile=profile, tiers=tiers,
                                      lowering="inductor")
            record["predicted_step_seconds"] = prediction.step_seconds
            # Against the least step, as time_bench compares: the profile's rates are
            # best-of too, so the model predicts a step no other process slowed.
            least, median = record["min_cpu_seconds"], record["cpu_seconds"]
            record["prediction_error"] = (prediction.step_seconds - least) / least
            record["prediction_error_to_median"] = (prediction.step_seconds - median) / median
            record["regions"] = {kind: vars(done) for kind, done in report.regions.items()}
        records.append(record)
    return records


# Steps profiled per row: a step's host times per op vary with what the other threads
# do meanwhile (an I/O completion taking the GIL), so each figure is a median over these.
PROFILED_STEPS = 5

# The transfer ops with run forms (`coalesce_transfers`), by what each call does for
# every tensor it moves: a call may move one tensor or a run of them. (`fetch_weight`,
# one weight a call, counts per call: its median is what a fetch waits.)
FAMILIES = {"slc::stash": "store issue", "slc::stash_many": "store issue", "slc::wait": "store wait",
            "slc::wait_many": "store wait", "slc::unstash": "load issue", "slc::unstash_many": "load issue",
            "slc::unstash_wait": "load wait", "slc::unstash_wait_many": "load wait",
            "slc::fetch_issue": "weight issue", "slc::fetch_issue_many": "weight issue"}


def transfer_host_us(host_us: dict[str, list[float]], moved: dict) -> dict[str, float]:
    """Host microseconds per tensor moved, for each half of a store and a load and for
    a weight fetch's issue: the step's host time of the ops of that kind (one tensor a
    call, or a run of them a call) over the activations the step stored to (or loaded
    from) a tier that copies, or the weights it loaded from one (counted by the
    runtime while the step ran)."""
    from slcompile.runtime import TransferKind

    def count(kind, stored):
        return sum(n for (moved_kind, source, _), n in moved.items()
                   if moved_kind is kind and (source.value == "device") == stored)

    stores, loads = count(TransferKind.ACTIVATION, True), count(TransferKind.ACTIVATION, False)
    weights = count(TransferKind.WEIGHT, False)
    totals: dict[str, float] = {}
    for name, times in host_us.items():
        if name in FAMILIES:
            totals[FAMILIES[name]] = totals.get(FAMILIES[name], 0.0) + sum(times)
    per = {"store issue": stores, "store wait": stores, "load issue": loads, "load wait": loads,
           "weight issue": weights}
    return {family: total / per[family] for family, total in totals.items() if per[family]}


def count_calls(step) -> dict[str, int]:
    """Python-level calls ('call') and C-level calls ('c_call': kernels, extern calls,
    size and stride asserts, the runtime's C work) of one step, by `sys.setprofile`."""
    counts = {"python_calls": 0, "c_calls": 0}

    def count(frame, event, arg):
        if event == "call":
            counts["python_calls"] += 1
        elif event == "c_call":
            counts["c_calls"] += 1

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts


def copy_calls(step) -> dict[str, int]:
    """The host tier's switches to the copy stream and its copy events in one step
    (`HostCopies._copying` / `_copies_done`): on a GPU, one `wait_stream` a switch and
    a record and a wait an event."""
    from slcompile.runtime.storage.host_copier import HostCopies

    counts = {"copy_stream_switches": 0, "copy_events": 0}
    switch, done = HostCopies._copying, HostCopies._copies_done

    def counted_switch(self):
        counts["copy_stream_switches"] += 1
        return switch(self)

    def counted_done(self):
        counts["copy_events"] += 1
        return done(self)

    HostCopies._copying, HostCopies._copies_done = counted_switch, counted_done
    try:
        step()
    finally:
        HostCopies._copying, HostCopies._copies_done = switch, done
    return counts


def host_items(step, report, shape: dict, allocations: dict[str, int]) -> dict:
    """What one step costs the host outside compiled kernels, per step, per (block,
    sub-batch) unit and per block visit (see the module docstring), and the GPU's host
    time predicted from the C calls."""
    counts = {**count_calls(step), **copy_calls(step)}
    k = report.config.num_subbatches if report is not None else 1
    units = 2 * shape["layers"] * k  # each block's forward and backward on each sub-batch
    visits = 2 * shape["layers"] if report is not None and report.streamed_bytes else 0
    return {"calls_per_step": counts, "units_per_step": units, "visits_per_step": visits,
            "slc_allocations": allocations,
            "predicted_gpu_host_seconds": counts["c_calls"] * GPU_HOST_US_PER_C_CALL * 1e-6}


def items_per_visit(row: dict) -> float | None:
    """`slc::` op calls and the allocations inside them, per block visit of the step."""
    if not row.get("visits_per_step"):
        return None
    calls = sum(row["slc_op_calls"].values()) + sum(row["slc_allocations"].values())
    return calls / row["visits_per_step"]


def launch_bound_goals(rows: list[dict]) -> dict:
    """The launch-bound mode's goals: at most 3 host items a visit with the weights on
    host, and a step's host items (and C calls) the same at K=4 and K=8."""
    by_name = {row["row"]: row for row in rows if "cpu_seconds" in row}
    plain = by_name.get("plain_inductor")
    for row in by_name.values():
        row["host_items_per_visit"] = items_per_visit(row)
        if plain is not None:
            row["cpu_ratio_to_plain"] = row["cpu_seconds"] / plain["cpu_seconds"]
            row["predicted_gpu_host_ratio_to_plain"] = (row["predicted_gpu_host_seconds"]
                                                        / plain["predicted_gpu_host_seconds"])
    result = {}
    host = {name: by_name[name]["host_items_per_visit"] for name in ("k4_weights_host", "k8_weights_host")
            if name in by_name}
    result["host_items_per_visit_at_most_3"] = {"per_row": host, "met": bool(host) and all(
        items <= GOALS["items_per_visit"] for items in host.values())}
    k4, k8 = by_name.get("k4_weights_host"), by_name.get("k8_weights_host")
    if k4 is not None and k8 is not None:
        items = {name: sum(row["slc_op_calls"].values()) + sum(row["slc_allocations"].values())
                 for name, row in (("k4", k4), ("k8", k8))}
        extra_units = k8["units_per_step"] - k4["units_per_step"]
        result["step_host_items_flat_in_k"] = {
            "items_per_step": items, "met": items["k4"] == items["k8"],
            # What each (block, sub-batch) unit still costs the host: the compiled
            # region's own kernel calls, which only a CUDA graph removes.
            "c_calls_per_extra_unit": (k8["calls_per_step"]["c_calls"] - k4["calls_per_step"]["c_calls"]) / extra_units,
        }
    return result


def goals(rows: list[dict]) -> dict:
    by_name = {row["row"]: row for row in rows if "cpu_seconds" in row}
    plain = by_name.get("plain_inductor")
    result = {}
    if plain is not None:
        for name, row in by_name.items():
            row["cpu_ratio_to_plain"] = row["cpu_seconds"] / plain["cpu_seconds"]
        k1 = by_name.get("k1_device")
        if k1 is not None:
            result["k1_within_1.15x"] = {"ratio": k1["cpu_ratio_to_plain"], "met": k1["cpu_ratio_to_plain"] <= 1.15}
        k4 = {name: row["cpu_ratio_to_plain"] for name, row in by_name.items() if name.startswith("k4")}
        result["k4_within_1.3x"] = {"ratios": k4, "met": all(r <= GOALS["k4_ratio"] for r in k4.values())}
    prims = {name: row["eager_prims"] for name, row in by_name.items()}
    result["no_eager_prims"] = {"per_row": prims, "met": not any(prims.values())}
    # A run op's host time is per tensor it moves (`slc_transfer_host_us`); the others' per call.
    slowest = {name: max([*((op, us) for op, us in row["slc_op_host_us"].items() if op not in FAMILIES),
                          *row.get("slc_transfer_host_us", {}).items()], key=lambda item: item[1],
                         default=(None, 0.0))
               for name, row in by_name.items() if row["slc_op_host_us"]}
    result["transfer_ops_within_20us"] = {
        "slowest_per_row": slowest,
        "met": all(us <= GOALS["transfer_op_us"] for op, us in slowest.values() if op != "slc::mark"),
    }
    errors = {name: row["prediction_error"] for name, row in by_name.items() if "prediction_error" in row}
    result["prediction_within_25%"] = {"errors": errors,
                                       "met": all(abs(e) <= GOALS["prediction_error"] for e in errors.values())}
    return result


def plot_launch_bound(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if "cpu_seconds" in r]
    names = [r["row"] for r in rows]
    positions = list(range(len(rows)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.5 * len(rows) + 2.5))
    height = 0.4
    left.barh([p - height / 2 for p in positions], [r["cpu_seconds"] * 1e3 for r in rows], height=height,
              label="measured here (compute thread CPU, median)")
    left.barh([p + height / 2 for p in positions], [r["predicted_gpu_host_seconds"] * 1e3 for r in rows],
              height=height, label=f"GPU host predicted ({GPU_HOST_US_PER_C_CALL} us a C call)")
    left.set_yticks(positions, names)
    left.invert_yaxis()
    left.set_xlabel("ms per step")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, fontsize=8)
    per_visit = [(r.get("host_items_per_visit") or 0.0) for r in rows]
    right.barh(positions, per_visit, color="tab:green")
    right.axvline(GOALS["items_per_visit"], color="red", linestyle="--", label="goal: 3 a visit")
    right.set_yticks(positions, [""] * len(rows))
    right.invert_yaxis()
    right.set_xlabel("host items per block visit (slc:: op calls and their allocations)")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8)
    shape = record["model"]
    fig.suptitle(f"launch-bound step ({shape['layers']} layers, hidden {shape['hidden']}, vocabulary "
                 f"{shape['vocab']}) on {record['machine']} (torch {record['torch']}, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def launch_bound(steps: int, out: str | None, wanted: set[str] | None) -> int:
    """The `--launch-bound` mode (see the module docstring)."""
    import platform

    # Before any transfer engine is made: the host tier copies, as a GPU machine's.
    os.environ["SLC_SEPARATE_HOST"] = "1"
    # The backend drops the markers on a GPU; here they would add two calls a unit.
    os.environ["SLC_DISABLE"] = ",".join(filter(None, (os.environ.get("SLC_DISABLE", ""), "mark_regions")))
    import torch

    out = out or os.path.join(HERE, "results", "overhead_bench_launch_bound.json")
    offload_dir = tempfile.mkdtemp(prefix="slc-overhead-nvme-")
    torch.set_num_threads(1)
    specs = [{"row": name, "options": options, "offload_dir": offload_dir, "disable": disable,
              "shape": LAUNCH_BOUND_SHAPE}
             for name, options, disable in LAUNCH_BOUND_ROWS if wanted is None or name in wanted]
    rows = run_rows(specs, steps, None)
    record = {
        "machine": platform.node() or "cpu", "torch": torch.__version__, "model": LAUNCH_BOUND_SHAPE,
        "steps": steps, "gpu_host_us_per_c_call": GPU_HOST_US_PER_C_CALL, "rows": rows,
        "malloc": {key: os.environ.get(key) for key in KEPT_HEAP},
    }
    record["goals"] = launch_bound_goals(rows)
    return write_record(record, out, plot_launch_bound)


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if "cpu_seconds" in r]
    names = [r["row"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.5))
    positions = range(len(rows))
    left.barh(positions, [r["cpu_seconds"] * 1e3 for r in rows], label="measured (compute thread CPU)")
    left.scatter([r.get("predicted_step_seconds", float("nan")) * 1e3 for r in rows], positions, color="black",
                 marker="|", s=250, zorder=3, label="predicted")
    left.set_yticks(list(positions), names)
    left.invert_yaxis()
    left.set_xlabel("ms per step (median)")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    # What the goal judges: the transfers per tensor moved, the other ops per call.
    judged = [{**{op: us for op, us in r["slc_op_host_us"].items() if op not in FAMILIES},
               **r.get("slc_transfer_host_us", {})} for r in rows]
    ops = sorted({op for figures in judged for op in figures})
    width = 0.8 / max(len(ops), 1)
    for i, op in enumerate(ops):
        right.barh([p + i * width for p in positions], [figures.get(op, 0.0) for figures in judged],
                   height=width, label=op)
    right.axvline(GOALS["transfer_op_us"], color="red", linestyle="--", label="goal 20 us")
    right.set_yticks(list(positions), [""] * len(rows))
    right.invert_yaxis()
    right.set_xlabel("host us per tensor moved (transfers) or per call (median)")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=7)
    fig.suptitle(f"launch-bound step on {record['machine']} (torch {record['torch']}, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# glibc returns the top of its heap to the system once more than M_TRIM_THRESHOLD is
# free there, and the thresholds move with the sizes freed: which row's step gets the
# 32 MB logits back in fresh pages (8,000 page faults, about 12 ms of system time
# here) depends on the heap the rows share, not on the row. Kept, every row reuses
# its heap, as a CPU deployment with a caching allocator would.
KEPT_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def main() -> int:
    if "--default-malloc" not in sys.argv and any(os.environ.get(k) != v for k, v in KEPT_HEAP.items()):
        # glibc reads these when the process starts.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KEPT_HEAP})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="5 steps a row, results in a temp dir")
    parser.add_argument("--only", default=None, help="comma-separated row names")
    parser.add_argument("--wrapper", action="store_true",
                        help="Inductor's Python wrapper against its C++ wrapper (overhead_bench_wrapper.json)")
    parser.add_argument("--launch-bound", action="store_true",
                        help="host items per block visit at a launch-bound size (overhead_bench_launch_bound.json)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--default-malloc", action="store_true",
                        help="glibc's own heap thresholds (default: the heap kept, KEPT_HEAP)")
    args = parser.parse_args()

    import platform

    import torch

    from slcompile.profile import measure_profile

    steps = 5 if args.quick else args.steps
    wanted = set(args.only.split(",")) if args.only else None
    names = {row[0] for row in (LAUNCH_BOUND_ROWS if args.launch_bound else WRAPPER_ROWS if args.wrapper else ROWS)}
    if wanted is not None and wanted - names:
        print(f"overhead_bench: unknown row(s) {', '.join(sorted(wanted - names))}; choose from "
              f"{', '.join(sorted(names))}", file=sys.stderr)
        return 2
    if args.launch_bound:
        quick_out = os.path.join(tempfile.mkdtemp(prefix="slc-overhead-"), "overhead_bench_launch_bound.json")
        return launch_bound(steps, args.out or (quick_out if args.quick else None), wanted)
    out = args.out or (os.path.join(tempfile.mkdtemp(prefix="slc-overhead-"), "overhead_bench.json") if args.quick
                       else os.path.join(HERE, "results",
                                         "overhead_bench_wrapper.json" if args.wrapper else "overhead_bench.json"))
    offload_dir = tempfile.mkdtemp(prefix="slc-overhead-nvme-")
    torch.set_num_threads(1)
    profile = measure_profile(offload_dir=offload_dir, steps=True)
    profile_path = os.path.join(offload_dir, "profile.json")
    with open(profile_path, "w") as f:
        f.write(profile.to_json())
    rows = WRAPPER_ROWS if args.wrapper else tuple((name, options, False) for name, options in ROWS)
    specs = [{"row": name, "options": options, "offload_dir": offload_dir, "cpp_wrapper": cpp_wrapper}
             for name, options, cpp_wrapper in rows if wanted is None or name in wanted]
    rows = run_rows(specs, steps, profile_path)
    record = {
        "machine": platform.node() or "cpu", "torch": torch.__version__, "model": SHAPE, "steps": steps,
        "profile": json.loads(profile.to_json()), "rows": rows,
        "malloc": {key: os.environ.get(key) for key in KEPT_HEAP},
    }
    record["goals"] = goals(rows)
    return write_record(record, out, plot)


def write_record(record: dict, out: str, draw) -> int:
    """Writes `record` as JSON to `out` and `draw(record, path)`'s plot beside it, and
    prints the record."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    draw(record, os.path.splitext(out)[0] + ".png")
    print(json.dumps(record))
    print(f"overhead_bench: wrote {out} and its .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
