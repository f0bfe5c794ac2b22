"""A run of `python -c CODE` or `python -m MODULE ARGS` as a fresh interpreter does it,
forked from a server that has imported torch and transformers already
(multiprocessing's forkserver, `PRELOAD`), so that each run does not import them
again. Nothing else of the server is shared: the run's own imports (slcompile among
them) happen in the child, with the environment, working directory, `sys.path` and
`sys.argv` a fresh interpreter started so would have."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

__all__ = ["Completed", "run_code", "run_module"]

PRELOAD = ("torch", "torch._dynamo", "transformers", "transformers.modeling_utils")


@dataclasses.dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


def run_code(code: str, cwd, env: dict[str, str], timeout: float, args: list[str] = ()) -> Completed:
    """`python -c code *args` in `cwd` with the environment `env`."""
    return _run(("code", code), ["-c", *args], cwd, env, timeout)


def run_module(module: str, args: list[str], cwd, env: dict[str, str], timeout: float) -> Completed:
    """`python -m module *args` in `cwd` with the environment `env`."""
    return _run(("module", module), [module, *args], cwd, env, timeout)


@functools.cache
def _fresh_path(env_items: tuple) -> tuple[str, ...]:
    """`sys.path` of an interpreter started with `env`, but its first entry (the
    working directory for -c and -m)."""
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         env=dict(env_items), capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


def _run(what, argv, cwd, env, timeout) -> Completed:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    path = ["", *_fresh_path(tuple(sorted(env.items())))]
    with tempfile.TemporaryDirectory(prefix="slc-fresh-") as scratch:
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        child = context.Process(target=_child, args=(what, argv, os.fspath(cwd), dict(env), path, out, err))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        with open(out) as stdout, open(err) as stderr:
            return Completed(child.exitcode, stdout.read(), stderr.read())


def _child(what, argv, cwd, env, path, out, err) -> None:
    for fd, name in ((1, out), (2, err)):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    sys.argv = list(argv)
    kind, value = what
    status = 0
    try:
        if kind == "code":
            exec(compile(value, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            runpy.run_module(value, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # what the interpreter runs at exit (finalizers that remove files among them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
