"""The current machine's rates: measured once in a few seconds, cached on disk.

`machine_profile()` returns the rates the time model scales by
(`slcompile.analysis.machine.MachineProfile`): the one named by the environment
variable `SLC_PROFILE` (a named profile or a JSON file), else the cached
measurement of this machine as it runs now, else a new measurement
(`measure_profile`), which is then cached. A measurement holds for what it ran on
(`profile_key`: the device, the compute dtype, the compute thread count, the torch
version), and is cached under that key
(`~/.cache/slcompile/profile-<host>-cpu-float32-2threads-torch2.13.0.json`): a run with
another thread count or torch measures anew. `machine_profile("h100-pcie5-nvme")`
returns a named profile instead, for a machine you are not on.

What is measured (each a best of a few repeats):
- the matmul rate: square products of the compute dtype at a few sizes (small
  products reach less of it);
- the memory bandwidth: an out-of-place elementwise op (bytes read plus written)
  at a few working sets, from inside the caches to well beyond them;
- the op overhead: a one-element add; the transfer ops' overhead: an `slc::mark`;
- on CUDA, the pinned host <-> device copy rates;
- the disk: O_DIRECT writes and reads of the nvme tier (`NvmeArena`, with its I/O
  threads and checksums as a step uses them) at a small and a large size, fitted
  as `latency + bytes / rate`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import socket
import statistics
import time

import torch

from slcompile.analysis.machine import NAMED_PROFILES, MachineProfile, named_profile

__all__ = ["machine_profile", "measure_rates", "profile_key", "profile_path", "write_profile"]

log = logging.getLogger(__name__)


def default_device(device) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def default_dtype(device: torch.device, dtype) -> torch.dtype:
    return dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def profile_key(device: str | torch.device | None = None,
                dtype: torch.dtype | None = None) -> tuple[tuple[str, str], ...]:
    """What a measurement of this machine holds for, as `MachineProfile.measured_on`
    records it: the device (a GPU by its name), the compute dtype (defaults as
    `measure_profile`'s), the compute thread count and the torch version."""
    device = default_device(device)
    name = device.type
    if device.type == "cuda":
        name = f"cuda {torch.cuda.get_device_name(device)}"
    return (("device", name), ("dtype", str(default_dtype(device, dtype)).removeprefix("torch.")),
            ("threads", str(torch.get_num_threads())), ("torch", torch.__version__))


def profile_path(device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> str:
    """Where this machine's measurement for `profile_key(device, dtype)` is cached."""
    key = dict(profile_key(device, dtype))
    words = [socket.gethostname(), key["device"], key["dtype"], f"{key['threads']}threads", f"torch{key['torch']}"]
    name = "-".join(re.sub(r"[^A-Za-z0-9.+_]+", "_", word) for word in words)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "slcompile", f"profile-{name}.json")


def machine_profile(profile: str | MachineProfile | None = None, *, offload_dir: str | None = None,
                    device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                    refuse_untrusted: bool = False) -> MachineProfile:
    """The profile to predict with.

    Args:
        profile: a `MachineProfile`; a named profile (`NAMED_PROFILES`); a path to a
            profile's JSON; "current" or None: `SLC_PROFILE` if set, else this
            machine's cached (or new) measurement for `profile_key(device, dtype)`.
        offload_dir: where a new measurement writes its nvme test file.
        device, dtype: the compute device and dtype the prediction is for (default:
            `measure_profile`'s). A measured profile read from a file that ran on
            anything else is used with a warning naming the difference.
        refuse_untrusted: raise a `ProfileError` for a measurement read from the
            cache or a file whose `MachineProfile.trust_problem` names one (a
            `MachineProfile` passed in is used as it is). A cached measurement with
            one is measured anew first either way.
    """
    if isinstance(profile, MachineProfile):
        return profile
    if profile in (None, "current"):
        profile = os.environ.get("SLC_PROFILE") or None
        if profile is None:
            measured = _cached_measurement(offload_dir, device, dtype)
            return _trusted(measured, profile_path(device, dtype), refuse_untrusted)
    if profile in NAMED_PROFILES:
        return NAMED_PROFILES[profile]
    if os.path.isfile(profile):
        with open(profile) as f:
            loaded = MachineProfile.from_json(f.read())
        _warn_if_measured_elsewhere(loaded, profile, profile_key(device, dtype))
        return _trusted(loaded, profile, refuse_untrusted)
    return named_profile(profile)  # raises, listing the names


def _trusted(profile: MachineProfile, path: str, refuse: bool) -> MachineProfile:
    problem = profile.trust_problem()
    if problem is None or not refuse:
        return profile
    from slcompile.errors import ProfileError

    raise ProfileError(
        f"the machine profile {path} ({profile.source or 'measured'}) cannot be trusted: {problem}, so its rates "
        f"are not this machine's and every time predicted from them is off by an unknown factor. Remeasure it "
        f"while the machine is quiet (`python -m slcompile profile`, which replaces the cached one), or use it "
        f"anyway by passing it in (`profile=MachineProfile.from_json(open({path!r}).read())`)")


def _warn_if_measured_elsewhere(profile: MachineProfile, path: str, key) -> None:
    if not profile.measured_on:
        return
    measured, now = dict(profile.measured_on), dict(key)
    differences = [f"{what} {measured[what]} (now {now[what]})" for what in now
                   if what in measured and measured[what] != now[what]]
    if differences:
        log.warning("the machine profile %s was measured with %s: its predictions may be off by that much",
                    path, ", ".join(differences))


def _cached_measurement(offload_dir, device, dtype) -> MachineProfile:
    path = profile_path(device, dtype)
    key = profile_key(device, dtype)
    try:
        with open(path) as f:
            cached = MachineProfile.from_json(f.read())
        # One cached by an older release without the bandwidth curve is measured anew;
        # so is one measured under load.
        if cached.measured_on == key and cached.bandwidth_curve and cached.trust_problem() is None:
            return cached
    except (OSError, ValueError, TypeError):
        cached = None
    if cached is not None and cached == _MEASURED_HERE.get(path):
        return cached  # measured by this process: once is enough, loaded or not
    profile = measure_rates(device, dtype=dtype, offload_dir=offload_dir)
    _MEASURED_HERE[path] = profile
    try:
        write_profile(profile, path)
    except OSError as err:
        log.warning("could not cache the machine profile at %s: %s", path, err)
    return profile


_MEASURED_HERE: dict[str, MachineProfile] = {}
"""The measurement this process made for each cache path."""


def write_profile(profile: MachineProfile, path: str) -> None:
    """Writes `profile`'s JSON to `path` (`profile_path()`: where "current" reads it),
    making its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(profile.to_json())


class _Repeats:
    """Every timing of each measured rate, by the rate's name: the best is the rate,
    and how far the median of the repeats lies beyond it (the spread) says how far
    to trust it."""

    def __init__(self) -> None:
        self.times: dict[str, list[list[float]]] = {}

    def best(self, rate: str, fn, repeats: int) -> float:
        """The shortest of `repeats` timed calls of `fn` (after one untimed call)."""
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        self.times.setdefault(rate, []).append(times)
        return min(times)

    def spread(self) -> tuple[tuple[str, float], ...]:
        """(rate, median over best less 1) of each rate: the widest over the sizes
        it was timed at."""
        return tuple((rate, max(statistics.median(times) / max(min(times), 1e-12) - 1.0 for times in runs))
                     for rate, runs in self.times.items())


class _OtherLoad:
    """The cores other processes kept busy while the block ran: the machine's busy
    time (`/proc/stat`) less this process's own (every thread's, `os.times`), over
    the wall time. `cores` is None where `/proc/stat` cannot be read."""

    def __init__(self) -> None:
        self.cores: float | None = None

    @staticmethod
    def _busy_seconds() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu":
            return None
        # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
        ticks = [int(value) for value in fields[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_seconds() -> float:
        times = os.times()
        return times.user + times.system + times.children_user + times.children_system

    def __enter__(self) -> _OtherLoad:
        self._start = (time.perf_counter(), self._busy_seconds(), self._own_seconds())
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, own = time.perf_counter(), self._busy_seconds(), self._own_seconds()
        if busy is None or self._start[1] is None:
            return
        elapsed = max(wall - self._start[0], 1e-9)
        self.cores = max(busy - self._start[1] - (own - self._start[2]), 0.0) / elapsed


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rates(device: str | torch.device | None = None, *, dtype: torch.dtype | None = None,
                  offload_dir: str | None = None, nvme: bool = True) -> MachineProfile:
    """Measures this machine's rates (a few seconds); `slcompile.profile.measure_profile`
    fits the compute thread's fixed costs from compiled steps on top.

    Args:
        device: the compute device (default: CUDA if present, else the CPU).
        dtype: the compute dtype of the matmul (default: bf16 on CUDA, fp32 on CPU).
        offload_dir: the directory the nvme tier would use (default: the temp dir).
        nvme: measure the disk (else its rates are left infinite).
    """
    began = time.perf_counter()
    device = default_device(device)
    dtype = default_dtype(device, dtype)
    repeats = _Repeats()
    with _OtherLoad() as load:
        profile = _measure(device, dtype, offload_dir, nvme, repeats)
    source = (f"measured on {socket.gethostname()} ({device.type}, {torch.get_num_threads()} threads, "
              f"{dtype}) in {time.perf_counter() - began:.1f} s")
    return dataclasses.replace(profile, source=source, measured_on=profile_key(device, dtype),
                               load=None if load.cores is None else round(load.cores, 3),
                               cores=os.cpu_count() or 0, spread=repeats.spread())


def _measure(device: torch.device, dtype: torch.dtype, offload_dir, nvme: bool, repeats: _Repeats) -> MachineProfile:
    # Products of square matrices from small to large: small ones reach less of the rate.
    sizes = (256, 1024, 4096) if device.type == "cuda" else (64, 128, 256, 512)
    curve = []
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        reps = max(3, int(2e8 // size ** 3)) if device.type != "cuda" else 20

        def matmul():
            for _ in range(reps):
                torch.mm(a, b)
            _sync(device)

        curve.append((2.0 * size ** 3, 2 * size ** 3 * reps / repeats.best("matmul", matmul, 3)))
    matmul_flops = max(rate for _, rate in curve)
    # An out-of-place elementwise op at working sets from inside the caches to well
    # beyond them, into memory already mapped (writing fresh pages is the fitted
    # `output_seconds_per_byte`'s).
    sizes = (16 << 20, 64 << 20, 256 << 20) if device.type == "cuda" else (1 << 20, 4 << 20, 16 << 20, 64 << 20)
    bandwidth_curve = [(2.0 * size, _elementwise_rate(size, device, repeats)) for size in sizes]
    memory_bandwidth = max(rate for _, rate in bandwidth_curve)
    one = torch.ones(1, device=device)
    ops = 2000

    def tiny():
        for _ in range(ops):
            torch.ops.aten.add.Tensor(one, one)
        _sync(device)

    op_overhead = repeats.best("op", tiny, 3) / ops
    import slcompile.runtime  # noqa: F401  (registers what the slc:: ops do)

    def marks():
        for _ in range(ops // 4):
            torch.ops.slc.mark("profile", True)

    transfer_op = repeats.best("transfer_op", marks, 3) / (ops // 4)
    call_overhead = _measure_call(device, repeats)
    link_h2d = link_d2h = math.inf
    if device.type == "cuda":
        on_device = torch.empty((256 << 20) // 4, device=device, dtype=torch.float32)
        host = torch.empty(on_device.numel(), dtype=torch.float32, pin_memory=True)
        link_h2d = host.nbytes / repeats.best("link_h2d", lambda: (on_device.copy_(host, non_blocking=True), _sync(device)), 5)
        link_d2h = host.nbytes / repeats.best("link_d2h", lambda: (host.copy_(on_device, non_blocking=True), _sync(device)), 5)
        del on_device, host
    read = write = math.inf
    latency = 0.0
    if nvme:
        write, read, latency, transfer_op = _measure_disk(offload_dir, repeats)
    return MachineProfile(
        name=f"{socket.gethostname()}-{device.type}", matmul_flops=matmul_flops, memory_bandwidth=memory_bandwidth,
        op_overhead_seconds=op_overhead, transfer_op_seconds=transfer_op, call_overhead_seconds=call_overhead,
        link_h2d=link_h2d, link_d2h=link_d2h,
        link_latency_seconds=10e-6 if device.type == "cuda" else 0.0,
        nvme_read=read, nvme_write=write, nvme_latency_seconds=latency, matmul_curve=tuple(curve),
        bandwidth_curve=tuple(bandwidth_curve),
    )


def _elementwise_rate(nbytes: int, device: torch.device, repeats: _Repeats) -> float:
    """Bytes/s (read plus written) of an elementwise op over `nbytes` into memory
    already mapped: the best of a few repeats."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    out = torch.empty_like(src)

    def elementwise():
        for _ in range(4):
            torch.mul(src, 2.0, out=out)
        _sync(device)

    return 4 * 2 * nbytes / repeats.best("bandwidth", elementwise, 5)


def _measure_call(device, repeats: _Repeats) -> float:
    """Seconds one call of a compiled region costs beyond its ops: a function of a
    dict of 16 tensors (as a layer step takes its weights) compiled with Dynamo's
    eager backend, called, less the same op called directly."""
    tensors = {f"w{i}": torch.ones(4, device=device) for i in range(16)}
    x = torch.ones(4, device=device)

    def region(tensors, x):
        return x + tensors["w0"]

    compiled = torch.compile(region, backend="eager", dynamic=False)
    calls = 200
    compiled(tensors, x)

    def called(rate, fn):
        def run():
            for _ in range(calls):
                fn(tensors, x)
            _sync(device)
        return repeats.best(rate, run, 3) / calls

    try:
        return max(called("call", compiled) - called("op_call", region), 0.0)
    finally:
        torch._dynamo.reset_code(region.__code__)


def _measure_disk(offload_dir, repeats: _Repeats) -> tuple[float, float, float, float]:
    """(write bytes/s, read bytes/s, latency s, compute-thread seconds per transfer
    op) of the nvme tier as a step uses it (`TransferEngine` stores and loads, their
    I/O threads and checksums), fitted from small and large transfers."""
    from slcompile.runtime.storage.engine import TransferEngine
    from slcompile.runtime.stats import Recorder

    small, large = 64 << 10, 16 << 20
    engine = TransferEngine(offload_dir, recorder=Recorder())
    tensors = {n: torch.randn(n // 4) for n in (small, large)}
    op_seconds = []
    try:
        def run(direction, nbytes, count):
            keys = [f"profile{nbytes}.{i}" for i in range(count)]
            if direction == "write":
                handles = [engine.store(key, tensors[nbytes], "nvme", "activation") for key in keys]
            else:
                handles = [engine.load(key) for key in keys]
            for handle in handles:
                engine.wait(handle)

        timings = {}
        for direction in ("write", "read"):
            for nbytes, count in ((small, 32), (large, 4)):
                timings[direction, nbytes] = repeats.best(f"nvme_{direction}", lambda: run(direction, nbytes, count), 3) / count
        # What the caller's thread spends per issue and per wait of a finished transfer.
        keys = [f"profile{small}.{i}" for i in range(32)]
        start = time.perf_counter()
        handles = [engine.load(key) for key in keys]
        issued = time.perf_counter() - start
        for handle in handles:
            handle.wait_done()
        start = time.perf_counter()
        for handle in handles:
            engine.wait(handle)
        op_seconds = (issued + time.perf_counter() - start) / (2 * len(keys))
        rates, latencies = [], []
        for direction in ("write", "read"):
            t_small, t_large = timings[direction, small], timings[direction, large]
            rate = (large - small) / max(t_large - t_small, 1e-9)
            rates.append(rate)
            latencies.append(max(t_small - small / rate, 0.0))
        return rates[0], rates[1], sum(latencies) / 2, op_seconds
    finally:
        engine.close()
