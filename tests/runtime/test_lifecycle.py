"""The private offload directory is gone after a normal exit, and a directory left by a
killed process is removed by the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from slcompile.runtime import TransferEngine
    engine = TransferEngine(offload_dir=sys.argv[1])
    engine.wait(engine.store("w", torch.ones(1000), "nvme", "weight"))
    print(engine.arena.path, flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
    """
)


def run_child(offload_dir, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(offload_dir), mode],
        stdout=subprocess.PIPE, text=True, env=env,
    )


def test_private_dir_removed_at_normal_exit(tmp_path):
    child = run_child(tmp_path, "exit")
    path = child.stdout.readline().strip()
    assert child.wait(timeout=120) == 0
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_dir_of_a_killed_process_is_cleaned_by_the_next_start(tmp_path):
    killed = run_child(tmp_path, "hang")
    stale = killed.stdout.readline().strip()
    assert os.path.isdir(stale)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert os.path.isdir(stale)  # nothing ran at exit

    # A foreign directory with a similar name and a live pid is left alone.
    alive = tmp_path / f"slc-offload-{os.getpid()}-0badcafe"
    alive.mkdir()

    next_start = run_child(tmp_path, "exit")
    fresh = next_start.stdout.readline().strip()
    assert next_start.wait(timeout=120) == 0
    assert not os.path.exists(stale)
    assert not os.path.exists(fresh)
    assert os.listdir(tmp_path) == [alive.name]
