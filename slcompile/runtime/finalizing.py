"""What runs when an object dies (a ``weakref.finalize`` callback, a ``__del__``),
run where it cannot wait forever.

A garbage collection starts at an allocation, on whichever thread makes it, and
finalizes what it frees right there. That thread may be inside a critical section
of this package (allocating from the nvme arena, counting on the recorder, filing
a token's transfer). A finalizer that takes the same lock then waits on its own
thread forever; one that takes another may wait on a thread that waits on it.

``when_safe(fn, *args)`` calls ``fn(*args)`` at once, unless the calling thread is
collecting garbage: then one daemon thread of the process, which holds nothing,
calls it soon after. An object that dies with its last reference (a transfer token
when the backward drops what it saved, a loaded tensor when its user drops it) is
finalized at once, as before; one in a reference cycle, by that thread.

``settle()`` waits until what was handed to the thread has run, and
``collect_garbage()`` is ``gc.collect()`` followed by it: where ``gc.collect()``
returned with an engine's files or a stored copy still to go, ``collect_garbage()``
returns once they are gone. What is left at exit runs on the exiting thread.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["collect_garbage", "settle", "when_safe"]

log = logging.getLogger(__name__)

# The thread collecting garbage now (collections never overlap), else None.
_collecting: int | None = None
# What a collection's finalizers handed over, and how many of them have run.
_later: queue.SimpleQueue = queue.SimpleQueue()  # `put` may run inside another `put`
_handed = 0
_done = 0
_ran = threading.Condition()


def when_safe(fn: Callable[..., object], *args) -> None:
    """Calls ``fn(*args)`` now, or, inside a garbage collection, on the
    finalizing thread as soon as it can."""
    global _handed
    if _collecting != threading.get_ident():
        fn(*args)
        return
    _handed += 1  # only the collecting thread counts, one collection at a time
    _later.put((fn, args))


def settle(timeout: float | None = None) -> bool:
    """Waits until what garbage collections handed over so far has run; False if
    ``timeout`` seconds passed first."""
    with _ran:
        wanted = _handed
        return _ran.wait_for(lambda: _done >= wanted, timeout)


def collect_garbage() -> int:
    """``gc.collect()``, then what its finalizers handed over has run; returns what
    ``gc.collect()`` found unreachable."""
    found = gc.collect()
    settle()
    return found


def _on_collection(phase: str, info: dict) -> None:
    global _collecting
    _collecting = threading.get_ident() if phase == "start" else None


def _call(fn, args) -> None:
    global _done
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - nobody waits on a finalizer to raise to
        log.exception("finalizer %r failed", fn)
    with _ran:
        _done += 1
        _ran.notify_all()


def _finalize_later() -> None:
    while True:
        fn, args = _later.get()
        _call(fn, args)
        del fn, args  # what it held must not live until the next one


def _start() -> None:
    threading.Thread(target=_finalize_later, name="slc-finalize", daemon=True).start()


def _start_in_child() -> None:
    # A forked child has no copy of the thread, nor of a collection in progress; what
    # the parent's collections handed over is the parent's to run.
    global _collecting, _later, _handed, _done, _ran
    _collecting, _later, _handed, _done, _ran = None, queue.SimpleQueue(), 0, 0, threading.Condition()
    _start()


def _finish_at_exit() -> None:
    while True:
        try:
            fn, args = _later.get_nowait()
        except queue.Empty:
            return
        _call(fn, args)


gc.callbacks.append(_on_collection)
_start()
os.register_at_fork(after_in_child=_start_in_child)
atexit.register(_finish_at_exit)
