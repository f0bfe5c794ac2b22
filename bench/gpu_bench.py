"""Training steps of a Hugging Face Llama on a CUDA GPU: speedloader's tiers and
schedules against plain resident Inductor, with the PCIe bound of each row.

Usage (on a CUDA machine, from the repository root):
    python bench/gpu_bench.py [--small] [--ks 2,4,8] [--repeats 4] [--out bench/results/gpu_bench.json]
    python bench/gpu_bench.py --cpu-smoke      # the same code path, tiny sizes, on the CPU

Model: ``LlamaForCausalLM`` from a config (12 layers, hidden 2048, intermediate 5504,
vocabulary 32000, 16 heads; 738 M parameters), bf16, batch 16 x 512 tokens; ``--small``
takes 4 layers, hidden 1024, intermediate 2752, batch 8 x 256. A step is forward and
backward (no optimizer), gradients cleared between steps.

Rows (each in its own process, so compile caches and the peak are its own):
- ``resident_inductor``: plain ``torch.compile`` (Inductor), everything resident: the
  compute time of a step, and the 100% of "% of resident".
- ``resident_inductor_cudagraphs``: the same with ``mode="reduce-overhead"`` (CUDA graphs).
- ``eager``: no compilation, everything resident.
- ``weights_host`` (K = 2, 4, 8): speedloader, block weights on pinned host memory.
- ``weights_host_cudagraphs`` (K): the same with the ``cudagraphs`` option: the compute
  between transfers replayed as CUDA graphs.
- ``weights_activations_host_recompute`` (K): also the saved activations, with
  block recomputation (``recompute="blocks"``: only each block's input is stored).
- ``weights_activations_host`` (K): every saved activation stored (``recompute="none"``).
- ``grad_accumulation`` (K): the sample-major schedule, weights on host.
- ``fsdp2_cpu_offload``: FSDP2 ``fully_shard`` with ``CPUOffloadPolicy`` in a
  one-process group, when ``torch.distributed`` allows one; otherwise the row says why.

With ``spec["profile_path"]`` (a `MachineProfile` measured on this machine, as
gpu_check does), a speedloader row also records the step the time model predicts and
its error against the median step.

Per row: median step seconds after warm-up (``torch.cuda.synchronize`` around each
step), tokens/s, % of resident Inductor, first-step seconds (compile included), peak
``torch.cuda.max_memory_allocated`` over the timed steps, bytes moved per step per
(kind, source, destination) and per tier from ``slcompile.runtime_stats()``, pinned
host bytes, and the bound max(resident compute time, host<->device bytes / measured
bandwidth); from one more step under ``torch.profiler`` (``slcompile.step_profile``),
the operators run outside compiled code and each ``slc::`` op's median host
microseconds, and on CUDA from one more with CUDA activity the kernels and CUDA graphs
launched (``host``); the median host thread CPU time of a step until its work is
issued, before the final synchronize (``host_issue_seconds``: near the step, the
host bounds it). The pinned host->device and device->host copy bandwidth is
measured once, in the parent process, before the rows.

Writes the JSON record to ``--out`` and a plot beside it (``.png``); prints the JSON.
Without CUDA it exits with status 2 and says so, unless ``--cpu-smoke`` is given: that
runs every row with a 2-layer Llama of hidden 64 on the CPU, ``lowering="aot_eager"``,
K = 2, to a temporary directory (the host tier copies nothing there, so its figures
mean nothing; it only shows the script works).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODELS = {
    "full": dict(layers=12, hidden=2048, intermediate=5504, heads=16, vocab=32000, batch=16, seq=512),
    "small": dict(layers=4, hidden=1024, intermediate=2752, heads=16, vocab=32000, batch=8, seq=256),
    "cpu_smoke": dict(layers=2, hidden=64, intermediate=128, heads=4, vocab=256, batch=4, seq=16),
}


def row_specs(ks: list[int], *, fsdp: bool) -> list[dict]:
    """The rows of the table, in order."""
    rows = [{"row": "resident_inductor", "k": 1}, {"row": "resident_inductor_cudagraphs", "k": 1},
            {"row": "eager", "k": 1}]
    for k in ks:
        rows += [
            {"row": "weights_host", "k": k},
            {"row": "weights_host_cudagraphs", "k": k},
            {"row": "weights_activations_host_recompute", "k": k},
            {"row": "weights_activations_host", "k": k},
            {"row": "grad_accumulation", "k": k},
        ]
    if fsdp:
        rows.append({"row": "fsdp2_cpu_offload", "k": 1})
    return rows


def speedloader_options(row: str, k: int, lowering: str) -> dict | None:
    """The backend options of a speedloader row (None: not a speedloader row)."""
    base = {"lowering": lowering, "num_subbatches": k, "weights": "host", "live_blocks": 2}
    if row == "weights_host":
        return base
    if row == "weights_host_cudagraphs":
        return {**base, "cudagraphs": True}
    if row == "weights_activations_host_recompute":
        return {**base, "activations": "host", "recompute": "blocks"}
    if row == "weights_activations_host":
        return {**base, "activations": "host", "recompute": "none"}
    if row == "grad_accumulation":
        return {**base, "schedule": "grad_accumulation"}
    return None


# -- measurement helpers ----------------------------------------------------------


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, nbytes: int, repeats: int = 5) -> dict:
    """Bytes per second of pinned host->device and device->host copies of ``nbytes``
    (median of ``repeats``). On the CPU: a plain memory copy, for the smoke run."""
    import torch

    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for name, (dst, src) in {"host_to_device": (on_device, host), "device_to_host": (host, on_device)}.items():
        dst.copy_(src, non_blocking=pin)  # first touch / context warm-up
        synchronize(device)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        result[f"{name}_bytes_per_second"] = nbytes / statistics.median(seconds)
    result["copy_bytes"] = nbytes
    result["pinned"] = pin
    return result


def build_model(shape: dict, device, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=shape["layers"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"], vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq"],
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def tier_bytes(bytes_moved) -> dict:
    """Bytes per step per tier that is not the device (each transfer counted once,
    at its off-device end), and the host<->device total that crosses PCIe."""
    per_tier: dict[str, int] = {}
    pcie = 0
    for (kind, source, destination), n in bytes_moved.items():
        for tier in {source.value, destination.value} - {"device"}:
            per_tier[tier] = per_tier.get(tier, 0) + n
        if {source.value, destination.value} == {"host", "device"}:
            pcie += n
    return {"per_tier": per_tier, "host_device": pcie}


def fsdp2_cpu_offload(model, device):
    """Wraps ``model`` with FSDP2 and CPU offload in a one-process group. The
    offloaded parameters are pinned on a CUDA device, as ``CPUOffloadPolicy()`` does;
    on the CPU, where pinning needs an accelerator, they are not (a smoke run).

    Raises:
        RuntimeError: torch.distributed cannot make a one-process group here, or
            FSDP2 is missing.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build")
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="slc-gpu-bench-store-"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def run_row(spec: dict) -> dict:
    """Runs one row in this process and returns its figures."""
    import torch

    import slcompile

    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    shape = spec["shape"]
    model = build_model(shape, device, dtype)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=generator).to(device)
    row, k = spec["row"], spec["k"]

    if row == "eager":
        forward = model
    elif row == "resident_inductor":
        # A smoke run on the CPU may name a cheaper backend; the measured row is Inductor's.
        forward = torch.compile(model, backend=spec.get("resident_backend", "inductor"))
    elif row == "resident_inductor_cudagraphs":
        forward = torch.compile(model, mode="reduce-overhead")
    elif row == "fsdp2_cpu_offload":
        try:
            forward = fsdp2_cpu_offload(model, device)
        except Exception as error:  # reported as the row's reason, not a failure of the bench
            return {"spec": spec, "unavailable": f"{type(error).__name__}: {error}"}
    else:
        forward = torch.compile(model, backend="speedloader",
                                options=speedloader_options(row, k, spec["lowering"]))

    issued = []  # the host thread's CPU seconds of each step until its work is issued

    def step() -> float:
        for parameter in model.parameters():
            parameter.grad = None
        synchronize(device)
        start, thread_start = time.perf_counter(), time.thread_time()
        loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        issued.append(time.thread_time() - thread_start)
        synchronize(device)
        return time.perf_counter() - start

    try:
        first = step()
        for _ in range(spec["warmup"]):
            step()
        slcompile.reset_runtime_stats()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, windows = [], []
        issued.clear()
        for _ in range(spec["repeats"]):
            slcompile.mark_step()
            times.append(step())
            windows.append(slcompile.mark_step())
    except Exception as error:
        if row == "fsdp2_cpu_offload":
            return {"spec": spec, "unavailable": f"{type(error).__name__}: {error}"}
        raise
    median = statistics.median_high(times)  # a measured step, so its counters go with it
    window = windows[times.index(median)]
    stats = slcompile.runtime_stats()
    moved = tier_bytes(window.bytes_moved)
    host = _host_profile(step, device.type == "cuda") if row != "fsdp2_cpu_offload" else None
    prediction = _predicted(spec, forward if row not in ("eager", "fsdp2_cpu_offload") else None, median)
    return {
        "spec": spec,
        "step_seconds": median,
        "all_step_seconds": times,
        # Near the step: the host is the bound; far under it: the device is.
        "host_issue_seconds": statistics.median(issued[:len(times)]),
        "tokens_per_second": shape["batch"] * shape["seq"] / median,
        "first_step_seconds": first,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "bytes_moved_per_step": {"/".join(part.value for part in key): n for key, n in window.bytes_moved.items()},
        "tier_bytes_per_step": moved["per_tier"],
        "host_device_bytes_per_step": moved["host_device"],
        "stall_seconds": window.stall_seconds,
        "pinned_host_bytes": stats.pinned_host_bytes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "host": host,
        **prediction,
    }


def _predicted(spec: dict, forward, median: float) -> dict:
    """The step the time model predicts for a speedloader row (`explain.report_time`
    of its compile report, with the profile at ``spec["profile_path"]``, measured on
    this machine), and its error against the median step; {} for another row or
    without a profile."""
    import slcompile
    from slcompile.analysis.machine import MachineProfile
    from slcompile.explain import report_time

    if speedloader_options(spec["row"], spec["k"], spec["lowering"]) is None or forward is None:
        return {}
    report = slcompile.compile_reports()[-1]
    if not spec.get("profile_path") or not report.partitioned or report.fallback_reason is not None:
        return {}
    with open(spec["profile_path"]) as f:
        profile = MachineProfile.from_json(f.read())
    predicted = report_time(report, report.config, profile).step_seconds
    return {"predicted_step_seconds": predicted, "prediction_error": (predicted - median) / median}


def _host_profile(step, cuda: bool) -> dict:
    """One more step under `torch.profiler` (`slcompile.step_profile`): the operators
    run outside compiled code, each `slc::` op's median host microseconds, and on
    CUDA the kernels and CUDA graphs launched (another step, with CUDA activity on)."""
    from slcompile.step_profile import profile_step

    ops = profile_step(step)
    launches = profile_step(step, cuda=True).launches if cuda else {}
    return {"eager_ops": ops.eager, "eager_prims": ops.eager_count("prims"), "eager_aten": ops.eager_count("aten"),
            "compiled_calls": ops.compiled_calls, "slc_op_host_us": ops.slc_median_us(),
            "slc_op_calls": {name: len(times) for name, times in ops.slc_host_us.items()},
            "launches": launches, "graph_launches": launches.get("cudaGraphLaunch", 0),
            "kernel_launches": sum(n for name, n in launches.items() if name != "cudaGraphLaunch")}


def run_isolated(spec: dict) -> dict:
    """Runs a row in a child process; a crash becomes the row's error."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--row", json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    if proc.returncode != 0:
        return {"spec": spec, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                f"exit status {proc.returncode}", "stderr_tail": proc.stderr[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def add_bounds(rows: list[dict], bandwidth: dict) -> None:
    """Adds % of resident Inductor and the bound max(compute, bytes / bandwidth)."""
    resident = next((r for r in rows if r["spec"]["row"] == "resident_inductor" and "step_seconds" in r), None)
    compute = resident["step_seconds"] if resident else None
    # Loads and stores share the link only in one direction each: the slower direction
    # with all bytes is the conservative figure.
    link = min(bandwidth["host_to_device_bytes_per_second"], bandwidth["device_to_host_bytes_per_second"])
    for row in rows:
        if "step_seconds" not in row:
            continue
        transfer = row["host_device_bytes_per_step"] / link
        row["transfer_seconds_at_bandwidth"] = transfer
        if compute is not None:
            row["percent_of_resident"] = 100.0 * compute / row["step_seconds"]
            row["bound_seconds"] = max(compute, transfer)
            row["over_bound"] = row["step_seconds"] / row["bound_seconds"]


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if "step_seconds" in r]
    labels = [r["spec"]["row"] + (f" K={r['spec']['k']}" if r["spec"]["k"] > 1 else "") for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.35 * len(rows) + 2))
    positions = range(len(rows))
    left.barh(positions, [r["step_seconds"] for r in rows], label="step")
    left.scatter([r.get("bound_seconds", 0) for r in rows], positions, color="black", marker="|", s=200,
                 label="bound max(compute, bytes / bandwidth)", zorder=3)
    left.set_yticks(list(positions), labels)
    left.invert_yaxis()
    left.set_xlabel("seconds per step (median)")
    left.legend(loc="lower right")
    peaks = [(r["peak_bytes"] or 0) / 2**30 for r in rows]
    right.barh(positions, peaks, color="tab:orange")
    right.set_yticks(list(positions), [""] * len(rows))
    right.invert_yaxis()
    right.set_xlabel("peak device memory (GiB)")
    fig.suptitle(f"{record['model']} on {record['device_name']} (torch {record['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a 4-layer model and batch 8 x 256: a quick run")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks the script runs")
    parser.add_argument("--ks", default=None, help="comma-separated K values (default 2,4,8; 2 for --cpu-smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per row (default 4; 2 for --cpu-smoke)")
    parser.add_argument("--warmup", type=int, default=1, help="steps after the first, before timing")
    parser.add_argument("--lowering", default=None, help="speedloader rows' lowering (default inductor; "
                                                         "aot_eager for --cpu-smoke)")
    parser.add_argument("--no-fsdp", action="store_true", help="leave out the FSDP2 CPUOffloadPolicy row")
    parser.add_argument("--only", default=None, help="comma-separated row names to run")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_bench.json; "
                                                    "a temp dir for --cpu-smoke)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row is not None:
        print(json.dumps(run_row(json.loads(args.row))))
        return 0

    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(f"gpu_bench: no CUDA device (torch {torch.__version__}, "
              f"cuda build {torch.version.cuda}); run it on a CUDA machine, or pass --cpu-smoke "
              "to check the script on the CPU", file=sys.stderr)
        return 2
    smoke = args.cpu_smoke
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    shape_name = "cpu_smoke" if smoke else ("small" if args.small else "full")
    ks = [int(k) for k in (args.ks or ("2" if smoke else "2,4,8")).split(",")]
    out = args.out or (os.path.join(tempfile.mkdtemp(prefix="slc-gpu-bench-"), "gpu_bench.json") if smoke
                       else os.path.join(HERE, "results", "gpu_bench.json"))
    base = {
        "device": str(device), "dtype": "float32" if smoke else "bfloat16", "shape": MODELS[shape_name],
        "repeats": args.repeats or (2 if smoke else 4), "warmup": args.warmup,
        "lowering": args.lowering or ("aot_eager" if smoke else "inductor"),
    }
    specs = row_specs(ks, fsdp=not args.no_fsdp)
    if args.only:
        wanted = set(args.only.split(","))
        specs = [s for s in specs if s["row"] in wanted]
    bandwidth = copy_bandwidth(device, (16 << 20) if smoke else (1 << 30))
    rows = []
    for spec in specs:
        row = run_isolated({**base, **spec})
        rows.append(row)
        status = row.get("error") or row.get("unavailable") or f"{row['step_seconds']:.3f} s"
        print(f"gpu_bench: {spec['row']} K={spec['k']}: {status}", file=sys.stderr, flush=True)
    add_bounds(rows, bandwidth)
    record = {
        "model": f"HF Llama {shape_name}: " + ", ".join(f"{k} {v}" for k, v in MODELS[shape_name].items()),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)",
        "torch": torch.__version__,
        "bandwidth": bandwidth,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    plot(record, os.path.splitext(out)[0] + ".png")
    print(json.dumps(record))
    print(f"gpu_bench: wrote {out} and its .png", file=sys.stderr)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
