"""The private offload directory is gone after a normal exit and after SIGTERM, a
directory left by a killed process is removed by the next start, and a live arena is
kept whatever its pid looks like from here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from slcompile.runtime import TransferEngine
    if sys.argv[2] == "handler":  # the program's own SIGTERM handler, for a graceful stop
        stopping = []
        signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    engine = TransferEngine(offload_dir=sys.argv[1])
    engine.wait(engine.store("w", torch.ones(1000), "nvme", "weight"))
    print(engine.arena.path, flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
    elif sys.argv[2] == "handler":
        while not stopping:
            time.sleep(0.01)
        engine.wait(engine.load("w"))  # the arena still works while the program stops
        print(os.path.isdir(engine.arena.path), flush=True)
    elif sys.argv[2] == "fork":
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a forked child exits normally: its exit handlers run
        os.waitpid(child, 0)
        print(os.path.isdir(engine.arena.path), flush=True)
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


def test_a_live_arena_is_kept_when_its_pid_looks_dead_from_here(tmp_path, monkeypatch):
    """A process in another pid namespace (a container) or on another host sharing the
    directory: its pid means nothing here. Its lock says it is alive."""
    from slcompile.runtime import NvmeArena

    live = run_child(tmp_path, "hang")
    try:
        path = live.stdout.readline().strip()
        kill = os.kill

        def elsewhere(pid, sig):
            if pid == live.pid:
                raise ProcessLookupError(pid)  # what os.kill says of a pid in another namespace
            return kill(pid, sig)

        monkeypatch.setattr(os, "kill", elsewhere)
        arena = NvmeArena(str(tmp_path))
        monkeypatch.undo()
        assert sorted(os.listdir(path)) == ["arena.bin", "lock"]
        assert live.poll() is None
        arena.close()
    finally:
        live.kill()
        live.wait(timeout=60)


def test_sigterm_removes_the_private_dir_and_still_terminates(tmp_path):
    child = run_child(tmp_path, "hang")
    path = child.stdout.readline().strip()
    assert os.path.isdir(path)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM  # dies by the signal, as by default
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_a_forked_child_leaves_its_parents_dir_when_it_exits(tmp_path):
    child = run_child(tmp_path, "fork")
    path = child.stdout.readline().strip()
    assert child.stdout.readline().strip() == "True"  # still there after the fork's exit
    assert child.wait(timeout=120) == 0
    assert not os.path.exists(path)  # removed by its maker


def test_a_programs_own_sigterm_handler_stays_in_charge_and_exit_removes_the_dir(tmp_path):
    child = run_child(tmp_path, "handler")
    path = child.stdout.readline().strip()
    child.send_signal(signal.SIGTERM)
    assert child.stdout.readline().strip() == "True"  # kept while the program's handler stops it
    assert child.wait(timeout=120) == 0
    assert not os.path.exists(path)


def _in_new_pid_namespace(offload_dir) -> subprocess.Popen | None:
    """A run holding an arena in `offload_dir` from a pid namespace of its own (as in
    another container), its pid pushed past a few hundred there so that the number
    in its directory's name means another process, or none, here; None when this
    machine does not allow a new pid namespace (not root, or no user namespaces)."""
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "-p", "-f", "--mount-proc", "true"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        return None
    script = f"for i in $(seq 300); do /bin/true; done; {sys.executable} -c \"$SLC_CHILD\" \"$1\" hang & wait"
    env = dict(os.environ, PYTHONPATH=ROOT, SLC_CHILD=CHILD)
    return subprocess.Popen(
        [unshare, "-p", "-f", "--mount-proc", "--kill-child", "bash", "-c", script, "bash", str(offload_dir)],
        stdout=subprocess.PIPE, text=True, env=env,
    )


def test_a_live_arena_in_another_pid_namespace_is_kept_by_a_run_started_here(tmp_path):
    import pytest

    other = _in_new_pid_namespace(tmp_path)
    if other is None:
        pytest.skip("unshare -p is not permitted here (needs root or user namespaces)")
    try:
        path = other.stdout.readline().strip()
        assert path.startswith(str(tmp_path)) and os.path.isdir(path)
        pid_there = int(os.path.basename(path).split("-")[2])
        assert pid_there > 300  # the number is that namespace's
        # A run started here cleans the directory up: the other run's lock keeps its arena.
        here = run_child(tmp_path, "exit")
        fresh = here.stdout.readline().strip()
        assert here.wait(timeout=120) == 0
        assert not os.path.exists(fresh)
        assert sorted(os.listdir(path)) == ["arena.bin", "lock"]
        assert other.poll() is None
    finally:
        other.kill()  # --kill-child: the namespace's init, and with it the namespace, goes too
        other.wait(timeout=60)
