"""What the time-model benches share: the model flags, timing plans round-robin, a
row's prediction fields, and the rank correlation of predictions against measurements."""

from __future__ import annotations

import time


def add_model_arguments(parser, *, rounds: int, batch: int) -> None:
    """--rounds, --threads and the package GPT's shape (--d-model, --seq-len, --layers, --batch)."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads (default 1: leaves a core to the I/O threads on 2 cores)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=batch)


def time_round_robin(steps, rounds: int, warm: int = 0) -> tuple[list[list[float]], list[list[float]]]:
    """Each step's wall and compute-thread CPU seconds over `rounds` rounds, one timed
    call of every step a round, so that a burst of load from another process falls on
    all of them alike. With `warm`, each timed call follows that many untimed calls
    of the same step: a step as a training loop runs it, after one of its own (its
    weights and buffers in the caches), not after another model's."""
    from tqdm import tqdm

    times: list[list[float]] = [[] for _ in steps]
    cpu: list[list[float]] = [[] for _ in steps]
    for _ in tqdm(range(rounds), desc="rounds"):
        for i, step in enumerate(steps):
            for _ in range(warm):
                step()
            start, thread_start = time.perf_counter(), time.thread_time()
            step()
            times[i].append(time.perf_counter() - start)
            cpu[i].append(time.thread_time() - thread_start)
    return times, cpu


def prediction_fields(prediction, best: float, median: float) -> dict:
    """A row's predicted figures (`TimePrediction`) and their error against the
    fastest and the median measured step."""
    return {
        "predicted_step_seconds": prediction.step_seconds,
        "error": (prediction.step_seconds - best) / best,
        "error_vs_median": (prediction.step_seconds - median) / median,
        "predicted_compute_seconds": prediction.compute_seconds,
        "predicted_stall_seconds": prediction.stall_seconds,
        "predicted_lane_seconds": prediction.lane_seconds(),
        "predicted_lane_bytes": prediction.lane_bytes(),
        "predicted_bound": prediction.bound,
        "predicted_gflop": prediction.flops / 1e9,
    }


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (no ties expected)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0] * len(values)
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))
