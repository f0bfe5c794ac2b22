"""Saved activations of a training step: speedloader's nvme tier and block recompute
against AOTAutograd's own activation offloading, on one GPT and one batch.

Usage:
    python bench/activation_bench.py [--quick] [--repeats 3] [--omp-wait-policy PASSIVE]
                                     [--out bench/results/activation_bench.json]

Configurations, each in its own process (so peak RSS is its own), every one with
`lowering="aot_eager"` or the `aot_eager` backend and every weight resident:
- ``aot_eager``: `torch.compile(backend="aot_eager")`, nothing offloaded.
- ``speedloader``: the speedloader backend, K=1, activations on the device.
- ``pytorch_flag``: `aot_eager` with
  `torch._functorch.config.enable_activation_offloading = True` and nothing else.
- ``pytorch_marked``: the same flag, plus a `joint_custom_pass` that sets
  `meta["should_offload"]` on every op of the joint graph, the way PyTorch's own tests
  ask for offloading (nothing in torch sets that key; see `pytorch_offload_evidence`).
- ``speedloader_nvme``: `activations="nvme"`, `min_offload_bytes=65536`,
  `recompute` "none" or "blocks", K in {1, 2, 4}.
- ``lifetime_aware_nvme``: the same with `schedule="lifetime_aware"` (the example
  policy in `slcompile/schedules/examples/lifetime_aware.py`: it keeps on the device
  the activations whose round trip cannot hide behind compute), `recompute="none"`.

``--kinds`` runs some of them only (``speedloader_nvme/none`` names one recompute
choice; ``aot_eager`` always runs: the ratios are to it).

Per configuration: the median of ``--repeats`` steps after 2 warm-up steps, timed
without the profiler (wall and CPU seconds); then one step under `torch.profiler`,
inside `buffers_seen_by_profiler()` so that reloaded activations come from torch's
allocator, whose allocator events give the peak bytes the step allocates
(`slcompile.analysis.memory.measured_peak_bytes`, as the tests measure it). Next to
it: speedloader's predicted peak (`compile_reports()[-1].memory`), activation bytes
stored and loaded per step (`runtime_stats()`), peak RSS, `Cached` of /proc/meminfo
around the timed steps and the page-cache bytes of the nvme tier's own files
(`fincore`), the load average and the time the process's threads waited for a core
(schedstat). The run also measures the disk's O_DIRECT read bandwidth (dd) and
records what PyTorch's offloading pass does on this CPU-only machine.

libgomp lets idle OpenMP threads spin before they sleep; on two cores shared with other
jobs, spinning workers take the cores that the thread they wait for, the I/O threads
and the other jobs need, and a step of many short parallel regions (sub-batches,
recompute) slows down several times. ``--omp-wait-policy PASSIVE`` sets
``OMP_WAIT_POLICY`` for every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.deepspeed_bench import runqueue_wait_seconds  # noqa: E402
from bench.train_bench import dd_read_bandwidth  # noqa: E402

MiB = 2**20

WARMUP_STEPS = 2
MIN_OFFLOAD_BYTES = 65536


def meminfo_cached_bytes() -> int:
    """`Cached` of /proc/meminfo: the page cache, in bytes."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Cached line in /proc/meminfo")


def page_cache_of_files(directory: str) -> dict:
    """Size of the files under `directory` and how many of their bytes sit in the page
    cache (`fincore`): the nvme tier's own files, whatever else runs on the machine."""
    paths = [os.path.join(folder, name) for folder, _, names in os.walk(directory) for name in names]
    size = sum(os.path.getsize(path) for path in paths)
    if not paths:
        return {"files": 0, "bytes": 0, "page_cache_bytes": 0}
    proc = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *paths],
                          capture_output=True, text=True, check=True)
    return {"files": len(paths), "bytes": size, "page_cache_bytes": sum(int(v) for v in proc.stdout.split())}


def mark_every_op_for_offloading(gm, joint_inputs):
    """A `joint_custom_pass`: asks AOTAutograd to offload every saved tensor it can."""
    marked = 0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["should_offload"] = True
            marked += 1
    mark_every_op_for_offloading.marked = marked
    return gm


def capturing_aot_eager(graphs: dict):
    """The `aot_eager` backend itself, keeping the forward and backward graphs."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return boxed_nop(gm, example_inputs)

        compiler._boxed_call = True
        return compiler

    def backend(gm, example_inputs, **kwargs):
        return aot_eager(gm, example_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"), **kwargs)

    return backend


def device_put_figures(graphs: dict) -> dict:
    """The `prims.device_put` nodes PyTorch's pass inserted, and the bytes they carry."""
    import torch

    from slcompile.analysis.lifetimes import tensor_bytes

    put = torch.ops.prims.device_put.default
    figures = {}
    for kind, gm in graphs.items():
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is put]
        figures[f"{kind}_device_put_nodes"] = len(nodes)
        figures[f"{kind}_device_put_bytes"] = int(sum(tensor_bytes(n.args[0].meta["val"]) for n in nodes))
        figures[f"{kind}_device_put_targets"] = sorted({str(n.args[1]) for n in nodes})
    if "backward" in graphs:
        figures["saved_tensors"] = sum(
            not n.name.startswith("tangents") for n in graphs["backward"].graph.find_nodes(op="placeholder")
        )
    return figures


def saved_activation_bytes(call, model) -> int:
    """Bytes of the distinct storages the autograd graph saves for the backward,
    parameters left out (one untimed forward under `saved_tensors_hooks`)."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = call()
    del outputs
    return sum(storages.values())


def run_one(spec: dict) -> dict:
    """Runs one configuration in this process and returns its figures."""
    import torch
    import torch._functorch.config

    import slcompile
    from slcompile.analysis.machine import MachineFacts
    from slcompile.analysis.memory import measured_peak_bytes, predict_memory
    from slcompile.examples import GPTConfig, TinyGPT
    from slcompile.runtime import Tier, TransferKind, mark_step, reset_runtime_stats
    from slcompile.runtime.storage.nvme import buffers_seen_by_profiler
    from slcompile.runtime.storage.tiers import PAGE_BYTES

    load_start = os.getloadavg()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=spec["vocab"], seq_len=spec["seq_len"], d_model=spec["d_model"],
        n_heads=spec["n_heads"], n_layers=spec["n_layers"],
    )
    model = TinyGPT(cfg)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.seq_len), generator=gen)

    graphs: dict = {}
    kind = spec["kind"]
    # AOTAutograd reads these while it partitions, in the first step.
    functorch_patch = {}
    if kind in ("aot_eager", "pytorch_flag", "pytorch_marked"):
        functorch_patch["enable_activation_offloading"] = kind != "aot_eager"
        if kind == "pytorch_marked":
            functorch_patch["joint_custom_pass"] = mark_every_op_for_offloading
        compiled = torch.compile(model, backend=capturing_aot_eager(graphs))
    else:
        options = {"lowering": "aot_eager", "num_subbatches": spec["k"], "offload_dir": spec["offload_dir"]}
        if kind in ("speedloader_nvme", "lifetime_aware_nvme"):
            options.update(activations="nvme", recompute=spec["recompute"], min_offload_bytes=MIN_OFFLOAD_BYTES)
        if kind == "lifetime_aware_nvme":
            options.update(schedule="lifetime_aware")
        compiled = torch.compile(model, backend="speedloader", options=options)

    def clear_grads() -> None:
        for p in model.parameters():
            p.grad = None

    def step() -> None:
        logits, loss = compiled(idx, targets)  # the caller holds the outputs, as usual
        loss.backward()

    cpu_seconds, waits = [], []

    def timed_step() -> float:
        clear_grads()
        started, cpu_started, wait_started = time.perf_counter(), time.process_time(), runqueue_wait_seconds()
        step()
        cpu_seconds.append(time.process_time() - cpu_started)
        waits.append(runqueue_wait_seconds() - wait_started)
        return time.perf_counter() - started

    compile_started = time.perf_counter()
    with torch._functorch.config.patch(functorch_patch):
        timed_step()
    compile_seconds = time.perf_counter() - compile_started
    for _ in range(WARMUP_STEPS - 1):
        timed_step()

    reset_runtime_stats()
    cpu_seconds.clear()
    waits.clear()
    cached_before = meminfo_cached_bytes()
    times, steps = [], []
    for _ in range(spec["repeats"]):
        mark_step()
        times.append(timed_step())
        steps.append(mark_step())
    cached_after = meminfo_cached_bytes()
    tier_files = page_cache_of_files(spec["offload_dir"])
    peak_rss_timed = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    median = statistics.median_high(times)  # a measured step, so its counters go with it
    middle = steps[times.index(median)]
    store_key = (TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME)
    load_key = (TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE)
    stored_total = sum(s.bytes_moved.get(store_key, 0) for s in steps)

    # Weights are resident, so every load of a step is issued inside that step and
    # lands in torch's allocator here: no settling step is needed.
    with buffers_seen_by_profiler():
        clear_grads()
        measured = measured_peak_bytes(step)
    clear_grads()

    result = {
        "spec": spec,
        "step_seconds": median,
        "all_step_seconds": times,
        # CPU seconds of the process's threads: less sensitive than wall time to other
        # work on the shared cores, but they include OpenMP threads spinning while
        # they wait unless OMP_WAIT_POLICY=PASSIVE.
        "step_cpu_seconds": statistics.median(cpu_seconds),
        "all_step_cpu_seconds": list(cpu_seconds),
        "all_step_runqueue_wait_seconds": list(waits),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "niceness": os.nice(0),
        "tokens_per_second": spec["batch"] * cfg.seq_len / median,
        "compile_and_first_step_seconds": compile_seconds,
        "measured_step_peak_bytes": measured,
        "activation_store_bytes_per_step": middle.bytes_moved.get(store_key, 0),
        "activation_load_bytes_per_step": middle.bytes_moved.get(load_key, 0),
        "bytes_moved_per_step": {"/".join(part.value for part in key): n for key, n in middle.bytes_moved.items()},
        "stall_seconds": middle.stall_seconds,
        "activation_store_bytes_timed_steps": stored_total,
        "meminfo_cached_bytes": {"before": cached_before, "after": cached_after},
        "nvme_files_after_timed_steps": tier_files,
        "peak_rss_bytes": peak_rss_timed,
        "peak_rss_bytes_after_profiled_step": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    if kind.startswith(("speedloader", "lifetime_aware")):
        report = slcompile.compile_reports()[-1]
        memory = report.memory
        # The profiler's view: each loaded buffer comes from torch's allocator with one
        # page of alignment slack (see buffers_seen_by_profiler).
        # Off by default: predicting again takes about as long as compiling.
        seen = predict_memory(
            report.graphs["forward"], report.graphs["backward"], live_blocks=report.config.live_blocks,
            machine=MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES),
        ) if spec.get("profiler_view") else None
        offloaded = report.offloaded_activations
        result.update({
            "fallback_reason": report.fallback_reason,
            "predicted_step_peak_bytes": memory.step_peak_bytes,
            "predicted_peak_bytes": dict(memory.peak_bytes),
            "predicted_held_bytes": memory.held_bytes,
            "predicted_offloaded_activation_bytes": memory.offloaded_activation_bytes,
            "predicted_step_peak_bytes_profiler_view": seen.step_peak_bytes if seen else None,
            "recompute_planned": memory.recompute,
            "offloaded_activation_count": len(offloaded.names) if offloaded is not None else 0,
        })
    else:
        result.update(device_put_figures(graphs))
        result["nodes_marked_should_offload"] = getattr(mark_every_op_for_offloading, "marked", 0)
        clear_grads()
        result["saved_activation_bytes"] = saved_activation_bytes(lambda: compiled(idx, targets), model)
        clear_grads()
    result["loadavg"] = {"start": load_start, "end": os.getloadavg()}
    return result


def pytorch_offload_evidence() -> dict:
    """What `enable_activation_offloading` does on this machine, read from torch's
    source and shown on a two-matmul function under aot_eager and Inductor."""
    import inspect

    import torch
    import torch._functorch.config
    from torch._dynamo.backends.debugging import aot_eager
    from torch._functorch import partitioners
    from torch._inductor.utils import run_and_get_code

    root = os.path.dirname(torch.__file__)
    readers, writers = [], []
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8", errors="replace") as handle:
                for number, line in enumerate(handle, 1):
                    if '"should_offload"' in line:
                        where = f"{os.path.relpath(path, root)}:{number}: {line.strip()}"
                        (writers if '"should_offload"] =' in line else readers).append(where)
    callers = [
        name for name, fn in inspect.getmembers(partitioners, inspect.isfunction)
        if fn.__module__ == partitioners.__name__ and "enable_activation_offloading(" in inspect.getsource(fn)
    ]

    def two_matmuls(a, b):
        return ((a @ b).sin() @ b).cos().sum()

    a = torch.randn(64, 64, requires_grad=True)
    b = torch.randn(64, 64, requires_grad=True)
    torch._functorch.config.enable_activation_offloading = True
    torch._functorch.config.joint_custom_pass = mark_every_op_for_offloading
    graphs: dict = {}
    torch.compile(two_matmuls, backend=capturing_aot_eager(graphs))(a, b).backward()
    put = torch.ops.prims.device_put.default
    sample = torch.randn(16)
    moved = put(sample, torch.device("cpu"), True)
    torch._dynamo.reset()
    _, (forward_code, backward_code) = run_and_get_code(
        lambda: torch.compile(two_matmuls, backend="inductor")(a, b).backward()
    )
    torch._functorch.config.joint_custom_pass = None
    forward_call = forward_code[forward_code.index("def call("):].split("\n\n")[0]
    return {
        "torch_source_should_offload_readers": readers,
        "torch_source_should_offload_writers": writers,
        "partitioners_calling_enable_activation_offloading": callers,
        "aot_eager_backend_partition_fn": re.findall(r"partition_fn=(\w+)", inspect.getsource(aot_eager)),
        "small_function_aot_eager": device_put_figures(graphs),
        "device_put_cpu_to_cpu_returns_its_input": moved is sample,
        "small_function_inductor_backward_offloaded_inputs": backward_code.count("assert_size_stride(cpu_offload_"),
        "small_function_inductor_forward_copies": [
            line.strip() for line in forward_call.splitlines()
            if any(word in line for word in ("clone", "copy", "device_put", ".to("))
        ],
    }


def source_version() -> dict:
    """The commit of the checkout and whether slcompile/ differs from it."""
    root = os.path.dirname(HERE)

    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=root, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "slcompile_modified": bool(git("status", "--porcelain", "slcompile"))}


def in_subprocess(*arguments: str, omp_wait_policy: str | None = None) -> dict:
    """Runs this script with `arguments` in a fresh process; returns its JSON line."""
    env = dict(os.environ)
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    proc = subprocess.run([sys.executable, __file__, *arguments], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(arguments)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--evidence", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small model and K in {1, 2}: a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], default=None,
        help="OMP_WAIT_POLICY for every configuration (default: inherited); PASSIVE stops idle OpenMP threads "
             "from spinning, which on a machine shared with other jobs decides the timings",
    )
    parser.add_argument("--profiler-view", action="store_true",
                        help="also predict the peak as the profiler sees loaded buffers (one page of slack each); "
                             "slow: about as long as each compile")
    parser.add_argument("--offload-dir", default=None, help="where the nvme tier's files go (default: a temp dir)")
    parser.add_argument("--kinds", default=None,
                        help="comma-separated configurations to run, kind or kind/recompute (default: all); "
                             "aot_eager always runs")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "activation_bench.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if args.evidence:
        print(json.dumps(pytorch_offload_evidence()))
        return

    from tqdm import tqdm

    load_start = os.getloadavg()
    version_start = source_version()
    started = time.perf_counter()
    offload_dir = args.offload_dir or tempfile.mkdtemp(prefix="slc-bench-", dir=os.environ.get("TMPDIR", "/tmp"))
    if args.quick:
        model = {"d_model": 128, "n_heads": 4, "n_layers": 4, "vocab": 512, "seq_len": 64, "batch": 8}
        ks = [1, 2]
    else:
        # Sized so that a step takes 1 to 3 s on two shared cores (OMP_WAIT_POLICY=PASSIVE),
        # the saved activations are several times the weights and their gradients, and
        # compiling K=4 with block recompute (the slowest compile) stays under two minutes.
        model = {"d_model": 384, "n_heads": 6, "n_layers": 8, "vocab": 1024, "seq_len": 128, "batch": 8}
        ks = [1, 2, 4]
    base = dict(model, repeats=args.repeats, offload_dir=offload_dir, k=1, recompute="none",
                profiler_view=args.profiler_view)
    specs = [dict(base, kind=kind) for kind in ("aot_eager", "speedloader", "pytorch_flag", "pytorch_marked")]
    for recompute in ("none", "blocks"):
        specs += [dict(base, kind="speedloader_nvme", k=k, recompute=recompute) for k in ks]
    specs += [dict(base, kind="lifetime_aware_nvme", k=k, recompute="none") for k in ks]
    if args.kinds:
        kinds = {"aot_eager", *args.kinds.split(",")}
        specs = [spec for spec in specs if {spec["kind"], f"{spec['kind']}/{spec['recompute']}"} & kinds]

    bandwidth = dd_read_bandwidth(offload_dir)
    cached_before = meminfo_cached_bytes()
    evidence = in_subprocess("--evidence")
    results = [
        in_subprocess("--one", json.dumps(spec), omp_wait_policy=args.omp_wait_policy) for spec in tqdm(specs, desc="activation bench", unit="config")
    ]
    cached_after = meminfo_cached_bytes()

    import torch

    rows = summarize(results)
    record = {
        "command": "python bench/activation_bench.py" + (" --quick" if args.quick else "")
        + (" --profiler-view" if args.profiler_view else "") + f" --repeats {args.repeats}"
        + (f" --omp-wait-policy {args.omp_wait_policy}" if args.omp_wait_policy else "")
        + (f" --kinds {args.kinds}" if args.kinds else ""),
        "machine": {
            "platform": platform.platform(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "loadavg": {"start": load_start, "end": os.getloadavg()},
        # Others commit to this checkout while it runs: each configuration imports
        # slcompile when its process starts.
        "source": {"start": version_start, "end": source_version()},
        "wall_seconds": time.perf_counter() - started,
        "model": model,
        "tokens_per_step": model["batch"] * model["seq_len"],
        "warmup_steps": WARMUP_STEPS,
        "omp_wait_policy": args.omp_wait_policy,
        "min_offload_bytes": MIN_OFFLOAD_BYTES,
        "disk_read_bandwidth_bytes_per_s": bandwidth,
        "meminfo_cached_bytes": {"before": cached_before, "after": cached_after},
        "pytorch_activation_offloading": evidence,
        "summary": rows,
        "runs": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=2)
    print_table(rows, record)
    plot(rows, args.out.replace(".json", ".png"), record)
    print(f"wrote {args.out}")


def label(spec: dict) -> str:
    if spec["kind"] == "speedloader_nvme":
        return f"nvme, recompute={spec['recompute']}, K={spec['k']}"
    if spec["kind"] == "lifetime_aware_nvme":
        return f"lifetime_aware nvme, K={spec['k']}"
    return {
        "aot_eager": "aot_eager", "speedloader": "speedloader K=1", "pytorch_flag": "PyTorch flag",
        "pytorch_marked": "PyTorch flag + marks",
    }[spec["kind"]]


def summarize(results: list[dict]) -> list[dict]:
    """One row per configuration, in run order."""
    baseline = next(r for r in results if r["spec"]["kind"] == "aot_eager")
    rows = []
    for run in results:
        predicted = run.get("predicted_step_peak_bytes")
        seen = run.get("predicted_step_peak_bytes_profiler_view")
        measured = run["measured_step_peak_bytes"]
        rows.append({
            "configuration": label(run["spec"]),
            "kind": run["spec"]["kind"],
            "k": run["spec"]["k"],
            "recompute": run["spec"]["recompute"] if run["spec"]["kind"].endswith("_nvme") else None,
            "offloaded_activation_count": run.get("offloaded_activation_count"),
            "step_s": run["step_seconds"],
            "step_cpu_s": run["step_cpu_seconds"],
            "step_runqueue_wait_s": statistics.median(run["all_step_runqueue_wait_seconds"]),
            "tokens_per_second": run["tokens_per_second"],
            "time_over_aot_eager": run["step_seconds"] / baseline["step_seconds"],
            "fastest_step_s": min(run["all_step_seconds"]),
            "measured_step_peak_bytes": measured,
            "peak_over_aot_eager": measured / baseline["measured_step_peak_bytes"],
            "predicted_step_peak_bytes": predicted,
            "predicted_profiler_view_bytes": seen,
            "prediction_error": None if predicted is None else (predicted - measured) / measured,
            "profiler_view_error": None if seen is None else (seen - measured) / measured,
            "predicted_device_peak_bytes": run.get("predicted_peak_bytes", {}).get("device"),
            "predicted_nvme_peak_bytes": run.get("predicted_peak_bytes", {}).get("nvme"),
            "activation_store_bytes": run["activation_store_bytes_per_step"],
            "activation_load_bytes": run["activation_load_bytes_per_step"],
            "pytorch_device_put_bytes": run.get("forward_device_put_bytes"),
            "saved_activation_bytes": run.get("saved_activation_bytes"),
            "peak_rss_bytes": run["peak_rss_bytes"],
            "cached_delta_bytes": run["meminfo_cached_bytes"]["after"] - run["meminfo_cached_bytes"]["before"],
            "stored_in_timed_steps_bytes": run["activation_store_bytes_timed_steps"],
            "nvme_file_bytes": run["nvme_files_after_timed_steps"]["bytes"],
            "nvme_file_page_cache_bytes": run["nvme_files_after_timed_steps"]["page_cache_bytes"],
        })
    return rows


def _mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f}"


def _percent(fraction) -> str:
    return "-" if fraction is None else f"{100 * fraction:+.1f}%"


def print_table(rows: list[dict], record: dict) -> None:
    print(f"disk O_DIRECT read bandwidth: {record['disk_read_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"load average {record['loadavg']['start'][0]:.1f} -> {record['loadavg']['end'][0]:.1f}; "
          f"OMP_WAIT_POLICY {record['omp_wait_policy'] or 'inherited'}")
    profiler_view = any(r["predicted_profiler_view_bytes"] is not None for r in rows)
    print("| configuration | step s | fastest s | CPU s | core wait s | tokens/s | measured peak MiB "
          "| predicted MiB (error) |" + (" profiler-view MiB (error) |" if profiler_view else "")
          + " act. stored MiB/step | act. loaded MiB/step | RSS MiB |")
    print("|---" * (11 + profiler_view) + "|")
    for r in rows:
        print(
            f"| {r['configuration']} | {r['step_s']:.2f} | {r['fastest_step_s']:.2f} | {r['step_cpu_s']:.2f} "
            f"| {r['step_runqueue_wait_s']:.2f} "
            f"| {r['tokens_per_second']:.0f} | {_mb(r['measured_step_peak_bytes'])} "
            f"| {_mb(r['predicted_step_peak_bytes'])} ({_percent(r['prediction_error'])}) |"
            + (f" {_mb(r['predicted_profiler_view_bytes'])} ({_percent(r['profiler_view_error'])}) |"
               if profiler_view else "")
            + f" {_mb(r['activation_store_bytes'])} | {_mb(r['activation_load_bytes'])} "
            f"| {r['peak_rss_bytes'] / MiB:.0f} |"
        )
    evidence = record["pytorch_activation_offloading"]
    print(f"torch source: should_offload written at {evidence['torch_source_should_offload_writers'] or 'no place'}; "
          f"read at {len(evidence['torch_source_should_offload_readers'])} place(s); "
          f"device_put cpu->cpu returns its input: {evidence['device_put_cpu_to_cpu_returns_its_input']}")
    print(f"page cache: Cached {record['meminfo_cached_bytes']['before'] / MiB:.1f} MiB before, "
          f"{record['meminfo_cached_bytes']['after'] / MiB:.1f} MiB after the configurations; the nvme tier's files "
          f"hold at most {max(r['nvme_file_page_cache_bytes'] for r in rows)} bytes in it "
          f"(of {max(r['nvme_file_bytes'] for r in rows) / MiB:.1f} MiB)")


def plot(rows: list[dict], path: str, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["configuration"] for r in rows]
    positions = range(len(rows))
    colors = ["tab:grey" if r["kind"] in ("aot_eager", "speedloader") else
              "tab:orange" if r["kind"].startswith("pytorch") else
              "tab:purple" if r["kind"] == "lifetime_aware_nvme" else
              "tab:blue" if r["recompute"] == "none" else "tab:green" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    axes[0].bar(positions, [r["measured_step_peak_bytes"] / MiB for r in rows], color=colors, label="measured")
    predicted = [(i, r["predicted_step_peak_bytes"] / MiB) for i, r in enumerate(rows)
                 if r["predicted_step_peak_bytes"] is not None]
    axes[0].scatter([i for i, _ in predicted], [mb for _, mb in predicted], color="black", marker="_", s=300,
                    zorder=3, label="speedloader's prediction")
    axes[0].set(ylabel="peak bytes allocated during a step (MiB)", title="peak device memory of a training step")
    axes[0].legend(fontsize=8)
    axes[1].bar(positions, [r["step_s"] for r in rows], color=colors, label="median step")
    axes[1].scatter(positions, [r["fastest_step_s"] for r in rows], color="black", marker="_", s=300, zorder=3,
                    label="fastest step")
    axes[1].set(ylabel="seconds per training step", title="step time (2 cores shared with other work: noisy)")
    axes[1].legend(fontsize=8)
    model = record["model"]
    fig.suptitle(
        f"GPT {model['n_layers']} blocks, d_model {model['d_model']}, batch {model['batch']} x {model['seq_len']} "
        f"tokens, weights resident, aot_eager; torch {record['machine']['torch']}", fontsize=10,
    )
    for axis in axes:
        axis.set_xticks(list(positions))
        axis.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        axis.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
