"""Training with weights that do not stay in device memory: speedloader against
DeepSpeed ZeRO-3 with offload, the same Hugging Face Llama, data and optimizer.

Usage:
    python bench/deepspeed_bench.py [--quick] [--steps 8] [--omp-wait-policy PASSIVE]
                                    [--out bench/results/deepspeed_bench.json]

DeepSpeed is not a dependency of the package (it is in the ``bench`` extra); its
nvme offload needs libaio's headers to build the async_io op (bench/README.md). It
runs single-process on the CPU accelerator (``DS_ACCELERATOR=cpu``), gloo backend.

Systems, each configuration in its own process:
- ``speedloader``: `torch.compile(model, backend="speedloader")`, `num_subbatches=K`,
  block weights on the nvme tier (O_DIRECT files), `live_blocks=2`, aot_eager; one
  compiled step over the whole batch, then the optimizer step inside
  `slcompile.gathered_weights(model)`.
- ``deepspeed_cpu``: ZeRO stage 3, `offload_param` and `offload_optimizer` on `cpu`,
  `gradient_accumulation_steps=K`, micro batch = batch / K.
- ``deepspeed_nvme``: the same with `offload_param` on `nvme` (async_io op, O_DIRECT
  swap files in a temp directory), tuned so parameters stay on disk and swap buffers
  cover two blocks (see `deepspeed_config`), with one work-around for a dtype bug
  (`keep_swap_dtype_of_model`). One extra short run without the work-around records
  whether DeepSpeed's nvme offload works as shipped. DeepSpeed swaps only parameters
  of at least one aio block (1 MiB): the ``--quick`` model's are smaller, so there its
  nvme run reads nothing from disk (a smoke test only).

Both sides use `torch.optim.AdamW` (DeepSpeed with `zero_force_ds_cpu_optimizer:
false`), fp32, no dropout, no gradient clipping (DeepSpeed's default clips at 1.0;
the config turns it off), the same initial weights (built from the same seed; a
checksum of them is recorded per run and compared) and the same batch on every step (a
fixed random batch: the loss then falls step by step, which makes any difference in
the updates visible). DeepSpeed divides each micro-batch loss by K before its
backward; every micro-batch has the same number of tokens, so the sum of those
gradients is the gradient of the whole-batch mean loss that speedloader computes.

libgomp's default lets idle OpenMP threads spin for a while before sleeping. On two
cores shared with other jobs those spins take the cores that the thread they wait
for needs, and the compiled speedloader step (many short parallel regions with Python
and transfer waits between them) suffered far more than DeepSpeed's eager steps:
``--omp-wait-policy PASSIVE`` sets ``OMP_WAIT_POLICY`` for every run, both systems.

Per run: the loss of every step; over the steps after the first (which compiles or
initialises): median step time, tokens/s, disk bytes read and written per step
(/proc/self/io), the time the process's threads waited for a core (schedstat: load
from other processes), peak RSS of those steps (`VmHWM` after a reset through
/proc/self/clear_refs); and peak RSS of the whole process (`getrusage` maxrss, which
includes building the model in RAM).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SYSTEMS = ("speedloader", "deepspeed_cpu", "deepspeed_nvme")
LEARNING_RATE = 1e-3
MiB = 2**20


def build_model(spec: dict):
    """The benchmark's Llama, random weights from a fixed seed, in training mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=spec["layers"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_attention_heads=spec["heads"], num_key_value_heads=spec["heads"], vocab_size=spec["vocab"],
        max_position_embeddings=spec["seq_len"], attention_dropout=0.0,
    )
    return LlamaForCausalLM(config).train()


def weight_checksum(model) -> float:
    """A sum over every parameter, to show two processes started from the same weights."""
    import torch

    with torch.no_grad():
        return float(sum(p.double().abs().sum() for p in model.parameters()))


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def disk_io_bytes() -> tuple[int, int]:
    """Bytes this process (all its threads) has read from and written to storage,
    page cache excluded: the disk traffic of each system, measured the same way."""
    fields = {}
    with open("/proc/self/io") as handle:
        for line in handle:
            name, value = line.split(":")
            fields[name] = int(value)
    return fields["read_bytes"], fields["write_bytes"]


def runqueue_wait_seconds() -> float:
    """Time this process's threads spent runnable but waiting for a core (schedstat),
    summed over the threads alive now: how much other load on the machine delayed it."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as handle:
                total += int(handle.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total / 1e9


def reset_peak_rss() -> None:
    """Resets VmHWM to the current RSS (Linux >= 4.0), so later peaks are the steps' own."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def speedloader_trainer(spec: dict, model, optimizer):
    """Returns a function that runs one training step and returns its loss."""
    import torch

    import slcompile

    compiled = torch.compile(
        model, backend="speedloader",
        options={"num_subbatches": spec["k"], "weights": "nvme", "live_blocks": 2,
                 "lowering": "aot_eager", "offload_dir": spec["dir"]},
    )

    def step(ids) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        with slcompile.gathered_weights(model):
            optimizer.step()
        return loss.item()

    return step


def deepspeed_config(spec: dict, model, world: int = 1) -> dict:
    """ZeRO-3 over K micro-batches of `spec["batch"]`, which `world` data-parallel ranks
    share; parameters and optimizer states offloaded unless `spec["offload"]` is false."""
    k, batch = spec["k"], spec["batch"]
    zero = {"stage": 3}
    if spec.get("offload", True):
        zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    if spec["system"] == "deepspeed_nvme":
        # Each parameter swapped in takes one buffer of `buffer_size` elements (at
        # least the largest parameter; the default, 1e8 elements, would be 400 MB
        # each). Buffers for two blocks, like speedloader's live_blocks=2, with live
        # parameters bounded to two blocks and a reuse distance of 0 so that used
        # parameters give their buffers back (with the defaults, 5 buffers ran out
        # at the sixth parameter of the first forward). `max_in_cpu` defaults to 1e9
        # elements, which copies every parameter of a model this size back into RAM
        # at start-up for good (no disk reads while training): 0 keeps them on disk.
        block = model.model.layers[0]
        block_numel = sum(p.numel() for p in block.parameters())
        zero["offload_param"] = {
            "device": "nvme", "nvme_path": os.path.join(spec["dir"], "deepspeed-swap"), "pin_memory": False,
            "buffer_count": 2 * len(list(block.parameters())) + 2,
            "buffer_size": max(p.numel() for p in model.parameters()),
            "max_in_cpu": 0,
        }
        zero.update(stage3_max_live_parameters=2 * block_numel, stage3_prefetch_bucket_size=block_numel,
                    stage3_max_reuse_distance=0)
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch // (k * world),
        "gradient_accumulation_steps": k,
        "zero_optimization": zero,
        # This DeepSpeed clips the gradient norm to 1.0 unless told otherwise; the
        # other side does not clip, and clipping changes every update.
        "gradient_clipping": 0.0,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }


def keep_swap_dtype_of_model() -> None:
    """Works around DeepSpeed 0.19.8 storing an fp32 model's nvme-swapped parameters
    as bfloat16 on a CPU accelerator.

    `zero.Init._set_dtype` computes ``dtype or torch.float16 if fp16_supported() else
    torch.bfloat16 if is_bf16_supported else torch.float32``: the conditional binds
    looser than ``or``, and ``is_bf16_supported`` is not called, so without fp16
    support the swap dtype is bfloat16 whatever the model's dtype, and the first
    linear layer fails with "expected m1 and m2 to have the same dtype". Answering
    that fp16 is supported, as a GPU does, makes the expression give the model's
    dtype; nothing else in an fp32 run reads that answer.
    """
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def deepspeed_trainer(spec: dict, model, optimizer, record: dict):
    """Returns a function that runs one training step (K micro-batches) and returns its loss."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    if spec["system"] == "deepspeed_nvme":
        from deepspeed.ops.op_builder import AsyncIOBuilder

        record["async_io_compatible"] = bool(AsyncIOBuilder().is_compatible(verbose=False))
        if spec.get("patch_swap_dtype", True):
            keep_swap_dtype_of_model()
    config = deepspeed_config(spec, model)
    record["deepspeed_config"] = config
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    record["deepspeed_optimizer"] = type(ds_optimizer).__name__
    k = spec["k"]

    def step(ids) -> float:
        losses = []
        for part in ids.chunk(k):
            loss = engine(part, labels=part).loss
            engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
            engine.step()  # steps the optimizer at the accumulation boundary only
            losses.append(loss.item())
        return sum(losses) / k

    return step


def run_one(spec: dict) -> dict:
    """Runs one (system, K) configuration in this process and returns its figures."""
    import torch

    record: dict = {"spec": spec}
    model = build_model(spec)
    record["initial_weight_checksum"] = weight_checksum(model)
    record["parameters"] = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    ours = spec["system"] == "speedloader"
    if ours:
        from slcompile.runtime import mark_step

        step = speedloader_trainer(spec, model, optimizer)
    else:
        step = deepspeed_trainer(spec, model, optimizer, record)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]), generator=torch.Generator().manual_seed(1))
    record["rss_after_setup_bytes"] = proc_status_kib("VmRSS") * 1024
    losses, times, weight_bytes, stalls = [], [], [], []
    for index in range(spec["steps"]):
        if index == 1:
            reset_peak_rss()
            io_before = disk_io_bytes()
            wait_before = runqueue_wait_seconds()
            load_before = os.getloadavg()
        if ours:
            mark_step()
        started = time.perf_counter()
        losses.append(step(ids))
        times.append(time.perf_counter() - started)
        if ours:
            figures = mark_step()
            weight_bytes.append(sum(n for (kind, _, _), n in figures.bytes_moved.items() if kind.value == "weight"))
            stalls.append(figures.stall_seconds)
    io_after = disk_io_bytes()
    timed_steps = spec["steps"] - 1
    median = statistics.median(times[1:])
    record.update(
        runqueue_wait_seconds_per_step=(runqueue_wait_seconds() - wait_before) / timed_steps,
        loadavg_timed_steps=[load_before, os.getloadavg()],
        disk_read_bytes_per_step=(io_after[0] - io_before[0]) / timed_steps,
        disk_write_bytes_per_step=(io_after[1] - io_before[1]) / timed_steps,
        losses=losses,
        step_seconds=times,
        median_step_seconds=median,
        tokens_per_second=spec["batch"] * spec["seq_len"] / median,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        steady_peak_rss_bytes=proc_status_kib("VmHWM") * 1024,
        torch_threads=torch.get_num_threads(),
    )
    if ours:
        import slcompile

        report = slcompile.compile_reports()[-1]
        record["slcompile_file"] = slcompile.__file__
        record["fallback_reason"] = report.fallback_reason
        record["streamed_bytes"] = report.streamed_bytes
        # Forward and backward loads plus the optimizer step's load and store.
        record["weight_bytes_per_step"] = weight_bytes
        # Time the compute thread waited for transfers, per step.
        record["stall_seconds_per_step"] = stalls
    return record


def error_line(stderr: str) -> str:
    """The line of a failed run's stderr that names the exception."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        text = line.removeprefix("[rank0]:").strip()
        if "Error" in text.split(":")[0] or "Exception" in text.split(":")[0]:
            return text
    return lines[-1] if lines else ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_in_subprocess(spec: dict, omp_wait_policy: str | None) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        return {"spec": spec, "error": error_line(proc.stderr), "stderr_tail": proc.stderr[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(results: list[dict], ks: list[int]) -> list[dict]:
    """One row per (K, system): throughput, memory, disk traffic, and how far its
    losses are from speedloader's at the same K."""
    by_key = {(r["spec"]["system"], r["spec"]["k"]): r for r in results}
    rows = []
    for k in ks:
        ours = by_key[("speedloader", k)]
        for system in SYSTEMS:
            run = by_key.get((system, k))
            if run is None:
                continue
            row = {"k": k, "system": system}
            if "error" in run:
                rows.append(dict(row, error=run["error"]))
                continue
            row.update(
                median_step_seconds=run["median_step_seconds"],
                tokens_per_second=run["tokens_per_second"],
                peak_rss_bytes=run["peak_rss_bytes"],
                steady_peak_rss_bytes=run["steady_peak_rss_bytes"],
                disk_read_bytes_per_step=run["disk_read_bytes_per_step"],
                disk_write_bytes_per_step=run["disk_write_bytes_per_step"],
                runqueue_wait_seconds_per_step=run["runqueue_wait_seconds_per_step"],
            )
            if "error" not in ours:
                row["speedloader_speedup"] = ours["tokens_per_second"] / run["tokens_per_second"]
                row["max_abs_loss_difference_vs_speedloader"] = max(
                    abs(a - b) for a, b in zip(ours["losses"], run["losses"])
                )
                row["same_initial_weights"] = run["initial_weight_checksum"] == ours["initial_weight_checksum"]
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'K':>2} {'system':15} {'step s':>7} {'tok/s':>7} {'SL x':>6} {'peak RSS MiB':>12} {'steps RSS MiB':>13} "
          f"{'disk rd MiB/step':>16} {'disk wr MiB/step':>16} {'max |dloss|':>12} {'rq wait s/step':>15}")
    for r in rows:
        if "error" in r:
            print(f"{r['k']:>2} {r['system']:15} failed: {r['error']}")
            continue
        print(f"{r['k']:>2} {r['system']:15} {r['median_step_seconds']:7.2f} {r['tokens_per_second']:7.1f} "
              f"{r.get('speedloader_speedup', float('nan')):6.2f} {r['peak_rss_bytes'] / MiB:12.0f} "
              f"{r['steady_peak_rss_bytes'] / MiB:13.0f} {r['disk_read_bytes_per_step'] / MiB:16.1f} "
              f"{r['disk_write_bytes_per_step'] / MiB:16.1f} "
              f"{r.get('max_abs_loss_difference_vs_speedloader', float('nan')):12.2e} "
              f"{r['runqueue_wait_seconds_per_step']:15.2f}")


def plot(results: list[dict], ks: list[int], path: str) -> None:
    """Throughput per K, the loss curves, and each DeepSpeed curve's distance from speedloader's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"speedloader": "speedloader (nvme tier)", "deepspeed_cpu": "DeepSpeed ZeRO-3, params on cpu",
              "deepspeed_nvme": "DeepSpeed ZeRO-3, params on nvme"}
    styles = {"speedloader": "-", "deepspeed_cpu": "--", "deepspeed_nvme": ":"}
    colors = dict(zip(ks, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    by_key = {(r["spec"]["system"], r["spec"]["k"]): r for r in results}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    width = 0.8 / len(SYSTEMS)
    for index, system in enumerate(SYSTEMS):
        values = [by_key.get((system, k), {}).get("tokens_per_second", 0.0) for k in ks]
        positions = [i + (index - (len(SYSTEMS) - 1) / 2) * width for i in range(len(ks))]
        axes[0].bar(positions, values, width, label=labels[system])
    axes[0].set_xticks(range(len(ks)), [f"K={k}" for k in ks])
    axes[0].set(ylabel="tokens/s (median step)", title="training throughput")
    axes[0].legend(fontsize=8)
    for k in ks:
        ours = by_key.get(("speedloader", k), {})
        for system in SYSTEMS:
            run = by_key.get((system, k), {})
            if "losses" not in run:
                continue
            axes[1].plot(range(len(run["losses"])), run["losses"], linestyle=styles[system], color=colors[k],
                         label=f"{system}, K={k}")
            if system != "speedloader" and "losses" in ours:
                gaps = [max(abs(a - b), 1e-9) for a, b in zip(run["losses"], ours["losses"])]
                axes[2].plot(range(len(gaps)), gaps, linestyle=styles[system], color=colors[k], marker="o",
                             label=f"{system}, K={k}")
    axes[1].set(xlabel="step", ylabel="loss", title="loss per step (same weights, batch, AdamW)")
    axes[2].set(xlabel="step", ylabel="|loss - speedloader loss|", yscale="log",
                title="DeepSpeed loss minus speedloader loss (1e-9 = equal)")
    for axis in axes[1:]:
        axis.legend(fontsize=7)
    for axis in axes:
        axis.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def source_state() -> dict:
    """Which slcompile the runs import: its directory, and the commit and uncommitted
    files of the git tree it sits in (when it is one)."""
    root = os.path.dirname(HERE)
    state = {"slcompile_dir": os.path.join(root, "slcompile")}
    try:
        state["commit"] = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], check=True,
                                         capture_output=True, text=True).stdout.strip()
        state["uncommitted_files"] = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "slcompile"], check=True, capture_output=True, text=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        state["commit"] = None
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small model and K in {1, 4}: a smoke run")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run; the first is not timed")
    parser.add_argument("--dir", default=None, help="where offload files go (default: a temp dir)")
    parser.add_argument(
        "--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], default=None,
        help="OMP_WAIT_POLICY for every run (default: inherited). PASSIVE stops idle OpenMP threads from "
             "spinning, which on a machine shared with other jobs decides the timings",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results", "deepspeed_bench.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return

    from tqdm import tqdm

    load_at_start = os.getloadavg()
    directory = tempfile.mkdtemp(prefix="slc-ds-bench-", dir=args.dir)
    if args.quick:
        model = {"layers": 8, "hidden": 256, "intermediate": 688, "heads": 4, "vocab": 512}
        ks = [1, 4]
    else:
        model = {"layers": 8, "hidden": 512, "intermediate": 1408, "heads": 8, "vocab": 1024}
        ks = [1, 4, 8]
    batch, seq_len = 8, 64
    specs = [dict(model, batch=batch, seq_len=seq_len, k=k, system=system, steps=args.steps,
                  dir=os.path.join(directory, f"{system}-k{k}"))
             for k in ks for system in SYSTEMS]
    # DeepSpeed's nvme parameter offload as shipped (no swap-dtype work-around), one
    # short run, to record whether it works on this machine and how it fails if not.
    first_nvme = next(spec for spec in specs if spec["system"] == "deepspeed_nvme")
    probe = dict(first_nvme, steps=2, patch_swap_dtype=False, dir=os.path.join(directory, "probe"))
    results, probes = [], []
    try:
        for spec in tqdm([*specs, probe], desc="deepspeed bench", unit="run"):
            os.makedirs(spec["dir"])
            outcome = run_in_subprocess(spec, args.omp_wait_policy)
            (probes if spec is probe else results).append(outcome)
            shutil.rmtree(spec["dir"], ignore_errors=True)
            if "error" in outcome:
                tqdm.write(f"{spec['system']} K={spec['k']} failed: {outcome['error']}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    load_at_end = os.getloadavg()
    rows = summarize(results, ks)
    print_table(rows)
    print("DeepSpeed nvme offload as shipped (K=1): "
          + (f"failed: {probes[0]['error']}" if "error" in probes[0] else "ran"))

    from importlib.metadata import version

    import torch

    command = "python bench/deepspeed_bench.py" + (" --quick" if args.quick else "") + f" --steps {args.steps}"
    if args.omp_wait_policy:
        command += f" --omp-wait-policy {args.omp_wait_policy}"
    record = {
        "command": command,
        "machine": {
            "platform": platform.platform(), "cores": os.cpu_count(),
            "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "loadavg_start": load_at_start, "loadavg_end": load_at_end, "niceness": os.nice(0),
            "omp_wait_policy": args.omp_wait_policy or os.environ.get("OMP_WAIT_POLICY"),
        },
        "source": source_state(),
        "versions": {"torch": torch.__version__, "deepspeed": version("deepspeed"),
                     "transformers": version("transformers"), "python": platform.python_version()},
        "config": {"model": model, "batch": batch, "seq_len": seq_len, "tokens_per_step": batch * seq_len,
                   "steps": args.steps, "timed_steps": args.steps - 1, "ks": ks,
                   "optimizer": f"torch.optim.AdamW(lr={LEARNING_RATE}) on both sides", "dtype": "float32",
                   "data": "one fixed random batch (seed 1) every step; labels = input ids"},
        "summary": rows,
        "runs": results,
        "deepspeed_nvme_as_shipped": probes[0],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=2)
    plot(results, ks, args.out.replace(".json", ".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
