"""Failing nvme writes on purpose, whichever way the arena writes: on its I/O threads
(`os.pwritev`) or through Linux's native AIO (`AioQueue.submit`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from slcompile.runtime.nvme_aio import IOCB_CMD_PWRITE, AioQueue


def _report(on_complete, error: int, before: Callable[[], None] | None, result: int, end: float) -> None:
    if before is not None:
        before()
    on_complete(-error, end)


def fail_writes(monkeypatch, failure: Callable[[int], int | None], before: Callable[[], None] | None = None):
    """Makes each nvme write fail as `failure(file offset)` says (an errno; None: it
    writes), `failure` called once per write in issue order; `before()` runs on the
    thread that reports a failure, just before it does."""
    real_pwritev = os.pwritev

    def pwritev(fd, buffers, offset):
        error = failure(offset)
        if error is not None:
            if before is not None:
                before()
            raise OSError(error, os.strerror(error))
        return real_pwritev(fd, buffers, offset)

    real_submit = AioQueue.submit

    def submit(self, requests):
        changed = []
        for fd, opcode, address, nbytes, offset, on_complete in requests:
            error = failure(offset) if opcode == IOCB_CMD_PWRITE else None
            if error is not None:
                on_complete = functools.partial(_report, on_complete, error, before)
            changed.append((fd, opcode, address, nbytes, offset, on_complete))
        real_submit(self, changed)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(AioQueue, "submit", submit)
