"""The whole CUDA validation in one command, under one wall-clock budget: the tests that
touch CUDA, then the rows of gpu_bench.py that decide the GPU goals, each beside its
goal and its bandwidth bound; one JSON and one plot.

Usage (on a CUDA machine, from the repository root):
    python -m bench gpu --check [--out DIR] [--budget-s 540]
    python bench/gpu_check.py --cpu-smoke      # the same code path, tiny sizes, on the CPU

Steps, each with its own time budget inside ``--budget-s`` (a step that fails or runs
out of time is recorded as such, and the next one runs):

1. tests: ``pytest -m cuda_check`` over TEST_FILES with ``SLC_TEST_DEVICE=cuda``
   (numerics equal eager across tiers, exact bytes moved, pinned pool sizes, the
   plan's peak against the CUDA allocator's), junit XML and log kept. None of these
   files needs expecttest, pydot or graphviz.
2. the pinned host<->device copy bandwidth (gpu_bench.copy_bandwidth, 1 GiB), then
   this machine's `MachineProfile` (``slcompile.profile.measure_profile(steps=True,
   generation=False)``: the training steps' costs, not generation's; at most
   ``--profile-budget-s``), kept in the JSON: each speedloader row records the step
   the time model predicts from it.
3. bench rows of gpu_bench.py (``--small`` model: 4 layers, hidden 1024, batch 8 x 256,
   bf16, Inductor), each in its own process with a fresh Inductor/Triton cache (so
   every first step pays its whole compile), in the order of row_order(): what the
   goals need first; rows that no longer fit the budget are recorded as skipped. The
   grad_accumulation goal's pair also runs at IO_SHAPE, where the link bounds the step.
4. goals (ratios within the run), each with the rows it read and what the bound
   allows:
   - weights on pinned host: tokens/s >= 95% of resident Inductor, at each K;
   - weights and activations on host with a peak <= 50% of resident Inductor's:
     tokens/s >= 75% of resident Inductor (any such row);
   - compile (first step) <= 1.5x plain Inductor's, at K = 4 and 8;
   - speedloader at the largest K >= 0.9 K times grad_accumulation's tokens/s, where
     the link bounds the step (else recorded as not applicable, with the figures).
   The bound of a row is gpu_bench.add_bounds': max(resident compute, host<->device
   bytes per step / the slower direction's pinned copy bandwidth).
5. ``gpu_check.json`` and ``gpu_check.png`` in ``--out`` (default: $OUT when set, else
   bench/results/gpu_check/), beside ``pytest_junit.xml`` and ``pytest.log``: four files.

Exit status: 0 when every test passed (or was skipped) and every row ran, 1 otherwise,
2 without CUDA (unless ``--cpu-smoke``) or when the package does not import or is not
installed as the ``speedloader`` backend (``preflight``), before any step. A missed goal is a finding, not a failure.

``--cpu-smoke`` runs the same steps on the CPU with gpu_bench's 2-layer Llama of hidden
64, aot_eager, K = 2, two rows (resident, weights on host) and two tests, to a temporary directory: it checks the
command works; its figures mean nothing (the host tier copies nothing on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import gpu_bench  # noqa: E402

# The test files whose `cuda_check` tests run on the device under test. Files that import
# expecttest or pydot at module level are not listed: collecting them would fail where
# those packages are missing (the GPU image has neither).
TEST_FILES = (
    "tests/test_device_tiers.py",
    "tests/runtime/test_engine.py",
    "tests/runtime/test_host_pool_plan.py",
    "tests/runtime/test_tiers.py",
    "tests/test_generate.py",
)
SMOKE_TESTS = (
    "tests/test_device_tiers.py::test_every_tier_combination_equals_eager_and_moves_the_bytes_of_its_graphs"
    "[host-host-2]",
    "tests/runtime/test_tiers.py::test_engine_reserve_pins_plan_bytes_and_counts_them",
)

LOG_LIMIT = 8 << 20  # characters of pytest's log kept (its end)

GOAL_WEIGHTS_HOST = 0.95  # of resident Inductor's tokens/s
GOAL_ACTIVATIONS_PEAK = 0.50  # of resident Inductor's peak
GOAL_ACTIVATIONS_SPEED = 0.75  # of resident Inductor's tokens/s
GOAL_COMPILE = 1.5  # x plain Inductor's first step
GOAL_GRAD_ACC = 0.9  # x K


# The link-bound regime of the grad_accumulation goal: 2 layers of the full model's width
# (101 MB of bf16 weights each; 2 P = 405 MB per step, about 8 ms at 50 GB/s) and 8 x 32
# tokens, so that moving the block weights takes longer than a step's compute (at K = 8
# a sub-batch is one sample: the kernels' launches, not their arithmetic, set the
# compute), and grad_accumulation's K passes over the weights (K x 2 P) are what its
# step waits for.
IO_SHAPE = {**gpu_bench.MODELS["full"], "layers": 2, "batch": 8, "seq": 32}


def row_order(ks: list[int]) -> list[dict]:
    """The rows to run, most needed first (each goal's first row early): the baseline,
    weights on host and activations on host with recompute at the smallest K, the
    baseline and weights on host with CUDA graphs (mode="reduce-overhead", the
    cudagraphs option) at the smallest K, weights on host at the other K, the link-bound
    pair at the largest K (with its own resident
    baseline), then the rest: every saved activation moved, grad_accumulation of the
    main shape, recompute at the other K."""
    rows = [{"row": "resident_inductor", "k": 1}, {"row": "weights_host", "k": min(ks)},
            {"row": "weights_activations_host_recompute", "k": min(ks)}]
    rows += [{"row": "resident_inductor_cudagraphs", "k": 1}, {"row": "weights_host_cudagraphs", "k": min(ks)}]
    rows += [{"row": "weights_host", "k": k} for k in ks if k != min(ks)]
    rows += [{"row": name, "k": k, "regime": "io_bound"}
             for name, k in (("resident_inductor", 1), ("weights_host", max(ks)), ("grad_accumulation", max(ks)))]
    rows.append({"row": "weights_activations_host", "k": min(ks)})
    rows.append({"row": "grad_accumulation", "k": max(ks)})
    for k in ks:
        if k != min(ks):
            rows.append({"row": "weights_activations_host_recompute", "k": k})
    return rows


def regime(row: dict) -> str:
    """"compute" (the main shape) or "io_bound" (IO_SHAPE)."""
    return row["spec"].get("regime", "compute")


class Clock:
    """The run's wall-clock budget."""

    def __init__(self, budget_s: float, reserve_s: float):
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.reserve_s = reserve_s  # kept back for the JSON and the plot

    def left(self) -> float:
        return self.budget_s - self.reserve_s - (time.monotonic() - self.start)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def log(message: str) -> None:
    print(f"gpu_check [{time.strftime('%H:%M:%S')}]: {message}", file=sys.stderr, flush=True)


def run_limited(command: list[str], timeout_s: float, *, env: dict, stdout, stderr,
                interrupt_first: bool = False) -> tuple[int | None, float, bool]:
    """Runs `command` in its own process group for at most `timeout_s`; returns (exit
    status or None when killed, seconds, timed out). With `interrupt_first`, a run out of
    time gets SIGINT and 20 s to finish (pytest then still writes its junit XML)."""
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True,
                            start_new_session=True)
    try:
        proc.wait(timeout=max(timeout_s, 1.0))
        return proc.returncode, time.monotonic() - started, False
    except subprocess.TimeoutExpired:
        if interrupt_first:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=20)
                return None, time.monotonic() - started, True
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, time.monotonic() - started, True


def junit_summary(path: str) -> dict:
    """Counts and per-test outcomes of a pytest junit XML file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    cases = []
    for case in suite.iter("testcase"):
        if case.get("name") is None:  # the test a timeout interrupted: no outcome
            continue
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or found.text or "")[:600]
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0.0)), **({"message": message} if message else {})})
    counts["passed"] = sum(c["outcome"] == "passed" for c in cases)
    return {**counts, "seconds": float(suite.get("time", 0.0)), "cases": cases}


def run_tests(args, out: str, clock: Clock, device: str) -> dict:
    """Step 1: the cuda_check tests on `device`, junit XML and log in `out`."""
    budget = min(args.tests_budget_s, clock.left())
    selection = list(SMOKE_TESTS if args.cpu_smoke else TEST_FILES)
    junit = os.path.join(out, "pytest_junit.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "cuda_check",
               f"--junitxml={junit}", *selection]
    if args.pytest_k:
        command += ["-k", args.pytest_k]
    try:
        import pytest_timeout  # noqa: F401  (on the GPU image; a stuck test then fails alone)

        command.append(f"--timeout={int(max(30, min(args.test_timeout_s, budget)))}")
    except ImportError:
        pass
    step = {"command": " ".join(command[1:]), "device": device, "budget_seconds": budget}
    if budget < 10:
        return {**step, "status": "skipped", "reason": f"{budget:.0f} s left of the budget"}
    log(f"tests on {device}, at most {budget:.0f} s: {' '.join(selection)}")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}  # not a worker's
    env.update(SLC_TEST_DEVICE=device, PYTHONUNBUFFERED="1")
    if args.cpu_smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the engine computes on the CPU too
    with open(os.path.join(out, "pytest.log"), "w") as log_file:
        code, seconds, timed_out = run_limited(command, budget, env=env, stdout=log_file,
                                               stderr=subprocess.STDOUT, interrupt_first=True)
    step.update(exit_status=code, seconds=seconds, timed_out=timed_out)
    if os.path.exists(junit):
        try:
            step["summary"] = junit_summary(junit)
        except ET.ParseError as error:
            step["summary_error"] = str(error)
    log_path = os.path.join(out, "pytest.log")
    with open(log_path, errors="replace") as log_file:
        text = log_file.read()
    step["log_tail"] = text[-3000:]
    if len(text) > LOG_LIMIT:  # what comes back from a device machine is capped per file
        with open(log_path, "w") as log_file:
            log_file.write(f"[first {len(text) - LOG_LIMIT} characters left out]\n" + text[-LOG_LIMIT:])
    # pytest: 0 all passed, 5 nothing collected (all deselected): both are not failures.
    step["status"] = "timed out" if timed_out else ("passed" if code in (0, 5) else "failed")
    summary = step.get("summary", {})
    log(f"tests: {step['status']} in {seconds:.0f} s ({summary.get('passed', '?')} passed, "
        f"{summary.get('failures', '?')} failed, {summary.get('errors', '?')} errors, "
        f"{summary.get('skipped', '?')} skipped)")
    return step


def run_row(spec: dict, timeout_s: float, script: str = "gpu_bench.py") -> dict:
    """One bench row in its own process (`script` --row: a script of bench/ whose
    ``--row`` prints the row's JSON as its last line), with a fresh Inductor and
    Triton cache, for at most `timeout_s`."""
    cache = tempfile.mkdtemp(prefix="slc-gpu-check-cache-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(cache, "triton"), "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        code, seconds, timed_out = run_limited(
            [sys.executable, os.path.join(HERE, script), "--row", json.dumps(spec)], timeout_s,
            env=env, stdout=stdout, stderr=stderr)
        stdout.seek(0)
        stderr.seek(0)
        out_text, err_text = stdout.read(), stderr.read()
    subprocess.run(["rm", "-rf", cache], check=False)
    if timed_out:
        return {"spec": spec, "error": f"ran out of its {timeout_s:.0f} s", "timed_out": True,
                "wall_seconds": seconds, "stderr_tail": err_text[-3000:]}
    if code != 0:
        last = err_text.strip().splitlines()[-1] if err_text.strip() else f"exit status {code}"
        return {"spec": spec, "error": last, "wall_seconds": seconds, "stderr_tail": err_text[-3000:]}
    try:
        row = json.loads(out_text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"spec": spec, "error": "no JSON on stdout", "wall_seconds": seconds,
                "stderr_tail": err_text[-3000:]}
    row["wall_seconds"] = seconds
    return row


def run_rows(args, base: dict, clock: Clock, rows: list[dict] | None = None, after_row=None) -> list[dict]:
    """Step 3: the bench rows in order, each within what is left, appended to `rows`;
    `after_row()` runs after each."""
    rows = [] if rows is None else rows
    for spec in args.rows:
        spec = {**base, **spec}
        if spec.get("regime") == "io_bound":
            spec["shape"] = dict(IO_SHAPE)
        label = f"row {spec['row']} K={spec['k']}" + (f" ({spec['regime']})" if "regime" in spec else "")
        left = clock.left()
        if left < args.min_row_s:
            rows.append({"spec": spec, "skipped": f"{max(left, 0):.0f} s left of the budget"})
            log(f"{label}: skipped ({left:.0f} s left)")
            continue
        timeout = min(args.row_budget_s, left)
        log(f"{label}: at most {timeout:.0f} s")
        row = run_row(spec, timeout)
        rows.append(row)
        status = row.get("error") or row.get("unavailable") or (
            f"{row['step_seconds']:.4f} s/step, first step {row['first_step_seconds']:.1f} s")
        log(f"{label}: {status} ({row['wall_seconds']:.0f} s)")
        if after_row is not None:
            after_row()
    return rows


def block_weight_bytes(shape: dict, dtype: str) -> int:
    """P: the bytes of a Llama's decoder layers (q, k, v, o with as many key/value heads
    as heads, gate, up and down, two RMSNorm weights), the weights that stream."""
    hidden, intermediate = shape["hidden"], shape["intermediate"]
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return shape["layers"] * per_layer * (2 if dtype in ("bfloat16", "float16") else 4)


def expected_weight_bytes(spec: dict) -> int | None:
    """Host->device weight bytes of one step, before it runs: 2 P (each block loaded for
    the forward and for the backward, shared by the K sub-batches), K x 2 P for
    grad_accumulation, None for rows that stream nothing."""
    if gpu_bench.speedloader_options(spec["row"], spec["k"], "inductor") is None:
        return None
    if spec["device"].startswith("cpu"):
        return 0  # the host tier is the device's memory: nothing is copied
    passes = spec["k"] if spec["row"] == "grad_accumulation" else 1
    return passes * 2 * block_weight_bytes(spec["shape"], spec["dtype"])


def describe_bounds(rows: list[dict], bandwidth: dict | None) -> None:
    """gpu_bench.add_bounds, then per row what bounds it and the tokens/s share of
    resident Inductor the bound allows; beside them the weight bytes expected before the
    run (and their time over the link) against those measured."""
    link = None if bandwidth is None else min(bandwidth["host_to_device_bytes_per_second"],
                                              bandwidth["device_to_host_bytes_per_second"])
    for row in rows:
        expected = expected_weight_bytes(row["spec"]) if "shape" in row["spec"] else None
        if expected is None:
            continue
        row["expected_weight_bytes_per_step"] = expected
        if link:
            row["expected_weight_seconds_at_bandwidth"] = expected / link
        if "bytes_moved_per_step" in row:
            loaded = sum(n for key, n in row["bytes_moved_per_step"].items() if key.startswith("weight/")
                         and key.endswith("/device"))
            row["weight_bytes_per_step"] = loaded
            # A prefetch still in flight when a step's window closes lands in the next
            # window: a step can show a block more or less than this.
            row["weight_bytes_minus_expected"] = loaded - expected
    for name in ("compute", "io_bound"):
        measured = [r for r in rows if "step_seconds" in r and regime(r) == name]
        if bandwidth is not None and measured:
            gpu_bench.add_bounds(measured, bandwidth)  # against the resident row of the same shape
    for row in rows:
        if "bound_seconds" not in row:
            continue
        resident = find(rows, "resident_inductor", 1, regime(row))
        compute = resident["step_seconds"]
        row["bound_is"] = "link" if row["transfer_seconds_at_bandwidth"] > compute else "compute"
        row["bound_percent_of_resident"] = 100.0 * compute / row["bound_seconds"]
        if resident.get("peak_bytes") and row.get("peak_bytes") is not None:
            row["peak_fraction_of_resident"] = row["peak_bytes"] / resident["peak_bytes"]


def bound_ratio(row: dict) -> float | None:
    """The share of resident tokens/s the row's bound allows (None without a bound)."""
    percent = row.get("bound_percent_of_resident")
    return None if percent is None else percent / 100


def find(rows: list[dict], name: str, k: int, in_regime: str = "compute") -> dict | None:
    return next((r for r in rows if r["spec"]["row"] == name and r["spec"]["k"] == k and regime(r) == in_regime),
                None)


def measured(row: dict | None) -> bool:
    return row is not None and "step_seconds" in row


def goal(name: str, text: str, status: str, **figures) -> dict:
    return {"goal": name, "text": text, "status": status, **figures}


def why_not(row: dict | None, name: str) -> str:
    if row is None:
        return f"{name} not in this run"
    return f"{name}: " + (row.get("error") or row.get("skipped") or row.get("unavailable") or "no figures")


def evaluate_goals(rows: list[dict], ks: list[int]) -> list[dict]:
    """Every goal, met / missed / not measured / not applicable, with its figures."""
    goals = []
    resident = find(rows, "resident_inductor", 1)
    if not measured(resident):
        text = why_not(resident, "resident_inductor")
        return [goal(name, "every goal is a ratio to resident Inductor", "not measured", reason=text)
                for name in ("weights_host_throughput", "activations_host_memory_and_throughput", "compile_time",
                             "speedloader_over_grad_accumulation")]

    for k in ks:
        row = find(rows, "weights_host", k)
        text = f"weights on pinned host, K={k}: tokens/s >= {GOAL_WEIGHTS_HOST:.0%} of resident Inductor"
        if not measured(row):
            goals.append(goal("weights_host_throughput", text, "not measured", k=k,
                              reason=why_not(row, "weights_host")))
            continue
        ratio = row["tokens_per_second"] / resident["tokens_per_second"]
        goals.append(goal("weights_host_throughput", text, "met" if ratio >= GOAL_WEIGHTS_HOST else "missed", k=k,
                          ratio=ratio, target=GOAL_WEIGHTS_HOST, bound_ratio=bound_ratio(row),
                          bound_is=row.get("bound_is"), over_bound=row.get("over_bound")))

    candidates = [r for r in rows if r["spec"]["row"] in ("weights_activations_host_recompute",
                                                          "weights_activations_host")
                  and measured(r) and regime(r) == "compute"]
    text = (f"weights and activations on host with peak <= {GOAL_ACTIVATIONS_PEAK:.0%} of resident Inductor's: "
            f"tokens/s >= {GOAL_ACTIVATIONS_SPEED:.0%} of resident Inductor")
    if not candidates or not resident.get("peak_bytes"):
        goals.append(goal("activations_host_memory_and_throughput", text, "not measured",
                          reason="no weights+activations row measured" if not candidates else "no peak (CPU run)"))
    else:
        figures = []
        for r in candidates:
            peak = r["peak_bytes"] / resident["peak_bytes"]
            speed = r["tokens_per_second"] / resident["tokens_per_second"]
            figures.append({"row": r["spec"]["row"], "k": r["spec"]["k"], "peak_fraction": peak, "ratio": speed,
                            "bound_ratio": bound_ratio(r),
                            "bound_is": r.get("bound_is"),
                            "met": peak <= GOAL_ACTIVATIONS_PEAK and speed >= GOAL_ACTIVATIONS_SPEED})
        goals.append(goal("activations_host_memory_and_throughput", text,
                          "met" if any(f["met"] for f in figures) else "missed", rows=figures,
                          target={"peak_fraction": GOAL_ACTIVATIONS_PEAK, "ratio": GOAL_ACTIVATIONS_SPEED}))

    for k in [k for k in ks if k in (4, 8)] or ks:
        row = find(rows, "weights_host", k)
        text = f"compile (first step) of speedloader K={k}, weights on host: <= {GOAL_COMPILE}x plain Inductor's"
        if not measured(row):
            goals.append(goal("compile_time", text, "not measured", k=k, reason=why_not(row, "weights_host")))
            continue
        ratio = row["first_step_seconds"] / resident["first_step_seconds"]
        goals.append(goal("compile_time", text, "met" if ratio <= GOAL_COMPILE else "missed", k=k, ratio=ratio,
                          target=GOAL_COMPILE, seconds=row["first_step_seconds"],
                          inductor_seconds=resident["first_step_seconds"]))

    goals += [grad_accumulation_goal(rows, max(ks), name) for name in ("io_bound", "compute")]
    return goals


def grad_accumulation_goal(rows: list[dict], k: int, in_regime: str) -> dict:
    """Speedloader against grad_accumulation at K in one regime's shape."""
    fast, slow = find(rows, "weights_host", k, in_regime), find(rows, "grad_accumulation", k, in_regime)
    text = (f"speedloader K={k} tokens/s >= {GOAL_GRAD_ACC} x {k} grad_accumulation's (weights on host), "
            f"where the link bounds the step ({in_regime} shape)")
    if not (measured(fast) and measured(slow)):
        return goal("speedloader_over_grad_accumulation", text, "not measured", k=k, regime=in_regime,
                    reason="; ".join(why_not(r, n) for r, n in ((fast, "weights_host"), (slow, "grad_accumulation"))
                                     if not measured(r)))
    speedup = slow["step_seconds"] / fast["step_seconds"]
    expected = (slow["bound_seconds"] / fast["bound_seconds"]) if "bound_seconds" in fast else None
    # The ratio reaches K only when both steps are link-bound: grad_accumulation moves K
    # times the weights of speedloader's step.
    applicable = fast.get("bound_is") == "link"
    status = ("met" if speedup >= GOAL_GRAD_ACC * k else "missed") if applicable else "not applicable"
    return goal("speedloader_over_grad_accumulation", text, status, k=k, regime=in_regime, ratio=speedup,
                target=GOAL_GRAD_ACC * k, bound_ratio=expected, speedloader_bound_is=fast.get("bound_is"),
                grad_accumulation_bound_is=slow.get("bound_is"),
                **({} if applicable else {"reason": "compute bounds speedloader's step: the link does not"}))


def measure_profile(args, record: dict, clock: Clock) -> str | None:
    """Measures this machine's `MachineProfile` (`slcompile.profile.measure_profile`:
    rates, and the host cost of each kind of op from small compiled steps) in a child
    process within ``--profile-budget-s``; records it in ``record["profile"]`` and
    returns the path of its JSON, or None when it failed or ran out of time. The CPU
    smoke run measures the rates alone."""
    path = os.path.join(tempfile.mkdtemp(prefix="slc-gpu-check-profile-"), "profile.json")
    steps = not args.cpu_smoke
    code = ("import sys; from slcompile.profile import measure_profile; "
            f"open(sys.argv[1], 'w').write(measure_profile(steps={steps}, nvme={steps}, generation=False).to_json())")
    budget = min(args.profile_budget_s, clock.left())
    with tempfile.TemporaryFile("w+") as err:
        status, seconds, timed_out = run_limited([sys.executable, "-c", code, path], budget, env=dict(os.environ),
                                                 stdout=subprocess.DEVNULL, stderr=err)
        err.seek(0)
        tail = err.read()[-2000:]
    if status != 0 or not os.path.exists(path):
        record["profile"] = {"status": "timed out" if timed_out else "error", "seconds": seconds, "stderr": tail}
        log(f"machine profile: {record['profile']['status']} after {seconds:.0f} s")
        return None
    with open(path) as f:
        record["profile"] = {"status": "measured", "seconds": seconds, "profile": json.load(f)}
    log(f"machine profile measured in {seconds:.0f} s")
    return path


WHEELS_HINT = ("on a machine where the package is not installed, build and carry wheels of it and of what "
               "the image lacks (bench/README.md, \"CUDA validation in one command\")")


def preflight() -> str | None:
    """Why no speedloader row can run in this interpreter (the package does not
    import, or `torch.compile` does not know the backend by name: the package is
    not installed, so its entry point is not either), or None. Checked before the
    first row, so that a machine lent for minutes does not spend them on rows that
    fail the same way."""
    import torch

    try:
        import slcompile  # noqa: F401

        torch._dynamo.lookup_backend("speedloader")
    except Exception as error:  # any reason is the answer
        return f"{type(error).__name__}: {error}; {WHEELS_HINT}"
    return None


def environment(device) -> dict:
    import torch

    record = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)",
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record["device_memory_bytes"] = props.total_memory
        record["multiprocessors"] = props.multi_processor_count
    try:
        import transformers

        record["transformers"] = transformers.__version__
    except ImportError:
        record["transformers"] = None
    try:
        record["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                          timeout=10).stdout.strip() or None
        # A copy of a working tree may carry a git HEAD older than its files.
        record["tracked_files_changed"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True,
            timeout=10).stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        record["commit"] = None
    return record


def write_json(record: dict, out: str) -> None:
    """The record so far (after every step, so that a run killed from outside still
    leaves what it measured)."""
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)


def write(record: dict, out: str) -> None:
    path = os.path.join(out, "gpu_check.json")
    write_json(record, out)
    if any("step_seconds" in r for r in record["rows"]):
        try:
            shown = [{**r, "spec": {**r["spec"], "row": r["spec"]["row"] + (
                f" ({r['spec']['shape']['batch']}x{r['spec']['shape']['seq']})" if regime(r) != "compute" else "")}}
                for r in record["rows"] if "step_seconds" in r]
            gpu_bench.plot({**record, "rows": shown}, os.path.join(out, "gpu_check.png"))
        except Exception as error:  # the JSON is what matters
            record["plot_error"] = f"{type(error).__name__}: {error}"
            with open(path, "w") as f:
                json.dump(record, f, indent=1, default=str)


def print_goals(record: dict) -> None:
    for g in record["goals"]:
        figures = ", ".join(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}"
                            for key, value in g.items()
                            if key in ("k", "regime", "ratio", "target", "bound_ratio", "bound_is", "reason"))
        print(f"{g['status']:>14}  {g['goal']}: {figures}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench gpu --check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)  # as `python -m bench gpu --check`
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks the command works")
    parser.add_argument("--out", default=None, help="folder for the files (default $OUT when set, else "
                                                    "bench/results/gpu_check; a temp dir for --cpu-smoke)")
    parser.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole command "
                                                                     "(default 540; 150 for --cpu-smoke)")
    parser.add_argument("--tests-budget-s", type=float, default=None, help="of which the tests (default 170; "
                                                                           "60 for --cpu-smoke)")
    parser.add_argument("--test-timeout-s", type=float, default=120, help="one test's limit (with pytest-timeout)")
    parser.add_argument("--profile-budget-s", type=float, default=90,
                        help="the machine profile's limit (the time model's rates for each row's prediction)")
    parser.add_argument("--row-budget-s", type=float, default=None, help="one bench row's limit (default 150)")
    parser.add_argument("--min-row-s", type=float, default=None, help="a row starts only with this much left "
                                                                      "(default 40; 5 for --cpu-smoke)")
    parser.add_argument("--ks", default=None, help="comma-separated K (default 4,8; 2 for --cpu-smoke)")
    parser.add_argument("--model", default=None, choices=sorted(gpu_bench.MODELS),
                        help="gpu_bench model (default small; cpu_smoke for --cpu-smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per row (default 5; 1 for --cpu-smoke)")
    parser.add_argument("--only", default=None, help="comma-separated row names (default: every row of row_order())")
    parser.add_argument("--skip-tests", action="store_true", help="leave out step 1")
    parser.add_argument("--pytest-k", default=None, help="a -k expression narrowing the tests")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.budget_s = args.budget_s or (150 if smoke else 540)
    args.tests_budget_s = args.tests_budget_s or (60 if smoke else 170)
    args.row_budget_s = args.row_budget_s or 150
    args.min_row_s = args.min_row_s if args.min_row_s is not None else (5 if smoke else 40)
    args.ks = [int(k) for k in (args.ks or ("2" if smoke else "4,8")).split(",")]
    args.model = args.model or ("cpu_smoke" if smoke else "small")
    args.repeats = args.repeats or (1 if smoke else 5)
    rows = row_order(args.ks)
    if smoke and not args.only:
        rows = [r for r in rows if r["row"] in ("resident_inductor", "weights_host") and "regime" not in r]
    if args.only:
        wanted = set(args.only.split(","))
        rows = [r for r in rows if r["row"] in wanted]
    args.rows = rows
    if args.out is None:
        args.out = (tempfile.mkdtemp(prefix="slc-gpu-check-") if smoke
                    else os.environ.get("OUT") or os.path.join(HERE, "results", "gpu_check"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    clock = Clock(args.budget_s, reserve_s=10)
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, cuda build {torch.version.cuda}); run it "
              "on a CUDA machine, or pass --cpu-smoke to check the command on the CPU", file=sys.stderr)
        return 2
    problem = preflight()
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", torch.cuda.current_device())
    os.makedirs(args.out, exist_ok=True)
    record = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "gpu_check",
                             *(argv if argv is not None else sys.argv[1:])]),
        "smoke": args.cpu_smoke,
        **environment(device),
        "budget_seconds": args.budget_s,
        "model": f"HF Llama {args.model}: " + ", ".join(f"{k} {v}" for k, v in gpu_bench.MODELS[args.model].items()),
        "goals_text": {
            "weights_host_throughput": f">= {GOAL_WEIGHTS_HOST:.0%} of resident Inductor tokens/s",
            "activations_host_memory_and_throughput": f"peak <= {GOAL_ACTIVATIONS_PEAK:.0%} and tokens/s >= "
                                                      f"{GOAL_ACTIVATIONS_SPEED:.0%} of resident Inductor",
            "compile_time": f"first step <= {GOAL_COMPILE}x plain Inductor's at K = 4 and 8",
            "speedloader_over_grad_accumulation": f">= {GOAL_GRAD_ACC} x K grad_accumulation's tokens/s where "
                                                  "the link bounds the step",
            "bound": "max(resident Inductor step, host<->device bytes per step / the slower pinned copy "
                     "direction's bandwidth); bound_ratio = resident step / bound: the share of resident "
                     "tokens/s the link allows (1.0 when compute bounds the row)",
        },
    }
    # 1. tests
    if args.skip_tests:
        record["tests"] = {"status": "skipped", "reason": "--skip-tests"}
    else:
        try:
            record["tests"] = run_tests(args, args.out, clock, "cpu" if args.cpu_smoke else "cuda")
        except Exception as error:  # recorded; the rows still run
            record["tests"] = {"status": "error", "error": f"{type(error).__name__}: {error}"}
    write_json({**record, "status": "running: tests done"}, args.out)
    # 2. bandwidth
    try:
        record["bandwidth"] = gpu_bench.copy_bandwidth(device, (16 << 20) if args.cpu_smoke else (1 << 30))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log("pinned copy GB/s: host->device {:.1f}, device->host {:.1f}".format(
            record["bandwidth"]["host_to_device_bytes_per_second"] / 1e9,
            record["bandwidth"]["device_to_host_bytes_per_second"] / 1e9))
    except Exception as error:
        record["bandwidth"] = None
        record["bandwidth_error"] = f"{type(error).__name__}: {error}"
    # 2b. this machine's profile, for the time model's prediction of each row
    profile_path = measure_profile(args, record, clock)
    write_json({**record, "status": "running: profile done"}, args.out)
    # 3. rows
    base = {
        **({"profile_path": profile_path} if profile_path else {}),
        "device": str(device), "dtype": "float32" if args.cpu_smoke else "bfloat16",
        "shape": gpu_bench.MODELS[args.model], "repeats": args.repeats, "warmup": 1,
        "lowering": "aot_eager" if args.cpu_smoke else "inductor",
        **({"resident_backend": "aot_eager"} if args.cpu_smoke else {}),
    }
    record["rows"] = []
    run_rows(args, base, clock, record["rows"],
             after_row=lambda: write_json({**record, "status": "running: rows"}, args.out))
    # 4. bounds and goals
    try:
        describe_bounds(record["rows"], record["bandwidth"])
        record["goals"] = evaluate_goals(record["rows"], args.ks)
    except Exception as error:
        record["goals"] = []
        record["goals_error"] = f"{type(error).__name__}: {error}"
    tests_ok = record["tests"].get("status") in ("passed", "skipped")
    rows_ok = all("step_seconds" in r or "unavailable" in r for r in record["rows"])
    record["status"] = {"tests": record["tests"].get("status"), "rows_ran": rows_ok,
                        "goals": {s: sum(g["status"] == s for g in record["goals"])
                                  for s in ("met", "missed", "not measured", "not applicable")}}
    record["seconds"] = clock.elapsed()
    write(record, args.out)
    print_goals(record)
    print(f"gpu_check: tests {record['status']['tests']}, rows {'all ran' if rows_ok else 'not all ran'}, "
          f"{record['seconds']:.0f} s; wrote {args.out}/gpu_check.json", flush=True)
    return 0 if tests_ok and rows_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
