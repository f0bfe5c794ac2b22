"""nvme tier benchmark: engine throughput against dd with O_DIRECT, overlap of loads
with compute, and page-cache bypass, measured in one run on one filesystem.

Usage:
    python bench/io_bench.py [--dir DIR] [--gib 2] [--repeats 3] [--out bench/results/io_bench.json]

Figures written to the JSON file:
- ``dd_write_gbps`` / ``dd_read_gbps``: ``dd`` with ``oflag=direct`` / ``iflag=direct``,
  8 MiB blocks, on a file in ``--dir``.
- ``engine_store_gbps`` / ``engine_load_gbps``: the same number of bytes stored to /
  loaded from the nvme tier by ``TransferEngine`` (tensors of 128 MiB, all issued at
  once, then waited), load buffers reused as in steady state (``engine_cold_load_gbps``
  is the first pass, which faults in fresh memory). Ratios to dd; goal >= 0.85.
- ``overlap``: a matmul loop alone, the loads alone, and both at once (loads issued,
  then the loop, then the waits); goal ``both <= 1.15 * max(alone)``. Measured with
  compute on all cores and with one core left to the I/O threads (the kernel's
  direct-I/O work and page pinning need a CPU too).
- ``page_cache``: growth of ``Cached`` in /proc/meminfo while the engine stored and
  loaded the data; bypassing the cache means it stays far below the bytes moved.
Each throughput figure is the median of ``--repeats`` runs, alternating dd and engine
so both see the same disk conditions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slcompile.runtime import TransferEngine  # noqa: E402

log = logging.getLogger("io_bench")

TENSOR_BYTES = 128 << 20
DD_BLOCK = "8M"


def meminfo_kib(field: str) -> int:
    """Reads one field of /proc/meminfo, in KiB."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def drop_file_cache(path: str) -> None:
    """Asks the kernel to forget a file's cached pages so a read goes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_write(path: str, nbytes: int) -> float:
    count = nbytes // (8 << 20)
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", f"bs={DD_BLOCK}", f"count={count}", "oflag=direct"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return nbytes / (time.perf_counter() - start) / 1e9


def dd_read(path: str, nbytes: int) -> float:
    drop_file_cache(path)
    start = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}", "iflag=direct"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return nbytes / (time.perf_counter() - start) / 1e9


def make_tensors(nbytes: int) -> list[torch.Tensor]:
    count = nbytes // TENSOR_BYTES
    return [torch.full((TENSOR_BYTES // 4,), float(index)) for index in range(count)]


def engine_store(engine: TransferEngine, tensors: list[torch.Tensor], prefix: str) -> float:
    start = time.perf_counter()
    handles = [engine.store(f"{prefix}{i}", t, "nvme", "weight") for i, t in enumerate(tensors)]
    for handle in handles:
        engine.wait(handle)
    return sum(t.nbytes for t in tensors) / (time.perf_counter() - start) / 1e9


def engine_load(engine: TransferEngine, keys: list[str]) -> tuple[float, list[torch.Tensor]]:
    nbytes = sum(engine.stored(key).nbytes for key in keys)
    start = time.perf_counter()
    handles = [engine.load(key) for key in keys]
    loaded = [engine.wait(handle) for handle in handles]
    return nbytes / (time.perf_counter() - start) / 1e9, loaded


def compute_loop(iterations: int, size: int = 1024) -> float:
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    start = time.perf_counter()
    for _ in range(iterations):
        a = torch.mm(a, b)
        a.div_(a.abs().max())  # keep values finite without changing the work
    return time.perf_counter() - start


def overlap(engine: TransferEngine, keys: list[str], threads: int, repeats: int) -> dict:
    """Compute alone, loads alone, both at once; median ratio over ``repeats``."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    runs = []
    try:
        for _ in range(repeats):
            # Loads alone first, then a compute loop sized to take about as long
            # (the hardest case: neither side can hide the other for free).
            start = time.perf_counter()
            for handle in [engine.load(key) for key in keys]:
                engine.wait(handle)
            loads_alone = time.perf_counter() - start
            per_iteration = compute_loop(10) / 10
            iterations = max(10, round(loads_alone / per_iteration))
            compute_alone = compute_loop(iterations)
            start = time.perf_counter()
            handles = [engine.load(key) for key in keys]
            compute_loop(iterations)
            for handle in handles:
                engine.wait(handle)
            both = time.perf_counter() - start
            runs.append({
                "matmul_iterations": iterations,
                "compute_alone_s": compute_alone,
                "loads_alone_s": loads_alone,
                "both_s": both,
                "ratio_to_max_alone": both / max(compute_alone, loads_alone),
            })
    finally:
        torch.set_num_threads(previous_threads)
    return {
        "compute_threads": threads,
        "loads_bytes": sum(engine.stored(key).nbytes for key in keys),
        "median_ratio_to_max_alone": statistics.median(r["ratio_to_max_alone"] for r in runs),
        "runs": runs,
    }


def filesystem_of(path: str) -> str:
    result = subprocess.run(["df", "-T", path], capture_output=True, text=True)
    lines = result.stdout.strip().splitlines()
    return lines[-1].split()[1] if len(lines) > 1 else "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--gib", type=float, default=2.0, help="bytes moved per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "io_bench.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    work_dir = tempfile.mkdtemp(prefix="slc-io-bench-", dir=args.dir)
    nbytes = int(args.gib * (1 << 30)) // TENSOR_BYTES * TENSOR_BYTES
    dd_path = os.path.join(work_dir, "dd.bin")
    # Room to reuse every load buffer: dd reuses its one buffer too.
    engine = TransferEngine(offload_dir=work_dir, buffer_cache_bytes=nbytes)
    tensors = make_tensors(nbytes)
    cores = os.cpu_count() or 1
    try:
        engine_store(engine, tensors, "warm.")
        warm_keys = [f"warm.{index}" for index in range(len(tensors))]
        cold_load, loaded = engine_load(engine, warm_keys)  # first loads fault fresh pages
        del loaded
        for key in warm_keys:
            engine.free(key)
        dd_writes, dd_reads, stores, loads = [], [], [], []
        cached_growth_kib = []
        for repeat in range(args.repeats):
            dd_writes.append(dd_write(dd_path, nbytes))
            cached_before = meminfo_kib("Cached")
            stores.append(engine_store(engine, tensors, f"r{repeat}."))
            dd_reads.append(dd_read(dd_path, nbytes))
            os.unlink(dd_path)
            keys = [f"r{repeat}.{index}" for index in range(len(tensors))]
            throughput, loaded = engine_load(engine, keys)
            loads.append(throughput)
            cached_growth_kib.append(meminfo_kib("Cached") - cached_before)
            for got, want in zip(loaded, tensors, strict=True):
                assert torch.equal(got, want), "data mismatch"
            del loaded
            for key in keys:
                engine.free(key)
            log.info("repeat %d: dd w %.2f r %.2f GB/s; engine store %.2f load %.2f GB/s",
                     repeat, dd_writes[-1], dd_reads[-1], stores[-1], loads[-1])
        engine_store(engine, tensors, "ov.")
        del tensors
        overlap_keys = [f"ov.{index}" for index in range(nbytes // TENSOR_BYTES)]
        overlap_figures = {
            "all_cores": overlap(engine, overlap_keys, cores, args.repeats),
            "one_core_left_for_io": overlap(engine, overlap_keys, max(1, cores - 1), args.repeats),
            "goal": 1.15,
        }
        log.info("overlap: %s", json.dumps(overlap_figures))
    finally:
        engine.close()
        shutil.rmtree(work_dir, ignore_errors=True)

    figures = {
        "bytes_per_measurement": nbytes,
        "repeats": args.repeats,
        "dd_write_gbps": statistics.median(dd_writes),
        "dd_read_gbps": statistics.median(dd_reads),
        "engine_store_gbps": statistics.median(stores),
        "engine_load_gbps": statistics.median(loads),
        "engine_cold_load_gbps": cold_load,
        "all_runs": {"dd_write": dd_writes, "dd_read": dd_reads,
                     "engine_store": stores, "engine_load": loads},
    }
    figures["store_to_dd_write"] = figures["engine_store_gbps"] / figures["dd_write_gbps"]
    figures["load_to_dd_read"] = figures["engine_load_gbps"] / figures["dd_read_gbps"]
    figures["throughput_goal"] = 0.85
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "memory_gib": round(
                os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
            ),
            "filesystem": filesystem_of(args.dir or tempfile.gettempdir()),
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
        },
        "torch": torch.__version__,
        "python": platform.python_version(),
        "throughput": figures,
        "overlap": overlap_figures,
        "page_cache": {
            "bytes_stored_and_loaded_per_repeat": 2 * nbytes,
            "cached_growth_bytes": [kib * 1024 for kib in cached_growth_kib],
        },
        "goals_met": {
            "store_ge_85pct_dd": figures["store_to_dd_write"] >= 0.85,
            "load_ge_85pct_dd": figures["load_to_dd_read"] >= 0.85,
            "overlap_le_1_15_all_cores":
                overlap_figures["all_cores"]["median_ratio_to_max_alone"] <= 1.15,
            "overlap_le_1_15_one_core_for_io":
                overlap_figures["one_core_left_for_io"]["median_ratio_to_max_alone"] <= 1.15,
            "page_cache_bypassed": max(cached_growth_kib) * 1024 < 0.05 * nbytes,
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
        handle.write("\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
