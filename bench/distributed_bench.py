"""Block weights sharded across ranks, against one process streaming them whole and
against FSDP2 with gradient accumulation.

Usage:
    python bench/distributed_bench.py [--quick] [--world 2] [--k 4] [--steps 5] [--out FILE]

Configurations (the package's GPT, AdamW, the same global batch and K; each in its
own spawned processes, ranks over gloo with a file rendezvous):
- ``single``: one process, the whole batch, block weights streamed whole from nvme
  (`slcompile.offload_optimizer`, `lowering="aot_eager"`).
- ``sharded``: `--world` processes, each with 1/W of the batch and
  `shard_weights=True`: each rank's nvme tier holds 1/W of every block weight;
  fetches all-gather, gradients reduce-scatter.
- ``fsdp2_grad_accum``: `--world` processes, `torch.distributed.fsdp.fully_shard`
  on each block and on the root (weights resident, sharded), K micro-batches of the
  rank's batch one after the other, eager `torch.optim.AdamW` on the shards. FSDP2
  reduce-scatters the gradients after each micro-batch's backward (its default).
- ``fsdp2_grad_accum_no_sync``: the same with `set_requires_gradient_sync(False)`
  on all but the last micro-batch: one reduce-scatter per step, the unsharded
  gradients held over the K micro-batches.
- ``fsdp2_cpu_offload``: ``fsdp2_grad_accum`` with `CPUOffloadPolicy(pin_memory=False)`
  (pinned memory needs an accelerator); on a CPU-only machine the "device" already is
  host memory, so it measures FSDP2's offload path, not a transfer.
- ``deepspeed_zero3``: `--world` processes, DeepSpeed ZeRO stage 3 on its CPU
  accelerator (`deepspeed_bench.deepspeed_config`), `gradient_accumulation_steps=K`,
  micro-batches of the rank's batch, `torch.optim.AdamW`; its collectives counted by
  `counted_deepspeed_collectives`.
- ``deepspeed_zero3_offload``: the same with `offload_param` and `offload_optimizer`
  on `cpu` (again host memory on this machine: DeepSpeed's offload path).

Reported per configuration (rank 0; memory of every rank): the median step time
over `--steps` steps after two warm-up steps, the bytes per (kind, source tier,
destination tier) of the last step, each rank's peak RSS during the timed steps
(`VmHWM` after a reset) and over the whole process (`getrusage` maxrss), and the loss
of every step: the mean cross-entropy over the labelled tokens of the whole global
batch (every step trains on the same batch, so the losses fall step by step and
configurations that train the same model give the same curve). Collective
bytes are the bytes a rank receives from the others, as
`slcompile.runtime.collectives` defines them; FSDP2's and DeepSpeed's are counted by
`counted_collectives`, which wraps the `torch.distributed` functions they call.
`paper_model` scales each schedule's collective bytes per step to a stated model
of 8 GPUs with 100 Gb/s links: a model, not a measurement. On a machine with fewer
cores than ranks, the ranks share the cores and the step time says little.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CONFIGS = ("single", "sharded", "fsdp2_grad_accum", "fsdp2_grad_accum_no_sync", "fsdp2_cpu_offload",
           "deepspeed_zero3", "deepspeed_zero3_offload")
# Configurations recorded as skipped, with the reason, when they fail: they depend on
# what another library supports on a CPU-only machine.
MAY_SKIP = ("fsdp2_cpu_offload", "deepspeed_zero3", "deepspeed_zero3_offload")
LEARNING_RATE = 1e-4

# The torch.distributed collectives whose bytes `counted_collectives` counts, with
# the kind each is counted as and the argument whose size that count is based on.
# FSDP2 (torch 2.13) calls `all_gather_single` and `reduce_scatter_single`, and
# `all_reduce` when it replicates across a second mesh dimension (HSDP); DeepSpeed's
# ZeRO-3 (0.19) `all_gather_into_tensor`, `reduce_scatter_tensor` and `all_reduce`
# (see `counted_deepspeed_collectives`).
_COUNTED = {
    "all_gather_single": ("all_gather", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "output"),
    "reduce_scatter_tensor": ("reduce_scatter", "output"),
    "all_reduce": ("all_reduce", "tensor"),
}


def received_bytes(kind: str, tensor, world: int) -> int:
    """Bytes a rank receives from the other `world - 1` ranks in one collective, as
    `slcompile.runtime.collectives` counts them: for an all-gather, the other ranks'
    shards (`tensor` is this rank's input shard); for a reduce-scatter, the other
    ranks' partial shards (`tensor` is the output shard); for an all-reduce of
    `tensor`, twice the other ranks' shards of it (a reduce-scatter and an
    all-gather of `ceil(numel / world)` elements each)."""
    if kind == "all_reduce":
        return 2 * (world - 1) * -(-tensor.numel() // world) * tensor.element_size()
    return (world - 1) * tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def counted_collectives() -> Iterator[Counter]:
    """Counts the bytes this rank receives in the collectives called through
    `torch.distributed` while the block runs (see `received_bytes`).

    Yields a Counter keyed as `slcompile.mark_step().bytes_moved` keys collectives,
    `(TransferKind, Tier.DEVICE, Tier.DEVICE)`, filled as the collectives are issued.
    A collective that one of the counted ones calls on its way is not counted again.
    Only for code that calls `torch.distributed.<name>` at run time (FSDP2 does);
    not for slcompile's own collectives, which count themselves.
    """
    import torch.distributed as dist

    from slcompile.runtime import Tier, TransferKind

    counts: Counter = Counter()
    inside = threading.local()
    originals = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

    def counting(name, original):
        kind, argument = _COUNTED[name]
        key = (TransferKind(kind), Tier.DEVICE, Tier.DEVICE)
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            if getattr(inside, "depth", 0) == 0:
                bound = signature.bind(*args, **kwargs).arguments
                counts[key] += received_bytes(kind, bound[argument], dist.get_world_size(bound.get("group")))
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                inside.depth -= 1

        return wrapper

    with mock.patch.multiple(dist, **{name: counting(name, original) for name, original in originals.items()}):
        yield counts


@contextlib.contextmanager
def counted_deepspeed_collectives() -> Iterator[Counter]:
    """`counted_collectives` for DeepSpeed: `deepspeed.comm`'s torch backend calls
    `torch.distributed.all_reduce` at run time, but binds
    `torch.distributed.all_gather_into_tensor` and `reduce_scatter_tensor` when it is
    created (its `all_gather_function` and `reduce_scatter_function`, which ZeRO-3's
    parameter gathers and gradient reduce-scatters go through); those two are pointed
    at the counting wrappers while the block runs."""
    import torch.distributed as dist
    from deepspeed import comm

    backend = comm.comm.cdb
    bound = {"all_gather_function": "all_gather_into_tensor", "reduce_scatter_function": "reduce_scatter_tensor"}
    originals = {attribute: getattr(backend, attribute) for attribute in bound}
    for attribute, name in bound.items():
        if originals[attribute] is not getattr(dist, name):
            raise RuntimeError(f"deepspeed.comm's {attribute} is {originals[attribute]!r}, not torch.distributed."
                               f"{name}: this DeepSpeed's collectives would not be counted")
    with counted_collectives() as counts, \
            mock.patch.multiple(backend, **{attribute: getattr(dist, name) for attribute, name in bound.items()}):
        yield counts


def _spec(args) -> dict:
    if args.quick:
        return {"n_layers": 2, "d_model": 64, "vocab_size": 128, "seq_len": 16, "batch": 8}
    return {"n_layers": 8, "d_model": 512, "vocab_size": 1024, "seq_len": 32, "batch": 8}


def _proc_status_bytes(field: str) -> int:
    from bench.deepspeed_bench import proc_status_kib

    return proc_status_kib(field) * 1024


def _model_and_batch(spec: dict, rank: int, world: int):
    import torch

    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

    torch.manual_seed(0)
    config = GPTConfig(n_layers=spec["n_layers"], d_model=spec["d_model"], vocab_size=spec["vocab_size"],
                       seq_len=spec["seq_len"])
    idx, targets = make_gpt_batch(config, spec["batch"])
    local = slice(rank * spec["batch"] // world, (rank + 1) * spec["batch"] // world)
    return TinyGPT(config), idx[local], targets[local]


def _labelled(targets) -> int:
    """Tokens with a label (`make_gpt_batch` masks some with -100)."""
    return int((targets != -100).sum())


def _speedloader_step(spec: dict, rank: int, world: int, k: int, offload_dir: str):
    """One training step of the speedloader schedule, its bytes counted by the runtime."""
    import torch

    import slcompile

    model, idx, targets = _model_and_batch(spec, rank, world)
    optimizer = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=LEARNING_RATE)
    options = {"lowering": "aot_eager", "num_subbatches": k, "weights": "nvme", "offload_dir": offload_dir,
               "shard_weights": world > 1}
    compiled = torch.compile(model, backend="speedloader", options=options)
    parameter_bytes = sum(p.nbytes for p in model.parameters())

    labelled = _labelled(targets)

    def step() -> tuple[Counter, float, int]:
        loss = compiled(idx, targets)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return Counter(), loss.item() * labelled, labelled

    return step, parameter_bytes


def _fsdp2_step(spec: dict, rank: int, world: int, k: int, config: str):
    """One training step of FSDP2 with K micro-batches, its collectives counted by
    `counted_collectives`."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model, idx, targets = _model_and_batch(spec, rank, world)
    parameter_bytes = sum(p.nbytes for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if config == "fsdp2_cpu_offload" else {}
    for block in model.layers:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    micro = list(zip(idx.chunk(k), targets.chunk(k)))
    no_sync = config == "fsdp2_grad_accum_no_sync"

    def step() -> tuple[Counter, float, int]:
        loss_sum = 0.0
        with counted_collectives() as moved:
            for index, (micro_idx, micro_targets) in enumerate(micro):
                if no_sync:
                    model.set_requires_gradient_sync(index == len(micro) - 1)
                loss = model(micro_idx, micro_targets)[1]
                (loss / len(micro)).backward()
                loss_sum += loss.item() * _labelled(micro_targets)
            optimizer.step()
            optimizer.zero_grad()
        return moved, loss_sum, _labelled(targets)

    return step, parameter_bytes


def _deepspeed_step(spec: dict, rank: int, world: int, k: int, config: str):
    """One training step of DeepSpeed ZeRO-3 with K micro-batches (its gradient
    accumulation), its collectives counted by `counted_deepspeed_collectives`."""
    # The CPU accelerator, and the variables torch's launcher sets (DeepSpeed's engine
    # reads LOCAL_RANK); the ranks here are spawned processes.
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed
    import torch

    from bench.deepspeed_bench import deepspeed_config

    model, idx, targets = _model_and_batch(spec, rank, world)
    parameter_bytes = sum(p.nbytes for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    deepspeed.init_distributed(dist_backend="gloo")  # takes the process group already made
    ds_spec = {"k": k, "batch": spec["batch"], "system": config, "offload": config == "deepspeed_zero3_offload"}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=deepspeed_config(ds_spec, model, world))
    micro = list(zip(idx.chunk(k), targets.chunk(k)))

    def step() -> tuple[Counter, float, int]:
        loss_sum = 0.0
        with counted_deepspeed_collectives() as moved:
            for micro_idx, micro_targets in micro:
                loss = engine(micro_idx, micro_targets)[1]
                engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
                engine.step()  # steps the optimizer after the K-th micro-batch only
                loss_sum += loss.item() * _labelled(micro_targets)
        return moved, loss_sum, _labelled(targets)

    return step, parameter_bytes


def _run(config: str, rank: int, world: int, spec: dict, k: int, steps: int, offload_dir: str) -> dict:
    from bench.deepspeed_bench import reset_peak_rss
    from slcompile.runtime import mark_step, reset_runtime_stats

    if config in ("single", "sharded"):
        step, parameter_bytes = _speedloader_step(spec, rank, world, k, offload_dir)
    elif config.startswith("deepspeed"):
        step, parameter_bytes = _deepspeed_step(spec, rank, world, k, config)
    else:
        step, parameter_bytes = _fsdp2_step(spec, rank, world, k, config)
    times, loss_sums, labelled = [], [], []
    reset_runtime_stats()
    for index in range(steps + 2):
        if index == 2:
            reset_peak_rss()
        started = time.perf_counter()
        counted, loss_sum, labels = step()
        elapsed = time.perf_counter() - started
        loss_sums.append(loss_sum)
        labelled.append(labels)
        last = Counter(mark_step().bytes_moved) + counted
        if index >= 2:
            times.append(elapsed)
    moved = {f"{kind.value} {source.value}->{destination.value}": n
             for (kind, source, destination), n in last.items() if n}
    return {"step_seconds": statistics.median(times), "bytes_per_step": moved,
            "parameter_bytes": parameter_bytes, "loss_sums": loss_sums, "labelled_tokens": labelled,
            "steps_peak_rss_bytes": _proc_status_bytes("VmHWM"),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _rank_main(rank: int, world: int, rendezvous: str, config: str, spec: dict, k: int, steps: int,
               offload_dir: str, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=10))
    try:
        try:
            # Rank processes print nothing of their own; DeepSpeed's log lines go to
            # stderr, leaving stdout to the record.
            with contextlib.redirect_stdout(sys.stderr):
                result = _run(config, rank, world, spec, k, steps, offload_dir)
        except Exception as error:
            if config not in MAY_SKIP:
                raise
            # Recorded as skipped, with the reason, where the other library does not run.
            result = {"skipped": _failure(error)}
    finally:
        if world > 1:
            dist.destroy_process_group()
    out[(config, rank)] = result


def _failure(error: BaseException) -> str:
    """The error's first line and the innermost frame that raised it."""
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = frame.filename.split("site-packages" + os.sep)[-1]
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} ({where}:{frame.lineno})"


def _launch(config: str, world: int, spec: dict, k: int, steps: int, workdir: str) -> dict:
    """Runs one configuration on `world` spawned ranks; rank 0's result, with every
    rank's peak RSS and the global batch's loss per step."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        offload_dir = tempfile.mkdtemp(dir=workdir)
        rendezvous = os.path.join(workdir, f"{config}.rendezvous")
        mp.spawn(_rank_main, args=(world, rendezvous, config, spec, k, steps, offload_dir, out),
                 nprocs=world, join=True)
        ranks = [out[(config, rank)] for rank in range(world)]
    result = {"world": world, **ranks[0]}
    skipped = [r["skipped"] for r in ranks if "skipped" in r]
    if skipped:
        return {"world": world, "skipped": skipped[0]}
    result["steps_peak_rss_bytes_per_rank"] = [r["steps_peak_rss_bytes"] for r in ranks]
    result["peak_rss_bytes_per_rank"] = [r["peak_rss_bytes"] for r in ranks]
    # The loss of the global batch: the labelled tokens' mean over every rank.
    del result["loss_sums"], result["labelled_tokens"]
    result["losses"] = [sum(r["loss_sums"][i] for r in ranks) / sum(r["labelled_tokens"][i] for r in ranks)
                        for i in range(len(ranks[0]["loss_sums"]))]
    return result


def _collective_bytes(result: dict) -> dict[str, int]:
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    moved = result["bytes_per_step"]
    return {kind: moved.get(f"{kind} device->device", 0) for kind in kinds}


def _weight_bytes(result: dict) -> int:
    return sum(n for key, n in result["bytes_per_step"].items() if key.startswith("weight"))


def loss_differences(configs: dict) -> dict:
    """Each configuration's loss at the last step, and the largest difference of its
    per-step losses from those of `single` (the whole batch in one process) and of
    `fsdp2_grad_accum` (which, like DeepSpeed, averages K micro-batch means per rank)."""
    trained = {name: result["losses"] for name, result in configs.items() if "losses" in result}
    differences: dict = {"last_step_loss": {name: losses[-1] for name, losses in trained.items()}}
    for reference in ("single", "fsdp2_grad_accum"):
        if reference in trained:
            differences[f"max_abs_difference_vs_{reference}"] = {
                name: max(abs(a - b) for a, b in zip(losses, trained[reference]))
                for name, losses in trained.items() if name != reference}
    return differences


# The stated model `paper_model` scales to (not measured here).
PAPER = {
    "gpus": 8,
    "link_gbit_per_second": 100,
    "parameters": 7e9,
    "bytes_per_parameter": 2,  # bf16 weights and gradients on the wire
    "tokens_per_micro_batch_per_gpu": 4096,
    "achieved_flops_per_gpu": 400e12,  # about 40% of an H100's dense bf16 peak
}


def paper_model(configs: dict, measured_world: int, k: int) -> dict:
    """Each schedule's collective bytes per step, as multiples of the measured model's
    parameter bytes times (W - 1) / W, applied to `PAPER`'s model at its W; the time
    those bytes take on one link against the step's compute time (6 FLOPs per
    parameter per token over K micro-batches of tokens). A model, not a measurement."""
    gpus = PAPER["gpus"]
    link_bytes_per_second = PAPER["link_gbit_per_second"] * 1e9 / 8
    paper_bytes = PAPER["parameters"] * PAPER["bytes_per_parameter"]
    tokens = k * PAPER["tokens_per_micro_batch_per_gpu"]
    compute_seconds = 6 * PAPER["parameters"] * tokens / PAPER["achieved_flops_per_gpu"]
    rows = {}
    for name, result in configs.items():
        if name == "single" or "skipped" in result:
            continue
        measured_share = result["parameter_bytes"] * (measured_world - 1) / measured_world
        per_kind = {kind: n / measured_share * paper_bytes * (gpus - 1) / gpus
                    for kind, n in _collective_bytes(result).items()}
        total = sum(per_kind.values())
        rows[name] = {
            "multiples_of_parameter_bytes": {kind: n / paper_bytes for kind, n in per_kind.items()},
            "bytes_per_step_per_gpu": per_kind,
            "communication_seconds": total / link_bytes_per_second,
            "communication_over_compute": total / link_bytes_per_second / compute_seconds,
        }
    return {
        "is_a_model": True,
        "note": ("collective bytes per step measured here at W={w}, K={k}, scaled by parameter bytes and by "
                 "(W-1)/W to the stated model; communication time = bytes a GPU receives per step / its link "
                 "bandwidth; compute time = 6 * parameters * tokens per GPU per step / achieved FLOP/s. "
                 "Assumes the measured split between block and other parameters carries over.").format(
                     w=measured_world, k=k),
        "assumptions": {**PAPER, "k": k, "tokens_per_step_per_gpu": tokens},
        "compute_seconds": compute_seconds,
        "schedules": rows,
    }


def plot(record: dict, path: str) -> None:
    """Collective bytes per step by kind, step time and peak RSS per rank of each
    configuration; each one's loss per step against `fsdp2_grad_accum`'s; and the paper model's
    communication time against its compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = record["configs"]
    names = [name for name in CONFIGS if "skipped" not in configs[name]]
    fig, (bytes_ax, time_ax, rss_ax, loss_ax, paper_ax) = plt.subplots(1, 5, figsize=(25, 5))
    bottom = [0.0] * len(names)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        values = [_collective_bytes(configs[name])[kind] / 2**20 for name in names]
        bytes_ax.bar(names, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    bytes_ax.set_ylim(0, max(bottom) * 1.3)
    bytes_ax.set_ylabel("MiB received per rank per step")
    bytes_ax.set_title(f"collective bytes, W={record['world']}, K={record['k']}")
    bytes_ax.legend(loc="upper left")
    time_ax.bar(names, [configs[name]["step_seconds"] for name in names])
    time_ax.set_ylabel("step seconds (median)")
    time_ax.set_title(f"step time (ranks share {record['cpus']} cores)")
    rss_ax.bar(names, [max(configs[name]["steps_peak_rss_bytes_per_rank"]) / 2**20 for name in names])
    rss_ax.set_ylabel("MiB")
    rss_ax.set_title("peak RSS of the steps, largest rank")
    reference = configs["fsdp2_grad_accum"]["losses"]
    for name in names:
        if name != "fsdp2_grad_accum":
            gaps = [max(abs(a - b), 1e-9) for a, b in zip(configs[name]["losses"], reference)]
            loss_ax.plot(range(len(gaps)), gaps, marker="o", label=name)
    loss_ax.set(xlabel="step (the first two are warm-up)", ylabel="|loss - fsdp2_grad_accum's loss|",
                yscale="log", title="loss per step against fsdp2_grad_accum (1e-9 = equal)")
    loss_ax.legend(fontsize=7)
    paper = record["paper_model"]
    modeled = list(paper["schedules"])
    seconds = [paper["schedules"][name]["communication_seconds"] for name in modeled]
    paper_ax.bar(modeled, seconds, label="communication (model)")
    paper_ax.axhline(paper["compute_seconds"], color="black", linestyle="--", label="compute (model)")
    paper_ax.set_ylim(0, max(seconds) * 1.3)
    paper_ax.set_ylabel("seconds per step")
    paper_ax.set_title(f"model: {PAPER['gpus']} GPUs x {PAPER['link_gbit_per_second']} Gb/s, "
                       f"{PAPER['parameters'] / 1e9:.0f}B parameters")
    paper_ax.legend(loc="upper left")
    for ax in (bytes_ax, time_ax, rss_ax, paper_ax):
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "distributed_bench.json"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot of the record at --out")
    args = parser.parse_args(argv)
    if args.plot_only:
        with open(args.out) as file:
            record = json.load(file)
        plot(record, os.path.splitext(args.out)[0] + ".png")
        return record
    spec = _spec(args)
    configs = {}
    with tempfile.TemporaryDirectory(prefix="slc-distributed-bench-") as workdir:
        for config in CONFIGS:
            world = 1 if config == "single" else args.world
            configs[config] = _launch(config, world, spec, args.k, args.steps, workdir)
            print(f"{config:>25}: {configs[config]}", file=sys.stderr)
    single, sharded = configs["single"], configs["sharded"]
    record = {
        "model": spec, "k": args.k, "world": args.world, "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "configs": configs,
        "nvme_weight_bytes_ratio": _weight_bytes(sharded) / _weight_bytes(single),
        "step_time_ratio": sharded["step_seconds"] / single["step_seconds"],
        "collective_bytes_over_sharded": {
            name: sum(_collective_bytes(result).values()) / sum(_collective_bytes(sharded).values())
            for name, result in configs.items() if name != "single" and "skipped" not in result},
        "losses": loss_differences(configs),
        "paper_model": paper_model(configs, args.world, args.k),
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.quick and args.out == parser.get_default("out"):
        return record  # smoke runs leave the measured results alone
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        file.write(text + "\n")
    plot(record, os.path.splitext(args.out)[0] + ".png")
    return record


if __name__ == "__main__":
    main()
